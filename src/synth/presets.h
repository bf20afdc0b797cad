// Built-in model geometries: `tiny` (the fixture's shapes with the real vocabulary; the
// built-in default model), `small` (a mid-size model for CPU benchmarks), `flash`
// (DeepSeek-V4-Flash exactly, spec §1.1) and `pro` (DeepSeek-V4-Pro, §1.4); for V4.1 `tiny41`, `small41` and `flash41`
// (DeepSeek-V4.1-Flash exactly). `dsv4 synth` and `dsv4 info --preset` use them.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "gguf/ggml_types.h"
#include "model/config.h"
#include "util/status.h"

namespace dsv4 {

struct Preset {
  std::string_view name;
  std::string_view description;
  ModelConfig config;
  GgmlType default_expert_type;  // routed-expert stacks
  GgmlType default_dense_type;   // every other matrix
};

std::span<const std::string_view> preset_names();  // "tiny", "small", "flash", "pro", "tiny41", ...
Result<Preset> find_preset(std::string_view name);  // error lists the known names

ModelConfig tiny_config();
ModelConfig interop_config();  // tiny with ratios 0 / 4 / 128 (what llama.cpp accepts)
ModelConfig small_config();
ModelConfig flash_config();
ModelConfig pro_config();  // DeepSeek-V4-Pro (spec §1.4)
// V4.1 (deepseek41): the tiny-v41 fixture's schedule, a CPU-benchmark size, V4.1-Flash.
ModelConfig tiny41_config();
ModelConfig small41_config();
ModelConfig flash41_config();

// Keeps the first `n_layers` trunk layers (and the MTP blocks), for benchmarks that
// compare per-layer cost on the full geometry. Hash layers beyond the cut are dropped;
// for V4.1 so are sources, the candidate source and Engram layers beyond it, and DSpark
// targets beyond it move to the last kept layer.
Result<ModelConfig> keep_first_layers(const ModelConfig& config, uint32_t n_layers);

// The trunk alone: no MTP block (a trunk-only file, as llama.cpp loads one without its
// sidecar).
ModelConfig without_mtp(const ModelConfig& config);

}  // namespace dsv4
