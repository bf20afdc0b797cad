// The typed configuration of a DeepSeek-V4-family model (hyperparameters of the GGUF
// `deepseek4` convention; see shared/spec/gguf-deepseek4.md). `deepseek41` (V4.1, with
// Engram) extends it through `variant` and the optional `engram` part, without changing
// the fields the V4 forward pass reads.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "util/status.h"

namespace dsv4 {
namespace gguf { class GgufFile; class GgufWriter; }

enum class ModelVariant { V4, V41 };

// Which file of a layout the metadata is for (model_files.h): one file with trunk and MTP,
// llama.cpp's trunk (block_count = trunk layers, no nextn_predict_layers), or its MTP
// sidecar (block_count = all blocks, nextn_predict_layers = MTP blocks).
enum class GgufPart { Bundled, Trunk, MtpSidecar };

enum class AttentionKind { Window, CSA, HCA };  // ratio 0, ratio 4 (+indexer), other ratio

struct RopeConfig {
  double freq_base = 10000;           // window-only layers and MTP ("main" table)
  double compress_freq_base = 160000; // layers with a compressor ("compress" table, YaRN)
  uint32_t dims = 64;                 // rope part at the end of each head
  double yarn_factor = 16;
  uint32_t yarn_original_context = 65536;
  double yarn_beta_fast = 32;
  double yarn_beta_slow = 1;
};

// V4.1's Engram memory (shared/spec/deepseek-v41.md); absent for V4.
struct EngramConfig {
  std::vector<uint32_t> layers;
  uint64_t table_rows = 0;
  uint32_t dim = 0;
  uint32_t ngram = 0;
  uint32_t heads = 0;
};

struct ModelConfig {
  ModelVariant variant = ModelVariant::V4;
  std::string name;                 // general.name, if any

  uint32_t vocab_size = 0;
  uint32_t hidden = 0;              // D
  uint32_t n_layers = 0;            // trunk blocks (MTP excluded)
  uint32_t n_mtp = 0;               // MTP blocks appended after the trunk
  uint64_t context_length = 0;      // training context (max positions)

  // Attention
  uint32_t n_heads = 0;
  uint32_t head_dim = 0;            // key_length = value_length
  uint32_t q_lora_rank = 0;
  uint32_t o_lora_rank = 0;
  uint32_t o_groups = 0;
  uint32_t sliding_window = 0;
  std::vector<uint32_t> compress_ratios;  // n_layers + n_mtp entries (MTP entries are 0)
  RopeConfig rope;
  float rms_eps = 1e-6f;

  // Lightning indexer (CSA layers)
  uint32_t index_heads = 0;
  uint32_t index_head_dim = 0;
  uint32_t index_topk = 0;

  // MoE
  uint32_t n_experts = 0;
  uint32_t n_experts_used = 0;
  uint32_t n_shared_experts = 0;
  uint32_t expert_ffn = 0;          // moe_intermediate_size
  float routed_scale = 1.5f;
  bool norm_topk = true;
  uint32_t n_hash_layers = 0;
  std::vector<float> swiglu_limit;         // per block (trunk + MTP), routed experts
  std::vector<float> swiglu_limit_shared;  // per block, shared expert

  // Hyper-connections
  uint32_t hc_mult = 4;
  uint32_t hc_sinkhorn_iters = 20;
  float hc_eps = 1e-6f;

  std::optional<EngramConfig> engram;  // V4.1 only

  // Derived
  uint32_t n_blocks() const { return n_layers + n_mtp; }
  uint32_t ratio(uint32_t block) const { return compress_ratios.at(block); }
  AttentionKind attention_kind(uint32_t block) const {
    const uint32_t r = ratio(block);
    return r == 0 ? AttentionKind::Window : (r == 4 ? AttentionKind::CSA : AttentionKind::HCA);
  }
  bool is_hash_layer(uint32_t block) const { return block < n_hash_layers; }
  bool is_mtp(uint32_t block) const { return block >= n_layers; }
  uint32_t rope_dims() const { return rope.dims; }
  uint32_t nope_dims() const { return head_dim - rope.dims; }
  uint32_t hc_dim() const { return (2 + hc_mult) * hc_mult; }   // 24 mix logits per site
  uint32_t compressor_overlap(uint32_t block) const { return ratio(block) == 4 ? 2 : 1; }
  std::string_view architecture() const;  // general.architecture: "deepseek4" / "deepseek41"

  // Checks internal consistency (ratios vs layer count, divisibility the kernels need,
  // ranges); the message names the field and both values.
  Status validate() const;

  // The geometry in one canonical line ("deepseek4 vocab=... hidden=... ratios=..."):
  // what a steering file or KV graft records as the model it was made for.
  std::string identity() const;

  // Reads `<arch>.*` keys of a deepseek4 / deepseek41 file; errors name file and key.
  // `mtp_blocks`: how many of the file's blocks are MTP blocks when the caller has looked
  // at its tensors (model_files.h: llama.cpp counts nextn_predict_layers only when the
  // first MTP block's nextn.eh_proj is present); default: nextn_predict_layers.
  static Result<ModelConfig> from_gguf(const gguf::GgufFile& file,
                                       std::optional<uint32_t> mtp_blocks = std::nullopt);
  // Writes the same keys (used by synth and convert), with the types llama.cpp's converter
  // writes (integer arrays as INT32).
  void write_gguf_metadata(gguf::GgufWriter& writer, GgufPart part = GgufPart::Bundled) const;
};

}  // namespace dsv4
