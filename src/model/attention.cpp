// Attention (spec §3): the common Q/KV path, the window ring, the compressors, the
// lightning indexer and the grouped low-rank output, for every row of a step at once.
#include <cmath>
#include <vector>

#include "model/forward.h"

namespace dsv4 {

using backend::MatmulMode;
using backend::Tensor;

// §3.1: Q and KV paths, the entries this step completes (§3.3), the indexer's selection
// (§3.6), one joint softmax with the sink over window and compressed keys, the window ring
// update, de-rotation and the grouped output. The KV path and the compressors read only x:
// they run on a side lane beside the query path, and the ring's update beside the output
// path (backend.h's lanes; the same bits).
Result<Tensor> ForwardPass::attention(const LayerPlan& layer, const Tensor& x, const Step& step) const {
  const uint32_t b = layer.block;
  const BlockWeights& bw = w.blocks[b];
  const backend::StepRows& rows = step.rows;
  const int64_t n = rows.n, hd = c.head_dim, heads = c.n_heads;

  DSV4_TRY(side_lane(step));
  DSV4_ASSIGN_OR_RETURN(Tensor kv, f32({n, hd}));
  DSV4_TRY(be.matmul(bw.kv, x, kv, opt.matmul));
  backend::RowFinish kv_finish;  // RMSNorm, RoPE, the QAT rounding of the non-rotated dims
  kv_finish.group = hd;
  kv_finish.norm = true;
  kv_finish.norm_weight = &bw.kv_norm;
  kv_finish.eps = c.rms_eps;
  kv_finish.rope = &layer.rope;
  if (opt.qat) {
    kv_finish.round = backend::QatRounding::Fp8;
    kv_finish.round_cols = c.nope_dims();
    kv_finish.round_block = 64;
  }
  DSV4_TRY(be.finish_rows(kv, rows.positions, kv_finish));
  DSV4_TRY(note(b, "kv", kv));

  backend::AttentionKeys keys;
  keys.window = c.sliding_window;
  keys.ring = cache.ring(layer.ring);
  keys.chunk = kv;
  Tensor head_weights;
  if (layer.ratio) {
    // The layer's fp32 products of x (§3.3, §3.6): each compressor's values and scores and
    // the indexer's head weights, in one call.
    DSV4_ASSIGN_OR_RETURN(const CompressorInput kv_in, compressor_input(bw.compressor, n));
    std::vector<const Tensor*> ws{&bw.compressor.kv, &bw.compressor.gate}, ys{&kv_in.kv, &kv_in.score};
    CompressorInput key_in;
    if (layer.indexer) {
      DSV4_ASSIGN_OR_RETURN(key_in, compressor_input(bw.index_compressor, n));
      DSV4_ASSIGN_OR_RETURN(head_weights, f32({n, static_cast<int64_t>(c.index_heads)}));
      ws.insert(ws.end(), {&bw.index_compressor.kv, &bw.index_compressor.gate, &bw.index_proj});
      ys.insert(ys.end(), {&key_in.kv, &key_in.score, &head_weights});
    }
    DSV4_TRY(be.matmul_many(ws, x, ys, fp32_mode()));
    // Entries completed by this step join the cache before attention: entry e is visible
    // from position e*ratio + ratio - 1 on, including to that token itself.
    if (layer.indexer) {
      // §3.6's scale of the head weights, here beside the query path (lanes).
      DSV4_TRY(be.scale(head_weights, static_cast<float>(1.0 / std::sqrt(double(c.index_head_dim)) /
                                                         std::sqrt(double(c.index_heads)))));
      DSV4_TRY(compress(layer, bw.index_compressor, true, layer.key_state, layer.key_list, key_in, step));
    }
    DSV4_TRY(compress(layer, bw.compressor, false, layer.kv_state, layer.kv_list, kv_in, step));
    keys.ratio = layer.ratio;
    keys.entries = cache.list(layer.kv_list);
  }

  DSV4_TRY(be.main_lane());
  DSV4_ASSIGN_OR_RETURN(Tensor qr, f32({n, static_cast<int64_t>(c.q_lora_rank)}));
  DSV4_TRY(be.matmul(bw.q_a, x, qr, opt.matmul));
  DSV4_TRY(be.rms_norm(qr, &bw.q_a_norm, c.rms_eps, qr.cols(), qr));
  DSV4_ASSIGN_OR_RETURN(Tensor q, f32({n, heads * hd}));
  DSV4_TRY(be.matmul(bw.q_b, qr, q, opt.matmul));
  backend::RowFinish q_finish;  // per head: unweighted RMSNorm, RoPE
  q_finish.group = hd;
  q_finish.norm = true;
  q_finish.eps = c.rms_eps;
  q_finish.rope = &layer.rope;
  DSV4_TRY(be.finish_rows(q, rows.positions, q_finish));
  Tensor index_q;
  if (layer.indexer) {
    DSV4_ASSIGN_OR_RETURN(index_q, indexer_query(layer, qr, step));
  }
  DSV4_TRY(be.join_lane(1));

  if (layer.indexer) {
    DSV4_ASSIGN_OR_RETURN(keys.selected, i32({n, static_cast<int64_t>(c.index_topk)}));
    DSV4_TRY(indexer(layer, index_q, head_weights, step, keys.selected));
    DSV4_TRY(note(b, "index_topk", keys.selected));
  }
  DSV4_ASSIGN_OR_RETURN(Tensor o, f32({n, heads * hd}));
  DSV4_TRY(be.attention(q, keys, rows, bw.sinks, 1.0f / std::sqrt(static_cast<float>(hd)), o, opt.matmul));
  // The ring's update, after every row has read it: nothing reads it again before the next
  // step, so it runs beside the output path (joined by the MoE's join or the block's end).
  DSV4_TRY(side_lane(step));
  DSV4_TRY(be.store_window(kv, rows, keys.window, keys.ring));
  DSV4_TRY(be.main_lane());
  DSV4_TRY(be.rope(o, hd, rows.positions, layer.rope, true));  // §3.1.9 output de-rotation

  // §3.1.10: group g's heads (concatenated) through its wo_a rows, then wo_b.
  DSV4_ASSIGN_OR_RETURN(Tensor u, f32({n, static_cast<int64_t>(c.o_groups * c.o_lora_rank)}));
  DSV4_TRY(be.matmul_grouped(bw.out_a, o, u, c.o_groups, opt.matmul));
  DSV4_ASSIGN_OR_RETURN(Tensor out, f32({n, static_cast<int64_t>(c.hidden)}));
  DSV4_TRY(be.matmul(bw.out_b, u, out, opt.matmul));
  return out;
}

Result<ForwardPass::CompressorInput> ForwardPass::compressor_input(const CompressorWeights& cw, int64_t n) const {
  CompressorInput in;
  DSV4_ASSIGN_OR_RETURN(in.kv, f32({n, cw.kv.rows()}));
  DSV4_ASSIGN_OR_RETURN(in.score, f32({n, cw.gate.rows()}));
  return in;
}

// §3.3: C = x Wkv^T, Z = x Wgate^T (in.kv, in.score, fp32), pooled per completed block, then
// norm, RoPE at the block's first position, and the QAT rounding of the entry kind.
Status ForwardPass::compress(const LayerPlan& layer, const CompressorWeights& cw, bool indexer,
                             int32_t state, int32_t list, const CompressorInput& in, const Step& step) const {
  const uint32_t b = layer.block;
  const backend::StepRows& rows = step.rows;
  const int64_t n = rows.n, width = cw.norm.cols();
  const Tensor& kv = in.kv;
  const Tensor& score = in.score;
  // An entry: the pooled row, RMSNorm, RoPE at the block's first position, for the indexer's
  // keys the Hadamard rotation (in both modes), then the QAT rounding of its kind.
  backend::RowFinish finish;
  finish.group = width;
  finish.norm = true;
  finish.norm_weight = &cw.norm;
  finish.eps = c.rms_eps;
  finish.rope = &layer.rope;
  finish.hadamard = indexer;
  backend::RowFinish rounding;  // the rounding alone
  rounding.group = width;
  if (opt.qat) {
    rounding.round = indexer ? backend::QatRounding::Fp4 : backend::QatRounding::Fp8;
    rounding.round_cols = indexer ? 0 : c.nope_dims();
    rounding.round_block = indexer ? 32 : 64;
  }
  if (!trace) {
    finish.round = rounding.round;
    finish.round_cols = rounding.round_cols;
    finish.round_block = rounding.round_block;
    return be.compress_entries(kv, score, cw.ape, layer.ratio, layer.overlap, rows, cache.state_kv(state),
                               cache.state_score(state), finish, cache.list(list));
  }
  // Traced: Backend::compress_entries's steps one by one, for the entries before and after
  // the rounding.
  DSV4_ASSIGN_OR_RETURN(Tensor pooled, f32({n, width}));
  DSV4_TRY(be.fill(pooled, 0.0f));
  DSV4_TRY(be.compress(kv, score, cw.ape, layer.ratio, layer.overlap, rows, cache.state_kv(state),
                       cache.state_score(state), pooled));
  DSV4_ASSIGN_OR_RETURN(Tensor first_pos, i32({n}));
  DSV4_TRY(be.block_positions(rows, layer.ratio, first_pos));
  DSV4_TRY(be.finish_rows(pooled, first_pos, finish));
  DSV4_TRY(note_entries(b, indexer ? "indexer_kv_prequant" : "compressed_kv_prequant", pooled, layer.ratio, step));
  DSV4_TRY(be.finish_rows(pooled, first_pos, rounding));
  DSV4_TRY(note_entries(b, indexer ? "indexer_kv" : "compressed_kv", pooled, layer.ratio, step));
  return be.store_entries(pooled, layer.ratio, rows, cache.list(list));
}

// §3.6: the indexer's queries from qr (index_q_b, then per head RoPE, the Hadamard rotation
// and the QAT rounding).
Result<Tensor> ForwardPass::indexer_query(const LayerPlan& layer, const Tensor& qr, const Step& step) const {
  const BlockWeights& bw = w.blocks[layer.block];
  const int64_t n = step.rows.n, dk = c.index_head_dim;
  DSV4_ASSIGN_OR_RETURN(Tensor q, f32({n, static_cast<int64_t>(c.index_heads) * dk}));
  DSV4_TRY(be.matmul(bw.index_q_b, qr, q, opt.matmul));
  backend::RowFinish q_finish;
  q_finish.group = dk;
  q_finish.rope = &layer.rope;
  q_finish.hadamard = true;
  if (opt.qat) {
    q_finish.round = backend::QatRounding::Fp4;
    q_finish.round_block = 32;
  }
  DSV4_TRY(be.finish_rows(q, step.rows.positions, q_finish));
  return q;
}

// §3.6: scores of the queries q over each row's visible keys with the head weights (x
// Wproj^T in fp32, scaled by 1 / sqrt(dk * heads): given), and the top-k.
Status ForwardPass::indexer(const LayerPlan& layer, const Tensor& q, const Tensor& weights, const Step& step,
                            const Tensor& idx) const {
  const backend::StepRows& rows = step.rows;
  const int64_t n = rows.n;

  // Scores for as many keys as the furthest row sees; each row's own count is on the device.
  const int64_t max_visible = std::max<int64_t>(rows.max_end / layer.ratio, 1);
  DSV4_ASSIGN_OR_RETURN(Tensor scores, f32({n, max_visible}));
  DSV4_TRY(be.indexer_scores(q, weights, cache.list(layer.key_list), layer.ratio, rows, scores, opt.matmul));
  return be.top_k(scores, layer.ratio, rows, static_cast<int>(c.index_topk), idx);
}

}  // namespace dsv4
