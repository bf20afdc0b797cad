#include "convert/converter.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include <sys/resource.h>

#include "convert/official_tensor.h"
#include "convert/safetensors.h"
#include "gguf/gguf_writer.h"
#include "gguf/quant.h"
#include "model/engram.h"
#include "model/engram_table.h"
#include "text/engram_vocab.h"
#include "text/tokenizer_json.h"
#include "util/thread_pool.h"

namespace dsv4::convert {
namespace {

// A GGUF tensor's rows, produced from its bound official parts (see SourceLayout).
class RowProducer {
 public:
  RowProducer(const PlannedTensor& plan, std::vector<OfficialTensor> parts)
      : plan_(plan), parts_(std::move(parts)), row_len_(plan.spec.ne.at(0)) {
    rows_ = plan.spec.n_elements() / row_len_;
    part_rows_ = parts_.front().rows();
  }

  uint64_t rows() const { return rows_; }
  uint64_t row_len() const { return row_len_; }

  // Writes output row r as `type` into dst; `scratch` holds at least row_len floats.
  void write_row(uint64_t r, GgmlType type, uint8_t* dst, float* scratch) const {
    const SourceLayout layout = plan_.source.layout;
    if (layout == SourceLayout::EngramRows) {  // V4.1: the FP8 row with its scales, or requantised
      const OfficialTensor& table = parts_[0];
      if (type == GgmlType::I8) {
        encode_engram_fp8_row(table.fp8_codes(r), table.fp8_row_scales(r), static_cast<uint32_t>(row_len_), dst);
        return;
      }
      table.decode_rows(r, 1, scratch);
      quantize_row(type, scratch, dst, static_cast<int64_t>(row_len_));
      return;
    }
    if (layout == SourceLayout::Index) {
      std::vector<int64_t> ids(row_len_);
      parts_[0].integer_rows(r, 1, ids.data());
      for (uint64_t c = 0; c < row_len_; ++c) {
        const int32_t v = static_cast<int32_t>(ids[c]);
        std::memcpy(dst + 4 * c, &v, 4);
      }
      return;
    }
    if (layout == SourceLayout::ColumnConcat) {
      const uint64_t part_cols = parts_[0].cols();
      const uint64_t elem = type == GgmlType::F32 ? 4 : 2;
      bool raw = true;
      for (const auto& p : parts_) raw = raw && p.raw_row(r, type);
      if (raw) {
        for (size_t i = 0; i < parts_.size(); ++i)
          std::memcpy(dst + i * part_cols * elem, parts_[i].raw_row(r, type), part_cols * elem);
        return;
      }
      for (size_t i = 0; i < parts_.size(); ++i) parts_[i].decode_rows(r, 1, scratch + i * part_cols);
      quantize_row(type, scratch, dst, static_cast<int64_t>(row_len_));
      return;
    }
    const OfficialTensor& part = parts_[r / part_rows_];
    const uint64_t pr = r % part_rows_;
    if (type == GgmlType::MXFP4 && part.has_mxfp4_layout()) {
      part.mxfp4_rows(pr, 1, reinterpret_cast<block_mxfp4*>(dst));
      return;
    }
    if (const uint8_t* raw = part.raw_row(pr, type)) {
      std::memcpy(dst, raw, *ggml_row_bytes(type, row_len_));
      return;
    }
    part.decode_rows(pr, 1, scratch);
    quantize_row(type, scratch, dst, static_cast<int64_t>(row_len_));
  }

  // Drops the checkpoint pages of output rows [r0, r1) once they are written.
  void release(const Checkpoint& ckpt, uint64_t r0, uint64_t r1) const {
    if (plan_.source.layout == SourceLayout::ColumnConcat || plan_.source.layout == SourceLayout::Index ||
        plan_.source.layout == SourceLayout::Single || plan_.source.layout == SourceLayout::EngramRows) {
      for (const auto& p : parts_) p.release_rows(ckpt, r0, r1 - r0, r1 == rows_);
      return;
    }
    for (uint64_t r = r0; r < r1;) {
      const uint64_t part = r / part_rows_, begin = r % part_rows_;
      const uint64_t end = std::min(part_rows_, begin + (r1 - r));
      parts_[part].release_rows(ckpt, begin, end - begin, end == part_rows_);
      r += end - begin;
    }
  }

 private:
  const PlannedTensor& plan_;
  std::vector<OfficialTensor> parts_;
  uint64_t row_len_ = 0, rows_ = 0, part_rows_ = 0;
};

// llama.cpp's llama_ftype for the recipe (general.file_type): what tools display.
uint32_t llama_file_type(const Recipe& recipe) {
  switch (recipe.type(ConvertRole::Experts)) {
    case GgmlType::Q2_K: return 10;   // MOSTLY_Q2_K
    case GgmlType::Q4_K: return 15;   // MOSTLY_Q4_K_M
    case GgmlType::Q8_0: return 7;    // MOSTLY_Q8_0
    case GgmlType::MXFP4: return 38;  // MOSTLY_MXFP4_MOE
    case GgmlType::BF16: return 32;   // MOSTLY_BF16
    case GgmlType::F16: return 1;     // MOSTLY_F16
    default: return 0;                // ALL_F32
  }
}

Result<std::string> read_file_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::errorf("{}: cannot open", path.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Every tid2eid row must name distinct experts below n_experts.
Status check_tid2eid(const OfficialTensor& t, uint32_t n_experts) {
  std::vector<int64_t> row(t.cols());
  for (uint64_t r = 0; r < t.rows(); ++r) {
    t.integer_rows(r, 1, row.data());
    for (uint64_t c = 0; c < row.size(); ++c) {
      if (row[c] < 0 || row[c] >= n_experts)
        return Status::errorf("tensor {}: row {} holds expert {}, outside [0, {})", t.name(), r, row[c],
                              n_experts);
      for (uint64_t k = 0; k < c; ++k)
        if (row[k] == row[c])
          return Status::errorf("tensor {}: row {} lists expert {} twice", t.name(), r, row[c]);
    }
  }
  return Status::ok();
}

// V4.1: the compressed token map from the checkpoint's tokenizer.json (it must give the
// config's compressed vocabulary) and the official hash constants (their prime sums must
// give the config's table rows); the table encoding when the rows are stored as I8.
Status write_engram_metadata_v41(const std::filesystem::path& dir, const ModelConfig& model, const ConversionPlan& plan,
                                 gguf::GgufWriter& writer) {
  const auto path = dir / "tokenizer.json";
  if (!std::filesystem::exists(path))
    return Status::errorf("{}: missing; a V4.1 checkpoint needs it for the Engram token map", path.string());
  DSV4_ASSIGN_OR_RETURN(std::string json, read_file_text(path));
  text::TokenizerJsonOptions topts;
  topts.min_vocab_size = model.vocab_size;
  topts.vocabulary_only = true;  // the map needs the vocabulary and its byte-level decoding only
  DSV4_ASSIGN_OR_RETURN(text::TokenizerVocab vocab, text::parse_tokenizer_json(json, path.string(), topts));
  DSV4_ASSIGN_OR_RETURN(text::CompressedVocab map, text::compressed_token_map(vocab));
  if (map.size != model.engram->compressed_vocab_size)
    return Status::errorf("{}: gives {} Engram ids (the official normalisation), config.json's "
                          "engram_compressed_vocab_size is {}", path.string(), map.size,
                          model.engram->compressed_vocab_size);
  if (map.token_map.size() != model.vocab_size)
    return Status::errorf("{}: {} tokens, config.json's vocab_size is {}", path.string(), map.token_map.size(),
                          model.vocab_size);
  auto constants = compute_engram_hash_constants(*model.engram);
  if (!constants) return constants.status().with_context(dir.string() + "/config.json");
  DSV4_ASSIGN_OR_RETURN(EngramHasher hasher,
                        EngramHasher::create(*model.engram, std::move(*constants), std::move(map.token_map)));
  write_engram_hash_metadata(writer, model, hasher);
  for (const PlannedTensor& t : plan.tensors)
    if (t.spec.block_kind == BlockTensor::EngramEmbd && t.type == GgmlType::I8) {
      writer.set(fmt::format("{}.engram.encoding", model.architecture()),
                 gguf::Value::string(engram_row_encoding(model.engram->dim)));
      break;
    }
  return Status::ok();
}

std::string human_bytes(uint64_t b) {
  const double x = static_cast<double>(b);
  if (x >= 1e9) return fmt::format("{:.2f} GB", x / 1e9);
  if (x >= 1e6) return fmt::format("{:.2f} MB", x / 1e6);
  if (x >= 1e3) return fmt::format("{:.1f} kB", x / 1e3);
  return fmt::format("{} B", b);
}

}  // namespace

uint64_t ConversionPlan::total_bytes() const {
  uint64_t n = 0;
  for (const auto& t : tensors) n += t.nbytes;
  return n;
}

uint64_t ConversionPlan::total_elements() const {
  uint64_t n = 0;
  for (const auto& t : tensors) n += t.spec.n_elements();
  return n;
}

double ConversionPlan::bits_per_weight() const {
  const uint64_t n = total_elements();
  return n == 0 ? 0.0 : 8.0 * static_cast<double>(total_bytes()) / static_cast<double>(n);
}

Result<ConversionPlan> plan_conversion(const CheckpointConfig& config, const Recipe& recipe) {
  DSV4_TRY(config.model.validate());
  ConversionPlan plan;
  plan.config = config;
  plan.recipe = recipe;
  // V4.1: the recipe keeps or drops the vision tower (and exp_probs_b_vl with it).
  if (plan.config.model.vision) plan.config.model.vision->in_file = recipe.keep_vision && config.has_vision_tower;
  const TensorCatalog catalog = build_tensor_catalog(plan.config.model);
  for (const TensorSpec& spec : catalog.tensors) {
    auto source = official_source(plan.config.model, spec);
    if (!source) continue;  // optional MTP copies of embed/head: the trunk's are shared
    // exp_probs_b_vl is optional in the catalog: written exactly when the tower is kept.
    if (spec.block_kind == BlockTensor::FfnExpProbsBVl && !spec.required) continue;
    DSV4_ASSIGN_OR_RETURN(TypeChoice choice, choose_type(recipe, spec));
    PlannedTensor t;
    t.spec = spec;
    t.type = choice.type;
    t.requested = choice.requested;
    t.source = std::move(*source);
    t.nbytes = *stored_bytes(spec, t.type);
    plan.tensors.push_back(std::move(t));
  }
  return plan;
}

ConvertSummary ConvertSummary::of_plan(ConversionPlan plan) {
  ConvertSummary summary;
  summary.plan = std::move(plan);
  for (const PlannedTensor& t : summary.plan.tensors) {
    ++summary.tensors_by_type[t.type];
    if (t.type != t.requested) summary.fallbacks.push_back(&t);
  }
  return summary;
}

std::string ConvertSummary::to_string() const {
  std::string s;
  const uint64_t bytes = plan.total_bytes();
  s += fmt::format("recipe {}: {} tensors, {} ({} bytes), {:.3f} bits per weight over {:.3f} B weights\n",
                   plan.recipe.name, plan.tensors.size(), human_bytes(bytes), bytes, plan.bits_per_weight(),
                   static_cast<double>(plan.total_elements()) / 1e9);
  std::map<GgmlType, uint64_t> bytes_by_type;
  for (const auto& t : plan.tensors) bytes_by_type[t.type] += t.nbytes;
  for (const auto& [type, n] : tensors_by_type)
    s += fmt::format("  {:>6}: {:5} tensors, {}\n", ggml_type_name(type), n, human_bytes(bytes_by_type[type]));
  if (!output_paths.empty()) {
    s += fmt::format("written in {:.1f} s ({:.0f} MB/s), peak resident memory {}:", seconds,
                     seconds > 0 ? static_cast<double>(bytes) / seconds / 1e6 : 0.0, human_bytes(peak_rss_bytes));
    for (const auto& p : output_paths) s += " " + p;
    s += "\n";
    s += tokenizer_written        ? "tokenizer: from tokenizer.json\n"
         : tokenizer_note.empty() ? "tokenizer: none (the checkpoint folder has no tokenizer.json)\n"
                                  : fmt::format("tokenizer: not written ({})\n", tokenizer_note);
  }
  if (fallbacks.empty()) {
    s += "fallbacks: none\n";
  } else {
    s += fmt::format("fallbacks ({}; row length not a multiple of the type's block):\n", fallbacks.size());
    for (const PlannedTensor* t : fallbacks)
      s += fmt::format("  {}: {} -> {} (row length {}, {} block {})\n", t->spec.name,
                       ggml_type_name(t->requested), ggml_type_name(t->type), t->spec.ne[0],
                       ggml_type_name(t->requested), ggml_traits(t->requested).block_elems);
  }
  return s;
}

Result<ConvertSummary> convert_checkpoint(const ConvertOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  const std::string out_path = options.output.string();
  if (!options.force && std::filesystem::exists(options.output))
    return Status::errorf("{}: output file exists (use --force to replace it)", out_path);

  DSV4_ASSIGN_OR_RETURN(CheckpointConfig config, read_checkpoint_config(options.checkpoint_dir));
  if (config.model.name.empty()) {
    // llama.cpp's converter names the model after its folder too.
    const auto dir = std::filesystem::weakly_canonical(options.checkpoint_dir);
    config.model.name = dir.filename().string();
  }
  DSV4_ASSIGN_OR_RETURN(ConversionPlan planned, plan_conversion(config, options.recipe));
  ConvertSummary summary = ConvertSummary::of_plan(std::move(planned));
  const ConversionPlan& plan = summary.plan;
  config.model = plan.config.model;
  DSV4_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::open(options.checkpoint_dir));

  // Bind every source before writing anything: all problems are reported together.
  std::vector<RowProducer> producers;
  producers.reserve(plan.tensors.size());
  std::vector<std::string> problems;
  std::set<std::string, std::less<>> used;
  for (const PlannedTensor& t : plan.tensors) {
    std::vector<OfficialTensor> parts;
    const bool integer = t.source.layout == SourceLayout::Index;
    for (const std::string& name : t.source.names) {
      used.insert(name);
      if (auto scale = scale_name_of(name)) used.insert(*scale);
      auto bound = t.source.layout == SourceLayout::EngramRows
                       ? OfficialTensor::bind_engram_table(ckpt, name, t.source.part_shape)
                       : OfficialTensor::bind(ckpt, name, t.source.part_shape, config.format, integer);
      if (!bound) {
        problems.push_back(bound.status().message());
        continue;
      }
      if (integer)
        if (Status s = check_tid2eid(*bound, config.model.n_experts); !s)
          problems.push_back(s.message());
      parts.push_back(std::move(*bound));
    }
    if (parts.size() == t.source.names.size()) producers.emplace_back(t, std::move(parts));
  }
  for (const auto& [name, tensor] : ckpt.tensors()) {
    if (used.contains(name)) continue;
    // The official converter drops MTP copies of the embedding and head: they are shared.
    if (!config.model.is_v41() && name.starts_with("mtp.") &&
        (name.find("emb") != std::string::npos || name.ends_with("head.weight")))
      continue;
    // V4.1: a recipe without the vision tower drops it and the image-token routing bias.
    if (config.model.is_v41() && plan.config.model.vision && !plan.config.model.vision->in_file &&
        is_official_vision_tensor(name))
      continue;
    problems.push_back(fmt::format("{}: tensor {} ({} {}) is not part of a DeepSeek-V4 model with this "
                                   "config.json", ckpt.files()[tensor->file_index].path().string(), name,
                                   st_dtype_name(tensor->dtype), tensor->shape_string()));
  }
  if (!problems.empty()) {
    constexpr size_t kShown = 20;
    std::string msg = fmt::format("{}: {} problem{} with the checkpoint:", options.checkpoint_dir.string(),
                                  problems.size(), problems.size() == 1 ? "" : "s");
    for (size_t i = 0; i < std::min(kShown, problems.size()); ++i) msg += "\n  " + problems[i];
    if (problems.size() > kShown) msg += fmt::format("\n  ... and {} more", problems.size() - kShown);
    return Status::error(std::move(msg));
  }

  // The files to write: (path, metadata part, [(plan index, name in that file)]).
  struct OutputFile {
    std::string path;
    GgufPart part;
    std::vector<std::pair<size_t, std::string>> tensors;
  };
  std::vector<OutputFile> files;
  const ModelConfig& model = config.model;
  // V4.1's DSpark stages stay in the file: llama.cpp's sidecar layout is V4's MTP block.
  if (options.layout == WriteLayout::Bundled || model.n_mtp == 0 || model.is_v41()) {
    files.push_back({out_path, model.n_mtp == 0 ? GgufPart::Trunk : GgufPart::Bundled, {}});
    for (size_t i = 0; i < plan.tensors.size(); ++i) files[0].tensors.emplace_back(i, plan.tensors[i].spec.name);
  } else {
    files.push_back({out_path, GgufPart::Trunk, {}});
    files.push_back({sidecar_path_for(out_path), GgufPart::MtpSidecar, {}});
    if (!options.force && std::filesystem::exists(files[1].path))
      return Status::errorf("{}: output file exists (use --force to replace it)", files[1].path);
    for (size_t i = 0; i < plan.tensors.size(); ++i) {
      const Placement p = place_tensor(plan.tensors[i].spec, model);
      if (p.in_trunk) files[0].tensors.emplace_back(i, plan.tensors[i].spec.name);
      if (p.in_sidecar) files[1].tensors.emplace_back(i, p.sidecar_name);
    }
  }
  std::string tokenizer_json;
  const auto tokenizer_path = options.checkpoint_dir / "tokenizer.json";
  if (std::filesystem::exists(tokenizer_path)) {
    DSV4_ASSIGN_OR_RETURN(tokenizer_json, read_file_text(tokenizer_path));
    summary.tokenizer_written = true;
    if (model.is_v41()) {
      // A V4.1 test checkpoint may ship a vocabulary-only tokenizer: convert without it.
      text::TokenizerJsonOptions topts;
      topts.min_vocab_size = model.vocab_size;
      auto vocab = text::parse_tokenizer_json(tokenizer_json, tokenizer_path.string(), topts);
      if (!vocab) {
        summary.tokenizer_written = false;
        summary.tokenizer_note = vocab.status().message();
      }
    }
  }

  ThreadPool pool(options.threads);
  std::vector<std::vector<float>> scratch(pool.size());
  std::vector<uint8_t> chunk;
  ConvertProgress progress;
  for (const OutputFile& f : files) {
    progress.tensors_total += f.tensors.size();
    for (const auto& [i, name] : f.tensors) progress.bytes_total += plan.tensors[i].nbytes;
  }
  for (const OutputFile& f : files) {
    gguf::WriterOptions wopts;
    wopts.split_max_bytes = f.part == GgufPart::MtpSidecar ? 0 : options.split_max_bytes;
    wopts.overwrite = options.force;
    gguf::GgufWriter writer(f.path, wopts);
    model.write_gguf_metadata(writer, f.part);
    writer.set("general.file_type", gguf::Value::u32(llama_file_type(plan.recipe)));
    writer.set("general.quantization_version", gguf::Value::u32(2));
    writer.set("dsv4.convert.recipe", gguf::Value::string(plan.recipe.name));
    if (summary.tokenizer_written) {
      text::TokenizerJsonOptions topts;
      topts.min_vocab_size = model.vocab_size;
      DSV4_TRY(text::write_tokenizer_metadata(tokenizer_json, tokenizer_path.string(), writer, topts));
    }
    if (model.engram && f.part != GgufPart::MtpSidecar)
      DSV4_TRY(write_engram_metadata_v41(options.checkpoint_dir, model, plan, writer));
    for (const auto& [i, name] : f.tensors)
      DSV4_TRY(writer.add_tensor(name, plan.tensors[i].type, stored_shape(plan.tensors[i].spec, plan.tensors[i].type)));
    DSV4_TRY(writer.begin());

    for (const auto& [i, name] : f.tensors) {
      const PlannedTensor& t = plan.tensors[i];
      const RowProducer& producer = producers[i];
      progress.current = name;
      const uint64_t row_bytes = *ggml_row_bytes(t.type, stored_shape(t.spec, t.type)[0]);
      const uint64_t work_bytes = std::max<uint64_t>(row_bytes, producer.row_len() * sizeof(float));
      const uint64_t rows_per_chunk = std::max<uint64_t>(1, options.chunk_bytes / work_bytes);
      for (uint64_t row0 = 0; row0 < producer.rows(); row0 += rows_per_chunk) {
        const uint64_t n = std::min(rows_per_chunk, producer.rows() - row0);
        chunk.resize(n * row_bytes);
        pool.parallel_for(static_cast<int64_t>(n), [&](int64_t begin, int64_t end, int thread) {
          std::vector<float>& buf = scratch[thread];
          buf.resize(producer.row_len());
          for (int64_t r = begin; r < end; ++r)
            producer.write_row(row0 + r, t.type, chunk.data() + r * row_bytes, buf.data());
        });
        DSV4_TRY(writer.write_tensor_data(chunk));
        producer.release(ckpt, row0, row0 + n);
        if (options.cancel && options.cancel->load()) return Status::error(std::string(kInterrupted));
        progress.bytes_done += chunk.size();
        if (options.on_progress) options.on_progress(progress);
      }
      ++progress.tensors_done;
      if (options.on_progress) options.on_progress(progress);
    }
    DSV4_TRY(writer.finish());
    for (const std::string& p : writer.output_paths()) summary.output_paths.push_back(p);
  }
  summary.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  struct rusage usage {};
  if (getrusage(RUSAGE_SELF, &usage) == 0) summary.peak_rss_bytes = static_cast<uint64_t>(usage.ru_maxrss) * 1024;
  return summary;
}

}  // namespace dsv4::convert
