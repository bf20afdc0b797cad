#include "text/chat.h"

#include <algorithm>
#include <map>

namespace dsv4::text {
namespace {

constexpr std::string_view kEffortAbsoluteMaximum =
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n";

constexpr std::string_view kEffortBeyondMaximum =
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: "
    "exhaustively decompose the problem into its most fundamental components, trace every causal "
    "chain to its root, and resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles "
    "and are certain that no assumption remains unchecked and no error remains undiscovered.\n\n";

constexpr std::string_view kToolsTemplateHead =
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools "
    "by writing a \"<｜DSML｜tool_calls>\" block like the following:\n\n"
    "<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME\">\n"
    "<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME2\">\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types "
    "(numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning "
    "inside <think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n";
constexpr std::string_view kToolsTemplateTail =
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n";

constexpr std::string_view kResponseFormatHead =
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n";

const std::map<std::string, std::string, std::less<>> kTaskTokens = {
    {"action", "<｜action｜>"}, {"query", "<｜query｜>"},   {"authority", "<｜authority｜>"},
    {"domain", "<｜domain｜>"}, {"title", "<｜title｜>"},   {"read_url", "<｜read_url｜>"},
};

// A message after tool results have been merged into user turns.
struct Block {
  bool is_tool_result = false;
  std::string text;
  std::string tool_use_id;
  bool null_text = false;  // a user message with null content: an error once rendered
};
struct Turn {
  const ChatMessage* source;   // role and fields other than content for non-user turns
  std::string role;
  std::vector<Block> blocks;   // user turns
  bool drop_reasoning = false;
  const std::optional<std::string>& task() const { return task_override ? *task_override : source->task; }
  std::optional<std::optional<std::string>> task_override;  // merged user turns own their task
};

std::string content_or(const std::optional<std::string>& c, std::string_view fallback) {
  return c ? *c : std::string(fallback);
}

bool has_tools(const ChatMessage& m) { return m.tools.is_array() && !m.tools.empty(); }
bool has_response_format(const OrderedJson& rf) {
  return !(rf.is_null() || ((rf.is_object() || rf.is_array() || rf.is_string()) && rf.empty()) ||
           (rf.is_boolean() && !rf.get<bool>()));
}

// Tool messages join the previous user turn (or start one); a user message joins a
// previous user turn that has no task.
std::vector<Turn> merge_turns(std::span<const ChatMessage> messages) {
  std::vector<Turn> turns;
  for (const ChatMessage& m : messages) {
    if (m.role == "tool") {
      Block b{true, content_or(m.content, "None"), m.tool_call_id, false};
      if (!turns.empty() && turns.back().role == "user") {
        turns.back().blocks.push_back(std::move(b));
      } else {
        // A turn opened by a tool result has no task, whatever the tool message says.
        turns.push_back(Turn{&m, "user", {std::move(b)}, false, std::optional<std::string>{}});
      }
    } else if (m.role == "user") {
      Block b{false, content_or(m.content, ""), {}, !m.content};
      if (!turns.empty() && turns.back().role == "user" && !turns.back().task()) {
        turns.back().blocks.push_back(std::move(b));
      } else {
        turns.push_back(Turn{&m, "user", {std::move(b)}, false, std::nullopt});
      }
    } else {
      turns.push_back(Turn{&m, m.role, {}, false, std::nullopt});
    }
  }
  return turns;
}

// Tool results inside each user turn follow the call order of the latest assistant turn
// with tool calls (unknown ids count as position 0); text blocks keep their slots.
void sort_tool_results(std::vector<Turn>& turns) {
  std::map<std::string, size_t> order;
  for (Turn& t : turns) {
    if (t.role == "assistant" && !t.source->tool_calls.empty()) {
      order.clear();
      for (size_t i = 0; i < t.source->tool_calls.size(); ++i)
        if (!t.source->tool_calls[i].id.empty()) order.emplace(t.source->tool_calls[i].id, i);
    } else if (t.role == "user") {
      std::vector<Block> results;
      for (const Block& b : t.blocks)
        if (b.is_tool_result) results.push_back(b);
      if (results.size() < 2 || order.empty()) continue;
      auto pos = [&](const Block& b) {
        auto it = order.find(b.tool_use_id);
        return it == order.end() ? size_t{0} : it->second;
      };
      std::stable_sort(results.begin(), results.end(),
                       [&](const Block& a, const Block& b) { return pos(a) < pos(b); });
      size_t k = 0;
      for (Block& b : t.blocks)
        if (b.is_tool_result) b = results[k++];
    }
  }
}

int last_user_index(const std::vector<Turn>& turns) {
  for (int i = static_cast<int>(turns.size()) - 1; i >= 0; --i)
    if (turns[i].role == "user" || turns[i].role == "developer") return i;
  return -1;
}

// Before the last user/developer turn: assistant reasoning is dropped and developer turns
// disappear.
std::vector<Turn> drop_thinking(const std::vector<Turn>& turns) {
  const int last_user = last_user_index(turns);
  std::vector<Turn> out;
  for (int i = 0; i < static_cast<int>(turns.size()); ++i) {
    const Turn& t = turns[i];
    const bool keep_role = t.role == "user" || t.role == "system" || t.role == "latest_reminder";
    if (keep_role || i >= last_user) {
      out.push_back(t);
    } else if (t.role == "assistant") {
      out.push_back(t);
      out.back().drop_reasoning = true;
    }
  }
  return out;
}

Result<std::string> tool_call_parameters(const ToolCall& call) {
  OrderedJson args = OrderedJson::parse(call.arguments, nullptr, /*allow_exceptions=*/false);
  std::string out;
  auto param = [&](std::string_view key, bool is_string, std::string_view value) {
    if (!out.empty()) out += "\n";
    out += fmt::format("<｜DSML｜parameter name=\"{}\" string=\"{}\">{}</｜DSML｜parameter>", key,
                       is_string ? "true" : "false", value);
  };
  if (args.is_discarded()) {
    // Not JSON: the reference keeps the raw text as one string parameter.
    param("arguments", true, call.arguments);
    return out;
  }
  if (!args.is_object())
    return Status::errorf("chat: tool call '{}': arguments {} are not a JSON object", call.name, call.arguments);
  for (const auto& [key, value] : args.items()) {
    if (value.is_string()) param(key, true, value.get_ref<const std::string&>());
    else param(key, false, python_json_dumps(value));
  }
  return out;
}

Result<std::string> render_tool_calls(const std::vector<ToolCall>& calls) {
  std::string invokes;
  for (const ToolCall& call : calls) {
    DSV4_ASSIGN_OR_RETURN(std::string params, tool_call_parameters(call));
    if (!invokes.empty()) invokes += "\n";
    invokes += fmt::format("<｜DSML｜invoke name=\"{}\">\n{}\n</｜DSML｜invoke>", call.name, params);
  }
  return "\n\n<｜DSML｜tool_calls>\n" + invokes + "\n</｜DSML｜tool_calls>";
}

Result<std::string> tools_and_format(const ChatMessage& m) {
  std::string out;
  if (has_tools(m)) {
    DSV4_ASSIGN_OR_RETURN(std::string block, render_tools_block(m.tools));
    out += "\n\n" + block;
  }
  if (has_response_format(m.response_format))
    out += "\n\n" + std::string(kResponseFormatHead) + python_json_dumps(m.response_format);
  return out;
}

Result<std::string_view> effort_prefix(const ChatOptions& opts) {
  const std::string& e = opts.reasoning_effort;
  if (opts.effort_table == EffortTable::kV4) {
    if (e.empty() || e == "high") return std::string_view{};
    if (e == "max") return kEffortAbsoluteMaximum;
    return Status::errorf("chat: reasoning effort '{}' is not one of high, max (DeepSeek-V4)", e);
  }
  if (e.empty() || e == "low") return std::string_view{};
  if (e == "high") return kEffortAbsoluteMaximum;
  if (e == "max") return kEffortBeyondMaximum;
  return Status::errorf("chat: reasoning effort '{}' is not one of low, high, max (DeepSeek-V4-0731)", e);
}

Result<std::string> render_turn(size_t index, const std::vector<Turn>& turns, const ChatOptions& opts,
                                bool drop, std::string_view effort_text) {
  const Turn& t = turns[index];
  const ChatMessage& m = *t.source;
  const bool thinking = opts.thinking == ThinkingMode::kThinking;
  const int last_user = last_user_index(turns);
  std::string out;
  if (index == 0 && thinking) out += effort_text;

  if (t.role == "system") {
    out += content_or(m.content, "");
    DSV4_ASSIGN_OR_RETURN(std::string extra, tools_and_format(m));
    out += extra;
  } else if (t.role == "developer") {
    if (!m.content || m.content->empty()) return Status::error("chat: a developer message needs non-empty content");
    out += std::string(kUserText) + *m.content;
    DSV4_ASSIGN_OR_RETURN(std::string extra, tools_and_format(m));
    out += extra;
  } else if (t.role == "user") {
    out += kUserText;
    for (size_t i = 0; i < t.blocks.size(); ++i) {
      if (i) out += "\n\n";
      const Block& b = t.blocks[i];
      if (b.null_text) return Status::error("chat: a user message has null content");
      out += b.is_tool_result ? "<tool_result>" + b.text + "</tool_result>" : b.text;
    }
  } else if (t.role == "latest_reminder") {
    out += std::string(kLatestReminderText) + content_or(m.content, "None");
  } else if (t.role == "assistant") {
    std::string calls;
    if (m.raw_tool_calls) {
      calls = *m.raw_tool_calls;
    } else if (!m.tool_calls.empty()) {
      DSV4_ASSIGN_OR_RETURN(calls, render_tool_calls(m.tool_calls));
    }
    const bool prev_has_task = index > 0 && turns[index - 1].task().has_value();
    std::string reasoning;
    if (thinking && !prev_has_task && (!drop || static_cast<int>(index) > last_user))
      reasoning = (t.drop_reasoning ? "" : content_or(m.reasoning_content, "")) + std::string(kThinkEndText);
    out += reasoning + content_or(m.content, "") + calls;
    if (!m.wo_eos) out += kEosText;
  } else {
    return Status::errorf("chat: unknown role '{}' (expected system, user, assistant, tool, "
                          "latest_reminder or developer)", t.role);
  }

  // The transition into the next assistant turn (or the generation prompt at the end).
  if (index + 1 < turns.size() && turns[index + 1].role != "assistant" &&
      turns[index + 1].role != "latest_reminder")
    return out;
  if (const auto& task = t.task(); task) {
    auto it = kTaskTokens.find(*task);
    if (it == kTaskTokens.end())
      return Status::errorf("chat: unknown task '{}' (expected action, query, authority, domain, "
                            "read_url or title)", *task);
    if (*task == "action") out += std::string(kAssistantText) + std::string(thinking ? kThinkStartText : kThinkEndText);
    out += it->second;
  } else if (t.role == "user" || t.role == "developer") {
    out += kAssistantText;
    const bool open_thinking = thinking && (!drop || static_cast<int>(index) >= last_user);
    out += open_thinking ? kThinkStartText : kThinkEndText;
  }
  return out;
}

}  // namespace

Result<std::string> render_tools_block(const OrderedJson& tools) {
  std::string schemas;
  for (const OrderedJson& tool : tools) {
    if (!tool.is_object() || !tool.contains("function"))
      return Status::errorf("chat: tool {} has no \"function\" object (OpenAI format expected)",
                            python_json_dumps(tool));
    if (!schemas.empty()) schemas += "\n";
    schemas += python_json_dumps(tool["function"]);
  }
  return std::string(kToolsTemplateHead) + schemas + std::string(kToolsTemplateTail);
}

Result<std::string> render_chat(std::span<const ChatMessage> messages, const ChatOptions& opts,
                                std::span<const ChatMessage> context) {
  // Context and new messages are merged separately (a new tool result never joins a
  // context turn); tool-result order and the thinking rules see both together.
  DSV4_ASSIGN_OR_RETURN(std::string_view effort_text, effort_prefix(opts));
  std::vector<Turn> context_turns = merge_turns(context);
  const std::vector<Turn> new_turns = merge_turns(messages);
  std::vector<Turn> full = context_turns;
  full.insert(full.end(), new_turns.begin(), new_turns.end());
  sort_tool_results(full);
  sort_tool_results(context_turns);

  bool any_tools = false;
  for (const auto* list : {&context, &messages})
    for (const ChatMessage& m : *list) any_tools = any_tools || has_tools(m);
  const bool drop = opts.drop_thinking && !any_tools;

  size_t first_to_render = context_turns.size();
  if (opts.thinking == ThinkingMode::kThinking && drop) {
    first_to_render = drop_thinking(context_turns).size();
    full = drop_thinking(full);
  }

  std::string out = opts.add_bos && context.empty() ? std::string(kBosText) : std::string();
  for (size_t i = first_to_render; i < full.size(); ++i) {
    DSV4_ASSIGN_OR_RETURN(std::string piece, render_turn(i, full, opts, drop, effort_text));
    out += piece;
  }
  return out;
}

Result<std::vector<ChatMessage>> chat_messages_from_json(const OrderedJson& messages) {
  if (!messages.is_array()) return Status::error("chat: messages must be a JSON array");
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const OrderedJson& j = messages[i];
    auto where = [&](std::string_view field) { return fmt::format("chat: messages[{}].{}", i, field); };
    if (!j.is_object()) return Status::errorf("chat: messages[{}] is not an object", i);
    ChatMessage m;
    if (!j.contains("role") || !j["role"].is_string()) return Status::errorf("{}: missing or not a string", where("role"));
    m.role = j["role"];
    auto opt_string = [&](const char* key, std::optional<std::string>& dst) -> Status {
      if (!j.contains(key) || j[key].is_null()) return Status::ok();
      if (j[key].is_string()) {
        dst = j[key].get<std::string>();
        return Status::ok();
      }
      if (m.role == "tool" && std::string_view(key) == "content" && j[key].is_array()) {
        std::string joined;
        for (const OrderedJson& part : j[key]) {
          if (!joined.empty()) joined += "\n\n";
          const std::string type = part.is_object() && part.contains("type") && part["type"].is_string()
                                       ? part["type"].get<std::string>() : "None";
          if (type == "text" && part.contains("text") && part["text"].is_string()) joined += part["text"].get<std::string>();
          else if (type == "text") joined += "";
          else joined += "[Unsupported " + type + "]";
        }
        dst = std::move(joined);
        return Status::ok();
      }
      return Status::errorf("{}: expected a string", where(key));
    };
    DSV4_TRY(opt_string("content", m.content));
    DSV4_TRY(opt_string("reasoning_content", m.reasoning_content));
    DSV4_TRY(opt_string("task", m.task));
    // A missing content renders as empty text; only an explicit null differs by role.
    if (!j.contains("content") && m.role != "latest_reminder") m.content = "";
    if (m.role == "tool" && !j.contains("content")) m.content = "";
    if (j.contains("tool_call_id") && j["tool_call_id"].is_string()) m.tool_call_id = j["tool_call_id"];
    if (j.contains("tools") && !j["tools"].is_null()) {
      if (!j["tools"].is_array()) return Status::errorf("{}: expected an array", where("tools"));
      m.tools = j["tools"];
    }
    if (j.contains("response_format")) m.response_format = j["response_format"];
    if (j.contains("wo_eos")) m.wo_eos = j["wo_eos"].is_boolean() && j["wo_eos"].get<bool>();
    if (j.contains("tool_calls") && !j["tool_calls"].is_null()) {
      if (!j["tool_calls"].is_array()) return Status::errorf("{}: expected an array", where("tool_calls"));
      for (size_t k = 0; k < j["tool_calls"].size(); ++k) {
        const OrderedJson& c = j["tool_calls"][k];
        const std::string w = fmt::format("{}[{}]", where("tool_calls"), k);
        if (!c.is_object() || !c.contains("function") || !c["function"].is_object())
          return Status::errorf("{}: expected {{\"function\": {{\"name\", \"arguments\"}}}}", w);
        const OrderedJson& f = c["function"];
        ToolCall call;
        if (c.contains("id") && c["id"].is_string()) call.id = c["id"];
        if (!f.contains("name") || !f["name"].is_string()) return Status::errorf("{}.function.name: missing", w);
        call.name = f["name"];
        if (f.contains("arguments")) {
          if (f["arguments"].is_string()) call.arguments = f["arguments"];
          else call.arguments = python_json_dumps(f["arguments"]);
        }
        m.tool_calls.push_back(std::move(call));
      }
    }
    out.push_back(std::move(m));
  }
  return out;
}

void attach_request_tools(std::vector<ChatMessage>& messages, const OrderedJson& tools) {
  if (!tools.is_array() || tools.empty()) return;
  if (!messages.empty() && (messages[0].role == "system" || messages[0].role == "developer")) {
    messages[0].tools = tools;
    return;
  }
  ChatMessage sys;
  sys.role = "system";
  sys.content = "";
  sys.tools = tools;
  messages.insert(messages.begin(), std::move(sys));
}

}  // namespace dsv4::text
