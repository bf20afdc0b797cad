#include "convert/name_map.h"

#include <fmt/format.h>

namespace dsv4::convert {
namespace {

std::optional<std::string_view> global_official_name(GlobalTensor t) {
  switch (t) {
    case GlobalTensor::TokenEmbd: return "embed.weight";
    case GlobalTensor::OutputNorm: return "norm.weight";
    case GlobalTensor::Output: return "head.weight";
    case GlobalTensor::OutputHcFn: return "hc_head_fn";
    case GlobalTensor::OutputHcBase: return "hc_head_base";
    case GlobalTensor::OutputHcScale: return "hc_head_scale";
    default: return std::nullopt;  // V4.1 kinds: official_source_v41
  }
  return std::nullopt;
}

// The official name after the block prefix; experts and eh_proj are handled by the caller.
std::optional<std::string_view> block_official_suffix(BlockTensor t) {
  using BT = BlockTensor;
  switch (t) {
    case BT::AttnNorm: return "attn_norm.weight";
    case BT::AttnSinks: return "attn.attn_sink";
    case BT::AttnQA: return "attn.wq_a.weight";
    case BT::AttnQANorm: return "attn.q_norm.weight";
    case BT::AttnQB: return "attn.wq_b.weight";
    case BT::AttnKv: return "attn.wkv.weight";
    case BT::AttnKvNorm: return "attn.kv_norm.weight";
    case BT::AttnOutputA: return "attn.wo_a.weight";
    case BT::AttnOutputB: return "attn.wo_b.weight";
    case BT::HcAttnFn: return "hc_attn_fn";
    case BT::HcAttnBase: return "hc_attn_base";
    case BT::HcAttnScale: return "hc_attn_scale";
    case BT::HcFfnFn: return "hc_ffn_fn";
    case BT::HcFfnBase: return "hc_ffn_base";
    case BT::HcFfnScale: return "hc_ffn_scale";
    case BT::CompressorKv: return "attn.compressor.wkv.weight";
    case BT::CompressorGate: return "attn.compressor.wgate.weight";
    case BT::CompressorApe: return "attn.compressor.ape";
    case BT::CompressorNorm: return "attn.compressor.norm.weight";
    case BT::IndexerProj: return "attn.indexer.weights_proj.weight";
    case BT::IndexerQB: return "attn.indexer.wq_b.weight";
    case BT::IndexerCompressorKv: return "attn.indexer.compressor.wkv.weight";
    case BT::IndexerCompressorGate: return "attn.indexer.compressor.wgate.weight";
    case BT::IndexerCompressorApe: return "attn.indexer.compressor.ape";
    case BT::IndexerCompressorNorm: return "attn.indexer.compressor.norm.weight";
    case BT::FfnGateInp: return "ffn.gate.weight";
    case BT::FfnTid2Eid: return "ffn.gate.tid2eid";
    case BT::FfnExpProbsB: return "ffn.gate.bias";
    case BT::FfnNorm: return "ffn_norm.weight";
    case BT::FfnGateShexp: return "ffn.shared_experts.w1.weight";
    case BT::FfnUpShexp: return "ffn.shared_experts.w3.weight";
    case BT::FfnDownShexp: return "ffn.shared_experts.w2.weight";
    case BT::NextnEnorm: return "enorm.weight";
    case BT::NextnHnorm: return "hnorm.weight";
    case BT::NextnSharedHeadNorm: return "norm.weight";
    case BT::NextnHcHeadFn: return "hc_head_fn";
    case BT::NextnHcHeadBase: return "hc_head_base";
    case BT::NextnHcHeadScale: return "hc_head_scale";
    default: return std::nullopt;
  }
}

std::vector<uint64_t> reversed(const std::vector<uint64_t>& ne) { return {ne.rbegin(), ne.rend()}; }

// ---- V4.1 ----
std::optional<TensorSource> official_source_v41(const ModelConfig& config, const TensorSpec& spec) {
  TensorSource src;
  src.part_shape = reversed(spec.ne);
  const std::string last_stage = fmt::format("mtp.{}.", config.n_mtp == 0 ? 0 : config.n_mtp - 1);
  if (spec.global_kind) {
    switch (*spec.global_kind) {
      case GlobalTensor::DsparkMarkovEmbd: src.names = {last_stage + "markov_head.embed.weight"}; return src;
      case GlobalTensor::DsparkMarkovHead: src.names = {last_stage + "markov_head.head.weight"}; return src;
      case GlobalTensor::DsparkConfProj: src.names = {last_stage + "confidence_head.proj.weight"}; return src;
      case GlobalTensor::Vision: {
        // GGUF "vision.<x>": the tower keeps its official name, the rest drops the prefix.
        const std::string_view x = std::string_view(spec.name).substr(7);
        src.names = {x.starts_with("aligner.") || x.starts_with("image_") ? std::string(x) : spec.name};
        return src;
      }
      default: return std::nullopt;
    }
  }
  const std::string prefix = official_block_prefix(config, spec.block.value_or(0));
  using BT = BlockTensor;
  switch (spec.block_kind.value_or(BT::AttnNorm)) {
    case BT::IndexerK: src.names = {prefix + "attn.indexer.wk.weight"}; return src;
    case BT::IndexerKNorm: src.names = {prefix + "attn.indexer.k_norm.weight"}; return src;
    case BT::FfnExpProbsBVl: src.names = {prefix + "ffn.gate.bias_vl"}; return src;
    case BT::EngramEmbd:
      src.layout = SourceLayout::EngramRows;
      src.names = {prefix + "engram.embed.weight"};
      return src;
    case BT::EngramKv: src.names = {prefix + "engram.wkv.weight"}; return src;
    case BT::EngramQ: src.names = {prefix + "engram.q_weight"}; return src;
    case BT::EngramK: src.names = {prefix + "engram.k_weight"}; return src;
    case BT::DsparkMainProj: src.names = {prefix + "main_proj.weight"}; return src;
    case BT::DsparkMainNorm: src.names = {prefix + "main_norm.weight"}; return src;
    default: return std::nullopt;
  }
}

}  // namespace

bool is_official_vision_tensor(std::string_view name) {
  return name.starts_with("vision.") || name.starts_with("aligner.") || name.starts_with("image_") ||
         name.ends_with(".ffn.gate.bias_vl");
}

std::string official_block_prefix(const ModelConfig& config, uint32_t block) {
  return config.is_mtp(block) ? fmt::format("mtp.{}.", block - config.n_layers)
                              : fmt::format("layers.{}.", block);
}

std::optional<TensorSource> official_source(const ModelConfig& config, const TensorSpec& spec) {
  if (config.is_v41())
    if (auto v41 = official_source_v41(config, spec)) return v41;
  TensorSource src;
  if (spec.global_kind) {
    const auto name = global_official_name(*spec.global_kind);
    if (!name) return std::nullopt;
    src.names = {std::string(*name)};
    src.part_shape = reversed(spec.ne);
    return src;
  }
  const uint32_t block = spec.block.value_or(0);
  const std::string prefix = official_block_prefix(config, block);
  using BT = BlockTensor;
  const BT kind = spec.block_kind.value_or(BT::AttnNorm);
  switch (kind) {
    case BT::FfnGateExps:
    case BT::FfnUpExps:
    case BT::FfnDownExps: {
      const char* w = kind == BT::FfnGateExps ? "w1" : kind == BT::FfnUpExps ? "w3" : "w2";
      src.layout = SourceLayout::ExpertStack;
      for (uint64_t e = 0; e < spec.ne.at(2); ++e)
        src.names.push_back(fmt::format("{}ffn.experts.{}.{}.weight", prefix, e, w));
      src.part_shape = {spec.ne.at(1), spec.ne.at(0)};
      return src;
    }
    case BT::NextnEhProj:
      // llama.cpp's eh_proj reads concat(enorm(embedding), hnorm(hidden)): e_proj's
      // columns first, then h_proj's.
      src.layout = SourceLayout::ColumnConcat;
      src.names = {prefix + "e_proj.weight", prefix + "h_proj.weight"};
      src.part_shape = {spec.ne.at(1), spec.ne.at(0) / 2};
      return src;
    case BT::FfnTid2Eid:
      src.layout = SourceLayout::Index;
      src.names = {prefix + "ffn.gate.tid2eid"};
      src.part_shape = reversed(spec.ne);
      return src;
    default: {
      const auto suffix = block_official_suffix(kind);
      if (!suffix) return std::nullopt;
      src.names = {prefix + std::string(*suffix)};
      src.part_shape = reversed(spec.ne);
      return src;
    }
  }
}

}  // namespace dsv4::convert
