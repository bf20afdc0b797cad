#include "model/weights.h"

#include <fmt/format.h>

#include <vector>

#include "gguf/gguf_file.h"
#include "gguf/quant.h"
#include "model/model_files.h"
#include "model/tensor_catalog.h"

namespace dsv4 {
namespace {

using backend::Tensor;

class Loader {
 public:
  Loader(const ModelFiles& files, backend::Backend& be) : files_(files), be_(be) {}

  // A matrix in its stored type (absent optional tensors give an empty Tensor).
  Result<Tensor> matrix(const std::string& name, bool required = true) {
    const gguf::TensorInfo* info = files_.find_tensor(name);
    if (!info) return missing(name, required);
    return be_.weight(*info);
  }
  Result<Tensor> matrix(uint32_t block, BlockTensor t, bool required = true) {
    return matrix(block_tensor_name(block, t), required);
  }

  // A small vector or table decoded to F32 with the stored shape.
  Result<Tensor> vector(const std::string& name, bool required = true) {
    const gguf::TensorInfo* info = files_.find_tensor(name);
    if (!info) return missing(name, required);
    std::vector<float> host(info->n_elements());
    dequantize_row(info->type, info->data, host.data(), static_cast<int64_t>(host.size()));
    std::vector<int64_t> shape(info->ne.rbegin(), info->ne.rend());
    DSV4_ASSIGN_OR_RETURN(Tensor t, be_.alloc(GgmlType::F32, shape));
    DSV4_TRY(be_.upload(t, host.data(), host.size() * sizeof(float)));
    return t;
  }
  Result<Tensor> vector(uint32_t block, BlockTensor t, bool required = true) {
    return vector(block_tensor_name(block, t), required);
  }

  // The hash-routing table as I32 [vocab, k].
  Result<Tensor> index_table(const std::string& name) {
    const gguf::TensorInfo* info = files_.find_tensor(name);
    if (!info) return missing(name, true);
    if (info->type != GgmlType::I32)
      return Status::errorf("{}: tensor {}: type {}, expected i32", files_.file_of(*info).path(), name,
                            ggml_type_name(info->type));
    std::vector<int64_t> shape(info->ne.rbegin(), info->ne.rend());
    DSV4_ASSIGN_OR_RETURN(Tensor t, be_.alloc(GgmlType::I32, shape));
    DSV4_TRY(be_.upload(t, info->data, info->nbytes));
    return t;
  }

  // The first of `names` the file has (published V4.1 files spell some tensors two ways).
  Result<Tensor> matrix_any(std::initializer_list<std::string> names) {
    for (const auto& n : names)
      if (files_.find_tensor(n)) return matrix(n);
    return missing(*names.begin(), true);
  }
  Result<Tensor> vector_any(std::initializer_list<std::string> names) {
    for (const auto& n : names)
      if (files_.find_tensor(n)) return vector(n);
    return missing(*names.begin(), true);
  }
  const ModelFiles& files() const { return files_; }

  Result<HcSite> hc_site(uint32_t block, BlockTensor fn, BlockTensor base, BlockTensor scale,
                         bool required = true) {
    HcSite s;
    DSV4_ASSIGN_OR_RETURN(s.fn, matrix(block, fn, required));
    DSV4_ASSIGN_OR_RETURN(s.base, vector(block, base, required));
    DSV4_ASSIGN_OR_RETURN(s.scale, vector(block, scale, required));
    return s;
  }

 private:
  Result<Tensor> missing(const std::string& name, bool required) {
    if (required) return Status::errorf("{}: tensor {} is missing", files_.label(), name);
    return Tensor{};
  }
  const ModelFiles& files_;
  backend::Backend& be_;
};

Result<BlockWeights> load_block(Loader& l, const ModelConfig& c, uint32_t b) {
  using T = BlockTensor;
  BlockWeights w;
  DSV4_ASSIGN_OR_RETURN(w.attn_norm, l.vector(b, T::AttnNorm));
  DSV4_ASSIGN_OR_RETURN(w.sinks, l.vector(b, T::AttnSinks));
  DSV4_ASSIGN_OR_RETURN(w.q_a, l.matrix(b, T::AttnQA));
  DSV4_ASSIGN_OR_RETURN(w.q_a_norm, l.vector(b, T::AttnQANorm));
  DSV4_ASSIGN_OR_RETURN(w.q_b, l.matrix(b, T::AttnQB));
  DSV4_ASSIGN_OR_RETURN(w.kv, l.matrix(b, T::AttnKv));
  DSV4_ASSIGN_OR_RETURN(w.kv_norm, l.vector(b, T::AttnKvNorm));
  DSV4_ASSIGN_OR_RETURN(w.out_a, l.matrix(b, T::AttnOutputA));
  DSV4_ASSIGN_OR_RETURN(w.out_b, l.matrix(b, T::AttnOutputB));
  DSV4_ASSIGN_OR_RETURN(w.hc_attn, l.hc_site(b, T::HcAttnFn, T::HcAttnBase, T::HcAttnScale));
  DSV4_ASSIGN_OR_RETURN(w.hc_ffn, l.hc_site(b, T::HcFfnFn, T::HcFfnBase, T::HcFfnScale));
  if (c.ratio(b) != 0) {
    DSV4_ASSIGN_OR_RETURN(w.compressor.kv, l.matrix(b, T::CompressorKv));
    DSV4_ASSIGN_OR_RETURN(w.compressor.gate, l.matrix(b, T::CompressorGate));
    DSV4_ASSIGN_OR_RETURN(w.compressor.ape, l.vector(b, T::CompressorApe));
    DSV4_ASSIGN_OR_RETURN(w.compressor.norm, l.vector(b, T::CompressorNorm));
  }
  if (c.attention_kind(b) == AttentionKind::CSA) {
    DSV4_ASSIGN_OR_RETURN(w.index_proj, l.matrix(b, T::IndexerProj));
    DSV4_ASSIGN_OR_RETURN(w.index_q_b, l.matrix(b, T::IndexerQB));
    DSV4_ASSIGN_OR_RETURN(w.index_compressor.kv, l.matrix(b, T::IndexerCompressorKv));
    DSV4_ASSIGN_OR_RETURN(w.index_compressor.gate, l.matrix(b, T::IndexerCompressorGate));
    DSV4_ASSIGN_OR_RETURN(w.index_compressor.ape, l.vector(b, T::IndexerCompressorApe));
    DSV4_ASSIGN_OR_RETURN(w.index_compressor.norm, l.vector(b, T::IndexerCompressorNorm));
  }
  DSV4_ASSIGN_OR_RETURN(w.ffn_norm, l.vector(b, T::FfnNorm));
  DSV4_ASSIGN_OR_RETURN(w.gate_inp, l.matrix(b, T::FfnGateInp));
  if (c.is_hash_layer(b)) {
    DSV4_ASSIGN_OR_RETURN(w.tid2eid, l.index_table(block_tensor_name(b, T::FfnTid2Eid)));
  } else {
    DSV4_ASSIGN_OR_RETURN(w.exp_probs_b, l.vector(b, T::FfnExpProbsB));
  }
  DSV4_ASSIGN_OR_RETURN(w.gate_exps, l.matrix(b, T::FfnGateExps));
  DSV4_ASSIGN_OR_RETURN(w.up_exps, l.matrix(b, T::FfnUpExps));
  DSV4_ASSIGN_OR_RETURN(w.down_exps, l.matrix(b, T::FfnDownExps));
  DSV4_ASSIGN_OR_RETURN(w.gate_shexp, l.matrix(b, T::FfnGateShexp));
  DSV4_ASSIGN_OR_RETURN(w.up_shexp, l.matrix(b, T::FfnUpShexp));
  DSV4_ASSIGN_OR_RETURN(w.down_shexp, l.matrix(b, T::FfnDownShexp));
  if (c.is_mtp(b)) {
    DSV4_ASSIGN_OR_RETURN(w.eh_proj, l.matrix(b, T::NextnEhProj));
    DSV4_ASSIGN_OR_RETURN(w.enorm, l.vector(b, T::NextnEnorm));
    DSV4_ASSIGN_OR_RETURN(w.hnorm, l.vector(b, T::NextnHnorm));
    DSV4_ASSIGN_OR_RETURN(w.head_norm, l.vector(b, T::NextnSharedHeadNorm, false));
    DSV4_ASSIGN_OR_RETURN(w.embed, l.matrix(b, T::NextnEmbedTokens, false));
    DSV4_ASSIGN_OR_RETURN(w.head, l.matrix(b, T::NextnSharedHeadHead, false));
    DSV4_ASSIGN_OR_RETURN(w.hc_head, l.hc_site(b, T::NextnHcHeadFn, T::NextnHcHeadBase,
                                               T::NextnHcHeadScale, false));
  }
  return w;
}

// ---- V4.1 (deepseek41) ----
Result<BlockWeights> load_block_v41(Loader& l, const ModelConfig& c, uint32_t b) {
  using T = BlockTensor;
  BlockWeights w;
  DSV4_ASSIGN_OR_RETURN(w.attn_norm, l.vector(b, T::AttnNorm));
  DSV4_ASSIGN_OR_RETURN(w.sinks, l.vector(b, T::AttnSinks));
  DSV4_ASSIGN_OR_RETURN(w.q_a, l.matrix(b, T::AttnQA));
  DSV4_ASSIGN_OR_RETURN(w.q_a_norm, l.vector(b, T::AttnQANorm));
  DSV4_ASSIGN_OR_RETURN(w.q_b, l.matrix(b, T::AttnQB));
  DSV4_ASSIGN_OR_RETURN(w.kv, l.matrix(b, T::AttnKv));
  DSV4_ASSIGN_OR_RETURN(w.kv_norm, l.vector(b, T::AttnKvNorm));
  DSV4_ASSIGN_OR_RETURN(w.out_a, l.matrix(b, T::AttnOutputA));
  DSV4_ASSIGN_OR_RETURN(w.out_b, l.matrix(b, T::AttnOutputB));
  DSV4_ASSIGN_OR_RETURN(w.hc_attn, l.hc_site(b, T::HcAttnFn, T::HcAttnBase, T::HcAttnScale));
  DSV4_ASSIGN_OR_RETURN(w.hc_ffn, l.hc_site(b, T::HcFfnFn, T::HcFfnBase, T::HcFfnScale));
  const LayerRoles roles = c.layer_roles(b);
  if (roles.kv_source) {
    DSV4_ASSIGN_OR_RETURN(w.compressor.kv, l.matrix(b, T::CompressorKv));
    if (c.ratio(b) > 1) {
      DSV4_ASSIGN_OR_RETURN(w.compressor.gate, l.matrix(b, T::CompressorGate));
    }
    DSV4_ASSIGN_OR_RETURN(w.compressor.norm, l.vector(b, T::CompressorNorm));
    DSV4_ASSIGN_OR_RETURN(w.index_k, l.matrix(b, T::IndexerK));
    DSV4_ASSIGN_OR_RETURN(w.index_k_norm, l.vector(b, T::IndexerKNorm));
  }
  if (roles.index_source) {
    DSV4_ASSIGN_OR_RETURN(w.index_proj, l.matrix(b, T::IndexerProj));
    DSV4_ASSIGN_OR_RETURN(w.index_q_b, l.matrix(b, T::IndexerQB));
  }
  if (c.is_engram_layer(b)) {
    auto alias = [b](const char* suffix) { return fmt::format("blk.{}.{}", b, suffix); };
    w.engram.table = l.files().find_tensor(block_tensor_name(b, T::EngramEmbd));
    if (!w.engram.table)
      return Status::errorf("{}: tensor {} is missing", l.files().label(), block_tensor_name(b, T::EngramEmbd));
    DSV4_ASSIGN_OR_RETURN(w.engram.kv, l.matrix_any({block_tensor_name(b, T::EngramKv), alias("engram_wkv.weight")}));
    DSV4_ASSIGN_OR_RETURN(w.engram.q, l.vector_any({block_tensor_name(b, T::EngramQ), alias("engram_q.weight")}));
    DSV4_ASSIGN_OR_RETURN(w.engram.k, l.vector_any({block_tensor_name(b, T::EngramK), alias("engram_k.weight")}));
  }
  DSV4_ASSIGN_OR_RETURN(w.ffn_norm, l.vector(b, T::FfnNorm));
  DSV4_ASSIGN_OR_RETURN(w.gate_inp, l.matrix(b, T::FfnGateInp));
  DSV4_ASSIGN_OR_RETURN(w.exp_probs_b, l.vector(b, T::FfnExpProbsB));
  DSV4_ASSIGN_OR_RETURN(w.exp_probs_b_vl, l.vector(b, T::FfnExpProbsBVl, false));
  DSV4_ASSIGN_OR_RETURN(w.gate_exps, l.matrix(b, T::FfnGateExps));
  DSV4_ASSIGN_OR_RETURN(w.up_exps, l.matrix(b, T::FfnUpExps));
  DSV4_ASSIGN_OR_RETURN(w.down_exps, l.matrix(b, T::FfnDownExps));
  DSV4_ASSIGN_OR_RETURN(w.gate_shexp, l.matrix(b, T::FfnGateShexp));
  DSV4_ASSIGN_OR_RETURN(w.up_shexp, l.matrix(b, T::FfnUpShexp));
  DSV4_ASSIGN_OR_RETURN(w.down_shexp, l.matrix(b, T::FfnDownShexp));
  if (c.is_mtp(b) && c.dspark) {
    if (b == c.n_layers) {
      DSV4_ASSIGN_OR_RETURN(w.dspark_main_proj, l.matrix(b, T::DsparkMainProj));
      DSV4_ASSIGN_OR_RETURN(w.dspark_main_norm, l.vector(b, T::DsparkMainNorm));
    }
    if (b + 1 == c.n_blocks()) {
      DSV4_ASSIGN_OR_RETURN(w.head_norm, l.vector(b, T::NextnSharedHeadNorm));
    }
  }
  return w;
}

Result<ModelWeights> load_v41(Loader& l, const ModelConfig& config) {
  ModelWeights w;
  DSV4_ASSIGN_OR_RETURN(w.token_embd, l.matrix(std::string(global_tensor_name(GlobalTensor::TokenEmbd))));
  DSV4_ASSIGN_OR_RETURN(w.output_norm, l.vector(std::string(global_tensor_name(GlobalTensor::OutputNorm))));
  DSV4_ASSIGN_OR_RETURN(w.output, l.matrix(std::string(global_tensor_name(GlobalTensor::Output))));
  if (config.dspark && config.n_mtp > 0) {
    DSV4_ASSIGN_OR_RETURN(w.dspark.markov_embd,
                          l.matrix(std::string(global_tensor_name(GlobalTensor::DsparkMarkovEmbd))));
    DSV4_ASSIGN_OR_RETURN(w.dspark.markov_head,
                          l.matrix(std::string(global_tensor_name(GlobalTensor::DsparkMarkovHead))));
    DSV4_ASSIGN_OR_RETURN(w.dspark.conf_proj, l.matrix(std::string(global_tensor_name(GlobalTensor::DsparkConfProj))));
  }
  for (uint32_t b = 0; b < config.n_blocks(); ++b) {
    DSV4_ASSIGN_OR_RETURN(BlockWeights bw, load_block_v41(l, config, b));
    w.blocks.push_back(std::move(bw));
  }
  return w;
}

}  // namespace

Result<ModelWeights> ModelWeights::load(const ModelFiles& files, backend::Backend& backend) {
  DSV4_TRY(files.check());
  const ModelConfig& config = files.config();
  Loader l(files, backend);
  if (config.is_v41()) return load_v41(l, config);
  ModelWeights w;
  DSV4_ASSIGN_OR_RETURN(w.token_embd, l.matrix(std::string(global_tensor_name(GlobalTensor::TokenEmbd))));
  DSV4_ASSIGN_OR_RETURN(w.output_norm, l.vector(std::string(global_tensor_name(GlobalTensor::OutputNorm))));
  DSV4_ASSIGN_OR_RETURN(w.output, l.matrix(std::string(global_tensor_name(GlobalTensor::Output))));
  DSV4_ASSIGN_OR_RETURN(w.hc_head.fn, l.matrix(std::string(global_tensor_name(GlobalTensor::OutputHcFn))));
  DSV4_ASSIGN_OR_RETURN(w.hc_head.base, l.vector(std::string(global_tensor_name(GlobalTensor::OutputHcBase))));
  DSV4_ASSIGN_OR_RETURN(w.hc_head.scale, l.vector(std::string(global_tensor_name(GlobalTensor::OutputHcScale))));
  for (uint32_t b = 0; b < config.n_blocks(); ++b) {
    DSV4_ASSIGN_OR_RETURN(BlockWeights bw, load_block(l, config, b));
    if (config.is_mtp(b)) {  // the MTP head shares the trunk's tensors unless it has its own
      if (!bw.head_norm.valid()) bw.head_norm = w.output_norm;
      if (!bw.embed.valid()) bw.embed = w.token_embd;
      if (!bw.head.valid()) bw.head = w.output;
      if (!bw.hc_head.fn.valid()) bw.hc_head = w.hc_head;
    }
    w.blocks.push_back(std::move(bw));
  }
  return w;
}

}  // namespace dsv4
