// The sampler's distributions, checked exactly (distribution()) against hand-computed
// probabilities, and statistically (sample()) by a chi-square test with fixed seeds.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "runtime/sampler.h"

namespace dsv4::runtime {
namespace {

// One field changed from the defaults.
template <typename T>
SamplingParams with(T SamplingParams::*field, T value) {
  SamplingParams p;
  p.*field = value;
  return p;
}

const std::vector<float> kLogits = {2.0f, 1.0f, 0.5f, 3.0f, -1.0f, 0.0f, 1.5f, -2.0f};

std::vector<double> softmax(const std::vector<float>& l, double t) {
  std::vector<double> p(l.size());
  double m = *std::max_element(l.begin(), l.end()), s = 0;
  for (size_t i = 0; i < l.size(); ++i) s += p[i] = std::exp((l[i] - m) / t);
  for (double& x : p) x /= s;
  return p;
}

// Keeps only `ids` of p and renormalises.
std::vector<double> restrict_to(std::vector<double> p, const std::vector<int>& ids) {
  std::vector<double> q(p.size(), 0.0);
  double s = 0;
  for (int i : ids) s += q[i] = p[i];
  for (double& x : q) x /= s;
  return q;
}

std::vector<double> as_vector(const std::vector<TokenProb>& d, size_t n) {
  std::vector<double> v(n, 0.0);
  for (const TokenProb& t : d) v[t.id] = t.p;
  return v;
}

void expect_close(const std::vector<double>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-6) << "token " << i;
}

// Draws n samples and compares the counts with `want` (chi-square, p < 1e-6 fails).
void expect_samples_follow(SamplingParams params, const std::vector<double>& want, int n = 40000) {
  Sampler s(params);
  std::vector<int> counts(want.size(), 0);
  for (int i = 0; i < n; ++i) ++counts.at(static_cast<size_t>(s.sample(kLogits)));
  double chi2 = 0;
  int df = -1;
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i] == 0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " has probability 0";
      continue;
    }
    const double e = n * want[i];
    chi2 += (counts[i] - e) * (counts[i] - e) / e;
    ++df;
  }
  // For df <= 7 the 1e-6 critical value is below 40.
  EXPECT_LT(chi2, 40.0) << "df " << df << ", seed " << params.seed;
}

TEST(Sampler, TemperatureScalesTheSoftmax) {
  for (float t : {1.0f, 0.5f, 2.0f}) {
    SamplingParams p;
    p.temperature = t;
    p.seed = 7;
    expect_close(as_vector(Sampler(p).distribution(kLogits), kLogits.size()), softmax(kLogits, t));
    expect_samples_follow(p, softmax(kLogits, t));
  }
}

TEST(Sampler, GreedyIsTheArgMaxAndIgnoresTheSeed) {
  SamplingParams p;
  p.temperature = 0;
  for (uint64_t seed : {1u, 2u, 3u}) {
    p.seed = seed;
    Sampler s(p);
    for (int i = 0; i < 10; ++i) EXPECT_EQ(s.sample(kLogits), 3);
  }
  std::vector<float> tie = {1.0f, 5.0f, 5.0f};
  EXPECT_EQ(Sampler(p).sample(tie), 1);
}

TEST(Sampler, TopKTopPAndMinP) {
  const auto base = softmax(kLogits, 1.0);  // order: 3, 0, 6, 1, 2, 5, 4, 7
  SamplingParams k;
  k.top_k = 3;
  k.seed = 11;
  expect_close(as_vector(Sampler(k).distribution(kLogits), 8), restrict_to(base, {3, 0, 6}));
  expect_samples_follow(k, restrict_to(base, {3, 0, 6}));

  SamplingParams tp;
  tp.top_p = 0.8f;  // p(3)+p(0) = 0.78 < 0.8, adding 6 reaches it
  tp.seed = 12;
  ASSERT_LT(base[3] + base[0], 0.8);
  ASSERT_GE(base[3] + base[0] + base[6], 0.8);
  expect_close(as_vector(Sampler(tp).distribution(kLogits), 8), restrict_to(base, {3, 0, 6}));
  expect_samples_follow(tp, restrict_to(base, {3, 0, 6}));

  SamplingParams mp;
  mp.min_p = 0.2f;  // keep p >= 0.2 * p(3): exp(l - 3) >= 0.2, i.e. l >= 3 + ln 0.2 = 1.39
  mp.seed = 13;
  expect_close(as_vector(Sampler(mp).distribution(kLogits), 8), restrict_to(base, {3, 0, 6}));
  mp.min_p = 0.1f;  // l >= 0.70: adds token 1
  expect_close(as_vector(Sampler(mp).distribution(kLogits), 8), restrict_to(base, {3, 0, 6, 1}));
  expect_samples_follow(mp, restrict_to(base, {3, 0, 6, 1}));
}

TEST(Sampler, PenaltiesAndLogitBias) {
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  p.presence_penalty = 0.5f;
  p.frequency_penalty = 0.25f;
  p.logit_bias = {{4, 3.0f}, {7, -INFINITY}};
  p.seed = 21;
  Sampler s(p);
  s.accept(3);
  s.accept(3);
  s.accept(4);
  std::vector<float> want = kLogits;
  want[4] += 3.0f;                              // bias first: 2.0
  want[3] = 3.0f / 2 - 0.5f - 0.25f * 2;        // positive: divided, then penalties
  want[4] = want[4] / 2 - 0.5f - 0.25f * 1;     // 2.0 -> 0.25
  std::vector<double> expected = softmax(want, 1.0);
  expected = restrict_to(expected, {0, 1, 2, 3, 4, 5, 6});  // token 7 banned
  expect_close(as_vector(s.distribution(kLogits), 8), expected);
  // Negative logits are multiplied by the repetition penalty.
  Sampler neg(with(&SamplingParams::repetition_penalty, 2.0f));
  neg.accept(4);
  std::vector<float> w2 = kLogits;
  w2[4] = -2.0f;
  expect_close(as_vector(neg.distribution(kLogits), 8), softmax(w2, 1.0));
}

TEST(Sampler, SameSeedSameTokensDifferentSeedDifferent) {
  auto run = [](uint64_t seed) {
    Sampler s(with(&SamplingParams::seed, seed));
    std::vector<int32_t> out;
    for (int i = 0; i < 64; ++i) out.push_back(s.sample(kLogits));
    return out;
  };
  EXPECT_EQ(run(42), run(42));
  EXPECT_NE(run(42), run(43));
  Sampler s(with(&SamplingParams::seed, uint64_t{5}));
  const int32_t first = s.sample(kLogits);
  s.reset();
  EXPECT_EQ(s.sample(kLogits), first);
}

TEST(Sampler, ValidateNamesTheField) {
  EXPECT_TRUE(SamplingParams{}.validate(8).is_ok());
  auto msg = [](SamplingParams p) { return p.validate(8).message(); };
  EXPECT_NE(msg(with(&SamplingParams::temperature, -1.0f)).find("temperature = -1"), std::string::npos);
  EXPECT_NE(msg(with(&SamplingParams::top_p, 0.0f)).find("top_p"), std::string::npos);
  EXPECT_NE(msg(with(&SamplingParams::top_p, 1.5f)).find("top_p"), std::string::npos);
  EXPECT_NE(msg(with(&SamplingParams::min_p, 2.0f)).find("min_p"), std::string::npos);
  EXPECT_NE(msg(with(&SamplingParams::top_k, -3)).find("top_k"), std::string::npos);
  EXPECT_NE(msg(with(&SamplingParams::repetition_penalty, 0.0f)).find("repetition_penalty"), std::string::npos);
  EXPECT_NE(msg(with(&SamplingParams::temperature, NAN)).find("temperature"), std::string::npos);
  SamplingParams b;
  b.logit_bias = {{8, 1.0f}};
  EXPECT_NE(msg(b).find("token id 8"), std::string::npos);
}

}  // namespace
}  // namespace dsv4::runtime
