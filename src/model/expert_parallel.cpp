#include "model/expert_parallel.h"

#include <vector>

#include "model/partition.h"

namespace dsv4 {

using backend::Tensor;

Status expert_parallel_moe(backend::Backend& be, backend::Collective& comm, const ExpertShard& shard,
                           const Tensor& x, const Tensor& experts, const Tensor& weights, float limit,
                           backend::MatmulMode mode, const Tensor& y) {
  const int n_ranks = comm.size(), me = comm.rank();
  const ExpertRange mine = expert_range(shard.n_experts, n_ranks, me);
  if (shard.first != mine.first || shard.count != mine.count)
    return Status::errorf("expert_parallel_moe: rank {} of {} holds experts {}+{}, expected {}+{} of {}", me, n_ranks,
                          shard.first, shard.count, mine.first, mine.count, shard.n_experts);
  const int64_t n = x.rows(), d = x.cols(), k = experts.cols();
  if (experts.type != GgmlType::I32 || experts.rows() != n || weights.type != GgmlType::F32 ||
      weights.rows() != n || weights.cols() != k)
    return Status::errorf("expert_parallel_moe: experts {} / weights {} for x {}", experts.describe(),
                          weights.describe(), x.describe());
  if (n == 0) return Status::ok();
  std::vector<int32_t> ids(n * k);
  std::vector<float> w(n * k);
  DSV4_TRY(be.download(experts, ids.data(), ids.size() * sizeof(int32_t)));
  DSV4_TRY(be.download(weights, w.data(), w.size() * sizeof(float)));

  // Which rank runs each (token, slot) pair, and its row among that rank's pairs.
  std::vector<int32_t> owner(n * k), row_of(n * k);
  std::vector<int64_t> per_rank(n_ranks, 0);
  std::vector<uint32_t> rank_of_expert(shard.n_experts);
  for (int r = 0; r < n_ranks; ++r) {
    const ExpertRange range = expert_range(shard.n_experts, n_ranks, r);
    for (uint32_t e = range.first; e < range.first + range.count; ++e) rank_of_expert[e] = r;
  }
  std::vector<int32_t> my_tokens, my_experts;
  std::vector<float> my_weights;
  for (int64_t p = 0; p < n * k; ++p) {
    if (ids[p] < 0 || static_cast<uint32_t>(ids[p]) >= shard.n_experts)
      return Status::errorf("expert_parallel_moe: row {} slot {} names expert {} of {}", p / k, p % k, ids[p],
                            shard.n_experts);
    owner[p] = static_cast<int32_t>(rank_of_expert[ids[p]]);
    row_of[p] = static_cast<int32_t>(per_rank[owner[p]]++);
    if (owner[p] == me) {
      my_tokens.push_back(static_cast<int32_t>(p / k));
      my_experts.push_back(ids[p] - static_cast<int32_t>(shard.first));
      my_weights.push_back(w[p]);
    }
  }
  int64_t most = 0;
  for (int64_t c : per_rank) most = std::max(most, c);

  // This rank's pair outputs, padded to `most` rows (the padding is never read).
  const int64_t m = static_cast<int64_t>(my_tokens.size());
  DSV4_ASSIGN_OR_RETURN(Tensor mine_out, be.alloc(GgmlType::F32, std::vector<int64_t>{most, d}));
  DSV4_TRY(be.fill(mine_out, 0.0f));
  if (m > 0) {
    DSV4_ASSIGN_OR_RETURN(Tensor tok, be.alloc(GgmlType::I32, std::vector<int64_t>{m}));
    DSV4_ASSIGN_OR_RETURN(Tensor local, be.alloc(GgmlType::I32, std::vector<int64_t>{m, 1}));
    DSV4_ASSIGN_OR_RETURN(Tensor lw, be.alloc(GgmlType::F32, std::vector<int64_t>{m, 1}));
    DSV4_ASSIGN_OR_RETURN(Tensor xs, be.alloc(GgmlType::F32, std::vector<int64_t>{m, d}));
    DSV4_TRY(be.upload(tok, my_tokens.data(), m * sizeof(int32_t)));
    DSV4_TRY(be.upload(local, my_experts.data(), m * sizeof(int32_t)));
    DSV4_TRY(be.upload(lw, my_weights.data(), m * sizeof(float)));
    DSV4_TRY(be.get_rows(x, tok, xs));
    // One slot per row: the row's output is 0 + expert(x) * weight, as in the one-backend sum.
    DSV4_TRY(be.moe_experts(xs, shard.gate, shard.up, shard.down, local, lw, limit, mode, mine_out.slice(0, m)));
  }
  DSV4_ASSIGN_OR_RETURN(Tensor all, be.alloc(GgmlType::F32, std::vector<int64_t>{n_ranks * most, d}));
  DSV4_TRY(be.synchronize());
  DSV4_TRY(comm.all_gather(static_cast<const float*>(mine_out.data), static_cast<float*>(all.data),
                           static_cast<size_t>(most * d)));

  // Slot-major order: block j holds every token's slot j, so y = +0, += block 0, += block 1,
  // ... adds in the order Backend::moe_experts does.
  std::vector<int32_t> gather(n * k);
  for (int64_t s = 0; s < n; ++s)
    for (int64_t j = 0; j < k; ++j) gather[j * n + s] = static_cast<int32_t>(owner[s * k + j] * most + row_of[s * k + j]);
  DSV4_ASSIGN_OR_RETURN(Tensor gather_ids, be.alloc(GgmlType::I32, std::vector<int64_t>{n * k}));
  DSV4_TRY(be.upload(gather_ids, gather.data(), gather.size() * sizeof(int32_t)));
  DSV4_ASSIGN_OR_RETURN(Tensor slots, be.alloc(GgmlType::F32, std::vector<int64_t>{n * k, d}));
  DSV4_TRY(be.get_rows(all, gather_ids, slots));
  DSV4_TRY(be.fill(y, 0.0f));
  for (int64_t j = 0; j < k; ++j) DSV4_TRY(be.add(slots.slice(j * n, n), y));
  return Status::ok();
}

}  // namespace dsv4
