// dsv4 chat-render: conversations -> prompt text with dsv4's chat encoder (text/chat.h),
// and the Jinja template dsv4 writes as tokenizer.chat_template (--template). A development
// tool: tests/python/test_chat_template.py compares the two on a corpus of conversations.
// Each stdin line is one JSON object with the template's variables (docs/TEXT.md):
//   {"messages": [...], "tools": [...], "response_format": ..., "thinking": true,
//    "reasoning_effort": "max", "effort_table": "v4", "drop_thinking": true}
// and each stdout line is {"text": "..."} or {"error": "..."}.
#include <fmt/format.h>

#include <iostream>
#include <string>

#include "commands.h"
#include "text/chat.h"
#include "text/chat_template.h"

namespace dsv4::cli {
namespace {

using text::OrderedJson;

// The request-level response_format goes where attach_request_tools puts tools: on message 0
// when it is a system or developer message, else on a new empty system message.
void attach_request_format(std::vector<text::ChatMessage>& messages, const OrderedJson& format) {
  if (format.is_null()) return;
  if (messages.empty() || (messages[0].role != "system" && messages[0].role != "developer")) {
    text::ChatMessage sys;
    sys.role = "system";
    sys.content = "";
    messages.insert(messages.begin(), std::move(sys));
  }
  messages[0].response_format = format;
}

Result<std::string> render_request(const OrderedJson& req) {
  if (!req.is_object()) return Status::error("chat-render: each line must be a JSON object");
  if (!req.contains("messages")) return Status::error("chat-render: no \"messages\"");
  auto flag = [&](const char* key, bool fallback) -> Result<bool> {
    if (!req.contains(key) || req[key].is_null()) return fallback;
    if (!req[key].is_boolean()) return Status::errorf("chat-render: \"{}\" must be true or false", key);
    return req[key].get<bool>();
  };
  auto text = [&](const char* key, std::string fallback) -> Result<std::string> {
    if (!req.contains(key) || req[key].is_null()) return fallback;
    if (!req[key].is_string()) return Status::errorf("chat-render: \"{}\" must be a string", key);
    return req[key].get<std::string>();
  };
  text::ChatOptions opts;
  DSV4_ASSIGN_OR_RETURN(bool enable_thinking, flag("enable_thinking", true));
  DSV4_ASSIGN_OR_RETURN(bool thinking, flag("thinking", enable_thinking));
  opts.thinking = thinking ? text::ThinkingMode::kThinking : text::ThinkingMode::kChat;
  DSV4_ASSIGN_OR_RETURN(opts.drop_thinking, flag("drop_thinking", true));
  DSV4_ASSIGN_OR_RETURN(opts.reasoning_effort, text("reasoning_effort", ""));
  DSV4_ASSIGN_OR_RETURN(std::string table, text("effort_table", "v4"));
  if (table != "v4" && table != "0731")
    return Status::errorf("chat: effort_table '{}' is not v4 or 0731", table);
  opts.effort_table = table == "0731" ? text::EffortTable::kV4_0731 : text::EffortTable::kV4;
  DSV4_ASSIGN_OR_RETURN(bool generation_prompt, flag("add_generation_prompt", true));
  if (!generation_prompt)
    return Status::error("chat-render: the encoder always writes the generation prompt (add_generation_prompt false)");

  DSV4_ASSIGN_OR_RETURN(std::vector<text::ChatMessage> messages, text::chat_messages_from_json(req["messages"]));
  if (req.contains("tools")) text::attach_request_tools(messages, req["tools"]);
  if (req.contains("response_format")) attach_request_format(messages, req["response_format"]);
  return text::render_chat(messages, opts);
}

int run_chat_render(bool print_template) {
  if (print_template) {
    std::cout << text::chat_template_jinja();
    return kExitOk;
  }
  std::string line;
  size_t line_no = 0;
  while (std::getline(std::cin, line)) {
    ++line_no;
    OrderedJson req = OrderedJson::parse(line, nullptr, /*allow_exceptions=*/false);
    if (req.is_discarded()) {
      fmt::print(stderr, "dsv4 chat-render: stdin line {}: not JSON\n", line_no);
      return kExitFailure;
    }
    auto rendered = render_request(req);
    OrderedJson out = rendered.is_ok() ? OrderedJson{{"text", *rendered}}
                                       : OrderedJson{{"error", rendered.status().message()}};
    std::cout << out.dump(-1, ' ', false, OrderedJson::error_handler_t::replace) << '\n';
  }
  std::cout.flush();
  return kExitOk;
}

}  // namespace

void register_chat_render(CLI::App& app, CommandRunner& run) {
  auto print_template = std::make_shared<bool>(false);
  app.add_flag("--template", *print_template,
               "print the Jinja chat template dsv4 writes as tokenizer.chat_template, and exit");
  run = [print_template] { return run_chat_render(*print_template); };
}

}  // namespace dsv4::cli
