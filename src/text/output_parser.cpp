#include "text/output_parser.h"

#include <cmath>

#include <fmt/format.h>

namespace dsv4::text {
namespace {

constexpr std::string_view kCallsStart = "\n\n<｜DSML｜tool_calls";
constexpr std::string_view kCallsEnd = "</｜DSML｜tool_calls>";
constexpr std::string_view kInvokeStart = "<｜DSML｜invoke";
constexpr std::string_view kInvokeEnd = "</｜DSML｜invoke";
constexpr std::string_view kParamStart = "<｜DSML｜parameter";
constexpr std::string_view kParamEnd = "</｜DSML｜parameter";

// Length of the longest suffix of `s` that is a proper prefix of one of `markers`: text
// that may still turn into a marker and must be held back.
size_t partial_marker_len(std::string_view s, std::initializer_list<std::string_view> markers) {
  size_t best = 0;
  for (std::string_view m : markers)
    for (size_t k = std::min(s.size(), m.size() - 1); k > best; --k)
      if (s.substr(s.size() - k) == m.substr(0, k)) {
        best = k;
        break;
      }
  return best;
}

struct Found {
  size_t pos = std::string_view::npos;
  std::string_view marker;
};
Found find_first(std::string_view s, std::initializer_list<std::string_view> markers) {
  Found f;
  for (std::string_view m : markers)
    if (size_t p = s.find(m); p < f.pos) f = {p, m};
  return f;
}

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

std::string preview(std::string_view s) {
  std::string p(s.substr(0, 60));
  return python_json_string(p) + (s.size() > 60 ? "…" : "");
}

// One invoke body (after "<｜DSML｜invoke", before "</｜DSML｜invoke"), read as the official
// parser does but tolerating extra whitespace between elements.
struct RawInvoke {
  std::string name;
  std::vector<std::pair<std::string, std::string>> params;
  std::vector<bool> is_string;
};
Result<RawInvoke> parse_invoke(std::string_view body) {
  RawInvoke inv;
  size_t p = 0;
  while (p < body.size() && is_space(body[p])) ++p;
  if (body.substr(p, 6) != "name=\"") return Status::errorf("invoke without name=\"…\": {}", preview(body));
  p += 6;
  const size_t name_end = body.find("\">", p);
  if (name_end == std::string_view::npos) return Status::errorf("invoke name not closed: {}", preview(body));
  inv.name = std::string(body.substr(p, name_end - p));
  p = name_end + 2;
  for (;;) {
    while (p < body.size() && is_space(body[p])) ++p;
    if (p == body.size()) break;
    if (body.substr(p, kParamStart.size()) != kParamStart)
      return Status::errorf("invoke '{}': expected a parameter at {}", inv.name, preview(body.substr(p)));
    p += kParamStart.size();
    if (body.substr(p, 7) != " name=\"")
      return Status::errorf("invoke '{}': parameter without name: {}", inv.name, preview(body.substr(p)));
    p += 7;
    const size_t key_end = body.find("\" string=\"", p);
    if (key_end == std::string_view::npos)
      return Status::errorf("invoke '{}': parameter without string=\"true|false\": {}", inv.name, preview(body.substr(p)));
    std::string key(body.substr(p, key_end - p));
    p = key_end + 10;
    bool is_string;
    if (body.substr(p, 6) == "true\">") {
      is_string = true;
      p += 6;
    } else if (body.substr(p, 7) == "false\">") {
      is_string = false;
      p += 7;
    } else {
      return Status::errorf("invoke '{}': parameter '{}': string= must be \"true\" or \"false\"", inv.name, key);
    }
    const size_t value_end = body.find(kParamEnd, p);
    if (value_end == std::string_view::npos)
      return Status::errorf("invoke '{}': parameter '{}' not closed", inv.name, key);
    std::string value(body.substr(p, value_end - p));
    p = value_end + kParamEnd.size();
    if (p >= body.size() || body[p] != '>')
      return Status::errorf("invoke '{}': parameter '{}': expected '>' after the closing tag", inv.name, key);
    ++p;
    for (const auto& [k, v] : inv.params)
      if (k == key) return Status::errorf("invoke '{}': parameter '{}' given twice", inv.name, key);
    inv.params.emplace_back(std::move(key), std::move(value));
    inv.is_string.push_back(is_string);
  }
  return inv;
}

const OrderedJson* find_tool(const OrderedJson& tools, std::string_view name) {
  for (const OrderedJson& t : tools) {
    const OrderedJson* f = t.is_object() && t.contains("function") ? &t["function"] : &t;
    if (f->is_object() && f->contains("name") && (*f)["name"].is_string() && (*f)["name"].get<std::string>() == name)
      return f;
  }
  return nullptr;
}

bool has_type(const OrderedJson& v, std::string_view type) {
  if (type == "string") return v.is_string();
  if (type == "number") return v.is_number();
  if (type == "integer")
    return v.is_number_integer() || (v.is_number_float() && std::isfinite(v.get<double>()) &&
                                     std::floor(v.get<double>()) == v.get<double>());
  if (type == "boolean") return v.is_boolean();
  if (type == "array") return v.is_array();
  if (type == "object") return v.is_object();
  if (type == "null") return v.is_null();
  return true;  // unknown type names constrain nothing
}

}  // namespace

std::string check_json_schema(const OrderedJson& v, const OrderedJson& schema, const std::string& path) {
  if (!schema.is_object()) return "";
  if (schema.contains("type")) {
    const OrderedJson& t = schema["type"];
    bool ok = false;
    if (t.is_string()) ok = has_type(v, t.get<std::string>());
    else if (t.is_array())
      for (const OrderedJson& x : t) ok = ok || (x.is_string() && has_type(v, x.get<std::string>()));
    else ok = true;
    if (!ok) return fmt::format("{}: {} is not of type {}", path, python_json_dumps(v), python_json_dumps(t));
  }
  if (schema.contains("enum") && schema["enum"].is_array()) {
    bool found = false;
    for (const OrderedJson& e : schema["enum"]) found = found || e == v;
    if (!found) return fmt::format("{}: {} is not one of {}", path, python_json_dumps(v), python_json_dumps(schema["enum"]));
  }
  if (schema.contains("const") && schema["const"] != v)
    return fmt::format("{}: {} is not {}", path, python_json_dumps(v), python_json_dumps(schema["const"]));
  for (const char* key : {"anyOf", "oneOf"}) {
    if (!schema.contains(key) || !schema[key].is_array()) continue;
    size_t matches = 0;
    for (const OrderedJson& alt : schema[key]) matches += check_json_schema(v, alt, path).empty();
    if (matches == 0 || (std::string_view(key) == "oneOf" && matches != 1))
      return fmt::format("{}: {} matches {} of the {} alternatives", path, python_json_dumps(v), matches, key);
  }
  if (v.is_number()) {
    const double x = v.get<double>();
    if (schema.contains("minimum") && schema["minimum"].is_number() && x < schema["minimum"].get<double>())
      return fmt::format("{}: {} is below the minimum {}", path, python_json_dumps(v), python_json_dumps(schema["minimum"]));
    if (schema.contains("maximum") && schema["maximum"].is_number() && x > schema["maximum"].get<double>())
      return fmt::format("{}: {} is above the maximum {}", path, python_json_dumps(v), python_json_dumps(schema["maximum"]));
  }
  auto limit = [&](const char* key, size_t n, bool is_min) -> std::string {
    if (!schema.contains(key) || !schema[key].is_number_unsigned()) return "";
    const auto bound = schema[key].get<uint64_t>();
    if (is_min ? n < bound : n > bound) return fmt::format("{}: length {} violates {} {}", path, n, key, bound);
    return "";
  };
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    size_t chars = 0;
    for (char c : s) chars += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
    for (auto [key, is_min] : {std::pair{"minLength", true}, {"maxLength", false}})
      if (auto e = limit(key, chars, is_min); !e.empty()) return e;
  }
  if (v.is_array()) {
    for (auto [key, is_min] : {std::pair{"minItems", true}, {"maxItems", false}})
      if (auto e = limit(key, v.size(), is_min); !e.empty()) return e;
    if (schema.contains("items") && schema["items"].is_object())
      for (size_t i = 0; i < v.size(); ++i)
        if (auto e = check_json_schema(v[i], schema["items"], fmt::format("{}[{}]", path, i)); !e.empty()) return e;
  }
  if (v.is_object()) {
    if (schema.contains("required") && schema["required"].is_array())
      for (const OrderedJson& r : schema["required"])
        if (r.is_string() && !v.contains(r.get<std::string>()))
          return fmt::format("{}: required property '{}' is missing", path, r.get<std::string>());
    const OrderedJson* props = schema.contains("properties") && schema["properties"].is_object() ? &schema["properties"] : nullptr;
    const bool closed = schema.contains("additionalProperties") && schema["additionalProperties"] == false;
    for (const auto& [k, item] : v.items()) {
      if (props && props->contains(k)) {
        if (auto e = check_json_schema(item, (*props)[k], path + "." + k); !e.empty()) return e;
      } else if (closed) {
        return fmt::format("{}: property '{}' is not allowed", path, k);
      }
    }
  }
  return "";
}

OutputParser::OutputParser(ThinkingMode mode, OrderedJson tools)
    : phase_(mode == ThinkingMode::kThinking ? Phase::kReasoning : Phase::kContent),
      tools_(tools.is_array() ? std::move(tools) : OrderedJson::array()) {}

void OutputParser::emit_reasoning(std::string_view s, OutputDelta& d) {
  out_.reasoning.append(s);
  d.reasoning.append(s);
}

void OutputParser::emit_content(std::string_view s, OutputDelta& d) {
  out_.content.append(s);
  d.content.append(s);
}

OutputDelta OutputParser::push(std::string_view text) {
  OutputDelta d;
  buf_.append(text);
  run(d, false);
  return d;
}

OutputDelta OutputParser::finish() {
  OutputDelta d;
  run(d, true);
  return d;
}

ParsedToolCall OutputParser::check_call(ParsedToolCall call, const std::vector<std::pair<std::string, std::string>>& raw,
                                        const std::vector<bool>& is_string) const {
  // The arguments text is rebuilt exactly as the official parser does; checking needs a
  // parsed copy, where string="false" values must be JSON.
  std::string args = "{";
  OrderedJson parsed = OrderedJson::object();
  for (size_t i = 0; i < raw.size(); ++i) {
    const auto& [key, value] = raw[i];
    if (i) args += ", ";
    args += python_json_string(key) + ": " + (is_string[i] ? python_json_string(value) : value);
    if (is_string[i]) {
      parsed[key] = value;
    } else {
      OrderedJson v = OrderedJson::parse(value, nullptr, false);
      if (v.is_discarded() && call.error.empty())
        call.error = fmt::format("tool '{}': parameter '{}' has string=\"false\" but {} is not JSON", call.name, key,
                                 preview(value));
      parsed[key] = v.is_discarded() ? OrderedJson(value) : v;
    }
  }
  call.arguments = args + "}";
  if (!call.error.empty() || tools_.empty()) return call;
  const OrderedJson* tool = find_tool(tools_, call.name);
  if (!tool) {
    call.error = fmt::format("tool '{}' is not one of the request's tools", call.name);
    return call;
  }
  if (tool->contains("parameters"))
    if (std::string e = check_json_schema(parsed, (*tool)["parameters"], "arguments"); !e.empty())
      call.error = fmt::format("tool '{}': {}", call.name, e);
  return call;
}

// Consumes complete invokes from buf_ (which starts after "\n\n<｜DSML｜tool_calls").
// Returns false when it needs more text.
bool OutputParser::parse_calls(OutputDelta& d, bool at_end) {
  auto give_up = [&](const std::string& why) {
    // Malformed: keep the text as content so nothing the model wrote is lost.
    out_.errors.push_back("malformed DSML tool call: " + why);
    const Found eos = find_first(buf_, {kEosText});
    emit_content(std::string(kCallsStart) + buf_.substr(0, eos.pos), d);
    if (eos.pos != std::string::npos) {
      out_.saw_eos = true;
      buf_.erase(0, eos.pos + kEosText.size());
      phase_ = Phase::kDone;
    } else {
      buf_.clear();
      phase_ = Phase::kContent;
      calls_failed_ = true;
    }
    return true;
  };
  for (;;) {
    size_t p = 0;
    if (p < buf_.size() && buf_[p] == '>') ++p;
    while (p < buf_.size() && is_space(buf_[p])) ++p;
    std::string_view rest = std::string_view(buf_).substr(p);
    if (rest.starts_with(kCallsEnd)) {
      buf_.erase(0, p + kCallsEnd.size());
      phase_ = Phase::kAfterCalls;
      return true;
    }
    if (rest.starts_with(kInvokeStart)) {
      const size_t end = rest.find(kInvokeEnd);
      if (end == std::string_view::npos) {
        if (rest.find(kEosText) != std::string_view::npos || rest.find(kCallsEnd) != std::string_view::npos)
          return give_up("an invoke is not closed");
        if (at_end) return give_up("the output ended inside a tool call");
        return false;
      }
      auto inv = parse_invoke(rest.substr(kInvokeStart.size(), end - kInvokeStart.size()));
      if (!inv.is_ok()) return give_up(inv.status().message());
      ParsedToolCall call;
      call.name = inv->name;
      call = check_call(std::move(call), inv->params, inv->is_string);
      out_.tool_calls.push_back(call);
      d.tool_calls.push_back(std::move(call));
      buf_.erase(0, p + end + kInvokeEnd.size());
      continue;
    }
    const bool may_grow = rest.empty() || std::string_view(kInvokeStart).starts_with(rest) ||
                          std::string_view(kCallsEnd).starts_with(rest);
    if (may_grow && !at_end) return false;
    return give_up(rest.empty() ? "the output ended inside the tool-call block"
                                : "expected an invoke or the end of the block at " + preview(rest));
  }
}

void OutputParser::run(OutputDelta& d, bool at_end) {
  for (;;) {
    switch (phase_) {
      case Phase::kReasoning: {
        const Found f = find_first(buf_, {kThinkEndText, kCallsStart, kEosText});
        if (f.pos == std::string::npos) {
          const size_t hold = at_end ? 0 : partial_marker_len(buf_, {kThinkEndText, kCallsStart, kEosText});
          emit_reasoning(std::string_view(buf_).substr(0, buf_.size() - hold), d);
          buf_.erase(0, buf_.size() - hold);
          if (at_end) {
            out_.errors.push_back("the output ended inside the reasoning (no </think>)");
            phase_ = Phase::kDone;
          }
          return;
        }
        emit_reasoning(std::string_view(buf_).substr(0, f.pos), d);
        buf_.erase(0, f.pos + f.marker.size());
        if (f.marker == kThinkEndText) {
          phase_ = Phase::kContent;
        } else if (f.marker == kCallsStart) {
          out_.errors.push_back("tool calls began before </think>");
          phase_ = Phase::kToolCalls;
        } else {
          out_.errors.push_back("the output ended inside the reasoning (EOS before </think>)");
          out_.saw_eos = true;
          phase_ = Phase::kDone;
        }
        break;
      }
      case Phase::kContent: {
        // After a malformed call block the rest is plain content up to EOS.
        const Found f = calls_failed_ ? find_first(buf_, {kEosText}) : find_first(buf_, {kCallsStart, kEosText});
        if (f.pos == std::string::npos) {
          const size_t hold = at_end ? 0
                              : calls_failed_ ? partial_marker_len(buf_, {kEosText})
                                              : partial_marker_len(buf_, {kCallsStart, kEosText});
          emit_content(std::string_view(buf_).substr(0, buf_.size() - hold), d);
          buf_.erase(0, buf_.size() - hold);
          if (at_end) phase_ = Phase::kDone;
          return;
        }
        emit_content(std::string_view(buf_).substr(0, f.pos), d);
        buf_.erase(0, f.pos + f.marker.size());
        if (f.marker == kCallsStart) {
          phase_ = Phase::kToolCalls;
        } else {
          out_.saw_eos = true;
          phase_ = Phase::kDone;
        }
        break;
      }
      case Phase::kToolCalls:
        if (!parse_calls(d, at_end)) return;
        break;
      case Phase::kAfterCalls: {
        size_t p = 0;
        while (p < buf_.size() && is_space(buf_[p])) ++p;
        std::string_view rest = std::string_view(buf_).substr(p);
        if (rest.starts_with(kEosText)) {
          out_.saw_eos = true;
          buf_.erase(0, p + kEosText.size());
          phase_ = Phase::kDone;
        } else if (std::string_view(kEosText).starts_with(rest) && !at_end) {
          return;
        } else {
          if (!rest.empty()) {
            out_.errors.push_back("text after the tool calls: " + preview(rest));
            emit_content(rest, d);
          }
          buf_.clear();
          phase_ = Phase::kDone;
        }
        break;
      }
      case Phase::kDone:
        if (!buf_.empty()) {
          size_t p = 0;
          while (p < buf_.size() && is_space(buf_[p])) ++p;
          if (p < buf_.size()) out_.errors.push_back("text after the end of the reply: " + preview(buf_.substr(p)));
          buf_.clear();
        }
        return;
    }
  }
}

}  // namespace dsv4::text
