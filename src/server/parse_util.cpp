#include "server/parse_util.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <random>
#include <cmath>

namespace dsv4::server {

std::string error_body(ApiKind api, const ApiError& e) {
  std::string type = e.type;
  if (type.empty()) {
    switch (e.status) {
      case 401: type = "authentication_error"; break;
      case 403: type = "permission_error"; break;
      case 404: type = api == ApiKind::kOpenAI ? "invalid_request_error" : "not_found_error"; break;
      case 413: type = api == ApiKind::kOpenAI ? "invalid_request_error" : "request_too_large"; break;
      case 429: type = api == ApiKind::kOpenAI ? "rate_limit_exceeded" : "rate_limit_error"; break;
      default: type = e.status >= 500 ? (api == ApiKind::kOpenAI ? "server_error" : "api_error") : "invalid_request_error";
    }
  }
  OrderedJson j;
  if (api == ApiKind::kAnthropic) {
    j = {{"type", "error"}, {"error", {{"type", type}, {"message", e.message}}}};
  } else {
    j = {{"error",
          {{"message", e.message},
           {"type", type},
           {"param", e.param.empty() ? OrderedJson(nullptr) : OrderedJson(e.param)},
           {"code", e.code.empty() ? OrderedJson(nullptr) : OrderedJson(e.code)}}}};
  }
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

ApiError error_from_status(const Status& s, int retry_after) {
  ApiError e;
  e.message = s.message();
  switch (s.code()) {
    case StatusCode::kInvalidArgument: e.status = 400; break;
    case StatusCode::kOutOfRange: e.status = 400; e.code = "context_length_exceeded"; break;
    case StatusCode::kResourceExhausted: e.status = 429; e.retry_after = std::max(retry_after, 1); break;
    case StatusCode::kCancelled: e.status = 503; break;
    default: e.status = 500;
  }
  return e;
}

namespace detail {

std::string json_type_name(const OrderedJson& v) {
  switch (v.type()) {
    case OrderedJson::value_t::null: return "null";
    case OrderedJson::value_t::boolean: return "a boolean";
    case OrderedJson::value_t::string: return "a string";
    case OrderedJson::value_t::array: return "an array";
    case OrderedJson::value_t::object: return "an object";
    case OrderedJson::value_t::number_float: return "a number";
    default: return "an integer";
  }
}

Fields::Fields(const OrderedJson& object, std::string where, ApiError& err) : obj_(object), where_(std::move(where)), err_(err) {
  if (ok() && !obj_.is_object())
    fail("", fmt::format("expected an object, got {}", json_type_name(obj_)));
}

void Fields::fail(const std::string& key, const std::string& message, int status, const std::string& code) {
  if (!ok()) return;
  const std::string field = key.empty() ? where_ : name(key);
  err_.status = status;
  err_.param = field;
  err_.code = code;
  err_.message = field.empty() ? message : fmt::format("{}: {}", field, message);
}

bool Fields::has(const char* key) const { return obj_.is_object() && obj_.contains(key) && !obj_[key].is_null(); }

void Fields::only(std::initializer_list<const char*> known) {
  if (!ok()) return;
  for (const auto& item : obj_.items()) {
    const std::string& key = item.key();
    if (std::none_of(known.begin(), known.end(), [&](const char* k) { return key == k; })) {
      std::string list;
      for (const char* k : known) list += (list.empty() ? "" : ", ") + std::string(k);
      return fail(key, fmt::format("unrecognized field (known fields: {})", list));
    }
  }
}

const OrderedJson* Fields::any(const char* key) { return ok() && has(key) ? &obj_[key] : nullptr; }

std::optional<std::string> Fields::string(const char* key) {
  const OrderedJson* v = any(key);
  if (!v) return std::nullopt;
  if (!v->is_string()) {
    fail(key, fmt::format("expected a string, got {}", json_type_name(*v)));
    return std::nullopt;
  }
  return v->get<std::string>();
}

std::optional<bool> Fields::boolean(const char* key) {
  const OrderedJson* v = any(key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) {
    fail(key, fmt::format("expected a boolean, got {}", json_type_name(*v)));
    return std::nullopt;
  }
  return v->get<bool>();
}

std::optional<int64_t> Fields::integer(const char* key, int64_t lo, int64_t hi) {
  const OrderedJson* v = any(key);
  if (!v) return std::nullopt;
  if (!v->is_number_integer() && !(v->is_number_float() && std::isfinite(v->get<double>()) &&
                                   std::floor(v->get<double>()) == v->get<double>() && std::fabs(v->get<double>()) < 9e15)) {
    fail(key, fmt::format("expected an integer, got {}", json_type_name(*v)));
    return std::nullopt;
  }
  const double d = v->is_number_unsigned() ? static_cast<double>(v->get<uint64_t>()) : v->get<double>();
  if (d < static_cast<double>(lo) || d > static_cast<double>(hi)) {
    fail(key, fmt::format("{} is out of range [{}, {}]", v->dump(), lo, hi));
    return std::nullopt;
  }
  return v->is_number_unsigned() ? static_cast<int64_t>(v->get<uint64_t>()) : v->get<int64_t>();
}

std::optional<double> Fields::number(const char* key, double lo, double hi) {
  const OrderedJson* v = any(key);
  if (!v) return std::nullopt;
  if (!v->is_number()) {
    fail(key, fmt::format("expected a number, got {}", json_type_name(*v)));
    return std::nullopt;
  }
  const double d = v->get<double>();
  if (!(d >= lo && d <= hi)) {
    fail(key, fmt::format("{} is out of range [{}, {}]", v->dump(), lo, hi));
    return std::nullopt;
  }
  return d;
}

const OrderedJson* Fields::array(const char* key) {
  const OrderedJson* v = any(key);
  if (v && !v->is_array()) {
    fail(key, fmt::format("expected an array, got {}", json_type_name(*v)));
    return nullptr;
  }
  return v;
}

const OrderedJson* Fields::object(const char* key) {
  const OrderedJson* v = any(key);
  if (v && !v->is_object()) {
    fail(key, fmt::format("expected an object, got {}", json_type_name(*v)));
    return nullptr;
  }
  return v;
}

bool check_model(Fields& f, const ApiContext& ctx, std::string& model, bool required) {
  const auto m = f.string("model");
  if (!f.ok()) return false;
  if (!m) {
    if (required) f.fail("model", "required");
    model = ctx.model_names.empty() ? "dsv4" : ctx.model_names[0];
    return f.ok();
  }
  model = *m;
  if (ctx.any_model) return true;
  if (std::find(ctx.model_names.begin(), ctx.model_names.end(), model) == ctx.model_names.end()) {
    std::string served;
    for (const std::string& n : ctx.model_names) served += (served.empty() ? "" : ", ") + n;
    f.fail("model", fmt::format("the model '{}' does not exist (this server serves: {})", model, served), 404,
           "model_not_found");
    return false;
  }
  return true;
}

// Requests without a seed get distinct ones, different in every process (unless fixed).
std::atomic<uint64_t> g_default_seed{std::random_device{}()};

void set_first_default_seed(uint64_t seed) { g_default_seed.store(seed); }

void read_sampling(Fields& f, runtime::RequestSpec& spec, const ApiContext& ctx) {
  runtime::SamplingParams& p = spec.sampling;
  if (auto t = f.number("temperature", 0, 2)) p.temperature = static_cast<float>(*t);
  if (auto t = f.number("top_p", 0, 1)) {
    if (*t <= 0) f.fail("top_p", "must be greater than 0");
    p.top_p = static_cast<float>(*t);
  }
  if (auto k = f.integer("top_k", -1, 1 << 20)) p.top_k = static_cast<int32_t>(std::max<int64_t>(*k, 0));
  if (auto m = f.number("min_p", 0, 1)) p.min_p = static_cast<float>(*m);
  if (auto s = f.integer("seed", INT64_MIN, INT64_MAX)) {
    p.seed = static_cast<uint64_t>(*s);
  } else {
    p.seed = g_default_seed.fetch_add(0x9e3779b97f4a7c15ull);
  }
  if (auto v = f.number("presence_penalty", -2, 2)) p.presence_penalty = static_cast<float>(*v);
  if (auto v = f.number("frequency_penalty", -2, 2)) p.frequency_penalty = static_cast<float>(*v);
  if (auto v = f.number("repetition_penalty", 0.01, 100)) p.repetition_penalty = static_cast<float>(*v);
  if (auto v = f.integer("priority", -1000000, 1000000)) spec.priority = static_cast<int>(*v);
  if (const OrderedJson* bias = f.object("logit_bias")) {
    for (const auto& [key, value] : bias->items()) {
      char* end = nullptr;
      const long long id = std::strtoll(key.c_str(), &end, 10);
      if (key.empty() || *end || id < 0 || static_cast<size_t>(id) >= ctx.vocab_size)
        return f.fail("logit_bias", fmt::format("key '{}' is not a token id in [0, {})", key, ctx.vocab_size));
      if (!value.is_number() || !(value.get<double>() >= -100 && value.get<double>() <= 100))
        return f.fail("logit_bias", fmt::format("bias for token {} must be a number in [-100, 100]", key));
      p.logit_bias.push_back({static_cast<int32_t>(id), static_cast<float>(value.get<double>())});
    }
  }
  // Our extension object (docs/SERVER.md): "dsv4": {"glp_alpha": A}.
  if (const OrderedJson* ext = f.object("dsv4")) {
    Fields g(*ext, "dsv4", f.error());
    g.only({"glp_alpha"});
    if (auto a = g.number("glp_alpha", -runtime::kMaxSteeringAlpha, runtime::kMaxSteeringAlpha)) {
      if (!ctx.steering_bound)
        g.fail("glp_alpha", "no steering file is bound on this server (dsv4 serve --glp FILE)");
      else
        spec.steering_alpha = static_cast<float>(*a);
    }
  }
}

bool check_openai_tools(Fields& f, const char* key, const OrderedJson& tools) {
  for (size_t i = 0; i < tools.size(); ++i) {
    const OrderedJson& t = tools[i];
    const std::string at = fmt::format("{}[{}]", key, i);
    if (!t.is_object() || !t.contains("type") || t["type"] != "function" || !t.contains("function") ||
        !t["function"].is_object()) {
      f.fail(at, "expected {\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": ...}}");
      return false;
    }
    const OrderedJson& fn = t["function"];
    if (!fn.contains("name") || !fn["name"].is_string() || fn["name"].get<std::string>().empty()) {
      f.fail(at + ".function.name", "required: a non-empty string");
      return false;
    }
    const std::string name = fn["name"];
    if (name.find_first_of("\"<>\n") != std::string::npos) {
      f.fail(at + ".function.name", "must not contain quotes, angle brackets or newlines");
      return false;
    }
    if (fn.contains("parameters") && !fn["parameters"].is_object()) {
      f.fail(at + ".function.parameters", "expected a JSON schema object");
      return false;
    }
  }
  return f.ok();
}

bool apply_effort(Fields& f, const std::string& key, const std::string& effort, const ApiContext& ctx,
                  text::ChatOptions& chat) {
  if (effort == "none" || effort == "minimal") {
    chat.thinking = text::ThinkingMode::kChat;
    chat.reasoning_effort.clear();
    return true;
  }
  chat.thinking = text::ThinkingMode::kThinking;
  if (ctx.effort_table == text::EffortTable::kV4) {
    // V4 knows high (no prefix) and max; lower efforts think as high.
    if (effort == "low" || effort == "medium" || effort == "high") chat.reasoning_effort.clear();
    else if (effort == "max" || effort == "xhigh") chat.reasoning_effort = "max";
    else f.fail(key, fmt::format("'{}' is not one of none, minimal, low, medium, high, xhigh, max", effort));
  } else {
    if (effort == "low" || effort == "medium") chat.reasoning_effort = "low";
    else if (effort == "high") chat.reasoning_effort = "high";
    else if (effort == "max" || effort == "xhigh") chat.reasoning_effort = "max";
    else f.fail(key, fmt::format("'{}' is not one of none, minimal, low, medium, high, xhigh, max", effort));
  }
  return f.ok();
}

bool build_prompt(Fields& f, PromptSpec& p, const ApiContext& ctx, runtime::RequestSpec& spec) {
  if (!f.ok()) return false;
  using Choice = ToolUse::Choice;
  std::vector<text::ChatMessage>& msgs = p.messages;
  if (msgs.empty()) {
    f.fail("messages", "at least one message is required");
    return false;
  }
  const bool offer_tools = !p.tools.empty() && p.tool_use.choice != Choice::kNone;
  OrderedJson offered = OrderedJson::array();
  if (offer_tools) {
    offered = p.tools;
    if (p.tool_use.choice == Choice::kNamed) {
      bool found = false;
      for (const OrderedJson& t : p.tools) found = found || t["function"]["name"] == p.tool_use.name;
      if (!found) {
        f.fail("tool_choice", fmt::format("names the function '{}', which is not among the tools", p.tool_use.name));
        return false;
      }
    }
    text::attach_request_tools(msgs, offered);
  } else if ((p.tool_use.choice == Choice::kRequired || p.tool_use.choice == Choice::kNamed) && p.tools.empty()) {
    f.fail("tool_choice", "requires tools");
    return false;
  }
  if (!p.response_format.is_null()) {
    if (msgs[0].role == "system" || msgs[0].role == "developer") {
      msgs[0].response_format = p.response_format;
    } else {
      text::ChatMessage sys = text::ChatMessage::of("system", "");
      sys.response_format = p.response_format;
      msgs.insert(msgs.begin(), std::move(sys));
    }
  }
  if (ctx.replay) ctx.replay->apply(msgs);
  auto rendered = text::render_chat(msgs, p.chat);
  if (!rendered.is_ok()) {
    f.fail("messages", rendered.status().message());
    return false;
  }
  auto ids = ctx.replay ? ctx.replay->tokenize(*ctx.tokenizer, *rendered, msgs) : ctx.tokenizer->encode(*rendered);
  if (!ids.is_ok()) {
    f.fail("messages", ids.status().message());
    return false;
  }
  spec.prompt = std::move(*ids);
  if (spec.prompt.size() >= ctx.max_context) {
    f.fail("messages",
           fmt::format("the prompt has {} tokens and this server's context holds {} (dsv4 serve --ctx), leaving no "
                       "room to generate", spec.prompt.size(), ctx.max_context),
           400, "context_length_exceeded");
    return false;
  }
  // The mode the reply starts in: the prompt ends inside <think> or after </think>.
  spec.thinking = rendered->ends_with(text::kThinkStartText) ? text::ThinkingMode::kThinking : text::ThinkingMode::kChat;
  spec.tools = offered;
  spec.parse_output = true;

  std::optional<runtime::OutputGrammarSpec> g;
  if (offer_tools) {
    bool any_strict = false;
    for (const OrderedJson& t : offered)
      any_strict = any_strict || (t["function"].contains("strict") && t["function"]["strict"] == true);
    runtime::OutputGrammarSpec gs;
    gs.parallel_tool_calls = p.tool_use.parallel;
    if (p.tool_use.choice == Choice::kRequired || p.tool_use.choice == Choice::kNamed) {
      gs.body = runtime::OutputGrammarSpec::Body::kToolCalls;
      if (p.tool_use.choice == Choice::kNamed) {
        gs.parallel_tool_calls = false;
        for (const OrderedJson& t : offered)
          if (t["function"]["name"] == p.tool_use.name) gs.tools.push_back(t);
      } else {
        gs.tools = offered;
      }
      g = gs;
    } else if (any_strict && !p.format) {
      gs.body = runtime::OutputGrammarSpec::Body::kContentOrToolCalls;
      gs.tools = offered;
      g = gs;
    }
  }
  if (p.format && !g) g = p.format;
  if (g) {
    g->thinking = spec.thinking == text::ThinkingMode::kThinking;
    auto grammar = runtime::build_output_grammar(*g);
    if (!grammar.is_ok()) {
      f.fail(p.format && g->body == p.format->body ? "response_format" : "tools", grammar.status().message());
      return false;
    }
    spec.grammar = *grammar;
    // The shortest completion, in the vocabulary's longest tokens, must fit in max_tokens.
    if (ctx.vocab) {
      const int64_t least = static_cast<int64_t>(runtime::GrammarMatcher(spec.grammar, ctx.vocab).plan().size());
      const int64_t room = std::min<int64_t>(spec.max_tokens < 0 ? INT64_MAX : spec.max_tokens,
                                             static_cast<int64_t>(ctx.max_context - spec.prompt.size()));
      if (least > room) {
        f.fail(p.format && g->body == p.format->body ? "response_format" : "tool_choice",
               fmt::format("the required output takes at least {} tokens, more than the {} allowed (max_tokens or the "
                           "context's end)", least, room));
        return false;
      }
    }
  }
  return true;
}

}  // namespace detail
}  // namespace dsv4::server
