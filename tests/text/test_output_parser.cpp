#include <gtest/gtest.h>

#include <random>

#include "support/test_support.h"
#include "text/chat.h"
#include "text/output_parser.h"

namespace dsv4::text {
namespace {

using json = OrderedJson;

const char* kWeatherTools = R"([
  {"type":"function","function":{"name":"get_weather","description":"Get the weather",
   "parameters":{"type":"object","properties":{"location":{"type":"string"},
   "unit":{"type":"string","enum":["celsius","fahrenheit"]},"days":{"type":"integer","minimum":1}},
   "required":["location"],"additionalProperties":false}}}])";

const std::string kToolCompletion =
    "The user wants to know the weather in Beijing. I should use the get_weather tool.</think>\n\n<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"location\" string=\"true\">Beijing</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"unit\" string=\"true\">celsius</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    "<｜end▁of▁sentence｜>";

// Feeds `text` in pieces cut at the given sizes (cycled), checking that the deltas add
// up to the final result.
ParsedOutput feed(const std::string& text, ThinkingMode mode, const std::vector<size_t>& cuts, json tools = json::array()) {
  OutputParser p(mode, std::move(tools));
  std::string reasoning, content;
  size_t calls = 0;
  auto take = [&](const OutputDelta& d) {
    reasoning += d.reasoning;
    content += d.content;
    calls += d.tool_calls.size();
  };
  for (size_t pos = 0, k = 0; pos < text.size(); ++k) {
    const size_t n = std::min(text.size() - pos, std::max<size_t>(1, cuts[k % cuts.size()]));
    take(p.push(std::string_view(text).substr(pos, n)));
    pos += n;
  }
  take(p.finish());
  EXPECT_EQ(reasoning, p.result().reasoning);
  EXPECT_EQ(content, p.result().content);
  EXPECT_EQ(calls, p.result().tool_calls.size());
  return p.result();
}

TEST(OutputParser, ChatModeContent) {
  auto r = feed("2 + 2 = 4.<｜end▁of▁sentence｜>", ThinkingMode::kChat, {1000});
  EXPECT_EQ(r.content, "2 + 2 = 4.");
  EXPECT_EQ(r.reasoning, "");
  EXPECT_TRUE(r.saw_eos);
  EXPECT_TRUE(r.errors.empty());
}

TEST(OutputParser, SpecToolCallSegmentAtEverySplit) {
  for (size_t step : {1, 2, 3, 5, 7, 13, 64, 10000}) {
    auto r = feed(kToolCompletion, ThinkingMode::kThinking, {step}, json::parse(kWeatherTools));
    EXPECT_EQ(r.reasoning, "The user wants to know the weather in Beijing. I should use the get_weather tool.");
    EXPECT_EQ(r.content, "");
    ASSERT_EQ(r.tool_calls.size(), 1u) << "step " << step;
    EXPECT_EQ(r.tool_calls[0].name, "get_weather");
    EXPECT_EQ(r.tool_calls[0].arguments, R"({"location": "Beijing", "unit": "celsius"})");
    EXPECT_EQ(r.tool_calls[0].error, "");
    EXPECT_TRUE(r.errors.empty()) << r.errors[0];
    EXPECT_TRUE(r.saw_eos);
  }
}

TEST(OutputParser, PartialTagsAreHeldBackNotShown) {
  OutputParser p(ThinkingMode::kThinking);
  EXPECT_EQ(p.push("think</th").reasoning, "think");
  auto d = p.push("ink>Answer\n\n<｜DSM");
  EXPECT_EQ(d.reasoning, "");
  EXPECT_EQ(d.content, "Answer");
  d = p.push("L and more");  // not a tool call after all
  EXPECT_EQ(d.content, "\n\n<｜DSML and more");
  p.finish();
  EXPECT_TRUE(p.result().errors.empty());
  EXPECT_FALSE(p.result().saw_eos);
}

TEST(OutputParser, RoundTripsWhatTheEncoderRenders) {
  std::mt19937_64 rng(test::test_seed());
  const std::vector<std::string> values = {"Beijing", "a \"quoted\"\nline", "<tag>", "", "中文", "x</y"};
  for (int iter = 0; iter < 50; ++iter) {
    json args = json::object();
    for (int k = std::uniform_int_distribution<int>(0, 4)(rng); k > 0; --k) {
      const std::string key = "k" + std::to_string(k);
      switch (std::uniform_int_distribution<int>(0, 3)(rng)) {
        case 0: args[key] = values[std::uniform_int_distribution<size_t>(0, values.size() - 1)(rng)]; break;
        case 1: args[key] = std::uniform_int_distribution<int>(-1000, 1000)(rng); break;
        case 2: args[key] = json::parse(R"({"a": [1, 2.5, null], "b": {"c": true}})"); break;
        default: args[key] = 0.25; break;
      }
    }
    const ChatMessage user = ChatMessage::of("user", "q");
    ChatMessage asst = ChatMessage::of("assistant", "text before");
    asst.reasoning_content = "why";
    asst.tool_calls.push_back({"id1", "fn", python_json_dumps(args)});
    asst.tool_calls.push_back({"id2", "other", "{}"});
    std::vector<ChatMessage> msgs = {user, asst};
    ChatOptions opts;
    opts.drop_thinking = false;
    auto prompt = render_chat(msgs, opts);
    ASSERT_TRUE(prompt.is_ok()) << prompt.status().message();
    const std::string completion = prompt->substr(prompt->find("<think>") + 7);
    auto r = feed(completion, ThinkingMode::kThinking, {1, 4, 9});
    EXPECT_EQ(r.reasoning, "why");
    EXPECT_EQ(r.content, "text before");
    ASSERT_EQ(r.tool_calls.size(), 2u) << completion;
    EXPECT_EQ(r.tool_calls[0].arguments, python_json_dumps(args)) << "seed " << test::test_seed();
    EXPECT_EQ(r.tool_calls[1].arguments, "{}");
    EXPECT_TRUE(r.errors.empty());
  }
}

TEST(OutputParser, ChecksCallsAgainstTheToolSchema) {
  auto call = [](const std::string& params, const char* name = "get_weather") {
    const std::string text = std::string("</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"") + name + "\">\n" + params +
                             "\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>";
    auto r = feed(text, ThinkingMode::kThinking, {3}, json::parse(kWeatherTools));
    EXPECT_EQ(r.tool_calls.size(), 1u);
    return r.tool_calls.empty() ? std::string("<no call>") : r.tool_calls[0].error;
  };
  auto p = [](const char* k, const char* v, bool s) {
    return fmt::format("<｜DSML｜parameter name=\"{}\" string=\"{}\">{}</｜DSML｜parameter>", k, s ? "true" : "false", v);
  };
  EXPECT_EQ(call(p("location", "Paris", true) + "\n" + p("days", "3", false)), "");
  EXPECT_NE(call(p("location", "Paris", true), "get_time").find("not one of the request's tools"), std::string::npos);
  EXPECT_NE(call(p("unit", "celsius", true)).find("required property 'location'"), std::string::npos);
  EXPECT_NE(call(p("location", "P", true) + p("unit", "kelvin", true)).find("\"kelvin\" is not one of"), std::string::npos);
  EXPECT_NE(call(p("location", "P", true) + p("days", "0", false)).find("below the minimum"), std::string::npos);
  EXPECT_NE(call(p("location", "P", true) + p("days", "2.5", false)).find("not of type"), std::string::npos);
  EXPECT_NE(call(p("location", "P", true) + p("days", "three", false)).find("is not JSON"), std::string::npos);
  EXPECT_NE(call(p("location", "P", true) + p("extra", "1", false)).find("'extra' is not allowed"), std::string::npos);
}

TEST(OutputParser, MalformedAndTruncatedOutputBecomesContentWithAnError) {
  struct Case {
    std::string text;
    ThinkingMode mode;
    const char* error;
  };
  const Case cases[] = {
      {"reasoning that never ends", ThinkingMode::kThinking, "inside the reasoning"},
      {"a\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke nam=\"x\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>",
       ThinkingMode::kChat, "invoke without name"},
      {"a\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"x\">\n<｜DSML｜parameter name=\"k\" string=\"maybe\">v"
       "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
       ThinkingMode::kChat, "string= must be"},
      {"a\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"x\">\n<｜DSML｜parameter name=\"k\" string=\"true\">v",
       ThinkingMode::kChat, "ended inside a tool call"},
      {"a\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"x\"><｜end▁of▁sentence｜>", ThinkingMode::kChat, "not closed"},
      {"a\n\n<｜DSML｜tool_calls>\nhello</｜DSML｜tool_calls>", ThinkingMode::kChat, "expected an invoke"},
      {"a\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"x\">\n<｜DSML｜parameter name=\"k\" string=\"true\">1"
       "</｜DSML｜parameter>\n<｜DSML｜parameter name=\"k\" string=\"true\">2</｜DSML｜parameter>\n</｜DSML｜invoke>"
       "\n</｜DSML｜tool_calls>",
       ThinkingMode::kChat, "given twice"},
      {"done<｜end▁of▁sentence｜>more", ThinkingMode::kChat, "after the end"},
  };
  for (const Case& c : cases) {
    for (size_t step : {1, 6, 1000}) {
      auto r = feed(c.text, c.mode, {step});
      ASSERT_FALSE(r.errors.empty()) << c.text;
      EXPECT_NE(r.errors[0].find(c.error), std::string::npos) << r.errors[0] << " for " << c.text;
      EXPECT_TRUE(r.tool_calls.empty());
    }
  }
  // The malformed block is kept as content.
  auto r = feed(cases[1].text, ThinkingMode::kChat, {5});
  EXPECT_EQ(r.content, "a\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke nam=\"x\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>");
  EXPECT_TRUE(r.saw_eos);
}

TEST(OutputParser, SurvivesRandomCutsAndMutations) {
  std::mt19937_64 rng(test::test_seed());
  const std::string base = kToolCompletion;
  for (int iter = 0; iter < 500; ++iter) {
    std::string t = base.substr(0, std::uniform_int_distribution<size_t>(0, base.size())(rng));
    for (int m = std::uniform_int_distribution<int>(0, 3)(rng); m > 0 && !t.empty(); --m)
      t[std::uniform_int_distribution<size_t>(0, t.size() - 1)(rng)] = "<>/\"\n=x"[rng() % 7];
    auto r = feed(t, ThinkingMode::kThinking, {static_cast<size_t>(1 + rng() % 9)}, json::parse(kWeatherTools));
    EXPECT_LE(r.reasoning.size() + r.content.size(), t.size() + 32) << "seed " << test::test_seed();
  }
}

TEST(JsonSchema, NestedArraysAndAlternatives) {
  json schema = json::parse(R"({"type":"object","properties":{"xs":{"type":"array","items":{"type":"number"},"maxItems":2},
    "v":{"anyOf":[{"type":"string"},{"type":"null"}]}}})");
  EXPECT_EQ(check_json_schema(json::parse(R"({"xs":[1,2.5],"v":null})"), schema, "a"), "");
  EXPECT_EQ(check_json_schema(json::parse(R"({"xs":[1,"2"]})"), schema, "a"), "a.xs[1]: \"2\" is not of type \"number\"");
  EXPECT_NE(check_json_schema(json::parse(R"({"xs":[1,2,3]})"), schema, "a").find("maxItems"), std::string::npos);
  EXPECT_NE(check_json_schema(json::parse(R"({"v":3})"), schema, "a").find("anyOf"), std::string::npos);
}

}  // namespace
}  // namespace dsv4::text
