#include "model/tensor_catalog.h"

#include <fmt/format.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "gguf/gguf_file.h"
#include "model/engram_table.h"

namespace dsv4 {

std::string_view global_tensor_name(GlobalTensor t) {
  switch (t) {
    case GlobalTensor::TokenEmbd: return "token_embd.weight";
    case GlobalTensor::OutputNorm: return "output_norm.weight";
    case GlobalTensor::Output: return "output.weight";
    case GlobalTensor::OutputHcFn: return "output_hc_fn.weight";
    case GlobalTensor::OutputHcBase: return "output_hc_base.weight";
    case GlobalTensor::OutputHcScale: return "output_hc_scale.weight";
    case GlobalTensor::DsparkMarkovEmbd: return "markov_w1.weight";
    case GlobalTensor::DsparkMarkovHead: return "markov_w2.weight";
    case GlobalTensor::DsparkConfProj: return "conf_proj.weight";
    case GlobalTensor::Vision: return "vision.";
  }
  return "?";
}

std::string_view block_tensor_suffix(BlockTensor t) {
  switch (t) {
    case BlockTensor::AttnNorm: return "attn_norm.weight";
    case BlockTensor::AttnSinks: return "attn_sinks.weight";
    case BlockTensor::AttnQA: return "attn_q_a.weight";
    case BlockTensor::AttnQANorm: return "attn_q_a_norm.weight";
    case BlockTensor::AttnQB: return "attn_q_b.weight";
    case BlockTensor::AttnKv: return "attn_kv.weight";
    case BlockTensor::AttnKvNorm: return "attn_kv_a_norm.weight";
    case BlockTensor::AttnOutputA: return "attn_output_a.weight";
    case BlockTensor::AttnOutputB: return "attn_output_b.weight";
    case BlockTensor::HcAttnFn: return "hc_attn_fn.weight";
    case BlockTensor::HcAttnBase: return "hc_attn_base.weight";
    case BlockTensor::HcAttnScale: return "hc_attn_scale.weight";
    case BlockTensor::HcFfnFn: return "hc_ffn_fn.weight";
    case BlockTensor::HcFfnBase: return "hc_ffn_base.weight";
    case BlockTensor::HcFfnScale: return "hc_ffn_scale.weight";
    case BlockTensor::CompressorKv: return "attn_compressor_kv.weight";
    case BlockTensor::CompressorGate: return "attn_compressor_gate.weight";
    case BlockTensor::CompressorApe: return "attn_compressor_ape.weight";
    case BlockTensor::CompressorNorm: return "attn_compressor_norm.weight";
    case BlockTensor::IndexerProj: return "indexer.proj.weight";
    case BlockTensor::IndexerQB: return "indexer.attn_q_b.weight";
    case BlockTensor::IndexerCompressorKv: return "indexer_compressor_kv.weight";
    case BlockTensor::IndexerCompressorGate: return "indexer_compressor_gate.weight";
    case BlockTensor::IndexerCompressorApe: return "indexer_compressor_ape.weight";
    case BlockTensor::IndexerCompressorNorm: return "indexer_compressor_norm.weight";
    case BlockTensor::FfnGateInp: return "ffn_gate_inp.weight";
    case BlockTensor::FfnTid2Eid: return "ffn_gate_tid2eid.weight";
    case BlockTensor::FfnExpProbsB: return "exp_probs_b.bias";
    case BlockTensor::FfnNorm: return "ffn_norm.weight";
    case BlockTensor::FfnGateExps: return "ffn_gate_exps.weight";
    case BlockTensor::FfnUpExps: return "ffn_up_exps.weight";
    case BlockTensor::FfnDownExps: return "ffn_down_exps.weight";
    case BlockTensor::FfnGateShexp: return "ffn_gate_shexp.weight";
    case BlockTensor::FfnUpShexp: return "ffn_up_shexp.weight";
    case BlockTensor::FfnDownShexp: return "ffn_down_shexp.weight";
    case BlockTensor::NextnEhProj: return "nextn.eh_proj.weight";
    case BlockTensor::NextnEnorm: return "nextn.enorm.weight";
    case BlockTensor::NextnHnorm: return "nextn.hnorm.weight";
    case BlockTensor::NextnSharedHeadNorm: return "nextn.shared_head_norm.weight";
    case BlockTensor::NextnHcHeadFn: return "nextn.hc_head_fn.weight";
    case BlockTensor::NextnHcHeadBase: return "nextn.hc_head_base.weight";
    case BlockTensor::NextnHcHeadScale: return "nextn.hc_head_scale.weight";
    case BlockTensor::NextnEmbedTokens: return "nextn.embed_tokens.weight";
    case BlockTensor::NextnSharedHeadHead: return "nextn.shared_head_head.weight";
    case BlockTensor::IndexerK: return "indexer.attn_k.weight";
    case BlockTensor::IndexerKNorm: return "indexer.k_norm.weight";
    case BlockTensor::FfnExpProbsBVl: return "exp_probs_b_vl.bias";
    case BlockTensor::EngramEmbd: return "engram_embd.weight";
    case BlockTensor::EngramKv: return "engram_kv.weight";
    case BlockTensor::EngramQ: return "engram_q_norm.weight";
    case BlockTensor::EngramK: return "engram_k_norm.weight";
    case BlockTensor::DsparkMainProj: return "dspark_main_proj.weight";
    case BlockTensor::DsparkMainNorm: return "dspark_main_norm.weight";
  }
  return "?";
}

std::string block_tensor_name(uint32_t block, BlockTensor t) {
  return fmt::format("blk.{}.{}", block, block_tensor_suffix(t));
}

bool type_allowed(TypeClass cls, GgmlType type) {
  switch (cls) {
    case TypeClass::Matrix:
      return type != GgmlType::I32 && ggml_traits(type).supported;
    case TypeClass::Vector:
      return type == GgmlType::F32 || type == GgmlType::F16 || type == GgmlType::BF16;
    case TypeClass::Index:
      return type == GgmlType::I32;
    case TypeClass::EngramTable:
      return type == GgmlType::I8 || type_allowed(TypeClass::Matrix, type);
  }
  return false;
}

std::string_view type_class_name(TypeClass cls) {
  switch (cls) {
    case TypeClass::Matrix: return "matrix (any type dsv4 decodes: f32, f16, bf16, q4_0..q8_0, q2_K..q6_K, iq1_s..iq4_xs, mxfp4)";
    case TypeClass::Vector: return "vector (f32, f16, bf16)";
    case TypeClass::Index: return "index (i32)";
    case TypeClass::EngramTable: return "engram table (i8 FP8 rows, or a matrix type)";
  }
  return "?";
}

std::string_view tensor_role_name(TensorRole role) {
  switch (role) {
    case TensorRole::RoutedExperts: return "routed experts";
    case TensorRole::Attention: return "attention";
    case TensorRole::DenseFfn: return "shared expert, router, MTP projection";
    case TensorRole::EmbeddingHead: return "embedding and head";
    case TensorRole::Small: return "norms, hyper-connections, biases, tables";
    case TensorRole::EngramTables: return "engram tables (streamed)";
    case TensorRole::VisionTower: return "vision tower";
  }
  return "?";
}

uint64_t TensorSpec::n_elements() const {
  uint64_t n = 1;
  for (uint64_t d : ne) n *= d;
  return n;
}

bool TensorSpec::has_name(std::string_view n) const {
  return name == n || std::find(aliases.begin(), aliases.end(), n) != aliases.end();
}

const TensorSpec* TensorCatalog::find(std::string_view name) const {
  for (const auto& t : tensors)
    if (t.has_name(name)) return &t;
  return nullptr;
}

std::vector<uint64_t> stored_shape(const TensorSpec& spec, GgmlType type) {
  std::vector<uint64_t> ne = spec.ne;
  if (spec.type_class == TypeClass::EngramTable && type == GgmlType::I8 && !ne.empty())
    ne[0] = engram_row_bytes(ne[0]);
  return ne;
}

std::optional<uint64_t> stored_bytes(const TensorSpec& spec, GgmlType type) {
  const std::vector<uint64_t> ne = stored_shape(spec, type);
  const auto row = ggml_row_bytes(type, ne.empty() ? 1 : ne[0]);
  if (!row) return std::nullopt;
  uint64_t rows = 1;
  for (size_t i = 1; i < ne.size(); ++i) rows *= ne[i];
  return *row * rows;
}

size_t TensorCatalog::n_required() const {
  return static_cast<size_t>(
      std::count_if(tensors.begin(), tensors.end(), [](const TensorSpec& t) { return t.required; }));
}

std::string shape_outer_first(std::span<const uint64_t> ne) {
  std::string s = "[";
  for (size_t i = ne.size(); i-- > 0;) {
    s += std::to_string(ne[i]);
    if (i > 0) s += ", ";
  }
  return s + "]";
}

namespace {

class CatalogBuilder {
 public:
  explicit CatalogBuilder(const ModelConfig& c) : c_(c) {}

  void global(GlobalTensor kind, std::vector<uint64_t> ne, TypeClass cls, TensorRole role) {
    TensorSpec s;
    s.name = std::string(global_tensor_name(kind));
    s.ne = std::move(ne);
    s.type_class = cls;
    s.role = role;
    s.global_kind = kind;
    out_.tensors.push_back(std::move(s));
  }

  void vision(std::string official, std::vector<uint64_t> ne, TypeClass cls) {
    TensorSpec s;
    s.name = official.starts_with("vision.") ? official : "vision." + official;
    s.ne = std::move(ne);
    s.type_class = cls;
    s.role = TensorRole::VisionTower;
    s.global_kind = GlobalTensor::Vision;
    out_.tensors.push_back(std::move(s));
  }

  void block(uint32_t b, BlockTensor kind, std::vector<uint64_t> ne, TypeClass cls,
             TensorRole role, bool required = true) {
    TensorSpec s;
    s.name = block_tensor_name(b, kind);
    s.ne = std::move(ne);
    s.type_class = cls;
    s.role = role;
    s.required = required;
    s.block = b;
    s.block_kind = kind;
    out_.tensors.push_back(std::move(s));
  }

  TensorCatalog build() {
    if (c_.is_v41()) return build_v41();
    const uint64_t D = c_.hidden, V = c_.vocab_size, hc = c_.hc_mult;
    using TC = TypeClass;
    using R = TensorRole;
    global(GlobalTensor::TokenEmbd, {D, V}, TC::Matrix, R::EmbeddingHead);
    global(GlobalTensor::OutputNorm, {D}, TC::Vector, R::Small);
    global(GlobalTensor::Output, {D, V}, TC::Matrix, R::EmbeddingHead);
    global(GlobalTensor::OutputHcFn, {hc * D, hc}, TC::Matrix, R::Small);
    global(GlobalTensor::OutputHcBase, {hc}, TC::Vector, R::Small);
    global(GlobalTensor::OutputHcScale, {1}, TC::Vector, R::Small);
    for (uint32_t b = 0; b < c_.n_blocks(); ++b) add_block(b);
    return std::move(out_);
  }

 private:
  void add_block(uint32_t b) {
    using BT = BlockTensor;
    using TC = TypeClass;
    using R = TensorRole;
    const uint64_t D = c_.hidden, H = c_.n_heads, hd = c_.head_dim, qr = c_.q_lora_rank;
    const uint64_t groups = c_.o_groups, orank = c_.o_lora_rank;
    const uint64_t hc = c_.hc_mult, mix = c_.hc_dim();
    const uint64_t E = c_.n_experts, I = c_.expert_ffn;

    block(b, BT::AttnNorm, {D}, TC::Vector, R::Small);
    block(b, BT::AttnSinks, {H}, TC::Vector, R::Small);
    block(b, BT::AttnQA, {D, qr}, TC::Matrix, R::Attention);
    block(b, BT::AttnQANorm, {qr}, TC::Vector, R::Small);
    block(b, BT::AttnQB, {qr, H * hd}, TC::Matrix, R::Attention);
    block(b, BT::AttnKv, {D, hd}, TC::Matrix, R::Attention);
    block(b, BT::AttnKvNorm, {hd}, TC::Vector, R::Small);
    block(b, BT::AttnOutputA, {H * hd / groups, groups * orank}, TC::Matrix, R::Attention);
    block(b, BT::AttnOutputB, {groups * orank, D}, TC::Matrix, R::Attention);

    block(b, BT::HcAttnFn, {hc * D, mix}, TC::Matrix, R::Small);
    block(b, BT::HcAttnBase, {mix}, TC::Vector, R::Small);
    block(b, BT::HcAttnScale, {3}, TC::Vector, R::Small);
    block(b, BT::HcFfnFn, {hc * D, mix}, TC::Matrix, R::Small);
    block(b, BT::HcFfnBase, {mix}, TC::Vector, R::Small);
    block(b, BT::HcFfnScale, {3}, TC::Vector, R::Small);

    const uint64_t ratio = c_.ratio(b);
    if (ratio != 0) {
      const uint64_t width = c_.compressor_overlap(b) * hd;
      block(b, BT::CompressorKv, {D, width}, TC::Matrix, R::Attention);
      block(b, BT::CompressorGate, {D, width}, TC::Matrix, R::Attention);
      // llama.cpp takes the APE in any type (llama-quantize quantises this 2-D weight).
      block(b, BT::CompressorApe, {width, ratio}, TC::Matrix, R::Small);
      block(b, BT::CompressorNorm, {hd}, TC::Vector, R::Small);
    }
    if (c_.attention_kind(b) == AttentionKind::CSA) {
      const uint64_t ih = c_.index_heads, id = c_.index_head_dim;
      block(b, BT::IndexerProj, {D, ih}, TC::Matrix, R::Attention);
      block(b, BT::IndexerQB, {qr, ih * id}, TC::Matrix, R::Attention);
      block(b, BT::IndexerCompressorKv, {D, 2 * id}, TC::Matrix, R::Attention);
      block(b, BT::IndexerCompressorGate, {D, 2 * id}, TC::Matrix, R::Attention);
      block(b, BT::IndexerCompressorApe, {2 * id, ratio}, TC::Matrix, R::Small);
      block(b, BT::IndexerCompressorNorm, {id}, TC::Vector, R::Small);
    }

    block(b, BT::FfnGateInp, {D, E}, TC::Matrix, R::DenseFfn);
    if (c_.is_hash_layer(b))
      block(b, BT::FfnTid2Eid, {c_.n_experts_used, c_.vocab_size}, TC::Index, R::Small);
    else
      block(b, BT::FfnExpProbsB, {E}, TC::Vector, R::Small);
    block(b, BT::FfnNorm, {D}, TC::Vector, R::Small);
    block(b, BT::FfnGateExps, {D, I, E}, TC::Matrix, R::RoutedExperts);
    block(b, BT::FfnUpExps, {D, I, E}, TC::Matrix, R::RoutedExperts);
    block(b, BT::FfnDownExps, {I, D, E}, TC::Matrix, R::RoutedExperts);
    const uint64_t shared = I * c_.n_shared_experts;
    block(b, BT::FfnGateShexp, {D, shared}, TC::Matrix, R::DenseFfn);
    block(b, BT::FfnUpShexp, {D, shared}, TC::Matrix, R::DenseFfn);
    block(b, BT::FfnDownShexp, {shared, D}, TC::Matrix, R::DenseFfn);

    if (c_.is_mtp(b)) {
      // Optional ones are absent from files of older converters; the forward pass then
      // uses the trunk's tensor, as llama.cpp does.
      block(b, BT::NextnEhProj, {2 * D, D}, TC::Matrix, R::DenseFfn);
      block(b, BT::NextnEnorm, {D}, TC::Vector, R::Small);
      block(b, BT::NextnHnorm, {D}, TC::Vector, R::Small);
      block(b, BT::NextnSharedHeadNorm, {D}, TC::Vector, R::Small, false);
      block(b, BT::NextnHcHeadFn, {hc * D, hc}, TC::Matrix, R::Small, false);
      block(b, BT::NextnHcHeadBase, {hc}, TC::Vector, R::Small, false);
      block(b, BT::NextnHcHeadScale, {1}, TC::Vector, R::Small, false);
      block(b, BT::NextnEmbedTokens, {D, c_.vocab_size}, TC::Matrix, R::EmbeddingHead, false);
      block(b, BT::NextnSharedHeadHead, {D, c_.vocab_size}, TC::Matrix, R::EmbeddingHead, false);
    }
  }


  // ---- V4.1 (deepseek41): shared sources, Engram, DSpark, no hash layers, no output_hc_*.
  TensorCatalog build_v41() {
    const uint64_t D = c_.hidden, V = c_.vocab_size;
    using TC = TypeClass;
    using R = TensorRole;
    global(GlobalTensor::TokenEmbd, {D, V}, TC::Matrix, R::EmbeddingHead);
    global(GlobalTensor::OutputNorm, {D}, TC::Vector, R::Small);
    global(GlobalTensor::Output, {D, V}, TC::Matrix, R::EmbeddingHead);
    if (c_.dspark && c_.n_mtp > 0) {
      const uint64_t rank = c_.dspark->markov_rank;
      global(GlobalTensor::DsparkMarkovEmbd, {rank, V}, TC::Matrix, R::EmbeddingHead);
      global(GlobalTensor::DsparkMarkovHead, {rank, V}, TC::Matrix, R::EmbeddingHead);
      global(GlobalTensor::DsparkConfProj, {D + rank, 1}, TC::Matrix, R::Small);
    }
    if (c_.vision && c_.vision->in_file) add_vision();
    for (uint32_t b = 0; b < c_.n_blocks(); ++b) add_block_v41(b);
    return std::move(out_);
  }

  void add_block_v41(uint32_t b) {
    using BT = BlockTensor;
    using TC = TypeClass;
    using R = TensorRole;
    const uint64_t D = c_.hidden, H = c_.n_heads, hd = c_.head_dim, qr = c_.q_lora_rank;
    const uint64_t groups = c_.o_groups, orank = c_.o_lora_rank;
    const uint64_t hc = c_.hc_mult, mix = c_.hc_dim();
    const uint64_t E = c_.experts_of(b), I = c_.expert_ffn;

    block(b, BT::AttnNorm, {D}, TC::Vector, R::Small);
    block(b, BT::AttnSinks, {H}, TC::Vector, R::Small);
    block(b, BT::AttnQA, {D, qr}, TC::Matrix, R::Attention);
    block(b, BT::AttnQANorm, {qr}, TC::Vector, R::Small);
    block(b, BT::AttnQB, {qr, H * hd}, TC::Matrix, R::Attention);
    block(b, BT::AttnKv, {D, hd}, TC::Matrix, R::Attention);
    block(b, BT::AttnKvNorm, {hd}, TC::Vector, R::Small);
    block(b, BT::AttnOutputA, {H * hd / groups, groups * orank}, TC::Matrix, R::Attention);
    block(b, BT::AttnOutputB, {groups * orank, D}, TC::Matrix, R::Attention);
    block(b, BT::HcAttnFn, {hc * D, mix}, TC::Matrix, R::Small);
    block(b, BT::HcAttnBase, {mix}, TC::Vector, R::Small);
    block(b, BT::HcAttnScale, {3}, TC::Vector, R::Small);
    block(b, BT::HcFfnFn, {hc * D, mix}, TC::Matrix, R::Small);
    block(b, BT::HcFfnBase, {mix}, TC::Vector, R::Small);
    block(b, BT::HcFfnScale, {3}, TC::Vector, R::Small);

    const LayerRoles roles = c_.layer_roles(b);
    const uint64_t ih = c_.index_heads, id = c_.index_head_dim;
    if (roles.kv_source) {
      // No APE and no overlap (§3.3); the gate only pools groups of ratio > 1.
      block(b, BT::CompressorKv, {D, hd}, TC::Matrix, R::Attention);
      if (c_.ratio(b) > 1) block(b, BT::CompressorGate, {D, hd}, TC::Matrix, R::Attention);
      block(b, BT::CompressorNorm, {hd}, TC::Vector, R::Small);
      block(b, BT::IndexerK, {hd, id}, TC::Matrix, R::Attention);
      block(b, BT::IndexerKNorm, {id}, TC::Vector, R::Small);
    }
    if (roles.index_source) {
      block(b, BT::IndexerProj, {D, ih}, TC::Matrix, R::Attention);
      block(b, BT::IndexerQB, {qr, ih * id}, TC::Matrix, R::Attention);
    }
    if (c_.is_engram_layer(b)) {
      const EngramConfig& e = *c_.engram;
      const uint64_t rows = e.table_rows.at(static_cast<size_t>(e.index_of(b)));
      block(b, BT::EngramEmbd, {e.dim, rows}, TC::EngramTable, R::EngramTables);
      block(b, BT::EngramKv, {e.kv_inputs(), (hc + 1) * D}, TC::Matrix, R::Attention);
      block(b, BT::EngramQ, {D, hc}, TC::Vector, R::Small);
      block(b, BT::EngramK, {D, hc}, TC::Vector, R::Small);
      // Metrale's spellings (spec §4.2).
      out_.tensors[out_.tensors.size() - 3].aliases = {block_alias(b, "engram_wkv.weight")};
      out_.tensors[out_.tensors.size() - 2].aliases = {block_alias(b, "engram_q.weight")};
      out_.tensors[out_.tensors.size() - 1].aliases = {block_alias(b, "engram_k.weight")};
    }

    block(b, BT::FfnGateInp, {D, E}, TC::Matrix, R::DenseFfn);
    block(b, BT::FfnExpProbsB, {E}, TC::Vector, R::Small);
    // Present in published files whether or not they keep the vision tower.
    block(b, BT::FfnExpProbsBVl, {E}, TC::Vector, R::Small, c_.vision && c_.vision->in_file);
    block(b, BT::FfnNorm, {D}, TC::Vector, R::Small);
    block(b, BT::FfnGateExps, {D, I, E}, TC::Matrix, R::RoutedExperts);
    block(b, BT::FfnUpExps, {D, I, E}, TC::Matrix, R::RoutedExperts);
    block(b, BT::FfnDownExps, {I, D, E}, TC::Matrix, R::RoutedExperts);
    const uint64_t shared = I * c_.n_shared_experts;
    block(b, BT::FfnGateShexp, {D, shared}, TC::Matrix, R::DenseFfn);
    block(b, BT::FfnUpShexp, {D, shared}, TC::Matrix, R::DenseFfn);
    block(b, BT::FfnDownShexp, {shared, D}, TC::Matrix, R::DenseFfn);

    // DSpark stages: the first projects the target layers' mean streams, the last
    // normalises before the shared head.
    if (c_.is_mtp(b) && c_.dspark) {
      if (b == c_.n_layers) {
        const uint64_t targets = c_.dspark->target_layers.size();
        block(b, BT::DsparkMainProj, {targets * D, D}, TC::Matrix, R::DenseFfn);
        block(b, BT::DsparkMainNorm, {D}, TC::Vector, R::Small);
      }
      if (b + 1 == c_.n_blocks()) block(b, BT::NextnSharedHeadNorm, {D}, TC::Vector, R::Small);
    }
  }

  void add_vision() {
    using TC = TypeClass;
    const VisionConfig& v = *c_.vision;
    const uint64_t W = v.hidden, D = c_.hidden, P = v.patch_size, F = v.ffn;
    const uint64_t folded = W * v.downsample * v.downsample;
    vision("vision.patch_embed.proj.weight", {3 * P * P, W}, TC::Matrix);
    vision("vision.patch_embed.proj.bias", {W}, TC::Vector);
    for (uint32_t l = 0; l < v.n_layers; ++l) {
      const std::string p = fmt::format("vision.blocks.{}.", l);
      vision(p + "attn.wqkv.weight", {W, 3 * W}, TC::Matrix);
      vision(p + "attn.wqkv.bias", {3 * W}, TC::Vector);
      vision(p + "attn.wo.weight", {W, W}, TC::Matrix);
      vision(p + "attn.wo.bias", {W}, TC::Vector);
      vision(p + "mlp.w1.weight", {W, 2 * F}, TC::Matrix);  // gate and up, stacked
      vision(p + "mlp.w2.weight", {F, W}, TC::Matrix);
      vision(p + "norm1.weight", {W}, TC::Vector);
      vision(p + "norm2.weight", {W}, TC::Vector);
    }
    vision("vision.norm.weight", {W}, TC::Vector);
    vision("aligner.w1.weight", {folded, D}, TC::Matrix);
    vision("aligner.w1.bias", {D}, TC::Vector);
    vision("aligner.w2.weight", {D, D}, TC::Matrix);
    vision("aligner.w2.bias", {D}, TC::Vector);
    for (const char* name : {"image_start", "image_end", "image_newline"}) vision(name, {D}, TC::Vector);
  }

  static std::string block_alias(uint32_t b, std::string_view suffix) { return fmt::format("blk.{}.{}", b, suffix); }

  const ModelConfig& c_;
  TensorCatalog out_;
};

// A shape matches when the dims agree, ignoring trailing 1s (ggml pads ne to 4 dims).
bool same_shape(std::span<const uint64_t> got, std::span<const uint64_t> want) {
  const size_t n = std::max(got.size(), want.size());
  for (size_t i = 0; i < n; ++i) {
    const uint64_t g = i < got.size() ? got[i] : 1;
    const uint64_t w = i < want.size() ? want[i] : 1;
    if (g != w) return false;
  }
  return true;
}

}  // namespace

TensorCatalog build_tensor_catalog(const ModelConfig& config) {
  return CatalogBuilder(config).build();
}

Status check_tensors(const TensorCatalog& catalog, std::span<const gguf::TensorInfo> tensors,
                     std::string_view file_label) {
  std::unordered_map<std::string_view, const TensorSpec*> by_name;
  for (const auto& spec : catalog.tensors) {
    by_name.emplace(spec.name, &spec);
    for (const auto& alias : spec.aliases) by_name.emplace(alias, &spec);
  }

  std::vector<std::string> problems;
  std::unordered_set<const TensorSpec*> seen;
  for (const auto& t : tensors) {
    auto it = by_name.find(t.name);
    if (it != by_name.end() && !seen.insert(it->second).second) {
      problems.push_back(fmt::format("{}: tensor {}: a second copy of {} (under another published name)",
                                     file_label, t.name, it->second->name));
      continue;
    }
    if (it == by_name.end()) {
      problems.push_back(fmt::format("{}: tensor {}: unexpected for this config (shape {}, {})",
                                     file_label, t.name, shape_outer_first(t.ne),
                                     ggml_type_name(t.type)));
      continue;
    }
    const TensorSpec& spec = *it->second;
    const std::vector<uint64_t> want = stored_shape(spec, t.type);
    if (!same_shape(t.ne, want))
      problems.push_back(fmt::format("{}: tensor {}: shape {}, expected {}", file_label, t.name,
                                     shape_outer_first(t.ne), shape_outer_first(want)));
    if (!type_allowed(spec.type_class, t.type))
      problems.push_back(fmt::format("{}: tensor {}: type {} not allowed, expected {}",
                                     file_label, t.name, ggml_type_name(t.type),
                                     type_class_name(spec.type_class)));
    else if (spec.type_class != TypeClass::Vector && !ggml_row_bytes(t.type, want[0]))
      problems.push_back(fmt::format("{}: tensor {}: row length {} is not a multiple of the "
                                     "{} block size {}",
                                     file_label, t.name, spec.ne[0], ggml_type_name(t.type),
                                     ggml_traits(t.type).block_elems));
  }
  for (const auto& spec : catalog.tensors)
    if (spec.required && !seen.contains(&spec))
      problems.push_back(fmt::format("{}: tensor {}: missing (shape {}, {})", file_label,
                                     spec.name, shape_outer_first(spec.ne),
                                     type_class_name(spec.type_class)));
  if (problems.empty()) return Status::ok();
  std::string msg = fmt::format("{} tensor problem{} found:", problems.size(),
                                problems.size() == 1 ? "" : "s");
  for (const auto& p : problems) msg += "\n  " + p;
  return Status::error(std::move(msg));
}

}  // namespace dsv4
