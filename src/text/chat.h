// DeepSeek-V4 prompt rendering, equal to DeepSeek's official encoder
// (encoding/encoding_dsv4.py; spec checkpoint-tokenizer-chat.md §5): BOS, roles
// (system, user, assistant, tool, latest_reminder, developer), thinking on/off with
// dropping of earlier reasoning, reasoning-effort prefixes (V4 and 0731 tables), tools
// and tool calls in DSML, tool results merged into user turns, quick-instruction tasks.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "text/pyjson.h"
#include "util/status.h"

namespace dsv4::text {

// The literal control-token strings of the format.
inline constexpr std::string_view kBosText = "<｜begin▁of▁sentence｜>";
inline constexpr std::string_view kEosText = "<｜end▁of▁sentence｜>";
inline constexpr std::string_view kUserText = "<｜User｜>";
inline constexpr std::string_view kAssistantText = "<｜Assistant｜>";
inline constexpr std::string_view kThinkStartText = "<think>";
inline constexpr std::string_view kThinkEndText = "</think>";
inline constexpr std::string_view kDsmlText = "｜DSML｜";
inline constexpr std::string_view kLatestReminderText = "<｜latest_reminder｜>";

enum class ThinkingMode { kChat, kThinking };

// Which checkpoint's reasoning-effort prompts to use (§5.2, §5.7): the original V4
// accepts unset/"high" (no prefix) and "max"; the 0731 refresh accepts "low" (default, no
// prefix), "high" and "max", each with its own text.
enum class EffortTable { kV4, kV4_0731 };

struct ToolCall {
  std::string id;         // OpenAI tool_call id (orders tool results; not rendered)
  std::string name;
  std::string arguments;  // JSON object text, as in OpenAI function.arguments
};

struct ChatMessage {
  std::string role;  // system, user, assistant, tool, latest_reminder, developer
  std::optional<std::string> content;            // nullopt: absent or null
  std::optional<std::string> reasoning_content;  // assistant
  std::vector<ToolCall> tool_calls;              // assistant
  std::string tool_call_id;                      // tool
  OrderedJson tools = OrderedJson::array();      // system/developer: OpenAI tool objects
  OrderedJson response_format;                   // system/developer; null = none
  std::optional<std::string> task;  // action, query, authority, domain, read_url, title
  bool wo_eos = false;              // assistant: leave out the final EOS (prefill)
  // assistant: the DSML call block exactly as the model wrote it, rendered instead of
  // tool_calls (a server's exact replay: the history re-renders byte for byte)
  std::optional<std::string> raw_tool_calls;

  static ChatMessage of(std::string role, std::string content) {
    ChatMessage m;
    m.role = std::move(role);
    m.content = std::move(content);
    return m;
  }
};

struct ChatOptions {
  ThinkingMode thinking = ThinkingMode::kThinking;
  bool drop_thinking = true;  // drop reasoning of turns before the last user message
  bool add_bos = true;
  std::string reasoning_effort;  // "" = unset
  EffortTable effort_table = EffortTable::kV4;
};

// Renders `messages`; with a non-empty `context` (messages already rendered and sent
// earlier) returns only the text of the new messages, computed over context + messages,
// and writes no BOS. A conversation ending in a user/tool/developer message ends with the
// generation prompt <｜Assistant｜><think> or <｜Assistant｜></think>.
Result<std::string> render_chat(std::span<const ChatMessage> messages, const ChatOptions& opts,
                                std::span<const ChatMessage> context = {});

// OpenAI-style message objects -> ChatMessage. Tool-result content given as a list of
// parts keeps its text parts (joined by "\n\n"), others become "[Unsupported TYPE]";
// tool-call arguments given as an object are serialised to JSON text first.
Result<std::vector<ChatMessage>> chat_messages_from_json(const OrderedJson& messages);

// The OpenAI "tools" array placed where the official convention puts request-level tools:
// on message 0 if it is a system/developer message, else on a new empty system message.
void attach_request_tools(std::vector<ChatMessage>& messages, const OrderedJson& tools);

// The "## Tools" block for a list of OpenAI tool objects (§5.4), ending in a newline.
Result<std::string> render_tools_block(const OrderedJson& tools);

}  // namespace dsv4::text
