// Grammars for structured output (grammar.h), derived from JSON schemas and tool lists.
//
// JSON is written in the canonical form DeepSeek's encoder uses (Python's json.dumps:
// ", " and ": " separators, no other whitespace), object properties in schema order
// (required ones always, optional ones maybe), numbers with at most 16 digits.
// Supported keywords: type (and lists of types), enum, const, properties, required,
// additionalProperties, items, minItems/maxItems, minLength/maxLength, anyOf/oneOf,
// allOf (its first schema), local $ref (#, #/$defs/..., #/definitions/...). Other
// keywords (pattern, format, minimum, ...) do not constrain the grammar; tool calls are
// still checked against the whole schema afterwards (text/output_parser.h).
//
// Tool calls follow the DSML block the chat encoder renders (chat.cpp), byte for byte,
// so a constrained call re-renders identically: string-typed parameters as
// string="true" raw text (never containing "</｜DSML｜parameter"), others as
// string="false" canonical JSON.
#pragma once

#include <memory>

#include "runtime/grammar.h"
#include "text/pyjson.h"
#include "util/status.h"

namespace dsv4::runtime {

struct OutputGrammarSpec {
  enum class Body {
    kJsonObject,          // response_format json_object: any JSON object
    kJsonSchema,          // response_format json_schema: `schema`
    kToolCalls,           // tool_choice required or a named function: a call block only
    kContentOrToolCalls,  // tool_choice auto with strict tools: free text, then maybe calls
  };
  Body body = Body::kJsonObject;
  bool thinking = false;  // the output opens with reasoning up to </think>
  text::OrderedJson schema;                                // kJsonSchema
  text::OrderedJson tools = text::OrderedJson::array();    // OpenAI tools (tool bodies)
  bool parallel_tool_calls = true;
};

Result<std::shared_ptr<const Grammar>> build_output_grammar(const OutputGrammarSpec& spec);

// The grammar of one JSON value fitting `schema` (tests, and the pieces above).
Result<std::shared_ptr<const Grammar>> json_schema_grammar(const text::OrderedJson& schema);

}  // namespace dsv4::runtime
