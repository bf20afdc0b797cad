// Backend::sample on the CPU: greedy, the truncations (top-k, top-p, min-p), the
// adjustments, determinism in (seed, counter), and the drawn distribution against the
// exact renormalised softmax by a chi-square test (fixed seeds, so the test is
// deterministic; the threshold is the 0.999 quantile).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/sampling.h"
#include "support/test_support.h"

namespace dsv4::backend {
namespace {

struct Params {
  float temperature = 1.0f, top_p = 1.0f, min_p = 0.0f;
  int32_t top_k = 0;
  uint64_t seed = 1, counter = 0;
};

int32_t bits(float f) {
  int32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

std::vector<int32_t> param_row(const Params& p) {
  return {bits(p.temperature), bits(p.top_p), bits(p.min_p), p.top_k, static_cast<int32_t>(p.seed),
          static_cast<int32_t>(p.seed >> 32), static_cast<int32_t>(p.counter), static_cast<int32_t>(p.counter >> 32)};
}

class CpuSample : public ::testing::Test {
 protected:
  CpuSample() : be_(2) {}
  Tensor f32(std::vector<int64_t> shape, const std::vector<float>& v) {
    Tensor t = be_.alloc(GgmlType::F32, shape).value();
    EXPECT_TRUE(be_.upload(t, v.data(), v.size() * sizeof(float)).is_ok());
    return t;
  }
  Tensor i32(std::vector<int64_t> shape, const std::vector<int32_t>& v) {
    Tensor t = be_.alloc(GgmlType::I32, shape).value();
    EXPECT_TRUE(be_.upload(t, v.data(), v.size() * sizeof(int32_t)).is_ok());
    return t;
  }
  // Draws `n` tokens from one row of logits, counter 0..n-1 (all rows in one call).
  std::vector<int32_t> draws(const std::vector<float>& logits, Params p, int64_t n) {
    const int64_t vocab = static_cast<int64_t>(logits.size());
    std::vector<float> all;
    std::vector<int32_t> params;
    for (int64_t i = 0; i < n; ++i) {
      all.insert(all.end(), logits.begin(), logits.end());
      p.counter = static_cast<uint64_t>(i);
      const auto row = param_row(p);
      params.insert(params.end(), row.begin(), row.end());
    }
    Tensor out = i32({n}, std::vector<int32_t>(n, -5));
    const Status st = be_.sample(f32({n, vocab}, all), i32({n, kSampleFields}, params), nullptr, out);
    EXPECT_TRUE(st.is_ok()) << st.message();
    std::vector<int32_t> t(n);
    EXPECT_TRUE(be_.download(out, t.data(), n * sizeof(int32_t)).is_ok());
    return t;
  }
  CpuBackend be_;
};

// The exact distribution the definition gives (double).
std::vector<double> expected(const std::vector<float>& logits, const Params& p) {
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::vector<double> z(logits.size());
  for (size_t i = 0; i < z.size(); ++i) z[i] = logits[i] / p.temperature;
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return z[a] > z[b]; });
  size_t keep = order.size();
  if (p.top_k > 0) keep = std::min<size_t>(keep, p.top_k);
  std::vector<double> w(order.size());
  double total = 0;
  for (size_t j = 0; j < keep; ++j) total += w[j] = std::exp(z[order[j]] - z[order[0]]);
  if (p.top_p < 1) {
    double acc = 0;
    for (size_t j = 0; j < keep; ++j)
      if ((acc += w[j]) >= p.top_p * total) {
        keep = j + 1;
        break;
      }
  }
  if (p.min_p > 0) {
    size_t m = 1;
    while (m < keep && w[m] >= p.min_p) ++m;
    keep = m;
  }
  std::vector<double> prob(logits.size(), 0.0);
  double kept = 0;
  for (size_t j = 0; j < keep; ++j) kept += w[j];
  for (size_t j = 0; j < keep; ++j) prob[order[j]] = w[j] / kept;
  return prob;
}

// Pearson's statistic over the cells with expected count >= 5 (the rest pooled).
double chi_square(const std::vector<int32_t>& tokens, const std::vector<double>& prob, int* dof) {
  std::vector<double> count(prob.size(), 0.0);
  for (int32_t t : tokens) count.at(t) += 1;
  const double n = static_cast<double>(tokens.size());
  double stat = 0, pool_obs = 0, pool_exp = 0;
  *dof = -1;
  for (size_t i = 0; i < prob.size(); ++i) {
    if (prob[i] == 0) {
      EXPECT_EQ(count[i], 0) << "token " << i << " is outside the kept set but was drawn";
      continue;
    }
    if (n * prob[i] < 5) {
      pool_obs += count[i];
      pool_exp += n * prob[i];
      continue;
    }
    stat += (count[i] - n * prob[i]) * (count[i] - n * prob[i]) / (n * prob[i]);
    ++*dof;
  }
  if (pool_exp > 0) {
    stat += (pool_obs - pool_exp) * (pool_obs - pool_exp) / pool_exp;
    ++*dof;
  }
  return stat;
}

// 0.999 quantile of chi-square with k degrees of freedom (Wilson-Hilferty).
double chi_square_999(int k) {
  const double z = 3.0902, a = 2.0 / (9.0 * k);
  return k * std::pow(1 - a + z * std::sqrt(a), 3);
}

TEST_F(CpuSample, GreedyIsTheLowestArgmax) {
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f, 1.0f};
  Params p;
  p.temperature = 0;
  for (int32_t t : draws(logits, p, 4)) EXPECT_EQ(t, 1);
}

TEST_F(CpuSample, DistributionsMatchTheDefinition) {
  std::mt19937_64 rng(test::test_seed());
  const std::vector<float> logits = test::random_normal(24, rng, 1.5f);
  std::vector<Params> cases(5);
  cases[1].temperature = 0.7f;
  cases[2].top_k = 5;
  cases[3].top_p = 0.6f;
  cases[4].min_p = 0.15f;
  cases[4].temperature = 1.3f;
  for (size_t c = 0; c < cases.size(); ++c) {
    cases[c].seed = 1000 + c;
    const auto tokens = draws(logits, cases[c], 20000);
    int dof = 0;
    const double stat = chi_square(tokens, expected(logits, cases[c]), &dof);
    ASSERT_GT(dof, 0);
    EXPECT_LT(stat, chi_square_999(dof)) << "case " << c << ": chi-square " << stat << " with " << dof << " dof";
  }
}

TEST_F(CpuSample, TopKKeepsExactlyKEvenWithTies) {
  const std::vector<float> logits = {1.0f, 3.0f, 3.0f, 3.0f, 0.0f, 3.0f};
  Params p;
  p.top_k = 2;  // four tokens tie at 3.0: the two lowest ids are kept
  std::set<int32_t> seen;
  for (int32_t t : draws(logits, p, 400)) seen.insert(t);
  EXPECT_EQ(seen, (std::set<int32_t>{1, 2}));
}

TEST_F(CpuSample, DeterministicInSeedAndCounter) {
  std::mt19937_64 rng(test::test_seed() + 1);
  const std::vector<float> logits = test::random_normal(100, rng, 0.5f);
  Params p;
  p.seed = 42;
  const auto a = draws(logits, p, 64), b = draws(logits, p, 64);
  EXPECT_EQ(a, b);
  p.seed = 43;
  EXPECT_NE(draws(logits, p, 64), a);
  EXPECT_GT(std::set<int32_t>(a.begin(), a.end()).size(), 8u);  // the counter varies the draws
}

TEST_F(CpuSample, AdjustmentsApplyBeforeTheChoice) {
  const std::vector<float> logits = {5.0f, 4.0f, 1.0f, -2.0f};
  Tensor l = f32({1, 4}, logits);
  Params p;
  p.temperature = 0;
  // Token 0 repetition 2 (5 -> 2.5), token 3 a bias of +10 (subtract -10): the arg-max is 3.
  const std::vector<int32_t> adj = {0, 0, bits(2.0f), bits(0.0f), 0, 3, bits(1.0f), bits(-10.0f)};
  Tensor a = i32({2, kAdjustFields}, adj);
  Tensor out = i32({1}, {-1});
  ASSERT_TRUE(be_.sample(l, i32({1, kSampleFields}, param_row(p)), &a, out).is_ok());
  int32_t t = -1;
  ASSERT_TRUE(be_.download(out, &t, sizeof t).is_ok());
  EXPECT_EQ(t, 3);
  std::vector<float> after(4);
  ASSERT_TRUE(be_.download(l, after.data(), sizeof(float) * 4).is_ok());
  EXPECT_EQ(after, (std::vector<float>{2.5f, 4.0f, 1.0f, 8.0f}));
  const std::vector<int32_t> bad = {0, 9, bits(1.0f), bits(0.0f)};
  Tensor b = i32({1, kAdjustFields}, bad);
  EXPECT_FALSE(be_.sample(l, i32({1, kSampleFields}, param_row(p)), &b, out).is_ok());
}

TEST(SampleNoise, PhiloxMatchesTheReferenceVector) {
  // Random123's known-answer vector for philox4x32-10 with counter and key all zero.
  const Philox4x32 r = philox4x32(0, 0, 0, 0, 0, 0);
  EXPECT_EQ(r.v[0], 0x6627e8d5u);
  EXPECT_EQ(r.v[1], 0xe169c58du);
  EXPECT_EQ(r.v[2], 0xbc57ac4cu);
  EXPECT_EQ(r.v[3], 0x9b00dbd8u);
  for (uint32_t t = 0; t < 1000; ++t) {
    const double u = sample_uniform(7, 3, t);
    EXPECT_GT(u, 0.0);
    EXPECT_LT(u, 1.0);
  }
}

}  // namespace
}  // namespace dsv4::backend
