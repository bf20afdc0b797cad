// The DeepSeek-V4.1 block (shared/spec/deepseek-v41.md §3; DeepSeek's inference/model.py
// and engram.py are normative): Engram memory at block entry, the delayed hyper-connection
// mix, attention over shared KV / index sources with candidate-block pre-selection, and
// the V4 MoE. Pinned to shared/fixtures/tiny-v41 (tests/tools/test_fixture_v41*.cpp).
#include <cmath>

#include "model/forward.h"

namespace dsv4 {

using backend::MatmulMode;
using backend::Tensor;

Status ForwardPass::v41_begin(const Step& step, std::vector<std::vector<float>> engram_rows) const {
  const int64_t n = step.rows.n, hc = c.hc_mult;
  std::vector<float> one_hot(static_cast<size_t>(n * hc), 0.0f);
  for (int64_t r = 0; r < n; ++r) one_hot[r * hc] = 1.0f;  // block 0's attention: stream 0
  DSV4_ASSIGN_OR_RETURN(v41->pre, f32({n, hc}));
  DSV4_TRY(be.upload(v41->pre, one_hot.data(), one_hot.size() * sizeof(float)));
  v41->selection.assign(plan.layers.size(), Tensor{});
  for (const LayerPlan& l : plan.layers)
    if (l.indexer) {
      DSV4_ASSIGN_OR_RETURN(v41->selection[l.block], i32({n, static_cast<int64_t>(c.index_topk)}));
    }
  if (c.candidate) {
    DSV4_ASSIGN_OR_RETURN(v41->candidates, i32({n, static_cast<int64_t>(c.candidate->topk_blocks)}));
  }
  v41->engram_rows = std::move(engram_rows);
  return Status::ok();
}

// §3.2: the step's 24 rows per token through wkv (fp32), then the per-stream gate adds the
// value to each stream.
Status ForwardPass::engram(const LayerPlan& layer, const Tensor& streams, const Step& step) const {
  const BlockWeights& bw = w.blocks[layer.block];
  const std::vector<float>& rows = v41->engram_rows.at(static_cast<size_t>(layer.engram));
  const int64_t n = step.rows.n, in = bw.engram.kv.cols();
  if (static_cast<int64_t>(rows.size()) != n * in)
    return Status::errorf(StatusCode::kInternal, "engram: block {}: {} gathered values for {} rows of {}",
                          layer.block, rows.size(), n, in);
  DSV4_ASSIGN_OR_RETURN(Tensor e, f32({n, in}));
  DSV4_TRY(be.upload(e, rows.data(), rows.size() * sizeof(float)));
  DSV4_ASSIGN_OR_RETURN(Tensor kv, f32({n, bw.engram.kv.rows()}));
  DSV4_TRY(be.matmul(bw.engram.kv, e, kv, v41_exact()));
  DSV4_TRY(note(layer.block, "engram_kv", kv));
  DSV4_ASSIGN_OR_RETURN(Tensor gate, f32({n, static_cast<int64_t>(c.hc_mult)}));
  DSV4_TRY(be.engram_gate(streams, kv, bw.engram.q, bw.engram.k, static_cast<int>(c.hc_mult), c.rms_eps, gate));
  return note(layer.block, "engram_gate", gate);
}

// §3.5: each sublayer's mix is computed from the streams it sees, but its input is the
// collapse with the previous site's `pre`; this site's `pre` is carried to the next.
Status ForwardPass::block_v41(const LayerPlan& layer, const Tensor& streams, const Step& step) const {
  const uint32_t b = layer.block;
  const BlockWeights& bw = w.blocks[b];
  const int64_t d = c.hidden, n = step.rows.n, hc = c.hc_mult;
  struct Scope {
    backend::Backend& be;
    backend::Backend::ScratchMark mark;
    ~Scope() { be.scratch_release(mark); }
  } scope{be, be.scratch_mark()};

  if (layer.engram >= 0) DSV4_TRY(engram(layer, streams, step));
  if (v41->dspark_hidden.valid() && !layer.mtp) DSV4_TRY(dspark_target(layer, streams, step));

  const auto mix = [&](const HcSite& site, Tensor& pre, HcMix& m) -> Status {
    DSV4_ASSIGN_OR_RETURN(Tensor mixes, f32({n, static_cast<int64_t>(c.hc_dim())}));
    DSV4_TRY(be.matmul(site.fn, streams, mixes, v41_exact()));
    DSV4_ASSIGN_OR_RETURN(pre, f32({n, hc}));
    DSV4_ASSIGN_OR_RETURN(m.post, f32({n, hc}));
    DSV4_ASSIGN_OR_RETURN(m.comb, f32({n, hc * hc}));
    return be.hc_mix(streams, mixes, site.scale, site.base, c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.rms_eps,
                     pre, m.post, m.comb);
  };

  Tensor attn_pre;
  HcMix attn_mix;
  DSV4_TRY(mix(bw.hc_attn, attn_pre, attn_mix));
  DSV4_TRY(note(b, "hc_attn_pre", attn_pre));
  DSV4_TRY(note(b, "hc_attn_post", attn_mix.post));
  DSV4_TRY(note(b, "hc_attn_comb", attn_mix.comb));
  DSV4_ASSIGN_OR_RETURN(Tensor attn_in, f32({n, d}));
  DSV4_TRY(be.hc_collapse(streams, v41->pre, c.hc_mult, attn_in));
  DSV4_TRY(v41_norm(attn_in, &bw.attn_norm, d, attn_in));
  DSV4_TRY(note(b, "attn_in", attn_in));
  DSV4_ASSIGN_OR_RETURN(Tensor attn_out, attention_v41(layer, attn_in, step));
  DSV4_TRY(note(b, "attn_out", attn_out));
  DSV4_TRY(hc_post(attn_out, attn_mix, streams));

  Tensor ffn_pre;
  HcMix ffn_mix;
  DSV4_TRY(mix(bw.hc_ffn, ffn_pre, ffn_mix));
  DSV4_TRY(note(b, "hc_ffn_pre", ffn_pre));
  DSV4_TRY(note(b, "hc_ffn_post", ffn_mix.post));
  DSV4_TRY(note(b, "hc_ffn_comb", ffn_mix.comb));
  DSV4_ASSIGN_OR_RETURN(Tensor ffn_in, f32({n, d}));
  DSV4_TRY(be.hc_collapse(streams, attn_pre, c.hc_mult, ffn_in));
  DSV4_TRY(v41_norm(ffn_in, &bw.ffn_norm, d, ffn_in));
  DSV4_ASSIGN_OR_RETURN(Tensor ffn_out, moe(layer, ffn_in, step));
  DSV4_TRY(note(b, "ffn_out", ffn_out));
  DSV4_TRY(hc_post(ffn_out, ffn_mix, streams));
  DSV4_TRY(be.copy_rows(ffn_pre, v41->pre));  // the next block's attention collapses with it
  return note(b, "out_streams", streams);
}

// Attention as V4's (§3.1) with the V4.1 sources: a KV source compresses (ratio 1 or 2, no
// APE, no overlap) and derives the index keys from the latent; an index source selects
// over its KV source's keys (masked by the candidate blocks after the candidate source);
// every compressed block attends its KV source's entries through its index source's
// selection. As in V4 the KV path and the compressor read only x: a side lane beside the
// query path (backend.h's lanes), joined before the indexer.
Result<Tensor> ForwardPass::attention_v41(const LayerPlan& layer, const Tensor& x, const Step& step) const {
  const uint32_t b = layer.block;
  const BlockWeights& bw = w.blocks[b];
  const backend::StepRows& rows = step.rows;
  const int64_t n = rows.n, hd = c.head_dim, heads = c.n_heads;

  DSV4_TRY(side_lane(step));
  DSV4_ASSIGN_OR_RETURN(Tensor kv, f32({n, hd}));
  DSV4_TRY(be.matmul(bw.kv, x, kv, v41_mode(opt.matmul)));
  DSV4_TRY(v41_norm(kv, &bw.kv_norm, hd, kv));
  DSV4_TRY(be.rope(kv, hd, rows.positions, layer.rope, false));
  DSV4_TRY(note(b, "window_kv_prequant", kv));
  if (opt.qat) DSV4_TRY(be.round_fp8_blocks(kv, hd, 32));  // every dim, blocks of 32
  DSV4_TRY(note(b, "window_kv", kv));
  if (layer.ratio && layer.kv_source) DSV4_TRY(compress_v41(layer, x, step));

  DSV4_TRY(be.main_lane());
  DSV4_ASSIGN_OR_RETURN(Tensor qr, f32({n, static_cast<int64_t>(c.q_lora_rank)}));
  DSV4_TRY(be.matmul(bw.q_a, x, qr, v41_mode(opt.matmul)));
  DSV4_TRY(v41_norm(qr, &bw.q_a_norm, qr.cols(), qr));
  DSV4_ASSIGN_OR_RETURN(Tensor q, f32({n, heads * hd}));
  DSV4_TRY(be.matmul(bw.q_b, qr, q, v41_mode(opt.matmul)));  // no per-head norm in V4.1 (fixture: attn_out)
  DSV4_TRY(be.rope(q, hd, rows.positions, layer.rope, false));
  DSV4_TRY(be.join_lane(1));

  backend::AttentionKeys keys;
  keys.window = c.sliding_window;
  keys.ring = cache.ring(layer.ring);
  keys.chunk = kv;
  keys.draft_block = layer.mtp;  // a DSpark stage attends its seeded ring and the whole block
  if (layer.ratio) {
    if (layer.indexer) DSV4_TRY(indexer_v41(layer, x, qr, step));
    keys.ratio = layer.ratio;
    keys.entries = cache.list(layer.kv_list);
    keys.selected = v41->selection.at(static_cast<size_t>(layer.selection_block));
  }
  DSV4_ASSIGN_OR_RETURN(Tensor o, f32({n, heads * hd}));
  DSV4_TRY(be.attention(q, keys, rows, bw.sinks, 1.0f / std::sqrt(static_cast<float>(hd)), o, opt.matmul));
  if (!layer.mtp) DSV4_TRY(be.store_window(kv, rows, keys.window, keys.ring));  // drafts stay out
  DSV4_TRY(be.rope(o, hd, rows.positions, layer.rope, true));

  DSV4_ASSIGN_OR_RETURN(Tensor u, f32({n, static_cast<int64_t>(c.o_groups * c.o_lora_rank)}));
  DSV4_TRY(be.matmul_grouped(bw.out_a, o, u, c.o_groups, v41_mode(opt.matmul)));
  DSV4_ASSIGN_OR_RETURN(Tensor out, f32({n, static_cast<int64_t>(c.hidden)}));
  DSV4_TRY(be.matmul(bw.out_b, u, out, v41_mode(opt.matmul)));
  return out;
}

// §3.3: the latent of each completed group (ratio 2: a per-dimension softmax of the gate
// scores; ratio 1: the row itself), its norm; the index key k_norm(wk(latent)) and the
// entry, each rotated at the group's first position and QAT-rounded, into the source's lists.
Status ForwardPass::compress_v41(const LayerPlan& layer, const Tensor& x, const Step& step) const {
  const uint32_t b = layer.block;
  const BlockWeights& bw = w.blocks[b];
  const CompressorWeights& cw = bw.compressor;
  const backend::StepRows& rows = step.rows;
  const int64_t n = rows.n, hd = c.head_dim, dk = c.index_head_dim;
  DSV4_ASSIGN_OR_RETURN(Tensor kv, f32({n, hd}));
  DSV4_TRY(be.matmul(cw.kv, x, kv, v41_exact()));
  Tensor score = kv;  // ratio 1: one row per group, its softmax weight is exactly 1
  if (layer.ratio > 1) {
    DSV4_ASSIGN_OR_RETURN(score, f32({n, hd}));
    DSV4_TRY(be.matmul(cw.gate, x, score, v41_exact()));
  }
  DSV4_ASSIGN_OR_RETURN(Tensor no_ape, f32({static_cast<int64_t>(layer.ratio), hd}));
  DSV4_TRY(be.fill(no_ape, 0.0f));
  DSV4_ASSIGN_OR_RETURN(Tensor latent, f32({n, hd}));
  DSV4_TRY(be.fill(latent, 0.0f));
  DSV4_TRY(be.compress(kv, score, no_ape, layer.ratio, false, rows, cache.state_kv(layer.kv_state),
                       cache.state_score(layer.kv_state), latent));
  DSV4_TRY(v41_norm(latent, &cw.norm, hd, latent));
  DSV4_ASSIGN_OR_RETURN(Tensor first_pos, i32({n}));
  DSV4_TRY(be.block_positions(rows, layer.ratio, first_pos));

  DSV4_ASSIGN_OR_RETURN(Tensor key, f32({n, dk}));
  DSV4_TRY(be.matmul(bw.index_k, latent, key, v41_exact()));
  DSV4_TRY(v41_norm(key, &bw.index_k_norm, dk, key));
  DSV4_TRY(be.rope(key, dk, first_pos, layer.rope, false));
  DSV4_TRY(note_entries(b, "index_k_prequant", key, layer.ratio, step));
  if (opt.qat) DSV4_TRY(be.round_fp4_blocks(key, 32));
  DSV4_TRY(note_entries(b, "index_k", key, layer.ratio, step));
  DSV4_TRY(be.store_entries(key, layer.ratio, rows, cache.list(layer.key_list)));

  DSV4_TRY(be.rope(latent, hd, first_pos, layer.rope, false));
  DSV4_TRY(note_entries(b, "compressed_kv_prequant", latent, layer.ratio, step));
  if (opt.qat) DSV4_TRY(be.round_fp4_e4m3_blocks(latent, 16));
  DSV4_TRY(note_entries(b, "compressed_kv", latent, layer.ratio, step));
  return be.store_entries(latent, layer.ratio, rows, cache.list(layer.kv_list));
}

// §3.3-3.4: index queries from the q latent (RoPE, FP4 in QAT), head weights, scores over
// the KV source's index keys; the candidate source publishes its candidate blocks, later
// index sources mask with them; then the top-k for this block and its consumers.
Status ForwardPass::indexer_v41(const LayerPlan& layer, const Tensor& x, const Tensor& qr, const Step& step) const {
  const uint32_t b = layer.block;
  const BlockWeights& bw = w.blocks[b];
  const backend::StepRows& rows = step.rows;
  const int64_t n = rows.n, heads = c.index_heads, dk = c.index_head_dim;
  DSV4_ASSIGN_OR_RETURN(Tensor q, f32({n, heads * dk}));
  DSV4_TRY(be.matmul(bw.index_q_b, qr, q, v41_mode(opt.matmul)));
  DSV4_TRY(be.rope(q, dk, rows.positions, layer.rope, false));
  if (opt.qat) DSV4_TRY(be.round_fp4_blocks(q, 32));
  DSV4_ASSIGN_OR_RETURN(Tensor weights, f32({n, heads}));
  DSV4_TRY(be.matmul(bw.index_proj, x, weights, v41_exact()));
  DSV4_TRY(be.scale(weights, static_cast<float>(1.0 / std::sqrt(double(dk)) / std::sqrt(double(heads)))));

  const int64_t max_visible = std::max<int64_t>(rows.max_end / layer.ratio, 1);
  DSV4_ASSIGN_OR_RETURN(Tensor scores, f32({n, max_visible}));
  DSV4_TRY(be.indexer_scores(q, weights, cache.list(layer.key_list), layer.ratio, rows, scores, opt.matmul));
  if (layer.candidate_source) {
    DSV4_TRY(be.candidate_blocks(scores, layer.ratio, rows, c.candidate->block_size,
                                 static_cast<int>(c.candidate->topk_blocks), v41->candidates));
    DSV4_TRY(note(b, "candidate_blocks", v41->candidates));
  }
  if (layer.uses_candidates) DSV4_TRY(be.mask_candidates(scores, v41->candidates, c.candidate->block_size));
  const Tensor& idx = v41->selection.at(b);
  DSV4_TRY(be.top_k(scores, layer.ratio, rows, static_cast<int>(c.index_topk), idx));
  return note(b, "index_topk", idx);
}

Result<Tensor> ForwardPass::head_v41(const Tensor& pre, const Tensor& streams) const {
  const int64_t n = streams.rows(), d = c.hidden;
  DSV4_ASSIGN_OR_RETURN(Tensor h, f32({n, d}));
  DSV4_TRY(be.hc_collapse(streams, pre, c.hc_mult, h));
  if (trace) DSV4_TRY(trace->record("final_hidden", h));
  DSV4_TRY(v41_norm(h, &w.output_norm, d, h));
  DSV4_ASSIGN_OR_RETURN(Tensor logits, f32({n, static_cast<int64_t>(c.vocab_size)}));
  DSV4_TRY(be.matmul(w.output, h, logits, v41_mode(opt.matmul)));
  return logits;
}

}  // namespace dsv4
