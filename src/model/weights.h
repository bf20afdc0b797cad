// The weights of a DeepSeek-V4 model as backend tensors, looked up by the catalog's
// names. Matrices keep their GGUF element type (views of the file on the CPU); the small
// vectors (norms, sinks, mixer bases and scales, APE, router bias) become F32 and the
// hash table I32.
#pragma once

#include <vector>

#include "backend/backend.h"
#include "model/config.h"
#include "util/status.h"

namespace dsv4 {
class ModelFiles;
namespace gguf { class GgufFile; struct TensorInfo; }

struct HcSite {  // one mHC site: fn [24, hc*D], base [24], scale [3]
  backend::Tensor fn, base, scale;
};

struct CompressorWeights {  // spec §3.3
  backend::Tensor kv, gate;  // [overlap*w, D]
  backend::Tensor ape;       // F32 [ratio, overlap*w]
  backend::Tensor norm;      // F32 [w]
};

// V4.1 Engram (shared/spec/deepseek-v41.md §3.2). The table stays in the file: `table` is
// its header (rows are read on demand through model/engram_table.h), never a backend tensor.
struct EngramWeights {
  const gguf::TensorInfo* table = nullptr;  // engram_embd: [rows, dim] (I8 FP8 rows or a ggml type)
  backend::Tensor kv;    // engram_kv [(hc+1)*D, cols*dim]: hc keys, then the value
  backend::Tensor q, k;  // engram_q_norm / engram_k_norm, F32 [hc, D]
};

struct BlockWeights {
  // attention (spec §3.1)
  backend::Tensor attn_norm, sinks, q_a, q_a_norm, q_b, kv, kv_norm, out_a, out_b;
  HcSite hc_attn, hc_ffn;
  CompressorWeights compressor;                 // CSA, HCA
  backend::Tensor index_proj, index_q_b;        // CSA: lightning indexer
  CompressorWeights index_compressor;
  // MoE (spec §4)
  backend::Tensor ffn_norm, gate_inp, tid2eid, exp_probs_b;
  backend::Tensor gate_exps, up_exps, down_exps;       // [E, I, D], [E, I, D], [E, D, I]
  backend::Tensor gate_shexp, up_shexp, down_shexp;
  // MTP blocks (spec §5); the head tensors fall back to the trunk's when absent
  backend::Tensor eh_proj, enorm, hnorm, head_norm, embed, head;
  HcSite hc_head;
  // V4.1 only (empty for V4). The compressor of a KV source has kv, norm and (ratio > 1)
  // gate, no APE; index_proj / index_q_b are set on index sources.
  backend::Tensor index_k, index_k_norm;  // KV sources: W_k [idx_hd, hd] and its RMSNorm
  backend::Tensor exp_probs_b_vl;         // image-token routing bias, when in the file
  EngramWeights engram;                   // engram layers
  backend::Tensor dspark_main_proj, dspark_main_norm;  // first DSpark stage
  // (the last DSpark stage's norm is head_norm; V4.1 stages have no hc_head)
};

// V4.1 DSpark heads, after the last stage.
struct DsparkHeadWeights {
  backend::Tensor markov_embd;  // markov_w1 [vocab, rank]
  backend::Tensor markov_head;  // markov_w2 [vocab, rank]
  backend::Tensor conf_proj;    // conf_proj [1, D + rank]
};

struct ModelWeights {
  backend::Tensor token_embd, output_norm, output;
  HcSite hc_head;                    // V4 only (V4.1 collapses with the last FFN pre)
  std::vector<BlockWeights> blocks;  // trunk then MTP (V4.1: DSpark stages)
  DsparkHeadWeights dspark;          // V4.1 with DSpark stages

  // Every tensor of the catalog from `files` (checked against it first), whatever their
  // layout (model_files.h).
  static Result<ModelWeights> load(const ModelFiles& files, backend::Backend& backend);
};

}  // namespace dsv4
