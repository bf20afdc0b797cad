// What each block of a DeepSeek-V4 model computes, decided once at load from the config
// (spec §1.1, §2.5, §3, §4): the forward pass dispatches on this plan instead of asking the
// config about ratios, and the cache manager sizes every sequence's state from it.
//
// The cache is described as lists of growing rows (compressed KV entries, indexer keys),
// compressor states and window rings, each with an id; a block names the ids it writes and
// reads. In V4 every compressed block owns its lists; V4.1's shared KV and index sources
// map several blocks to one source block's lists, which this layout allows without change.
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
  bool indexer = false;       // CSA: the lightning indexer and its own compressor (§3.6)
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

  // `config` must be valid.
  static ModelPlan build(const ModelConfig& config);
  int max_ratio() const;   // the largest compress ratio (1 when there is none)
};

}  // namespace dsv4
