// The four request parsers: OpenAI chat completions, OpenAI completions, OpenAI
// Responses, Anthropic Messages. Each checks every field it knows (type, range), refuses
// fields it does not know, converts the conversation to ChatMessages and builds the
// prompt (parse_util.cpp).
#include <fmt/format.h>

#include "server/parse_util.h"

namespace dsv4::server {
namespace {

using detail::Fields;
using detail::PromptSpec;
using detail::ToolUse;
using text::ChatMessage;

// Text of a content value: a string, or an array of text parts (types in `text_types`).
bool content_text(Fields& f, const std::string& at, const OrderedJson& c, std::initializer_list<const char*> text_types,
                  std::string& out) {
  if (c.is_null()) return true;
  if (c.is_string()) {
    out = c.get<std::string>();
    return true;
  }
  if (!c.is_array()) {
    f.fail(at, fmt::format("expected a string or an array of content parts, got {}", detail::json_type_name(c)));
    return false;
  }
  for (size_t k = 0; k < c.size(); ++k) {
    const OrderedJson& part = c[k];
    const std::string where = fmt::format("{}[{}]", at, k);
    if (!part.is_object() || !part.contains("type") || !part["type"].is_string()) {
      f.fail(where, "expected a content part object with a \"type\"");
      return false;
    }
    const std::string type = part["type"];
    if (std::none_of(text_types.begin(), text_types.end(), [&](const char* t) { return type == t; })) {
      f.fail(where + ".type", fmt::format("'{}' content is not supported (only text)", type));
      return false;
    }
    const char* key = type == "refusal" ? "refusal" : "text";
    if (!part.contains(key) || !part[key].is_string()) {
      f.fail(where + "." + key, "expected a string");
      return false;
    }
    if (!out.empty()) out += "\n";
    out += part[key].get<std::string>();
  }
  return true;
}

std::string arguments_text(const OrderedJson& v) {
  return v.is_string() ? v.get<std::string>() : text::python_json_dumps(v);
}

// The ChatOptions of a request: thinking from the server default, then the API's field.
text::ChatOptions chat_defaults(const ApiContext& ctx) {
  text::ChatOptions o;
  o.thinking = ctx.default_thinking ? text::ThinkingMode::kThinking : text::ThinkingMode::kChat;
  o.effort_table = ctx.effort_table;
  return o;
}

bool read_stop(Fields& f, const char* key, size_t max_count, std::vector<std::string>& out, bool allow_string = true) {
  const OrderedJson* s = f.any(key);
  if (!s) return f.ok();
  if (s->is_string() && allow_string) {
    out.push_back(s->get<std::string>());
  } else if (s->is_array()) {
    for (const OrderedJson& x : *s) {
      if (!x.is_string()) {
        f.fail(key, "expected strings");
        return false;
      }
      out.push_back(x.get<std::string>());
    }
  } else {
    f.fail(key, fmt::format("expected a string or an array of strings, got {}", detail::json_type_name(*s)));
    return false;
  }
  if (out.size() > max_count) f.fail(key, fmt::format("at most {} stop sequences", max_count));
  for (const std::string& x : out)
    if (x.empty()) f.fail(key, "an empty stop sequence would stop at once");
  return f.ok();
}

bool read_json_format(Fields& f, const char* key, const OrderedJson& rf, bool flat, PromptSpec& p) {
  if (!rf.is_object() || !rf.contains("type") || !rf["type"].is_string()) {
    f.fail(key, "expected {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}");
    return false;
  }
  const std::string type = rf["type"];
  if (type == "text") return true;
  runtime::OutputGrammarSpec g;
  if (type == "json_object") {
    g.body = runtime::OutputGrammarSpec::Body::kJsonObject;
  } else if (type == "json_schema") {
    const OrderedJson* js = flat ? &rf : (rf.contains("json_schema") ? &rf["json_schema"] : nullptr);
    if (!js || !js->is_object() || !js->contains("schema") || !((*js)["schema"].is_object() || (*js)["schema"].is_boolean())) {
      f.fail(key, flat ? "json_schema needs a \"schema\" object" : "json_schema needs {\"json_schema\": {\"name\", \"schema\"}}");
      return false;
    }
    g.body = runtime::OutputGrammarSpec::Body::kJsonSchema;
    g.schema = (*js)["schema"];
  } else {
    f.fail(std::string(key) + ".type", fmt::format("'{}' is not one of text, json_object, json_schema", type));
    return false;
  }
  p.format = g;
  p.response_format = rf;
  return true;
}

bool read_openai_tool_choice(Fields& f, const OrderedJson* tc, bool flat, ToolUse& use) {
  if (!tc) return true;
  if (tc->is_string()) {
    const std::string c = *tc;
    if (c == "auto") use.choice = ToolUse::Choice::kAuto;
    else if (c == "none") use.choice = ToolUse::Choice::kNone;
    else if (c == "required") use.choice = ToolUse::Choice::kRequired;
    else f.fail("tool_choice", fmt::format("'{}' is not one of none, auto, required", c));
    return f.ok();
  }
  const OrderedJson* name = nullptr;
  if (tc->is_object() && tc->contains("type") && (*tc)["type"] == "function") {
    if (flat && tc->contains("name")) name = &(*tc)["name"];
    else if (tc->contains("function") && (*tc)["function"].is_object() && (*tc)["function"].contains("name"))
      name = &(*tc)["function"]["name"];
  }
  if (!name || !name->is_string()) {
    f.fail("tool_choice", flat ? "expected a string or {\"type\": \"function\", \"name\": ...}"
                               : "expected a string or {\"type\": \"function\", \"function\": {\"name\": ...}}");
    return false;
  }
  use.choice = ToolUse::Choice::kNamed;
  use.name = *name;
  return true;
}

void read_max_tokens(Fields& f, const ApiContext& ctx, const char* key, runtime::RequestSpec& spec) {
  if (auto m = f.integer(key, 1, static_cast<int64_t>(ctx.max_context))) spec.max_tokens = *m;
}

// ---- OpenAI chat ---------------------------------------------------------------------------

bool openai_messages(Fields& f, const OrderedJson& list, std::vector<ChatMessage>& out) {
  for (size_t i = 0; i < list.size() && f.ok(); ++i) {
    const std::string at = fmt::format("messages[{}]", i);
    const OrderedJson& m = list[i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
      f.fail(at, "expected an object with a \"role\"");
      return false;
    }
    std::string role = m["role"];
    if (role == "developer") role = "system";
    if (role != "system" && role != "user" && role != "assistant" && role != "tool") {
      f.fail(at + ".role", fmt::format("'{}' is not one of system, developer, user, assistant, tool", role));
      return false;
    }
    ChatMessage cm;
    cm.role = role;
    std::string content;
    if (m.contains("content") &&
        !content_text(f, at + ".content", m["content"], {"text", "input_text", "output_text", "refusal"}, content))
      return false;
    cm.content = content;
    if (role == "assistant") {
      for (const char* key : {"reasoning_content", "reasoning"})
        if (m.contains(key) && !m[key].is_null()) {
          if (!m[key].is_string()) {
            f.fail(at + "." + key, "expected a string");
            return false;
          }
          cm.reasoning_content = m[key].get<std::string>();
        }
      if (m.contains("tool_calls") && !m["tool_calls"].is_null()) {
        if (!m["tool_calls"].is_array()) {
          f.fail(at + ".tool_calls", "expected an array");
          return false;
        }
        for (size_t k = 0; k < m["tool_calls"].size(); ++k) {
          const OrderedJson& c = m["tool_calls"][k];
          const std::string w = fmt::format("{}.tool_calls[{}]", at, k);
          if (!c.is_object() || !c.contains("function") || !c["function"].is_object() ||
              !c["function"].contains("name") || !c["function"]["name"].is_string()) {
            f.fail(w, "expected {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}");
            return false;
          }
          text::ToolCall call;
          if (c.contains("id") && c["id"].is_string()) call.id = c["id"];
          call.name = c["function"]["name"];
          call.arguments = c["function"].contains("arguments") ? arguments_text(c["function"]["arguments"]) : "{}";
          cm.tool_calls.push_back(std::move(call));
        }
      }
    }
    if (role == "tool") {
      if (!m.contains("tool_call_id") || !m["tool_call_id"].is_string()) {
        f.fail(at + ".tool_call_id", "required for tool messages");
        return false;
      }
      cm.tool_call_id = m["tool_call_id"];
    }
    out.push_back(std::move(cm));
  }
  return f.ok();
}

}  // namespace

Result<ParsedRequest> parse_chat_completion(const OrderedJson& body, const ApiContext& ctx, ApiError& err) {
  err = {};
  Fields f(body, "", err);
  f.only({"model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "min_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias", "logprobs", "top_logprobs", "tools", "tool_choice",
          "parallel_tool_calls", "response_format", "reasoning_effort", "thinking", "chat_template_kwargs", "user",
          "metadata", "store", "service_tier", "priority", "dsv4", "modalities", "prompt_cache_key", "safety_identifier"});
  ParsedRequest r;
  r.request = body;
  detail::check_model(f, ctx, r.model, true);
  PromptSpec p;
  p.chat = chat_defaults(ctx);
  const OrderedJson* messages = f.array("messages");
  if (f.ok() && !messages) f.fail("messages", "required");
  if (f.ok()) openai_messages(f, *messages, p.messages);
  if (auto n = f.integer("n", 1, 1)) (void)n;
  if (const OrderedJson* mod = f.array("modalities"))
    for (const OrderedJson& x : *mod)
      if (x != "text") f.fail("modalities", "only text output is supported");
  r.stream = f.boolean("stream").value_or(false);
  if (const OrderedJson* so = f.object("stream_options")) {
    Fields g(*so, "stream_options", err);
    g.only({"include_usage", "include_obfuscation"});
    r.include_usage = g.boolean("include_usage").value_or(false);
  }
  read_max_tokens(f, ctx, "max_tokens", r.spec);
  read_max_tokens(f, ctx, "max_completion_tokens", r.spec);
  detail::read_sampling(f, r.spec, ctx);
  read_stop(f, "stop", 4, r.spec.stop_strings);
  r.logprobs = f.boolean("logprobs").value_or(false);
  if (auto k = f.integer("top_logprobs", 0, 20)) {
    if (!r.logprobs) f.fail("top_logprobs", "requires logprobs: true");
    r.spec.top_logprobs = static_cast<int>(*k);
  }
  if (r.logprobs && r.spec.top_logprobs < 0) r.spec.top_logprobs = 0;
  if (const OrderedJson* tools = f.array("tools"); tools && detail::check_openai_tools(f, "tools", *tools)) p.tools = *tools;
  read_openai_tool_choice(f, f.any("tool_choice"), false, p.tool_use);
  p.tool_use.parallel = f.boolean("parallel_tool_calls").value_or(true);
  if (const OrderedJson* rf = f.object("response_format")) read_json_format(f, "response_format", *rf, false, p);
  if (auto effort = f.string("reasoning_effort")) detail::apply_effort(f, "reasoning_effort", *effort, ctx, p.chat);
  if (const OrderedJson* th = f.object("thinking")) {
    if (!th->contains("type") || !(*th)["type"].is_string() ||
        ((*th)["type"] != "enabled" && (*th)["type"] != "disabled"))
      f.fail("thinking", "expected {\"type\": \"enabled\" | \"disabled\"}");
    else p.chat.thinking = (*th)["type"] == "enabled" ? text::ThinkingMode::kThinking : text::ThinkingMode::kChat;
  }
  if (const OrderedJson* kw = f.object("chat_template_kwargs"))
    if (kw->contains("thinking") && (*kw)["thinking"].is_boolean())
      p.chat.thinking = (*kw)["thinking"].get<bool>() ? text::ThinkingMode::kThinking : text::ThinkingMode::kChat;
  detail::build_prompt(f, p, ctx, r.spec);
  if (!f.ok()) return Status::error(err.message);
  r.tools = r.spec.tools;
  return r;
}

// ---- OpenAI completions ------------------------------------------------------------------

Result<ParsedRequest> parse_completion(const OrderedJson& body, const ApiContext& ctx, ApiError& err) {
  err = {};
  Fields f(body, "", err);
  f.only({"model", "prompt", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n",
          "best_of", "stop", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
          "logprobs", "echo", "suffix", "user", "priority", "dsv4"});
  ParsedRequest r;
  r.request = body;
  detail::check_model(f, ctx, r.model, true);
  const OrderedJson* prompt = f.any("prompt");
  if (f.ok() && !prompt) f.fail("prompt", "required");
  if (f.ok()) {
    const OrderedJson* one = prompt;
    if (prompt->is_array() && !prompt->empty() && !(*prompt)[0].is_number()) {
      if (prompt->size() != 1) f.fail("prompt", "only one prompt per request is supported");
      one = &(*prompt)[0];
    }
    if (f.ok() && one->is_string()) {
      r.prompt_text = one->get<std::string>();
      auto ids = ctx.tokenizer->encode(r.prompt_text);
      if (!ids.is_ok()) f.fail("prompt", ids.status().message());
      else r.spec.prompt = std::move(*ids);
    } else if (f.ok() && one->is_array()) {
      for (const OrderedJson& t : *one) {
        if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= static_cast<int64_t>(ctx.vocab_size)) {
          f.fail("prompt", fmt::format("token ids must be integers in [0, {})", ctx.vocab_size));
          break;
        }
        r.spec.prompt.push_back(t.get<int32_t>());
      }
      r.prompt_text = ctx.tokenizer->decode(r.spec.prompt);
    } else if (f.ok()) {
      f.fail("prompt", "expected a string, an array of one string, or an array of token ids");
    }
    if (f.ok() && r.spec.prompt.empty()) f.fail("prompt", "is empty");
    if (f.ok() && r.spec.prompt.size() >= ctx.max_context)
      f.fail("prompt",
             fmt::format("the prompt has {} tokens and this server's context holds {} (dsv4 serve --ctx)",
                         r.spec.prompt.size(), ctx.max_context),
             400, "context_length_exceeded");
  }
  (void)f.integer("n", 1, 1);
  (void)f.integer("best_of", 1, 1);
  if (f.has("suffix")) f.fail("suffix", "is not supported");
  r.stream = f.boolean("stream").value_or(false);
  if (const OrderedJson* so = f.object("stream_options")) {
    Fields g(*so, "stream_options", err);
    g.only({"include_usage"});
    r.include_usage = g.boolean("include_usage").value_or(false);
  }
  r.spec.max_tokens = 16;  // the completions API's default
  read_max_tokens(f, ctx, "max_tokens", r.spec);
  detail::read_sampling(f, r.spec, ctx);
  read_stop(f, "stop", 4, r.spec.stop_strings);
  if (auto k = f.integer("logprobs", 0, 5)) {
    r.logprobs = true;
    r.spec.top_logprobs = static_cast<int>(*k);
  }
  r.echo = f.boolean("echo").value_or(false);
  r.spec.parse_output = false;
  if (!f.ok()) return Status::error(err.message);
  return r;
}

// ---- OpenAI Responses --------------------------------------------------------------------

namespace {

bool responses_input(Fields& f, const OrderedJson& input, std::vector<ChatMessage>& out) {
  if (input.is_string()) {
    out.push_back(ChatMessage::of("user", input.get<std::string>()));
    return true;
  }
  if (!input.is_array()) {
    f.fail("input", "expected a string or an array of input items");
    return false;
  }
  std::optional<std::string> reasoning;  // a reasoning item waits for its assistant turn
  auto assistant = [&]() -> ChatMessage& {
    if (out.empty() || out.back().role != "assistant" || out.back().wo_eos) {
      ChatMessage m = ChatMessage::of("assistant", "");
      out.push_back(std::move(m));
    }
    if (reasoning) {
      out.back().reasoning_content = std::move(*reasoning);
      reasoning.reset();
    }
    return out.back();
  };
  for (size_t i = 0; i < input.size() && f.ok(); ++i) {
    const OrderedJson& it = input[i];
    const std::string at = fmt::format("input[{}]", i);
    if (!it.is_object()) {
      f.fail(at, "expected an input item object");
      return false;
    }
    std::string type = it.contains("type") && it["type"].is_string() ? it["type"].get<std::string>() : "message";
    if (type == "message") {
      if (!it.contains("role") || !it["role"].is_string()) {
        f.fail(at + ".role", "required");
        return false;
      }
      std::string role = it["role"];
      if (role == "developer") role = "system";
      if (role != "system" && role != "user" && role != "assistant") {
        f.fail(at + ".role", fmt::format("'{}' is not one of system, developer, user, assistant", role));
        return false;
      }
      std::string content;
      if (it.contains("content") &&
          !content_text(f, at + ".content", it["content"], {"input_text", "output_text", "text", "refusal"}, content))
        return false;
      if (role == "assistant") {
        ChatMessage& a = assistant();
        a.content = a.content.value_or("") + content;
      } else {
        out.push_back(ChatMessage::of(role, content));
      }
    } else if (type == "function_call") {
      if (!it.contains("name") || !it["name"].is_string() || !it.contains("call_id") || !it["call_id"].is_string()) {
        f.fail(at, "a function_call needs \"call_id\" and \"name\"");
        return false;
      }
      text::ToolCall c;
      c.id = it["call_id"];
      c.name = it["name"];
      c.arguments = it.contains("arguments") ? arguments_text(it["arguments"]) : "{}";
      assistant().tool_calls.push_back(std::move(c));
    } else if (type == "function_call_output") {
      if (!it.contains("call_id") || !it["call_id"].is_string()) {
        f.fail(at + ".call_id", "required");
        return false;
      }
      std::string output;
      if (it.contains("output") && !content_text(f, at + ".output", it["output"], {"input_text", "output_text", "text"}, output))
        return false;
      ChatMessage m = ChatMessage::of("tool", output);
      m.tool_call_id = it["call_id"];
      out.push_back(std::move(m));
    } else if (type == "reasoning") {
      std::string text;
      for (const char* key : {"content", "summary"}) {
        if (!text.empty() || !it.contains(key) || !it[key].is_array()) continue;
        for (const OrderedJson& part : it[key])
          if (part.is_object() && part.contains("text") && part["text"].is_string()) text += part["text"].get<std::string>();
      }
      reasoning = text;
    } else {
      f.fail(at + ".type", fmt::format("'{}' items are not supported (message, function_call, "
                                       "function_call_output, reasoning)", type));
      return false;
    }
  }
  return f.ok();
}

}  // namespace

Result<ParsedRequest> parse_responses(const OrderedJson& body, const ApiContext& ctx, ApiError& err) {
  err = {};
  Fields f(body, "", err);
  f.only({"model", "input", "instructions", "stream", "stream_options", "max_output_tokens", "temperature", "top_p",
          "top_k", "tools", "tool_choice", "parallel_tool_calls", "reasoning", "text", "store", "metadata", "user",
          "previous_response_id", "include", "truncation", "service_tier", "seed", "priority", "dsv4", "prompt_cache_key",
          "background", "max_tool_calls", "safety_identifier", "top_logprobs", "conversation", "prompt"});
  ParsedRequest r;
  r.request = body;
  detail::check_model(f, ctx, r.model, true);
  if (f.has("previous_response_id"))
    f.fail("previous_response_id", "is not supported: this server keeps no responses; send the whole conversation in input");
  if (f.has("conversation")) f.fail("conversation", "is not supported: send the whole conversation in input");
  if (f.boolean("background").value_or(false)) f.fail("background", "is not supported");
  PromptSpec p;
  p.chat = chat_defaults(ctx);
  if (auto instructions = f.string("instructions")) p.messages.push_back(ChatMessage::of("system", *instructions));
  const OrderedJson* input = f.any("input");
  if (f.ok() && !input) f.fail("input", "required");
  if (f.ok()) responses_input(f, *input, p.messages);
  r.stream = f.boolean("stream").value_or(false);
  read_max_tokens(f, ctx, "max_output_tokens", r.spec);
  detail::read_sampling(f, r.spec, ctx);
  if (const OrderedJson* tools = f.array("tools")) {
    for (size_t i = 0; i < tools->size() && f.ok(); ++i) {
      const OrderedJson& t = (*tools)[i];
      if (!t.is_object() || !t.contains("type") || !t["type"].is_string()) {
        f.fail(fmt::format("tools[{}]", i), "expected a tool object with a \"type\"");
        break;
      }
      if (t["type"] != "function") continue;  // hosted tools (web search, ...) are not offered
      OrderedJson fn = OrderedJson::object();
      for (const char* key : {"name", "description", "parameters", "strict"})
        if (t.contains(key) && !t[key].is_null()) fn[key] = t[key];
      p.tools.push_back({{"type", "function"}, {"function", fn}});
    }
    detail::check_openai_tools(f, "tools", p.tools);
  }
  read_openai_tool_choice(f, f.any("tool_choice"), true, p.tool_use);
  p.tool_use.parallel = f.boolean("parallel_tool_calls").value_or(true);
  if (const OrderedJson* reasoning = f.object("reasoning")) {
    Fields g(*reasoning, "reasoning", err);
    g.only({"effort", "summary", "generate_summary"});
    if (auto effort = g.string("effort")) detail::apply_effort(g, "effort", *effort, ctx, p.chat);
  }
  if (const OrderedJson* t = f.object("text")) {
    Fields g(*t, "text", err);
    g.only({"format", "verbosity"});
    if (const OrderedJson* fmt_ = g.object("format")) read_json_format(g, "format", *fmt_, true, p);
  }
  detail::build_prompt(f, p, ctx, r.spec);
  if (!f.ok()) return Status::error(err.message);
  r.tools = r.spec.tools;
  return r;
}

// ---- Anthropic Messages ------------------------------------------------------------------

namespace {

bool anthropic_conversation(Fields& f, const OrderedJson& body, PromptSpec& p) {
  if (const OrderedJson* sys = f.any("system")) {
    std::string text;
    if (!content_text(f, "system", *sys, {"text"}, text)) return false;
    p.messages.push_back(ChatMessage::of("system", text));
  }
  const OrderedJson* messages = f.array("messages");
  if (f.ok() && !messages) f.fail("messages", "required");
  if (!f.ok()) return false;
  (void)body;
  for (size_t i = 0; i < messages->size() && f.ok(); ++i) {
    const OrderedJson& m = (*messages)[i];
    const std::string at = fmt::format("messages.{}", i);
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content")) {
      f.fail(at, "expected {\"role\": \"user\" | \"assistant\", \"content\": ...}");
      return false;
    }
    const std::string role = m["role"];
    if (role != "user" && role != "assistant") {
      f.fail(at + ".role", fmt::format("'{}' is not one of user, assistant", role));
      return false;
    }
    const OrderedJson& c = m["content"];
    if (c.is_string()) {
      p.messages.push_back(ChatMessage::of(role, c.get<std::string>()));
      continue;
    }
    if (!c.is_array()) {
      f.fail(at + ".content", "expected a string or an array of content blocks");
      return false;
    }
    ChatMessage assistant = ChatMessage::of("assistant", "");
    std::string user_text;
    bool user_has_text = false;
    for (size_t k = 0; k < c.size(); ++k) {
      const OrderedJson& b = c[k];
      const std::string w = fmt::format("{}.content.{}", at, k);
      if (!b.is_object() || !b.contains("type") || !b["type"].is_string()) {
        f.fail(w, "expected a content block with a \"type\"");
        return false;
      }
      const std::string type = b["type"];
      auto str = [&](const char* key) -> std::optional<std::string> {
        if (b.contains(key) && b[key].is_string()) return b[key].get<std::string>();
        f.fail(w + "." + key, "expected a string");
        return std::nullopt;
      };
      if (type == "text") {
        auto t = str("text");
        if (!t) return false;
        if (role == "assistant") assistant.content = *assistant.content + *t;
        else {
          user_text += (user_has_text ? "\n" : "") + *t;
          user_has_text = true;
        }
      } else if (type == "thinking" && role == "assistant") {
        auto t = str("thinking");
        if (!t) return false;
        assistant.reasoning_content = assistant.reasoning_content.value_or("") + *t;
      } else if (type == "redacted_thinking" && role == "assistant") {
        continue;
      } else if (type == "tool_use" && role == "assistant") {
        auto id = str("id"), name = str("name");
        if (!id || !name) return false;
        text::ToolCall call;
        call.id = *id;
        call.name = *name;
        call.arguments = b.contains("input") ? arguments_text(b["input"]) : "{}";
        assistant.tool_calls.push_back(std::move(call));
      } else if (type == "tool_result" && role == "user") {
        auto id = str("tool_use_id");
        if (!id) return false;
        std::string out;
        if (b.contains("content") && !content_text(f, w + ".content", b["content"], {"text"}, out)) return false;
        ChatMessage tm = ChatMessage::of("tool", out);
        tm.tool_call_id = *id;
        p.messages.push_back(std::move(tm));
      } else {
        f.fail(w + ".type", fmt::format("'{}' blocks are not supported in {} messages", type, role));
        return false;
      }
    }
    if (role == "assistant") p.messages.push_back(std::move(assistant));
    else if (user_has_text || c.empty()) p.messages.push_back(ChatMessage::of("user", user_text));
  }
  return f.ok();
}

bool anthropic_tools(Fields& f, PromptSpec& p) {
  if (const OrderedJson* tools = f.array("tools")) {
    for (size_t i = 0; i < tools->size() && f.ok(); ++i) {
      const OrderedJson& t = (*tools)[i];
      const std::string at = fmt::format("tools.{}", i);
      if (!t.is_object() || !t.contains("name") || !t["name"].is_string()) {
        f.fail(at, "expected {\"name\", \"description\", \"input_schema\"}");
        break;
      }
      if (t.contains("type") && t["type"].is_string() && t["type"] != "custom" && !t.contains("input_schema"))
        continue;  // server tools (web search, ...) are not offered
      OrderedJson fn = {{"name", t["name"]}};
      if (t.contains("description")) fn["description"] = t["description"];
      if (t.contains("input_schema")) fn["parameters"] = t["input_schema"];
      p.tools.push_back({{"type", "function"}, {"function", fn}});
    }
    detail::check_openai_tools(f, "tools", p.tools);
  }
  if (const OrderedJson* tc = f.object("tool_choice")) {
    const std::string type = tc->contains("type") && (*tc)["type"].is_string() ? (*tc)["type"].get<std::string>() : "";
    if (type == "auto") p.tool_use.choice = ToolUse::Choice::kAuto;
    else if (type == "any") p.tool_use.choice = ToolUse::Choice::kRequired;
    else if (type == "none") p.tool_use.choice = ToolUse::Choice::kNone;
    else if (type == "tool" && tc->contains("name") && (*tc)["name"].is_string()) {
      p.tool_use.choice = ToolUse::Choice::kNamed;
      p.tool_use.name = (*tc)["name"];
    } else {
      f.fail("tool_choice", "expected {\"type\": \"auto\" | \"any\" | \"none\" | \"tool\", \"name\"}");
    }
    if (tc->contains("disable_parallel_tool_use") && (*tc)["disable_parallel_tool_use"] == true)
      p.tool_use.parallel = false;
  }
  return f.ok();
}

void anthropic_thinking(Fields& f, PromptSpec& p) {
  p.chat.thinking = text::ThinkingMode::kChat;  // Anthropic's default: no extended thinking
  if (const OrderedJson* th = f.object("thinking")) {
    const std::string type = th->contains("type") && (*th)["type"].is_string() ? (*th)["type"].get<std::string>() : "";
    if (type == "enabled" || type == "adaptive") p.chat.thinking = text::ThinkingMode::kThinking;
    else if (type != "disabled") f.fail("thinking", "expected {\"type\": \"enabled\", \"budget_tokens\": N} or {\"type\": \"disabled\"}");
  }
}

}  // namespace

Result<ParsedRequest> parse_messages(const OrderedJson& body, const ApiContext& ctx, ApiError& err) {
  err = {};
  Fields f(body, "", err);
  f.only({"model", "messages", "system", "max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k",
          "tools", "tool_choice", "thinking", "metadata", "service_tier", "container", "priority", "dsv4", "context_management",
          "mcp_servers"});
  ParsedRequest r;
  r.request = body;
  detail::check_model(f, ctx, r.model, true);
  PromptSpec p;
  p.chat = chat_defaults(ctx);
  anthropic_conversation(f, body, p);
  if (f.ok() && !f.has("max_tokens")) f.fail("max_tokens", "required");
  read_max_tokens(f, ctx, "max_tokens", r.spec);
  r.stream = f.boolean("stream").value_or(false);
  (void)f.number("temperature", 0, 1);  // Anthropic's range; read_sampling takes the value
  detail::read_sampling(f, r.spec, ctx);
  read_stop(f, "stop_sequences", 16, r.spec.stop_strings, false);
  anthropic_tools(f, p);
  anthropic_thinking(f, p);
  detail::build_prompt(f, p, ctx, r.spec);
  if (!f.ok()) return Status::error(err.message);
  r.tools = r.spec.tools;
  return r;
}

Result<int64_t> count_message_tokens(const OrderedJson& body, const ApiContext& ctx, ApiError& err) {
  err = {};
  Fields f(body, "", err);
  f.only({"model", "messages", "system", "tools", "tool_choice", "thinking", "mcp_servers"});
  std::string model;
  detail::check_model(f, ctx, model, true);
  PromptSpec p;
  p.chat = chat_defaults(ctx);
  anthropic_conversation(f, body, p);
  anthropic_tools(f, p);
  anthropic_thinking(f, p);
  runtime::RequestSpec spec;
  detail::build_prompt(f, p, ctx, spec);
  if (!f.ok()) return Status::error(err.message);
  return static_cast<int64_t>(spec.prompt.size());
}

}  // namespace dsv4::server
