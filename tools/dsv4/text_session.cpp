#include "text_session.h"

#include <fmt/format.h>
#include <unistd.h>

#include <csignal>
#include <fstream>
#include <random>
#include <sstream>

#include "gguf/gguf_file.h"
#include "synth/builtin_model.h"

namespace dsv4::cli {
namespace {

std::atomic<bool> g_interrupted{false};
void on_sigint(int) { g_interrupted.store(true); }

Result<std::pair<int32_t, float>> parse_bias(const std::string& s) {
  const size_t eq = s.find('=');
  try {
    if (eq == std::string::npos) throw std::invalid_argument("no =");
    size_t used_id = 0, used_bias = 0;
    const long id = std::stol(s.substr(0, eq), &used_id);
    const float bias = std::stof(s.substr(eq + 1), &used_bias);
    if (used_id != eq || used_bias != s.size() - eq - 1 || id < 0 || id > INT32_MAX) throw std::invalid_argument("junk");
    return std::pair{static_cast<int32_t>(id), bias};
  } catch (const std::exception&) {
    return Status::errorf("--logit-bias '{}': expected TOKEN_ID=BIAS, e.g. 128821=-100 or 42=-inf", s);
  }
}

// --spec: "auto" (-1) or a draft count 0..4.
Result<int> parse_spec(const std::string& s) {
  if (s == "auto") return -1;
  if (s.size() == 1 && s[0] >= '0' && s[0] <= '4') return s[0] - '0';
  return Status::errorf("--spec '{}': expected auto or a draft count 0..4", s);
}

}  // namespace

void add_session_flags(CLI::App& app, SessionFlags& f) {
  app.add_option("-m,--model", f.model, "GGUF model file (default: the built-in tiny model, random weights)")
      ->check(CLI::ExistingFile);
  app.add_option("--mtp", f.mtp, "MTP sidecar of a trunk-only model (default: mtp-*.gguf found next to it)");
  app.add_option("-t,--threads", f.backend.threads, "CPU threads (default: all)")->check(CLI::NonNegativeNumber);
  app.add_option("--ctx", f.ctx, "context length in tokens (default: the model's, at most 16384)");
  add_backend_flags(app, f.backend);
  auto* think = app.add_flag("--think", f.think, "thinking mode: reason first, then answer (default)");
  app.add_flag("--nothink", f.nothink, "chat mode: answer directly")->excludes(think);
  app.add_option("--effort", f.effort, "reasoning effort: high or max (V4); low, high or max (0731)");
  app.add_option("--effort-table", f.effort_table, "which checkpoint's effort prompts: v4 or 0731")
      ->check(CLI::IsMember({"v4", "0731"}));
  app.add_option("--system", f.system, "system prompt");
  app.add_option("--tools", f.tools_file, "JSON file with an OpenAI \"tools\" array the model may call")
      ->check(CLI::ExistingFile);
  app.add_option("--temp,--temperature", f.temperature, "sampling temperature, 0 = greedy (default 1.0)");
  app.add_option("--top-k", f.top_k, "keep the k most likely tokens, 0 = off (default 0)");
  app.add_option("--top-p", f.top_p, "nucleus sampling mass in (0, 1] (default 1.0)");
  app.add_option("--min-p", f.min_p, "drop tokens below min-p times the top probability (default 0)");
  app.add_option("--repeat-penalty", f.repeat_penalty, "repetition penalty, 1 = off (default 1.0)");
  app.add_option("--presence-penalty", f.presence_penalty, "subtracted from the logit of every seen token");
  app.add_option("--frequency-penalty", f.frequency_penalty, "subtracted per occurrence of a seen token");
  app.add_option("--logit-bias", f.logit_bias, "TOKEN_ID=BIAS added to that token's logit (repeatable)")->allow_extra_args(false);
  app.add_option("--stop", f.stop, "stop when the output contains this text (repeatable)")->allow_extra_args(false);
  app.add_option("--stop-token", f.stop_token, "stop at this token id, besides EOS (repeatable)")->allow_extra_args(false);
  app.add_option("-n,--max-tokens", f.max_tokens, "most tokens to generate per reply (default 2048)");
  app.add_option("--spec", f.spec,
                 "MTP speculative decoding: at most K draft tokens per step, 1..4, 0 = off; auto (default): 3 where "
                 "it pays (dsv4 run, greedy, a CUDA device, a model with an MTP block), else off");
  app.add_option("-s,--seed", f.seed, "random seed; the same seed gives the same output (default: random)");
  add_intervention_flags(app, f.interventions);
}

Status validate_session_flags(const SessionFlags& f) {
  runtime::SamplingParams p;
  p.temperature = f.temperature;
  p.top_k = f.top_k;
  p.top_p = f.top_p;
  p.min_p = f.min_p;
  p.repetition_penalty = f.repeat_penalty;
  p.presence_penalty = f.presence_penalty;
  p.frequency_penalty = f.frequency_penalty;
  if (Status s = p.validate(SIZE_MAX); !s.is_ok()) {
    // Name the command-line flag rather than the field.
    std::string m = s.message();
    for (auto [field, flag] : {std::pair{"temperature", "--temp"}, {"top_k", "--top-k"}, {"top_p", "--top-p"},
                               {"min_p", "--min-p"}, {"repetition_penalty", "--repeat-penalty"},
                               {"presence_penalty", "--presence-penalty"}, {"frequency_penalty", "--frequency-penalty"}})
      if (size_t at = m.find(std::string(field) + " ="); at != std::string::npos) m.replace(at, std::string(field).size(), flag);
    return Status::error(m);
  }
  for (const std::string& b : f.logit_bias) DSV4_TRY(parse_bias(b).status());
  DSV4_TRY(parse_spec(f.spec).status());
  if (f.max_tokens < 0) return Status::errorf("--max-tokens {} must be >= 0", f.max_tokens);
  for (const std::string& s : f.stop)
    if (s.empty()) return Status::error("--stop: an empty stop string would stop at once");
  for (int32_t t : f.stop_token)
    if (t < 0) return Status::errorf("--stop-token {} is not a token id", t);
  DSV4_TRY(validate_intervention_flags(f.interventions));
  DSV4_TRY(device_memory_bytes(f.backend).status());
  if (!f.effort.empty()) {
    const bool ok = f.effort_table == "v4" ? (f.effort == "high" || f.effort == "max")
                                           : (f.effort == "low" || f.effort == "high" || f.effort == "max");
    if (!ok)
      return Status::errorf("--effort {}: expected {} for --effort-table {}", f.effort,
                            f.effort_table == "v4" ? "high or max" : "low, high or max", f.effort_table);
  }
  return Status::ok();
}

int resolve_spec(const Session& s, bool one_reply) {
  const runtime::SamplingParams& p = s.generate.sampling;
  const bool plain_greedy = p.temperature == 0.0f && p.repetition_penalty == 1.0f && p.presence_penalty == 0.0f &&
                            p.frequency_penalty == 0.0f && p.logit_bias.empty();
  return one_reply && s.backend.device && s.model && s.model->has_mtp() && plain_greedy && !s.graft ? 3 : 0;
}

Result<Session> open_session(const SessionFlags& f, const char* command) {
  Session s;
  s.model_path = f.model;
  if (s.model_path.empty()) {
    DSV4_ASSIGN_OR_RETURN(std::filesystem::path p, ensure_builtin_model([&](std::string_view line) {
                            fmt::print(stderr, "{}: {}\n", command, line);
                          }));
    s.model_path = p.string();
    s.builtin = true;
  }
  {
    gguf::OpenOptions header_only;
    header_only.map_data = false;
    DSV4_ASSIGN_OR_RETURN(gguf::GgufFile file, gguf::GgufFile::open(s.model_path, header_only));
    DSV4_ASSIGN_OR_RETURN(text::Tokenizer tok, text::Tokenizer::from_gguf(file));
    s.tokenizer = std::make_unique<text::Tokenizer>(std::move(tok));
  }
  DSV4_ASSIGN_OR_RETURN(s.backend, make_backend(f.backend, command));
  ModelOptions mo;
  mo.matmul = matmul_mode(f.backend, s.backend);
  DSV4_ASSIGN_OR_RETURN(mo.device_memory, device_memory_bytes(f.backend));
  // The generator keeps one sequence (two while it replaces one); the --ctx default is its.
  mo.cache = cache_options(s.backend, 2, f.ctx ? f.ctx : 16384);
  mo.mtp_path = f.mtp;
  DSV4_ASSIGN_OR_RETURN(s.model, Model::load(s.model_path, *s.backend.backend, mo));
  if (s.backend.device || s.backend.sized_as_device) fmt::print(stderr, "{}: device memory: {}\n", command, s.model->memory_plan().describe());
  const size_t vocab = s.model->config().vocab_size;
  if (s.tokenizer->vocab_size() > vocab)
    return Status::errorf("{}: the tokenizer has {} tokens but the model's vocabulary is {}", s.model_path,
                          s.tokenizer->vocab_size(), vocab);
  if (f.ctx > s.model->config().context_length)
    return Status::errorf("--ctx {} exceeds the model's context length {}", f.ctx, s.model->config().context_length);
  DSV4_ASSIGN_OR_RETURN(s.graft, apply_interventions(f.interventions, *s.model));

  if (!f.tools_file.empty()) {
    std::ifstream in(f.tools_file);
    std::stringstream ss;
    ss << in.rdbuf();
    s.tools = text::OrderedJson::parse(ss.str(), nullptr, false);
    if (s.tools.is_discarded() || !s.tools.is_array())
      return Status::errorf("--tools {}: expected a JSON array of OpenAI tool objects", f.tools_file);
    for (const auto& t : s.tools)
      if (!t.is_object() || !t.contains("function"))
        return Status::errorf("--tools {}: every entry needs a \"function\" object", f.tools_file);
  }
  s.chat.thinking = f.nothink ? text::ThinkingMode::kChat : text::ThinkingMode::kThinking;
  s.chat.reasoning_effort = f.effort;
  s.chat.effort_table = f.effort_table == "0731" ? text::EffortTable::kV4_0731 : text::EffortTable::kV4;

  runtime::SamplingParams& p = s.generate.sampling;
  p.temperature = f.temperature;
  p.top_k = f.top_k;
  p.top_p = f.top_p;
  p.min_p = f.min_p;
  p.repetition_penalty = f.repeat_penalty;
  p.presence_penalty = f.presence_penalty;
  p.frequency_penalty = f.frequency_penalty;
  p.seed = f.seed_given ? f.seed : (static_cast<uint64_t>(std::random_device{}()) << 32 | std::random_device{}());
  for (const std::string& b : f.logit_bias) {
    DSV4_ASSIGN_OR_RETURN(auto pair, parse_bias(b));
    p.logit_bias.push_back(pair);
  }
  DSV4_TRY(p.validate(vocab));
  for (int32_t t : f.stop_token)
    if (static_cast<size_t>(t) >= vocab)
      return Status::errorf("--stop-token {} is outside the vocabulary [0, {})", t, vocab);
  s.generate.max_tokens = f.max_tokens;
  DSV4_ASSIGN_OR_RETURN(const int spec, parse_spec(f.spec));
  s.spec_auto = spec < 0;
  s.generate.spec = spec >= 0 ? spec : resolve_spec(s, std::string_view(command) == "dsv4 run");
  s.generate.stop_strings = f.stop;
  s.generate.stop_tokens = f.stop_token;
  return s;
}

ReplyPrinter::ReplyPrinter(text::ThinkingMode mode, const text::OrderedJson& tools, bool print, bool color)
    : parser_(mode, tools), print_(print), color_(color) {}

void ReplyPrinter::show(const text::OutputDelta& d) {
  if (!print_) return;
  auto out = [&](std::string_view s) {
    if (s.empty()) return;
    std::fwrite(s.data(), 1, s.size(), stdout);
    at_line_start_ = s.back() == '\n';
  };
  if (!d.reasoning.empty()) {
    if (!reasoning_shown_) {
      out(color_ ? "\x1b[2m<think>\n" : "<think>\n");
      reasoning_shown_ = in_reasoning_ = true;
    }
    out(d.reasoning);
  }
  if (!d.content.empty() || !d.tool_calls.empty()) {
    if (in_reasoning_) {
      if (!at_line_start_) out("\n");
      out(color_ ? "</think>\x1b[0m\n" : "</think>\n");
      in_reasoning_ = false;
    }
    out(d.content);
    for (const auto& c : d.tool_calls) {
      if (!at_line_start_) out("\n");
      out(fmt::format("[tool call] {} {}{}\n", c.name, c.arguments, c.error.empty() ? "" : "  (invalid: " + c.error + ")"));
    }
  }
  std::fflush(stdout);
}

void ReplyPrinter::on_text(std::string_view piece) { show(parser_.push(piece)); }

void ReplyPrinter::finish() {
  show(parser_.finish());
  if (!print_) return;
  if (in_reasoning_) {
    if (!at_line_start_) std::fputs("\n", stdout);
    std::fputs(color_ ? "</think>\x1b[0m\n" : "</think>\n", stdout);
    at_line_start_ = true;
    in_reasoning_ = false;
  }
  if (!at_line_start_) std::fputs("\n", stdout);
  std::fflush(stdout);
}

std::string speed_line(const runtime::GenerateStats& s) {
  return fmt::format("prompt: {} tokens ({} computed), {:.1f} tokens/s | generation: {} tokens, {:.1f} tokens/s ({})",
                     s.prompt_tokens, s.prefilled_tokens, s.prefill_tokens_per_second(), s.generated_tokens,
                     s.decode_tokens_per_second(), runtime::finish_reason_name(s.finish)) +
         (s.spec.steps ? fmt::format(" | speculative: {} of {} drafts accepted ({:.0f}%), {:.2f} tokens/step",
                                     s.spec.accepted, s.spec.drafted, 100 * s.spec.acceptance(),
                                     s.spec.tokens_per_step())
                       : std::string());
}

InterruptFlag::InterruptFlag() {
  g_interrupted.store(false);
  struct sigaction sa {};
  sa.sa_handler = on_sigint;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: a blocked read returns EINTR
  sigaction(SIGINT, &sa, nullptr);
}

InterruptFlag::~InterruptFlag() { std::signal(SIGINT, SIG_DFL); }

const std::atomic<bool>& InterruptFlag::flag() const { return g_interrupted; }

bool InterruptFlag::take() { return g_interrupted.exchange(false); }

}  // namespace dsv4::cli
