// Compressed-KV grafts (docs/STEERING.md): fabricated rows planted in a sequence's
// compressed caches before its first token, as if a context had been prefilled, without
// prefilling it.
//
// A bank covers some compressed layers; layer l carries N_l rows of compressed KV (and, on
// CSA layers, N_l indexer keys, so the indexer can select them). The graft's footprint F =
// max over covered layers of N_l * ratio_l: a grafted sequence starts at position F, with
// no window before it and empty compressor states; layer l's rows sit in its entries
// F / ratio_l - N_l ... F / ratio_l - 1 (for a bank made from a prompt, N_l = F / ratio_l:
// the first N_l entries, exactly the rows prefilling the prompt left there), and entries
// below them do not exist. Which entry index a row occupies changes no attention result:
// its rotation is part of the row.
//
// File: a GGUF with keys graft.version (1), graft.model.identity (ModelConfig::identity()),
// graft.layers (I32 array of covered blocks), graft.slots (I32 array, N_l in the same
// order), graft.footprint (U64, F), and F32 tensors graft.kv.<layer> [N_l, head_dim] and,
// for CSA layers, graft.index.<layer> [N_l, index_head_dim]. A bank for another model, a
// wrong width, a non-finite value or an inconsistent footprint is refused.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "util/status.h"

namespace dsv4 {

struct KvGraftLayer {
  uint32_t block = 0;
  int64_t slots = 0;          // N_l
  std::vector<float> kv;      // [slots, head_dim]
  std::vector<float> keys;    // [slots, index_head_dim] on CSA layers, else empty
};

struct KvGraft {
  std::string model_identity;
  int64_t footprint = 0;      // F
  std::vector<KvGraftLayer> layers;  // ascending blocks
  uint64_t hash = 0;          // of the rows and slot counts: part of a prefix cache's key

  static Result<KvGraft> read(const std::string& path, const ModelConfig& config);
  Status write(const std::string& path, bool overwrite = false) const;
  // F from the slot counts, the hash from the rows; checks shapes against the model.
  Status finalize(const ModelConfig& config);
  const KvGraftLayer* find(uint32_t block) const;
};

}  // namespace dsv4
