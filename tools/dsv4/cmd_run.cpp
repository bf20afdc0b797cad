// dsv4 run: one prompt, one streamed reply. The prompt is rendered with DeepSeek-V4's
// chat format (thinking on unless --nothink), the reply is shown as it is generated
// (reasoning between <think> lines, then the answer and any tool calls), and the speed
// of prompt processing and generation follows on stderr. --json prints one JSON object
// instead. Without -m it runs the built-in tiny model, whose random weights make noise.
#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <memory>

#include "commands.h"
#include "text_session.h"

namespace dsv4::cli {
namespace {

struct RunOptions {
  SessionFlags session;
  std::string prompt;
  bool raw = false;
  bool json = false;
};

int fail(const Status& s, int code = kExitFailure) {
  fmt::print(stderr, "dsv4 run: {}\n", s.message());
  return code;
}

int run_run(RunOptions& o) {
  if (Status s = validate_session_flags(o.session); !s.is_ok()) return fail(s, kExitUsage);
  auto session = open_session(o.session, "dsv4 run");
  if (!session.is_ok()) return fail(session.status());
  Session& s = *session;

  std::string prompt_text = o.prompt;
  if (!o.raw) {
    std::vector<text::ChatMessage> messages;
    if (!o.session.system.empty()) messages.push_back(text::ChatMessage::of("system", o.session.system));
    messages.push_back(text::ChatMessage::of("user", o.prompt));
    text::attach_request_tools(messages, s.tools);
    auto rendered = text::render_chat(messages, s.chat);
    if (!rendered.is_ok()) return fail(rendered.status(), kExitUsage);
    prompt_text = *rendered;
  }
  auto ids = s.tokenizer->encode(prompt_text);
  if (!ids.is_ok()) return fail(ids.status(), kExitUsage);

  const text::ThinkingMode mode = o.raw ? text::ThinkingMode::kChat : s.chat.thinking;
  ReplyPrinter printer(mode, s.tools, !o.json, isatty(STDOUT_FILENO) != 0);
  runtime::Generator gen(*s.model, *s.tokenizer, o.session.ctx);
  gen.set_graft(s.graft);
  InterruptFlag interrupt;
  auto stats = gen.generate(*ids, s.generate, [&](std::string_view t) { printer.on_text(t); }, &interrupt.flag());
  if (!stats.is_ok()) return fail(stats.status());
  printer.finish();
  const text::ParsedOutput& r = printer.result();

  if (o.json) {
    text::OrderedJson calls = text::OrderedJson::array();
    for (const auto& c : r.tool_calls) {
      text::OrderedJson call = {{"name", c.name}, {"arguments", c.arguments}};
      if (!c.error.empty()) call["error"] = c.error;
      calls.push_back(call);
    }
    text::OrderedJson out = {
        {"model", s.model_path},
        {"builtin_model", s.builtin},
        {"thinking", mode == text::ThinkingMode::kThinking},
        {"seed", s.generate.sampling.seed},
        {"reasoning", r.reasoning},
        {"content", r.content},
        {"tool_calls", calls},
        {"parse_errors", r.errors},
        {"finish_reason", runtime::finish_reason_name(stats->finish)},
        {"prompt_tokens", stats->prompt_tokens},
        {"generated_tokens", stats->generated_tokens},
        {"prompt_tokens_per_second", stats->prefill_tokens_per_second()},
        {"generation_tokens_per_second", stats->decode_tokens_per_second()},
    };
    if (s.generate.spec > 0)
      out["speculative"] = {{"max_drafts", s.generate.spec},
                            {"auto", s.spec_auto},
                            {"steps", stats->spec.steps},
                            {"drafted", stats->spec.drafted},
                            {"accepted", stats->spec.accepted},
                            {"acceptance", stats->spec.acceptance()},
                            {"tokens_per_step", stats->spec.tokens_per_step()}};
    fmt::print("{}\n", out.dump(2, ' ', false, text::OrderedJson::error_handler_t::replace));
  } else {
    // A reply cut by the token limit or a stop string is expected to end early.
    const bool cut = stats->finish != runtime::FinishReason::kEos && stats->finish != runtime::FinishReason::kStopToken;
    for (const std::string& e : r.errors)
      if (!(cut && e.starts_with("the output ended"))) fmt::print(stderr, "dsv4 run: note: {}\n", e);
    fmt::print(stderr, "{}\n", speed_line(*stats));
    if (s.builtin)
      fmt::print(stderr, "dsv4 run: this is the built-in tiny model with random weights; its output is noise "
                         "(use -m MODEL.gguf for a real one)\n");
  }
  return stats->finish == runtime::FinishReason::kCancelled ? kExitInterrupted : kExitOk;
}

}  // namespace

void register_run(CLI::App& app, CommandRunner& run) {
  auto o = std::make_shared<RunOptions>();
  app.add_option("-p,--prompt", o->prompt, "the user message")->required();
  add_session_flags(app, o->session);
  app.add_flag("--raw", o->raw, "send the prompt text as is, without the chat format");
  app.add_flag("--json", o->json, "print one JSON object (reasoning, content, tool calls, speed) instead of streaming");
  run = [o, &app] {
    o->session.seed_given = app.count("--seed") > 0;
    return run_run(*o);
  };
}

}  // namespace dsv4::cli
