// The HTTP APIs' request parsing and response formatting, apart from the HTTP server
// itself (http_server.h) so they can be tested and fuzzed without a socket or a model.
//
// Each API (OpenAI chat completions, OpenAI completions, OpenAI Responses, Anthropic
// Messages) has a parse function, body JSON -> ParsedRequest (the runtime's RequestSpec
// plus what the formatter needs), and a formatter that turns the runtime's events into
// that API's streaming events or its final JSON. Errors carry the API's HTTP status and
// error type; error_body() writes the API's own error JSON.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "runtime/grammar.h"
#include "runtime/replay.h"
#include "runtime/request.h"
#include "text/chat.h"
#include "text/tokenizer.h"

namespace dsv4::server {

using text::OrderedJson;

enum class ApiKind { kOpenAI, kAnthropic };

struct ApiError {
  int status = 400;
  std::string type;     // the API's error type; empty: derived from status
  std::string message;
  std::string param;    // OpenAI: the offending field
  std::string code;     // OpenAI: a machine-readable code
  int retry_after = 0;  // seconds, for 429
};

// {"error": {"message", "type", "param", "code"}} or
// {"type": "error", "error": {"type", "message"}}.
std::string error_body(ApiKind api, const ApiError& e);
// The runtime's rejection as an API error: 400 for bad or oversized requests, 429 (with
// Retry-After) for a full queue, 500 otherwise.
ApiError error_from_status(const Status& s, int retry_after = 0);

// What the parsers need from the server: no model, no scheduler.
struct ApiContext {
  const text::Tokenizer* tokenizer = nullptr;
  std::vector<std::string> model_names;  // accepted "model" values; the first is reported
  bool any_model = false;                // accept every name
  uint64_t max_context = 0;
  size_t vocab_size = 0;
  runtime::ReplayStore* replay = nullptr;  // exact replay (optional)
  std::shared_ptr<const runtime::VocabTrie> vocab;  // for grammar-constrained requests
  bool default_thinking = true;
  text::EffortTable effort_table = text::EffortTable::kV4;
  bool steering_bound = false;  // serve --glp: requests may set "dsv4": {"glp_alpha": A}
};

struct ParsedRequest {
  runtime::RequestSpec spec;
  std::string model;          // as the client named it
  bool stream = false;
  bool include_usage = false;  // OpenAI stream_options.include_usage
  bool logprobs = false;
  bool echo = false;           // completions: prompt text before the output
  std::string prompt_text;     // completions with echo
  OrderedJson tools = OrderedJson::array();  // OpenAI-format tools offered
  OrderedJson request;         // the body (Responses echoes parts of it)
};

Result<ParsedRequest> parse_chat_completion(const OrderedJson& body, const ApiContext& ctx, ApiError& err);
Result<ParsedRequest> parse_completion(const OrderedJson& body, const ApiContext& ctx, ApiError& err);
Result<ParsedRequest> parse_responses(const OrderedJson& body, const ApiContext& ctx, ApiError& err);
Result<ParsedRequest> parse_messages(const OrderedJson& body, const ApiContext& ctx, ApiError& err);
// Anthropic /v1/messages/count_tokens: the prompt's token count.
Result<int64_t> count_message_tokens(const OrderedJson& body, const ApiContext& ctx, ApiError& err);

// Turns one request's events into an API's output. Streaming: begin(), then event() for
// each runtime event (the last has done set) returns the SSE text to send. Otherwise
// body() after the done event gives the response JSON.
class ResponseFormatter {
 public:
  virtual ~ResponseFormatter() = default;
  virtual std::string begin() = 0;
  virtual std::string event(const runtime::RequestEvent& e) = 0;
  virtual OrderedJson body() = 0;
  // A failure after the stream began, in the API's streaming form.
  virtual std::string stream_error(const ApiError& e) = 0;
};

enum class Endpoint { kChatCompletions, kCompletions, kResponses, kMessages };
// `request_id` seeds the ids the output carries (call ids, item ids); `created` is the
// Unix time. The formatter remembers finished turns in ctx.replay.
std::unique_ptr<ResponseFormatter> make_formatter(Endpoint endpoint, const ParsedRequest& req, const ApiContext& ctx,
                                                  uint64_t request_id, int64_t created);

// OpenAI /v1/models (with Anthropic's fields too, so both clients read it).
OrderedJson models_list(const ApiContext& ctx, int64_t created);

// What is otherwise drawn once per process so that two server runs never hand out the same
// ids or default seeds: the salt of every output id (call, item, response ids) and the first
// default sampling seed of requests without one. Fixed by the fuzzers and tests that must
// behave the same on every run; call before the first request.
void set_process_randomness(uint64_t id_salt, uint64_t first_default_seed);

}  // namespace dsv4::server
