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

struct HcSite {  // one mHC site: fn [24, hc*D], base [24], scale [3]
  backend::Tensor fn, base, scale;
};

struct CompressorWeights {  // spec §3.3
  backend::Tensor kv, gate;  // [overlap*w, D]
  backend::Tensor ape;       // F32 [ratio, overlap*w]
  backend::Tensor norm;      // F32 [w]
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
};

struct ModelWeights {
  backend::Tensor token_embd, output_norm, output;
  HcSite hc_head;
  std::vector<BlockWeights> blocks;  // trunk then MTP

  // Every tensor of the catalog from `files` (checked against it first), whatever their
  // layout (model_files.h).
  static Result<ModelWeights> load(const ModelFiles& files, backend::Backend& backend);
};

}  // namespace dsv4
