// MoE (spec §4): router (hash or biased sqrt-softplus top-k), routed experts, shared expert.
#include "model/forward.h"

namespace dsv4 {

using backend::Tensor;

// The shared expert reads only x: in steps with lanes it runs on a side lane (backend.h) into
// its own sum, added to the routed experts' after both (the same bits as adding it into
// theirs, which it does otherwise).
Result<Tensor> ForwardPass::moe(const LayerPlan& layer, const Tensor& x, const Step& step) const {
  const uint32_t b = layer.block;
  const BlockWeights& bw = w.blocks[b];
  const int64_t n = step.rows.n, k = c.experts_used_of(b);  // DSpark stages: their own counts
  const backend::MatmulMode exact = c.is_v41() ? v41_exact() : fp32_mode();
  const backend::MatmulMode mode = c.is_v41() ? v41_mode(opt.matmul) : opt.matmul;
  const auto shared_expert = [&](const Tensor& into) {
    return be.swiglu_expert(x, bw.gate_shexp, bw.up_shexp, bw.down_shexp, layer.swiglu_limit_shared, mode, into);
  };

  Tensor shared;
  if (lanes(step)) {
    DSV4_TRY(be.fork_lane(1));
    DSV4_ASSIGN_OR_RETURN(shared, f32({n, static_cast<int64_t>(c.hidden)}));
    DSV4_TRY(be.fill(shared, 0.0f));
    DSV4_TRY(shared_expert(shared));
    DSV4_TRY(be.main_lane());
  }
  DSV4_ASSIGN_OR_RETURN(Tensor logits, f32({n, static_cast<int64_t>(c.experts_of(b))}));
  DSV4_TRY(be.matmul(bw.gate_inp, x, logits, exact));  // fp32 router
  DSV4_ASSIGN_OR_RETURN(Tensor experts, i32({n, k}));
  DSV4_ASSIGN_OR_RETURN(Tensor weights, f32({n, k}));
  const bool hash = layer.hash_routing;
  DSV4_TRY(be.route(logits, hash ? nullptr : &bw.exp_probs_b, hash ? &bw.tid2eid : nullptr,
                    step.rows.tokens, static_cast<int>(k), c.routed_scale, experts, weights));
  DSV4_TRY(note(b, "router_experts", experts));
  DSV4_TRY(note(b, "router_weights", weights));

  // The routed experts write y, and the shared expert adds into it (or into its own sum).
  DSV4_ASSIGN_OR_RETURN(Tensor y, f32({n, static_cast<int64_t>(c.hidden)}));
  DSV4_TRY(be.moe_experts(x, bw.gate_exps, bw.up_exps, bw.down_exps, experts, weights,
                          layer.swiglu_limit, mode, y));
  if (!shared.valid()) {
    DSV4_TRY(shared_expert(y));
    return y;
  }
  DSV4_TRY(be.join_lane(1));
  DSV4_TRY(be.add(shared, y));
  return y;
}

}  // namespace dsv4
