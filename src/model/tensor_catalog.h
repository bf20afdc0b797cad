// The GGUF tensors of a DeepSeek-V4 model: names, shapes and allowed element types.
//
// This is the single source of truth for tensor names (llama.cpp's `deepseek4`
// convention, MTP block included, and the `deepseek41` convention of published V4.1
// files; docs/MODEL-FILES.md maps them to the official checkpoint names). The converter writes these names, the loader checks a file against
// build_tensor_catalog(config) before allocating anything, and the forward pass looks
// weights up with block_tensor_name() / global_tensor_name().
//
// Shapes are in ggml order: ne[0] is the row length (the input width of a matrix),
// ne[1] the number of rows (its output width), ne[2] the expert index of a 3-D stack.
// Messages print them outer-first, e.g. "[512, 4096]" for ne = {4096, 512}.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gguf/ggml_types.h"
#include "model/config.h"
#include "util/status.h"

namespace dsv4 {
namespace gguf { struct TensorInfo; }

// Tensors outside the blocks.
enum class GlobalTensor {
  TokenEmbd,      // token_embd.weight      {D, vocab}
  OutputNorm,     // output_norm.weight     {D}
  Output,         // output.weight          {D, vocab}
  OutputHcFn,     // output_hc_fn.weight    {hc*D, hc}   hyper head (spec §2.6)
  OutputHcBase,   // output_hc_base.weight  {hc}
  OutputHcScale,  // output_hc_scale.weight {1}
  // V4.1 DSpark heads (llama.cpp's DSpark names; official mtp.<last>.markov_head.*,
  // mtp.<last>.confidence_head.proj)
  DsparkMarkovEmbd,  // markov_w1.weight  {rank, vocab}
  DsparkMarkovHead,  // markov_w2.weight  {rank, vocab}
  DsparkConfProj,    // conf_proj.weight  {D + rank, 1}
  // V4.1 vision tower, kept by recipe: every tensor under "vision." (official names, see
  // docs/MODEL-FILES.md); one kind for all of them.
  Vision,
};

// Tensors of block N ("blk.N."), trunk and MTP alike; which ones a block holds depends
// on its compress ratio, on hash routing, and on whether it is an MTP block.
enum class BlockTensor {
  // Attention, every block (spec §3.1)
  AttnNorm,      // attn_norm.weight        {D}
  AttnSinks,     // attn_sinks.weight       {H}
  AttnQA,        // attn_q_a.weight         {D, q_rank}
  AttnQANorm,    // attn_q_a_norm.weight    {q_rank}
  AttnQB,        // attn_q_b.weight         {q_rank, H*hd}
  AttnKv,        // attn_kv.weight          {D, hd}
  AttnKvNorm,    // attn_kv_a_norm.weight   {hd}
  AttnOutputA,   // attn_output_a.weight    {H*hd/groups, groups*o_rank}
  AttnOutputB,   // attn_output_b.weight    {groups*o_rank, D}
  // Hyper-connection sites (spec §2.3)
  HcAttnFn,      // hc_attn_fn.weight       {hc*D, (2+hc)*hc}
  HcAttnBase,    // hc_attn_base.weight     {(2+hc)*hc}
  HcAttnScale,   // hc_attn_scale.weight    {3}
  HcFfnFn,       // hc_ffn_fn.weight
  HcFfnBase,     // hc_ffn_base.weight
  HcFfnScale,    // hc_ffn_scale.weight
  // Main compressor, ratio != 0 (spec §3.3); overlap o = 2 at ratio 4, else 1
  CompressorKv,    // attn_compressor_kv.weight   {D, o*hd}
  CompressorGate,  // attn_compressor_gate.weight {D, o*hd}
  CompressorApe,   // attn_compressor_ape.weight  {o*hd, ratio}
  CompressorNorm,  // attn_compressor_norm.weight {hd}
  // Lightning indexer, ratio 4 only (spec §3.6)
  IndexerProj,             // indexer.proj.weight             {D, idx_heads}
  IndexerQB,               // indexer.attn_q_b.weight         {q_rank, idx_heads*idx_hd}
  IndexerCompressorKv,     // indexer_compressor_kv.weight    {D, 2*idx_hd}
  IndexerCompressorGate,   // indexer_compressor_gate.weight  {D, 2*idx_hd}
  IndexerCompressorApe,    // indexer_compressor_ape.weight   {2*idx_hd, 4}
  IndexerCompressorNorm,   // indexer_compressor_norm.weight  {idx_hd}
  // MoE (spec §4)
  FfnGateInp,    // ffn_gate_inp.weight     {D, E}
  FfnTid2Eid,    // ffn_gate_tid2eid.weight {k, vocab} I32, hash layers only
  FfnExpProbsB,  // exp_probs_b.bias        {E}, non-hash blocks
  FfnNorm,       // ffn_norm.weight         {D}
  FfnGateExps,   // ffn_gate_exps.weight    {D, I, E}  3-D expert stack
  FfnUpExps,     // ffn_up_exps.weight      {D, I, E}  3-D expert stack
  FfnDownExps,   // ffn_down_exps.weight    {I, D, E}  3-D expert stack
  FfnGateShexp,  // ffn_gate_shexp.weight   {D, I*n_shared}
  FfnUpShexp,    // ffn_up_shexp.weight     {D, I*n_shared}
  FfnDownShexp,  // ffn_down_shexp.weight   {I*n_shared, D}
  // MTP blocks only (spec §5; llama.cpp's NextN names)
  NextnEhProj,          // nextn.eh_proj.weight    {2*D, D}: input = concat(enorm(e), hnorm(h))
  NextnEnorm,           // nextn.enorm.weight      {D}
  NextnHnorm,           // nextn.hnorm.weight      {D}
  NextnSharedHeadNorm,  // nextn.shared_head_norm.weight {D}   optional: falls back to output_norm
  NextnHcHeadFn,        // nextn.hc_head_fn.weight {hc*D, hc}  optional: falls back to output_hc_*
  NextnHcHeadBase,      // nextn.hc_head_base.weight {hc}
  NextnHcHeadScale,     // nextn.hc_head_scale.weight {1}
  NextnEmbedTokens,     // nextn.embed_tokens.weight {D, vocab}     optional: token_embd
  NextnSharedHeadHead,  // nextn.shared_head_head.weight {D, vocab}  optional: output
  // V4.1 (shared/spec/deepseek-v41.md §4.2)
  IndexerK,        // indexer.attn_k.weight   {hd, idx_hd}  KV sources: keys from the latent
  IndexerKNorm,    // indexer.k_norm.weight   {idx_hd}      KV sources
  FfnExpProbsBVl,  // exp_probs_b_vl.bias     {E}           routing bias of image tokens
  EngramEmbd,      // engram_embd.weight      {dim, rows}   the n-gram table (I8: {dim*33/32, rows})
  EngramKv,        // engram_kv.weight        {cols*dim, (hc+1)*D}   alias engram_wkv
  EngramQ,         // engram_q_norm.weight    {D, hc}       alias engram_q
  EngramK,         // engram_k_norm.weight    {D, hc}       alias engram_k
  DsparkMainProj,  // dspark_main_proj.weight {targets*D, D}  first DSpark stage
  DsparkMainNorm,  // dspark_main_norm.weight {D}            first DSpark stage
};

std::string_view global_tensor_name(GlobalTensor t);          // "token_embd.weight"
std::string_view block_tensor_suffix(BlockTensor t);          // "attn_kv.weight"
std::string block_tensor_name(uint32_t block, BlockTensor t); // "blk.3.attn_kv.weight"

// Which element types a tensor may have.
enum class TypeClass {
  Matrix,  // any type dsv4 decodes (F32/F16/BF16, Q8_0, Q2_K..Q6_K, IQ2_XXS, MXFP4)
  Vector,  // small float data: F32, F16 or BF16 (norms, biases, sinks, hc base/scale, APE)
  Index,   // I32 (tid2eid)
  EngramTable,  // a Matrix type, or I8 rows of FP8 codes + E8M0 scales (model/engram_table.h)
};
bool type_allowed(TypeClass cls, GgmlType type);
std::string_view type_class_name(TypeClass cls);  // for messages: "matrix", ...

// What a tensor is for (`dsv4 info` sums bytes by role).
enum class TensorRole {
  RoutedExperts,  // ffn_{gate,up,down}_exps
  Attention,      // attn_*, compressors, indexer
  DenseFfn,       // shared expert, router, MTP eh_proj
  EmbeddingHead,  // token_embd, output (and MTP copies)
  Small,          // norms, hyper-connection mixers, sinks, APE, biases, tid2eid
  EngramTables,   // V4.1 engram_embd (streamed from the file, never resident)
  VisionTower,    // V4.1 vision tower
};
std::string_view tensor_role_name(TensorRole role);  // "experts", "attention", ...

struct TensorSpec {
  std::string name;
  std::vector<uint64_t> ne;  // ggml order
  TypeClass type_class = TypeClass::Matrix;
  TensorRole role = TensorRole::Small;
  bool required = true;
  std::optional<uint32_t> block;           // nullopt for global tensors
  std::optional<GlobalTensor> global_kind;  // exactly one of global_kind / block_kind
  std::optional<BlockTensor> block_kind;
  std::vector<std::string> aliases;        // other names published files use for it

  uint64_t n_elements() const;
  bool has_name(std::string_view n) const;  // the name or an alias
};

struct TensorCatalog {
  std::vector<TensorSpec> tensors;  // globals first, then block by block (writing order)

  const TensorSpec* find(std::string_view name) const;
  size_t n_required() const;
};

// Every tensor a file of this config holds or may hold. `config` must be valid.
TensorCatalog build_tensor_catalog(const ModelConfig& config);

// Checks a file's tensor list against the catalog: every required tensor present, no
// unexpected name, every shape and type as expected. All problems are reported at once,
// one per line, each "<file_label>: tensor <name>: ..." (outer-first shapes).
Status check_tensors(const TensorCatalog& catalog, std::span<const gguf::TensorInfo> tensors,
                     std::string_view file_label);

// The shape a tensor has in the file when stored as `type`: `spec.ne`, except an Engram
// table in I8 rows, whose row holds dim FP8 codes and dim/32 scales.
std::vector<uint64_t> stored_shape(const TensorSpec& spec, GgmlType type);
// Bytes of the tensor stored as `type` (nullopt when its rows do not fit the type's blocks).
std::optional<uint64_t> stored_bytes(const TensorSpec& spec, GgmlType type);

// "[512, 4096]" for ne = {4096, 512} (outer-first, as errors print shapes).
std::string shape_outer_first(std::span<const uint64_t> ne);

}  // namespace dsv4
