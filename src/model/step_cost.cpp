#include "model/step_cost.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include "model/cache_layout.h"
#include "model/tensor_catalog.h"

namespace dsv4 {
namespace {

bool is_matmul(const TensorSpec& spec) {
  // The compressor APE is added to scores, not multiplied by; tid2eid is an index table.
  return spec.type_class == TypeClass::Matrix && spec.block_kind != BlockTensor::CompressorApe &&
         spec.block_kind != BlockTensor::IndexerCompressorApe;
}

}  // namespace

Result<StepCost> StepCost::of(const ModelConfig& c, std::span<const gguf::TensorInfo> tensors) {
  StepCost cost;
  cost.config = &c;
  cost.expert_bytes.assign(c.n_layers, 0);
  std::map<std::string, const gguf::TensorInfo*, std::less<>> by_name;
  for (const gguf::TensorInfo& t : tensors) by_name.emplace(t.name, &t);
  const TensorCatalog catalog = build_tensor_catalog(c);
  for (const TensorSpec& spec : catalog.tensors) {
    if (spec.block && *spec.block >= c.n_layers) continue;  // MTP blocks: not part of a trunk step
    const auto it = by_name.find(spec.name);
    if (it == by_name.end()) {
      if (spec.required) return Status::errorf("step cost: tensor {} is missing", spec.name);
      continue;
    }
    const uint64_t bytes = it->second->nbytes;
    const double params = static_cast<double>(spec.n_elements());
    if (spec.global_kind == GlobalTensor::TokenEmbd) {
      cost.embedding_row_bytes = bytes / spec.ne[1];
      continue;
    }
    if (spec.role == TensorRole::RoutedExperts) {
      cost.expert_bytes[*spec.block] += bytes / c.n_experts;
      cost.token_params += params * c.n_experts_used / c.n_experts;
      continue;
    }
    cost.always_bytes += bytes;
    if (!is_matmul(spec)) continue;
    if (spec.global_kind == GlobalTensor::Output)
      cost.head_params = params;
    else
      cost.token_params += params;
  }
  return cost;
}

double StepCost::expected_distinct_experts(uint32_t tokens) const {
  const double E = config->n_experts, k = config->n_experts_used;
  if (tokens <= 1) return k;
  return E * (1 - std::pow(1 - k / E, static_cast<double>(tokens)));
}

uint64_t StepCost::kv_read_bytes(uint64_t depth) const {
  const ModelConfig& c = *config;
  const CacheLayout layout = plan_cache_layout(c, CacheFormat::F32);
  uint64_t bytes = 0;
  for (uint32_t b = 0; b < c.n_layers; ++b) {
    const BlockCache& bc = layout.blocks[b];
    const uint64_t window_rows = std::min<uint64_t>(depth + 1, bc.window_slots);
    bytes += window_rows * (bc.window_slots ? bc.window_bytes / bc.window_slots : 0);
    bytes += bc.compressor_state_bytes + bc.indexer_state_bytes;
    const uint64_t entries = bc.entries(depth + 1);
    if (bc.kind == AttentionKind::CSA)
      bytes += entries * bc.index_key_bytes + std::min<uint64_t>(entries, c.index_topk) * bc.entry_bytes;
    else if (bc.kind == AttentionKind::HCA)
      bytes += entries * bc.entry_bytes;
  }
  return bytes;
}

double StepCost::decode_bytes(uint32_t sequences, uint64_t depth, double distinct_experts) const {
  double bytes = static_cast<double>(always_bytes) + static_cast<double>(sequences) * embedding_row_bytes;
  for (uint64_t e : expert_bytes) bytes += distinct_experts * static_cast<double>(e);
  return bytes + static_cast<double>(sequences) * static_cast<double>(kv_read_bytes(depth));
}

double StepCost::attention_flops(uint64_t position) const {
  const ModelConfig& c = *config;
  const double per_key = 4.0 * c.n_heads * c.head_dim;
  const double indexer_per_entry = 2.0 * c.index_heads * c.index_head_dim;
  const uint64_t visible = position + 1;
  double flops = 0;
  for (uint32_t b = 0; b < c.n_layers; ++b) {
    double keys = static_cast<double>(std::min<uint64_t>(visible, c.sliding_window));
    const uint32_t ratio = c.ratio(b);
    if (ratio != 0) {
      const uint64_t entries = visible / ratio;
      if (c.attention_kind(b) == AttentionKind::CSA) {
        keys += static_cast<double>(std::min<uint64_t>(entries, c.index_topk));
        flops += indexer_per_entry * static_cast<double>(entries);
      } else {
        keys += static_cast<double>(entries);
      }
    }
    flops += per_key * keys;
  }
  return flops;
}

double StepCost::prefill_flops_per_token(uint64_t prompt, uint64_t chunk) const {
  if (prompt == 0) return 0;
  chunk = chunk ? std::min(chunk, prompt) : prompt;
  const double chunks = std::ceil(static_cast<double>(prompt) / static_cast<double>(chunk));
  double attention = 0;
  for (uint64_t p = 0; p < prompt; ++p) attention += attention_flops(p);
  return 2 * token_params + 2 * head_params * chunks / static_cast<double>(prompt) +
         attention / static_cast<double>(prompt);
}

}  // namespace dsv4
