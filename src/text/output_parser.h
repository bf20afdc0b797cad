// Splitting model output into reasoning, content and DSML tool calls, incrementally: text
// is pushed as it is decoded (any split, even inside a tag) and each push returns what is
// now certain. The format is the one the official parser reads (spec §5.5):
//   [reasoning "</think>"] content ["\n\n<｜DSML｜tool_calls>\n" invokes "</｜DSML｜tool_calls>"] [EOS]
// Unlike the official parser this one never fails: malformed or truncated DSML becomes
// content plus an error message, and each tool call is checked against its tool's JSON
// schema when tools are given.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "text/chat.h"
#include "text/pyjson.h"

namespace dsv4::text {

struct ParsedToolCall {
  std::string name;
  std::string arguments;  // JSON object text, rebuilt as the official parser does
  std::string error;      // empty when the call is well-formed and fits the tool's schema
};

// What one push() made certain.
struct OutputDelta {
  std::string reasoning;
  std::string content;
  std::vector<ParsedToolCall> tool_calls;  // calls completed by this push
};

struct ParsedOutput {
  std::string reasoning;
  std::string content;
  std::vector<ParsedToolCall> tool_calls;
  std::vector<std::string> errors;  // format problems (a call's own problems are in .error)
  bool saw_eos = false;             // the EOS text ended the output
};

class OutputParser {
 public:
  // `tools`: the OpenAI tools array of the request (for name and schema checks); may be
  // empty, then calls are only checked for well-formed DSML.
  explicit OutputParser(ThinkingMode mode, OrderedJson tools = OrderedJson::array());

  OutputDelta push(std::string_view text);
  // Ends the stream: releases held-back text and reports truncation.
  OutputDelta finish();

  const ParsedOutput& result() const { return out_; }
  bool done() const { return phase_ == Phase::kDone; }  // EOS or the end of the call block seen

 private:
  enum class Phase { kReasoning, kContent, kToolCalls, kAfterCalls, kDone };
  void run(OutputDelta& delta, bool at_end);
  bool parse_calls(OutputDelta& delta, bool at_end);
  void emit_reasoning(std::string_view s, OutputDelta& d);
  void emit_content(std::string_view s, OutputDelta& d);
  ParsedToolCall check_call(ParsedToolCall call, const std::vector<std::pair<std::string, std::string>>& raw,
                            const std::vector<bool>& is_string) const;

  Phase phase_;
  OrderedJson tools_;
  std::string buf_;       // text not yet classified
  bool calls_failed_ = false;  // a malformed call block became content
  ParsedOutput out_;
};

// Checks a JSON value against a JSON schema (the subset tool definitions use: type, enum,
// const, properties, required, additionalProperties, items, minimum/maximum,
// minItems/maxItems, minLength/maxLength, anyOf/oneOf). Returns "" or the first
// violation, naming the path ("arguments.unit: 'kelvin' is not one of [...]").
std::string check_json_schema(const OrderedJson& value, const OrderedJson& schema, const std::string& path);

}  // namespace dsv4::text
