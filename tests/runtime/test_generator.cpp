// The generation loop on the built-in tiny model: cache reuse gives the same tokens as a
// fresh run, limits and cancellation, stop strings held back and cut.
#include <gtest/gtest.h>

#include "runtime/generator.h"
#include "support/builtin_model_fixture.h"

namespace dsv4::runtime {
namespace {

using Fixture = test::BuiltinModel;
Fixture& fixture() { return test::builtin_model(); }

std::vector<int32_t> ids(const std::string& text) { return *fixture().tokenizer->encode(text); }

GenerateOptions greedy(int64_t n) {
  GenerateOptions o;
  o.sampling.temperature = 0;
  o.max_tokens = n;
  o.stop_tokens = {};
  return o;
}

TEST(Generator, ReusedCacheGivesTheSameTokensAsAFreshRun) {
  Fixture& f = fixture();
  Generator gen(*f.model, *f.tokenizer, 512);
  const std::vector<int32_t> p1 = ids("<｜begin▁of▁sentence｜><｜User｜>Tell me a story.<｜Assistant｜></think>");
  auto first = gen.generate(p1, greedy(6), nullptr);
  ASSERT_TRUE(first.is_ok()) << first.status().message();
  ASSERT_EQ(first->finish, FinishReason::kLength);
  ASSERT_EQ(first->tokens.size(), 6u);
  // The cache holds the prompt and the generated tokens but the last (never decoded).
  EXPECT_EQ(gen.cached_tokens().size(), p1.size() + 5);

  std::vector<int32_t> p2 = p1;
  p2.insert(p2.end(), first->tokens.begin(), first->tokens.end());
  const std::vector<int32_t> more = ids("<｜end▁of▁sentence｜><｜User｜>And then?<｜Assistant｜></think>");
  p2.insert(p2.end(), more.begin(), more.end());
  std::string reused_text, fresh_text;
  auto reused = gen.generate(p2, greedy(8), [&](std::string_view t) { reused_text += t; });
  ASSERT_TRUE(reused.is_ok()) << reused.status().message();
  EXPECT_EQ(reused->prefilled_tokens, static_cast<int64_t>(more.size() + 1));

  Generator fresh_gen(*f.model, *f.tokenizer, 512);
  auto fresh = fresh_gen.generate(p2, greedy(8), [&](std::string_view t) { fresh_text += t; });
  ASSERT_TRUE(fresh.is_ok());
  EXPECT_EQ(fresh->prefilled_tokens, static_cast<int64_t>(p2.size()));
  EXPECT_EQ(reused->tokens, fresh->tokens);
  EXPECT_EQ(reused_text, fresh_text);
  EXPECT_EQ(fresh_text, f.tokenizer->decode(fresh->tokens));

  // A prompt that does not extend the cache starts over.
  auto other = gen.generate(ids("<｜User｜>Different"), greedy(1), nullptr);
  ASSERT_TRUE(other.is_ok());
  EXPECT_EQ(other->prefilled_tokens, other->prompt_tokens);
}

TEST(Generator, LimitsCancelAndErrors) {
  Fixture& f = fixture();
  Generator gen(*f.model, *f.tokenizer, 40);
  const auto prompt = ids("<｜User｜>Hi<｜Assistant｜></think>");
  auto none = gen.generate(prompt, greedy(0), nullptr);
  ASSERT_TRUE(none.is_ok());
  EXPECT_EQ(none->finish, FinishReason::kLength);
  EXPECT_TRUE(none->tokens.empty());

  std::atomic<bool> cancel{true};
  auto cancelled = gen.generate(prompt, greedy(5), nullptr, &cancel);
  ASSERT_TRUE(cancelled.is_ok());
  EXPECT_EQ(cancelled->finish, FinishReason::kCancelled);

  auto full = gen.generate(prompt, greedy(1000), nullptr);
  ASSERT_TRUE(full.is_ok());
  EXPECT_TRUE(full->finish == FinishReason::kContextFull || full->finish == FinishReason::kEos);
  // The last token is sampled but never decoded: prompt + reply fill the 40 positions at most.
  EXPECT_LT(static_cast<int64_t>(prompt.size()) + static_cast<int64_t>(full->tokens.size()), 41);

  EXPECT_FALSE(gen.generate(std::vector<int32_t>(40, 5), greedy(1), nullptr).is_ok());
  EXPECT_FALSE(gen.generate({}, greedy(1), nullptr).is_ok());
  EXPECT_FALSE(gen.generate(std::vector<int32_t>{999999}, greedy(1), nullptr).is_ok());
  GenerateOptions bad = greedy(1);
  bad.sampling.top_p = 0;
  EXPECT_NE(gen.generate(prompt, bad, nullptr).status().message().find("top_p"), std::string::npos);
}

TEST(Generator, StopTokenEndsTheReply) {
  Fixture& f = fixture();
  Generator gen(*f.model, *f.tokenizer, 128);
  const auto prompt = ids("<｜User｜>Go<｜Assistant｜></think>");
  auto run = gen.generate(prompt, greedy(4), nullptr);
  ASSERT_TRUE(run.is_ok());
  ASSERT_FALSE(run->tokens.empty());
  GenerateOptions o = greedy(4);
  o.stop_tokens = {run->tokens[0]};
  auto stopped = gen.generate(prompt, o, nullptr);
  ASSERT_TRUE(stopped.is_ok());
  EXPECT_EQ(stopped->finish, FinishReason::kStopToken);
  EXPECT_EQ(stopped->stop_token, run->tokens[0]);
  EXPECT_TRUE(stopped->tokens.empty());
}

TEST(StopStringMatcher, HoldsPossiblePrefixesAndCutsMatches) {
  StopStringMatcher m({"END", "xyz"});
  bool matched = false;
  EXPECT_EQ(m.push("abc E", matched), "abc ");
  EXPECT_FALSE(matched);
  EXPECT_EQ(m.push("N", matched), "");
  EXPECT_EQ(m.push("x", matched), "EN");  // "ENx" can no longer become END; "x" may start xyz
  EXPECT_FALSE(matched);
  EXPECT_EQ(m.push("yz and more", matched), "");
  EXPECT_TRUE(matched);

  StopStringMatcher n({"END"});
  EXPECT_EQ(n.push("one EN", matched), "one ");
  EXPECT_EQ(n.flush(), "EN");  // generation ended for another reason
  EXPECT_EQ(n.push("a END b", matched), "a ");
  EXPECT_TRUE(matched);
}

}  // namespace
}  // namespace dsv4::runtime
