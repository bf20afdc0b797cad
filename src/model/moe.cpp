// MoE (spec §4): router (hash or biased sqrt-softplus top-k), routed experts, shared expert.
#include "model/forward.h"

namespace dsv4 {

using backend::Tensor;

Result<Tensor> ForwardPass::moe(uint32_t b, const Tensor& x, const ForwardRows& rows) const {
  const BlockWeights& bw = w.blocks[b];
  const int64_t n = rows.n, k = c.n_experts_used;
  DSV4_ASSIGN_OR_RETURN(Tensor logits, f32({n, static_cast<int64_t>(c.n_experts)}));
  DSV4_TRY(be.matmul(bw.gate_inp, x, logits, backend::MatmulMode::Exact));  // fp32 router
  DSV4_ASSIGN_OR_RETURN(Tensor experts, be.alloc(GgmlType::I32, std::vector<int64_t>{n, k}));
  DSV4_ASSIGN_OR_RETURN(Tensor weights, f32({n, k}));
  const bool hash = c.is_hash_layer(b);
  DSV4_TRY(be.route(logits, hash ? nullptr : &bw.exp_probs_b, hash ? &bw.tid2eid : nullptr,
                    rows.tokens, static_cast<int>(k), c.routed_scale, experts, weights));
  DSV4_TRY(note(b, "router_experts", experts));
  DSV4_TRY(note(b, "router_weights", weights));

  DSV4_ASSIGN_OR_RETURN(Tensor y, f32({n, static_cast<int64_t>(c.hidden)}));  // zeros
  DSV4_TRY(be.moe_experts(x, bw.gate_exps, bw.up_exps, bw.down_exps, experts, weights,
                          c.swiglu_limit.at(b), opt.matmul, y));
  DSV4_TRY(be.swiglu_expert(x, bw.gate_shexp, bw.up_shexp, bw.down_shexp,
                            c.swiglu_limit_shared.at(b), opt.matmul, y));
  return y;
}

}  // namespace dsv4
