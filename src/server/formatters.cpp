// Response formatting for the four APIs: the final JSON and the streaming events, each
// in its API's own types and order:
//   chat completions  chat.completion.chunk deltas (role, reasoning_content, content,
//                     tool_calls), a final chunk with finish_reason, optional usage, [DONE]
//   completions       text_completion chunks, [DONE]
//   Responses         response.created, response.in_progress, per output item
//                     output_item.added / content_part.added / *.delta / *.done /
//                     output_item.done, then response.completed (or .incomplete)
//   Messages          message_start, ping, per block content_block_start / _delta /
//                     _stop, message_delta (stop_reason, usage), message_stop
#include <fmt/format.h>

#include <fmt/chrono.h>

#include <atomic>
#include <random>

#include "server/api.h"
#include "server/parse_util.h"

namespace dsv4::server {
namespace {

using runtime::FinishReason;
using runtime::RequestEvent;

std::string dump(const OrderedJson& j) { return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace); }
std::string sse_data(const OrderedJson& j) { return "data: " + dump(j) + "\n\n"; }
std::string sse_event(const std::string& type, const OrderedJson& j) {
  return "event: " + type + "\ndata: " + dump(j) + "\n\n";
}

std::atomic<bool> g_salt_fixed{false};
std::atomic<uint64_t> g_fixed_salt{0};

uint64_t process_salt() {
  if (g_salt_fixed.load()) return g_fixed_salt.load();
  static const uint64_t salt = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  return salt;
}

// A stable, unique id: prefix + 24 hex digits from the request id and an index.
std::string make_id(const char* prefix, uint64_t request_id, uint64_t index) {
  uint64_t h = process_salt() ^ (request_id * 0x9e3779b97f4a7c15ull) ^ (index + 1) * 0xbf58476d1ce4e5b9ull;
  h ^= h >> 31;
  h *= 0x94d049bb133111ebull;
  h ^= h >> 29;
  return fmt::format("{}{:016x}{:08x}", prefix, h, static_cast<uint32_t>(request_id ^ (index << 20)));
}

// Everything every formatter keeps: the text so far, calls with their ids, usage.
class Base : public ResponseFormatter {
 public:
  Base(const ParsedRequest& req, const ApiContext& ctx, uint64_t id, int64_t created, const char* call_prefix)
      : req_(req), ctx_(ctx), id_(id), created_(created), call_prefix_(call_prefix) {}

 protected:
  struct Call {
    std::string id, name, arguments, error;
  };
  // Accumulates e; returns the calls it completed (with their ids).
  std::vector<Call> take(const RequestEvent& e) {
    usage_ = e.usage;
    reasoning_ += e.parsed.reasoning;
    content_ += req_.spec.parse_output ? e.parsed.content : e.text;
    std::vector<Call> fresh;
    for (const text::ParsedToolCall& c : e.parsed.tool_calls) {
      Call call{make_id(call_prefix_, id_, calls_.size()), c.name, c.arguments, c.error};
      calls_.push_back(call);
      fresh.push_back(std::move(call));
    }
    for (const runtime::TokenLogprob& lp : e.logprobs) logprobs_.push_back(lp);
    if (e.done) {
      done_ = true;
      finish_ = e.finish;
      error_ = e.error;
      stop_sequence_ = matched_stop(e);
      remember(e);
    }
    return fresh;
  }
  // The model ended its turn: keep its exact bytes and tokens for the next request.
  void remember(const RequestEvent& e) {
    if (!ctx_.replay || !req_.spec.parse_output || e.finish != FinishReason::kEos || !e.error.is_ok()) return;
    std::vector<std::string> ids;
    for (const Call& c : calls_) ids.push_back(c.id);
    const int32_t think_end = ctx_.tokenizer->find_token(text::kThinkEndText).value_or(-1);
    ctx_.replay->remember(e.tokens, e.generated_text, std::move(ids), think_end);
  }
  std::string matched_stop(const RequestEvent& e) const {
    if (e.finish != FinishReason::kStopString) return "";
    size_t best = std::string::npos;
    std::string which;
    for (const std::string& s : req_.spec.stop_strings)
      if (size_t at = e.generated_text.find(s); at < best) {
        best = at;
        which = s;
      }
    return which;
  }
  bool truncated() const { return finish_ == FinishReason::kLength || finish_ == FinishReason::kContextFull; }
  std::string token_text(int32_t id) const { return text::utf8_lossy(ctx_.tokenizer->token_bytes(id)); }
  OrderedJson token_bytes(int32_t id) const {
    OrderedJson b = OrderedJson::array();
    for (unsigned char c : ctx_.tokenizer->token_bytes(id)) b.push_back(c);
    return b;
  }
  // OpenAI chat's logprobs.content entries.
  OrderedJson chat_logprobs(const std::vector<runtime::TokenLogprob>& lps) const {
    OrderedJson content = OrderedJson::array();
    for (const runtime::TokenLogprob& lp : lps) {
      OrderedJson top = OrderedJson::array();
      for (const auto& [id, l] : lp.top)
        top.push_back({{"token", token_text(id)}, {"logprob", l}, {"bytes", token_bytes(id)}});
      content.push_back({{"token", token_text(lp.id)}, {"logprob", lp.logprob}, {"bytes", token_bytes(lp.id)},
                         {"top_logprobs", top}});
    }
    return {{"content", content}};
  }
  OrderedJson openai_usage() const {
    return {{"prompt_tokens", usage_.prompt_tokens},
            {"completion_tokens", usage_.completion_tokens},
            {"total_tokens", usage_.prompt_tokens + usage_.completion_tokens},
            {"prompt_tokens_details", {{"cached_tokens", usage_.cached_tokens}}},
            {"completion_tokens_details", {{"reasoning_tokens", usage_.reasoning_tokens}}}};
  }
  OrderedJson call_error(const Call& c) const { return c.error.empty() ? OrderedJson(nullptr) : OrderedJson(c.error); }

  const ParsedRequest& req_;
  const ApiContext& ctx_;
  const uint64_t id_;
  const int64_t created_;
  const char* call_prefix_;
  std::string reasoning_, content_;
  std::vector<Call> calls_;
  std::vector<runtime::TokenLogprob> logprobs_;
  runtime::Usage usage_;
  bool done_ = false;
  FinishReason finish_ = FinishReason::kEos;
  Status error_;
  std::string stop_sequence_;
};

// ---- chat completions ----------------------------------------------------------------------

class ChatFormatter : public Base {
 public:
  ChatFormatter(const ParsedRequest& req, const ApiContext& ctx, uint64_t id, int64_t created)
      : Base(req, ctx, id, created, "call_"), cid_(make_id("chatcmpl-", id, 0)) {}

  std::string begin() override { return sse_data(chunk({{"role", "assistant"}, {"content", ""}})); }

  std::string event(const RequestEvent& e) override {
    const std::vector<Call> fresh = take(e);
    if (!req_.stream) return "";
    std::string out;
    if (!e.parsed.reasoning.empty()) out += sse_data(chunk({{"reasoning_content", e.parsed.reasoning}}));
    if (!e.parsed.content.empty() || (req_.logprobs && !e.logprobs.empty())) {
      OrderedJson c = chunk({{"content", e.parsed.content}});
      if (req_.logprobs && !e.logprobs.empty()) c["choices"][0]["logprobs"] = chat_logprobs(e.logprobs);
      out += sse_data(c);
    }
    for (const Call& call : fresh) {
      OrderedJson tc = {{"index", index_of(call)}, {"id", call.id}, {"type", "function"},
                        {"function", {{"name", call.name}, {"arguments", call.arguments}}}};
      if (!call.error.empty()) tc["dsv4_error"] = call.error;
      out += sse_data(chunk({{"tool_calls", OrderedJson::array({tc})}}));
    }
    if (e.done) {
      if (!e.error.is_ok()) return out + stream_error(error_from_status(e.error)) + "data: [DONE]\n\n";
      OrderedJson last = chunk(OrderedJson::object());
      last["choices"][0]["finish_reason"] = finish_reason();
      out += sse_data(last);
      if (req_.include_usage) {
        OrderedJson u = chunk(OrderedJson::object());
        u["choices"] = OrderedJson::array();
        u["usage"] = openai_usage();
        out += sse_data(u);
      }
      out += "data: [DONE]\n\n";
    }
    return out;
  }

  OrderedJson body() override {
    OrderedJson msg = {{"role", "assistant"},
                       {"content", content_.empty() && !calls_.empty() ? OrderedJson(nullptr) : OrderedJson(content_)}};
    if (!reasoning_.empty()) msg["reasoning_content"] = reasoning_;
    if (!calls_.empty()) {
      OrderedJson tcs = OrderedJson::array();
      for (const Call& c : calls_) {
        OrderedJson tc = {{"id", c.id}, {"type", "function"}, {"function", {{"name", c.name}, {"arguments", c.arguments}}}};
        if (!c.error.empty()) tc["dsv4_error"] = c.error;
        tcs.push_back(tc);
      }
      msg["tool_calls"] = tcs;
    }
    OrderedJson choice = {{"index", 0}, {"message", msg},
                          {"logprobs", req_.logprobs ? chat_logprobs(logprobs_) : OrderedJson(nullptr)},
                          {"finish_reason", finish_reason()}};
    return {{"id", cid_},       {"object", "chat.completion"},          {"created", created_},
            {"model", req_.model}, {"choices", OrderedJson::array({choice})}, {"usage", openai_usage()},
            {"system_fingerprint", "dsv4-" DSV4_VERSION}};
  }

  std::string stream_error(const ApiError& e) override {
    return sse_data(OrderedJson::parse(error_body(ApiKind::kOpenAI, e)));
  }

 private:
  OrderedJson chunk(OrderedJson delta) const {
    return {{"id", cid_},
            {"object", "chat.completion.chunk"},
            {"created", created_},
            {"model", req_.model},
            {"system_fingerprint", "dsv4-" DSV4_VERSION},
            {"choices", OrderedJson::array({{{"index", 0}, {"delta", std::move(delta)}, {"logprobs", nullptr},
                                             {"finish_reason", nullptr}}})}};
  }
  size_t index_of(const Call& c) const {
    for (size_t i = 0; i < calls_.size(); ++i)
      if (calls_[i].id == c.id) return i;
    return 0;
  }
  std::string finish_reason() const {
    if (truncated()) return "length";
    return calls_.empty() ? "stop" : "tool_calls";
  }
  std::string cid_;
};

// ---- completions ---------------------------------------------------------------------------

class CompletionFormatter : public Base {
 public:
  CompletionFormatter(const ParsedRequest& req, const ApiContext& ctx, uint64_t id, int64_t created)
      : Base(req, ctx, id, created, "call_"), cid_(make_id("cmpl-", id, 0)) {}

  std::string begin() override { return req_.echo ? sse_data(chunk(req_.prompt_text, OrderedJson(nullptr))) : ""; }

  std::string event(const RequestEvent& e) override {
    take(e);
    if (!req_.stream) return "";
    std::string out;
    if (!e.text.empty() || (req_.logprobs && !e.logprobs.empty()))
      out += sse_data(chunk(e.text, req_.logprobs ? legacy_logprobs(e.logprobs, 0) : OrderedJson(nullptr)));
    if (e.done) {
      if (!e.error.is_ok()) return out + stream_error(error_from_status(e.error)) + "data: [DONE]\n\n";
      OrderedJson last = chunk("", nullptr);
      last["choices"][0]["finish_reason"] = truncated() ? "length" : "stop";
      if (req_.include_usage) last["usage"] = openai_usage();
      out += sse_data(last) + "data: [DONE]\n\n";
    }
    return out;
  }

  OrderedJson body() override {
    const std::string prefix = req_.echo ? req_.prompt_text : "";
    OrderedJson c = chunk(prefix + content_, req_.logprobs ? legacy_logprobs(logprobs_, prefix.size()) : OrderedJson(nullptr));
    c["choices"][0]["finish_reason"] = truncated() ? "length" : "stop";
    c["usage"] = openai_usage();
    return c;
  }

  std::string stream_error(const ApiError& e) override {
    return sse_data(OrderedJson::parse(error_body(ApiKind::kOpenAI, e)));
  }

 private:
  OrderedJson chunk(const std::string& text, OrderedJson logprobs) const {
    return {{"id", cid_},
            {"object", "text_completion"},
            {"created", created_},
            {"model", req_.model},
            {"choices", OrderedJson::array({{{"text", text}, {"index", 0}, {"logprobs", std::move(logprobs)},
                                             {"finish_reason", nullptr}}})}};
  }
  OrderedJson legacy_logprobs(const std::vector<runtime::TokenLogprob>& lps, size_t offset) {
    OrderedJson tokens = OrderedJson::array(), lp = OrderedJson::array(), top = OrderedJson::array(),
                offsets = OrderedJson::array();
    for (const runtime::TokenLogprob& t : lps) {
      tokens.push_back(token_text(t.id));
      lp.push_back(t.logprob);
      OrderedJson alts = OrderedJson::object();
      for (const auto& [id, l] : t.top) alts[token_text(id)] = l;
      top.push_back(alts);
      offsets.push_back(offset + text_offset_);
      text_offset_ += ctx_.tokenizer->token_bytes(t.id).size();
    }
    return {{"tokens", tokens}, {"token_logprobs", lp}, {"top_logprobs", top}, {"text_offset", offsets}};
  }
  std::string cid_;
  size_t text_offset_ = 0;
};

// ---- Responses -----------------------------------------------------------------------------

class ResponsesFormatter : public Base {
 public:
  ResponsesFormatter(const ParsedRequest& req, const ApiContext& ctx, uint64_t id, int64_t created)
      : Base(req, ctx, id, created, "call_"), rid_(make_id("resp_", id, 0)) {}

  std::string begin() override {
    return emit("response.created", {{"response", response("in_progress")}}) +
           emit("response.in_progress", {{"response", response("in_progress")}});
  }

  std::string event(const RequestEvent& e) override {
    const std::vector<Call> fresh = take(e);
    std::string out;
    if (!e.parsed.reasoning.empty()) out += delta(Item::kReasoning, e.parsed.reasoning);
    const std::string content = e.parsed.content;
    if (!content.empty()) out += delta(Item::kMessage, content);
    for (const Call& c : fresh) {
      out += close();
      const size_t index = items_.size();
      items_.push_back({Item::kFunctionCall, make_id("fc_", id_, index + 100), c.name, c.arguments, c.id, true});
      OrderedJson added = function_call_item(items_.back(), "in_progress");
      added["arguments"] = "";
      out += emit("response.output_item.added", {{"output_index", index}, {"item", added}});
      out += emit("response.function_call_arguments.delta",
                  {{"item_id", items_.back().id}, {"output_index", index}, {"delta", c.arguments}});
      out += emit("response.function_call_arguments.done",
                  {{"item_id", items_.back().id}, {"output_index", index}, {"name", c.name}, {"arguments", c.arguments}});
      items_.back().open = false;
      out += emit("response.output_item.done", {{"output_index", index}, {"item", function_call_item(items_.back(), "completed")}});
    }
    if (e.done) {
      out += close();
      if (!e.error.is_ok()) {
        const ApiError err = error_from_status(e.error);
        OrderedJson failed = response("failed");
        failed["error"] = {{"code", err.status >= 500 ? "server_error" : "invalid_request"}, {"message", err.message}};
        return req_.stream ? out + emit("response.failed", {{"response", failed}}) : "";
      }
      const bool incomplete = truncated();
      out += emit(incomplete ? "response.incomplete" : "response.completed",
                  {{"response", response(incomplete ? "incomplete" : "completed")}});
    }
    return req_.stream ? out : "";
  }

  OrderedJson body() override { return response(truncated() ? "incomplete" : "completed"); }

  std::string stream_error(const ApiError& e) override {
    return emit("error", {{"code", e.code.empty() ? OrderedJson(nullptr) : OrderedJson(e.code)},
                          {"message", e.message},
                          {"param", e.param.empty() ? OrderedJson(nullptr) : OrderedJson(e.param)}});
  }

 private:
  struct Item {
    enum Kind { kReasoning, kMessage, kFunctionCall } kind;
    std::string id, name, text, call_id;
    bool open = true;
  };

  std::string emit(const std::string& type, OrderedJson data) {
    OrderedJson j = {{"type", type}, {"sequence_number", seq_++}};
    for (auto& [k, v] : data.items()) j[k] = v;
    return sse_event(type, j);
  }
  OrderedJson part(const Item& it) const {
    if (it.kind == Item::kReasoning) return {{"type", "reasoning_text"}, {"text", it.text}};
    return {{"type", "output_text"}, {"text", it.text}, {"annotations", OrderedJson::array()}, {"logprobs", OrderedJson::array()}};
  }
  OrderedJson function_call_item(const Item& it, const char* status) const {
    return {{"type", "function_call"}, {"id", it.id}, {"call_id", it.call_id}, {"name", it.name},
            {"arguments", it.text}, {"status", status}};
  }
  OrderedJson item_json(const Item& it) const {
    const char* status = it.open ? "in_progress" : "completed";
    switch (it.kind) {
      case Item::kReasoning:
        return {{"type", "reasoning"}, {"id", it.id}, {"summary", OrderedJson::array()},
                {"content", OrderedJson::array({part(it)})}, {"status", status}};
      case Item::kMessage:
        return {{"type", "message"}, {"id", it.id}, {"status", status}, {"role", "assistant"},
                {"content", OrderedJson::array({part(it)})}};
      case Item::kFunctionCall: return function_call_item(it, status);
    }
    return nullptr;
  }
  // Appends text to the open item of `kind`, opening one (and closing another) as needed.
  std::string delta(Item::Kind kind, const std::string& text) {
    std::string out;
    if (items_.empty() || !items_.back().open || items_.back().kind != kind) {
      out += close();
      const size_t index = items_.size();
      items_.push_back({kind, make_id(kind == Item::kReasoning ? "rs_" : "msg_", id_, index + 100), "", "", "", true});
      OrderedJson added = item_json(items_.back());
      added["content"] = OrderedJson::array();
      out += emit("response.output_item.added", {{"output_index", index}, {"item", added}});
      out += emit("response.content_part.added",
                  {{"item_id", items_.back().id}, {"output_index", index}, {"content_index", 0}, {"part", part(items_.back())}});
    }
    Item& it = items_.back();
    it.text += text;
    const size_t index = items_.size() - 1;
    OrderedJson d = {{"item_id", it.id}, {"output_index", index}, {"content_index", 0}, {"delta", text}};
    if (kind == Item::kMessage) d["logprobs"] = OrderedJson::array();
    out += emit(kind == Item::kReasoning ? "response.reasoning_text.delta" : "response.output_text.delta", d);
    return out;
  }
  std::string close() {
    if (items_.empty() || !items_.back().open) return "";
    Item& it = items_.back();
    const size_t index = items_.size() - 1;
    std::string out;
    OrderedJson done = {{"item_id", it.id}, {"output_index", index}, {"content_index", 0}, {"text", it.text}};
    if (it.kind == Item::kMessage) done["logprobs"] = OrderedJson::array();
    out += emit(it.kind == Item::kReasoning ? "response.reasoning_text.done" : "response.output_text.done", done);
    out += emit("response.content_part.done",
                {{"item_id", it.id}, {"output_index", index}, {"content_index", 0}, {"part", part(it)}});
    it.open = false;
    out += emit("response.output_item.done", {{"output_index", index}, {"item", item_json(it)}});
    return out;
  }
  OrderedJson response(const char* status) const {
    const OrderedJson& b = req_.request;
    OrderedJson output = OrderedJson::array();
    std::string text;
    for (const Item& it : items_) {
      output.push_back(item_json(it));
      if (it.kind == Item::kMessage) text += it.text;
    }
    const bool finished = std::string(status) != "in_progress";
    OrderedJson tools = OrderedJson::array();
    for (const OrderedJson& t : req_.tools) {
      OrderedJson flat = {{"type", "function"}};
      for (const auto& [k, v] : t["function"].items()) flat[k] = v;
      if (!flat.contains("strict")) flat["strict"] = false;
      if (!flat.contains("parameters")) flat["parameters"] = OrderedJson::object();
      tools.push_back(flat);
    }
    OrderedJson r = {
        {"id", rid_},
        {"object", "response"},
        {"created_at", created_},
        {"status", status},
        {"error", nullptr},
        {"incomplete_details", std::string(status) == "incomplete" ? OrderedJson{{"reason", "max_output_tokens"}}
                                                                    : OrderedJson(nullptr)},
        {"instructions", b.contains("instructions") ? b["instructions"] : OrderedJson(nullptr)},
        {"max_output_tokens", b.contains("max_output_tokens") ? b["max_output_tokens"] : OrderedJson(nullptr)},
        {"model", req_.model},
        {"output", output},
        {"parallel_tool_calls", b.contains("parallel_tool_calls") ? b["parallel_tool_calls"] : OrderedJson(true)},
        {"previous_response_id", nullptr},
        {"reasoning", {{"effort", b.contains("reasoning") && b["reasoning"].is_object() && b["reasoning"].contains("effort")
                                      ? b["reasoning"]["effort"] : OrderedJson(nullptr)},
                       {"summary", nullptr}}},
        {"store", false},
        {"temperature", req_.spec.sampling.temperature},
        {"text", {{"format", b.contains("text") && b["text"].is_object() && b["text"].contains("format")
                                 ? b["text"]["format"] : OrderedJson{{"type", "text"}}}}},
        {"tool_choice", b.contains("tool_choice") ? b["tool_choice"] : OrderedJson("auto")},
        {"tools", tools},
        {"top_p", req_.spec.sampling.top_p},
        {"truncation", "disabled"},
        {"metadata", b.contains("metadata") && b["metadata"].is_object() ? b["metadata"] : OrderedJson::object()},
        {"usage", finished ? OrderedJson{{"input_tokens", usage_.prompt_tokens},
                                         {"input_tokens_details", {{"cached_tokens", usage_.cached_tokens}}},
                                         {"output_tokens", usage_.completion_tokens},
                                         {"output_tokens_details", {{"reasoning_tokens", usage_.reasoning_tokens}}},
                                         {"total_tokens", usage_.prompt_tokens + usage_.completion_tokens}}
                           : OrderedJson(nullptr)}};
    if (finished) r["output_text"] = text;
    return r;
  }

  std::string rid_;
  std::vector<Item> items_;
  uint64_t seq_ = 0;
};

// ---- Anthropic Messages --------------------------------------------------------------------

class MessagesFormatter : public Base {
 public:
  MessagesFormatter(const ParsedRequest& req, const ApiContext& ctx, uint64_t id, int64_t created)
      : Base(req, ctx, id, created, "toolu_"), mid_(make_id("msg_", id, 0)) {}

  // message_start waits for the first event, which knows the cached prompt tokens.
  std::string begin() override { return ""; }

  std::string event(const RequestEvent& e) override {
    const std::vector<Call> fresh = take(e);
    std::string out;
    if (!started_ && e.error.is_ok()) {
      started_ = true;
      OrderedJson msg = message(false);
      out += sse_event("message_start", {{"type", "message_start"}, {"message", msg}});
      out += sse_event("ping", {{"type", "ping"}});
    }
    if (!e.parsed.reasoning.empty()) out += delta(Block::kThinking, e.parsed.reasoning);
    if (!e.parsed.content.empty()) out += delta(Block::kText, e.parsed.content);
    for (const Call& c : fresh) {
      out += close();
      const size_t index = blocks_.size();
      blocks_.push_back({Block::kToolUse, c.arguments, c.id, c.name});
      out += sse_event("content_block_start",
                       {{"type", "content_block_start"},
                        {"index", index},
                        {"content_block", {{"type", "tool_use"}, {"id", c.id}, {"name", c.name}, {"input", OrderedJson::object()}}}});
      out += sse_event("content_block_delta", {{"type", "content_block_delta"},
                                               {"index", index},
                                               {"delta", {{"type", "input_json_delta"}, {"partial_json", input_json_text(c.arguments)}}}});
      out += sse_event("content_block_stop", {{"type", "content_block_stop"}, {"index", index}});
      open_ = false;
    }
    if (e.done) {
      if (!e.error.is_ok()) return req_.stream ? out + stream_error(error_from_status(e.error)) : "";
      out += close();
      out += sse_event("message_delta", {{"type", "message_delta"},
                                         {"delta", {{"stop_reason", stop_reason()}, {"stop_sequence", stop_sequence()}}},
                                         {"usage", usage_json()}});
      out += sse_event("message_stop", {{"type", "message_stop"}});
    }
    return req_.stream ? out : "";
  }

  OrderedJson body() override { return message(true); }

  std::string stream_error(const ApiError& e) override {
    return sse_event("error", OrderedJson::parse(error_body(ApiKind::kAnthropic, e)));
  }

 private:
  struct Block {
    enum Kind { kThinking, kText, kToolUse } kind;
    std::string text, id, name;
  };
  static OrderedJson input_object(const std::string& arguments) {
    const OrderedJson j = OrderedJson::parse(arguments, nullptr, false);
    if (j.is_object()) return j;
    return {{"arguments", arguments}};
  }
  static std::string input_json_text(const std::string& arguments) { return dump(input_object(arguments)); }
  OrderedJson usage_json() const {
    return {{"input_tokens", usage_.prompt_tokens - usage_.cached_tokens},
            {"output_tokens", usage_.completion_tokens},
            {"cache_creation_input_tokens", 0},
            {"cache_read_input_tokens", usage_.cached_tokens}};
  }
  OrderedJson stop_reason() const {
    if (!done_) return nullptr;
    if (truncated()) return "max_tokens";
    if (finish_ == FinishReason::kStopString) return "stop_sequence";
    return calls_.empty() ? "end_turn" : "tool_use";
  }
  OrderedJson stop_sequence() const { return stop_sequence_.empty() ? OrderedJson(nullptr) : OrderedJson(stop_sequence_); }
  OrderedJson block_json(const Block& b) const {
    switch (b.kind) {
      case Block::kThinking: return {{"type", "thinking"}, {"thinking", b.text}, {"signature", ""}};
      case Block::kText: return {{"type", "text"}, {"text", b.text}};
      case Block::kToolUse: return {{"type", "tool_use"}, {"id", b.id}, {"name", b.name}, {"input", input_object(b.text)}};
    }
    return nullptr;
  }
  OrderedJson message(bool final) const {
    OrderedJson content = OrderedJson::array();
    if (final) {
      if (!req_.stream) {
        // Built from the whole output: reasoning, text, calls.
        if (!reasoning_.empty()) content.push_back(block_json({Block::kThinking, reasoning_, "", ""}));
        if (!content_.empty()) content.push_back(block_json({Block::kText, content_, "", ""}));
        for (const Call& c : calls_) content.push_back(block_json({Block::kToolUse, c.arguments, c.id, c.name}));
      } else {
        for (const Block& b : blocks_) content.push_back(block_json(b));
      }
    }
    return {{"id", mid_},
            {"type", "message"},
            {"role", "assistant"},
            {"model", req_.model},
            {"content", content},
            {"stop_reason", final ? stop_reason() : OrderedJson(nullptr)},
            {"stop_sequence", final ? stop_sequence() : OrderedJson(nullptr)},
            {"usage", usage_json()}};
  }
  std::string delta(Block::Kind kind, const std::string& text) {
    std::string out;
    if (!open_ || blocks_.back().kind != kind) {
      out += close();
      const size_t index = blocks_.size();
      blocks_.push_back({kind, "", "", ""});
      open_ = true;
      OrderedJson start = kind == Block::kThinking ? OrderedJson{{"type", "thinking"}, {"thinking", ""}, {"signature", ""}}
                                                   : OrderedJson{{"type", "text"}, {"text", ""}};
      out += sse_event("content_block_start", {{"type", "content_block_start"}, {"index", index}, {"content_block", start}});
    }
    blocks_.back().text += text;
    OrderedJson d = kind == Block::kThinking ? OrderedJson{{"type", "thinking_delta"}, {"thinking", text}}
                                             : OrderedJson{{"type", "text_delta"}, {"text", text}};
    out += sse_event("content_block_delta", {{"type", "content_block_delta"}, {"index", blocks_.size() - 1}, {"delta", d}});
    return out;
  }
  std::string close() {
    if (!open_) return "";
    open_ = false;
    const size_t index = blocks_.size() - 1;
    std::string out;
    if (blocks_.back().kind == Block::kThinking)
      out += sse_event("content_block_delta", {{"type", "content_block_delta"},
                                               {"index", index},
                                               {"delta", {{"type", "signature_delta"}, {"signature", ""}}}});
    return out + sse_event("content_block_stop", {{"type", "content_block_stop"}, {"index", index}});
  }

  std::string mid_;
  std::vector<Block> blocks_;
  bool open_ = false, started_ = false;
};

}  // namespace

std::unique_ptr<ResponseFormatter> make_formatter(Endpoint endpoint, const ParsedRequest& req, const ApiContext& ctx,
                                                  uint64_t request_id, int64_t created) {
  switch (endpoint) {
    case Endpoint::kChatCompletions: return std::make_unique<ChatFormatter>(req, ctx, request_id, created);
    case Endpoint::kCompletions: return std::make_unique<CompletionFormatter>(req, ctx, request_id, created);
    case Endpoint::kResponses: return std::make_unique<ResponsesFormatter>(req, ctx, request_id, created);
    case Endpoint::kMessages: return std::make_unique<MessagesFormatter>(req, ctx, request_id, created);
  }
  return nullptr;
}

OrderedJson models_list(const ApiContext& ctx, int64_t created) {
  OrderedJson data = OrderedJson::array();
  const std::string when = fmt::format("{:%Y-%m-%dT%H:%M:%SZ}", fmt::gmtime(static_cast<std::time_t>(created)));
  for (const std::string& n : ctx.model_names)
    data.push_back({{"id", n}, {"object", "model"}, {"created", created}, {"owned_by", "dsv4"},
                    {"type", "model"}, {"display_name", n}, {"created_at", when}});
  return {{"object", "list"},
          {"data", data},
          {"has_more", false},
          {"first_id", ctx.model_names.empty() ? OrderedJson(nullptr) : OrderedJson(ctx.model_names.front())},
          {"last_id", ctx.model_names.empty() ? OrderedJson(nullptr) : OrderedJson(ctx.model_names.back())}};
}

void set_process_randomness(uint64_t id_salt, uint64_t first_default_seed) {
  g_fixed_salt.store(id_salt);
  g_salt_fixed.store(true);
  detail::set_first_default_seed(first_default_seed);
}

}  // namespace dsv4::server
