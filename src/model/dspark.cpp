// V4.1's DSpark draft stages (shared/spec/deepseek-v41.md §3.7; DeepSeek's official
// inference/model.py is normative, shared/fixtures/tiny-v41/README.md records it): the
// trunk hands over the mean streams of the target layers; the first stage projects them
// (main_proj, main_norm) into main_x, whose window KV every stage keeps in its own ring;
// a draft block (the known next token, then noise tokens) runs through the window-only
// stages, non-causally over the ring and the whole block, with the delayed mix; the
// shared head on the last stage's norm, plus the Markov bias, gives the drafts.
#include <algorithm>

#include "model/forward.h"

namespace dsv4 {

using backend::MatmulMode;
using backend::Tensor;

Status ForwardPass::dspark_target(const LayerPlan& layer, const Tensor& streams, const Step& step) const {
  const std::vector<uint32_t>& targets = c.dspark->target_layers;
  const auto at = std::find(targets.begin(), targets.end(), layer.block);
  if (at == targets.end()) return Status::ok();
  const int64_t n = step.rows.n, d = c.hidden, t = at - targets.begin();
  DSV4_ASSIGN_OR_RETURN(Tensor mean_pre, f32({n, static_cast<int64_t>(c.hc_mult)}));
  DSV4_TRY(be.fill(mean_pre, 1.0f / static_cast<float>(c.hc_mult)));  // a power of two: exact
  DSV4_ASSIGN_OR_RETURN(Tensor mean, f32({n, d}));
  DSV4_TRY(be.hc_collapse(streams, mean_pre, c.hc_mult, mean));
  return be.copy_rows(mean, v41->dspark_hidden.columns(t * d, d));
}

Result<Tensor> ForwardPass::dspark_seed(const Tensor& main_hidden, const Step& step) const {
  const backend::StepRows& rows = step.rows;
  const int64_t n = rows.n, d = c.hidden, hd = c.head_dim;
  const BlockWeights& first = w.blocks[c.n_layers];
  DSV4_ASSIGN_OR_RETURN(Tensor x, f32({n, d}));
  DSV4_TRY(be.matmul(first.dspark_main_proj, main_hidden, x, v41_mode(opt.matmul)));
  DSV4_TRY(v41_norm(x, &first.dspark_main_norm, d, x));
  if (trace) DSV4_TRY(trace->record("dspark_main_x", x));
  for (uint32_t s = 0; s < c.n_mtp; ++s) {
    const LayerPlan& layer = plan.layers[c.n_layers + s];
    const BlockWeights& bw = w.blocks[layer.block];
    DSV4_ASSIGN_OR_RETURN(Tensor kv, f32({n, hd}));
    DSV4_TRY(be.matmul(bw.kv, x, kv, v41_mode(opt.matmul)));
    DSV4_TRY(v41_norm(kv, &bw.kv_norm, hd, kv));
    DSV4_TRY(be.rope(kv, hd, rows.positions, layer.rope, false));
    if (opt.qat) DSV4_TRY(be.round_fp8_blocks(kv, hd, 32));  // the FP8 rule, as the trunk's window KV
    DSV4_TRY(note(layer.block, "main_kv", kv));  // the draft rows record their own window_kv
    DSV4_TRY(be.store_window(kv, rows, c.sliding_window, cache.ring(layer.ring)));
  }
  return x;
}

Result<ForwardPass::DsparkOut> ForwardPass::dspark_draft(const Step& step) const {
  const int64_t n = step.rows.n, d = c.hidden;
  DSV4_ASSIGN_OR_RETURN(Tensor streams, embed(w.token_embd, step));
  DSV4_TRY(v41_begin(step, {}));  // block 0's one-hot `pre`: every stream holds the embedding
  for (uint32_t s = 0; s < c.n_mtp; ++s) DSV4_TRY(block_v41(plan.layers[c.n_layers + s], streams, step));
  DsparkOut out;
  DSV4_ASSIGN_OR_RETURN(out.h, f32({n, d}));
  DSV4_TRY(be.hc_collapse(streams, v41->pre, c.hc_mult, out.h));  // the last stage's FFN `pre`
  if (trace) DSV4_TRY(trace->record("dspark_hidden", out.h));
  DSV4_ASSIGN_OR_RETURN(Tensor normed, f32({n, d}));
  DSV4_TRY(v41_norm(out.h, &w.blocks[c.n_blocks() - 1].head_norm, d, normed));
  DSV4_ASSIGN_OR_RETURN(out.logits, f32({n, static_cast<int64_t>(c.vocab_size)}));
  DSV4_TRY(be.matmul(w.output, normed, out.logits, v41_mode(opt.matmul)));
  return out;
}

}  // namespace dsv4
