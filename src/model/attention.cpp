// Attention (spec §3): the common Q/KV path, the window ring, the compressors, the
// lightning indexer and the grouped low-rank output, for every row of a step at once.
#include <cmath>

#include "model/forward.h"

namespace dsv4 {

using backend::MatmulMode;
using backend::Tensor;

// §3.1: Q and KV paths, the entries this step completes (§3.3), the indexer's selection
// (§3.6), one joint softmax with the sink over window and compressed keys, the window ring
// update, de-rotation and the grouped output.
Result<Tensor> ForwardPass::attention(const LayerPlan& layer, const Tensor& x, const Step& step) const {
  const uint32_t b = layer.block;
  const BlockWeights& bw = w.blocks[b];
  const backend::StepRows& rows = step.rows;
  const int64_t n = rows.n, hd = c.head_dim, heads = c.n_heads;

  DSV4_ASSIGN_OR_RETURN(Tensor qr, f32({n, static_cast<int64_t>(c.q_lora_rank)}));
  DSV4_TRY(be.matmul(bw.q_a, x, qr, opt.matmul));
  DSV4_TRY(be.rms_norm(qr, &bw.q_a_norm, c.rms_eps, qr.cols(), qr));
  DSV4_ASSIGN_OR_RETURN(Tensor q, f32({n, heads * hd}));
  DSV4_TRY(be.matmul(bw.q_b, qr, q, opt.matmul));
  DSV4_TRY(be.rms_norm(q, nullptr, c.rms_eps, hd, q));  // per-head, unweighted
  DSV4_TRY(be.rope(q, hd, rows.positions, layer.rope, false));

  DSV4_ASSIGN_OR_RETURN(Tensor kv, f32({n, hd}));
  DSV4_TRY(be.matmul(bw.kv, x, kv, opt.matmul));
  DSV4_TRY(be.rms_norm(kv, &bw.kv_norm, c.rms_eps, hd, kv));
  DSV4_TRY(be.rope(kv, hd, rows.positions, layer.rope, false));
  if (opt.qat) DSV4_TRY(be.round_fp8_blocks(kv, c.nope_dims(), 64));
  DSV4_TRY(note(b, "kv", kv));

  backend::AttentionKeys keys;
  keys.window = c.sliding_window;
  keys.ring = cache.ring(layer.ring);
  keys.chunk = kv;
  if (layer.ratio) {
    // Entries completed by this step join the cache before attention: entry e is visible
    // from position e*ratio + ratio - 1 on, including to that token itself.
    if (layer.indexer)
      DSV4_TRY(compress(layer, bw.index_compressor, true, layer.key_state, layer.key_list, x, step));
    DSV4_TRY(compress(layer, bw.compressor, false, layer.kv_state, layer.kv_list, x, step));
    keys.ratio = layer.ratio;
    keys.entries = cache.list(layer.kv_list);
    if (layer.indexer) {
      DSV4_ASSIGN_OR_RETURN(keys.selected, i32({n, static_cast<int64_t>(c.index_topk)}));
      DSV4_TRY(indexer(layer, x, qr, step, keys.selected));
      DSV4_TRY(note(b, "index_topk", keys.selected));
    }
  }
  DSV4_ASSIGN_OR_RETURN(Tensor o, f32({n, heads * hd}));
  DSV4_TRY(be.attention(q, keys, rows, bw.sinks, 1.0f / std::sqrt(static_cast<float>(hd)), o, opt.matmul));
  DSV4_TRY(be.store_window(kv, rows, keys.window, keys.ring));  // after every row has read the ring
  DSV4_TRY(be.rope(o, hd, rows.positions, layer.rope, true));   // §3.1.9 output de-rotation

  // §3.1.10: group g's heads (concatenated) through its wo_a rows, then wo_b.
  DSV4_ASSIGN_OR_RETURN(Tensor u, f32({n, static_cast<int64_t>(c.o_groups * c.o_lora_rank)}));
  DSV4_TRY(be.matmul_grouped(bw.out_a, o, u, c.o_groups, opt.matmul));
  DSV4_ASSIGN_OR_RETURN(Tensor out, f32({n, static_cast<int64_t>(c.hidden)}));
  DSV4_TRY(be.matmul(bw.out_b, u, out, opt.matmul));
  return out;
}

// §3.3: C = x Wkv^T, Z = x Wgate^T in fp32, pooled per completed block, then norm, RoPE at
// the block's first position, and the QAT rounding of the entry kind.
Status ForwardPass::compress(const LayerPlan& layer, const CompressorWeights& cw, bool indexer,
                             int32_t state, int32_t list, const Tensor& x, const Step& step) const {
  const uint32_t b = layer.block;
  const backend::StepRows& rows = step.rows;
  const int64_t n = rows.n, wide = cw.kv.rows(), width = cw.norm.cols();
  DSV4_ASSIGN_OR_RETURN(Tensor kv, f32({n, wide}));
  DSV4_ASSIGN_OR_RETURN(Tensor score, f32({n, wide}));
  DSV4_TRY(be.matmul(cw.kv, x, kv, fp32_mode()));
  DSV4_TRY(be.matmul(cw.gate, x, score, fp32_mode()));
  // One pooled row per step row; only the rows that close a block are written (and
  // stored), the others stay zero and are never read.
  DSV4_ASSIGN_OR_RETURN(Tensor pooled, f32({n, width}));
  DSV4_TRY(be.fill(pooled, 0.0f));
  DSV4_TRY(be.compress(kv, score, cw.ape, layer.ratio, layer.overlap, rows, cache.state_kv(state),
                       cache.state_score(state), pooled));
  DSV4_TRY(be.rms_norm(pooled, &cw.norm, c.rms_eps, width, pooled));
  DSV4_ASSIGN_OR_RETURN(Tensor first_pos, i32({n}));
  DSV4_TRY(be.block_positions(rows, layer.ratio, first_pos));
  DSV4_TRY(be.rope(pooled, width, first_pos, layer.rope, false));
  if (indexer) DSV4_TRY(be.hadamard(pooled, width));  // in both modes; QAT adds the FP4 rounding
  DSV4_TRY(note_entries(b, indexer ? "indexer_kv_prequant" : "compressed_kv_prequant", pooled, layer.ratio, step));
  if (opt.qat)
    DSV4_TRY(indexer ? be.round_fp4_blocks(pooled, 32) : be.round_fp8_blocks(pooled, c.nope_dims(), 64));
  DSV4_TRY(note_entries(b, indexer ? "indexer_kv" : "compressed_kv", pooled, layer.ratio, step));
  return be.store_entries(pooled, layer.ratio, rows, cache.list(list));
}

// §3.6: indexer queries (RoPE, Hadamard, FP4), head weights, scores over each row's visible
// keys, and the top-k.
Status ForwardPass::indexer(const LayerPlan& layer, const Tensor& x, const Tensor& qr, const Step& step,
                            const Tensor& idx) const {
  const BlockWeights& bw = w.blocks[layer.block];
  const backend::StepRows& rows = step.rows;
  const int64_t n = rows.n, heads = c.index_heads, dk = c.index_head_dim;
  DSV4_ASSIGN_OR_RETURN(Tensor q, f32({n, heads * dk}));
  DSV4_TRY(be.matmul(bw.index_q_b, qr, q, opt.matmul));
  DSV4_TRY(be.rope(q, dk, rows.positions, layer.rope, false));
  DSV4_TRY(be.hadamard(q, dk));
  if (opt.qat) DSV4_TRY(be.round_fp4_blocks(q, 32));
  DSV4_ASSIGN_OR_RETURN(Tensor weights, f32({n, heads}));
  DSV4_TRY(be.matmul(bw.index_proj, x, weights, fp32_mode()));
  DSV4_TRY(be.scale(weights, static_cast<float>(1.0 / std::sqrt(double(dk)) / std::sqrt(double(heads)))));

  // Scores for as many keys as the furthest row sees; each row's own count is on the device.
  const int64_t max_visible = std::max<int64_t>(rows.max_end / layer.ratio, 1);
  DSV4_ASSIGN_OR_RETURN(Tensor scores, f32({n, max_visible}));
  DSV4_TRY(be.indexer_scores(q, weights, cache.list(layer.key_list), layer.ratio, rows, scores, opt.matmul));
  return be.top_k(scores, layer.ratio, rows, static_cast<int>(c.index_topk), idx);
}

}  // namespace dsv4
