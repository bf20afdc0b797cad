// Exact replay: a remembered turn re-renders with the model's DSML bytes and re-tokenizes
// to the model's own tokens (even a tokenization BPE would not choose), only when the
// client's history still matches it.
#include <gtest/gtest.h>

#include <algorithm>

#include "runtime/replay.h"

namespace dsv4::runtime {
namespace {

using text::ChatMessage;

const text::Tokenizer& tok() {
  static auto t = *text::Tokenizer::builtin();
  return *t;
}

// One token per byte: a tokenization BPE never produces for ordinary text.
std::vector<int32_t> bytewise(const std::string& s) {
  std::vector<int32_t> out;
  for (char c : s) out.push_back(tok().encode(std::string(1, c)).value()[0]);
  return out;
}

TEST(ReplayStore, TurnsRenderAndTokenizeAsGenerated) {
  ReplayStore store;
  // The model wrote its argument as compact JSON; re-rendering the parsed arguments would
  // give {"a": 1}.
  const std::string calls =
      "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"x\" "
      "string=\"false\">{\"a\":1}</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
  const std::string body = "Let me check." + calls;
  std::vector<int32_t> ids = bytewise("Let me check.");
  const auto rest = tok().encode(calls).value();
  ids.insert(ids.end(), rest.begin(), rest.end());
  ASSERT_EQ(tok().decode(ids), body);
  store.remember(ids, body, {"call_1"}, *tok().find_token("</think>"));

  std::vector<ChatMessage> history{ChatMessage::of("user", "hi")};
  ChatMessage a = ChatMessage::of("assistant", "Let me check.");
  a.tool_calls.push_back({"call_1", "f", R"({"x": {"a": 1}})"});
  history.push_back(a);
  ChatMessage result = ChatMessage::of("tool", "done");
  result.tool_call_id = "call_1";
  history.push_back(result);
  store.apply(history);
  ASSERT_TRUE(history[1].raw_tool_calls.has_value());
  EXPECT_EQ(*history[1].raw_tool_calls, calls);
  text::ChatOptions o;
  o.thinking = text::ThinkingMode::kChat;
  const std::string rendered = *text::render_chat(history, o);
  ASSERT_NE(rendered.find(body + "<｜end▁of▁sentence｜>"), std::string::npos);

  const auto replayed = store.tokenize(tok(), rendered);
  ASSERT_TRUE(replayed.is_ok());
  const auto plain = tok().encode(rendered).value();
  EXPECT_NE(*replayed, plain);
  EXPECT_EQ(tok().decode(*replayed), rendered);
  // Before the turn: the plain encoding; the turn: the generated ids.
  const std::string before = rendered.substr(0, rendered.find(body));
  const auto head = tok().encode(before).value();
  ASSERT_GE(replayed->size(), head.size() + ids.size());
  EXPECT_TRUE(std::equal(head.begin(), head.end(), replayed->begin()));
  EXPECT_TRUE(std::equal(ids.begin(), ids.end(), replayed->begin() + static_cast<std::ptrdiff_t>(head.size())));
  EXPECT_EQ(store.replayed_turns(), 1u);

  // A client that changed the call's arguments renders its own version.
  std::vector<ChatMessage> edited = history;
  edited[1].raw_tool_calls.reset();
  edited[1].tool_calls[0].arguments = R"({"x": {"a": 2}})";
  store.apply(edited);
  EXPECT_FALSE(edited[1].raw_tool_calls.has_value());
  // An unknown id: nothing replayed.
  std::vector<ChatMessage> other = history;
  other[1].raw_tool_calls.reset();
  other[1].tool_calls[0].id = "call_9";
  store.apply(other);
  EXPECT_FALSE(other[1].raw_tool_calls.has_value());
}

// Two turns that wrote the same text as different tokens: each message gets its own.
TEST(ReplayStore, SameTextDifferentTokensFollowTheirCalls) {
  ReplayStore store;
  const std::string calls =
      "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"run\">\n<｜DSML｜parameter name=\"c\" "
      "string=\"true\">make</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
  std::vector<int32_t> first = tok().encode(calls).value(), second = bytewise("\n\n");
  const auto rest = tok().encode(calls.substr(2)).value();
  second.insert(second.end(), rest.begin(), rest.end());
  ASSERT_NE(first, second);
  store.remember(first, calls, {"call_a"}, -1);
  store.remember(second, calls, {"call_b"}, -1);
  std::vector<ChatMessage> h{ChatMessage::of("user", "go")};
  for (const char* id : {"call_a", "call_b"}) {
    ChatMessage a = ChatMessage::of("assistant", "");
    a.tool_calls.push_back({id, "run", R"({"c": "make"})"});
    h.push_back(a);
    ChatMessage r = ChatMessage::of("tool", "ok");
    r.tool_call_id = id;
    h.push_back(r);
  }
  store.apply(h);
  text::ChatOptions o;
  o.thinking = text::ThinkingMode::kChat;
  const std::string rendered = *text::render_chat(h, o);
  const auto ids = store.tokenize(tok(), rendered, h).value();
  auto find = [&](const std::vector<int32_t>& needle, size_t from) {
    return std::search(ids.begin() + static_cast<std::ptrdiff_t>(from), ids.end(), needle.begin(), needle.end()) - ids.begin();
  };
  const size_t a = static_cast<size_t>(find(first, 0));
  ASSERT_LT(a, ids.size());
  EXPECT_LT(static_cast<size_t>(find(second, a + first.size())), ids.size());
  EXPECT_EQ(store.replayed_turns(), 2u);
}

TEST(ReplayStore, ForgetsTheOldestPastItsCapacity) {
  ReplayStore store(2);
  for (const char* t : {"one", "two", "three"}) store.remember(bytewise(t), t, {}, -1);
  EXPECT_EQ(store.size(), 2u);
  const std::string rendered = "<｜Assistant｜></think>one<｜end▁of▁sentence｜>";
  EXPECT_EQ(*store.tokenize(tok(), rendered), tok().encode(rendered).value());  // "one" is gone
  const std::string kept = "<｜Assistant｜></think>three<｜end▁of▁sentence｜>";
  EXPECT_NE(*store.tokenize(tok(), kept), tok().encode(kept).value());
}

}  // namespace
}  // namespace dsv4::runtime
