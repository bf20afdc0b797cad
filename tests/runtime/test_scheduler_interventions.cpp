// The scheduler with a KV graft and with GLP steering, on the built-in tiny model, against
// the Generator as reference: grafted requests, batched, give exactly the tokens a
// grafted Generator gives alone, and reuse their prefixes; per-request strengths in one
// batch give each strength's tokens alone (0: the unsteered ones), even when the same
// prompt was cached at another strength; admission counts the footprint and refuses a
// strength without a binding or out of bounds.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <random>

#include "backend/cpu/cpu_backend.h"
#include "runtime/scheduler.h"
#include "support/builtin_model_fixture.h"
#include "support/test_support.h"
#include "synth/builtin_model.h"

namespace dsv4::runtime {
namespace {

using Fixture = test::BuiltinModel;
Fixture& fixture() { return test::builtin_model(); }

std::vector<int32_t> prompt_of(int i, int words) {
  std::string s = "<｜begin▁of▁sentence｜><｜User｜>";
  for (int w = 0; w < words; ++w) s += fmt::format(" w{}x{}", i, w);
  return *fixture().tokenizer->encode(s + "<｜Assistant｜></think>");
}

RequestSpec spec_of(std::vector<int32_t> prompt, int64_t max_tokens) {
  RequestSpec s;
  s.prompt = std::move(prompt);
  s.max_tokens = max_tokens;
  s.sampling.temperature = 0.0f;
  return s;
}

std::vector<RequestEvent> drain(Scheduler& s, const std::vector<std::shared_ptr<RequestHandle>>& hs) {
  std::vector<RequestEvent> last(hs.size());
  std::vector<bool> done(hs.size(), false);
  for (int i = 0; i < 4000; ++i) {
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
  ADD_FAILURE() << "requests did not finish";
  return last;
}

std::vector<int32_t> tokens_of(const RequestEvent& e) {
  std::vector<int32_t> t = e.tokens;
  if (e.finish == FinishReason::kEos) t.push_back(fixture().tokenizer->eos_id());
  return t;
}

std::vector<int32_t> reference(const std::vector<int32_t>& prompt, int64_t n, std::shared_ptr<const KvGraft> graft) {
  Generator gen(*fixture().model, *fixture().tokenizer, 512);
  gen.set_graft(std::move(graft));
  GenerateOptions o;
  o.max_tokens = n;
  o.sampling.temperature = 0.0f;
  auto r = gen.generate(prompt, o, nullptr);
  EXPECT_TRUE(r.is_ok()) << r.status().message();
  std::vector<int32_t> t = r->tokens;
  if (r->stop_token >= 0) t.push_back(r->stop_token);
  return t;
}

SchedulerOptions options() {
  SchedulerOptions o;
  o.max_context = 512;
  o.max_seqs = 4;
  o.batch_tokens = 24;
  o.prefix.snapshot_interval = 16;
  return o;
}

std::shared_ptr<const KvGraft> bank_of(const std::vector<int32_t>& prompt) {
  const Model& m = *fixture().model;
  const size_t T = prompt.size() / m.plan().max_ratio() * m.plan().max_ratio();
  EXPECT_GT(T, 0u);
  SequenceOptions so;
  so.max_context = 512;
  auto seq = m.new_sequence(so);
  EXPECT_TRUE(seq.is_ok());
  EXPECT_TRUE(m.prefill(**seq, std::span<const int32_t>(prompt.data(), T)).is_ok());
  auto g = m.extract_graft(**seq);
  EXPECT_TRUE(g.is_ok()) << g.status().message();
  return std::make_shared<KvGraft>(std::move(*g));
}

TEST(SchedulerInterventions, GraftedRequestsMatchAGraftedGeneratorAndReusePrefixes) {
  Fixture& f = fixture();
  const auto bank = bank_of(prompt_of(99, 30));
  SchedulerOptions o = options();
  o.prefix.graft = bank;
  Scheduler s(*f.model, *f.tokenizer, o);
  std::vector<RequestSpec> specs;
  std::vector<std::shared_ptr<RequestHandle>> hs;
  for (int i = 0; i < 3; ++i) {
    specs.push_back(spec_of(prompt_of(i, 4 + 5 * i), 5));
    Rejection why;
    hs.push_back(s.submit(specs.back(), &why));
    ASSERT_TRUE(hs.back()) << why.status.message();
  }
  const auto out = drain(s, hs);
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_TRUE(out[i].error.is_ok()) << out[i].error.message();
    EXPECT_EQ(tokens_of(out[i]), reference(specs[i].prompt, 5, bank)) << i;
  }
  EXPECT_NE(tokens_of(out[2]), reference(specs[2].prompt, 5, nullptr));  // the graft is attended to

  // The same prompt again: reused from the grafted entry, the same tokens.
  const auto again = drain(s, {s.submit(specs[2], nullptr)})[0];
  ASSERT_TRUE(again.error.is_ok()) << again.error.message();
  EXPECT_GT(again.usage.cached_tokens, 0);
  EXPECT_EQ(tokens_of(again), tokens_of(out[2]));

  // The footprint counts against the context.
  const int64_t room = 512 - bank->footprint;
  Rejection why;
  EXPECT_FALSE(s.submit(spec_of(std::vector<int32_t>(static_cast<size_t>(room), 100), 1), &why));
  EXPECT_EQ(why.status.code(), StatusCode::kOutOfRange);
  EXPECT_NE(why.status.message().find("after the KV graft's"), std::string::npos) << why.status.message();
  EXPECT_TRUE(s.submit(spec_of(std::vector<int32_t>(static_cast<size_t>(room - 1), 100), 1), &why));
}

TEST(SchedulerInterventions, PerRequestStrengthsMatchEachStrengthAlone) {
  Fixture& f = fixture();
  Model& model = *f.model;
  const std::vector<int32_t> p = prompt_of(7, 12);
  {
    Scheduler s(model, *f.tokenizer, options());
    Rejection why;
    RequestSpec sp = spec_of(p, 2);
    sp.steering_alpha = 0.5f;
    EXPECT_FALSE(s.submit(sp, &why));
    EXPECT_NE(why.status.message().find("no steering file is bound"), std::string::npos) << why.status.message();
  }
  SteeringFile file;
  file.mode = SteerMode::Add;
  file.hook = SteerHook::FfnOut;
  file.alpha = 3.0f;
  file.model_identity = model.config().identity();
  std::mt19937_64 rng(11);
  for (uint32_t l = 0; l < model.config().n_layers; ++l)
    file.directions.push_back({l, test::random_normal(model.config().hidden, rng, 0.5f)});

  const std::vector<int32_t> unsteered = reference(p, 6, nullptr);
  ASSERT_TRUE(model.bind_steering(file, 2.0f).is_ok());
  const std::vector<int32_t> at_two = reference(p, 6, nullptr);
  ASSERT_TRUE(model.bind_steering(file, -4.0f).is_ok());
  const std::vector<int32_t> at_minus_four = reference(p, 6, nullptr);
  ASSERT_TRUE(model.bind_steering(file).is_ok());  // default strength 3
  const std::vector<int32_t> at_three = reference(p, 6, nullptr);
  ASSERT_NE(at_two, unsteered);

  Scheduler s(model, *f.tokenizer, options());
  // The default first, so the prompt is cached at strength 3 before the others arrive.
  const auto first = drain(s, {s.submit(spec_of(p, 6), nullptr)})[0];
  ASSERT_TRUE(first.error.is_ok()) << first.error.message();
  EXPECT_EQ(tokens_of(first), at_three);
  std::vector<std::shared_ptr<RequestHandle>> hs;
  for (float a : {0.0f, 2.0f, -4.0f}) {
    RequestSpec sp = spec_of(p, 6);
    sp.steering_alpha = a;
    Rejection why;
    hs.push_back(s.submit(sp, &why));
    ASSERT_TRUE(hs.back()) << why.status.message();
  }
  const auto out = drain(s, hs);
  EXPECT_EQ(tokens_of(out[0]), unsteered);
  EXPECT_EQ(tokens_of(out[1]), at_two);
  EXPECT_EQ(tokens_of(out[2]), at_minus_four);
  for (const auto& e : out) EXPECT_EQ(e.usage.cached_tokens, 0);  // another strength's rows are not reused

  for (float bad : {std::nanf(""), INFINITY, kMaxSteeringAlpha * 2}) {
    RequestSpec sp = spec_of(p, 2);
    sp.steering_alpha = bad;
    Rejection why;
    EXPECT_FALSE(s.submit(sp, &why)) << bad;
    EXPECT_NE(why.status.message().find("dsv4.glp_alpha"), std::string::npos) << why.status.message();
  }
  model.unbind_steering();
}

}  // namespace
}  // namespace dsv4::runtime
