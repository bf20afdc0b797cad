#include "convert/checkpoint_config.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace dsv4::convert {
namespace {

using nlohmann::ordered_json;

// Typed access to the keys of one JSON object; errors name the file and the key.
class Keys {
 public:
  Keys(const ordered_json& obj, std::string_view source) : obj_(obj), source_(source) {}

  bool has(const char* key) const { return obj_.contains(key) && !obj_[key].is_null(); }
  const ordered_json& object() const { return obj_; }
  std::string_view source() const { return source_; }

  Result<const ordered_json*> get(const char* key) const {
    if (!has(key)) return Status::errorf("{}: key {} is missing", source_, key);
    return &obj_[key];
  }
  Result<uint64_t> uint(const char* key, uint64_t max = UINT32_MAX) const {
    DSV4_ASSIGN_OR_RETURN(const ordered_json* v, get(key));
    return as_uint(*v, key, max);
  }
  Result<uint64_t> uint_or(const char* key, uint64_t fallback) const {
    return has(key) ? uint(key) : Result<uint64_t>(fallback);
  }
  Result<double> number(const char* key) const {
    DSV4_ASSIGN_OR_RETURN(const ordered_json* v, get(key));
    if (!v->is_number() || !std::isfinite(v->get<double>()))
      return Status::errorf("{}: key {}: expected a number, found {}", source_, key, v->dump());
    return v->get<double>();
  }
  Result<double> number_or(const char* key, double fallback) const {
    return has(key) ? number(key) : Result<double>(fallback);
  }
  Result<bool> boolean_or(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!obj_[key].is_boolean())
      return Status::errorf("{}: key {}: expected true or false, found {}", source_, key, obj_[key].dump());
    return obj_[key].get<bool>();
  }
  Result<std::string> string_or(const char* key, std::string fallback) const {
    if (!has(key)) return fallback;
    if (!obj_[key].is_string())
      return Status::errorf("{}: key {}: expected a string, found {}", source_, key, obj_[key].dump());
    return obj_[key].get<std::string>();
  }
  Result<uint64_t> as_uint(const ordered_json& v, std::string_view what, uint64_t max = UINT32_MAX) const {
    if (v.is_number_unsigned() && v.get<uint64_t>() <= max) return v.get<uint64_t>();
    if (v.is_number_integer() && v.get<int64_t>() >= 0 && static_cast<uint64_t>(v.get<int64_t>()) <= max)
      return static_cast<uint64_t>(v.get<int64_t>());
    // Some configs write integers as 4.0.
    if (v.is_number_float()) {
      const double d = v.get<double>();
      if (d >= 0 && d <= static_cast<double>(max) && d == std::floor(d)) return static_cast<uint64_t>(d);
    }
    return Status::errorf("{}: key {}: expected an integer in [0, {}], found {}", source_, what, max,
                          v.dump());
  }

 private:
  const ordered_json& obj_;
  std::string_view source_;
};

// A float as the shortest decimal that reads back to it (1e-06, not 9.99999997e-07).
double decimal(float f) { return std::stod(fmt::format("{}", f)); }


// ---- V4.1 (deepseek_v41) ----

bool is_v41_checkpoint(const ordered_json& root) {
  if (root.contains("model_type") && root["model_type"] == "deepseek_v41") return true;
  const auto it = root.find("architectures");
  return it != root.end() && it->is_array() && !it->empty() && (*it)[0] == "DeepseekV41ForCausalLM";
}

Result<std::vector<uint32_t>> uint_list(const Keys& k, const ordered_json& obj, const char* key) {
  DSV4_ASSIGN_OR_RETURN(const ordered_json* v, k.get(key));
  (void)obj;
  if (!v->is_array()) return Status::errorf("{}: key {}: expected an array, found {}", k.source(), key, v->dump());
  std::vector<uint32_t> out;
  for (size_t i = 0; i < v->size(); ++i) {
    DSV4_ASSIGN_OR_RETURN(uint64_t x, k.as_uint((*v)[i], fmt::format("{}[{}]", key, i)));
    out.push_back(static_cast<uint32_t>(x));
  }
  return out;
}

// The V4.1 keys of text_config (as the release spells them) and of the root
// (image_token_id, vision_config).
Status parse_v41_keys(const Keys& root, const Keys& text, CheckpointConfig& out) {
  ModelConfig& c = out.model;
  c.variant = ModelVariant::V41;
  const ordered_json& t = text.object();
  DSV4_ASSIGN_OR_RETURN(c.kv_source_layers, uint_list(text, t, "kv_source_layer_ids"));
  DSV4_ASSIGN_OR_RETURN(c.index_source_layers, uint_list(text, t, "index_source_layer_ids"));
  if (text.has("candidate_source_layer_id")) {
    CandidateConfig cand;
    DSV4_ASSIGN_OR_RETURN(uint64_t src, text.uint("candidate_source_layer_id"));
    DSV4_ASSIGN_OR_RETURN(uint64_t topk, text.uint("candidate_topk_blocks"));
    DSV4_ASSIGN_OR_RETURN(uint64_t block, text.uint("candidate_block_size"));
    cand.source_layer = static_cast<uint32_t>(src);
    cand.topk_blocks = static_cast<uint32_t>(topk);
    cand.block_size = static_cast<uint32_t>(block);
    c.candidate = cand;
  }
  if (text.has("engram_layer_ids")) {
    EngramConfig e;
    DSV4_ASSIGN_OR_RETURN(e.layers, uint_list(text, t, "engram_layer_ids"));
    if (!e.layers.empty()) {
      DSV4_ASSIGN_OR_RETURN(std::vector<uint32_t> rows, uint_list(text, t, "engram_num_embeddings"));
      e.table_rows.assign(rows.begin(), rows.end());
      DSV4_ASSIGN_OR_RETURN(uint64_t dim, text.uint("engram_head_dim"));
      DSV4_ASSIGN_OR_RETURN(uint64_t ngram, text.uint("engram_max_ngram_size"));
      DSV4_ASSIGN_OR_RETURN(uint64_t heads, text.uint("engram_n_heads"));
      DSV4_ASSIGN_OR_RETURN(e.hash_vocab_size, text.uint("engram_vocab_size", UINT64_MAX));
      DSV4_ASSIGN_OR_RETURN(uint64_t compressed, text.uint("engram_compressed_vocab_size"));
      DSV4_ASSIGN_OR_RETURN(uint64_t pad, text.uint("engram_pad_token_id"));
      e.dim = static_cast<uint32_t>(dim);
      e.ngram = static_cast<uint32_t>(ngram);
      e.heads = static_cast<uint32_t>(heads);
      e.compressed_vocab_size = static_cast<uint32_t>(compressed);
      e.pad_token_id = static_cast<uint32_t>(pad);
      c.engram = std::move(e);
    }
  }
  if (c.n_mtp > 0) {
    DsparkConfig d;
    DSV4_ASSIGN_OR_RETURN(uint64_t block, text.uint("dspark_block_size"));
    DSV4_ASSIGN_OR_RETURN(uint64_t rank, text.uint("dspark_markov_rank"));
    DSV4_ASSIGN_OR_RETURN(uint64_t experts, text.uint("dspark_n_routed_experts"));
    DSV4_ASSIGN_OR_RETURN(uint64_t used, text.uint("dspark_num_experts_per_tok"));
    DSV4_ASSIGN_OR_RETURN(uint64_t noise, text.uint("dspark_noise_token_id"));
    DSV4_ASSIGN_OR_RETURN(d.target_layers, uint_list(text, t, "dspark_target_layer_ids"));
    d.block_size = static_cast<uint32_t>(block);
    d.markov_rank = static_cast<uint32_t>(rank);
    d.n_experts = static_cast<uint32_t>(experts);
    d.n_experts_used = static_cast<uint32_t>(used);
    d.noise_token_id = static_cast<uint32_t>(noise);
    c.dspark = std::move(d);
  }
  const bool has_vision = root.has("vision_config");
  if (has_vision || root.has("image_token_id")) {
    VisionConfig v;
    DSV4_ASSIGN_OR_RETURN(uint64_t image, root.uint_or("image_token_id", 0));
    v.image_token_id = static_cast<uint32_t>(image);
    if (has_vision) {
      const ordered_json& vj = root.object()["vision_config"];
      if (!vj.is_object()) return Status::errorf("{}: key vision_config is not an object", root.source());
      const std::string vsource = fmt::format("{}: vision_config", root.source());
      const Keys vk(vj, vsource);
      DSV4_ASSIGN_OR_RETURN(uint64_t layers, vk.uint("num_hidden_layers"));
      DSV4_ASSIGN_OR_RETURN(uint64_t hidden, vk.uint("hidden_size"));
      DSV4_ASSIGN_OR_RETURN(uint64_t ffn, vk.uint("intermediate_size"));
      DSV4_ASSIGN_OR_RETURN(uint64_t heads, vk.uint("num_attention_heads"));
      DSV4_ASSIGN_OR_RETURN(uint64_t patch, vk.uint("patch_size"));
      DSV4_ASSIGN_OR_RETURN(uint64_t down, vk.uint_or("downsample_ratio", 1));
      DSV4_ASSIGN_OR_RETURN(uint64_t max_tokens, vk.uint_or("max_image_tokens", 0));
      DSV4_ASSIGN_OR_RETURN(uint64_t min_pixels, vk.uint_or("min_pixels", 0));
      DSV4_ASSIGN_OR_RETURN(v.rope_theta, vk.number_or("rope_theta", 10000));
      v.n_layers = static_cast<uint32_t>(layers);
      v.hidden = static_cast<uint32_t>(hidden);
      v.ffn = static_cast<uint32_t>(ffn);
      v.n_heads = static_cast<uint32_t>(heads);
      v.patch_size = static_cast<uint32_t>(patch);
      v.downsample = static_cast<uint32_t>(down);
      v.max_image_tokens = static_cast<uint32_t>(max_tokens);
      v.min_pixels = static_cast<uint32_t>(min_pixels);
      out.has_vision_tower = v.n_layers > 0;
    }
    c.vision = v;  // in_file: the converter's recipe decides
  }
  return Status::ok();
}

std::string checkpoint_config_json_v41(const CheckpointConfig& config) {
  const ModelConfig& c = config.model;
  ordered_json t;  // keys sorted, as transformers writes them
  t["attention_bias"] = false;
  t["attention_dropout"] = 0.0;
  if (c.candidate) {
    t["candidate_block_size"] = c.candidate->block_size;
    t["candidate_source_layer_id"] = c.candidate->source_layer;
    t["candidate_topk_blocks"] = c.candidate->topk_blocks;
  }
  t["compress_ratios"] = c.compress_ratios;
  t["compress_rope_theta"] = c.rope.compress_freq_base;
  if (c.dspark) {
    t["dspark_block_size"] = c.dspark->block_size;
    t["dspark_markov_rank"] = c.dspark->markov_rank;
    t["dspark_n_routed_experts"] = c.dspark->n_experts;
    t["dspark_noise_token_id"] = c.dspark->noise_token_id;
    t["dspark_num_experts_per_tok"] = c.dspark->n_experts_used;
    t["dspark_target_layer_ids"] = c.dspark->target_layers;
  }
  if (c.engram) {
    const EngramConfig& e = *c.engram;
    t["engram_compressed_vocab_size"] = e.compressed_vocab_size;
    t["engram_head_dim"] = e.dim;
    t["engram_layer_ids"] = e.layers;
    t["engram_max_ngram_size"] = e.ngram;
    t["engram_n_heads"] = e.heads;
    t["engram_num_embeddings"] = e.table_rows;
    t["engram_pad_token_id"] = e.pad_token_id;
    t["engram_vocab_size"] = e.hash_vocab_size;
  }
  t["hc_eps"] = decimal(c.hc_eps);
  t["hc_mult"] = c.hc_mult;
  t["hc_sinkhorn_iters"] = c.hc_sinkhorn_iters;
  t["head_dim"] = c.head_dim;
  t["hidden_act"] = "silu";
  t["hidden_size"] = c.hidden;
  t["index_head_dim"] = c.index_head_dim;
  t["index_n_heads"] = c.index_heads;
  t["index_source_layer_ids"] = c.index_source_layers;
  t["index_topk"] = c.index_topk;
  t["initializer_range"] = 0.02;
  t["kv_source_layer_ids"] = c.kv_source_layers;
  t["max_position_embeddings"] = c.context_length;
  t["model_type"] = "deepseek_v41_text";
  t["moe_intermediate_size"] = c.expert_ffn;
  t["n_routed_experts"] = c.n_experts;
  t["n_shared_experts"] = c.n_shared_experts;
  t["norm_topk_prob"] = c.norm_topk;
  t["num_attention_heads"] = c.n_heads;
  t["num_experts_per_tok"] = c.n_experts_used;
  t["num_hidden_layers"] = c.n_layers;
  t["num_key_value_heads"] = 1;
  t["num_nextn_predict_layers"] = c.n_mtp;
  t["o_groups"] = c.o_groups;
  t["o_lora_rank"] = c.o_lora_rank;
  t["q_lora_rank"] = c.q_lora_rank;
  t["qk_rope_head_dim"] = c.rope.dims;
  t["rms_norm_eps"] = decimal(c.rms_eps);
  t["rope_scaling"] = {{"beta_fast", c.rope.yarn_beta_fast},
                       {"beta_slow", c.rope.yarn_beta_slow},
                       {"factor", c.rope.yarn_factor},
                       {"original_max_position_embeddings", c.rope.yarn_original_context},
                       {"rope_type", "yarn"}};
  t["rope_theta"] = c.rope.freq_base;
  t["routed_scaling_factor"] = decimal(c.routed_scale);
  t["scoring_func"] = "sqrtsoftplus";
  t["sliding_window"] = c.sliding_window;
  t["swiglu_limit"] = decimal(c.swiglu_limit.empty() ? 0.0f : c.swiglu_limit.front());
  t["tie_word_embeddings"] = false;
  t["topk_method"] = "noaux_tc";
  t["use_cache"] = true;
  t["vocab_size"] = c.vocab_size;

  ordered_json j;
  j["architectures"] = {"DeepseekV41ForCausalLM"};
  j["bos_token_id"] = config.bos_token_id;
  j["dtype"] = "bfloat16";
  j["eos_token_id"] = config.eos_token_id;
  if (c.vision) j["image_token_id"] = c.vision->image_token_id;
  j["model_type"] = "deepseek_v41";
  j["pad_token_id"] = c.engram ? c.engram->pad_token_id : 2;
  j["quantization_config"] = {{"activation_scheme", "dynamic"},
                              {"expert_dtype", config.format.experts_fp4 ? "fp4" : "fp8"},
                              {"quant_method", "fp8"},
                              {"scale_fmt", "ue8m0"},
                              {"weight_block_size", {config.format.fp8_block_rows, config.format.fp8_block_cols}}};
  j["text_config"] = t;
  return j.dump(2) + "\n";
}

}  // namespace

Result<CheckpointConfig> parse_checkpoint_config(std::string_view json_text, std::string_view source) {
  ordered_json root;
  try {
    root = ordered_json::parse(json_text);
  } catch (const ordered_json::parse_error& e) {
    return Status::errorf("{}: not valid JSON: {}", source, e.what());
  }
  if (!root.is_object()) return Status::errorf("{}: not a JSON object", source);
  const Keys root_keys(root, source);
  // V4.1 nests the text model's keys under text_config (model_type deepseek_v41).
  const bool v41 = is_v41_checkpoint(root);
  if (root_keys.has("architectures")) {
    const ordered_json& archs = root["architectures"];
    const std::string arch = archs.is_array() && !archs.empty() && archs[0].is_string()
                                 ? archs[0].get<std::string>() : archs.dump();
    if (arch != "DeepseekV4ForCausalLM" && arch != "DeepseekV41ForCausalLM")
      return Status::errorf("{}: architectures[0] is {}; this converter reads DeepseekV4ForCausalLM and "
                            "DeepseekV41ForCausalLM checkpoints", source, arch);
  }
  if (v41 && !root["text_config"].is_object())
    return Status::errorf("{}: key text_config: expected an object (a deepseek_v41 config nests the text model)",
                          source);
  const ordered_json& text = v41 ? root["text_config"] : root;
  const std::string text_source = v41 ? fmt::format("{}: text_config", source) : std::string(source);
  const Keys k(text, text_source);
  DSV4_ASSIGN_OR_RETURN(std::string scoring, k.string_or("scoring_func", "sqrtsoftplus"));
  if (scoring != "sqrtsoftplus")
    return Status::errorf("{}: key scoring_func is \"{}\"; DeepSeek-V4 uses \"sqrtsoftplus\"", source, scoring);

  CheckpointConfig out;
  ModelConfig& c = out.model;
  c.variant = ModelVariant::V4;
  DSV4_ASSIGN_OR_RETURN(uint64_t vocab, k.uint("vocab_size"));
  DSV4_ASSIGN_OR_RETURN(uint64_t hidden, k.uint("hidden_size"));
  DSV4_ASSIGN_OR_RETURN(uint64_t n_layers, k.uint("num_hidden_layers"));
  DSV4_ASSIGN_OR_RETURN(uint64_t n_mtp, k.uint_or("num_nextn_predict_layers", 0));
  DSV4_ASSIGN_OR_RETURN(c.context_length, k.uint("max_position_embeddings", UINT64_MAX));
  DSV4_ASSIGN_OR_RETURN(uint64_t n_heads, k.uint("num_attention_heads"));
  DSV4_ASSIGN_OR_RETURN(uint64_t n_kv_heads, k.uint_or("num_key_value_heads", 1));
  if (n_kv_heads != 1)
    return Status::errorf("{}: key num_key_value_heads is {}; DeepSeek-V4 has one shared KV head",
                          source, n_kv_heads);
  DSV4_ASSIGN_OR_RETURN(uint64_t head_dim, k.uint("head_dim"));
  DSV4_ASSIGN_OR_RETURN(uint64_t rope_dims, k.uint("qk_rope_head_dim"));
  DSV4_ASSIGN_OR_RETURN(uint64_t q_rank, k.uint("q_lora_rank"));
  DSV4_ASSIGN_OR_RETURN(uint64_t o_rank, k.uint("o_lora_rank"));
  DSV4_ASSIGN_OR_RETURN(uint64_t o_groups, k.uint("o_groups"));
  DSV4_ASSIGN_OR_RETURN(uint64_t window, k.uint("sliding_window"));
  DSV4_ASSIGN_OR_RETURN(uint64_t index_heads, k.uint("index_n_heads"));
  DSV4_ASSIGN_OR_RETURN(uint64_t index_head_dim, k.uint("index_head_dim"));
  DSV4_ASSIGN_OR_RETURN(uint64_t index_topk, k.uint("index_topk"));
  DSV4_ASSIGN_OR_RETURN(uint64_t n_experts, k.uint("n_routed_experts"));
  DSV4_ASSIGN_OR_RETURN(uint64_t n_used, k.uint("num_experts_per_tok"));
  DSV4_ASSIGN_OR_RETURN(uint64_t n_shared, k.uint_or("n_shared_experts", 1));
  DSV4_ASSIGN_OR_RETURN(uint64_t expert_ffn, k.uint("moe_intermediate_size"));
  DSV4_ASSIGN_OR_RETURN(uint64_t n_hash, k.uint_or("num_hash_layers", 0));
  DSV4_ASSIGN_OR_RETURN(uint64_t hc_mult, k.uint_or("hc_mult", 4));
  DSV4_ASSIGN_OR_RETURN(uint64_t hc_iters, k.uint_or("hc_sinkhorn_iters", 20));
  DSV4_ASSIGN_OR_RETURN(double hc_eps, k.number_or("hc_eps", 1e-6));
  DSV4_ASSIGN_OR_RETURN(double rms_eps, k.number_or("rms_norm_eps", 1e-6));
  DSV4_ASSIGN_OR_RETURN(double routed_scale, k.number_or("routed_scaling_factor", 1.0));
  DSV4_ASSIGN_OR_RETURN(bool norm_topk, k.boolean_or("norm_topk_prob", true));
  DSV4_ASSIGN_OR_RETURN(double swiglu_limit, k.number_or("swiglu_limit", 0.0));
  DSV4_ASSIGN_OR_RETURN(c.rope.freq_base, k.number_or("rope_theta", 10000));
  DSV4_ASSIGN_OR_RETURN(c.rope.compress_freq_base, k.number_or("compress_rope_theta", 160000));
  DSV4_ASSIGN_OR_RETURN(uint64_t bos, root_keys.uint_or("bos_token_id", 0));
  DSV4_ASSIGN_OR_RETURN(uint64_t eos, root_keys.uint_or("eos_token_id", 1));

  c.vocab_size = static_cast<uint32_t>(vocab);
  c.hidden = static_cast<uint32_t>(hidden);
  c.n_layers = static_cast<uint32_t>(n_layers);
  c.n_mtp = static_cast<uint32_t>(n_mtp);
  c.n_heads = static_cast<uint32_t>(n_heads);
  c.head_dim = static_cast<uint32_t>(head_dim);
  c.rope.dims = static_cast<uint32_t>(rope_dims);
  c.q_lora_rank = static_cast<uint32_t>(q_rank);
  c.o_lora_rank = static_cast<uint32_t>(o_rank);
  c.o_groups = static_cast<uint32_t>(o_groups);
  c.sliding_window = static_cast<uint32_t>(window);
  c.index_heads = static_cast<uint32_t>(index_heads);
  c.index_head_dim = static_cast<uint32_t>(index_head_dim);
  c.index_topk = static_cast<uint32_t>(index_topk);
  c.n_experts = static_cast<uint32_t>(n_experts);
  c.n_experts_used = static_cast<uint32_t>(n_used);
  c.n_shared_experts = static_cast<uint32_t>(n_shared);
  c.expert_ffn = static_cast<uint32_t>(expert_ffn);
  c.n_hash_layers = static_cast<uint32_t>(n_hash);
  c.hc_mult = static_cast<uint32_t>(hc_mult);
  c.hc_sinkhorn_iters = static_cast<uint32_t>(hc_iters);
  c.hc_eps = static_cast<float>(hc_eps);
  c.rms_eps = static_cast<float>(rms_eps);
  c.routed_scale = static_cast<float>(routed_scale);
  c.norm_topk = norm_topk;
  out.bos_token_id = static_cast<uint32_t>(bos);
  out.eos_token_id = static_cast<uint32_t>(eos);

  // The pinned model.py clamps routed and shared experts alike (spec §2.3).
  c.swiglu_limit.assign(c.n_blocks(), static_cast<float>(swiglu_limit));
  c.swiglu_limit_shared = c.swiglu_limit;

  // compress_ratios lists the trunk layers and then the MTP blocks; a list of only the
  // trunk layers is completed with ratio 0 for the MTP blocks (their only legal value).
  DSV4_ASSIGN_OR_RETURN(const ordered_json* ratios, k.get("compress_ratios"));
  if (!ratios->is_array())
    return Status::errorf("{}: key compress_ratios: expected an array, found {}", source, ratios->dump());
  if (ratios->size() != c.n_blocks() && ratios->size() != c.n_layers)
    return Status::errorf("{}: key compress_ratios has {} entries, expected {} (num_hidden_layers {} + "
                          "num_nextn_predict_layers {})", source, ratios->size(), c.n_blocks(),
                          c.n_layers, c.n_mtp);
  for (size_t i = 0; i < ratios->size(); ++i) {
    DSV4_ASSIGN_OR_RETURN(uint64_t r, k.as_uint((*ratios)[i], fmt::format("compress_ratios[{}]", i)));
    c.compress_ratios.push_back(static_cast<uint32_t>(r));
  }
  c.compress_ratios.resize(c.n_blocks(), 0);

  if (k.has("rope_scaling")) {
    const ordered_json& rs = text["rope_scaling"];
    if (!rs.is_object()) return Status::errorf("{}: key rope_scaling is not an object", text_source);
    const std::string rs_source = fmt::format("{}: rope_scaling", text_source);
    const Keys r(rs, rs_source);
    DSV4_ASSIGN_OR_RETURN(std::string rope_type, r.string_or("rope_type", "yarn"));
    DSV4_ASSIGN_OR_RETURN(std::string type, r.string_or("type", rope_type));
    if (type != "yarn")
      return Status::errorf("{}: type is \"{}\"; DeepSeek-V4 uses \"yarn\"", rs_source, type);
    DSV4_ASSIGN_OR_RETURN(c.rope.yarn_factor, r.number("factor"));
    DSV4_ASSIGN_OR_RETURN(uint64_t orig, r.uint("original_max_position_embeddings"));
    c.rope.yarn_original_context = static_cast<uint32_t>(orig);
    DSV4_ASSIGN_OR_RETURN(c.rope.yarn_beta_fast, r.number_or("beta_fast", 32));
    DSV4_ASSIGN_OR_RETURN(c.rope.yarn_beta_slow, r.number_or("beta_slow", 1));
  } else {
    c.rope.yarn_factor = 1;
    c.rope.yarn_original_context = static_cast<uint32_t>(std::min<uint64_t>(c.context_length, UINT32_MAX));
  }

  if (root_keys.has("quantization_config")) {
    const ordered_json& q = root["quantization_config"];
    if (!q.is_object()) return Status::errorf("{}: key quantization_config is not an object", source);
    if (q.contains("weight_block_size")) {
      const ordered_json& bs = q["weight_block_size"];
      if (!bs.is_array() || bs.size() != 2)
        return Status::errorf("{}: quantization_config.weight_block_size: expected [rows, cols], found {}",
                              source, bs.dump());
      DSV4_ASSIGN_OR_RETURN(uint64_t br, k.as_uint(bs[0], "quantization_config.weight_block_size[0]"));
      DSV4_ASSIGN_OR_RETURN(uint64_t bc, k.as_uint(bs[1], "quantization_config.weight_block_size[1]"));
      if (br == 0 || bc == 0)
        return Status::errorf("{}: quantization_config.weight_block_size {} has a zero entry", source, bs.dump());
      out.format.fp8_block_rows = static_cast<uint32_t>(br);
      out.format.fp8_block_cols = static_cast<uint32_t>(bc);
    }
  }
  std::string expert_dtype = "fp4";
  if (v41 && root_keys.has("quantization_config") && root["quantization_config"].contains("expert_dtype")) {
    const Keys q(root["quantization_config"], fmt::format("{}: quantization_config", source));
    DSV4_ASSIGN_OR_RETURN(expert_dtype, q.string_or("expert_dtype", "fp4"));
  } else {
    DSV4_ASSIGN_OR_RETURN(expert_dtype, k.string_or("expert_dtype", "fp4"));
  }
  if (expert_dtype != "fp4" && expert_dtype != "fp8")
    return Status::errorf("{}: key expert_dtype is \"{}\", expected \"fp4\" or \"fp8\"", source, expert_dtype);
  out.format.experts_fp4 = expert_dtype == "fp4";

  if (v41) DSV4_TRY(parse_v41_keys(root_keys, k, out));
  if (Status s = c.validate(); !s) return s.with_context(std::string(source));
  return out;
}

Result<CheckpointConfig> read_checkpoint_config(const std::filesystem::path& checkpoint_dir) {
  const auto path = checkpoint_dir / "config.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::errorf("{}: cannot open: {}", path.string(), std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  return parse_checkpoint_config(ss.str(), path.string());
}

std::string checkpoint_config_json(const CheckpointConfig& config) {
  if (config.model.is_v41()) return checkpoint_config_json_v41(config);
  const ModelConfig& c = config.model;
  ordered_json j;
  j["architectures"] = {"DeepseekV4ForCausalLM"};
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["bos_token_id"] = config.bos_token_id;
  j["eos_token_id"] = config.eos_token_id;
  j["expert_dtype"] = config.format.experts_fp4 ? "fp4" : "fp8";
  j["hc_eps"] = decimal(c.hc_eps);
  j["hc_mult"] = c.hc_mult;
  j["hc_sinkhorn_iters"] = c.hc_sinkhorn_iters;
  j["head_dim"] = c.head_dim;
  j["hidden_act"] = "silu";
  j["hidden_size"] = c.hidden;
  j["index_head_dim"] = c.index_head_dim;
  j["index_n_heads"] = c.index_heads;
  j["index_topk"] = c.index_topk;
  j["initializer_range"] = 0.02;
  j["max_position_embeddings"] = c.context_length;
  j["model_type"] = "deepseek_v4";
  j["moe_intermediate_size"] = c.expert_ffn;
  j["n_routed_experts"] = c.n_experts;
  j["n_shared_experts"] = c.n_shared_experts;
  j["norm_topk_prob"] = c.norm_topk;
  j["num_attention_heads"] = c.n_heads;
  j["num_experts_per_tok"] = c.n_experts_used;
  j["num_hidden_layers"] = c.n_layers;
  j["num_hash_layers"] = c.n_hash_layers;
  j["num_key_value_heads"] = 1;
  j["num_nextn_predict_layers"] = c.n_mtp;
  j["o_groups"] = c.o_groups;
  j["o_lora_rank"] = c.o_lora_rank;
  j["q_lora_rank"] = c.q_lora_rank;
  j["qk_rope_head_dim"] = c.rope.dims;
  j["quantization_config"] = {{"activation_scheme", "dynamic"},
                              {"fmt", "e4m3"},
                              {"quant_method", "fp8"},
                              {"scale_fmt", "ue8m0"},
                              {"weight_block_size", {config.format.fp8_block_rows, config.format.fp8_block_cols}}};
  j["rms_norm_eps"] = decimal(c.rms_eps);
  j["rope_scaling"] = {{"beta_fast", c.rope.yarn_beta_fast},
                       {"beta_slow", c.rope.yarn_beta_slow},
                       {"factor", c.rope.yarn_factor},
                       {"original_max_position_embeddings", c.rope.yarn_original_context},
                       {"type", "yarn"}};
  j["rope_theta"] = c.rope.freq_base;
  j["routed_scaling_factor"] = decimal(c.routed_scale);
  j["scoring_func"] = "sqrtsoftplus";
  j["sliding_window"] = c.sliding_window;
  j["swiglu_limit"] = decimal(c.swiglu_limit.empty() ? 0.0f : c.swiglu_limit.front());
  j["tie_word_embeddings"] = false;
  j["topk_method"] = "noaux_tc";
  j["torch_dtype"] = "bfloat16";
  j["use_cache"] = true;
  j["vocab_size"] = c.vocab_size;
  j["compress_rope_theta"] = c.rope.compress_freq_base;
  j["compress_ratios"] = c.compress_ratios;
  return j.dump(2) + "\n";
}

}  // namespace dsv4::convert
