#include "model/config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <bit>
#include <limits>
#include <optional>
#include <span>

#include "gguf/gguf_file.h"
#include "gguf/gguf_writer.h"
#include "model/tensor_catalog.h"

namespace dsv4 {
namespace {

// llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS: score = sqrt(softplus(logit)).
constexpr uint64_t kGatingSqrtSoftplus = 4;
// The release's swiglu_limit, for V4.1 files that do not store it.
constexpr float kV41SwigluLimit = 10.0f;

// Reads `<arch>.<key>` with the arch prefix and the file name in every message.
class KeyReader {
 public:
  KeyReader(const gguf::GgufFile& file, std::string arch) : file_(file), arch_(std::move(arch)) {}

  std::string key(std::string_view k) const { return fmt::format("{}.{}", arch_, k); }
  bool has(std::string_view k) const { return file_.find(key(k)) != nullptr; }
  // The first of several spellings of one key that the file has, or nullopt.
  std::optional<std::string_view> first_of(std::span<const std::string_view> spellings) const {
    for (std::string_view k : spellings)
      if (has(k)) return k;
    return std::nullopt;
  }

  Result<uint32_t> u32(std::string_view k) const {
    DSV4_ASSIGN_OR_RETURN(uint64_t v, file_.get_uint(key(k)));
    if (v > std::numeric_limits<uint32_t>::max())
      return Status::errorf("{}: key {}: value {} does not fit in 32 bits", file_.path(), key(k), v);
    return static_cast<uint32_t>(v);
  }
  Result<uint64_t> u64(std::string_view k) const { return file_.get_uint(key(k)); }
  Result<double> f64(std::string_view k) const { return file_.get_float(key(k)); }
  Result<float> f32(std::string_view k) const {
    DSV4_ASSIGN_OR_RETURN(double v, file_.get_float(key(k)));
    return static_cast<float>(v);
  }
  Result<bool> boolean(std::string_view k) const { return file_.get_bool(key(k)); }
  Result<std::string> str(std::string_view k) const { return file_.get_string(key(k)); }

  // A per-block float list: an array with at least n entries (the first n are used), or
  // one scalar for every block (llama.cpp's get_key_or_arr).
  Result<std::vector<float>> per_block_floats(std::string_view k, uint32_t n) const {
    const gguf::Value* v = file_.find(key(k));
    if (v && !v->is_array()) {
      DSV4_ASSIGN_OR_RETURN(float x, f32(k));
      return std::vector<float>(n, x);
    }
    DSV4_ASSIGN_OR_RETURN(std::vector<double> xs, file_.get_float_array(key(k)));
    if (xs.size() < n)
      return Status::errorf("{}: key {}: {} entries, block_count needs {}", file_.path(), key(k),
                            xs.size(), n);
    return std::vector<float>(xs.begin(), xs.begin() + n);
  }

  const gguf::GgufFile& file() const { return file_; }

 private:
  const gguf::GgufFile& file_;
  std::string arch_;
};

// The deepseek4 keys. A V4.1 file (c.variant already set) may omit the keys that
// Metrale's deepseek41 files do not write; they take the release's values.
Status parse_v4(const KeyReader& r, std::optional<uint32_t> mtp_blocks, ModelConfig& c) {
  const auto& file = r.file();
  const bool v41 = c.variant == ModelVariant::V41;
  DSV4_ASSIGN_OR_RETURN(uint32_t block_count, r.u32("block_count"));
  c.n_mtp = 0;
  if (mtp_blocks) {
    c.n_mtp = *mtp_blocks;
  } else if (r.has("nextn_predict_layers")) {
    DSV4_ASSIGN_OR_RETURN(c.n_mtp, r.u32("nextn_predict_layers"));
  }
  if (c.n_mtp >= block_count)
    return Status::errorf("{}: key {}: {} MTP blocks leave no trunk layer of block_count {}",
                          file.path(), r.key("nextn_predict_layers"), c.n_mtp, block_count);
  c.n_layers = block_count - c.n_mtp;

  DSV4_ASSIGN_OR_RETURN(c.context_length, r.u64("context_length"));
  DSV4_ASSIGN_OR_RETURN(c.hidden, r.u32("embedding_length"));
  if (r.has("vocab_size")) {
    DSV4_ASSIGN_OR_RETURN(c.vocab_size, r.u32("vocab_size"));
  } else if (const auto* embd = file.find_tensor("token_embd.weight"); embd && embd->ne.size() >= 2) {
    c.vocab_size = static_cast<uint32_t>(embd->ne[1]);
  } else {
    return Status::errorf("{}: key {} is missing and there is no token_embd.weight to take the "
                          "vocabulary size from", file.path(), r.key("vocab_size"));
  }

  DSV4_ASSIGN_OR_RETURN(c.n_heads, r.u32("attention.head_count"));
  DSV4_ASSIGN_OR_RETURN(uint32_t kv_heads, r.u32("attention.head_count_kv"));
  if (kv_heads != 1)
    return Status::errorf("{}: key {}: {} KV heads, DeepSeek-V4 has 1", file.path(),
                          r.key("attention.head_count_kv"), kv_heads);
  DSV4_ASSIGN_OR_RETURN(c.head_dim, r.u32("attention.key_length"));
  DSV4_ASSIGN_OR_RETURN(uint32_t value_length, r.u32("attention.value_length"));
  if (value_length != c.head_dim)
    return Status::errorf("{}: key {}: {} differs from attention.key_length {} (K = V)",
                          file.path(), r.key("attention.value_length"), value_length, c.head_dim);
  DSV4_ASSIGN_OR_RETURN(c.q_lora_rank, r.u32("attention.q_lora_rank"));
  DSV4_ASSIGN_OR_RETURN(c.o_lora_rank, r.u32("attention.output_lora_rank"));
  DSV4_ASSIGN_OR_RETURN(c.o_groups, r.u32("attention.output_group_count"));
  DSV4_ASSIGN_OR_RETURN(c.sliding_window, r.u32("attention.sliding_window"));
  DSV4_ASSIGN_OR_RETURN(c.rms_eps, r.f32("attention.layer_norm_rms_epsilon"));

  DSV4_ASSIGN_OR_RETURN(std::vector<uint64_t> ratios,
                        file.get_uint_array(r.key("attention.compress_ratios")));
  if (ratios.size() < block_count)
    return Status::errorf("{}: key {}: {} entries, shorter than block_count {}", file.path(),
                          r.key("attention.compress_ratios"), ratios.size(), block_count);
  c.compress_ratios.clear();
  for (uint32_t i = 0; i < block_count; ++i) {
    if (ratios[i] > std::numeric_limits<uint32_t>::max())
      return Status::errorf("{}: key {}: entry {} is {}", file.path(),
                            r.key("attention.compress_ratios"), i, ratios[i]);
    c.compress_ratios.push_back(static_cast<uint32_t>(ratios[i]));
  }

  DSV4_ASSIGN_OR_RETURN(c.rope.dims, r.u32("rope.dimension_count"));
  DSV4_ASSIGN_OR_RETURN(c.rope.freq_base, r.f64("rope.freq_base"));
  DSV4_ASSIGN_OR_RETURN(c.rope.compress_freq_base, r.f64("attention.compress_rope_freq_base"));
  if (!v41 || r.has("rope.scaling.type")) {
    DSV4_ASSIGN_OR_RETURN(std::string scaling, r.str("rope.scaling.type"));
    if (scaling != "yarn")
      return Status::errorf("{}: key {}: \"{}\", expected \"yarn\"", file.path(),
                            r.key("rope.scaling.type"), scaling);
    DSV4_ASSIGN_OR_RETURN(c.rope.yarn_factor, r.f64("rope.scaling.factor"));
    DSV4_ASSIGN_OR_RETURN(c.rope.yarn_original_context, r.u32("rope.scaling.original_context_length"));
    DSV4_ASSIGN_OR_RETURN(c.rope.yarn_beta_fast, r.f64("rope.scaling.yarn_beta_fast"));
    DSV4_ASSIGN_OR_RETURN(c.rope.yarn_beta_slow, r.f64("rope.scaling.yarn_beta_slow"));
  }  // else the RopeConfig defaults: the release's YaRN x16 over 65,536, beta 32/1

  DSV4_ASSIGN_OR_RETURN(c.index_heads, r.u32("attention.indexer.head_count"));
  DSV4_ASSIGN_OR_RETURN(c.index_head_dim, r.u32("attention.indexer.key_length"));
  DSV4_ASSIGN_OR_RETURN(c.index_topk, r.u32("attention.indexer.top_k"));

  DSV4_ASSIGN_OR_RETURN(c.n_experts, r.u32("expert_count"));
  DSV4_ASSIGN_OR_RETURN(c.n_experts_used, r.u32("expert_used_count"));
  if (!v41 || r.has("expert_shared_count")) {
    DSV4_ASSIGN_OR_RETURN(c.n_shared_experts, r.u32("expert_shared_count"));
  } else {
    c.n_shared_experts = 1;
  }
  DSV4_ASSIGN_OR_RETURN(c.expert_ffn, r.u32("expert_feed_forward_length"));
  DSV4_ASSIGN_OR_RETURN(c.routed_scale, r.f32("expert_weights_scale"));
  DSV4_ASSIGN_OR_RETURN(c.norm_topk, r.boolean("expert_weights_norm"));
  DSV4_ASSIGN_OR_RETURN(uint64_t gating, r.u64("expert_gating_func"));
  if (gating != kGatingSqrtSoftplus)
    return Status::errorf("{}: key {}: {}, DeepSeek-V4 needs {} (sqrt-softplus)", file.path(),
                          r.key("expert_gating_func"), gating, kGatingSqrtSoftplus);
  c.n_hash_layers = 0;
  if (!v41 || r.has("hash_layer_count")) {
    DSV4_ASSIGN_OR_RETURN(c.n_hash_layers, r.u32("hash_layer_count"));
  }
  if (v41 && !r.has("swiglu_clamp_exp")) {
    c.swiglu_limit.assign(block_count, kV41SwigluLimit);
  } else {
    DSV4_ASSIGN_OR_RETURN(c.swiglu_limit, r.per_block_floats("swiglu_clamp_exp", block_count));
  }
  if (r.has("swiglu_clamp_shexp")) {
    DSV4_ASSIGN_OR_RETURN(c.swiglu_limit_shared,
                          r.per_block_floats("swiglu_clamp_shexp", block_count));
  } else {
    c.swiglu_limit_shared = c.swiglu_limit;
  }

  DSV4_ASSIGN_OR_RETURN(c.hc_mult, r.u32("hyper_connection.count"));
  DSV4_ASSIGN_OR_RETURN(c.hc_sinkhorn_iters, r.u32("hyper_connection.sinkhorn_iterations"));
  DSV4_ASSIGN_OR_RETURN(c.hc_eps, r.f32("hyper_connection.epsilon"));
  if (r.has("embedding_length_out")) {
    DSV4_ASSIGN_OR_RETURN(uint64_t out, r.u64("embedding_length_out"));
    if (out != uint64_t{c.hidden} * c.hc_mult)
      return Status::errorf("{}: key {}: {}, expected embedding_length x hyper_connection.count "
                            "= {}", file.path(), r.key("embedding_length_out"), out,
                            uint64_t{c.hidden} * c.hc_mult);
  }
  return Status::ok();
}

bool is_power_of_two(uint32_t x) { return x != 0 && std::has_single_bit(x); }

// ---- V4.1 (deepseek41) ------------------------------------------------------------------
// Published V4.1 files spell the same facts differently (shared/spec/deepseek-v41.md §4.2);
// each list below is one fact's spellings, in order of preference (docs/MODEL-FILES.md).

constexpr std::string_view kKvSourceKeys[] = {
    "kv_source_layer_ids", "attention.kv_source_layer_ids", "attention.kv_source_layers"};
constexpr std::string_view kIndexSourceKeys[] = {
    "index_source_layer_ids", "attention.index_source_layer_ids", "attention.index_source_layers"};
constexpr std::string_view kCandidateSourceKeys[] = {
    "attention.candidate_source_layer_id", "candidate_source_layer_id", "attention.candidate.source_layer"};
constexpr std::string_view kCandidateTopkKeys[] = {
    "attention.candidate_topk_blocks", "candidate_topk_blocks", "attention.candidate.topk_blocks"};
constexpr std::string_view kCandidateBlockKeys[] = {
    "attention.candidate_block_size", "candidate_block_size", "attention.candidate.block_size"};
constexpr std::string_view kEngramLayerKeys[] = {"engram.layer_ids"};
constexpr std::string_view kEngramNgramKeys[] = {"engram.max_ngram_size"};
constexpr std::string_view kEngramHeadKeys[] = {"engram.head_count", "engram.n_heads"};
constexpr std::string_view kEngramDimKeys[] = {"engram.key_length", "engram.head_dim"};
constexpr std::string_view kEngramPadKeys[] = {"engram.pad_id", "engram.pad_token_id"};
constexpr std::string_view kEngramRowKeys[] = {"engram.num_embeddings", "engram.rows"};
constexpr std::string_view kEngramHashVocabKeys[] = {"engram.vocab_size"};
constexpr std::string_view kEngramCompressedKeys[] = {"engram.compressed_vocab_size"};
constexpr std::string_view kEngramTokenMapKeys[] = {"engram.token_map"};
constexpr std::string_view kEngramPrimeKeys[] = {"engram.primes"};
// DSpark: `<arch>.dspark.*`, or `deepseek4.mtp.*` in files that reuse the V4 architecture.
constexpr std::string_view kDsparkBlockKeys[] = {"dspark.block_size", "mtp.block_size"};
constexpr std::string_view kDsparkRankKeys[] = {"dspark.markov_rank", "mtp.markov_rank"};
constexpr std::string_view kDsparkExpertKeys[] = {
    "dspark.expert_count", "dspark.n_routed_experts", "mtp.expert_count", "mtp.n_routed_experts"};
constexpr std::string_view kDsparkUsedKeys[] = {
    "dspark.expert_used_count", "dspark.num_experts_per_tok", "mtp.expert_used_count", "mtp.num_experts_per_tok"};
constexpr std::string_view kDsparkNoiseKeys[] = {"dspark.noise_token_id", "mtp.noise_token_id"};
constexpr std::string_view kDsparkTargetKeys[] = {
    "dspark.target_layer_ids", "mtp.target_layer_ids"};
constexpr std::string_view kImageTokenKeys[] = {"image_token_id", "vision.image_token_id"};

// The release's values, for files that leave the candidate and DSpark settings out.
constexpr uint32_t kReleaseCandidateBlockSize = 8;
constexpr uint32_t kReleaseCandidateTopkBlocks = 2048;
constexpr uint32_t kReleaseDsparkBlockSize = 5;
constexpr uint32_t kReleaseDsparkExpertsUsed = 3;
constexpr uint32_t kReleaseDsparkNoiseToken = 128799;

bool has_any_v41_key(const KeyReader& r) {
  for (std::span<const std::string_view> keys :
       {std::span<const std::string_view>(kKvSourceKeys), std::span<const std::string_view>(kIndexSourceKeys),
        std::span<const std::string_view>(kCandidateSourceKeys), std::span<const std::string_view>(kEngramLayerKeys)})
    if (r.first_of(keys)) return true;
  return false;
}

Result<std::vector<uint32_t>> u32_list(const KeyReader& r, std::string_view k) {
  DSV4_ASSIGN_OR_RETURN(std::vector<uint64_t> xs, r.file().get_uint_array(r.key(k)));
  std::vector<uint32_t> out;
  for (size_t i = 0; i < xs.size(); ++i) {
    if (xs[i] > std::numeric_limits<uint32_t>::max())
      return Status::errorf("{}: key {}: entry {} is {}", r.file().path(), r.key(k), i, xs[i]);
    out.push_back(static_cast<uint32_t>(xs[i]));
  }
  return out;
}

// Trunk blocks with ratio > 0 that hold tensor `kind` (the fallback for source lists).
std::vector<uint32_t> blocks_with_tensor(const gguf::GgufFile& file, const ModelConfig& c, BlockTensor kind) {
  std::vector<uint32_t> out;
  for (uint32_t b = 0; b < c.n_layers; ++b)
    if (c.ratio(b) != 0 && file.find_tensor(block_tensor_name(b, kind))) out.push_back(b);
  return out;
}

Status parse_v41_sources(const KeyReader& r, ModelConfig& c) {
  const auto& file = r.file();
  if (auto k = r.first_of(kKvSourceKeys)) {
    DSV4_ASSIGN_OR_RETURN(c.kv_source_layers, u32_list(r, *k));
  } else {
    c.kv_source_layers = blocks_with_tensor(file, c, BlockTensor::CompressorKv);
  }
  if (auto k = r.first_of(kIndexSourceKeys)) {
    DSV4_ASSIGN_OR_RETURN(c.index_source_layers, u32_list(r, *k));
  } else {
    c.index_source_layers = blocks_with_tensor(file, c, BlockTensor::IndexerQB);
  }
  const auto source = r.first_of(kCandidateSourceKeys);
  if (source) {
    CandidateConfig cand;
    DSV4_ASSIGN_OR_RETURN(cand.source_layer, r.u32(*source));
    auto topk = r.first_of(kCandidateTopkKeys);
    auto block = r.first_of(kCandidateBlockKeys);
    if (!topk || !block)
      return Status::errorf("{}: key {} is set but the candidate {} is missing", file.path(), r.key(*source),
                            !topk ? "top-block count (attention.candidate_topk_blocks)"
                                  : "block size (attention.candidate_block_size)");
    DSV4_ASSIGN_OR_RETURN(cand.topk_blocks, r.u32(*topk));
    DSV4_ASSIGN_OR_RETURN(cand.block_size, r.u32(*block));
    c.candidate = cand;
  } else {
    // As Metrale's loader does: the first ratio-1 KV source, with the release's settings.
    for (uint32_t s : c.kv_source_layers)
      if (s < c.n_layers && c.ratio(s) == 1) {
        c.candidate = CandidateConfig{s, kReleaseCandidateBlockSize, kReleaseCandidateTopkBlocks};
        break;
      }
  }
  return Status::ok();
}

Status parse_v41_engram(const KeyReader& r, ModelConfig& c) {
  const auto& file = r.file();
  const auto layers_key = r.first_of(kEngramLayerKeys);
  if (!layers_key) return Status::ok();
  EngramConfig e;
  DSV4_ASSIGN_OR_RETURN(e.layers, u32_list(r, *layers_key));
  if (e.layers.empty()) return Status::ok();
  auto need = [&](std::span<const std::string_view> keys) -> Result<std::string_view> {
    if (auto k = r.first_of(keys)) return *k;
    return Status::errorf("{}: key {} is missing (needed with a non-empty {})", file.path(),
                          r.key(keys[0]), r.key(*layers_key));
  };
  DSV4_ASSIGN_OR_RETURN(std::string_view ngram_key, need(kEngramNgramKeys));
  DSV4_ASSIGN_OR_RETURN(e.ngram, r.u32(ngram_key));
  DSV4_ASSIGN_OR_RETURN(std::string_view head_key, need(kEngramHeadKeys));
  DSV4_ASSIGN_OR_RETURN(e.heads, r.u32(head_key));
  DSV4_ASSIGN_OR_RETURN(std::string_view dim_key, need(kEngramDimKeys));
  DSV4_ASSIGN_OR_RETURN(e.dim, r.u32(dim_key));
  DSV4_ASSIGN_OR_RETURN(std::string_view pad_key, need(kEngramPadKeys));
  DSV4_ASSIGN_OR_RETURN(e.pad_token_id, r.u32(pad_key));
  if (auto k = r.first_of(kEngramHashVocabKeys)) {
    DSV4_ASSIGN_OR_RETURN(e.hash_vocab_size, r.u64(*k));
  }

  // Table rows: the key, else the sum of each layer's primes, else the tables' shapes.
  if (auto k = r.first_of(kEngramRowKeys)) {
    DSV4_ASSIGN_OR_RETURN(e.table_rows, file.get_uint_array(r.key(*k)));
  } else if (auto k = r.first_of(kEngramPrimeKeys)) {
    DSV4_ASSIGN_OR_RETURN(std::vector<uint64_t> primes, file.get_uint_array(r.key(*k)));
    const uint64_t cols = e.ngram >= 2 ? uint64_t{e.ngram - 1} * e.heads : 0;
    if (cols == 0 || primes.size() != cols * e.layers.size())
      return Status::errorf("{}: key {}: {} entries, expected {} layers x {} columns", file.path(), r.key(*k),
                            primes.size(), e.layers.size(), cols);
    for (size_t l = 0; l < e.layers.size(); ++l) {
      uint64_t sum = 0;
      for (uint64_t i = 0; i < cols; ++i) sum += primes[l * cols + i];
      e.table_rows.push_back(sum);
    }
  } else {
    for (uint32_t layer : e.layers) {
      const auto* t = file.find_tensor(block_tensor_name(layer, BlockTensor::EngramEmbd));
      if (!t || t->ne.size() < 2)
        return Status::errorf("{}: the Engram table rows of layer {} are given by no key ({}) and no tensor {}",
                              file.path(), layer, r.key(kEngramRowKeys[0]),
                              block_tensor_name(layer, BlockTensor::EngramEmbd));
      e.table_rows.push_back(t->ne[1]);
    }
  }

  // Compressed vocabulary: the key, else one past the largest id of the token map.
  if (auto k = r.first_of(kEngramCompressedKeys)) {
    DSV4_ASSIGN_OR_RETURN(e.compressed_vocab_size, r.u32(*k));
  } else if (auto k = r.first_of(kEngramTokenMapKeys)) {
    DSV4_ASSIGN_OR_RETURN(std::vector<uint64_t> map, file.get_uint_array(r.key(*k)));
    uint64_t top = 0;
    for (uint64_t v : map) top = std::max(top, v + 1);
    if (top > std::numeric_limits<uint32_t>::max())
      return Status::errorf("{}: key {}: compressed id {} out of range", file.path(), r.key(*k), top - 1);
    e.compressed_vocab_size = static_cast<uint32_t>(top);
  } else {
    return Status::errorf("{}: key {} is missing, and there is no {} to count it from", file.path(),
                          r.key(kEngramCompressedKeys[0]), r.key(kEngramTokenMapKeys[0]));
  }
  c.engram = std::move(e);
  return Status::ok();
}

Status parse_v41_dspark(const KeyReader& r, ModelConfig& c) {
  if (c.n_mtp == 0) return Status::ok();
  const auto& file = r.file();
  DsparkConfig d;
  // Without keys: the release's settings, counts from the stage tensors' shapes.
  d.block_size = kReleaseDsparkBlockSize;
  d.n_experts_used = kReleaseDsparkExpertsUsed;
  d.noise_token_id = kReleaseDsparkNoiseToken;
  for (uint32_t i = 0; i < c.n_mtp; ++i) d.target_layers.push_back(c.n_layers - c.n_mtp + i);
  if (const auto* gate = file.find_tensor(block_tensor_name(c.n_layers, BlockTensor::FfnGateInp));
      gate && gate->ne.size() >= 2)
    d.n_experts = static_cast<uint32_t>(gate->ne[1]);
  if (const auto* markov = file.find_tensor(global_tensor_name(GlobalTensor::DsparkMarkovEmbd));
      markov && !markov->ne.empty())
    d.markov_rank = static_cast<uint32_t>(markov->ne[0]);
  if (auto k = r.first_of(kDsparkBlockKeys)) {
    DSV4_ASSIGN_OR_RETURN(d.block_size, r.u32(*k));
  }
  if (auto k = r.first_of(kDsparkRankKeys)) {
    DSV4_ASSIGN_OR_RETURN(d.markov_rank, r.u32(*k));
  }
  if (auto k = r.first_of(kDsparkExpertKeys)) {
    DSV4_ASSIGN_OR_RETURN(d.n_experts, r.u32(*k));
  }
  if (auto k = r.first_of(kDsparkUsedKeys)) {
    DSV4_ASSIGN_OR_RETURN(d.n_experts_used, r.u32(*k));
  }
  if (auto k = r.first_of(kDsparkNoiseKeys)) {
    DSV4_ASSIGN_OR_RETURN(d.noise_token_id, r.u32(*k));
  }
  if (auto k = r.first_of(kDsparkTargetKeys)) {
    DSV4_ASSIGN_OR_RETURN(d.target_layers, u32_list(r, *k));
  }
  c.dspark = std::move(d);
  return Status::ok();
}

Status parse_v41_vision(const KeyReader& r, ModelConfig& c) {
  const auto image = r.first_of(kImageTokenKeys);
  if (!image && !r.has("vision.block_count")) return Status::ok();
  VisionConfig v;
  if (image) {
    DSV4_ASSIGN_OR_RETURN(v.image_token_id, r.u32(*image));
  }
  if (r.has("vision.block_count")) {
    v.in_file = true;
    DSV4_ASSIGN_OR_RETURN(v.n_layers, r.u32("vision.block_count"));
    DSV4_ASSIGN_OR_RETURN(v.hidden, r.u32("vision.embedding_length"));
    DSV4_ASSIGN_OR_RETURN(v.ffn, r.u32("vision.feed_forward_length"));
    DSV4_ASSIGN_OR_RETURN(v.n_heads, r.u32("vision.attention.head_count"));
    DSV4_ASSIGN_OR_RETURN(v.patch_size, r.u32("vision.patch_size"));
    DSV4_ASSIGN_OR_RETURN(v.downsample, r.u32("vision.downsample_ratio"));
    DSV4_ASSIGN_OR_RETURN(v.max_image_tokens, r.u32("vision.max_image_tokens"));
    DSV4_ASSIGN_OR_RETURN(v.min_pixels, r.u32("vision.min_pixels"));
    DSV4_ASSIGN_OR_RETURN(v.rope_theta, r.f64("vision.rope.freq_base"));
  }
  c.vision = v;
  return Status::ok();
}

Status parse_v41(const KeyReader& r, std::optional<uint32_t> mtp_blocks, ModelConfig& c) {
  DSV4_TRY(parse_v4(r, mtp_blocks, c));
  DSV4_TRY(parse_v41_sources(r, c));
  DSV4_TRY(parse_v41_engram(r, c));
  DSV4_TRY(parse_v41_dspark(r, c));
  return parse_v41_vision(r, c);
}

bool strictly_ascending(const std::vector<uint32_t>& xs) {
  return std::adjacent_find(xs.begin(), xs.end(), std::greater_equal<>()) == xs.end();
}

bool contains(const std::vector<uint32_t>& xs, uint32_t x) {
  return std::find(xs.begin(), xs.end(), x) != xs.end();
}

// The last entry of an ascending list that is <= x, or -1.
int32_t last_at_or_before(const std::vector<uint32_t>& xs, uint32_t x) {
  int32_t out = -1;
  for (uint32_t s : xs)
    if (s <= x) out = static_cast<int32_t>(s);
  return out;
}

Status validate_layer_list(const ModelConfig& c, const char* field, const std::vector<uint32_t>& xs) {
  if (!strictly_ascending(xs))
    return Status::errorf("config: {} [{}] must be strictly ascending", field, fmt::join(xs, ", "));
  for (uint32_t s : xs) {
    if (s >= c.n_layers)
      return Status::errorf("config: {} lists layer {}, beyond the {} trunk layers", field, s, c.n_layers);
    if (c.ratio(s) == 0)
      return Status::errorf("config: {} lists layer {}, whose compress ratio is 0 (window only)", field, s);
  }
  return Status::ok();
}

Status validate_v41(const ModelConfig& c) {
  if (c.n_hash_layers != 0)
    return Status::errorf("config: n_hash_layers is {}; V4.1 has no hash-routed layers", c.n_hash_layers);
  DSV4_TRY(validate_layer_list(c, "kv_source_layers", c.kv_source_layers));
  DSV4_TRY(validate_layer_list(c, "index_source_layers", c.index_source_layers));
  for (uint32_t s : c.kv_source_layers)
    if (!contains(c.index_source_layers, s))
      return Status::errorf("config: KV source layer {} is not an index source (index_source_layers [{}])", s,
                            fmt::join(c.index_source_layers, ", "));
  for (uint32_t b = 0; b < c.n_layers; ++b) {
    if (c.ratio(b) == 0) continue;
    const LayerRoles roles = c.layer_roles(b);
    if (roles.kv_source_layer < 0)
      return Status::errorf("config: layer {} (ratio {}) has no KV source at or before it (kv_source_layers [{}])",
                            b, c.ratio(b), fmt::join(c.kv_source_layers, ", "));
    if (roles.index_source_layer < 0)
      return Status::errorf("config: layer {} (ratio {}) has no index source at or before it "
                            "(index_source_layers [{}])", b, c.ratio(b), fmt::join(c.index_source_layers, ", "));
    const uint32_t kv = static_cast<uint32_t>(roles.kv_source_layer);
    if (c.ratio(kv) != c.ratio(b))
      return Status::errorf("config: layer {} has ratio {} but reads the compressed cache of KV source {} "
                            "of ratio {}", b, c.ratio(b), kv, c.ratio(kv));
    const LayerRoles idx = c.layer_roles(static_cast<uint32_t>(roles.index_source_layer));
    if (idx.kv_source_layer != roles.kv_source_layer)
      return Status::errorf("config: layer {} reads KV source {} but the selection of index source {}, "
                            "which indexes KV source {}", b, kv, roles.index_source_layer, idx.kv_source_layer);
  }
  if (!c.index_source_layers.empty()) {
    if (c.index_heads == 0 || c.index_topk == 0)
      return Status::errorf("config: index_heads {} and index_topk {} must be positive with index sources",
                            c.index_heads, c.index_topk);
    // RoPE covers the last rope dims of each indexer head; FP4 rounding works on blocks of 32.
    if (c.index_head_dim < c.rope.dims || c.index_head_dim % 32 != 0)
      return Status::errorf("config: index_head_dim {} must be a multiple of 32 and at least the rope dims {}",
                            c.index_head_dim, c.rope.dims);
  }
  if (c.candidate) {
    const CandidateConfig& k = *c.candidate;
    if (!contains(c.kv_source_layers, k.source_layer) || c.ratio(k.source_layer) != 1)
      return Status::errorf("config: candidate source layer {} must be a ratio-1 KV source (its ratio is {}; "
                            "kv_source_layers [{}])", k.source_layer,
                            k.source_layer < c.n_blocks() ? c.ratio(k.source_layer) : 0,
                            fmt::join(c.kv_source_layers, ", "));
    if (k.block_size == 0 || k.topk_blocks == 0)
      return Status::errorf("config: candidate block size {} and top blocks {} must be positive", k.block_size,
                            k.topk_blocks);
  }
  if (c.engram) {
    const EngramConfig& e = *c.engram;
    if (e.layers.empty()) return Status::error("config: engram has no layers");
    if (!strictly_ascending(e.layers) || e.layers.back() >= c.n_layers)
      return Status::errorf("config: engram layers [{}] must be strictly ascending trunk layers (< {})",
                            fmt::join(e.layers, ", "), c.n_layers);
    if (e.table_rows.size() != e.layers.size())
      return Status::errorf("config: engram table_rows has {} entries for {} engram layers", e.table_rows.size(),
                            e.layers.size());
    for (size_t i = 0; i < e.table_rows.size(); ++i)
      if (e.table_rows[i] == 0 || e.table_rows[i] > std::numeric_limits<uint32_t>::max())
        return Status::errorf("config: engram table of layer {} has {} rows (must be 1 ... 2^32-1)", e.layers[i],
                              e.table_rows[i]);
    if (e.ngram < 2 || e.ngram > kMaxEngramNgram || e.heads == 0 || e.heads > kMaxEngramHeads)
      return Status::errorf("config: engram max n-gram size {} (2 ... {}) and heads {} (1 ... {})", e.ngram,
                            kMaxEngramNgram, e.heads, kMaxEngramHeads);
    // The buckets are primes just above it and the tables have at most 2^32 - 1 rows.
    if (e.hash_vocab_size > std::numeric_limits<uint32_t>::max())
      return Status::errorf("config: engram vocab_size {} exceeds 2^32 - 1", e.hash_vocab_size);
    // The table rows carry one E8M0 scale per 32 values.
    if (e.dim == 0 || e.dim % 32 != 0)
      return Status::errorf("config: engram head_dim {} must be a positive multiple of 32", e.dim);
    if (e.compressed_vocab_size == 0 || e.compressed_vocab_size > c.vocab_size)
      return Status::errorf("config: engram compressed vocabulary {} must be 1 ... vocab_size {}",
                            e.compressed_vocab_size, c.vocab_size);
    if (e.pad_token_id >= c.vocab_size)
      return Status::errorf("config: engram pad token {} is outside the vocabulary of {}", e.pad_token_id,
                            c.vocab_size);
  }
  if (c.n_mtp > 0) {
    if (!c.dspark)
      return Status::errorf("config: {} MTP blocks but no DSpark settings (V4.1's MTP blocks are DSpark stages)",
                            c.n_mtp);
    const DsparkConfig& d = *c.dspark;
    if (d.n_experts == 0 || d.n_experts_used == 0 || d.n_experts_used > d.n_experts)
      return Status::errorf("config: DSpark experts {} top-{}: need 1 <= top-k <= experts", d.n_experts,
                            d.n_experts_used);
    if (d.block_size == 0 || d.markov_rank == 0)
      return Status::errorf("config: DSpark block size {} and Markov rank {} must be positive", d.block_size,
                            d.markov_rank);
    if (d.noise_token_id >= c.vocab_size)
      return Status::errorf("config: DSpark noise token {} is outside the vocabulary of {}", d.noise_token_id,
                            c.vocab_size);
    if (d.target_layers.empty())
      return Status::error("config: DSpark has no target layers");
    for (uint32_t t : d.target_layers)
      if (t >= c.n_layers)
        return Status::errorf("config: DSpark target layer {} is beyond the {} trunk layers", t, c.n_layers);
  }
  if (c.vision && c.vision->image_token_id >= c.vocab_size)
    return Status::errorf("config: image token {} is outside the vocabulary of {}", c.vision->image_token_id,
                          c.vocab_size);
  return Status::ok();
}

void write_v41_metadata(const ModelConfig& c, gguf::GgufWriter& w) {
  using gguf::Value;
  const std::string arch(c.architecture());
  auto key = [&](std::string_view k) { return fmt::format("{}.{}", arch, k); };
  auto u64s = [](const std::vector<uint64_t>& xs) {
    gguf::Value::Array a;
    for (uint64_t x : xs) a.push_back(x <= std::numeric_limits<uint32_t>::max()
                                          ? Value::u32(static_cast<uint32_t>(x)) : Value::u64(x));
    bool wide = std::any_of(xs.begin(), xs.end(), [](uint64_t x) { return x > std::numeric_limits<uint32_t>::max(); });
    if (wide) {
      a.clear();
      for (uint64_t x : xs) a.push_back(Value::u64(x));
      return Value::array(gguf::ValueType::UINT64, std::move(a));
    }
    return Value::array(gguf::ValueType::UINT32, std::move(a));
  };
  // Every spelling a published reader looks for (docs/MODEL-FILES.md, "compatibility map").
  w.set(key("kv_source_layer_ids"), Value::array_u32(c.kv_source_layers));
  w.set(key("index_source_layer_ids"), Value::array_u32(c.index_source_layers));
  if (c.candidate) {
    w.set(key("attention.candidate_source_layer_id"), Value::u32(c.candidate->source_layer));
    w.set(key("attention.candidate_topk_blocks"), Value::u32(c.candidate->topk_blocks));
    w.set(key("attention.candidate_block_size"), Value::u32(c.candidate->block_size));
  }
  if (c.engram) {
    const EngramConfig& e = *c.engram;
    w.set(key("engram.layer_ids"), Value::array_u32(e.layers));
    w.set(key("engram.max_ngram_size"), Value::u32(e.ngram));
    w.set(key("engram.head_count"), Value::u32(e.heads));
    w.set(key("engram.key_length"), Value::u32(e.dim));
    w.set(key("engram.head_dim"), Value::u32(e.dim));
    w.set(key("engram.pad_id"), Value::u32(e.pad_token_id));
    w.set(key("engram.num_embeddings"), u64s(e.table_rows));
    w.set(key("engram.rows"), u64s(e.table_rows));
    w.set(key("engram.vocab_size"), e.hash_vocab_size <= std::numeric_limits<uint32_t>::max()
                                        ? Value::u32(static_cast<uint32_t>(e.hash_vocab_size))
                                        : Value::u64(e.hash_vocab_size));
    w.set(key("engram.compressed_vocab_size"), Value::u32(e.compressed_vocab_size));
  } else {
    w.set(key("engram.layer_ids"), Value::array_u32({}));
  }
  if (c.dspark) {
    const DsparkConfig& d = *c.dspark;
    w.set(key("dspark.block_size"), Value::u32(d.block_size));
    w.set(key("dspark.markov_rank"), Value::u32(d.markov_rank));
    w.set(key("dspark.expert_count"), Value::u32(d.n_experts));
    w.set(key("dspark.expert_used_count"), Value::u32(d.n_experts_used));
    w.set(key("dspark.noise_token_id"), Value::u32(d.noise_token_id));
    w.set(key("dspark.target_layer_ids"), Value::array_u32(d.target_layers));
  }
  if (c.vision) {
    const VisionConfig& v = *c.vision;
    w.set(key("image_token_id"), Value::u32(v.image_token_id));
    if (v.in_file) {
      w.set(key("vision.block_count"), Value::u32(v.n_layers));
      w.set(key("vision.embedding_length"), Value::u32(v.hidden));
      w.set(key("vision.feed_forward_length"), Value::u32(v.ffn));
      w.set(key("vision.attention.head_count"), Value::u32(v.n_heads));
      w.set(key("vision.patch_size"), Value::u32(v.patch_size));
      w.set(key("vision.downsample_ratio"), Value::u32(v.downsample));
      w.set(key("vision.max_image_tokens"), Value::u32(v.max_image_tokens));
      w.set(key("vision.min_pixels"), Value::u32(v.min_pixels));
      w.set(key("vision.rope.freq_base"), Value::f32(static_cast<float>(v.rope_theta)));
    }
  }
}

}  // namespace

int EngramConfig::index_of(uint32_t layer) const {
  for (size_t i = 0; i < layers.size(); ++i)
    if (layers[i] == layer) return static_cast<int>(i);
  return -1;
}

LayerRoles ModelConfig::layer_roles(uint32_t block) const {
  LayerRoles r;
  if (!is_v41() || block >= n_layers || block >= compress_ratios.size() || ratio(block) == 0) return r;
  r.kv_source = contains(kv_source_layers, block);
  r.index_source = contains(index_source_layers, block);
  r.kv_source_layer = last_at_or_before(kv_source_layers, block);
  r.index_source_layer = last_at_or_before(index_source_layers, block);
  r.candidate_source = candidate && candidate->source_layer == block;
  r.uses_candidates = candidate && r.index_source && block > candidate->source_layer;
  return r;
}

uint32_t ModelConfig::experts_of(uint32_t block) const {
  return is_v41() && is_mtp(block) && dspark ? dspark->n_experts : n_experts;
}

uint32_t ModelConfig::experts_used_of(uint32_t block) const {
  return is_v41() && is_mtp(block) && dspark ? dspark->n_experts_used : n_experts_used;
}

std::string_view ModelConfig::architecture() const {
  return variant == ModelVariant::V41 ? "deepseek41" : "deepseek4";
}

Status ModelConfig::validate() const {
  auto positive = [](const char* field, uint64_t v) -> Status {
    if (v == 0) return Status::errorf("config: {} is 0, must be positive", field);
    return Status::ok();
  };
  DSV4_TRY(positive("vocab_size", vocab_size));
  DSV4_TRY(positive("hidden (embedding_length)", hidden));
  DSV4_TRY(positive("n_layers (block_count - nextn_predict_layers)", n_layers));
  DSV4_TRY(positive("context_length", context_length));
  DSV4_TRY(positive("n_heads", n_heads));
  DSV4_TRY(positive("head_dim", head_dim));
  DSV4_TRY(positive("q_lora_rank", q_lora_rank));
  DSV4_TRY(positive("o_lora_rank", o_lora_rank));
  DSV4_TRY(positive("o_groups", o_groups));
  DSV4_TRY(positive("sliding_window", sliding_window));
  DSV4_TRY(positive("n_experts", n_experts));
  DSV4_TRY(positive("n_experts_used", n_experts_used));
  DSV4_TRY(positive("n_shared_experts", n_shared_experts));
  DSV4_TRY(positive("expert_ffn", expert_ffn));
  DSV4_TRY(positive("hc_mult", hc_mult));
  DSV4_TRY(positive("hc_sinkhorn_iters", hc_sinkhorn_iters));

  if (compress_ratios.size() != n_blocks())
    return Status::errorf("config: compress_ratios has {} entries, expected n_layers + n_mtp = {}",
                          compress_ratios.size(), n_blocks());
  if (swiglu_limit.size() != n_blocks())
    return Status::errorf("config: swiglu_limit has {} entries, expected {}", swiglu_limit.size(),
                          n_blocks());
  if (swiglu_limit_shared.size() != n_blocks())
    return Status::errorf("config: swiglu_limit_shared has {} entries, expected {}",
                          swiglu_limit_shared.size(), n_blocks());
  for (uint32_t b = n_layers; b < n_blocks(); ++b)
    if (compress_ratios[b] != 0)
      return Status::errorf("config: compress_ratios[{}] (MTP block) is {}, must be 0", b,
                            compress_ratios[b]);

  if (rope.dims == 0 || rope.dims % 2 != 0 || rope.dims > head_dim)
    return Status::errorf("config: rope dims {} must be even, positive and at most head_dim {}",
                          rope.dims, head_dim);
  // V4.1's FP8 window rounding covers every dim in blocks of 32 (tiny-v41 README, QAT rule 1).
  if (is_v41() && head_dim % 32 != 0)
    return Status::errorf("config: head_dim {} is not a multiple of 32", head_dim);
  // V4's FP8 KV rounding works on 64-blocks of the non-rope dims (spec §8).
  if (!is_v41() && (head_dim - rope.dims) % 64 != 0)
    return Status::errorf("config: head_dim {} - rope dims {} = {} is not a multiple of 64",
                          head_dim, rope.dims, head_dim - rope.dims);
  if (n_heads % o_groups != 0)
    return Status::errorf("config: n_heads {} is not a multiple of o_groups {}", n_heads,
                          o_groups);
  if (n_experts_used > n_experts)
    return Status::errorf("config: n_experts_used {} exceeds n_experts {}", n_experts_used,
                          n_experts);
  if (n_hash_layers > n_layers)
    return Status::errorf("config: n_hash_layers {} exceeds n_layers {}", n_hash_layers,
                          n_layers);
  if (!(rms_eps > 0) || !(hc_eps > 0))
    return Status::errorf("config: rms_eps {} and hc_eps {} must be positive", rms_eps, hc_eps);
  if (!(rope.freq_base > 0) || !(rope.compress_freq_base > 0) || !(rope.yarn_factor > 0) ||
      rope.yarn_original_context == 0)
    return Status::errorf("config: rope bases {} / {}, yarn factor {}, yarn original context {} "
                          "must be positive", rope.freq_base, rope.compress_freq_base,
                          rope.yarn_factor, rope.yarn_original_context);

  if (is_v41()) return validate_v41(*this);
  const bool v41_parts = !kv_source_layers.empty() || !index_source_layers.empty() || candidate || engram ||
                         dspark || vision;
  if (v41_parts)
    return Status::error("config: source layers, candidates, Engram, DSpark and vision need the deepseek41 "
                         "(V4.1) variant");

  bool any_csa = false;
  for (uint32_t b = 0; b < n_blocks(); ++b) any_csa |= attention_kind(b) == AttentionKind::CSA;
  if (any_csa) {
    DSV4_TRY(positive("index_heads", index_heads));
    DSV4_TRY(positive("index_topk", index_topk));
    // RoPE covers the last rope dims of each indexer head, the Hadamard transform needs a
    // power of two and the FP4 rounding blocks of 32 (spec §8).
    if (index_head_dim < rope.dims || !is_power_of_two(index_head_dim) || index_head_dim % 32 != 0)
      return Status::errorf("config: index_head_dim {} must be a power of two, a multiple of 32 "
                            "and at least the rope dims {}", index_head_dim, rope.dims);
  }
  return Status::ok();
}

Result<ModelConfig> ModelConfig::from_gguf(const gguf::GgufFile& file, std::optional<uint32_t> mtp_blocks) {
  DSV4_ASSIGN_OR_RETURN(std::string arch, file.get_string("general.architecture"));
  ModelConfig c;
  if (arch != "deepseek4" && arch != "deepseek41")
    return Status::errorf("{}: general.architecture is \"{}\", expected \"deepseek4\" or \"deepseek41\"",
                          file.path(), arch);
  const KeyReader reader(file, arch);
  // Some tools reuse deepseek4 for V4.1 files and add the V4.1 keys.
  c.variant = arch == "deepseek41" || has_any_v41_key(reader) ? ModelVariant::V41 : ModelVariant::V4;
  if (file.find("general.name")) {
    DSV4_ASSIGN_OR_RETURN(c.name, file.get_string("general.name"));
  }
  DSV4_TRY(c.variant == ModelVariant::V41 ? parse_v41(reader, mtp_blocks, c) : parse_v4(reader, mtp_blocks, c));
  if (Status s = c.validate(); !s.is_ok()) return s.with_context(file.path());
  return c;
}

void ModelConfig::write_gguf_metadata(gguf::GgufWriter& w, GgufPart part) const {
  using gguf::Value;
  const std::string arch(architecture());
  auto key = [&](std::string_view k) { return fmt::format("{}.{}", arch, k); };
  w.set("general.architecture", Value::string(arch));
  if (!name.empty()) w.set("general.name", Value::string(name));

  // llama.cpp's trunk file counts only the trunk blocks; its per-block arrays then have
  // block_count entries except compress_ratios, which keeps the MTP entries (as config.json).
  const uint32_t blocks = part == GgufPart::Trunk ? n_layers : n_blocks();
  w.set(key("block_count"), Value::u32(blocks));
  if (part != GgufPart::Trunk) w.set(key("nextn_predict_layers"), Value::u32(n_mtp));
  const std::vector<float> clamp(swiglu_limit.begin(), swiglu_limit.begin() + blocks);
  const std::vector<float> clamp_shared(swiglu_limit_shared.begin(), swiglu_limit_shared.begin() + blocks);
  w.set(key("context_length"), context_length <= std::numeric_limits<uint32_t>::max()
                                   ? Value::u32(static_cast<uint32_t>(context_length))
                                   : Value::u64(context_length));
  w.set(key("embedding_length"), Value::u32(hidden));
  w.set(key("embedding_length_out"), Value::u32(hidden * hc_mult));
  w.set(key("vocab_size"), Value::u32(vocab_size));

  w.set(key("attention.head_count"), Value::u32(n_heads));
  w.set(key("attention.head_count_kv"), Value::u32(1));
  w.set(key("attention.key_length"), Value::u32(head_dim));
  w.set(key("attention.value_length"), Value::u32(head_dim));
  w.set(key("attention.q_lora_rank"), Value::u32(q_lora_rank));
  w.set(key("attention.output_lora_rank"), Value::u32(o_lora_rank));
  w.set(key("attention.output_group_count"), Value::u32(o_groups));
  w.set(key("attention.sliding_window"), Value::u32(sliding_window));
  w.set(key("attention.compress_ratios"),
        Value::array_i32(std::vector<int32_t>(compress_ratios.begin(), compress_ratios.end())));
  w.set(key("attention.compress_rope_freq_base"),
        Value::f32(static_cast<float>(rope.compress_freq_base)));
  w.set(key("attention.layer_norm_rms_epsilon"), Value::f32(rms_eps));
  w.set(key("attention.indexer.head_count"), Value::u32(index_heads));
  w.set(key("attention.indexer.key_length"), Value::u32(index_head_dim));
  w.set(key("attention.indexer.top_k"), Value::u32(index_topk));

  w.set(key("rope.dimension_count"), Value::u32(rope.dims));
  w.set(key("rope.freq_base"), Value::f32(static_cast<float>(rope.freq_base)));
  w.set(key("rope.scaling.type"), Value::string("yarn"));
  w.set(key("rope.scaling.factor"), Value::f32(static_cast<float>(rope.yarn_factor)));
  w.set(key("rope.scaling.original_context_length"), Value::u32(rope.yarn_original_context));
  w.set(key("rope.scaling.yarn_beta_fast"), Value::f32(static_cast<float>(rope.yarn_beta_fast)));
  w.set(key("rope.scaling.yarn_beta_slow"), Value::f32(static_cast<float>(rope.yarn_beta_slow)));

  w.set(key("expert_count"), Value::u32(n_experts));
  w.set(key("expert_used_count"), Value::u32(n_experts_used));
  w.set(key("expert_shared_count"), Value::u32(n_shared_experts));
  w.set(key("expert_feed_forward_length"), Value::u32(expert_ffn));
  w.set(key("expert_weights_scale"), Value::f32(routed_scale));
  w.set(key("expert_weights_norm"), Value::boolean(norm_topk));
  w.set(key("expert_gating_func"), Value::u32(static_cast<uint32_t>(kGatingSqrtSoftplus)));
  w.set(key("hash_layer_count"), Value::u32(n_hash_layers));
  w.set(key("swiglu_clamp_exp"), Value::array_f32(clamp));
  w.set(key("swiglu_clamp_shexp"), Value::array_f32(clamp_shared));

  w.set(key("hyper_connection.count"), Value::u32(hc_mult));
  w.set(key("hyper_connection.sinkhorn_iterations"), Value::u32(hc_sinkhorn_iters));
  w.set(key("hyper_connection.epsilon"), Value::f32(hc_eps));
  if (is_v41()) write_v41_metadata(*this, w);
}

Status refuse_image_tokens(const ModelConfig& c, std::span<const int32_t> tokens) {
  if (!c.vision) return Status::ok();
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] == static_cast<int32_t>(c.vision->image_token_id))
      return Status::errorf("prompt position {} holds the image token {}: image input is not supported yet "
                            "(text only)", i, c.vision->image_token_id);
  return Status::ok();
}

std::string ModelConfig::identity() const {
  std::string ratios;
  for (uint32_t r : compress_ratios) ratios += (ratios.empty() ? "" : ",") + std::to_string(r);
  return fmt::format("{} vocab={} hidden={} layers={} mtp={} heads={} head_dim={} q_rank={} o_rank={} o_groups={} "
                     "window={} ratios={} index={}x{} experts={}x{} top{} hc={}",
                     architecture(), vocab_size, hidden, n_layers, n_mtp, n_heads, head_dim, q_lora_rank, o_lora_rank,
                     o_groups, sliding_window, ratios, index_heads, index_head_dim, n_experts, expert_ffn,
                     n_experts_used, hc_mult);
}

}  // namespace dsv4
