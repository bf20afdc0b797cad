// dsv4 graft make: a compressed-KV bank (kv_graft.h, docs/STEERING.md) from a prompt's own
// compressed rows. The prompt (text, tokenized as is, or token ids) is prefilled once;
// every compressed layer's N_l = T / ratio_l rows (and indexer keys on CSA layers) are
// written with footprint F = T. T must be a positive multiple of the largest compress
// ratio: other lengths are refused with the nearest valid ones, or cut down to the one
// below with --truncate. The bank holds compressed rows only, not the prompt's window.
#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>

#include "backend_choice.h"
#include "commands.h"
#include "gguf/gguf_file.h"
#include "model/model.h"
#include "text/tokenizer.h"

namespace dsv4::cli {
namespace {

struct GraftMakeOptions {
  std::string model;
  std::string prompt;  // text file
  std::string tokens;  // or a file of whitespace-separated ids
  std::string output;
  bool truncate = false;
  bool force = false;
  BackendFlags backend;
};

Result<std::vector<int32_t>> read_ids(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::errorf("{}: cannot open the token file", path);
  std::vector<int32_t> ids;
  std::string word;
  while (in >> word) {
    char* end = nullptr;
    const long long v = std::strtoll(word.c_str(), &end, 10);
    if (*end != '\0' || v < 0 || v > INT32_MAX)
      return Status::errorf("{}: token {} (\"{}\") is not a non-negative integer id", path, ids.size(), word);
    ids.push_back(static_cast<int32_t>(v));
  }
  return ids;
}

Result<std::vector<int32_t>> read_prompt(const GraftMakeOptions& o) {
  if (!o.tokens.empty()) return read_ids(o.tokens);
  std::ifstream in(o.prompt, std::ios::binary);
  if (!in) return Status::errorf("{}: cannot open the prompt file", o.prompt);
  std::stringstream ss;
  ss << in.rdbuf();
  gguf::OpenOptions header_only;
  header_only.map_data = false;
  DSV4_ASSIGN_OR_RETURN(gguf::GgufFile file, gguf::GgufFile::open(o.model, header_only));
  DSV4_ASSIGN_OR_RETURN(text::Tokenizer tok, text::Tokenizer::from_gguf(file));
  DSV4_ASSIGN_OR_RETURN(std::vector<text::TokenId> ids, tok.encode(ss.str()));
  return std::vector<int32_t>(ids.begin(), ids.end());
}

// T a positive multiple of the largest ratio R, or --truncate to the one below.
Status fit_length(std::vector<int32_t>& ids, int64_t R, bool truncate, const std::string& source) {
  const int64_t T = static_cast<int64_t>(ids.size());
  if (T > 0 && T % R == 0) return Status::ok();
  const int64_t below = T / R * R, above = below + R;
  if (truncate && below > 0) {
    fmt::print(stderr, "dsv4 graft: --truncate: keeping the first {} of the prompt's {} tokens\n", below, T);
    ids.resize(static_cast<size_t>(below));
    return Status::ok();
  }
  if (below == 0)
    return Status::errorf("{}: the prompt has {} tokens; a bank needs a positive multiple of the largest compress ratio "
                          "{}: at least {} tokens", source, T, R, R);
  return Status::errorf("{}: the prompt has {} tokens, not a multiple of the largest compress ratio {}: the nearest "
                        "valid lengths are {} and {} (--truncate keeps the first {})", source, T, R, below, above, below);
}

Status run_graft_make(const GraftMakeOptions& o) {
  const std::string source = o.tokens.empty() ? o.prompt : o.tokens;
  DSV4_ASSIGN_OR_RETURN(std::vector<int32_t> ids, read_prompt(o));
  DSV4_ASSIGN_OR_RETURN(ChosenBackend chosen, make_backend(o.backend, "dsv4 graft"));
  ModelOptions mo;
  mo.matmul = matmul_mode(o.backend, chosen);
  DSV4_ASSIGN_OR_RETURN(mo.device_memory, device_memory_bytes(o.backend));
  mo.cache = cache_options(chosen, 1, ids.size() + 1);
  DSV4_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, Model::load(o.model, *chosen.backend, mo));
  const ModelConfig& c = model->config();
  for (int32_t t : ids)
    if (static_cast<uint64_t>(t) >= c.vocab_size)
      return Status::errorf("{}: token {} is outside the vocabulary [0, {})", source, t, c.vocab_size);
  DSV4_TRY(fit_length(ids, model->plan().max_ratio(), o.truncate, source));
  if (ids.size() >= c.context_length)
    return Status::errorf("{}: the prompt's {} tokens leave nothing of the model's context of {}", source, ids.size(),
                          c.context_length);
  SequenceOptions so;
  so.max_context = ids.size() + 1;
  DSV4_ASSIGN_OR_RETURN(std::unique_ptr<Sequence> seq, model->new_sequence(so));
  DSV4_TRY(model->prefill(*seq, ids).status());
  DSV4_ASSIGN_OR_RETURN(KvGraft bank, model->extract_graft(*seq));
  DSV4_TRY(bank.write(o.output, o.force));
  uint64_t rows = 0;
  for (const KvGraftLayer& l : bank.layers) rows += l.kv.size() + l.keys.size();
  fmt::print("{}: {} layers, footprint {} tokens, {} bytes of rows\n", o.output, bank.layers.size(), bank.footprint,
             rows * sizeof(float));
  for (const KvGraftLayer& l : bank.layers)
    fmt::print("  layer {} (ratio {}): {} slots{}\n", l.block, c.ratio(l.block), l.slots,
               l.keys.empty() ? "" : " + indexer keys");
  return Status::ok();
}

}  // namespace

void register_graft(CLI::App& app, CommandRunner& run) {
  app.require_subcommand(1);
  auto o = std::make_shared<GraftMakeOptions>();
  CLI::App* make = app.add_subcommand("make", "Write a bank of a prompt's compressed rows (F = its token count)");
  make->add_option("-m,--model", o->model, "GGUF model file")->required()->check(CLI::ExistingFile);
  auto* prompt = make->add_option("--prompt", o->prompt, "text file, tokenized as is (no chat format added)")
                     ->check(CLI::ExistingFile);
  auto* tokens = make->add_option("--tokens", o->tokens, "or a file of whitespace-separated token ids")
                     ->check(CLI::ExistingFile)
                     ->excludes(prompt);
  prompt->excludes(tokens);
  make->add_option("-o,--output", o->output, "the bank to write (.gguf)")->required();
  make->add_flag("--truncate", o->truncate, "cut the prompt down to a multiple of the largest compress ratio");
  make->add_flag("--force", o->force, "replace the output file if it exists");
  add_backend_flags(*make, o->backend);
  make->add_option("-t,--threads", o->backend.threads, "CPU threads (default: all)");
  run = [o] {
    if (o->prompt.empty() == o->tokens.empty()) {
      fmt::print(stderr, "dsv4 graft make: give --prompt FILE or --tokens FILE\n");
      return static_cast<int>(kExitUsage);
    }
    const Status s = run_graft_make(*o);
    if (!s.is_ok()) {
      fmt::print(stderr, "dsv4 graft make: {}\n", s.message());
      return static_cast<int>(kExitFailure);
    }
    return static_cast<int>(kExitOk);
  };
}

}  // namespace dsv4::cli
