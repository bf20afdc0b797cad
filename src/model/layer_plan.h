// What each block of a DeepSeek-V4 model computes, decided once at load from the config
// (spec §1.1, §2.5, §3, §4): the forward pass dispatches on this plan instead of asking the
// config about ratios, and the cache manager sizes every sequence's state from it.
//
// The cache is described as lists of growing rows (compressed KV entries, indexer keys),
// compressor states and window rings, each with an id; a block names the ids it writes and
// reads. In V4 every compressed block owns its lists. In V4.1 (shared/spec/deepseek-v41.md
// §3.3-3.5) only a KV source owns a compressor, a compressed-KV list and an index-key
// list (keys from the compressed latent, no compressor of their own); its consumers name
// the same list ids, so one list is written by the source and read by every consumer.
// Selections (index top-k, candidate blocks) live for one step: an index source computes
// one and the blocks after it reuse it, so the plan names whose selection a block uses.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "model/config.h"

namespace dsv4 {

struct LayerPlan {
  uint32_t block = 0;
  bool mtp = false;
  AttentionKind attention = AttentionKind::Window;
  int ratio = 0;              // tokens per compressed entry; 0 for window-only blocks
  bool overlap = false;       // the compressor pools two blocks (ratio 4, spec §3.3)
  bool indexer = false;       // V4 CSA: the lightning indexer and its own compressor (§3.6);
                              // V4.1: an index source (runs indexer queries and weights)
  backend::RopeParams rope;   // the "main" table (window-only, MTP) or "compress" (YaRN)
  bool hash_routing = false;  // experts from tid2eid (§4.2)
  float swiglu_limit = 0;
  float swiglu_limit_shared = 0;

  // Cache ids (-1: none): the window ring, the compressed-KV list this block writes and
  // attends, the indexer-key list, and the compressor states it feeds.
  int32_t ring = -1;
  int32_t kv_list = -1;
  int32_t key_list = -1;
  int32_t kv_state = -1;
  int32_t key_state = -1;

  // V4.1 roles (all false / -1 for V4).
  bool kv_source = false;          // owns the compressor; writes kv_list and key_list
  bool candidate_source = false;   // publishes the step's candidate blocks (§3.4)
  bool uses_candidates = false;    // masks its index scores with those blocks
  int32_t kv_source_block = -1;    // whose compressed cache and index keys it reads
  int32_t selection_block = -1;    // whose index selection it attends (itself if indexer)
  int32_t engram = -1;             // its Engram layer (EngramConfig order), -1: none
};

// A list of rows that grows by one row per `ratio` tokens.
struct CacheListPlan {
  uint32_t block = 0;   // the block that writes it
  uint32_t width = 0;   // floats per row
  int ratio = 0;
  bool index_keys = false;  // indexer keys (else compressed KV entries)
};

// One compressor's state: kv and score, each [overlap * ratio, overlap * width] fp32.
struct CompressorStatePlan {
  uint32_t block = 0;
  uint32_t rows = 0;
  uint32_t cols = 0;
};

struct ModelPlan {
  std::vector<LayerPlan> layers;  // trunk then MTP blocks, indexed by block
  std::vector<CacheListPlan> lists;
  std::vector<CompressorStatePlan> states;
  uint32_t window = 0;     // ring slots of every block
  uint32_t ring_width = 0; // head_dim
  uint32_t n_rings = 0;    // one per block
  // V4.1: each sublayer's input is collapsed with the previous site's `pre` (§3.5), RMS
  // eps from the file (1e-20), QAT rules of the V4.1 reference (window KV FP8 over all
  // dims in blocks of 32, compressed KV FP4 with E4M3 scales per 16, no Hadamard).
  bool v41 = false;

  // `config` must be valid.
  static ModelPlan build(const ModelConfig& config);
  int max_ratio() const;   // the largest compress ratio (1 when there is none)
};

}  // namespace dsv4
