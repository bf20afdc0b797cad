// The typed configuration of a DeepSeek-V4-family model (hyperparameters of the GGUF
// `deepseek4` convention; see shared/spec/gguf-deepseek4.md). `deepseek41` (V4.1:
// shared KV and index sources, candidate blocks, Engram, DSpark; shared/spec/
// deepseek-v41.md) extends it through `variant` and the V4.1 parts below, without
// changing the fields the V4 forward pass reads. For V4.1 blocks attention_kind() is
// not meaningful (ratios 1 and 2 are not V4's HCA): read layer_roles() instead.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
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

// Bounds validate() puts on Engram geometry read from a file (the release: 4 and 8).
inline constexpr uint32_t kMaxEngramNgram = 8;
inline constexpr uint32_t kMaxEngramHeads = 64;

// V4.1's Engram memory (shared/spec/deepseek-v41.md §3.2); absent for V4. The hash
// constants and the compressed token map are data, not config: model/engram.h.
struct EngramConfig {
  std::vector<uint32_t> layers;      // engram_layer_ids, ascending (trunk layers)
  std::vector<uint64_t> table_rows;  // engram_num_embeddings, per layer of `layers`
  uint32_t dim = 0;                  // engram_head_dim: values per table row
  uint32_t ngram = 0;                // engram_max_ngram_size: n-grams of 2..ngram tokens
  uint32_t heads = 0;                // engram_n_heads: hash heads per n-gram size
  uint64_t hash_vocab_size = 0;      // engram_vocab_size: the bucket primes start above it - 1
  uint32_t compressed_vocab_size = 0;  // engram_compressed_vocab_size
  uint32_t pad_token_id = 0;         // engram_pad_token_id; its compressed id pads n-grams

  uint32_t columns() const { return (ngram - 1) * heads; }  // rows gathered per token and layer
  uint64_t kv_inputs() const { return uint64_t{columns()} * dim; }  // wkv input width
  // Position of `layer` in `layers`, or -1.
  int index_of(uint32_t layer) const;
};

// V4.1's two-level top-k (§3.4): the candidate source keeps the best `topk_blocks` blocks
// of `block_size` compressed entries; index sources after it score only inside them.
struct CandidateConfig {
  uint32_t source_layer = 0;
  uint32_t block_size = 0;
  uint32_t topk_blocks = 0;
};

// V4.1's DSpark draft stages (§3.7): the MTP blocks, window-only, with their own expert
// count; stage 0 projects the mean streams of `target_layers`; the last stage has the
// Markov and confidence heads.
struct DsparkConfig {
  uint32_t block_size = 0;      // dspark_block_size: tokens drafted per call
  uint32_t markov_rank = 0;     // dspark_markov_rank
  uint32_t n_experts = 0;       // dspark_n_routed_experts
  uint32_t n_experts_used = 0;  // dspark_num_experts_per_tok
  uint32_t noise_token_id = 0;  // dspark_noise_token_id: fills the draft block
  std::vector<uint32_t> target_layers;  // dspark_target_layer_ids
};

// V4.1's vision tower (vision_config). dsv4 refuses image input; the converter keeps or
// drops the tower by recipe, so `in_file` says whether its tensors are in the GGUF.
struct VisionConfig {
  uint32_t image_token_id = 0;
  uint32_t n_layers = 0;
  uint32_t hidden = 0;
  uint32_t ffn = 0;             // intermediate_size
  uint32_t n_heads = 0;
  uint32_t patch_size = 0;
  uint32_t downsample = 0;      // downsample_ratio (spatial folding)
  uint32_t max_image_tokens = 0;
  uint32_t min_pixels = 0;
  double rope_theta = 10000;
  bool in_file = false;         // the tower's tensors (and exp_probs_b_vl) are in the GGUF
};

// One V4.1 block's attention roles (§3.3-3.4), derived from the source lists. A block of
// ratio 0 (window only, DSpark stages included) has none.
struct LayerRoles {
  bool kv_source = false;          // owns the compressor, the compressed cache and index keys
  bool index_source = false;       // runs indexer queries/weights, publishes a selection
  bool candidate_source = false;   // also publishes the candidate blocks
  bool uses_candidates = false;    // index source after the candidate source: masked scores
  int32_t kv_source_layer = -1;    // whose compressed cache (and index keys) it reads
  int32_t index_source_layer = -1; // whose selection it uses (itself when an index source)
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

  // V4.1 (deepseek41) only; empty / nullopt for V4.
  std::vector<uint32_t> kv_source_layers;     // ascending
  std::vector<uint32_t> index_source_layers;  // ascending, a superset of kv_source_layers
  std::optional<CandidateConfig> candidate;
  std::optional<EngramConfig> engram;
  std::optional<DsparkConfig> dspark;         // the MTP blocks are DSpark stages
  std::optional<VisionConfig> vision;

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

  // V4.1 per-block facts (valid for any block; all false / -1 for V4 configs).
  bool is_v41() const { return variant == ModelVariant::V41; }
  LayerRoles layer_roles(uint32_t block) const;
  bool is_engram_layer(uint32_t block) const { return engram && engram->index_of(block) >= 0; }
  // Routed experts of a block: DSpark stages have their own count and top-k.
  uint32_t experts_of(uint32_t block) const;
  uint32_t experts_used_of(uint32_t block) const;

  // Checks internal consistency (ratios vs layer count, divisibility the kernels need,
  // ranges; for V4.1 the source-layer rules of §3.3-3.4); the message names the field
  // and both values.
  Status validate() const;

  // The geometry in one canonical line ("deepseek4 vocab=... hidden=... ratios=..."):
  // what a steering file or KV graft records as the model it was made for.
  std::string identity() const;

  // Reads `<arch>.*` keys of a deepseek4 / deepseek41 file (V4.1 key spellings: see
  // docs/MODEL-FILES.md; source layers and candidate settings fall back to tensor presence
  // and the release's values); errors name file and key.
  // `mtp_blocks`: how many of the file's blocks are MTP blocks when the caller has looked
  // at its tensors (model_files.h: llama.cpp counts nextn_predict_layers only when the
  // first MTP block's nextn.eh_proj is present); default: nextn_predict_layers.
  static Result<ModelConfig> from_gguf(const gguf::GgufFile& file,
                                       std::optional<uint32_t> mtp_blocks = std::nullopt);
  // Writes the same keys (used by synth and convert), with the types llama.cpp's converter
  // writes (integer arrays as INT32). V4.1 writes every spelling that published converters read.
  void write_gguf_metadata(gguf::GgufWriter& writer, GgufPart part = GgufPart::Bundled) const;
};

// V4.1: dsv4 does not take image input yet. An error naming the first position that holds
// the model's image token (vision.image_token_id); ok for text-only prompts and V4 models.
Status refuse_image_tokens(const ModelConfig& config, std::span<const int32_t> tokens);

}  // namespace dsv4
