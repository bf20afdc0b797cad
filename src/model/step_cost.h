// What a forward step of a DeepSeek-V4 model must move and compute at the least: the
// physical bounds benchmarks compare with (docs/PERFORMANCE.md, "How the model is
// measured"; shared/spec/performance-limits.md §5 derives the same figures).
//
// Decode: the bytes one step reads, each once. Every trunk weight except the routed experts
// (attention, compressors, indexer, shared expert, router, mHC, norms, the head), one
// embedding row per sequence, the routed experts the step's tokens touch (each distinct
// expert once), and per sequence its cache at that depth as dsv4 keeps it (the F32 layout):
// the window ring, the compressor states, every indexer key and the top-k selected entries
// of a CSA layer, every entry of an HCA layer.
//
// Prefill: the FLOPs per prompt token. Two per weight of every trunk matrix a token
// multiplies by (routed experts: the k of E it is routed to; the head once per chunk, for
// the chunk's last token), plus attention at the token's position: 4 * heads * head_dim per
// key (QK and PV) over the window and the compressed keys it reads, and on CSA layers the
// indexer's 2 * index_heads * index_head_dim per visible entry.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "gguf/gguf_file.h"
#include "model/config.h"
#include "util/status.h"

namespace dsv4 {

struct StepCost {
  const ModelConfig* config = nullptr;
  uint64_t always_bytes = 0;              // weights every step reads (the head included)
  uint64_t embedding_row_bytes = 0;       // one token's embedding row
  std::vector<uint64_t> expert_bytes;     // per trunk layer: one routed expert (gate + up + down)
  double token_params = 0;                // weights one prompt token multiplies by, head excluded
  double head_params = 0;                 // the output head's

  // From the model's tensors (catalog names, file types); `config` must outlive the result.
  static Result<StepCost> of(const ModelConfig& config, std::span<const gguf::TensorInfo> tensors);

  // The expected number of distinct experts B tokens touch in a layer when each picks k of
  // E uniformly: E (1 - (1 - k/E)^B) (k for one token).
  double expected_distinct_experts(uint32_t tokens) const;
  // Cache bytes one decode step of one sequence reads at `depth` tokens (F32 layout).
  uint64_t kv_read_bytes(uint64_t depth) const;
  // Bytes a decode step of `sequences` sequences at `depth` reads, with `distinct_experts`
  // routed experts per layer.
  double decode_bytes(uint32_t sequences, uint64_t depth, double distinct_experts) const;

  // Attention FLOPs of one token at `position` over all trunk layers.
  double attention_flops(uint64_t position) const;
  // FLOPs per token of a prefill of `prompt` tokens from position 0 in chunks of `chunk`.
  double prefill_flops_per_token(uint64_t prompt, uint64_t chunk) const;
};

}  // namespace dsv4
