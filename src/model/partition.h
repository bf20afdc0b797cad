// How a model is laid out over N GPUs of one host (docs/MULTI-GPU.md): which tensors each
// GPU holds, how many bytes that is, the KV cache per GPU, the bytes each layer sends per
// token, and whether it fits.
//
// Rules:
// * Routed experts: expert parallelism. Experts are split into N contiguous ranges, the
//   first E mod N ranges one expert larger; a GPU holds its range of every expert stack
//   (all blocks, MTP included). Every expert of a stack has the same bytes.
// * Everything else ("dense": attention, shared expert, router, embedding and head, norms)
//   is either replicated (every GPU holds all of it; attention runs data-parallel over
//   sequences, each sequence's cache on one GPU) or tensor-parallel: the large per-head or
//   per-row matrices (attn_q_b, attn_output_a/b by head groups, the shared expert by
//   width, token_embd/output by vocabulary) are split N ways, the rest replicated. Under
//   tensor parallelism every GPU needs every sequence's cache: the KV is one latent head
//   shared by all query heads (MQA), so it cannot be split by head.
// * The mode: replicated when it fits and its estimated batch-1 decode step (bytes read at
//   HBM bandwidth + collective latencies) is not slower; tensor-parallel otherwise.
// * Communication per token and layer (activations bf16, partial sums fp32): all-to-all
//   dispatch + combine sends the token's hidden vector to each of its top-k experts' GPUs
//   and back, (N-1)/N of them remote on average; the alternative all-gather of hidden
//   vectors + reduce-scatter of fp32 partial outputs sends (N-1) x hidden x (2 + 4) bytes
//   whatever k is; tensor-parallel attention adds one all-reduce of the hidden vector.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "model/cache_layout.h"
#include "model/config.h"
#include "model/tensor_catalog.h"
#include "util/status.h"

namespace dsv4 {

// One tensor as it is (or would be) stored: its catalog entry and its bytes.
struct PlacedTensor {
  const TensorSpec* spec = nullptr;
  uint64_t bytes = 0;
};

struct GpuSet {
  uint32_t count = 1;
  uint64_t usable_bytes = 139ull << 30;   // an H200's 141 GB less the driver's share
  uint64_t reserve_bytes = 4ull << 30;    // per GPU: activations, workspace, CUDA graphs
  double hbm_bytes_per_s = 4.8e12;        // H200
  double link_bytes_per_s = 450e9;        // NVLink 4, one direction
  double collective_latency_s = 10e-6;    // one small NCCL collective inside a host
};

enum class DenseMode { Replicated, TensorParallel };
std::string_view dense_mode_name(DenseMode mode);  // "replicated", "tensor-parallel"

struct PartitionOptions {
  GpuSet gpus;
  uint64_t context_tokens = 0;   // per sequence
  uint32_t sequences = 1;
  CacheFormat cache_format = CacheFormat::ReferenceBf16;
  std::optional<DenseMode> mode;  // nullopt: chosen by the rules above
};

struct GpuShare {
  uint32_t first_expert = 0, n_experts = 0;  // its range of the first MoE block's routed experts
  uint64_t expert_bytes = 0;
  uint64_t dense_bytes = 0;     // replicated tensors plus its share of split ones
  uint64_t cache_bytes = 0;     // KV cache of the sequences it holds
  uint32_t sequences = 0;       // sequences whose cache it holds
  uint64_t total() const { return expert_bytes + dense_bytes + cache_bytes; }
};

// Bytes per token and MoE layer, summed over every GPU's sends.
struct TokenTraffic {
  uint64_t dispatch = 0, combine = 0;         // all-to-all (average over a uniform routing)
  uint64_t all_gather = 0, reduce_scatter = 0; // the all-gather + reduce-scatter alternative
  uint64_t tp_all_reduce = 0;                 // tensor-parallel attention + shared expert
  uint64_t all_to_all() const { return dispatch + combine; }
  uint64_t gather_scatter() const { return all_gather + reduce_scatter; }
};

struct PartitionPlan {
  DenseMode mode = DenseMode::Replicated;
  std::vector<GpuShare> gpus;
  uint64_t expert_bytes_total = 0;   // over the model (the catalog's routed-expert bytes)
  uint64_t dense_bytes_total = 0;    // everything else
  uint64_t split_bytes_total = 0;    // of dense: what tensor parallelism splits
  uint64_t cache_bytes_per_sequence = 0;
  uint32_t moe_layers = 0;           // blocks with routed experts (MTP included)
  TokenTraffic per_layer;            // per token and MoE layer
  double decode_step_s_replicated = 0, decode_step_s_tensor_parallel = 0;  // batch 1, estimates
  bool fits = false;
  std::string why_not;               // when !fits: which GPU, what it needs, the limit

  uint64_t max_gpu_bytes() const;
};

// Rank r's experts of n_experts over n_ranks: contiguous, the first n_experts mod n_ranks
// ranges one larger (the rule above; the expert-parallel MoE uses the same ranges).
struct ExpertRange {
  uint32_t first = 0, count = 0;
};
ExpertRange expert_range(uint32_t n_experts, uint32_t n_ranks, uint32_t rank);

// Whether tensor parallelism splits this tensor (N ways).
bool tensor_parallel_splits(const TensorSpec& spec);

// The plan for `tensors` (every stored tensor of the model) on `options.gpus`. Errors:
// no GPUs, more GPUs than routed experts, an expert stack whose bytes are not a whole
// number of experts. A plan that does not fit is returned with fits = false.
Result<PartitionPlan> plan_partition(const ModelConfig& config, std::span<const PlacedTensor> tensors,
                                     const PartitionOptions& options);

}  // namespace dsv4
