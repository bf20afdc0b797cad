// Shared pieces of the request parsers (request_parsing.cpp): typed field access that
// names the field and what was wrong, sampling fields, tool lists, prompt building.
// Internal to src/server/.
#pragma once

#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "runtime/schema_grammar.h"
#include "server/api.h"

namespace dsv4::server::detail {

// Reads fields of one JSON object; the first problem is kept in `err` (400, param = the
// field) and every later call does nothing, so a parser checks ok() once at the end.
class Fields {
 public:
  Fields(const OrderedJson& object, std::string where, ApiError& err);
  bool ok() const { return err_.message.empty(); }
  ApiError& error() const { return err_; }
  const OrderedJson& json() const { return obj_; }
  bool has(const char* key) const;  // present and not null

  // Fails on a key not in `known` ("unrecognized request argument").
  void only(std::initializer_list<const char*> known);
  std::optional<std::string> string(const char* key);
  std::optional<bool> boolean(const char* key);
  std::optional<int64_t> integer(const char* key, int64_t lo, int64_t hi);
  std::optional<double> number(const char* key, double lo, double hi);
  const OrderedJson* array(const char* key);
  const OrderedJson* object(const char* key);
  const OrderedJson* any(const char* key);  // present and not null
  void fail(const std::string& key, const std::string& message, int status = 400, const std::string& code = "");

 private:
  std::string name(const std::string& key) const { return where_.empty() ? key : where_ + "." + key; }
  const OrderedJson& obj_;
  std::string where_;
  ApiError& err_;
};

std::string json_type_name(const OrderedJson& v);

// The request's "model" against the served names (404 model_not_found).
bool check_model(Fields& f, const ApiContext& ctx, std::string& model, bool required);

// temperature, top_p, top_k, min_p, seed, presence/frequency/repetition penalties,
// logit_bias (OpenAI's {"token id": bias}), priority, and our extension object "dsv4"
// ({"glp_alpha": A}: the steering strength, |A| <= runtime::kMaxSteeringAlpha, only with a
// bound steering file).
void read_sampling(Fields& f, runtime::RequestSpec& spec, const ApiContext& ctx);
// The next default seed read_sampling hands out (set_process_randomness, api.h).
void set_first_default_seed(uint64_t seed);

// Validates an OpenAI tools array ({"type": "function", "function": {...}}).
bool check_openai_tools(Fields& f, const char* key, const OrderedJson& tools);

// How the tools may be used (OpenAI names; Anthropic's "any" is "required").
struct ToolUse {
  enum class Choice { kAuto, kNone, kRequired, kNamed } choice = Choice::kAuto;
  std::string name;            // kNamed
  bool parallel = true;
};

// Renders, tokenizes (with exact replay) and fills spec.prompt, spec.thinking,
// spec.tools and the grammar for tool use or a JSON response format.
struct PromptSpec {
  std::vector<text::ChatMessage> messages;
  text::ChatOptions chat;
  OrderedJson tools = OrderedJson::array();  // OpenAI format
  ToolUse tool_use;
  std::optional<runtime::OutputGrammarSpec> format;  // json_object / json_schema
  OrderedJson response_format;  // rendered into the system message (null: none)
};
bool build_prompt(Fields& f, PromptSpec& p, const ApiContext& ctx, runtime::RequestSpec& spec);

// "low" ... "max", "none": thinking on/off and the effort prefix for ctx's table.
bool apply_effort(Fields& f, const std::string& key, const std::string& effort, const ApiContext& ctx,
                  text::ChatOptions& chat);

}  // namespace dsv4::server::detail
