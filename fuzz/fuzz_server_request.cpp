// libFuzzer: request bodies through the server's parsers (OpenAI chat completions,
// completions, Responses; Anthropic messages and count_tokens), the first byte choosing
// the endpoint, and every parsed request through its formatter with a made-up reply
// (text, a tool call, the end). Errors are values with an HTTP status, never crashes
// or exceptions; a grammar-constrained request gets a completion plan.
#include <cstddef>
#include <cstdint>
#include <string>

#include "server/api.h"

using namespace dsv4;
using namespace dsv4::server;

namespace {

struct Context {
  std::shared_ptr<const text::Tokenizer> tokenizer = *text::Tokenizer::builtin();
  runtime::ReplayStore replay;
  ApiContext api;
  Context() {
    // Output ids and default seeds are otherwise drawn per process, and they reach the replay
    // store and the formatted text: two runs with the same seed covered different edges.
    set_process_randomness(1, 1);
    api.tokenizer = tokenizer.get();
    api.model_names = {"m"};
    api.max_context = 2048;
    api.vocab_size = tokenizer->vocab_size();
    api.replay = &replay;
    api.vocab = runtime::VocabTrie::build(*tokenizer);
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Context* ctx = new Context;
  if (size < 1) return 0;
  const OrderedJson body = OrderedJson::parse(data + 1, data + size, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) return 0;
  ApiError err;
  const int which = data[0] % 5;
  if (which == 4) {
    auto n = count_message_tokens(body, ctx->api, err);
    if (!n.is_ok() && (err.status < 400 || err.message.empty())) __builtin_trap();
    return 0;
  }
  static const Endpoint kEndpoints[] = {Endpoint::kChatCompletions, Endpoint::kCompletions, Endpoint::kResponses,
                                        Endpoint::kMessages};
  Result<ParsedRequest> r = Status::error("unparsed");
  switch (kEndpoints[which]) {
    case Endpoint::kChatCompletions: r = parse_chat_completion(body, ctx->api, err); break;
    case Endpoint::kCompletions: r = parse_completion(body, ctx->api, err); break;
    case Endpoint::kResponses: r = parse_responses(body, ctx->api, err); break;
    case Endpoint::kMessages: r = parse_messages(body, ctx->api, err); break;
  }
  if (!r.is_ok()) {
    if (err.status < 400 || err.message.empty()) __builtin_trap();
    (void)error_body(which == 3 ? ApiKind::kAnthropic : ApiKind::kOpenAI, err);
    return 0;
  }
  if (r->spec.prompt.empty() || r->spec.prompt.size() >= ctx->api.max_context) __builtin_trap();
  if (r->spec.grammar) (void)runtime::GrammarMatcher(r->spec.grammar, ctx->api.vocab).plan();
  auto f = make_formatter(kEndpoints[which], *r, ctx->api, 1, 0);
  (void)f->begin();
  runtime::RequestEvent e;
  e.text = "hello";
  e.parsed.reasoning = "why";
  e.parsed.content = "hello";
  e.parsed.tool_calls.push_back({"f", R"({"a": 1})", ""});
  e.usage = {static_cast<int64_t>(r->spec.prompt.size()), 0, 2, 1};
  (void)f->event(e);
  runtime::RequestEvent done;
  done.done = true;
  done.finish = data[0] & 8 ? runtime::FinishReason::kLength : runtime::FinishReason::kEos;
  done.generated_text = "why</think>hello";
  (void)f->event(done);
  (void)f->body().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return 0;
}
