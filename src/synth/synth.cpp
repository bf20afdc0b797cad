#include "synth/synth.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>
#include <span>

#include "gguf/gguf_value.h"
#include "gguf/gguf_writer.h"
#include "gguf/quant.h"
#include "model/engram.h"
#include "model/engram_table.h"
#include "synth/random_blocks.h"
#include "text/builtin_tokenizer.h"
#include "text/engram_vocab.h"
#include "text/tokenizer_json.h"
#include "util/float_formats.h"
#include "util/counter_rng.h"
#include "util/thread_pool.h"

namespace dsv4 {
namespace {

// ---- Counter-based random numbers (same values on every platform and thread count) ----

class RowRng {
 public:
  explicit RowRng(uint64_t key) : state_(key) {}
  uint64_t next() { return splitmix64(state_++); }
  double uniform() { return unit_double(next()); }  // [0, 1)
  float normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = 1.0 - uniform();  // (0, 1]
    const double u2 = uniform();
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = static_cast<float>(r * std::sin(2 * std::numbers::pi * u2));
    has_spare_ = true;
    return static_cast<float>(r * std::cos(2 * std::numbers::pi * u2));
  }

 private:
  uint64_t state_;
  float spare_ = 0;
  bool has_spare_ = false;
};

// A uniform draw in [lo, hi) fixed by a key (for per-block scale factors).
double keyed_uniform(uint64_t key, double lo, double hi) {
  return lo + (hi - lo) * unit_double(splitmix64(key));
}

// ---- The fixture's recipe ----

struct RowContext {
  const ModelConfig& c;
  const TensorSpec& spec;
  uint64_t tensor_key;
  SynthRouting routing = SynthRouting::Random;
};

// The routed experts a block's tokens use (its top-k).
uint32_t routed_per_token(const RowContext& ctx) {
  return ctx.spec.block ? ctx.c.experts_used_of(*ctx.spec.block) : ctx.c.n_experts_used;
}

// SynthRouting::Shared: experts 0..k-1 get kSharedRoutingBias, the others none.
void fill_shared_routing_bias(const RowContext& ctx, float* out) {
  const uint64_t n = ctx.spec.ne[0], k = routed_per_token(ctx);
  for (uint64_t i = 0; i < n; ++i) out[i] = i < k ? kSharedRoutingBias : 0.0f;
}

void fill_normal(RowRng& rng, float* out, uint64_t n, float mean, float stddev) {
  for (uint64_t i = 0; i < n; ++i) out[i] = mean + stddev * rng.normal();
}

// N(0,1)/sqrt(fan_in) times 2^U(-1,1) per 128x128 block, as the fixture's FP8 linears.
void fill_dense_linear(const RowContext& ctx, uint64_t row, float* out, double fan_in) {
  const uint64_t n = ctx.spec.ne[0];
  RowRng rng(mix_keys(ctx.tensor_key, row));
  const float base = static_cast<float>(1.0 / std::sqrt(fan_in));
  for (uint64_t col0 = 0; col0 < n; col0 += 128) {
    const uint64_t block_key = mix_keys(mix_keys(ctx.tensor_key ^ 0xb10c, row / 128), col0 / 128);
    const float scale = base * static_cast<float>(std::exp2(keyed_uniform(block_key, -1, 1)));
    for (uint64_t col = col0; col < std::min(n, col0 + 128); ++col) out[col] = scale * rng.normal();
  }
}

// Routed experts: N/sqrt(in) times 2^U(-0.5,0.5) per (row, 32 columns). Experts 3 and 7 of
// every 8 get gains 3.5 and 5 (gate/up x gain, down / gain^2) so the SwiGLU clamp triggers.
float expert_row_factor(const TensorSpec& spec, uint64_t row) {
  const uint64_t expert = row / spec.ne[1];
  float gain = 1.0f;
  if (expert % 8 == 3) gain = 3.5f;
  if (expert % 8 == 7) gain = 5.0f;
  return spec.block_kind == BlockTensor::FfnDownExps ? 1.0f / (gain * gain) : gain;
}

void fill_expert_row(const RowContext& ctx, uint64_t row, float* out) {
  const uint64_t n = ctx.spec.ne[0];
  RowRng rng(mix_keys(ctx.tensor_key, row));
  const float base = expert_row_factor(ctx.spec, row) / std::sqrt(static_cast<float>(n));
  for (uint64_t col0 = 0; col0 < n; col0 += 32) {
    const uint64_t group_key = mix_keys(mix_keys(ctx.tensor_key ^ 0x9e0, row), col0 / 32);
    const float scale = base * static_cast<float>(std::exp2(keyed_uniform(group_key, -0.5, 0.5)));
    for (uint64_t col = col0; col < std::min(n, col0 + 32); ++col) out[col] = scale * rng.normal();
  }
}

// Hash routing: the first k entries of a random permutation of the experts (Shared: 0..k-1).
void fill_tid2eid_row(const RowContext& ctx, uint64_t row, float* out) {
  if (ctx.routing == SynthRouting::Shared) {
    for (uint64_t i = 0; i < ctx.spec.ne[0]; ++i) out[i] = static_cast<float>(i);
    return;
  }
  const uint32_t n_experts = ctx.c.n_experts;
  std::vector<uint32_t> perm(n_experts);
  for (uint32_t i = 0; i < n_experts; ++i) perm[i] = i;
  RowRng rng(mix_keys(ctx.tensor_key, row));
  const uint64_t k = ctx.spec.ne[0];
  for (uint64_t i = 0; i < k; ++i) {
    const uint64_t j = i + rng.next() % (n_experts - i);
    std::swap(perm[i], perm[j]);
    out[i] = static_cast<float>(perm[i]);
  }
}

void fill_row(const RowContext& ctx, uint64_t row, float* out) {
  const ModelConfig& c = ctx.c;
  const TensorSpec& spec = ctx.spec;
  const uint64_t n = spec.ne[0];
  const double D = c.hidden;
  const double hc_in = static_cast<double>(c.hidden) * c.hc_mult;
  RowRng rng(mix_keys(ctx.tensor_key, row));

  if (spec.global_kind) {
    switch (*spec.global_kind) {
      case GlobalTensor::TokenEmbd: return fill_normal(rng, out, n, 0, 1);
      case GlobalTensor::Output: return fill_normal(rng, out, n, 0, 1 / std::sqrt(D));
      case GlobalTensor::OutputNorm: return fill_normal(rng, out, n, 1, 0.1f);
      case GlobalTensor::OutputHcFn: return fill_normal(rng, out, n, 0, 1.5 / std::sqrt(hc_in));
      case GlobalTensor::OutputHcBase: return fill_normal(rng, out, n, 0, 0.5f);
      case GlobalTensor::OutputHcScale: return fill_normal(rng, out, n, 0.5f, 0.1f);
      // V4.1 (the tiny-v41 fixture's recipe): Markov embedding 0.3 N, head and confidence N/sqrt(in).
      case GlobalTensor::DsparkMarkovEmbd: return fill_normal(rng, out, n, 0, 0.3f);
      case GlobalTensor::DsparkMarkovHead:
      case GlobalTensor::DsparkConfProj: return fill_normal(rng, out, n, 0, 1 / std::sqrt(static_cast<double>(n)));
      case GlobalTensor::Vision: return fill_normal(rng, out, n, 0, 1 / std::sqrt(static_cast<double>(n)));
    }
  }

  using BT = BlockTensor;
  switch (*spec.block_kind) {
    case BT::AttnNorm:
    case BT::AttnQANorm:
    case BT::AttnKvNorm:
    case BT::CompressorNorm:
    case BT::IndexerCompressorNorm:
    case BT::FfnNorm:
    case BT::NextnEnorm:
    case BT::NextnHnorm:
    case BT::NextnSharedHeadNorm:
      return fill_normal(rng, out, n, 1, 0.1f);
    case BT::AttnSinks:
      return fill_normal(rng, out, n, 0, 1);
    case BT::AttnQA:
    case BT::AttnQB:
    case BT::AttnKv:
    case BT::AttnOutputA:
      return fill_dense_linear(ctx, row, out, static_cast<double>(n));
    case BT::AttnOutputB:
      fill_dense_linear(ctx, row, out, static_cast<double>(n));
      for (uint64_t i = 0; i < n; ++i) out[i] *= 2;
      return;
    case BT::FfnGateShexp:
    case BT::FfnUpShexp:
      // Large enough that some shared-expert pre-activations exceed the clamp.
      fill_dense_linear(ctx, row, out, static_cast<double>(n));
      for (uint64_t i = 0; i < n; ++i) out[i] *= 3;
      return;
    case BT::FfnDownShexp:
      fill_dense_linear(ctx, row, out, static_cast<double>(n));
      for (uint64_t i = 0; i < n; ++i) out[i] /= 9;
      return;
    case BT::NextnEhProj:
      // Two side-by-side D-input projections (embedding half, hidden half).
      return fill_dense_linear(ctx, row, out, D);
    case BT::IndexerQB: {
      // Heads come in pairs, head 2j+1 = -(head 2j) + 0.3 * own draw; otherwise the ReLU
      // in the indexer score often zeroes every head and leaves exact ties at 0.
      fill_dense_linear(ctx, row, out, static_cast<double>(n));
      const uint64_t head = row / c.index_head_dim;
      if (head % 2 == 1) {
        std::vector<float> partner(n);
        fill_dense_linear(ctx, row - c.index_head_dim, partner.data(), static_cast<double>(n));
        for (uint64_t i = 0; i < n; ++i) out[i] = -partner[i] + 0.3f * out[i];
      }
      return;
    }
    case BT::CompressorKv:
    case BT::IndexerCompressorKv:
    case BT::IndexerProj:
      return fill_normal(rng, out, n, 0, 1 / std::sqrt(D));
    case BT::CompressorGate:
    case BT::IndexerCompressorGate:
      return fill_normal(rng, out, n, 0, 1.5 / std::sqrt(D));
    case BT::CompressorApe:
    case BT::IndexerCompressorApe:
      return fill_normal(rng, out, n, 0, 0.5f);
    case BT::HcAttnFn:
    case BT::HcFfnFn:
    case BT::NextnHcHeadFn:
      return fill_normal(rng, out, n, 0, 1.5 / std::sqrt(hc_in));
    case BT::HcAttnBase:
    case BT::HcFfnBase:
      // Pre/post entries 0.5 N, comb entries N: clearly asymmetric mixing matrices.
      for (uint64_t i = 0; i < n; ++i) out[i] = (i < 2 * c.hc_mult ? 0.5f : 1.0f) * rng.normal();
      return;
    case BT::NextnHcHeadBase:
      return fill_normal(rng, out, n, 0, 0.5f);
    case BT::HcAttnScale:
    case BT::HcFfnScale:
    case BT::NextnHcHeadScale:
      return fill_normal(rng, out, n, 0.5f, 0.1f);
    case BT::FfnGateInp:
      return fill_normal(rng, out, n, 0, 1.5 / std::sqrt(D));
    case BT::FfnExpProbsB:
      if (ctx.routing == SynthRouting::Shared) return fill_shared_routing_bias(ctx, out);
      return fill_normal(rng, out, n, 0, 0.2f);
    case BT::FfnTid2Eid:
      return fill_tid2eid_row(ctx, row, out);
    case BT::FfnGateExps:
    case BT::FfnUpExps:
    case BT::FfnDownExps:
      return fill_expert_row(ctx, row, out);
    case BT::NextnEmbedTokens:
      return fill_normal(rng, out, n, 0, 1);
    case BT::NextnSharedHeadHead:
      return fill_normal(rng, out, n, 0, 1 / std::sqrt(D));
    // V4.1, drawn as the tiny-v41 fixture draws them.
    case BT::IndexerKNorm:
    case BT::DsparkMainNorm:
      return fill_normal(rng, out, n, 1, 0.1f);
    case BT::IndexerK:
    case BT::DsparkMainProj:
      return fill_dense_linear(ctx, row, out, static_cast<double>(n));
    case BT::FfnExpProbsBVl:
      if (ctx.routing == SynthRouting::Shared) return fill_shared_routing_bias(ctx, out);
      return fill_normal(rng, out, n, 0, 0.2f);
    case BT::EngramEmbd: {
      // N times 2^U(-1,1) per (row, 32 values).
      for (uint64_t col0 = 0; col0 < n; col0 += 32) {
        const float scale = static_cast<float>(std::exp2(keyed_uniform(mix_keys(mix_keys(ctx.tensor_key, row), col0), -1, 1)));
        for (uint64_t col = col0; col < std::min(n, col0 + 32); ++col) out[col] = scale * rng.normal();
      }
      return;
    }
    case BT::EngramKv:  // gain 0.1: the gated value stays a small correction
      fill_dense_linear(ctx, row, out, static_cast<double>(n));
      for (uint64_t i = 0; i < n; ++i) out[i] *= 0.1f;
      return;
    case BT::EngramQ:
    case BT::EngramK:
      return fill_normal(rng, out, n, 1, 0.3f);
  }
}

bool is_hc_mixer(const TensorSpec& spec) {
  return spec.global_kind == GlobalTensor::OutputHcFn || spec.block_kind == BlockTensor::HcAttnFn ||
         spec.block_kind == BlockTensor::HcFfnFn || spec.block_kind == BlockTensor::NextnHcHeadFn;
}

// One Engram table row as the release stores it: FP8 codes under a power-of-two scale per
// 32 values (2^ceil(log2(amax / 448)), the fixture's rule), then the E8M0 scales.
void encode_fp8_engram_row(const float* values, uint32_t dim, uint8_t* dst) {
  std::vector<uint8_t> codes(dim), scales(dim / 32);
  for (uint32_t g = 0; g < dim / 32; ++g) {
    float amax = 0;
    for (uint32_t k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(values[32 * g + k]));
    int e = 0;
    if (amax > 0) {
      const float m = std::frexp(amax / kE4M3Max, &e);
      if (m == 0.5f) --e;
    }
    scales[g] = static_cast<uint8_t>(std::clamp(e + 127, 1, 254));
    const float inv = 1.0f / e8m0_to_f32(scales[g]);
    for (uint32_t k = 0; k < 32; ++k) codes[32 * g + k] = f32_to_e4m3(values[32 * g + k] * inv);
  }
  encode_engram_fp8_row(codes.data(), scales.data(), dim, dst);
}

// The compressed token map of DeepSeek's tokenizer and the official hash constants.
Status write_v41_engram_metadata(gguf::GgufWriter& writer, const ModelConfig& c) {
  DSV4_ASSIGN_OR_RETURN(text::TokenizerVocab vocab,
                        text::parse_tokenizer_json(text::builtin_tokenizer_json(), "built-in tokenizer.json"));
  DSV4_ASSIGN_OR_RETURN(text::CompressedVocab map, text::compressed_token_map(vocab));
  if (map.size != c.engram->compressed_vocab_size)
    return Status::errorf("synth: DeepSeek's tokenizer has {} Engram ids, the config says {}", map.size,
                          c.engram->compressed_vocab_size);
  map.token_map.resize(c.vocab_size, map.token_map.at(c.engram->pad_token_id));  // ids past the tokenizer
  DSV4_ASSIGN_OR_RETURN(EngramHashConstants k, compute_engram_hash_constants(*c.engram));
  DSV4_ASSIGN_OR_RETURN(EngramHasher hasher, EngramHasher::create(*c.engram, std::move(k), std::move(map.token_map)));
  write_engram_hash_metadata(writer, c, hasher);
  writer.set(fmt::format("{}.engram.encoding", c.architecture()), gguf::Value::string(engram_row_encoding(c.engram->dim)));
  return Status::ok();
}

constexpr uint64_t kChunkBytes = uint64_t{32} << 20;
constexpr uint64_t kGrainElements = 1 << 16;  // values per parallel work item, at least
constexpr uint64_t kPieceBytes = uint64_t{8} << 20;  // random blocks: bytes per write, at most

}  // namespace

GgmlType synth_tensor_type(const TensorSpec& spec, GgmlType expert_type, GgmlType dense_type,
                           std::string* note) {
  if (spec.type_class == TypeClass::Index) return GgmlType::I32;
  // Engram tables as the release stores them: FP8 rows with E8M0 scales.
  if (spec.type_class == TypeClass::EngramTable) return GgmlType::I8;
  if (spec.type_class == TypeClass::Vector) return GgmlType::F32;
  // The APE is small; llama.cpp's converter keeps it in the checkpoint's f32.
  if (spec.block_kind == BlockTensor::CompressorApe || spec.block_kind == BlockTensor::IndexerCompressorApe)
    return GgmlType::F32;
  // The reference keeps the hyper-connection mixers in fp32; they are small.
  if (is_hc_mixer(spec)) return GgmlType::F32;
  const GgmlType want = spec.role == TensorRole::RoutedExperts ? expert_type : dense_type;
  if (ggml_row_bytes(want, spec.ne[0])) return want;
  const GgmlType fallback = ggml_row_bytes(GgmlType::Q8_0, spec.ne[0]) ? GgmlType::Q8_0 : GgmlType::F32;
  if (note)
    *note = fmt::format("{}: row length {} is not a multiple of {}'s block size {}; written as {}",
                        spec.name, spec.ne[0], ggml_type_name(want), ggml_traits(want).block_elems,
                        ggml_type_name(fallback));
  return fallback;
}

std::vector<const TensorSpec*> synth_tensor_list(const TensorCatalog& catalog) {
  std::vector<const TensorSpec*> out;
  for (const auto& spec : catalog.tensors)
    if (spec.block_kind != BlockTensor::NextnEmbedTokens &&
        spec.block_kind != BlockTensor::NextnSharedHeadHead)
      out.push_back(&spec);
  return out;
}

float synth_row_std(const ModelConfig& c, const TensorSpec& spec, uint64_t row) {
  const double n = static_cast<double>(spec.ne[0]);
  const double D = c.hidden, hc_in = static_cast<double>(c.hidden) * c.hc_mult;
  double sd = 1 / std::sqrt(n);  // the dense linears (fill_dense_linear)
  if (spec.global_kind) {
    switch (*spec.global_kind) {
      case GlobalTensor::TokenEmbd: sd = 1; break;
      case GlobalTensor::Output: sd = 1 / std::sqrt(D); break;
      case GlobalTensor::OutputHcFn: sd = 1.5 / std::sqrt(hc_in); break;
      default: break;
    }
    return static_cast<float>(sd);
  }
  using BT = BlockTensor;
  switch (*spec.block_kind) {
    case BT::AttnOutputB: sd = 2 / std::sqrt(n); break;
    case BT::FfnGateShexp:
    case BT::FfnUpShexp: sd = 3 / std::sqrt(n); break;
    case BT::FfnDownShexp: sd = 1 / (9 * std::sqrt(n)); break;
    case BT::NextnEhProj: sd = 1 / std::sqrt(D); break;
    case BT::CompressorKv:
    case BT::IndexerCompressorKv:
    case BT::IndexerProj:
    case BT::NextnSharedHeadHead: sd = 1 / std::sqrt(D); break;
    case BT::CompressorGate:
    case BT::IndexerCompressorGate:
    case BT::FfnGateInp: sd = 1.5 / std::sqrt(D); break;
    case BT::CompressorApe:
    case BT::IndexerCompressorApe: sd = 0.5; break;
    case BT::HcAttnFn:
    case BT::HcFfnFn:
    case BT::NextnHcHeadFn: sd = 1.5 / std::sqrt(hc_in); break;
    case BT::NextnEmbedTokens: sd = 1; break;
    case BT::FfnGateExps:
    case BT::FfnUpExps:
    case BT::FfnDownExps: sd = expert_row_factor(spec, row) / std::sqrt(n); break;
    default: break;
  }
  return static_cast<float>(sd);
}

void synth_rows(const ModelConfig& config, const TensorSpec& spec, uint64_t seed, uint64_t row,
                uint64_t n_rows, float* out) {
  const RowContext ctx{config, spec, mix_keys(seed, hash_name(spec.name))};
  for (uint64_t r = 0; r < n_rows; ++r) fill_row(ctx, row + r, out + r * spec.ne[0]);
}

namespace {

// One output file: its metadata part and its tensors (catalog spec, name in this file).
struct SynthFile {
  std::string path;
  GgufPart part;
  std::vector<std::pair<const TensorSpec*, std::string>> tensors;
};

// Rows of the tensor between row0 and row0 + rows, drawn and quantised (the normal fill).
void draw_rows(const RowContext& ctx, GgmlType type, uint64_t row0, uint64_t rows, uint64_t row_bytes,
               ThreadPool& pool, std::vector<std::vector<float>>& scratch, uint8_t* out) {
  const uint64_t n = ctx.spec.ne[0];
  pool.parallel_for(static_cast<int64_t>(rows), [&](int64_t begin, int64_t end, int thread) {
    std::vector<float>& values = scratch[thread];
    values.resize(n);
    for (int64_t r = begin; r < end; ++r) {
      fill_row(ctx, row0 + r, values.data());
      uint8_t* dst = out + r * row_bytes;
      if (type == GgmlType::I8) {
        encode_fp8_engram_row(values.data(), static_cast<uint32_t>(n), dst);
      } else if (type == GgmlType::I32) {
        for (uint64_t k = 0; k < n; ++k) {
          const int32_t v = static_cast<int32_t>(values[k]);
          std::memcpy(dst + 4 * k, &v, 4);
        }
      } else {
        quantize_row(type, values.data(), dst, static_cast<int64_t>(n));
      }
    }
  }, std::max<int64_t>(1, static_cast<int64_t>(kGrainElements / n)));
}

// Random blocks (SynthFill::RandomBlocks), the writer's pieces produced and written by every
// thread of the pool: whole rows per piece, a few pieces per thread.
Status write_random_blocks(const RowContext& ctx, GgmlType type, uint64_t n_rows, uint64_t row_bytes,
                           ThreadPool& pool, gguf::GgufWriter& writer) {
  const uint64_t blocks_per_row = ctx.spec.ne[0] / ggml_traits(type).block_elems;
  const uint64_t want_rows = n_rows / (4 * static_cast<uint64_t>(pool.size())) + 1;
  const uint64_t piece_rows = std::clamp<uint64_t>(want_rows, 1, std::max<uint64_t>(1, kPieceBytes / row_bytes));
  return writer.write_tensor_data_parallel(
      n_rows * row_bytes, piece_rows * row_bytes,
      [&](uint64_t offset, std::span<uint8_t> piece) {
        const uint64_t row0 = offset / row_bytes, rows = piece.size() / row_bytes;
        std::vector<float> row_std(rows);
        for (uint64_t r = 0; r < rows; ++r) row_std[r] = synth_row_std(ctx.c, ctx.spec, row0 + r);
        fill_random_blocks(type, ctx.tensor_key, row0 * blocks_per_row, blocks_per_row, row_std, piece.data());
      },
      pool);
}

// The element type of each tensor of a file, with the notes on fallbacks.
Result<std::vector<GgmlType>> tensor_types(const SynthFile& file, const SynthOptions& opts, SynthReport& report) {
  std::vector<GgmlType> types;
  for (const auto& [spec, name] : file.tensors) {
    std::string note;
    if (opts.tensor_type) {
      DSV4_ASSIGN_OR_RETURN(GgmlType t, opts.tensor_type(*spec, &note));
      types.push_back(t);
    } else {
      types.push_back(synth_tensor_type(*spec, opts.expert_type, opts.dense_type, &note));
    }
    if (!note.empty()) report.notes.push_back(std::move(note));
  }
  return types;
}

bool gets_random_blocks(const SynthOptions& opts, const TensorSpec& spec, GgmlType type) {
  return opts.fill == SynthFill::RandomBlocks && spec.type_class == TypeClass::Matrix &&
         random_blocks_supported(type);
}

Status write_synth_file(const SynthFile& file, const SynthOptions& opts, size_t& done, size_t total,
                        SynthReport& report) {
  const ModelConfig& c = opts.config;
  DSV4_ASSIGN_OR_RETURN(std::vector<GgmlType> types, tensor_types(file, opts, report));
  if (opts.dry_run) {
    for (size_t i = 0; i < file.tensors.size(); ++i) {
      const TensorSpec& spec = *file.tensors[i].first;
      report.data_bytes += *ggml_row_bytes(types[i], stored_shape(spec, types[i])[0]) * (spec.n_elements() / spec.ne[0]);
      ++report.n_tensors;
    }
    report.paths.push_back(file.path);
    return Status::ok();
  }
  gguf::WriterOptions wopts;
  wopts.overwrite = opts.overwrite;
  gguf::GgufWriter writer(file.path, wopts);
  c.write_gguf_metadata(writer, file.part);
  if (!opts.preset_name.empty()) writer.set(std::string(kSynthPresetKey), gguf::Value::string(opts.preset_name));
  writer.set(std::string(kSynthSeedKey), gguf::Value::u64(opts.seed));
  writer.set(std::string(kSynthVersionKey), gguf::Value::u32(kSynthVersion));
  if (opts.fill == SynthFill::RandomBlocks) writer.set(std::string(kSynthFillKey), gguf::Value::string("random-blocks"));
  if (opts.routing == SynthRouting::Shared) writer.set(std::string(kSynthRoutingKey), gguf::Value::string("shared"));
  if (opts.write_tokenizer) {
    text::TokenizerJsonOptions topts;
    topts.min_vocab_size = c.vocab_size;
    DSV4_TRY(text::write_tokenizer_metadata(text::builtin_tokenizer_json(), "built-in tokenizer.json",
                                            writer, topts));
  }

  if (c.engram && file.part != GgufPart::MtpSidecar) DSV4_TRY(write_v41_engram_metadata(writer, c));

  for (size_t i = 0; i < file.tensors.size(); ++i)
    DSV4_TRY(writer.add_tensor(file.tensors[i].second, types[i], stored_shape(*file.tensors[i].first, types[i])));
  DSV4_TRY(writer.begin());

  ThreadPool& pool = opts.pool ? *opts.pool : ThreadPool::global();
  std::vector<std::vector<float>> scratch(pool.size());
  std::vector<uint8_t> chunk;
  for (size_t i = 0; i < file.tensors.size(); ++i) {
    const TensorSpec& spec = *file.tensors[i].first;
    const GgmlType type = types[i];
    const uint64_t row_bytes = *ggml_row_bytes(type, stored_shape(spec, type)[0]);
    const uint64_t n_rows = spec.n_elements() / spec.ne[0];
    // Keyed by the catalog name, so a tensor has the same values in whichever file it lands.
    const RowContext ctx{c, spec, mix_keys(opts.seed, hash_name(spec.name)), opts.routing};
    if (gets_random_blocks(opts, spec, type)) {
      DSV4_TRY(write_random_blocks(ctx, type, n_rows, row_bytes, pool, writer));
      report.data_bytes += n_rows * row_bytes;
    } else {
      const uint64_t rows_per_chunk = std::max<uint64_t>(1, kChunkBytes / row_bytes);
      for (uint64_t row0 = 0; row0 < n_rows; row0 += rows_per_chunk) {
        const uint64_t rows = std::min(rows_per_chunk, n_rows - row0);
        chunk.resize(rows * row_bytes);
        draw_rows(ctx, type, row0, rows, row_bytes, pool, scratch, chunk.data());
        DSV4_TRY(writer.write_tensor_data(chunk));
        report.data_bytes += chunk.size();
      }
    }
    ++report.n_tensors;
    if (opts.on_progress) opts.on_progress(++done, total, report.data_bytes);
  }
  DSV4_TRY(writer.finish());
  report.paths.push_back(file.path);
  return Status::ok();
}

}  // namespace

Result<SynthReport> write_synthetic_model(const std::string& path, const SynthOptions& opts) {
  const ModelConfig& c = opts.config;
  DSV4_TRY(c.validate());
  for (GgmlType t : {opts.expert_type, opts.dense_type})
    if (!can_quantize(t))
      return Status::errorf("synth: cannot produce {} weights (producible: f32, f16, bf16, q8_0, "
                            "q2_K, q3_K, q4_K, q5_K, q6_K, mxfp4)", ggml_type_name(t));

  const TensorCatalog catalog = build_tensor_catalog(c);
  const std::vector<const TensorSpec*> specs = synth_tensor_list(catalog);
  std::vector<SynthFile> files;
  if (opts.layout == WriteLayout::Bundled || c.n_mtp == 0 || c.is_v41()) {  // V4.1: DSpark stages stay in the file
    files.push_back({path, c.n_mtp == 0 ? GgufPart::Trunk : GgufPart::Bundled, {}});
    for (const TensorSpec* spec : specs) files[0].tensors.emplace_back(spec, spec->name);
  } else {
    files.push_back({path, GgufPart::Trunk, {}});
    files.push_back({sidecar_path_for(path), GgufPart::MtpSidecar, {}});
    for (const TensorSpec* spec : specs) {
      const Placement p = place_tensor(*spec, c);
      if (p.in_trunk) files[0].tensors.emplace_back(spec, spec->name);
      if (p.in_sidecar) files[1].tensors.emplace_back(spec, p.sidecar_name);
    }
  }
  size_t total = 0, done = 0;
  for (const SynthFile& f : files) total += f.tensors.size();
  SynthReport report;
  for (const SynthFile& f : files) DSV4_TRY(write_synth_file(f, opts, done, total, report));
  return report;
}

}  // namespace dsv4
