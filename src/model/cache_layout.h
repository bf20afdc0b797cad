// The per-sequence decode state of a DeepSeek-V4 model, byte for byte (spec §6): what each
// block keeps, how much of it is fixed and how much grows with the tokens processed.
//
// Per block:
//   every block   window KV ring: sliding_window slots of one KV entry (slot = t mod window)
//   CSA (ratio 4) compressed KV entries, one per 4 tokens; indexer keys, one per 4 tokens;
//                 main and indexer compressor states (fp32 kv + score of the open blocks)
//   HCA (other)   compressed KV entries, one per `ratio` tokens; compressor state
// Three formats of the KV entries and indexer keys:
//   F32            fp32 vectors, as dsv4's CPU reference keeps them (fixture numerics);
//   ReferenceBf16  bf16 vectors, as DeepSeek's reference keeps them;
//   Packed         the lossless FP8/FP4 form of the same values (spec §6.2): an entry is
//                  (head_dim - rope) e4m3 + rope bf16 + one ue8m0 scale per 64 e4m3
//                  values, padded to 8 bytes; an indexer key is index_head_dim e2m1 nibbles
//                  + one ue8m0 scale per 32.
// Compressor states are fp32 in every format (the layout the reference computes with).
//
// V4.1 (shared caches, shared/spec/deepseek-v41.md §3.3): every block keeps only its own
// window ring; a KV source also holds the compressed cache, the index keys (from its
// latent) and, at ratio > 1, the state of its open group; consumer layers read their
// source's cache. Packed V4.1 forms, lossless for the reference's QAT rules (tiny-v41
// README): window FP8 with one ue8m0 scale per 32, compressed entries FP4 E2M1 with one
// e4m3 scale per 16, index keys FP4 with one ue8m0 scale per 32.
// The forward pass's cache plan (cache.h) is this layout in F32; `dsv4 info` prints the
// bf16 and packed layouts.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "model/config.h"

namespace dsv4 {

enum class CacheFormat { F32, ReferenceBf16, Packed };
std::string_view cache_format_name(CacheFormat format);  // "fp32", "reference bf16", "packed fp8/fp4"

// Bytes of one KV vector (window slot or compressed entry) and of one indexer key.
uint64_t kv_entry_bytes(const ModelConfig& config, CacheFormat format);
uint64_t index_key_bytes(const ModelConfig& config, CacheFormat format);
// V4.1: a window slot and a compressed entry differ in the packed format.
uint64_t v41_window_entry_bytes(const ModelConfig& config, CacheFormat format);
uint64_t v41_compressed_entry_bytes(const ModelConfig& config, CacheFormat format);

// The fp32 state of one compressor of ratio `ratio` and entry width `width` with overlap
// factor `overlap` (2 for ratio 4, else 1): kv and score, each
// [overlap * ratio, overlap * width] (spec §3.3).
uint64_t compressor_state_bytes(uint32_t ratio, uint32_t width, uint32_t overlap);

struct BlockCache {
  uint32_t block = 0;
  AttentionKind kind = AttentionKind::Window;
  uint32_t ratio = 0;  // tokens per compressed entry; 0 for window-only blocks

  // Fixed per sequence.
  uint32_t window_slots = 0;
  uint64_t window_bytes = 0;
  uint64_t compressor_state_bytes = 0;  // main compressor (CSA, HCA)
  uint64_t indexer_state_bytes = 0;     // indexer compressor (CSA)
  // One per `ratio` tokens.
  uint64_t entry_bytes = 0;      // compressed KV entry (CSA, HCA)
  uint64_t index_key_bytes = 0;  // indexer key (CSA)
  // V4.1: whose compressed cache the block reads (-1 for window-only blocks); only a KV
  // source (kv_source_layer == block) holds entries, index keys and a compressor state.
  int32_t kv_source_layer = -1;
  bool holds_entries() const { return entry_bytes != 0; }

  uint64_t fixed_bytes() const { return window_bytes + compressor_state_bytes + indexer_state_bytes; }
  // Complete entries after n tokens: floor(n / ratio).
  uint64_t entries(uint64_t n_tokens) const { return ratio == 0 ? 0 : n_tokens / ratio; }
  uint64_t entry_bytes_at(uint64_t n_tokens) const { return entries(n_tokens) * entry_bytes; }
  uint64_t index_key_bytes_at(uint64_t n_tokens) const { return entries(n_tokens) * index_key_bytes; }
  uint64_t bytes_at(uint64_t n_tokens) const {
    return fixed_bytes() + entry_bytes_at(n_tokens) + index_key_bytes_at(n_tokens);
  }
  double bytes_per_token() const {
    return ratio == 0 ? 0.0 : static_cast<double>(entry_bytes + index_key_bytes) / ratio;
  }
};

// Sums over blocks, split by part, after n tokens.
struct CacheTotals {
  uint64_t windows = 0;
  uint64_t compressor_states = 0;  // main and indexer
  uint64_t csa_entries = 0;
  uint64_t index_keys = 0;
  uint64_t hca_entries = 0;
  uint64_t shared_entries = 0;  // V4.1: compressed KV of the KV sources (index keys: index_keys)
  uint64_t fixed() const { return windows + compressor_states; }
  uint64_t total() const { return fixed() + csa_entries + index_keys + hca_entries + shared_entries; }
};

struct CacheLayout {
  CacheFormat format = CacheFormat::ReferenceBf16;
  std::vector<BlockCache> blocks;  // trunk then MTP, one per block

  uint64_t fixed_bytes() const;
  double bytes_per_token() const;  // growth rate, averaged over each ratio
  uint64_t bytes_at(uint64_t n_tokens) const;
  // With page_rows > 1 the growing parts are counted in whole pages of that many rows (the
  // cache manager's allocation unit).
  CacheTotals totals_at(uint64_t n_tokens, uint64_t page_rows = 1) const;
};

// `config` must be valid.
CacheLayout plan_cache_layout(const ModelConfig& config, CacheFormat format);

}  // namespace dsv4
