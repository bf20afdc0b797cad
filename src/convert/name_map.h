// Where each GGUF tensor of the `deepseek4` catalog comes from in the official checkpoint.
// GGUF names come from model/tensor_catalog.h; this file only knows DeepSeek's names
// (shared/spec/deepseek-v4-architecture.md §7): `layers.N.` for trunk blocks, `mtp.K.` for
// the MTP blocks that follow them.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/tensor_catalog.h"

namespace dsv4::convert {

enum class SourceLayout {
  Single,        // one official tensor of shape reversed(ne)
  ExpertStack,   // ne[2] official tensors, expert e giving rows [e*ne[1], (e+1)*ne[1])
  ColumnConcat,  // official tensors [ne[1], ne[0]/k] side by side along the row (MTP eh_proj)
  Index,         // one official integer tensor (tid2eid) of shape reversed(ne)
  EngramRows,    // V4.1 engram.embed: FP8 [rows, dim] with one E8M0 scale per (row, 32 values)
};

struct TensorSource {
  SourceLayout layout = SourceLayout::Single;
  std::vector<std::string> names;           // official weight names, in order
  std::vector<uint64_t> part_shape;         // logical outer-first shape of each part
};

// "layers.3." for a trunk block, "mtp.0." for the first MTP block (V4.1: DSpark stage).
std::string official_block_prefix(const ModelConfig& config, uint32_t block);

// The official source of a catalog tensor; nullopt for the optional MTP copies of the
// embedding and head, which the official checkpoint does not have (it shares the trunk's).
std::optional<TensorSource> official_source(const ModelConfig& config, const TensorSpec& spec);

// V4.1: whether an official tensor belongs to the vision side (tower, aligner, image
// delimiters, image-token routing bias), which a recipe may drop.
bool is_official_vision_tensor(std::string_view name);

}  // namespace dsv4::convert
