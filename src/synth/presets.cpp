#include "synth/presets.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>

namespace dsv4 {
namespace {

constexpr uint32_t kDeepSeekV4Vocab = 129280;

ModelConfig common_v4() {
  ModelConfig c;
  c.variant = ModelVariant::V4;
  c.vocab_size = kDeepSeekV4Vocab;
  c.rope.freq_base = 10000;
  c.rope.compress_freq_base = 160000;
  c.rope.dims = 64;
  c.rope.yarn_beta_fast = 32;
  c.rope.yarn_beta_slow = 1;
  c.rms_eps = 1e-6f;
  c.n_shared_experts = 1;
  c.routed_scale = 1.5f;
  c.norm_topk = true;
  c.hc_mult = 4;
  c.hc_sinkhorn_iters = 20;
  c.hc_eps = 1e-6f;
  c.n_mtp = 1;
  return c;
}

void set_uniform_swiglu(ModelConfig& c, float limit) {
  c.swiglu_limit.assign(c.n_blocks(), limit);
  c.swiglu_limit_shared.assign(c.n_blocks(), limit);
}

constexpr std::array<std::string_view, 4> kNames = {"tiny", "interop", "small", "flash"};

}  // namespace

// Spec §8 / fixtures/tiny-v4, but with DeepSeek-V4's real 129,280-token vocabulary so the
// built-in model tokenizes real text, and a 4,096-token context (the YaRN parameters
// stay the fixture's; positions past factor x original are still well defined).
ModelConfig tiny_config() {
  ModelConfig c = common_v4();
  c.name = "dsv4 tiny (synthetic)";
  c.hidden = 256;
  c.n_layers = 6;
  c.context_length = 4096;
  c.n_heads = 4;
  c.head_dim = 256;
  c.q_lora_rank = 64;
  c.o_lora_rank = 32;
  c.o_groups = 2;
  c.sliding_window = 8;
  c.compress_ratios = {0, 4, 16, 4, 16, 0, 0};
  c.rope.yarn_factor = 4;
  c.rope.yarn_original_context = 64;
  c.index_heads = 4;
  c.index_head_dim = 128;
  c.index_topk = 3;
  c.n_experts = 8;
  c.n_experts_used = 2;
  c.expert_ffn = 128;
  c.n_hash_layers = 2;
  set_uniform_swiglu(c, 10.0f);
  return c;
}

// All three layer kinds in Flash's order (two window layers, then CSA/HCA alternating),
// Flash's window, ratios, head and indexer widths, at a quarter of its hidden size.
ModelConfig small_config() {
  ModelConfig c = common_v4();
  c.name = "dsv4 small (synthetic)";
  c.hidden = 1024;
  c.n_layers = 8;
  c.context_length = 65536;
  c.n_heads = 8;
  c.head_dim = 256;
  c.q_lora_rank = 256;
  c.o_lora_rank = 256;
  c.o_groups = 2;
  c.sliding_window = 128;
  c.compress_ratios = {0, 0, 4, 128, 4, 128, 4, 128, 0};
  c.rope.yarn_factor = 16;
  c.rope.yarn_original_context = 4096;
  c.index_heads = 16;
  c.index_head_dim = 128;
  c.index_topk = 128;
  c.n_experts = 32;
  c.n_experts_used = 4;
  c.expert_ffn = 512;
  c.n_hash_layers = 3;
  set_uniform_swiglu(c, 10.0f);
  return c;
}

// DeepSeek-V4-Flash, spec §1.1.
ModelConfig flash_config() {
  ModelConfig c = common_v4();
  c.name = "DeepSeek-V4-Flash geometry (synthetic)";
  c.hidden = 4096;
  c.n_layers = 43;
  c.context_length = 1048576;
  c.n_heads = 64;
  c.head_dim = 512;
  c.q_lora_rank = 1024;
  c.o_lora_rank = 1024;
  c.o_groups = 8;
  c.sliding_window = 128;
  c.compress_ratios = {0, 0};
  for (uint32_t layer = 2; layer < c.n_layers; ++layer)
    c.compress_ratios.push_back(layer % 2 == 0 ? 4 : 128);
  c.compress_ratios.push_back(0);  // MTP
  c.rope.yarn_factor = 16;
  c.rope.yarn_original_context = 65536;
  c.index_heads = 64;
  c.index_head_dim = 128;
  c.index_topk = 512;
  c.n_experts = 256;
  c.n_experts_used = 6;
  c.expert_ffn = 2048;
  c.n_hash_layers = 3;
  set_uniform_swiglu(c, 10.0f);
  return c;
}

// The tiny geometry with the compression ratios llama.cpp's deepseek4 loader accepts (0, 4
// and 128 only): the models of the llama.cpp interoperability tests (tests/llamacpp/).
ModelConfig interop_config() {
  ModelConfig c = tiny_config();
  c.name = "dsv4 interop (synthetic)";
  c.compress_ratios = {0, 4, 128, 4, 128, 0, 0};
  return c;
}

std::span<const std::string_view> preset_names() { return kNames; }

Result<Preset> find_preset(std::string_view name) {
  if (name == "tiny")
    return Preset{"tiny", "fixture geometry (hidden 256, 6 layers + MTP), real vocabulary",
                  tiny_config(), GgmlType::Q8_0, GgmlType::Q8_0};
  if (name == "interop")
    return Preset{"interop", "tiny geometry with llama.cpp's ratios (0, 4, 128): interoperability tests",
                  interop_config(), GgmlType::Q8_0, GgmlType::Q8_0};
  if (name == "small")
    return Preset{"small", "hidden 1024, 8 layers + MTP, 32 experts top-4 (CPU benchmarks)",
                  small_config(), GgmlType::Q2_K, GgmlType::Q8_0};
  if (name == "flash")
    return Preset{"flash", "DeepSeek-V4-Flash (hidden 4096, 43 layers + MTP, 256 experts)",
                  flash_config(), GgmlType::Q2_K, GgmlType::Q8_0};
  return Status::errorf("unknown preset \"{}\" (known: {})", name, fmt::join(kNames, ", "));
}

Result<ModelConfig> keep_first_layers(const ModelConfig& config, uint32_t n_layers) {
  if (n_layers == 0 || n_layers > config.n_layers)
    return Status::errorf("--layers {}: must be between 1 and the model's {} layers", n_layers,
                          config.n_layers);
  ModelConfig c = config;
  c.n_layers = n_layers;
  auto cut = [&](auto& per_block) {
    auto v = per_block;
    per_block.assign(v.begin(), v.begin() + n_layers);
    per_block.insert(per_block.end(), v.begin() + config.n_layers, v.end());
  };
  cut(c.compress_ratios);
  cut(c.swiglu_limit);
  cut(c.swiglu_limit_shared);
  c.n_hash_layers = std::min(c.n_hash_layers, n_layers);
  return c;
}

ModelConfig without_mtp(const ModelConfig& config) {
  ModelConfig c = config;
  c.n_mtp = 0;
  c.compress_ratios.resize(c.n_layers);
  c.swiglu_limit.resize(std::min<size_t>(c.swiglu_limit.size(), c.n_layers));
  c.swiglu_limit_shared.resize(std::min<size_t>(c.swiglu_limit_shared.size(), c.n_layers));
  return c;
}

}  // namespace dsv4
