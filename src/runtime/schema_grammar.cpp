#include "runtime/schema_grammar.h"

#include <fmt/format.h>

#include <array>
#include <map>
#include <optional>

namespace dsv4::runtime {
namespace {

using text::OrderedJson;
using Seq = Grammar::Sequence;

constexpr int kMaxDigits = 16;
constexpr int64_t kMaxBoundedRepeat = 64;  // larger bounds are treated as unbounded
constexpr int kMaxSchemaDepth = 64;
constexpr uint32_t kMaxSentence = 1 << 16;  // bytes of the shortest output a schema may demand

ByteClass range(int lo, int hi) {
  ByteClass c;
  for (int b = lo; b <= hi; ++b) c.set(static_cast<size_t>(b));
  return c;
}

Seq cat(Seq a, const Seq& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

class Compiler {
 public:
  Compiler(Grammar& g, const OrderedJson& root, bool dsml) : g_(g), root_(root), dsml_(dsml) {}

  // A rule for the shortest grammar piece of each kind.
  uint32_t rule_of(std::vector<Seq> alternatives) {
    const uint32_t r = g_.add_rule();
    for (Seq& s : alternatives) g_.add_alternative(r, std::move(s));
    return r;
  }
  Grammar::Symbol sym(uint32_t rule) { return g_.ref(rule); }
  Seq lit(std::string_view s) { return g_.literal(s); }
  Grammar::Symbol cls(const ByteClass& c) { return g_.byte_class(c); }

  // "the rest of `w`-avoiding text": any bytes in which `w` does not occur, then `w` and
  // `tail` (or, with may_end, the end anywhere before w completes). A KMP automaton
  // written as right-recursive rules, one per matched prefix length.
  uint32_t avoid_then(std::string_view w, const Seq& tail, bool may_end) {
    const size_t n = w.size();
    std::vector<size_t> fail(n + 1, 0);
    for (size_t i = 1, k = 0; i < n; ++i) {
      while (k && w[i] != w[k]) k = fail[k];
      if (w[i] == w[k]) ++k;
      fail[i + 1] = k;
    }
    auto next = [&](size_t k, unsigned char b) {
      while (k && static_cast<unsigned char>(w[k]) != b) k = fail[k];
      return static_cast<unsigned char>(w[k]) == b ? k + 1 : 0;
    };
    std::vector<uint32_t> state(n);
    for (size_t k = 0; k < n; ++k) state[k] = g_.add_rule();
    for (size_t k = 0; k < n; ++k) {
      std::map<size_t, ByteClass> by_next;
      for (int b = 0; b < 256; ++b) by_next[next(k, static_cast<unsigned char>(b))].set(static_cast<size_t>(b));
      for (const auto& [to, c] : by_next) {
        if (to == n) g_.add_alternative(state[k], cat(Seq{cls(c)}, tail));
        else g_.add_alternative(state[k], Seq{cls(c), sym(state[to])});
      }
      if (may_end) g_.add_alternative(state[k], {});
    }
    return state[0];
  }

  // `item` repeated between lo and hi times (hi < 0: unbounded), `sep` between.
  uint32_t repeat(const Seq& item, const Seq& sep, int64_t lo, int64_t hi) {
    if (hi >= 0 && hi > kMaxBoundedRepeat) hi = -1;
    lo = std::min<int64_t>(lo, kMaxBoundedRepeat);
    if (hi >= 0 && hi < lo) hi = lo;
    // rest[k]: what may follow the k-th item.
    uint32_t unbounded = 0;
    if (hi < 0) {
      unbounded = g_.add_rule();
      g_.add_alternative(unbounded, {});
      g_.add_alternative(unbounded, cat(cat(sep, item), Seq{sym(unbounded)}));
    }
    const int64_t last = hi < 0 ? lo : hi;
    std::vector<uint32_t> rest(static_cast<size_t>(last + 1));
    for (int64_t k = last; k >= 1; --k) {
      if (hi < 0 && k == last) {
        rest[k] = unbounded;
        continue;
      }
      std::vector<Seq> alts;
      if (k >= lo) alts.push_back({});
      if (k < last || hi < 0) alts.push_back(cat(cat(sep, item), Seq{sym(rest[k + 1])}));
      rest[k] = rule_of(std::move(alts));
    }
    std::vector<Seq> first;
    if (lo == 0) first.push_back({});
    if (last >= 1 || hi < 0) first.push_back(cat(item, Seq{sym(hi < 0 && last == 0 ? unbounded : rest[1])}));
    return rule_of(std::move(first));
  }

  uint32_t digits(int lo, int hi) { return repeat(Seq{cls(range('0', '9'))}, {}, lo, hi); }

  uint32_t integer() {
    if (integer_) return *integer_;
    const uint32_t sign = rule_of({{}, lit("-")});
    const uint32_t magnitude = rule_of({lit("0"), Seq{cls(range('1', '9')), sym(digits(0, kMaxDigits - 1))}});
    integer_ = rule_of({Seq{sym(sign), sym(magnitude)}});
    return *integer_;
  }
  uint32_t number() {
    if (number_) return *number_;
    const uint32_t frac = rule_of({{}, Seq{cls(range('.', '.')), sym(digits(1, kMaxDigits))}});
    ByteClass e;
    e.set('e');
    e.set('E');
    ByteClass pm;
    pm.set('+');
    pm.set('-');
    // At most 2 exponent digits: with at most 16 integer digits every number is a finite
    // double (below 1e116), which JSON parsers accept; 3 digits allowed e.g. 3E337, which
    // overflows and is refused (nlohmann's parser: "number overflow").
    const uint32_t exp = rule_of({{}, Seq{cls(e), sym(rule_of({{}, Seq{cls(pm)}})), sym(digits(1, 2))}});
    number_ = rule_of({Seq{sym(integer()), sym(frac), sym(exp)}});
    return *number_;
  }

  // One character inside a JSON string: unescaped valid UTF-8 (no control characters;
  // in DSML values no '<', so "</｜DSML｜parameter" cannot appear) or an escape.
  uint32_t string_char() {
    if (string_char_) return *string_char_;
    ByteClass ascii = range(0x20, 0x7f);
    ascii.reset('"');
    ascii.reset('\\');
    if (dsml_) ascii.reset('<');
    const ByteClass cont = range(0x80, 0xbf);
    std::vector<Seq> alts{{cls(ascii)},
                          {cls(range(0xc2, 0xdf)), cls(cont)},
                          {cls(range(0xe0, 0xe0)), cls(range(0xa0, 0xbf)), cls(cont)},
                          {cls(range(0xe1, 0xec)), cls(cont), cls(cont)},
                          {cls(range(0xed, 0xed)), cls(range(0x80, 0x9f)), cls(cont)},
                          {cls(range(0xee, 0xef)), cls(cont), cls(cont)},
                          {cls(range(0xf0, 0xf0)), cls(range(0x90, 0xbf)), cls(cont), cls(cont)},
                          {cls(range(0xf1, 0xf3)), cls(cont), cls(cont), cls(cont)},
                          {cls(range(0xf4, 0xf4)), cls(range(0x80, 0x8f)), cls(cont), cls(cont)}};
    ByteClass esc;
    for (char c : std::string_view("\"\\/bfnrt")) esc.set(static_cast<unsigned char>(c));
    ByteClass hex = range('0', '9') | range('a', 'f') | range('A', 'F');
    alts.push_back({cls(range('\\', '\\')), cls(esc)});
    alts.push_back({cls(range('\\', '\\')), cls(range('u', 'u')), cls(hex), cls(hex), cls(hex), cls(hex)});
    string_char_ = rule_of(std::move(alts));
    return *string_char_;
  }
  uint32_t string(int64_t lo, int64_t hi) {
    const uint32_t body = repeat(Seq{sym(string_char())}, {}, lo, hi);
    return rule_of({cat(cat(lit("\""), Seq{sym(body)}), lit("\""))});
  }

  uint32_t any_value() {
    if (any_) return *any_;
    any_ = g_.add_rule();
    const uint32_t str = string(0, -1);
    const Seq member = cat(Seq{sym(str)}, cat(lit(": "), Seq{sym(*any_)}));
    const uint32_t members = repeat(member, lit(", "), 0, -1);
    const uint32_t items = repeat(Seq{sym(*any_)}, lit(", "), 0, -1);
    g_.add_alternative(*any_, cat(cat(lit("{"), Seq{sym(members)}), lit("}")));
    g_.add_alternative(*any_, cat(cat(lit("["), Seq{sym(items)}), lit("]")));
    g_.add_alternative(*any_, Seq{sym(str)});
    g_.add_alternative(*any_, Seq{sym(number())});
    for (const char* w : {"true", "false", "null"}) g_.add_alternative(*any_, lit(w));
    return *any_;
  }

  Result<const OrderedJson*> resolve(const std::string& ref) {
    if (ref == "#") return &root_;
    for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
      const std::string p = prefix;
      if (ref.rfind(p, 0) == 0) {
        const std::string section = p.substr(2, p.size() - 3);
        const std::string name = ref.substr(p.size());
        if (root_.is_object() && root_.contains(section) && root_[section].is_object() && root_[section].contains(name))
          return &root_[section][name];
      }
    }
    return Status::errorf("schema: $ref \"{}\" is not a local definition (#, #/$defs/NAME, #/definitions/NAME)", ref);
  }

  int64_t count(const OrderedJson& s, const char* key, int64_t fallback) {
    if (!s.contains(key) || !s[key].is_number_integer()) return fallback;
    return std::max<int64_t>(0, s[key].get<int64_t>());
  }

  Result<uint32_t> value(const OrderedJson& s, int depth) {
    if (depth > kMaxSchemaDepth) return Status::errorf("schema: nested deeper than {} levels", kMaxSchemaDepth);
    if (s.is_boolean()) {
      if (!s.get<bool>()) return Status::error("schema: false admits no value");
      return any_value();
    }
    if (!s.is_object()) return Status::errorf("schema: expected an object or a boolean, got {}", text::python_json_dumps(s));
    if (s.contains("$ref")) {
      if (!s["$ref"].is_string()) return Status::error("schema: $ref must be a string");
      const std::string ref = s["$ref"];
      if (auto it = refs_.find(ref); it != refs_.end()) return it->second;
      const uint32_t r = g_.add_rule();
      refs_[ref] = r;
      DSV4_ASSIGN_OR_RETURN(const OrderedJson* target, resolve(ref));
      DSV4_ASSIGN_OR_RETURN(uint32_t inner, value(*target, depth + 1));
      g_.add_alternative(r, {sym(inner)});
      return r;
    }
    if (s.contains("const")) return rule_of({lit(text::python_json_dumps(s["const"]))});
    if (s.contains("enum")) {
      if (!s["enum"].is_array() || s["enum"].empty()) return Status::error("schema: enum must be a non-empty array");
      std::vector<Seq> alts;
      for (const OrderedJson& v : s["enum"]) alts.push_back(lit(text::python_json_dumps(v)));
      return rule_of(std::move(alts));
    }
    for (const char* key : {"anyOf", "oneOf"})
      if (s.contains(key)) {
        if (!s[key].is_array() || s[key].empty()) return Status::errorf("schema: {} must be a non-empty array", key);
        std::vector<Seq> alts;
        for (const OrderedJson& sub : s[key]) {
          DSV4_ASSIGN_OR_RETURN(uint32_t r, value(sub, depth + 1));
          alts.push_back({sym(r)});
        }
        return rule_of(std::move(alts));
      }
    if (s.contains("allOf")) {
      if (!s["allOf"].is_array() || s["allOf"].empty()) return Status::error("schema: allOf must be a non-empty array");
      return value(s["allOf"][0], depth + 1);
    }
    if (!s.contains("type")) {
      if (s.contains("properties")) return object(s, depth);
      if (s.contains("items")) return array(s, depth);
      return any_value();
    }
    const OrderedJson& t = s["type"];
    if (t.is_array()) {
      if (t.empty()) return Status::error("schema: type list is empty");
      std::vector<Seq> alts;
      for (const OrderedJson& one : t) {
        if (!one.is_string()) return Status::error("schema: type list entries must be strings");
        DSV4_ASSIGN_OR_RETURN(uint32_t r, typed(s, one.get<std::string>(), depth));
        alts.push_back({sym(r)});
      }
      return rule_of(std::move(alts));
    }
    if (!t.is_string()) return Status::error("schema: type must be a string or a list of strings");
    return typed(s, t.get<std::string>(), depth);
  }

  Result<uint32_t> typed(const OrderedJson& s, const std::string& type, int depth) {
    if (type == "string") return string(count(s, "minLength", 0), s.contains("maxLength") ? count(s, "maxLength", 0) : -1);
    if (type == "integer") return integer();
    if (type == "number") return number();
    if (type == "boolean") return rule_of({lit("true"), lit("false")});
    if (type == "null") return rule_of({lit("null")});
    if (type == "object") return object(s, depth);
    if (type == "array") return array(s, depth);
    return Status::errorf("schema: unknown type \"{}\"", type);
  }

  Result<uint32_t> array(const OrderedJson& s, int depth) {
    uint32_t item = 0;
    if (s.contains("items") && !s["items"].is_array()) {
      DSV4_ASSIGN_OR_RETURN(item, value(s["items"], depth + 1));
    } else {
      item = any_value();
    }
    const uint32_t body = repeat(Seq{sym(item)}, lit(", "), count(s, "minItems", 0),
                                 s.contains("maxItems") ? count(s, "maxItems", 0) : -1);
    return rule_of({cat(cat(lit("["), Seq{sym(body)}), lit("]"))});
  }

  Result<uint32_t> object(const OrderedJson& s, int depth) {
    const bool closed = s.contains("additionalProperties") && s["additionalProperties"].is_boolean() &&
                        !s["additionalProperties"].get<bool>();
    if (!s.contains("properties") || !s["properties"].is_object() || s["properties"].empty()) {
      if (closed) return rule_of({lit("{}")});
      uint32_t v = 0;
      if (s.contains("additionalProperties") && s["additionalProperties"].is_object()) {
        DSV4_ASSIGN_OR_RETURN(v, value(s["additionalProperties"], depth + 1));
      } else {
        v = any_value();
      }
      const Seq member = cat(Seq{sym(string(0, -1))}, cat(lit(": "), Seq{sym(v)}));
      return rule_of({cat(cat(lit("{"), Seq{sym(repeat(member, lit(", "), 0, -1))}), lit("}"))});
    }
    std::vector<std::pair<Seq, bool>> props;  // "key": value, required
    for (const auto& [key, sub] : s["properties"].items()) {
      bool required = false;
      if (s.contains("required") && s["required"].is_array())
        for (const OrderedJson& r : s["required"]) required = required || (r.is_string() && r.get<std::string>() == key);
      DSV4_ASSIGN_OR_RETURN(uint32_t v, value(sub, depth + 1));
      props.push_back({cat(lit(text::python_json_string(key) + ": "), Seq{sym(v)}), required});
    }
    const uint32_t body = chain(props, lit(", "));
    return rule_of({cat(cat(lit("{"), Seq{sym(body)}), lit("}"))});
  }

  // Items in order, required ones always, optional ones maybe, `sep` between those
  // written: rule (i, first) = what may come from item i on.
  uint32_t chain(const std::vector<std::pair<Seq, bool>>& items, const Seq& sep) {
    std::vector<std::array<uint32_t, 2>> r(items.size() + 1);
    r[items.size()] = {rule_of({{}}), rule_of({{}})};
    for (size_t i = items.size(); i-- > 0;) {
      for (int first = 0; first < 2; ++first) {
        std::vector<Seq> alts;
        alts.push_back(cat(cat(first ? Seq{} : sep, items[i].first), Seq{sym(r[i + 1][0])}));
        if (!items[i].second) alts.push_back({sym(r[i + 1][first])});
        r[i][first] = rule_of(std::move(alts));
      }
    }
    return r[0][1];
  }

  // The DSML call block of chat.cpp for `tools`, after its opening marker
  // "\n\n<｜DSML｜tool_calls".
  Result<Seq> tool_calls_after_marker(const OrderedJson& tools, bool parallel) {
    std::vector<Seq> invokes;
    for (const OrderedJson& tool : tools) {
      const OrderedJson& f = tool.is_object() && tool.contains("function") ? tool["function"] : tool;
      if (!f.is_object() || !f.contains("name") || !f["name"].is_string())
        return Status::error("tools: a tool has no function name");
      const std::string name = f["name"];
      std::vector<std::pair<Seq, bool>> params;
      if (f.contains("parameters") && f["parameters"].is_object() && f["parameters"].contains("properties") &&
          f["parameters"]["properties"].is_object()) {
        const OrderedJson& schema = f["parameters"];
        for (const auto& [key, sub] : schema["properties"].items()) {
          bool required = false;
          if (schema.contains("required") && schema["required"].is_array())
            for (const OrderedJson& r : schema["required"]) required = required || (r.is_string() && r.get<std::string>() == key);
          DSV4_ASSIGN_OR_RETURN(Seq p, parameter(key, sub));
          params.push_back({std::move(p), required});
        }
      }
      const uint32_t body = chain(params, lit("\n"));
      invokes.push_back(cat(cat(lit("<｜DSML｜invoke name=\"" + name + "\">\n"), Seq{sym(body)}),
                            lit("\n</｜DSML｜invoke>")));
    }
    if (invokes.empty()) return Status::error("tools: no tool to call");
    const uint32_t invoke = rule_of(std::move(invokes));
    const uint32_t all = repeat(Seq{sym(invoke)}, lit("\n"), 1, parallel ? -1 : 1);
    return cat(cat(lit(">\n"), Seq{sym(all)}), lit("\n</｜DSML｜tool_calls>"));
  }

  Result<Seq> parameter(const std::string& key, const OrderedJson& sub) {
    const std::string open = "<｜DSML｜parameter name=\"" + key + "\" string=\"";
    const std::string close = "</｜DSML｜parameter>";
    auto all_strings = [](const OrderedJson& list) {
      if (!list.is_array() || list.empty()) return false;
      for (const OrderedJson& v : list)
        if (!v.is_string()) return false;
      return true;
    };
    if (sub.is_object() && sub.contains("enum") && all_strings(sub["enum"])) {
      std::vector<Seq> alts;
      for (const OrderedJson& v : sub["enum"]) alts.push_back(lit(v.get<std::string>()));
      return cat(cat(lit(open + "true\">"), Seq{sym(rule_of(std::move(alts)))}), lit(close));
    }
    if (sub.is_object() && sub.contains("const") && sub["const"].is_string())
      return lit(open + "true\">" + sub["const"].get<std::string>() + close);
    if (sub.is_object() && sub.contains("type") && sub["type"].is_string() && sub["type"] == "string")
      return cat(lit(open + "true\">"), Seq{sym(avoid_then("</｜DSML｜parameter", lit(">"), false))});
    DSV4_ASSIGN_OR_RETURN(uint32_t v, value(sub, 1));
    return cat(cat(lit(open + "false\">"), Seq{sym(v)}), lit(close));
  }

 private:
  Grammar& g_;
  const OrderedJson& root_;
  std::map<std::string, uint32_t> refs_;
  const bool dsml_;  // inside DSML values: JSON strings leave out '<'
  std::optional<uint32_t> integer_, number_, string_char_, any_;
};

}  // namespace

Result<std::shared_ptr<const Grammar>> json_schema_grammar(const OrderedJson& schema) {
  auto g = std::make_shared<Grammar>();
  Compiler c(*g, schema, false);
  DSV4_ASSIGN_OR_RETURN(uint32_t root, c.value(schema, 0));
  DSV4_TRY(g->finish(root));
  if (g->min_length() > kMaxSentence)
    return Status::errorf("schema: its shortest output has {} bytes, more than the {} allowed", g->min_length(), kMaxSentence);
  return std::shared_ptr<const Grammar>(std::move(g));
}

Result<std::shared_ptr<const Grammar>> build_output_grammar(const OutputGrammarSpec& spec) {
  using Body = OutputGrammarSpec::Body;
  auto g = std::make_shared<Grammar>();
  const OrderedJson object_schema = {{"type", "object"}};
  const bool tools = spec.body == Body::kToolCalls || spec.body == Body::kContentOrToolCalls;
  Compiler c(*g, spec.body == Body::kJsonSchema ? spec.schema : object_schema, tools);
  const std::string marker = "\n\n<｜DSML｜tool_calls";
  uint32_t body = 0;
  switch (spec.body) {
    case Body::kJsonObject: {
      DSV4_ASSIGN_OR_RETURN(body, c.value(object_schema, 0));
      break;
    }
    case Body::kJsonSchema: {
      DSV4_ASSIGN_OR_RETURN(body, c.value(spec.schema, 0));
      break;
    }
    case Body::kToolCalls: {
      DSV4_ASSIGN_OR_RETURN(Grammar::Sequence tail, c.tool_calls_after_marker(spec.tools, spec.parallel_tool_calls));
      body = c.rule_of({cat(c.lit(marker), tail)});
      break;
    }
    case Body::kContentOrToolCalls: {
      // Free text that may end anywhere; once it spells the marker, the call block.
      DSV4_ASSIGN_OR_RETURN(Grammar::Sequence tail, c.tool_calls_after_marker(spec.tools, spec.parallel_tool_calls));
      body = c.avoid_then(marker, tail, true);
      break;
    }
  }
  const uint32_t root = spec.thinking ? c.avoid_then("</think>", {c.sym(body)}, false) : body;
  DSV4_TRY(g->finish(root));
  if (g->min_length() > kMaxSentence)
    return Status::errorf("schema: its shortest output has {} bytes, more than the {} allowed", g->min_length(), kMaxSentence);
  return std::shared_ptr<const Grammar>(std::move(g));
}

}  // namespace dsv4::runtime
