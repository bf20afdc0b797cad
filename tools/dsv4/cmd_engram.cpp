// dsv4 engram: V4.1's Engram front end as JSON (development tool): the hash constants of
// a deepseek41 file, a preset or given geometry, and optionally the table row ids of a
// token sequence. tests/python/test_engram_numpy.py checks the multipliers against NumPy.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "gguf/gguf_file.h"
#include "model/config.h"
#include "model/engram.h"
#include "synth/presets.h"

namespace dsv4::cli {
namespace {

struct EngramOptions {
  std::string file;
  std::string preset;
  std::vector<uint32_t> layers;
  uint64_t hash_vocab = 0;
  uint32_t compressed_vocab = 0;
  uint32_t ngram = 4;
  uint32_t heads = 8;
  std::vector<int32_t> tokens;
};

int fail(const Status& s, int code = kExitFailure) {
  fmt::print(stderr, "dsv4 engram: {}\n", s.message());
  return code;
}

int run_engram(const EngramOptions& o) {
  const int sources = !o.file.empty() + !o.preset.empty() + !o.layers.empty();
  if (sources != 1) return fail(Status::error("give exactly one of --model, --preset and --layers"), kExitUsage);
  std::optional<EngramHasher> hasher;
  EngramHashConstants constants;
  std::vector<uint32_t> layer_ids;
  if (!o.file.empty()) {
    auto file = gguf::GgufFile::open(o.file);
    if (!file) return fail(file.status());
    auto config = ModelConfig::from_gguf(*file);
    if (!config) return fail(config.status());
    auto h = EngramHasher::from_gguf(*file, *config);
    if (!h) return fail(h.status());
    constants = h->constants();
    layer_ids = config->engram->layers;
    hasher = std::move(*h);
  } else {
    EngramConfig e;
    if (!o.preset.empty()) {
      auto preset = find_preset(o.preset);
      if (!preset) return fail(preset.status(), kExitUsage);
      if (!preset->config.engram) return fail(Status::errorf("preset {} has no Engram layers", o.preset), kExitUsage);
      e = *preset->config.engram;
    } else {
      e.layers = o.layers;
      e.hash_vocab_size = o.hash_vocab;
      e.compressed_vocab_size = o.compressed_vocab;
      e.ngram = o.ngram;
      e.heads = o.heads;
    }
    auto k = compute_engram_hash_constants(e);
    if (!k) return fail(k.status(), kExitUsage);
    constants = std::move(*k);
    layer_ids = e.layers;
    if (!o.tokens.empty()) return fail(Status::error("--tokens needs --model (the token map is in the file)"), kExitUsage);
  }

  nlohmann::ordered_json out;
  out["layers"] = nlohmann::ordered_json::array();
  for (size_t l = 0; l < layer_ids.size(); ++l) {
    uint64_t rows = 0;
    for (uint64_t p : constants.primes[l]) rows += p;
    out["layers"].push_back({{"layer_id", layer_ids[l]},
                             {"multipliers", constants.multipliers[l]},
                             {"primes", constants.primes[l]},
                             {"offsets", constants.offsets[l]},
                             {"rows", rows}});
  }
  if (hasher && !o.tokens.empty()) {
    std::vector<uint32_t> rows(o.tokens.size() * hasher->rows_per_token());
    EngramHasher::History history = hasher->start();
    if (Status s = hasher->hash(history, o.tokens, {}, rows); !s) return fail(s, kExitUsage);
    nlohmann::ordered_json ids = nlohmann::ordered_json::array();
    for (size_t t = 0; t < o.tokens.size(); ++t)
      ids.push_back(std::vector<uint32_t>(rows.begin() + t * hasher->rows_per_token(),
                                          rows.begin() + (t + 1) * hasher->rows_per_token()));
    out["compressed_ids"] = nlohmann::ordered_json::array();
    for (int32_t t : o.tokens) out["compressed_ids"].push_back(hasher->token_map().at(static_cast<size_t>(t)));
    out["row_ids"] = ids;  // [token][layer * columns + column]
  }
  fmt::print("{}\n", out.dump());
  return kExitOk;
}

}  // namespace

void register_engram(CLI::App& app, CommandRunner& run) {
  auto o = std::make_shared<EngramOptions>();
  app.add_option("-m,--model", o->file, "a deepseek41 GGUF (its token map and constants)");
  app.add_option("--preset", o->preset, "a V4.1 preset: tiny41, small41, flash41");
  app.add_option("--layers", o->layers, "Engram layer ids (with --hash-vocab, --compressed-vocab)")->delimiter(',');
  app.add_option("--hash-vocab", o->hash_vocab, "engram_vocab_size: the primes start above it - 1");
  app.add_option("--compressed-vocab", o->compressed_vocab, "engram_compressed_vocab_size (sets the multiplier bound)");
  app.add_option("--ngram", o->ngram, "engram_max_ngram_size")->capture_default_str();
  app.add_option("--heads", o->heads, "engram_n_heads")->capture_default_str();
  app.add_option("--tokens", o->tokens, "token ids to hash (with --model), comma-separated")->delimiter(',');
  run = [o] { return run_engram(*o); };
}

}  // namespace dsv4::cli
