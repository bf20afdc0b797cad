// libFuzzer: the reply parser on arbitrary text, pushed in pieces whose sizes come from
// the input itself, in both modes, with a tool schema to check against. It must never
// crash, and the deltas must add up to the final result.
#include <cstddef>
#include <cstdint>
#include <string>

#include "text/output_parser.h"

using namespace dsv4::text;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  static const OrderedJson tools = OrderedJson::parse(
      R"([{"type":"function","function":{"name":"f","parameters":{"type":"object",
      "properties":{"a":{"type":"integer","minimum":0},"b":{"type":"array","items":{"type":"string"}}},
      "required":["a"],"additionalProperties":false}}}])");
  const ThinkingMode mode = data[0] & 1 ? ThinkingMode::kThinking : ThinkingMode::kChat;
  const size_t step = 1 + data[1] % 17;
  const std::string text(reinterpret_cast<const char*>(data + 2), size - 2);
  OutputParser p(mode, tools);
  std::string reasoning, content;
  size_t calls = 0;
  auto take = [&](const OutputDelta& d) {
    reasoning += d.reasoning;
    content += d.content;
    calls += d.tool_calls.size();
  };
  for (size_t at = 0; at < text.size(); at += step) take(p.push(std::string_view(text).substr(at, step)));
  take(p.finish());
  if (reasoning != p.result().reasoning || content != p.result().content || calls != p.result().tool_calls.size())
    __builtin_trap();
  return 0;
}
