// dsv4 chat: an interactive conversation. Each line is a user message; the reply streams
// like `dsv4 run`'s. Commands: /think and /nothink switch thinking mode, /reset starts a
// new conversation, /quit (or end of input) leaves. Ctrl-C stops the reply being
// generated and returns to the prompt; at the prompt it says how to leave.
// The conversation is re-rendered each turn (earlier reasoning dropped, as the official
// encoder does); the cache is reused wherever the new prompt extends the old tokens.
#include <errno.h>
#include <poll.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <memory>

#include "commands.h"
#include "text_session.h"

namespace dsv4::cli {
namespace {

struct ChatCliOptions {
  SessionFlags session;
};

enum class LineResult { kLine, kEof, kInterrupted };

// Reads one line from stdin. Ctrl-C can arrive at any moment, also just before the read
// would block (where a plain read(2) would never see it), so the flag is checked before
// every wait and the wait is a short poll(2) rather than a blocking read.
LineResult read_line(std::string& line, InterruptFlag& interrupt) {
  line.clear();
  for (;;) {
    if (interrupt.take()) return LineResult::kInterrupted;
    pollfd in{STDIN_FILENO, POLLIN, 0};
    const int ready = ::poll(&in, 1, 100);
    if (ready == 0 || (ready < 0 && errno == EINTR)) continue;
    if (ready < 0) return LineResult::kEof;
    char c;
    const ssize_t n = ::read(STDIN_FILENO, &c, 1);
    if (n == 1) {
      if (c == '\n') return LineResult::kLine;
      line.push_back(c);
      continue;
    }
    if (n == 0) return line.empty() ? LineResult::kEof : LineResult::kLine;
    if (errno == EINTR) continue;
    return LineResult::kEof;
  }
}

int fail(const Status& s, int code = kExitFailure) {
  fmt::print(stderr, "dsv4 chat: {}\n", s.message());
  return code;
}

int run_chat(ChatCliOptions& o) {
  if (Status s = validate_session_flags(o.session); !s.is_ok()) return fail(s, kExitUsage);
  auto session = open_session(o.session, "dsv4 chat");
  if (!session.is_ok()) return fail(session.status());
  Session& s = *session;
  const bool tty_out = isatty(STDOUT_FILENO) != 0;

  std::vector<text::ChatMessage> history;
  auto start_conversation = [&] {
    history.clear();
    if (!o.session.system.empty()) history.push_back(text::ChatMessage::of("system", o.session.system));
    text::attach_request_tools(history, s.tools);
  };
  start_conversation();
  runtime::Generator gen(*s.model, *s.tokenizer, o.session.ctx);
  gen.set_graft(s.graft);
  InterruptFlag interrupt;

  fmt::print("dsv4 chat: {}{} ({} mode). /think, /nothink, /reset, /quit; Ctrl-C stops a reply.\n", s.model_path,
             s.builtin ? " (built-in tiny model, random weights: expect noise)" : "",
             s.chat.thinking == text::ThinkingMode::kThinking ? "thinking" : "chat");
  std::string line;
  for (;;) {
    fmt::print("> ");
    std::fflush(stdout);
    const LineResult got = read_line(line, interrupt);
    if (got == LineResult::kEof) {
      fmt::print("\n");
      return kExitOk;
    }
    if (got == LineResult::kInterrupted) {
      fmt::print("\n(type /quit to leave)\n");
      continue;
    }
    if (line.empty()) continue;
    if (line == "/quit" || line == "/exit") return kExitOk;
    if (line == "/reset") {
      start_conversation();
      gen.reset();
      fmt::print("(new conversation)\n");
      continue;
    }
    if (line == "/think" || line == "/nothink") {
      s.chat.thinking = line == "/think" ? text::ThinkingMode::kThinking : text::ThinkingMode::kChat;
      fmt::print("({} mode)\n", line == "/think" ? "thinking" : "chat");
      continue;
    }
    if (line[0] == '/') {
      fmt::print("unknown command {}; commands: /think, /nothink, /reset, /quit\n", line);
      continue;
    }

    history.push_back(text::ChatMessage::of("user", line));
    auto prompt = text::render_chat(history, s.chat);
    if (!prompt.is_ok()) {
      history.pop_back();
      fmt::print(stderr, "dsv4 chat: {}\n", prompt.status().message());
      continue;
    }
    auto ids = s.tokenizer->encode(*prompt);
    if (!ids.is_ok()) {
      history.pop_back();
      fmt::print(stderr, "dsv4 chat: {}\n", ids.status().message());
      continue;
    }
    ReplyPrinter printer(s.chat.thinking, s.tools, true, tty_out);
    interrupt.take();
    auto stats = gen.generate(*ids, s.generate, [&](std::string_view t) { printer.on_text(t); }, &interrupt.flag());
    printer.finish();
    interrupt.take();
    if (!stats.is_ok()) {
      history.pop_back();
      fmt::print(stderr, "dsv4 chat: {}\n", stats.status().message());
      continue;
    }
    const text::ParsedOutput& r = printer.result();
    text::ChatMessage reply = text::ChatMessage::of("assistant", r.content);
    reply.reasoning_content = r.reasoning;
    for (const auto& c : r.tool_calls) reply.tool_calls.push_back({"", c.name, c.arguments});
    history.push_back(std::move(reply));
    if (stats->finish == runtime::FinishReason::kCancelled) fmt::print("(stopped)\n");
    fmt::print(stderr, "{}\n", speed_line(*stats));
  }
}

}  // namespace

void register_chat(CLI::App& app, CommandRunner& run) {
  auto o = std::make_shared<ChatCliOptions>();
  add_session_flags(app, o->session);
  run = [o, &app] {
    o->session.seed_given = app.count("--seed") > 0;
    return run_chat(*o);
  };
}

}  // namespace dsv4::cli
