// What `dsv4 run` and `dsv4 chat` share: model and sampling flags, loading a model (or
// the built-in one) with its tokenizer, and printing a reply as it streams (reasoning set
// apart from the answer, tool calls listed, speed on stderr).
#pragma once

#include <CLI/CLI.hpp>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "backend_choice.h"
#include "interventions.h"
#include "model/model.h"
#include "runtime/generator.h"
#include "text/chat.h"
#include "text/output_parser.h"
#include "text/tokenizer.h"

namespace dsv4::cli {

struct SessionFlags {
  std::string model;  // empty: the built-in model
  std::string mtp;    // --mtp FILE: the MTP sidecar of a trunk-only model
  BackendFlags backend;  // --backend, -t, --fast, --exact
  uint64_t ctx = 0;
  // Sampling (defaults: DeepSeek-V4's model card).
  float temperature = 1.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  float repeat_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  std::vector<std::string> logit_bias;  // "ID=BIAS"
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token;
  int64_t max_tokens = 2048;
  // --spec auto|K: MTP speculative decoding, at most K (1..4) drafts per step, 0 off; auto
  // (the default) resolves in open_session (resolve_spec).
  std::string spec = "auto";
  uint64_t seed = 0;
  bool seed_given = false;
  // Chat format.
  bool think = false, nothink = false;
  std::string effort;
  std::string effort_table = "v4";
  std::string system;
  std::string tools_file;
  InterventionFlags interventions;  // --glp, --glp-alpha, --glp-layers, --kv-graft
};

void add_session_flags(CLI::App& app, SessionFlags& f);

// Checks the flags that CLI11 cannot (ranges, ID=BIAS syntax, --think with --nothink);
// the message names the flag.
Status validate_session_flags(const SessionFlags& f);

struct Session {
  ChosenBackend backend;  // declared first: outlives the model
  std::unique_ptr<Model> model;
  std::unique_ptr<text::Tokenizer> tokenizer;
  std::string model_path;
  bool builtin = false;
  text::OrderedJson tools = text::OrderedJson::array();
  text::ChatOptions chat;
  runtime::GenerateOptions generate;
  std::shared_ptr<const KvGraft> graft;  // --kv-graft: for the generator (set_graft)
  bool spec_auto = false;  // --spec auto: generate.spec is resolve_spec's choice
};

// What --spec auto means for a session: 3 drafts where speculation pays and is exact, off
// elsewhere. It pays for one reply (dsv4 run: chat would prefill every turn again) of plain
// greedy decoding (the verify path brings no logits back) on a device (on the CPU a verify
// row costs what a step does), with a model that has an MTP block and no KV graft; adaptive k
// falls back to plain steps where drafts keep failing (docs/CLI.md, docs/PERFORMANCE.md).
int resolve_spec(const Session& s, bool one_reply);

// Loads the model (the built-in one when -m is absent, writing it on first use) and its
// tokenizer, and turns the flags into chat and generation options. `command` prefixes
// log lines ("dsv4 run").
Result<Session> open_session(const SessionFlags& f, const char* command);

// Prints a reply as it streams: reasoning between "<think>" and "</think>" lines (dim on a
// terminal), then the answer, then tool calls; collects the parsed result.
class ReplyPrinter {
 public:
  ReplyPrinter(text::ThinkingMode mode, const text::OrderedJson& tools, bool print, bool color);
  void on_text(std::string_view piece);
  void finish();
  const text::ParsedOutput& result() const { return parser_.result(); }

 private:
  void show(const text::OutputDelta& d);
  text::OutputParser parser_;
  bool print_, color_;
  bool in_reasoning_ = false, reasoning_shown_ = false;
  bool at_line_start_ = true;
};

// "prompt: 12 tokens, 340.1 tokens/s | generation: 30 tokens, 25.3 tokens/s (eos)"
std::string speed_line(const runtime::GenerateStats& s);

// SIGINT sets the flag instead of killing the process (while installed).
class InterruptFlag {
 public:
  InterruptFlag();
  ~InterruptFlag();
  const std::atomic<bool>& flag() const;
  bool take();  // true once per interrupt
};

}  // namespace dsv4::cli
