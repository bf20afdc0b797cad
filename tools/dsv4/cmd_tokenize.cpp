// dsv4 tokenize: text -> token ids with the model's tokenizer (or the built-in one).
// A development tool; tests/python/test_tokenizer_vs_hf.py drives its --json mode.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>

#include "commands.h"
#include "gguf/gguf_file.h"
#include "text/tokenizer.h"

namespace dsv4::cli {
namespace {

struct TokenizeOptions {
  std::string model;
  std::string prompt;
  bool prompt_given = false;
  bool json_lines = false;
  bool show_pieces = false;
  bool time_encode = false;
};

Result<std::shared_ptr<const text::Tokenizer>> load_tokenizer(const std::string& model) {
  if (model.empty()) return text::Tokenizer::builtin();
  gguf::OpenOptions open;
  open.map_data = false;
  DSV4_ASSIGN_OR_RETURN(gguf::GgufFile file, gguf::GgufFile::open(model, open));
  DSV4_ASSIGN_OR_RETURN(text::Tokenizer tok, text::Tokenizer::from_gguf(file));
  return std::shared_ptr<const text::Tokenizer>(std::make_shared<text::Tokenizer>(std::move(tok)));
}

// One JSON string per input line -> {"ids": [...], "decoded": "..."} per output line.
int run_json_lines(const text::Tokenizer& tok, bool time_encode) {
  std::string line;
  size_t line_no = 0, bytes = 0, tokens = 0;
  double encode_seconds = 0;
  while (std::getline(std::cin, line)) {
    ++line_no;
    nlohmann::json in = nlohmann::json::parse(line, nullptr, false);
    if (in.is_discarded() || !in.is_string()) {
      fmt::print(stderr, "dsv4 tokenize: stdin line {}: expected a JSON string\n", line_no);
      return kExitFailure;
    }
    const std::string text = in.get<std::string>();
    const auto t0 = std::chrono::steady_clock::now();
    auto ids = tok.encode(text);
    encode_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!ids.is_ok()) {
      fmt::print(stderr, "dsv4 tokenize: stdin line {}: {}\n", line_no, ids.status().message());
      return kExitFailure;
    }
    bytes += text.size();
    tokens += ids->size();
    nlohmann::json out = {{"ids", *ids}, {"decoded", tok.decode(*ids)}};
    std::cout << out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
  }
  std::cout.flush();
  if (time_encode)
    fmt::print(stderr, "dsv4 tokenize: {} strings, {} bytes, {} tokens, encode {:.6f} s ({:.2f} MB/s, one thread)\n",
               line_no, bytes, tokens, encode_seconds, encode_seconds > 0 ? bytes / encode_seconds / 1e6 : 0.0);
  return kExitOk;
}

int run_tokenize(const TokenizeOptions& o) {
  auto tok = load_tokenizer(o.model);
  if (!tok.is_ok()) {
    fmt::print(stderr, "dsv4 tokenize: {}\n", tok.status().message());
    return kExitFailure;
  }
  if (o.json_lines) return run_json_lines(**tok, o.time_encode);
  std::string text = o.prompt;
  if (!o.prompt_given) text.assign(std::istreambuf_iterator<char>(std::cin), {});
  auto ids = (*tok)->encode(text);
  if (!ids.is_ok()) {
    fmt::print(stderr, "dsv4 tokenize: {}\n", ids.status().message());
    return kExitFailure;
  }
  for (size_t i = 0; i < ids->size(); ++i) {
    const text::TokenId id = (*ids)[i];
    if (o.show_pieces)
      fmt::print("{}\t{}\n", id, nlohmann::json((*tok)->token_text(id)).dump());
    else
      fmt::print("{}{}", i ? " " : "", id);
  }
  if (!o.show_pieces) fmt::print("\n");
  return kExitOk;
}

}  // namespace

void register_tokenize(CLI::App& app, CommandRunner& run) {
  auto o = std::make_shared<TokenizeOptions>();
  app.add_option("-m,--model", o->model, "GGUF model whose tokenizer to use (default: the built-in tokenizer)")
      ->check(CLI::ExistingFile);
  app.add_option("-p,--prompt", o->prompt, "text to tokenize (default: all of stdin)");
  app.add_flag("--json", o->json_lines,
               "read one JSON string per stdin line, write {\"ids\": [...], \"decoded\": \"...\"} per line");
  app.add_flag("--time", o->time_encode, "with --json: report the time spent encoding (on stderr)");
  app.add_flag("--pieces", o->show_pieces, "print one token per line: id and vocabulary string");
  run = [o, &app] {
    o->prompt_given = app.count("--prompt") > 0;
    if (o->json_lines && o->prompt_given) {
      fmt::print(stderr, "dsv4 tokenize: --json reads stdin; it cannot be combined with --prompt\n");
      return static_cast<int>(kExitUsage);
    }
    return run_tokenize(*o);
  };
}

}  // namespace dsv4::cli
