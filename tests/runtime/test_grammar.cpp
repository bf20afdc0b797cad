// Grammars from JSON schemas and tool lists, over the real vocabulary: what they accept
// and refuse, and random walks through the allowed tokens (fixed seeds) that keep the
// plan within a token budget always end in output that parses and fits the schema.
#include <gtest/gtest.h>

#include <random>

#include "runtime/grammar.h"
#include "runtime/schema_grammar.h"
#include "support/test_support.h"
#include "text/output_parser.h"

namespace dsv4::runtime {
namespace {

using text::OrderedJson;

struct Vocab {
  std::shared_ptr<const text::Tokenizer> tok = *text::Tokenizer::builtin();
  std::shared_ptr<const VocabTrie> trie = VocabTrie::build(*tok);
};
Vocab& vocab() {
  static Vocab* v = new Vocab;
  return *v;
}

std::shared_ptr<const Grammar> schema(const char* json) {
  auto g = json_schema_grammar(OrderedJson::parse(json));
  EXPECT_TRUE(g.is_ok()) << g.status().message();
  return g.is_ok() ? *g : nullptr;
}

// Feeds `text` as its BPE tokens; true when every token fits and the text is complete.
bool accepts(const std::shared_ptr<const Grammar>& g, const std::string& text) {
  GrammarMatcher m(g, vocab().trie);
  const std::vector<int32_t> ids = vocab().tok->encode(text).value();
  for (int32_t t : ids)
    if (!m.accepts(t) || !m.advance(t).is_ok()) return false;
  return m.can_end();
}

TEST(Grammar, SchemasAcceptWhatFitsAndRefuseTheRest) {
  auto g = schema(R"({"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                      "n": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
                      "required": ["name"], "additionalProperties": false})");
  EXPECT_TRUE(accepts(g, R"({"name": "abc"})"));
  EXPECT_TRUE(accepts(g, R"({"name": "ab\"c", "n": -12, "tags": ["a", "b"]})"));
  EXPECT_TRUE(accepts(g, R"({"name": "é", "tags": []})"));
  EXPECT_FALSE(accepts(g, R"({"n": 1})"));                      // name is required
  EXPECT_FALSE(accepts(g, R"({"name": "abcdef"})"));            // maxLength
  EXPECT_FALSE(accepts(g, R"({"name": "a", "tags": ["c"]})"));  // enum
  EXPECT_FALSE(accepts(g, R"({"name": "a", "tags": ["a", "a", "a"]})"));
  EXPECT_FALSE(accepts(g, R"({"name": "a", "x": 1})"));         // no other properties
  EXPECT_FALSE(accepts(g, R"({"name": "a")"));                  // incomplete
  EXPECT_FALSE(accepts(g, "{\"name\": \"a\u0001\"}"));          // control character
  auto any = schema(R"({"anyOf": [{"type": "null"}, {"$ref": "#/$defs/p"}], "$defs": {"p": {"type": "number"}}})");
  EXPECT_TRUE(accepts(any, "null"));
  EXPECT_TRUE(accepts(any, "-1.5e+3"));
  EXPECT_TRUE(accepts(any, "9999999999999999.5E99"));  // the largest exponent: a finite double
  EXPECT_FALSE(accepts(any, "3E337"));                 // overflows a double: JSON parsers refuse it
  EXPECT_FALSE(accepts(any, "01"));
  auto free = schema("{}");
  EXPECT_TRUE(accepts(free, R"({"a": [1, {"b": null}], "c": "d"})"));
  EXPECT_FALSE(accepts(free, R"({"a": })"));
}

TEST(Grammar, BadGrammarsAndSchemasAreErrors) {
  Grammar left;
  const uint32_t r = left.add_rule();
  left.add_alternative(r, {left.ref(r), left.literal("a")[0]});
  left.add_alternative(r, left.literal("b"));
  EXPECT_NE(left.finish(r).message().find("left-recursive"), std::string::npos);
  Grammar empty;
  EXPECT_FALSE(empty.finish(empty.add_rule()).is_ok());
  for (const char* bad : {R"({"type": "nope"})", R"({"$ref": "#/$defs/missing"})", R"({"enum": []})", "false",
                          R"({"type": "array", "minItems": 64, "items": {"type": "array", "minItems": 64,
                              "items": {"type": "array", "minItems": 64, "items": {"type": "string", "minLength": 64}}}})"})
    EXPECT_FALSE(json_schema_grammar(OrderedJson::parse(bad)).is_ok()) << bad;
}

// Random allowed tokens, switching to the plan when it would no longer fit.
std::string walk(const std::shared_ptr<const Grammar>& g, int64_t max_tokens, uint64_t seed, int64_t& used) {
  GrammarMatcher m(g, vocab().trie);
  std::mt19937_64 rng(seed);
  std::string out;
  std::vector<int32_t> plan = m.plan();
  EXPECT_LE(static_cast<int64_t>(plan.size()), max_tokens);
  for (used = 0; used < max_tokens && !m.must_end(); ++used) {
    const int64_t budget = max_tokens - used;
    int32_t t = -1;
    if (static_cast<int64_t>(plan.size()) < budget) {
      // A random allowed token: random draws first (most tokens fit inside a string),
      // the full mask when they keep missing.
      int32_t pick = -1;
      for (int k = 0; k < 64 && pick < 0; ++k) {
        const auto id = static_cast<int32_t>(rng() % vocab().trie->vocab_size());
        if (id != vocab().trie->eos() && m.accepts(id)) pick = id;
      }
      if (pick < 0) {
        std::vector<uint8_t> mask;
        m.allowed(mask);
        std::vector<int32_t> ok;
        for (size_t i = 0; i < mask.size(); ++i)
          if (mask[i] && static_cast<int32_t>(i) != vocab().trie->eos()) ok.push_back(static_cast<int32_t>(i));
        if (!ok.empty()) pick = ok[rng() % ok.size()];
      }
      if (pick >= 0) {
        GrammarMatcher after = m;
        EXPECT_TRUE(after.advance(pick).is_ok());
        std::vector<int32_t> next = after.plan();
        if (static_cast<int64_t>(next.size()) <= budget - 1) {
          t = pick;
          plan = std::move(next);
        }
      }
    }
    if (t < 0) {
      if (plan.empty()) break;
      t = plan.front();
      plan.erase(plan.begin());
    }
    EXPECT_TRUE(m.advance(t).is_ok());
    out += vocab().trie->bytes(t);
  }
  EXPECT_TRUE(m.can_end()) << out;
  return out;
}

TEST(Grammar, RandomWalksEndInValidJsonWithinTheBudget) {
  const OrderedJson s = OrderedJson::parse(R"({"type": "object", "properties": {
      "id": {"type": "integer"}, "label": {"type": "string"}, "ok": {"type": "boolean"},
      "items": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}}},
      "required": ["id", "label", "items"]})");
  auto g = json_schema_grammar(s);
  ASSERT_TRUE(g.is_ok());
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    for (int64_t budget : {int64_t{24}, int64_t{60}}) {
      int64_t used = 0;
      const std::string out = walk(*g, budget, test::test_seed() + seed, used);
      EXPECT_LE(used, budget);
      const auto j = OrderedJson::parse(text::utf8_lossy(out), nullptr, false);
      ASSERT_FALSE(j.is_discarded()) << out;
      EXPECT_EQ(text::check_json_schema(j, s, "out"), "") << out;
    }
  }
}

TEST(Grammar, ToolCallBlocksParseAndFitTheirSchemas) {
  const OrderedJson tools = OrderedJson::parse(R"([
    {"type": "function", "function": {"name": "shell", "parameters": {"type": "object",
      "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}}, "required": ["command"]}}},
    {"type": "function", "function": {"name": "edit", "parameters": {"type": "object",
      "properties": {"path": {"enum": ["a.c", "b.c"]}, "lines": {"type": "array", "items": {"type": "string"}}},
      "required": ["path", "lines"]}}}])");
  for (bool thinking : {false, true}) {
    OutputGrammarSpec spec;
    spec.body = OutputGrammarSpec::Body::kToolCalls;
    spec.tools = tools;
    spec.thinking = thinking;
    auto g = build_output_grammar(spec);
    ASSERT_TRUE(g.is_ok()) << g.status().message();
    for (uint64_t seed = 1; seed <= 3; ++seed) {
      int64_t used = 0;
      const std::string out = walk(*g, 120, test::test_seed() * 7 + seed, used);
      text::OutputParser parser(thinking ? text::ThinkingMode::kThinking : text::ThinkingMode::kChat, tools);
      parser.push(text::utf8_lossy(out));
      parser.finish();
      const text::ParsedOutput& r = parser.result();
      ASSERT_GE(r.tool_calls.size(), 1u) << out;
      for (const auto& c : r.tool_calls) EXPECT_EQ(c.error, "") << out;
      EXPECT_TRUE(r.errors.empty()) << r.errors[0] << "\n" << out;
    }
  }
}

}  // namespace
}  // namespace dsv4::runtime
