// Speculative decoding in the scheduler, on the built-in tiny model (random weights, one
// MTP block: its drafts mostly fail, so nearly every step rolls back): concurrent greedy
// requests give token for token what they give without speculation, k = 1..4, with chunked
// prefill beside the verify steps, stop tokens, stop strings and max_tokens (nothing past
// a stop); a continued prefix keeps drafting; requests with log-probabilities or a grammar
// decode without drafts and are unchanged; preemption under a small budget changes nothing;
// forced drafts that agree are accepted and change nothing either.
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

std::vector<int32_t> prompt_of(int i, int words) {
  std::string s = "<｜begin▁of▁sentence｜><｜User｜>";
  for (int w = 0; w < words; ++w) s += fmt::format(" s{}y{}", i, w);
  return *fixture().tokenizer->encode(s + "<｜Assistant｜></think>");
}

RequestSpec greedy(std::vector<int32_t> prompt, int64_t max_tokens) {
  RequestSpec s;
  s.prompt = std::move(prompt);
  s.max_tokens = max_tokens;
  s.sampling.temperature = 0.0f;
  return s;
}

SchedulerOptions options(int k) {
  SchedulerOptions o;
  o.max_context = 512;
  o.max_seqs = 4;
  o.batch_tokens = 24;  // chunked prefill beside verify steps; k cut where rows run out
  o.prefix.snapshot_interval = 16;
  if (k > 0) {
    SpecOptions so;
    so.max_k = k;
    so.adaptive = false;  // draft every step: the rollback runs nearly every time
    o.speculative = so;
  }
  return o;
}

// What a request gave: its final event and every text piece streamed before it.
struct Outcome {
  RequestEvent last;
  std::string streamed;
  int64_t logprob_count = 0;
};

std::vector<Outcome> run_all(Scheduler& s, const std::vector<RequestSpec>& specs) {
  std::vector<std::shared_ptr<RequestHandle>> hs;
  for (const RequestSpec& spec : specs) {
    Rejection why;
    hs.push_back(s.submit(spec, &why));
    EXPECT_TRUE(hs.back()) << why.status.message();
    if (!hs.back()) return {};
  }
  std::vector<Outcome> out(hs.size());
  std::vector<bool> done(hs.size(), false);
  for (int step = 0; step < 4000; ++step) {
    s.step();
    bool all = true;
    for (size_t i = 0; i < hs.size(); ++i) {
      for (RequestEvent& e : hs[i]->wait(std::chrono::milliseconds(0))) {
        out[i].streamed += e.text;
        out[i].logprob_count += static_cast<int64_t>(e.logprobs.size());
        if (e.done) {
          out[i].last = std::move(e);
          done[i] = true;
        }
      }
      all = all && done[i];
    }
    if (all) return out;
  }
  ADD_FAILURE() << "requests did not finish";
  return out;
}

void expect_same(const std::vector<Outcome>& got, const std::vector<Outcome>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    SCOPED_TRACE(i);
    ASSERT_TRUE(got[i].last.error.is_ok()) << got[i].last.error.message();
    EXPECT_EQ(got[i].last.tokens, want[i].last.tokens);
    EXPECT_EQ(got[i].last.finish, want[i].last.finish);
    EXPECT_EQ(got[i].streamed, want[i].streamed);
    EXPECT_EQ(got[i].last.generated_text, want[i].last.generated_text);
    EXPECT_EQ(got[i].last.usage.prompt_tokens, want[i].last.usage.prompt_tokens);
    EXPECT_EQ(got[i].last.usage.completion_tokens, want[i].last.usage.completion_tokens);
    EXPECT_EQ(got[i].logprob_count, want[i].logprob_count);
  }
}

std::vector<Outcome> plain(const std::vector<RequestSpec>& specs, SchedulerOptions o = options(0)) {
  Scheduler s(*fixture().model, *fixture().tokenizer, o);
  return run_all(s, specs);
}

TEST(SchedulerSpeculative, GreedyEqualsPlainWithStopsAndLimits) {
  Fixture& f = fixture();
  ASSERT_TRUE(f.model->has_mtp());
  std::vector<RequestSpec> specs;
  for (int i = 0; i < 3; ++i) specs.push_back(greedy(prompt_of(i, 3 + 5 * i), 9 + i));
  specs.push_back(greedy(prompt_of(7, 5), 1));  // one token: nothing to draft
  // Stops inside the output: a stop token and a stop string from the plain run's tokens.
  const std::vector<Outcome> free_run = plain({specs[0], specs[1]});
  ASSERT_EQ(free_run.size(), 2u);
  const std::vector<int32_t>& t0 = free_run[0].last.tokens;
  const std::vector<int32_t>& t1 = free_run[1].last.tokens;
  ASSERT_GE(t0.size(), 7u);
  ASSERT_GE(t1.size(), 8u);
  specs[0].stop_tokens = {t0[4]};
  specs[1].stop_strings = {f.tokenizer->decode(std::vector<int32_t>(t1.begin() + 5, t1.begin() + 7))};
  const std::vector<Outcome> want = plain(specs);
  EXPECT_LT(want[0].last.tokens.size(), t0.size());
  EXPECT_LT(want[1].last.tokens.size(), t1.size());
  for (int k = 1; k <= 4; ++k) {
    SCOPED_TRACE(k);
    Scheduler s(*f.model, *f.tokenizer, options(k));
    const std::vector<Outcome> got = run_all(s, specs);
    expect_same(got, want);
    for (size_t i = 0; i < specs.size(); ++i)
      EXPECT_LE(got[i].last.usage.completion_tokens, specs[i].max_tokens) << i;
    const SchedulerMetrics m = s.metrics();
    EXPECT_GT(m.spec_steps, 0u);
    EXPECT_GT(m.spec_drafted, 0u);
    EXPECT_LE(m.spec_accepted, m.spec_drafted);
    EXPECT_EQ(m.running, 0u);
  }
}

// Drafts that agree (the plain run's own tokens, every one or every other one): accepted
// runs of tokens, stops and max_tokens inside them, the MTP rows of accepted chains
// rewound. Forced drafts are keyed by position, so one request speculates at a time; a
// request with log-probabilities decodes beside it.
TEST(SchedulerSpeculative, AcceptedDraftsGiveThePlainTokens) {
  Fixture& f = fixture();
  RequestSpec one = greedy(prompt_of(60, 6), 11);
  RequestSpec beside = greedy(prompt_of(61, 4), 5);
  beside.top_logprobs = 1;
  const std::vector<Outcome> free_run = plain({one, beside});
  std::vector<int32_t> full = one.prompt;
  full.insert(full.end(), free_run[0].last.tokens.begin(), free_run[0].last.tokens.end());
  ASSERT_GE(free_run[0].last.tokens.size(), 9u);
  RequestSpec stopped = one;
  stopped.stop_tokens = {free_run[0].last.tokens[6]};
  for (const bool every_other : {false, true}) {
    for (const RequestSpec& spec : {one, stopped}) {
      SCOPED_TRACE(every_other);
      const std::vector<Outcome> want = plain({spec, beside});
      SchedulerOptions o = options(3);
      o.speculative->forced_draft = [&](int64_t pos) {
        const int32_t t = pos < static_cast<int64_t>(full.size()) ? full[pos] : 0;
        return every_other && pos % 2 ? (t + 1) % 512 : t;
      };
      Scheduler s(*f.model, *f.tokenizer, o);
      expect_same(run_all(s, {spec, beside}), want);
      const SchedulerMetrics m = s.metrics();
      EXPECT_GT(m.spec_accepted, 0u);
      if (every_other) {
        EXPECT_LT(m.spec_accepted, m.spec_drafted);
      } else {
        EXPECT_EQ(m.spec_accepted, m.spec_drafted);
      }
    }
  }
}

TEST(SchedulerSpeculative, ContinuedPrefixKeepsDrafting) {
  Fixture& f = fixture();
  const std::vector<int32_t> p1 = prompt_of(30, 30);
  RequestSpec first = greedy(p1, 6);
  std::vector<int32_t> p2 = p1;
  const std::vector<Outcome> want1 = plain({first});
  p2.insert(p2.end(), want1[0].last.tokens.begin(), want1[0].last.tokens.end());
  const auto more = *f.tokenizer->encode("<｜end▁of▁sentence｜><｜User｜>And then?<｜Assistant｜></think>");
  p2.insert(p2.end(), more.begin(), more.end());
  RequestSpec second = greedy(p2, 8);

  Scheduler plain_s(*f.model, *f.tokenizer, options(0));
  (void)run_all(plain_s, {first});
  const std::vector<Outcome> want2 = run_all(plain_s, {second});

  Scheduler s(*f.model, *f.tokenizer, options(2));
  expect_same(run_all(s, {first}), want1);
  const uint64_t drafted = s.metrics().spec_drafted;
  const std::vector<Outcome> got2 = run_all(s, {second});
  expect_same(got2, want2);
  EXPECT_GT(got2[0].last.usage.cached_tokens, 0);
  EXPECT_EQ(got2[0].last.usage.cached_tokens, want2[0].last.usage.cached_tokens);
  EXPECT_GT(s.metrics().spec_drafted, drafted);  // the MTP inputs the entry kept let it draft
}

TEST(SchedulerSpeculative, LogprobsAndGrammarDecodeWithoutDrafts) {
  Fixture& f = fixture();
  RequestSpec lp = greedy(prompt_of(40, 4), 8);
  lp.top_logprobs = 2;
  const text::OrderedJson schema = text::OrderedJson::parse(
      R"({"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"]})");
  OutputGrammarSpec gs;
  gs.body = OutputGrammarSpec::Body::kJsonSchema;
  gs.schema = schema;
  auto g = build_output_grammar(gs);
  ASSERT_TRUE(g.is_ok()) << g.status().message();
  RequestSpec constrained = greedy(prompt_of(41, 4), 20);
  constrained.grammar = *g;
  const std::vector<RequestSpec> specs{lp, constrained};
  const std::vector<Outcome> want = plain(specs);
  Scheduler s(*f.model, *f.tokenizer, options(3));
  const std::vector<Outcome> got = run_all(s, specs);
  expect_same(got, want);
  EXPECT_EQ(got[0].logprob_count, static_cast<int64_t>(got[0].last.usage.completion_tokens));
  EXPECT_EQ(s.metrics().spec_drafted, 0u);
  const auto j = text::OrderedJson::parse(got[1].last.generated_text, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << got[1].last.generated_text;
}

TEST(SchedulerSpeculative, PreemptionUnderASmallBudgetGivesTheSameTokens) {
  Fixture& f = fixture();
  const std::vector<int32_t> p0 = prompt_of(50, 60), p1 = prompt_of(51, 60);
  const int64_t need = static_cast<int64_t>(std::max(p0.size(), p1.size())) + 8;
  auto plan = CachePlan::compute(f.model->config(), static_cast<uint64_t>(need), true);
  ASSERT_TRUE(plan.is_ok());
  const std::vector<RequestSpec> specs{greedy(p0, 6), greedy(p1, 6)};
  const std::vector<Outcome> want = plain(specs);
  SchedulerOptions o = options(2);
  o.kv_budget = plan->total() + plan->fixed() + 16 * 1024;  // one whole plan and a second one's fixed part
  o.prefix.max_idle = 0;
  Scheduler s(*f.model, *f.tokenizer, o);
  expect_same(run_all(s, specs), want);
  EXPECT_GT(s.metrics().preemptions, 0u);
}

}  // namespace
}  // namespace dsv4::runtime
