// The scheduler on the built-in tiny model (random weights: structure, not content):
// batched requests give exactly the tokens each gives alone (the Generator is the
// reference), prefix reuse continues and restores exactly and reports cached tokens,
// cancellation frees a sequence within one step, preemption under a small KV budget
// still gives the same tokens, admission refuses with numbers, grammars hold.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "backend/cpu/cpu_backend.h"
#include "runtime/scheduler.h"
#include "runtime/schema_grammar.h"
#include "support/builtin_model_fixture.h"
#include "support/test_support.h"
#include "synth/builtin_model.h"

namespace dsv4::runtime {
namespace {

using Fixture = test::BuiltinModel;
Fixture& fixture() { return test::builtin_model(); }

std::vector<int32_t> ids(const std::string& text) { return *fixture().tokenizer->encode(text); }

std::vector<int32_t> prompt_of(int i, int words) {
  std::string s = "<｜begin▁of▁sentence｜><｜User｜>";
  for (int w = 0; w < words; ++w) s += fmt::format(" w{}x{}", i, w);
  return ids(s + "<｜Assistant｜></think>");
}

RequestSpec spec_of(std::vector<int32_t> prompt, int64_t max_tokens, uint64_t seed = 0) {
  RequestSpec s;
  s.prompt = std::move(prompt);
  s.max_tokens = max_tokens;
  s.sampling.temperature = seed ? 1.0f : 0.0f;
  s.sampling.seed = seed;
  s.stop_tokens = {};
  return s;
}

// Steps until every handle is done; returns each one's final event.
std::vector<RequestEvent> drain(Scheduler& s, const std::vector<std::shared_ptr<RequestHandle>>& hs, int max_steps = 2000) {
  std::vector<RequestEvent> last(hs.size());
  std::vector<bool> done(hs.size(), false);
  for (int i = 0; i < max_steps; ++i) {
    s.step();
    bool all = true;
    for (size_t k = 0; k < hs.size(); ++k) {
      for (RequestEvent& e : hs[k]->wait(std::chrono::milliseconds(0)))
        if (e.done) {
          last[k] = std::move(e);
          done[k] = true;
        }
      all = all && done[k];
    }
    if (all) return last;
  }
  ADD_FAILURE() << "requests did not finish in " << max_steps << " steps";
  return last;
}

std::vector<int32_t> reference(const std::vector<int32_t>& prompt, int64_t n, uint64_t seed, uint64_t ctx) {
  Generator gen(*fixture().model, *fixture().tokenizer, ctx);
  GenerateOptions o;
  o.max_tokens = n;
  o.sampling.temperature = seed ? 1.0f : 0.0f;
  o.sampling.seed = seed;
  auto r = gen.generate(prompt, o, nullptr);
  EXPECT_TRUE(r.is_ok()) << r.status().message();
  std::vector<int32_t> t = r->tokens;
  if (r->stop_token >= 0) t.push_back(r->stop_token);
  return t;
}

std::vector<int32_t> with_stop(const RequestEvent& e) {
  std::vector<int32_t> t = e.tokens;
  if (e.finish == FinishReason::kEos) t.push_back(fixture().tokenizer->eos_id());
  return t;
}

SchedulerOptions small_options() {
  SchedulerOptions o;
  o.max_context = 512;
  o.max_seqs = 4;
  o.batch_tokens = 24;  // several steps per prompt: chunked prefill alongside decodes
  o.prefix.snapshot_interval = 16;
  return o;
}

TEST(Scheduler, BatchedRequestsMatchEachAlone) {
  Fixture& f = fixture();
  Scheduler s(*f.model, *f.tokenizer, small_options());
  std::vector<std::shared_ptr<RequestHandle>> hs;
  std::vector<RequestSpec> specs;
  for (int i = 0; i < 6; ++i) {  // more than max_seqs: some wait for a slot
    specs.push_back(spec_of(prompt_of(i, 2 + 3 * i), 2 + i % 3, i % 2 ? 100 + i : 0));
    Rejection why;
    hs.push_back(s.submit(specs.back(), &why));
    ASSERT_TRUE(hs.back()) << why.status.message();
  }
  const std::vector<RequestEvent> out = drain(s, hs);
  for (size_t i = 0; i < hs.size(); ++i) {
    SCOPED_TRACE(i);
    ASSERT_TRUE(out[i].error.is_ok()) << out[i].error.message();
    EXPECT_EQ(with_stop(out[i]), reference(specs[i].prompt, specs[i].max_tokens, specs[i].sampling.seed, 512));
    EXPECT_EQ(out[i].usage.prompt_tokens, static_cast<int64_t>(specs[i].prompt.size()));
    EXPECT_EQ(out[i].generated_text, f.tokenizer->decode(out[i].tokens));
  }
  const SchedulerMetrics m = s.metrics();
  EXPECT_EQ(m.running, 0u);
  EXPECT_EQ(m.queue_depth, 0u);
  EXPECT_EQ(m.requests_finished, 6u);
  EXPECT_EQ(m.time_to_first_token.count, 6u);
}

TEST(Scheduler, PrefixReuseContinuesAndRestoresExactly) {
  Fixture& f = fixture();
  Scheduler s(*f.model, *f.tokenizer, small_options());
  const std::vector<int32_t> p1 = prompt_of(1, 30);
  ASSERT_GT(p1.size(), 50u);
  auto first = drain(s, {s.submit(spec_of(p1, 6), nullptr)})[0];
  ASSERT_TRUE(first.error.is_ok());
  EXPECT_EQ(first.usage.cached_tokens, 0);

  // The next turn: the history (prompt + reply) and more. The cache holds the prompt
  // and every generated token but the last (never fed back).
  std::vector<int32_t> p2 = p1;
  p2.insert(p2.end(), first.tokens.begin(), first.tokens.end());
  const auto more = ids("<｜end▁of▁sentence｜><｜User｜>And then?<｜Assistant｜></think>");
  p2.insert(p2.end(), more.begin(), more.end());
  auto second = drain(s, {s.submit(spec_of(p2, 5), nullptr)})[0];
  ASSERT_TRUE(second.error.is_ok());
  EXPECT_EQ(second.usage.cached_tokens, static_cast<int64_t>(p1.size() + first.tokens.size() - 1));
  EXPECT_EQ(with_stop(second), reference(p2, 5, 0, 512));

  // A prompt that leaves p1 after 40 tokens: restored from the snapshot at 32.
  std::vector<int32_t> p3(p1.begin(), p1.begin() + 40);
  const auto other = ids(" something else entirely<｜Assistant｜></think>");
  p3.insert(p3.end(), other.begin(), other.end());
  auto third = drain(s, {s.submit(spec_of(p3, 5), nullptr)})[0];
  ASSERT_TRUE(third.error.is_ok());
  EXPECT_EQ(third.usage.cached_tokens, 32);
  EXPECT_EQ(with_stop(third), reference(p3, 5, 0, 512));
  const SchedulerMetrics m = s.metrics();
  EXPECT_EQ(m.prefix.lookups, 3u);
  EXPECT_EQ(m.prefix.hits, 2u);
}

TEST(Scheduler, CancellationFreesTheSequenceWithinOneStep) {
  Fixture& f = fixture();
  Scheduler s(*f.model, *f.tokenizer, small_options());
  auto h = s.submit(spec_of(prompt_of(2, 10), 1000), nullptr);
  ASSERT_TRUE(h);
  s.step();
  s.step();
  EXPECT_EQ(s.metrics().running, 1u);
  h->cancel();
  s.step();
  EXPECT_EQ(s.metrics().running, 0u);
  bool done = false;
  for (const RequestEvent& e : h->wait(std::chrono::milliseconds(0)))
    if (e.done) {
      done = true;
      EXPECT_EQ(e.finish, FinishReason::kCancelled);
    }
  EXPECT_TRUE(done);
  // A queued request cancelled before it starts.
  auto q = s.submit(spec_of(prompt_of(3, 3), 4), nullptr);
  q->cancel();
  s.step();
  EXPECT_TRUE(q->finished());
}

TEST(Scheduler, PreemptionUnderASmallBudgetGivesTheSameTokens) {
  Fixture& f = fixture();
  SchedulerOptions o = small_options();
  // Room for one request's whole plan and a second one's fixed part: both start, both
  // grow, and the younger is preempted and later recomputed.
  const std::vector<int32_t> p0 = prompt_of(10, 110), p1 = prompt_of(11, 110);
  const int64_t need = static_cast<int64_t>(std::max(p0.size(), p1.size())) + 6;
  auto plan = CachePlan::compute(f.model->config(), static_cast<uint64_t>(need), false);
  ASSERT_TRUE(plan.is_ok());
  o.kv_budget = plan->total() + plan->fixed() + 16 * 1024;
  o.prefix.max_idle = 0;
  Scheduler s(*f.model, *f.tokenizer, o);
  std::vector<RequestSpec> specs{spec_of(p0, 6, 7), spec_of(p1, 6, 8)};
  std::vector<std::shared_ptr<RequestHandle>> hs;
  for (const RequestSpec& sp : specs) {
    Rejection why;
    hs.push_back(s.submit(sp, &why));
    ASSERT_TRUE(hs.back()) << why.status.message();
  }
  const auto out = drain(s, hs, 4000);
  for (size_t i = 0; i < hs.size(); ++i) {
    ASSERT_TRUE(out[i].error.is_ok()) << out[i].error.message();
    EXPECT_EQ(with_stop(out[i]), reference(specs[i].prompt, specs[i].max_tokens, specs[i].sampling.seed, 512)) << i;
  }
  const SchedulerMetrics m = s.metrics();
  EXPECT_GT(m.preemptions, 0u);
  EXPECT_EQ(m.cache_bytes_used, 0u);  // nothing idle is kept (max_idle 0)
}

TEST(Scheduler, AdmissionRefusesWithNumbers) {
  Fixture& f = fixture();
  SchedulerOptions o = small_options();
  o.max_context = 64;
  auto plan = CachePlan::compute(f.model->config(), 64, false);
  o.kv_budget = plan->total() - 1;
  o.max_queue = 2;
  Scheduler s(*f.model, *f.tokenizer, o);
  Rejection why;
  EXPECT_FALSE(s.submit(spec_of(std::vector<int32_t>(64, 300), 1), &why));
  EXPECT_EQ(why.status.code(), StatusCode::kOutOfRange);
  EXPECT_NE(why.status.message().find("64 tokens"), std::string::npos) << why.status.message();
  EXPECT_FALSE(s.submit(spec_of(std::vector<int32_t>(10, 300), -1), &why));
  EXPECT_EQ(why.status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(why.status.message().find(std::to_string(o.kv_budget)), std::string::npos) << why.status.message();
  EXPECT_FALSE(s.submit(spec_of({}, 1), &why));
  EXPECT_FALSE(s.submit(spec_of({999999}, 1), &why));
  EXPECT_TRUE(s.submit(spec_of(std::vector<int32_t>(10, 300), 4), &why));
  EXPECT_TRUE(s.submit(spec_of(std::vector<int32_t>(10, 301), 4), &why));
  EXPECT_FALSE(s.submit(spec_of(std::vector<int32_t>(10, 302), 4), &why));
  EXPECT_EQ(why.status.code(), StatusCode::kResourceExhausted);
  EXPECT_GE(why.retry_after_seconds, 1);
}

TEST(Scheduler, GrammarConstrainedOutputParsesWithinMaxTokens) {
  Fixture& f = fixture();
  Scheduler s(*f.model, *f.tokenizer, small_options());
  const text::OrderedJson schema = text::OrderedJson::parse(R"({
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"},
                   "unit": {"enum": ["celsius", "fahrenheit"]}, "ok": {"type": "boolean"}},
    "required": ["city", "unit"], "additionalProperties": false})");
  OutputGrammarSpec gs;
  gs.body = OutputGrammarSpec::Body::kJsonSchema;
  gs.schema = schema;
  auto g = build_output_grammar(gs);
  ASSERT_TRUE(g.is_ok()) << g.status().message();
  for (uint64_t seed : {1u, 2u}) {
    for (int64_t max_tokens : {30, 90}) {
      RequestSpec spec = spec_of(prompt_of(20, 3), max_tokens, seed);
      spec.grammar = *g;
      auto out = drain(s, {s.submit(spec, nullptr)})[0];
      ASSERT_TRUE(out.error.is_ok()) << out.error.message();
      const auto j = text::OrderedJson::parse(out.generated_text, nullptr, false);
      ASSERT_FALSE(j.is_discarded()) << seed << " " << max_tokens << ": " << out.generated_text;
      EXPECT_EQ(text::check_json_schema(j, schema, "output"), "") << out.generated_text;
      EXPECT_LE(out.usage.completion_tokens, max_tokens);
    }
  }
}

}  // namespace
}  // namespace dsv4::runtime
