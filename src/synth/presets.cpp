#include "synth/presets.h"

#include "model/engram.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>

namespace dsv4 {
namespace {

constexpr uint32_t kDeepSeekV4Vocab = 129280;
// Engram ids of DeepSeek's tokenizer (text/engram_vocab.h), and its tokens V4.1 names.
constexpr uint32_t kDeepSeekCompressedVocab = 99092;
constexpr uint32_t kV41ImageToken = 129264;
constexpr uint32_t kV41DsparkNoiseToken = 128799;

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

constexpr std::array<std::string_view, 8> kNames = {"tiny",   "interop", "small",   "flash",
                                                     "pro",    "tiny41",  "small41", "flash41"};

// ---- V4.1 (deepseek41) ----

// What every V4.1 geometry shares with the release (shared/spec/deepseek-v41.md §3.1).
ModelConfig common_v41() {
  ModelConfig c = common_v4();
  c.variant = ModelVariant::V41;
  c.rms_eps = 1e-20f;
  c.n_hash_layers = 0;
  c.n_mtp = 3;  // DSpark stages
  return c;
}

// Table rows = the sum of each layer's bucket primes (they depend on the other fields).
void set_engram_rows(EngramConfig& e) {
  e.table_rows.clear();
  auto k = compute_engram_hash_constants(e);
  for (const auto& primes : k->primes) {
    uint64_t sum = 0;
    for (uint64_t p : primes) sum += p;
    e.table_rows.push_back(sum);
  }
}

EngramConfig release_engram(std::vector<uint32_t> layers, uint64_t hash_vocab_size) {
  EngramConfig e;
  e.layers = std::move(layers);
  e.dim = 256;
  e.ngram = 4;
  e.heads = 8;
  e.hash_vocab_size = hash_vocab_size;
  e.compressed_vocab_size = kDeepSeekCompressedVocab;
  e.pad_token_id = 2;
  set_engram_rows(e);
  return e;
}

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

// DeepSeek-V4-Pro, spec §1.4 (the official Pro config.json); the vocabulary is Flash's
// 129,280 (the published model cards list it). No window-only trunk layer: layers 0 and 1
// are HCA, then CSA on even and HCA on odd layers up to the last (60, CSA).
ModelConfig pro_config() {
  ModelConfig c = common_v4();
  c.name = "DeepSeek-V4-Pro geometry (synthetic)";
  c.hidden = 7168;
  c.n_layers = 61;
  c.context_length = 1048576;
  c.n_heads = 128;
  c.head_dim = 512;
  c.q_lora_rank = 1536;
  c.o_lora_rank = 1024;
  c.o_groups = 16;
  c.sliding_window = 128;
  c.compress_ratios = {128, 128};
  for (uint32_t layer = 2; layer < c.n_layers; ++layer)
    c.compress_ratios.push_back(layer % 2 == 0 ? 4 : 128);
  c.compress_ratios.push_back(0);  // MTP
  c.rope.yarn_factor = 16;
  c.rope.yarn_original_context = 65536;
  c.index_heads = 64;
  c.index_head_dim = 128;
  c.index_topk = 1024;
  c.n_experts = 384;
  c.n_experts_used = 6;
  c.expert_ffn = 3072;
  c.routed_scale = 2.5f;
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

// The tiny-v41 fixture's layer schedule (KV sources 2 and 4, index sources 2, 4, 6,
// candidates at 4, Engram on 1 and 2, three DSpark stages) with DeepSeek's vocabulary.
ModelConfig tiny41_config() {
  ModelConfig c = common_v41();
  c.name = "dsv4 tiny41 (synthetic)";
  c.hidden = 256;
  c.n_layers = 7;
  c.context_length = 4096;
  c.n_heads = 4;
  c.head_dim = 128;
  c.rope.dims = 32;
  c.q_lora_rank = 64;
  c.o_lora_rank = 64;
  c.o_groups = 2;
  c.sliding_window = 16;
  c.compress_ratios = {0, 0, 2, 2, 1, 1, 1, 0, 0, 0};
  c.rope.yarn_factor = 4;
  c.rope.yarn_original_context = 64;
  c.index_heads = 8;
  c.index_head_dim = 64;
  c.index_topk = 8;
  c.n_experts = 8;
  c.n_experts_used = 3;
  c.expert_ffn = 128;
  c.kv_source_layers = {2, 4};
  c.index_source_layers = {2, 4, 6};
  c.candidate = CandidateConfig{4, 4, 3};
  c.engram = release_engram({1, 2}, 150);
  c.engram->dim = 64;
  c.dspark = DsparkConfig{5, 32, 4, 2, kV41DsparkNoiseToken, {4, 5, 6}};
  c.vision = VisionConfig{.image_token_id = kV41ImageToken};
  set_uniform_swiglu(c, 10.0f);
  return c;
}

// V4.1-Flash's schedule in miniature: window layers, a ratio-2 encoder with two sources,
// a ratio-1 decoder with the candidate source, Flash's window, head and Engram widths.
ModelConfig small41_config() {
  ModelConfig c = common_v41();
  c.name = "dsv4 small41 (synthetic)";
  c.hidden = 1024;
  c.n_layers = 10;
  c.context_length = 65536;
  c.n_heads = 8;
  c.head_dim = 512;
  c.q_lora_rank = 320;
  c.o_lora_rank = 256;
  c.o_groups = 2;
  c.sliding_window = 128;
  c.compress_ratios = {0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0};
  c.rope.yarn_factor = 16;
  c.rope.yarn_original_context = 4096;
  c.index_heads = 8;
  c.index_head_dim = 128;
  c.index_topk = 128;
  c.n_experts = 32;
  c.n_experts_used = 6;
  c.expert_ffn = 512;
  c.kv_source_layers = {2, 4, 6};
  c.index_source_layers = {2, 4, 6, 8};
  c.candidate = CandidateConfig{6, 8, 64};
  c.engram = release_engram({1, 4}, 20000);
  c.dspark = DsparkConfig{5, 64, 8, 2, kV41DsparkNoiseToken, {7, 8, 9}};
  c.vision = VisionConfig{.image_token_id = kV41ImageToken};
  set_uniform_swiglu(c, 10.0f);
  return c;
}

// DeepSeek-V4.1-Flash (shared/spec/deepseek-v41.md §3.1, the release's config.json).
ModelConfig flash41_config() {
  ModelConfig c = common_v41();
  c.name = "DeepSeek-V4.1-Flash geometry (synthetic)";
  c.hidden = 5120;
  c.n_layers = 40;
  c.context_length = 1048576;
  c.n_heads = 64;
  c.head_dim = 512;
  c.q_lora_rank = 1280;
  c.o_lora_rank = 1024;
  c.o_groups = 8;
  c.sliding_window = 128;
  c.compress_ratios = {0, 0};
  for (uint32_t layer = 2; layer < c.n_layers; ++layer) c.compress_ratios.push_back(layer < 20 ? 2 : 1);
  c.compress_ratios.insert(c.compress_ratios.end(), {0, 0, 0});  // DSpark stages
  c.rope.yarn_factor = 16;
  c.rope.yarn_original_context = 65536;
  c.index_heads = 32;
  c.index_head_dim = 128;
  c.index_topk = 512;
  c.n_experts = 384;
  c.n_experts_used = 6;
  c.expert_ffn = 2304;
  c.kv_source_layers = {2, 8, 14, 20};
  c.index_source_layers = {2, 8, 14, 20, 24, 28, 32, 36};
  c.candidate = CandidateConfig{20, 8, 2048};
  c.engram = release_engram({1, 14}, 16000000);
  c.dspark = DsparkConfig{5, 256, 128, 3, kV41DsparkNoiseToken, {37, 38, 39}};
  c.vision = VisionConfig{.image_token_id = kV41ImageToken};
  set_uniform_swiglu(c, 10.0f);
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
  if (name == "pro")
    return Preset{"pro", "DeepSeek-V4-Pro (hidden 7168, 61 layers + MTP, 384 experts)",
                  pro_config(), GgmlType::Q2_K, GgmlType::Q8_0};
  if (name == "tiny41")
    return Preset{"tiny41", "the tiny-v41 fixture's schedule (hidden 256, 7 layers + 3 DSpark), real vocabulary",
                  tiny41_config(), GgmlType::Q8_0, GgmlType::Q8_0};
  if (name == "small41")
    return Preset{"small41", "V4.1 in miniature: hidden 1024, 10 layers + 3 DSpark, 32 experts, Engram (CPU benchmarks)",
                  small41_config(), GgmlType::Q2_K, GgmlType::Q8_0};
  if (name == "flash41")
    return Preset{"flash41", "DeepSeek-V4.1-Flash (hidden 5120, 40 layers + 3 DSpark, 384 experts, Engram)",
                  flash41_config(), GgmlType::Q2_K, GgmlType::Q8_0};
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
  if (c.is_v41()) {
    // Sources, Engram layers and DSpark targets beyond the cut go with their layers.
    auto keep = [n_layers](std::vector<uint32_t>& xs) { std::erase_if(xs, [&](uint32_t x) { return x >= n_layers; }); };
    keep(c.kv_source_layers);
    keep(c.index_source_layers);
    if (c.candidate && c.candidate->source_layer >= n_layers) c.candidate.reset();
    if (c.engram) {
      std::vector<uint64_t> rows;
      for (size_t i = 0; i < c.engram->layers.size(); ++i)
        if (c.engram->layers[i] < n_layers) rows.push_back(c.engram->table_rows[i]);
      keep(c.engram->layers);
      c.engram->table_rows = rows;
      if (c.engram->layers.empty()) c.engram.reset();
    }
    if (c.dspark)
      for (size_t i = 0; i < c.dspark->target_layers.size(); ++i)
        c.dspark->target_layers[i] = std::min(c.dspark->target_layers[i], n_layers - 1);
  }
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
