// Expert-parallel routed experts (docs/MULTI-GPU.md): N ranks, each a backend of the same
// kind holding a contiguous range of a layer's experts (model/partition.h expert_range),
// all with the same tokens, routing and output buffer (attention replicated). Each rank
// runs its experts on the (token, slot) pairs routed to them; the pair outputs are
// all-gathered (padded to the largest rank's count, which every rank knows from the
// routing) and every rank adds them into y per token in slot order, exactly as
// Backend::moe_experts does on one backend. Since each output row is computed by the same
// arithmetic whatever the batch (backend.h), the result is bit-identical to the
// single-backend layer.
#pragma once

#include <cstdint>

#include "backend/backend.h"
#include "backend/collective.h"
#include "util/status.h"

namespace dsv4 {

// This rank's slice of a layer's stacks: gate/up [count, I, D], down [count, D, I], experts
// [first, first + count) of n_experts, on the rank's backend.
struct ExpertShard {
  uint32_t n_experts = 0;
  uint32_t first = 0, count = 0;
  backend::Tensor gate, up, down;
};

// y (F32 [n, D]) = sum_j weights[s, j] * expert_{experts[s, j]}(x[s]) (Backend::moe_experts:
// from +0, in slot order; y is written); x F32 [n, D],
// experts I32 [n, k], weights F32 [n, k], the same on every rank (a rank's tensors on its
// backend). Every rank calls it, each from its own thread, with its own shard.
Status expert_parallel_moe(backend::Backend& be, backend::Collective& comm, const ExpertShard& shard,
                           const backend::Tensor& x, const backend::Tensor& experts, const backend::Tensor& weights,
                           float limit, backend::MatmulMode mode, const backend::Tensor& y);

}  // namespace dsv4
