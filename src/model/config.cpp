#include "model/config.h"

#include <fmt/format.h>

#include <bit>
#include <limits>

#include "gguf/gguf_file.h"
#include "gguf/gguf_writer.h"

namespace dsv4 {
namespace {

// llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS: score = sqrt(softplus(logit)).
constexpr uint64_t kGatingSqrtSoftplus = 4;

// Reads `<arch>.<key>` with the arch prefix and the file name in every message.
class KeyReader {
 public:
  KeyReader(const gguf::GgufFile& file, std::string arch) : file_(file), arch_(std::move(arch)) {}

  std::string key(std::string_view k) const { return fmt::format("{}.{}", arch_, k); }
  bool has(std::string_view k) const { return file_.find(key(k)) != nullptr; }

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

Status parse_v4(const KeyReader& r, std::optional<uint32_t> mtp_blocks, ModelConfig& c) {
  const auto& file = r.file();
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
  DSV4_ASSIGN_OR_RETURN(std::string scaling, r.str("rope.scaling.type"));
  if (scaling != "yarn")
    return Status::errorf("{}: key {}: \"{}\", expected \"yarn\"", file.path(),
                          r.key("rope.scaling.type"), scaling);
  DSV4_ASSIGN_OR_RETURN(c.rope.yarn_factor, r.f64("rope.scaling.factor"));
  DSV4_ASSIGN_OR_RETURN(c.rope.yarn_original_context, r.u32("rope.scaling.original_context_length"));
  DSV4_ASSIGN_OR_RETURN(c.rope.yarn_beta_fast, r.f64("rope.scaling.yarn_beta_fast"));
  DSV4_ASSIGN_OR_RETURN(c.rope.yarn_beta_slow, r.f64("rope.scaling.yarn_beta_slow"));

  DSV4_ASSIGN_OR_RETURN(c.index_heads, r.u32("attention.indexer.head_count"));
  DSV4_ASSIGN_OR_RETURN(c.index_head_dim, r.u32("attention.indexer.key_length"));
  DSV4_ASSIGN_OR_RETURN(c.index_topk, r.u32("attention.indexer.top_k"));

  DSV4_ASSIGN_OR_RETURN(c.n_experts, r.u32("expert_count"));
  DSV4_ASSIGN_OR_RETURN(c.n_experts_used, r.u32("expert_used_count"));
  DSV4_ASSIGN_OR_RETURN(c.n_shared_experts, r.u32("expert_shared_count"));
  DSV4_ASSIGN_OR_RETURN(c.expert_ffn, r.u32("expert_feed_forward_length"));
  DSV4_ASSIGN_OR_RETURN(c.routed_scale, r.f32("expert_weights_scale"));
  DSV4_ASSIGN_OR_RETURN(c.norm_topk, r.boolean("expert_weights_norm"));
  DSV4_ASSIGN_OR_RETURN(uint64_t gating, r.u64("expert_gating_func"));
  if (gating != kGatingSqrtSoftplus)
    return Status::errorf("{}: key {}: {}, DeepSeek-V4 needs {} (sqrt-softplus)", file.path(),
                          r.key("expert_gating_func"), gating, kGatingSqrtSoftplus);
  DSV4_ASSIGN_OR_RETURN(c.n_hash_layers, r.u32("hash_layer_count"));
  DSV4_ASSIGN_OR_RETURN(c.swiglu_limit, r.per_block_floats("swiglu_clamp_exp", block_count));
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

}  // namespace

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
  // The reference's FP8 KV rounding works on 64-blocks of the non-rope dims (spec §8).
  if ((head_dim - rope.dims) % 64 != 0)
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
  if (engram && variant != ModelVariant::V41)
    return Status::error("config: an Engram part needs the deepseek41 (V4.1) variant");
  return Status::ok();
}

Result<ModelConfig> ModelConfig::from_gguf(const gguf::GgufFile& file, std::optional<uint32_t> mtp_blocks) {
  DSV4_ASSIGN_OR_RETURN(std::string arch, file.get_string("general.architecture"));
  ModelConfig c;
  if (arch == "deepseek41")
    return Status::errorf("{}: architecture deepseek41 (DeepSeek-V4.1) is not supported yet; "
                          "this build runs deepseek4 files", file.path());
  if (arch != "deepseek4")
    return Status::errorf("{}: general.architecture is \"{}\", expected \"deepseek4\"",
                          file.path(), arch);
  c.variant = ModelVariant::V4;
  if (file.find("general.name")) {
    DSV4_ASSIGN_OR_RETURN(c.name, file.get_string("general.name"));
  }
  DSV4_TRY(parse_v4(KeyReader(file, arch), mtp_blocks, c));
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
