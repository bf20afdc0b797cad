#include "convert/synthetic_checkpoint.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "convert/converter.h"
#include "convert/official_tensor.h"
#include "convert/safetensors_writer.h"
#include "synth/synth.h"
#include "text/builtin_tokenizer.h"
#include "util/float_formats.h"
#include "util/thread_pool.h"

namespace dsv4::convert {
namespace {

// How the official release stores a tensor (spec §7).
enum class Storage { Bf16, F32, Fp8, Fp4, I64, Fp8Rows };  // Fp8Rows: V4.1 Engram tables

Storage storage_of(const PlannedTensor& t, const std::string& official_name, bool experts_fp4) {
  switch (t.source.layout) {
    case SourceLayout::ExpertStack: return experts_fp4 ? Storage::Fp4 : Storage::Fp8;
    case SourceLayout::Index: return Storage::I64;
    case SourceLayout::ColumnConcat: return Storage::Fp8;  // mtp e_proj / h_proj
    case SourceLayout::EngramRows: return Storage::Fp8Rows;
    case SourceLayout::Single: break;
  }
  using BT = BlockTensor;
  switch (t.spec.block_kind.value_or(BT::AttnNorm)) {
    case BT::AttnQA:
    case BT::AttnQB:
    case BT::AttnKv:
    case BT::AttnOutputA:
    case BT::AttnOutputB:
    case BT::IndexerQB:
    case BT::FfnGateShexp:
    case BT::FfnUpShexp:
    case BT::FfnDownShexp:
    case BT::EngramKv:         // V4.1 (tiny-v41 README, "stored as")
    case BT::DsparkMainProj: return Storage::Fp8;
    default: break;
  }
  if (t.spec.global_kind == GlobalTensor::DsparkMarkovEmbd || t.spec.global_kind == GlobalTensor::DsparkMarkovHead ||
      t.spec.global_kind == GlobalTensor::DsparkConfProj || t.spec.block_kind == BT::EngramQ ||
      t.spec.block_kind == BT::EngramK)
    return Storage::Bf16;
  // Norm weights, embedding, head, router, compressors, indexer projections: BF16;
  // hyper-connection tensors, sinks, APE and the router bias: F32.
  if (official_name.ends_with("norm.weight")) return Storage::Bf16;
  if (t.spec.type_class == TypeClass::Vector || official_name.find("hc_") != std::string::npos)
    return Storage::F32;
  return Storage::Bf16;
}

struct OfficialEntry {
  const PlannedTensor* plan;
  size_t part;                  // index into plan->source.names
  std::string name;
  Storage storage;
  uint64_t rows, cols;          // logical
  uint64_t weight_bytes, scale_bytes;
  std::vector<uint64_t> shape;  // as stored
};

uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

OfficialEntry make_entry(const PlannedTensor& t, size_t part, const CheckpointConfig& config) {
  OfficialEntry e{&t, part, t.source.names[part], Storage::F32, 1, 1, 0, 0, {}};
  e.storage = storage_of(t, e.name, config.format.experts_fp4);
  const auto& shape = t.source.part_shape;
  e.cols = shape.back();
  for (size_t i = 0; i + 1 < shape.size(); ++i) e.rows *= shape[i];
  e.shape = shape;
  switch (e.storage) {
    case Storage::Bf16: e.weight_bytes = e.rows * e.cols * 2; break;
    case Storage::F32: e.weight_bytes = e.rows * e.cols * 4; break;
    case Storage::I64: e.weight_bytes = e.rows * e.cols * 8; break;
    case Storage::Fp8:
      e.weight_bytes = e.rows * e.cols;
      e.scale_bytes = ceil_div(e.rows, config.format.fp8_block_rows) * ceil_div(e.cols, config.format.fp8_block_cols);
      break;
    case Storage::Fp4:
      e.shape = {e.rows, e.cols / 2};
      e.weight_bytes = e.rows * e.cols / 2;
      e.scale_bytes = e.rows * e.cols / 32;
      break;
    case Storage::Fp8Rows:
      e.weight_bytes = e.rows * e.cols;
      e.scale_bytes = e.rows * e.cols / 32;
      break;
  }
  return e;
}

// E8M0 byte of the power of two 2^ceil(log2(amax / limit)) (the fixture's scale rule).
uint8_t e8m0_scale_for(double amax, double limit) {
  if (!(amax > 0)) return 0;
  int e;
  const double m = std::frexp(amax / limit, &e);  // amax/limit = m * 2^e, m in [0.5, 1)
  if (m == 0.5) --e;                               // an exact power of two
  return static_cast<uint8_t>(std::clamp(e + 127, 0, 254));
}

// The f32 values of rows [row0, row0 + n) of one official part, from synth's drawing of
// the GGUF tensor it becomes.
void part_rows(const CheckpointConfig& config, const OfficialEntry& e, uint64_t seed, uint64_t row0, uint64_t n,
               float* out, std::vector<float>& wide) {
  const PlannedTensor& t = *e.plan;
  switch (t.source.layout) {
    case SourceLayout::ExpertStack:
      synth_rows(config.model, t.spec, seed, e.part * e.rows + row0, n, out);
      return;
    case SourceLayout::ColumnConcat: {
      const uint64_t width = t.spec.ne[0];
      wide.resize(width);
      for (uint64_t r = 0; r < n; ++r) {
        synth_rows(config.model, t.spec, seed, row0 + r, 1, wide.data());
        std::memcpy(out + r * e.cols, wide.data() + e.part * e.cols, e.cols * sizeof(float));
      }
      return;
    }
    default:
      synth_rows(config.model, t.spec, seed, row0, n, out);
  }
}

class EntryEncoder {
 public:
  EntryEncoder(const CheckpointConfig& config, uint64_t seed, ThreadPool& pool)
      : config_(config), seed_(seed), pool_(pool), wide_(pool.size()) {}

  Status write(const OfficialEntry& e, SafetensorsWriter& out) {
    const uint32_t br = config_.format.fp8_block_rows;
    // Slabs of whole FP8 row blocks, about 16 MB of f32 each.
    uint64_t slab = std::max<uint64_t>(1, (16ull << 20) / (4 * e.cols));
    if (e.storage == Storage::Fp8) slab = std::max<uint64_t>(br, slab / br * br);
    std::vector<uint8_t> scales(e.scale_bytes);
    for (uint64_t row0 = 0; row0 < e.rows; row0 += slab) {
      const uint64_t n = std::min(slab, e.rows - row0);
      values_.resize(n * e.cols);
      pool_.parallel_for(static_cast<int64_t>(n), [&](int64_t b, int64_t end, int thread) {
        part_rows(config_, e, seed_, row0 + b, end - b, values_.data() + b * e.cols, wide_[thread]);
      });
      const uint64_t row_bytes = e.weight_bytes / e.rows;
      bytes_.resize(n * row_bytes);
      if (e.storage == Storage::Fp8) fp8_scales(e, row0, n, scales);
      pool_.parallel_for(static_cast<int64_t>(n), [&](int64_t b, int64_t end, int) {
        for (int64_t r = b; r < end; ++r) encode_row(e, row0 + r, values_.data() + r * e.cols,
                                                     bytes_.data() + r * row_bytes, scales);
      });
      DSV4_TRY(out.write(bytes_));
    }
    if (!scales.empty()) DSV4_TRY(out.write(scales));
    return Status::ok();
  }

 private:
  // The E8M0 scales of the 128x128 blocks of rows [row0, row0 + n) (whole row blocks).
  void fp8_scales(const OfficialEntry& e, uint64_t row0, uint64_t n, std::vector<uint8_t>& scales) {
    const uint32_t br = config_.format.fp8_block_rows, bc = config_.format.fp8_block_cols;
    const uint64_t col_blocks = ceil_div(e.cols, bc);
    const uint64_t row_blocks = ceil_div(n, br);
    pool_.parallel_for(static_cast<int64_t>(row_blocks * col_blocks), [&](int64_t b, int64_t end, int) {
      for (int64_t i = b; i < end; ++i) {
        const uint64_t rb = static_cast<uint64_t>(i) / col_blocks, cb = static_cast<uint64_t>(i) % col_blocks;
        double amax = 0;
        for (uint64_t r = rb * br; r < std::min<uint64_t>(n, (rb + 1) * br); ++r)
          for (uint64_t c = cb * bc; c < std::min<uint64_t>(e.cols, (cb + 1) * bc); ++c)
            amax = std::max(amax, std::fabs(static_cast<double>(values_[r * e.cols + c])));
        scales[(row0 / br + rb) * col_blocks + cb] = e8m0_scale_for(amax, kE4M3Max);
      }
    });
  }

  void encode_row(const OfficialEntry& e, uint64_t row, const float* v, uint8_t* dst,
                  std::vector<uint8_t>& scales) const {
    switch (e.storage) {
      case Storage::Bf16:
        for (uint64_t c = 0; c < e.cols; ++c) {
          const uint16_t b = f32_to_bf16(v[c]);
          std::memcpy(dst + 2 * c, &b, 2);
        }
        break;
      case Storage::F32: std::memcpy(dst, v, e.cols * 4); break;
      case Storage::I64:
        for (uint64_t c = 0; c < e.cols; ++c) {
          const int64_t x = static_cast<int64_t>(v[c]);
          std::memcpy(dst + 8 * c, &x, 8);
        }
        break;
      case Storage::Fp8: {
        const uint32_t br = config_.format.fp8_block_rows, bc = config_.format.fp8_block_cols;
        const uint8_t* srow = scales.data() + (row / br) * ceil_div(e.cols, bc);
        for (uint64_t c = 0; c < e.cols; ++c) dst[c] = f32_to_e4m3(v[c] / e8m0_to_f32(srow[c / bc]));
        break;
      }
      case Storage::Fp8Rows: {  // one power-of-two scale per (row, 32 values), as the release
        uint8_t* srow = scales.data() + row * (e.cols / 32);
        for (uint64_t b = 0; b < e.cols / 32; ++b) {
          double amax = 0;
          for (uint64_t k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(static_cast<double>(v[32 * b + k])));
          srow[b] = e8m0_scale_for(amax, kE4M3Max);
          const float inv = 1.0f / e8m0_to_f32(srow[b]);
          for (uint64_t k = 0; k < 32; ++k) dst[32 * b + k] = f32_to_e4m3(v[32 * b + k] * inv);
        }
        break;
      }
      case Storage::Fp4: {
        uint8_t* srow = scales.data() + row * (e.cols / 32);
        for (uint64_t b = 0; b < e.cols / 32; ++b) {
          double amax = 0;
          for (uint64_t k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(static_cast<double>(v[32 * b + k])));
          srow[b] = e8m0_scale_for(amax, 6.0);
          const float inv = 1.0f / e8m0_to_f32(srow[b]);  // a power of two: exact
          for (uint64_t k = 0; k < 32; k += 2) {
            const uint8_t lo = f32_to_e2m1(v[32 * b + k] * inv), hi = f32_to_e2m1(v[32 * b + k + 1] * inv);
            dst[16 * b + k / 2] = static_cast<uint8_t>(lo | (hi << 4));
          }
        }
        break;
      }
    }
  }

  const CheckpointConfig& config_;
  uint64_t seed_;
  ThreadPool& pool_;
  std::vector<std::vector<float>> wide_;
  std::vector<float> values_;
  std::vector<uint8_t> bytes_;
};

// tokenizer_config.json as the official checkpoints ship it (what transformers' AutoTokenizer
// and llama.cpp's converter read beside tokenizer.json): no BOS/EOS added by the tokenizer,
// the end-of-sentence token as padding.
std::string tokenizer_config_json() {
  const auto token = [](std::string_view content) {
    return nlohmann::ordered_json{{"__type", "AddedToken"}, {"content", content}, {"lstrip", false},
                                  {"normalized", true},     {"rstrip", false},    {"single_word", false}};
  };
  nlohmann::ordered_json c;
  c["add_bos_token"] = false;
  c["add_eos_token"] = false;
  c["bos_token"] = token("<\uff5cbegin\u2581of\u2581sentence\uff5c>");
  c["clean_up_tokenization_spaces"] = false;
  c["eos_token"] = token("<\uff5cend\u2581of\u2581sentence\uff5c>");
  c["legacy"] = true;
  c["model_max_length"] = 1048576;
  c["pad_token"] = token("<\uff5cend\u2581of\u2581sentence\uff5c>");
  c["sp_model_kwargs"] = nlohmann::ordered_json::object();
  c["unk_token"] = nullptr;
  c["tokenizer_class"] = "PreTrainedTokenizerFast";
  return c.dump(2) + "\n";
}

Status write_text(const std::filesystem::path& path, std::string_view text) {
  const auto temp = path.string() + ".tmp";
  {
    std::ofstream out(temp, std::ios::binary);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    if (!out) return Status::errorf("{}: write failed: {}", temp, std::strerror(errno));
  }
  std::error_code ec;
  std::filesystem::rename(temp, path, ec);
  if (ec) return Status::errorf("{}: cannot rename to {}: {}", temp, path.string(), ec.message());
  return Status::ok();
}

}  // namespace

Result<SyntheticCheckpointReport> write_synthetic_checkpoint(const std::filesystem::path& dir,
                                                             const SyntheticCheckpointOptions& options) {
  const CheckpointConfig& config = options.config;
  DSV4_ASSIGN_OR_RETURN(Recipe recipe, recipe_by_name("f32"));
  DSV4_ASSIGN_OR_RETURN(ConversionPlan plan, plan_conversion(config, recipe));
  if ((options.write_tokenizer || config.model.engram) && config.model.vocab_size < 129280)
    return Status::errorf("synthetic checkpoint: the DeepSeek-V4 tokenizer needs vocab_size >= 129280, "
                          "the config has {}", config.model.vocab_size);
  if (std::filesystem::exists(dir / "config.json") && !options.overwrite)
    return Status::errorf("{}: already holds a checkpoint (config.json); overwrite not allowed", dir.string());
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::errorf("{}: cannot create: {}", dir.string(), ec.message());

  std::vector<OfficialEntry> entries;
  for (const PlannedTensor& t : plan.tensors)
    for (size_t p = 0; p < t.source.names.size(); ++p) entries.push_back(make_entry(t, p, config));

  // Shards in order, each up to shard_max_bytes of data (a weight stays with its scale).
  std::vector<std::vector<const OfficialEntry*>> shards(1);
  uint64_t shard_bytes = 0;
  for (const OfficialEntry& e : entries) {
    const uint64_t bytes = e.weight_bytes + e.scale_bytes;
    if (!shards.back().empty() && shard_bytes + bytes > options.shard_max_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(&e);
    shard_bytes += bytes;
  }

  SyntheticCheckpointReport report;
  ThreadPool pool(options.threads);
  EntryEncoder encoder(config, options.seed, pool);
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string file = fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards.size());
    SafetensorsWriter writer(dir / file);
    for (const OfficialEntry* e : shards[s]) {
      writer.add_tensor(e->name, e->storage == Storage::Bf16   ? StDtype::BF16
                                 : e->storage == Storage::F32  ? StDtype::F32
                                 : e->storage == Storage::I64  ? StDtype::I64
                                 : e->storage == Storage::Fp8 || e->storage == Storage::Fp8Rows ? StDtype::F8_E4M3
                                                               : StDtype::I8,
                        e->shape);
      weight_map[e->name] = file;
      ++report.n_tensors;
      if (e->scale_bytes) {
        const std::string scale = *scale_name_of(e->name);
        const std::vector<uint64_t> scale_shape =
            e->storage == Storage::Fp4 || e->storage == Storage::Fp8Rows
                ? std::vector<uint64_t>{e->rows, e->cols / 32}
                : std::vector<uint64_t>{ceil_div(e->rows, config.format.fp8_block_rows),
                                        ceil_div(e->cols, config.format.fp8_block_cols)};
        writer.add_tensor(scale, StDtype::F8_E8M0, scale_shape);
        weight_map[scale] = file;
        ++report.n_tensors;
      }
    }
    DSV4_TRY(writer.begin());
    for (const OfficialEntry* e : shards[s]) DSV4_TRY(encoder.write(*e, writer));
    DSV4_TRY(writer.finish());
    report.data_bytes += writer.data_bytes();
    report.shards.push_back(file);
  }

  nlohmann::ordered_json index;
  index["metadata"] = {{"total_size", report.data_bytes}};
  index["weight_map"] = weight_map;
  DSV4_TRY(write_text(dir / "model.safetensors.index.json", index.dump(2) + "\n"));
  // V4.1 needs the tokenizer: the converter derives the Engram token map from it.
  if (options.write_tokenizer || config.model.engram) {
    DSV4_TRY(write_text(dir / "tokenizer.json", text::builtin_tokenizer_json()));
    DSV4_TRY(write_text(dir / "tokenizer_config.json", tokenizer_config_json()));
  }
  // Last: a folder without config.json is not taken for a checkpoint.
  DSV4_TRY(write_text(dir / "config.json", checkpoint_config_json(config)));
  return report;
}

}  // namespace dsv4::convert
