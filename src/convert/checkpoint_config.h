// The official checkpoint's config.json (Hugging Face form, DeepSeek-V4 keys; see
// shared/spec/checkpoint-tokenizer-chat.md §2.3) read into a ModelConfig, and written
// back from one (the synthetic checkpoint writer uses that). V4.1 (model_type
// deepseek_v41) nests the text model under text_config, with the release's V4.1 keys
// (kv_source_layer_ids, candidate_*, engram_*, dspark_*), image_token_id and
// vision_config at the root, and quantization_config.expert_dtype.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

#include "model/config.h"
#include "util/status.h"

namespace dsv4::convert {

// How the checkpoint stores its linears, from `quantization_config` and `expert_dtype`.
struct CheckpointFormat {
  uint32_t fp8_block_rows = 128;  // weight_block_size [rows, cols] of the FP8 scales
  uint32_t fp8_block_cols = 128;
  bool experts_fp4 = true;        // expert_dtype "fp4" (packed E2M1 + E8M0 per 32)
};

struct CheckpointConfig {
  ModelConfig model;
  CheckpointFormat format;
  uint32_t bos_token_id = 0;
  uint32_t eos_token_id = 1;
  bool has_vision_tower = false;  // V4.1: vision_config with layers (vision.*, aligner.*, gate.bias_vl)
};

// `source` names the file in errors ("checkpoint/config.json: key hidden_size: ...").
Result<CheckpointConfig> parse_checkpoint_config(std::string_view json_text, std::string_view source);
Result<CheckpointConfig> read_checkpoint_config(const std::filesystem::path& checkpoint_dir);

// The config.json an official checkpoint of this configuration carries (same keys and key
// order as V4-Flash's file). parse_checkpoint_config() of it gives `config` back.
std::string checkpoint_config_json(const CheckpointConfig& config);

}  // namespace dsv4::convert
