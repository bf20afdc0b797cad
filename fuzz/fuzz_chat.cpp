// libFuzzer: OpenAI-style messages (arbitrary JSON) through chat_messages_from_json and
// render_chat in every mode: errors are values, never crashes.
#include <cstddef>
#include <cstdint>
#include <string>

#include "text/chat.h"

using namespace dsv4::text;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  OrderedJson j = OrderedJson::parse(data + 1, data + size, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  auto messages = chat_messages_from_json(j);
  if (!messages.is_ok()) return 0;
  ChatOptions o;
  o.thinking = data[0] & 1 ? ThinkingMode::kThinking : ThinkingMode::kChat;
  o.drop_thinking = data[0] & 2;
  o.effort_table = data[0] & 4 ? EffortTable::kV4_0731 : EffortTable::kV4;
  o.reasoning_effort = data[0] & 8 ? "max" : "";
  const size_t split = messages->size() * ((data[0] >> 4) & 3) / 4;
  std::span<const ChatMessage> all(*messages);
  (void)render_chat(all.subspan(split), o, all.first(split));
  return 0;
}
