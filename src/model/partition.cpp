#include "model/partition.h"

#include <fmt/format.h>

#include <algorithm>

namespace dsv4 {
namespace {

constexpr uint64_t kActivationBytes = 2;  // bf16 hidden vectors on the wire
constexpr uint64_t kPartialBytes = 4;     // fp32 partial sums

std::string gib(uint64_t bytes) { return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / (1ull << 30)); }

// Share g of n of `total` such that the shares sum to `total` exactly.
uint64_t share(uint64_t total, uint32_t g, uint32_t n) {
  const unsigned __int128 t = total;
  return static_cast<uint64_t>(t * (g + 1) / n - t * g / n);
}

// Read once per token at decode: everything but the embedding tables (one row each).
bool read_per_token(const TensorSpec& spec) {
  return spec.global_kind != GlobalTensor::TokenEmbd && spec.block_kind != BlockTensor::NextnEmbedTokens;
}

struct Sums {
  uint64_t experts = 0, dense = 0, split = 0;
  uint64_t dense_read = 0, split_read = 0;  // of dense / split: read per decoded token
  std::vector<uint64_t> per_expert;         // per MoE block: bytes of one expert (all three stacks)
  std::vector<uint32_t> n_experts;          // per MoE block (V4.1's DSpark stages have their own count)
};

}  // namespace

std::string_view dense_mode_name(DenseMode mode) {
  return mode == DenseMode::Replicated ? "replicated" : "tensor-parallel";
}

uint64_t PartitionPlan::max_gpu_bytes() const {
  uint64_t m = 0;
  for (const GpuShare& g : gpus) m = std::max(m, g.total());
  return m;
}

ExpertRange expert_range(uint32_t n_experts, uint32_t n_ranks, uint32_t rank) {
  const uint32_t base = n_experts / n_ranks, extra = n_experts % n_ranks;
  return {rank * base + std::min(rank, extra), base + (rank < extra ? 1u : 0u)};
}

bool tensor_parallel_splits(const TensorSpec& spec) {
  if (spec.global_kind)
    return *spec.global_kind == GlobalTensor::TokenEmbd || *spec.global_kind == GlobalTensor::Output;
  if (!spec.block_kind) return false;
  switch (*spec.block_kind) {
    case BlockTensor::AttnQB:
    case BlockTensor::AttnOutputA:
    case BlockTensor::AttnOutputB:
    case BlockTensor::FfnGateShexp:
    case BlockTensor::FfnUpShexp:
    case BlockTensor::FfnDownShexp:
    case BlockTensor::NextnEmbedTokens:
    case BlockTensor::NextnSharedHeadHead:
      return true;
    default:
      return false;
  }
}

Result<PartitionPlan> plan_partition(const ModelConfig& config, std::span<const PlacedTensor> tensors,
                                     const PartitionOptions& options) {
  const uint32_t n = options.gpus.count;
  if (n == 0) return Status::error("--gpus 0: at least one GPU is needed");
  Sums sums;
  uint32_t min_experts = UINT32_MAX;
  std::vector<uint32_t> moe_blocks;
  for (const PlacedTensor& t : tensors) {
    const TensorSpec& s = *t.spec;
    if (s.role == TensorRole::EngramTables) continue;  // streamed from the file, never resident
    if (s.role != TensorRole::RoutedExperts) {
      sums.dense += t.bytes;
      const bool split = tensor_parallel_splits(s);
      if (split) sums.split += t.bytes;
      if (read_per_token(s)) {
        sums.dense_read += t.bytes;
        if (split) sums.split_read += t.bytes;
      }
      continue;
    }
    const uint32_t e = config.experts_of(*s.block);
    if (e == 0 || t.bytes % e != 0)
      return Status::errorf("tensor {}: {} bytes are not {} experts of equal size", s.name, t.bytes, e);
    min_experts = std::min(min_experts, e);
    sums.experts += t.bytes;
    if (std::find(moe_blocks.begin(), moe_blocks.end(), *s.block) == moe_blocks.end()) {
      moe_blocks.push_back(*s.block);
      sums.per_expert.push_back(0);
      sums.n_experts.push_back(e);
    }
    const size_t i = std::find(moe_blocks.begin(), moe_blocks.end(), *s.block) - moe_blocks.begin();
    sums.per_expert[i] += t.bytes / e;
  }
  if (min_experts == UINT32_MAX) return Status::error("the model has no routed-expert tensors to partition");
  if (n > min_experts)
    return Status::errorf("--gpus {}: more GPUs than the {} routed experts of a layer", n, min_experts);

  PartitionPlan plan;
  plan.expert_bytes_total = sums.experts;
  plan.dense_bytes_total = sums.dense;
  plan.split_bytes_total = sums.split;
  plan.moe_layers = static_cast<uint32_t>(moe_blocks.size());
  const uint64_t ctx = options.context_tokens ? options.context_tokens : config.context_length;
  plan.cache_bytes_per_sequence = plan_cache_layout(config, options.cache_format).totals_at(ctx).total();

  // Traffic per token and MoE layer (summed over GPUs).
  const uint64_t d = config.hidden, k = config.n_experts_used;
  plan.per_layer.dispatch = k * d * kActivationBytes * (n - 1) / n;
  plan.per_layer.combine = plan.per_layer.dispatch;
  plan.per_layer.all_gather = uint64_t{n - 1} * d * kActivationBytes;
  plan.per_layer.reduce_scatter = uint64_t{n - 1} * d * kPartialBytes;
  plan.per_layer.tp_all_reduce = 2 * uint64_t{n - 1} * d * kPartialBytes;  // ring all-reduce

  // Batch-1 decode step: the dense bytes one token reads, its experts' bytes spread over
  // the GPUs, and one latency per collective (the MoE exchange every MoE layer; under
  // tensor parallelism also the attention all-reduce of every block, and the embedding
  // and logits exchanges).
  uint64_t expert_read = 0;
  for (size_t b = 0; b < sums.per_expert.size(); ++b)
    expert_read += sums.per_expert[b] * std::min<uint64_t>(config.experts_used_of(moe_blocks[b]), sums.n_experts[b]);
  const GpuSet& g = options.gpus;
  const double moe_sync = n > 1 ? plan.moe_layers * g.collective_latency_s : 0;
  const double expert_s = static_cast<double>(expert_read) / n / g.hbm_bytes_per_s;
  plan.decode_step_s_replicated = static_cast<double>(sums.dense_read) / g.hbm_bytes_per_s + expert_s + moe_sync;
  plan.decode_step_s_tensor_parallel =
      static_cast<double>(sums.dense_read - sums.split_read + sums.split_read / n) / g.hbm_bytes_per_s + expert_s +
      moe_sync + (n > 1 ? (config.n_blocks() + 2) * g.collective_latency_s : 0);

  auto build = [&](DenseMode mode) {
    std::vector<GpuShare> shares(n);
    for (uint32_t i = 0; i < n; ++i) {
      GpuShare& s = shares[i];
      const ExpertRange range = expert_range(sums.n_experts.front(), n, i);  // the first MoE block's
      s.first_expert = range.first;
      s.n_experts = range.count;
      for (size_t b = 0; b < sums.per_expert.size(); ++b)
        s.expert_bytes += sums.per_expert[b] * expert_range(sums.n_experts[b], n, i).count;
      if (mode == DenseMode::Replicated) {
        s.dense_bytes = sums.dense;
        s.sequences = options.sequences / n + (i < options.sequences % n ? 1 : 0);
      } else {
        s.dense_bytes = sums.dense - sums.split + share(sums.split, i, n);
        s.sequences = options.sequences;  // MQA: every rank reads every sequence's latent KV
      }
      s.cache_bytes = s.sequences * plan.cache_bytes_per_sequence;
    }
    return shares;
  };
  auto fits = [&](const std::vector<GpuShare>& shares) {
    return std::all_of(shares.begin(), shares.end(),
                       [&](const GpuShare& s) { return s.total() + g.reserve_bytes <= g.usable_bytes; });
  };
  const auto replicated = build(DenseMode::Replicated), split = build(DenseMode::TensorParallel);
  DenseMode mode;
  if (options.mode) {
    mode = *options.mode;
  } else if (n == 1) {
    mode = DenseMode::Replicated;
  } else if (fits(replicated) && fits(split)) {
    mode = plan.decode_step_s_replicated <= plan.decode_step_s_tensor_parallel ? DenseMode::Replicated
                                                                                 : DenseMode::TensorParallel;
  } else {
    mode = fits(replicated) ? DenseMode::Replicated : DenseMode::TensorParallel;
  }
  plan.mode = mode;
  plan.gpus = mode == DenseMode::Replicated ? replicated : split;
  plan.fits = fits(plan.gpus);
  if (!plan.fits) {
    const auto worst = std::max_element(plan.gpus.begin(), plan.gpus.end(),
                                        [](const GpuShare& a, const GpuShare& b) { return a.total() < b.total(); });
    plan.why_not = fmt::format(
        "GPU {} needs {} ({} experts {} + {} weights {} + cache of {} sequence(s) {} + reserve {}), more than its "
        "usable {}", worst - plan.gpus.begin(), gib(worst->total() + g.reserve_bytes), worst->n_experts,
        gib(worst->expert_bytes), dense_mode_name(mode), gib(worst->dense_bytes), worst->sequences,
        gib(worst->cache_bytes), gib(g.reserve_bytes), gib(g.usable_bytes));
  }
  return plan;
}

}  // namespace dsv4
