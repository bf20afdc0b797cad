// Each CPU backend operation against a plain-loop reference (double precision where it
// matters) on fresh random inputs. Outputs are poisoned with NaN first so an element the
// operation forgets to write shows up.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "gguf/quant.h"
#include "support/test_support.h"

namespace dsv4::backend {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

class CpuOps : public ::testing::Test {
 protected:
  CpuOps() : be_(2), rng_(test::test_seed()) {}
  void SetUp() override { RecordProperty("seed", std::to_string(test::test_seed())); }

  Tensor f32(std::vector<int64_t> shape, const std::vector<float>& values) {
    Tensor t = be_.alloc(GgmlType::F32, shape).value();
    EXPECT_TRUE(be_.upload(t, values.data(), values.size() * sizeof(float)).is_ok());
    return t;
  }
  Tensor poisoned(std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return f32(shape, std::vector<float>(n, kNaN));
  }
  Tensor i32(std::vector<int64_t> shape, const std::vector<int32_t>& values) {
    Tensor t = be_.alloc(GgmlType::I32, shape).value();
    EXPECT_TRUE(be_.upload(t, values.data(), values.size() * sizeof(int32_t)).is_ok());
    return t;
  }
  std::vector<float> read(const Tensor& t) {
    std::vector<float> v(t.n_elements());
    EXPECT_TRUE(be_.download(t, v.data(), v.size() * sizeof(float)).is_ok());
    return v;
  }
  std::vector<int32_t> read_i32(const Tensor& t) {
    std::vector<int32_t> v(t.n_elements());
    EXPECT_TRUE(be_.download(t, v.data(), v.size() * sizeof(int32_t)).is_ok());
    return v;
  }
  std::vector<float> randn(size_t n, float sd = 1) { return test::random_normal(n, rng_, sd); }

  // max |a - b| / max |b| (fp32 sums that cancel make element-wise ratios meaningless);
  // NaN fails.
  static void expect_close(const std::vector<float>& got, const std::vector<double>& want,
                           double tol, const char* what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    double worst = 0, scale = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_TRUE(std::isfinite(got[i])) << what << " element " << i;
      worst = std::max(worst, std::fabs(got[i] - want[i]));
      scale = std::max(scale, std::fabs(want[i]));
    }
    EXPECT_LE(worst / scale, tol) << what << " (seed " << test::test_seed() << ")";
  }

  CpuBackend be_;
  std::mt19937_64 rng_;
};

TEST_F(CpuOps, MatmulMatchesDoubleDotOverTypes) {
  const int64_t n_in = 256, n_out = 40, n_rows = 5;
  const std::vector<float> w = randn(n_in * n_out), x = randn(n_in * n_rows);
  for (GgmlType type : {GgmlType::F32, GgmlType::BF16, GgmlType::F16, GgmlType::Q8_0}) {
    const size_t row_bytes = ggml_row_bytes(type, n_in).value();
    std::vector<uint8_t> packed(row_bytes * n_out);
    for (int64_t o = 0; o < n_out; ++o) quantize_row(type, &w[o * n_in], &packed[o * row_bytes], n_in);
    Tensor wt = be_.alloc(type, std::vector<int64_t>{n_out, n_in}).value();
    ASSERT_TRUE(be_.upload(wt, packed.data(), packed.size()).is_ok());
    Tensor y = poisoned({n_rows, n_out});
    ASSERT_TRUE(be_.matmul(wt, f32({n_rows, n_in}, x), y, MatmulMode::Exact).is_ok());
    std::vector<double> want(n_rows * n_out);
    std::vector<float> row(n_in);
    for (int64_t o = 0; o < n_out; ++o) {
      dequantize_row(type, &packed[o * row_bytes], row.data(), n_in);
      for (int64_t s = 0; s < n_rows; ++s)
        for (int64_t i = 0; i < n_in; ++i) want[s * n_out + o] += double(row[i]) * x[s * n_in + i];
    }
    expect_close(read(y), want, 1e-4, ggml_type_name(type).data());
  }
}

// matmul_grouped (the output projection): group g's outputs are w's rows of group g times x's
// columns of group g, against the double dot; shapes that do not split into the groups fail.
TEST_F(CpuOps, MatmulGroupedTakesEachGroupsColumns) {
  const int64_t groups = 3, n = 8, k = 64, rows = 2;
  const std::vector<float> w = randn(groups * n * k), x = randn(rows * groups * k);
  Tensor wt = f32({groups * n, k}, w);
  Tensor y = poisoned({rows, groups * n});
  ASSERT_TRUE(be_.matmul_grouped(wt, f32({rows, groups * k}, x), y, groups, MatmulMode::Exact).is_ok());
  std::vector<double> want(rows * groups * n);
  for (int64_t s = 0; s < rows; ++s)
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t o = 0; o < n; ++o)
        for (int64_t i = 0; i < k; ++i)
          want[s * groups * n + g * n + o] += double(w[(g * n + o) * k + i]) * x[s * groups * k + g * k + i];
  expect_close(read(y), want, 1e-5, "matmul_grouped");
  const Status bad = be_.matmul_grouped(wt, f32({rows, groups * k}, x), y, 2, MatmulMode::Exact);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("2 groups"), std::string::npos) << bad.message();
}

// MatmulMode::Sequential: per output an fma chain from zero over each block of 192 inputs,
// the block sums added in order (the V4.1 reference's sgemm order), bit for bit; close to
// the double dot. K = 400 spans three blocks, 39 outputs leave a partial group of four.
TEST_F(CpuOps, MatmulSequentialIsTheBlockedFmaChain) {
  const int64_t n_in = 400, n_out = 39, n_rows = 3;
  const std::vector<float> w = randn(n_in * n_out), x = randn(n_in * n_rows);
  for (GgmlType type : {GgmlType::F32, GgmlType::BF16}) {
    const size_t row_bytes = ggml_row_bytes(type, n_in).value();
    std::vector<uint8_t> packed(row_bytes * n_out);
    for (int64_t o = 0; o < n_out; ++o) quantize_row(type, &w[o * n_in], &packed[o * row_bytes], n_in);
    Tensor wt = be_.alloc(type, std::vector<int64_t>{n_out, n_in}).value();
    ASSERT_TRUE(be_.upload(wt, packed.data(), packed.size()).is_ok());
    Tensor y = poisoned({n_rows, n_out});
    ASSERT_TRUE(be_.matmul(wt, f32({n_rows, n_in}, x), y, MatmulMode::Sequential).is_ok());
    const std::vector<float> got = read(y);
    std::vector<double> want(n_rows * n_out);
    std::vector<float> row(n_in);
    int64_t differ = 0;
    for (int64_t o = 0; o < n_out; ++o) {
      dequantize_row(type, &packed[o * row_bytes], row.data(), n_in);
      for (int64_t s = 0; s < n_rows; ++s) {
        float total = 0;
        for (int64_t k0 = 0; k0 < n_in; k0 += 192) {
          float chain = 0;
          for (int64_t k = k0; k < std::min<int64_t>(n_in, k0 + 192); ++k) chain = std::fma(row[k], x[s * n_in + k], chain);
          total = k0 == 0 ? chain : total + chain;
        }
        differ += std::memcmp(&total, &got[s * n_out + o], sizeof(float)) != 0;
        for (int64_t i = 0; i < n_in; ++i) want[s * n_out + o] += double(row[i]) * x[s * n_in + i];
      }
    }
    EXPECT_EQ(differ, 0) << ggml_type_name(type);
    expect_close(got, want, 1e-5, ggml_type_name(type).data());
  }
}

// rms_norm_torch_order: the sum of squares in torch's CPU order. For 128 values (the
// tiny-v41 rows: 16 vectors of 8, four accumulators, no cascade) against that order
// written out; for 5120 (the cascade) close to the double statistic of rms_norm.
TEST_F(CpuOps, RmsNormTorchOrder) {
  const std::vector<float> x = randn(2 * 128, 3), w = randn(128);
  Tensor y = poisoned({2, 128});
  Tensor wt = f32({128}, w);
  ASSERT_TRUE(be_.rms_norm_torch_order(f32({2, 128}, x), &wt, 1e-6f, 128, y).is_ok());
  const std::vector<float> got = read(y);
  int64_t differ = 0;
  for (int r = 0; r < 2; ++r) {
    const float* v = &x[r * 128];
    std::vector<float> sq(128);  // rounded squares first (x.square()), in memory: no fma below
    for (int i = 0; i < 128; ++i) sq[i] = v[i] * v[i];
    float lanes[8] = {};
    for (int l = 0; l < 8; ++l) {
      float acc[4] = {};
      for (int i = 0; i < 4; ++i)
        for (int k = 0; k < 4; ++k) acc[k] += sq[(4 * i + k) * 8 + l];
      lanes[l] = ((acc[0] + acc[1]) + acc[2]) + acc[3];
    }
    float sum = 0;
    for (float l : lanes) sum += l;
    const float inv = 1.0f / std::sqrt(sum / 128.0f + 1e-6f);
    for (int i = 0; i < 128; ++i) {
      const float want = v[i] * inv * w[i];
      differ += std::memcmp(&want, &got[r * 128 + i], sizeof(float)) != 0;
    }
  }
  EXPECT_EQ(differ, 0);

  const std::vector<float> big = randn(5120);
  Tensor a = poisoned({1, 5120}), b = poisoned({1, 5120});
  ASSERT_TRUE(be_.rms_norm_torch_order(f32({1, 5120}, big), nullptr, 1e-20f, 5120, a).is_ok());
  ASSERT_TRUE(be_.rms_norm(f32({1, 5120}, big), nullptr, 1e-20f, 5120, b).is_ok());
  const std::vector<float> ra = read(a), rb = read(b);
  expect_close(ra, std::vector<double>(rb.begin(), rb.end()), 1e-6, "5120 values");
}

TEST_F(CpuOps, HcPreSinkhornAndCollapse) {
  const int n_hc = 4, iters = 20, n_mix = 24;
  const int64_t n = 3, d = 64;
  const float eps = 1e-6f, norm_eps = 1e-6f;
  const auto streams = randn(n * n_hc * d), mixes = randn(n * n_mix, 3), base = randn(n_mix);
  const std::vector<float> scale = {0.5f, 0.6f, 0.4f};
  Tensor x = poisoned({n, d}), post = poisoned({n, n_hc}), comb = poisoned({n, n_hc * n_hc});
  ASSERT_TRUE(be_.hc_pre(f32({n, n_hc * d}, streams), f32({n, n_mix}, mixes), f32({3}, scale),
                         f32({n_mix}, base), n_hc, iters, eps, norm_eps, x, post, comb).is_ok());
  std::vector<double> want_x(n * d), want_post(n * n_hc), want_comb(n * n_hc * n_hc);
  for (int64_t s = 0; s < n; ++s) {
    double ss = 0;
    for (int64_t i = 0; i < n_hc * d; ++i) ss += double(streams[s * n_hc * d + i]) * streams[s * n_hc * d + i];
    const double rho = 1 / std::sqrt(ss / (n_hc * d) + norm_eps);
    const auto m = [&](int j) { return mixes[s * n_mix + j] * rho; };
    const auto sig = [](double v) { return 1 / (1 + std::exp(-v)); };
    double pre[4], c[4][4];
    for (int j = 0; j < n_hc; ++j) {
      pre[j] = sig(m(j) * scale[0] + base[j]) + eps;
      want_post[s * n_hc + j] = 2 * sig(m(4 + j) * scale[1] + base[4 + j]);
    }
    for (int j = 0; j < 4; ++j) {
      double row[4], mx = -1e300, sum = 0;
      for (int k = 0; k < 4; ++k) mx = std::max(mx, row[k] = m(8 + 4 * j + k) * scale[2] + base[8 + 4 * j + k]);
      for (int k = 0; k < 4; ++k) sum += row[k] = std::exp(row[k] - mx);
      for (int k = 0; k < 4; ++k) c[j][k] = row[k] / sum + eps;
    }
    for (int it = 0; it < iters; ++it) {
      if (it > 0)
        for (int j = 0; j < 4; ++j) {
          double sum = 0;
          for (int k = 0; k < 4; ++k) sum += c[j][k];
          for (int k = 0; k < 4; ++k) c[j][k] /= sum + eps;
        }
      for (int k = 0; k < 4; ++k) {
        double sum = 0;
        for (int j = 0; j < 4; ++j) sum += c[j][k];
        for (int j = 0; j < 4; ++j) c[j][k] /= sum + eps;
      }
    }
    for (int j = 0; j < 4; ++j)
      for (int k = 0; k < 4; ++k) want_comb[s * 16 + j * 4 + k] = c[j][k];
    for (int64_t i = 0; i < d; ++i)
      for (int j = 0; j < n_hc; ++j) want_x[s * d + i] += pre[j] * streams[s * n_hc * d + j * d + i];
  }
  expect_close(read(x), want_x, 1e-5, "collapsed x");
  expect_close(read(post), want_post, 1e-5, "post");
  expect_close(read(comb), want_comb, 1e-5, "comb");
  // hc_pre_norm: the same x, post and comb, and x's RMSNorm with the sublayer's weight.
  const auto norm = randn(d);
  Tensor x2 = poisoned({n, d}), post2 = poisoned({n, n_hc}), comb2 = poisoned({n, n_hc * n_hc}),
         normed = poisoned({n, d});
  ASSERT_TRUE(be_.hc_pre_norm(f32({n, n_hc * d}, streams), f32({n, n_mix}, mixes), f32({3}, scale),
                              f32({n_mix}, base), n_hc, iters, eps, norm_eps, f32({d}, norm), x2, post2, comb2,
                              normed).is_ok());
  EXPECT_EQ(read(x2), read(x));
  EXPECT_EQ(read(post2), read(post));
  EXPECT_EQ(read(comb2), read(comb));
  const auto xs = read(x);
  std::vector<double> want_normed(n * d);
  for (int64_t s = 0; s < n; ++s) {
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += double(xs[s * d + i]) * xs[s * d + i];
    for (int64_t i = 0; i < d; ++i) want_normed[s * d + i] = xs[s * d + i] / std::sqrt(ss / d + norm_eps) * norm[i];
  }
  expect_close(read(normed), want_normed, 1e-5, "hc_pre_norm normed");
  // hc_post: X'[k] = post_k y + sum_j comb[j, k] X[j] (source j, destination k).
  const auto y = randn(n * d);
  Tensor X = f32({n, n_hc * d}, streams);
  ASSERT_TRUE(be_.hc_post(f32({n, d}, y), post, comb, n_hc, X).is_ok());
  const auto p = read(post), cb = read(comb);
  std::vector<double> want(n * n_hc * d);
  for (int64_t s = 0; s < n; ++s)
    for (int k = 0; k < n_hc; ++k)
      for (int64_t i = 0; i < d; ++i) {
        double v = double(p[s * n_hc + k]) * y[s * d + i];
        for (int j = 0; j < n_hc; ++j) v += double(cb[s * 16 + j * 4 + k]) * streams[s * n_hc * d + j * d + i];
        want[s * n_hc * d + k * d + i] = v;
      }
  expect_close(read(X), want, 1e-5, "hc_post streams");
}

// Frequencies from the spec's formulas (§2.1) in double; inverse rotation restores.
// hc_pre_norm_from_fn's default: the mixes by matmul in the given mode, then hc_pre_norm, the
// same bits as those two calls.
TEST_F(CpuOps, HcPreNormFromTheMixWeightsIsTheTwoCalls) {
  const int n_hc = 4, iters = 20, n_mix = 24;
  const int64_t n = 3, d = 64;
  const auto streams = randn(n * n_hc * d), fn = randn(n_mix * n_hc * d, 0.2f), base = randn(n_mix),
             norm = randn(d);
  const Tensor st = f32({n, n_hc * d}, streams), fw = f32({n_mix, n_hc * d}, fn), sc = f32({3}, {0.5f, 0.6f, 0.4f}),
               bt = f32({n_mix}, base), nw = f32({d}, norm);
  Tensor mixes = poisoned({n, n_mix});
  Tensor x = poisoned({n, d}), post = poisoned({n, n_hc}), comb = poisoned({n, n_hc * n_hc}), normed = poisoned({n, d});
  ASSERT_TRUE(be_.matmul(fw, st, mixes, MatmulMode::Float32).is_ok());
  ASSERT_TRUE(be_.hc_pre_norm(st, mixes, sc, bt, n_hc, iters, 1e-6f, 1e-6f, nw, x, post, comb, normed).is_ok());
  Tensor x2 = poisoned({n, d}), post2 = poisoned({n, n_hc}), comb2 = poisoned({n, n_hc * n_hc}),
         normed2 = poisoned({n, d});
  ASSERT_TRUE(be_.hc_pre_norm_from_fn(fw, st, MatmulMode::Float32, sc, bt, n_hc, iters, 1e-6f, 1e-6f, nw, x2, post2,
                                      comb2, normed2).is_ok());
  const auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  EXPECT_TRUE(same_bits(read(x2), read(x)));
  EXPECT_TRUE(same_bits(read(post2), read(post)));
  EXPECT_TRUE(same_bits(read(comb2), read(comb)));
  EXPECT_TRUE(same_bits(read(normed2), read(normed)));
  for (float v : read(normed2)) ASSERT_TRUE(std::isfinite(v));
}

TEST_F(CpuOps, RopeWithYarnAndInverse) {
  RopeParams p;
  p.dims = 64;
  p.freq_base = 160000;
  p.yarn = true;
  p.yarn_factor = 16;
  p.yarn_original_context = 65536;
  const int64_t heads = 2, hd = 128, n = 4;
  const std::vector<int32_t> pos = {0, 1, 77, 4095};
  const auto x = randn(n * heads * hd);
  Tensor t = f32({n, heads * hd}, x);
  ASSERT_TRUE(be_.rope(t, hd, i32({n}, pos), p, false).is_ok());
  const double lg = std::log(double(p.freq_base));
  const double low = std::floor(64 * std::log(65536 / (32 * 2 * M_PI)) / (2 * lg));
  const double high = std::ceil(64 * std::log(65536 / (1 * 2 * M_PI)) / (2 * lg));
  EXPECT_EQ(low, 15);
  EXPECT_EQ(high, 25);
  std::vector<double> want(x.begin(), x.end());
  for (int64_t s = 0; s < n; ++s)
    for (int64_t h = 0; h < heads; ++h)
      for (int i = 0; i < 32; ++i) {
        const double omega = std::pow(double(p.freq_base), -2.0 * i / 64);
        const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
        const double phi = pos[s] * (omega * (1 - ramp) + omega / 16 * ramp);
        const int64_t at = (s * heads + h) * hd + hd - 64 + 2 * i;
        const double a = x[at], b = x[at + 1];
        want[at] = a * std::cos(phi) - b * std::sin(phi);
        want[at + 1] = a * std::sin(phi) + b * std::cos(phi);
      }
  expect_close(read(t), want, 2e-4, "rope");
  ASSERT_TRUE(be_.rope(t, hd, i32({n}, pos), p, true).is_ok());
  expect_close(read(t), std::vector<double>(x.begin(), x.end()), 1e-4, "inverse rope");
}

TEST_F(CpuOps, RoutingBiasedAndHashed) {
  const int64_t n = 6, n_experts = 16;
  const int k = 4;
  const float route_scale = 1.5f;
  const auto logits = randn(n * n_experts, 2), bias = randn(n_experts, 0.5f);
  const auto sp = [](double z) { return std::sqrt(std::log1p(std::exp(z))); };
  Tensor experts = i32({n, k}, std::vector<int32_t>(n * k, -7)), weights = poisoned({n, k});
  Tensor tokens = i32({n}, {0, 1, 2, 3, 4, 5});
  const Tensor bias_t = f32({n_experts}, bias);
  ASSERT_TRUE(be_.route(f32({n, n_experts}, logits), &bias_t, nullptr, tokens, k, route_scale,
                        experts, weights).is_ok());
  auto e = read_i32(experts);
  auto wv = read(weights);
  for (int64_t s = 0; s < n; ++s) {
    std::vector<int32_t> order(n_experts);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return sp(logits[s * n_experts + a]) + bias[a] > sp(logits[s * n_experts + b]) + bias[b];
    });
    std::set<int32_t> want_set(order.begin(), order.begin() + k);
    EXPECT_EQ(std::set<int32_t>(e.begin() + s * k, e.begin() + (s + 1) * k), want_set) << "row " << s;
    double sum = 0;
    for (int32_t x : want_set) sum += sp(logits[s * n_experts + x]);
    for (int j = 0; j < k; ++j)
      EXPECT_NEAR(wv[s * k + j], sp(logits[s * n_experts + e[s * k + j]]) / sum * route_scale, 1e-5);
  }
  // Hash routing: the table's experts, weighted by the same renormalised scores.
  std::vector<int32_t> table(8 * k);
  for (int r = 0; r < 8; ++r)
    for (int j = 0; j < k; ++j) table[r * k + j] = static_cast<int32_t>((r * 5 + j * 3) % n_experts);
  const std::vector<int32_t> ids = {7, 0, 3, 3, 5, 1};
  const Tensor table_t = i32({8, k}, table);
  ASSERT_TRUE(be_.route(f32({n, n_experts}, logits), nullptr, &table_t, i32({n}, ids), k,
                        route_scale, experts, weights).is_ok());
  e = read_i32(experts);
  wv = read(weights);
  for (int64_t s = 0; s < n; ++s) {
    std::set<int32_t> want_set(table.begin() + ids[s] * k, table.begin() + (ids[s] + 1) * k);
    EXPECT_EQ(std::set<int32_t>(e.begin() + s * k, e.begin() + (s + 1) * k), want_set);
    double sum = 0;
    for (int32_t x : want_set) sum += sp(logits[s * n_experts + x]);
    for (int j = 0; j < k; ++j)
      EXPECT_NEAR(wv[s * k + j], sp(logits[s * n_experts + e[s * k + j]]) / sum * route_scale, 1e-5);
  }
}

// SwiGLU with the clamp (spec §4.3): the gate clamps above only, the up projection both ways.
TEST_F(CpuOps, SharedExpertClamp) {
  const int64_t n = 3, d = 32, inter = 16;
  const float limit = 10;
  const auto g = randn(inter * d, 2), u = randn(inter * d, 2), dn = randn(d * inter, 0.2f), x = randn(n * d, 2);
  Tensor y = f32({n, d}, std::vector<float>(n * d, 0.25f));
  ASSERT_TRUE(be_.swiglu_expert(f32({n, d}, x), f32({inter, d}, g), f32({inter, d}, u),
                                f32({d, inter}, dn), limit, MatmulMode::Exact, y).is_ok());
  std::vector<double> want(n * d, 0.25);
  int clamped = 0;
  for (int64_t s = 0; s < n; ++s) {
    std::vector<double> h(inter);
    for (int64_t i = 0; i < inter; ++i) {
      double gv = 0, uv = 0;
      for (int64_t c = 0; c < d; ++c) {
        gv += double(g[i * d + c]) * x[s * d + c];
        uv += double(u[i * d + c]) * x[s * d + c];
      }
      clamped += gv > limit || std::fabs(uv) > limit;
      gv = std::min(gv, double(limit));
      uv = std::clamp(uv, -double(limit), double(limit));
      h[i] = gv / (1 + std::exp(-gv)) * uv;
    }
    for (int64_t c = 0; c < d; ++c)
      for (int64_t i = 0; i < inter; ++i) want[s * d + c] += double(dn[c * inter + i]) * h[i];
  }
  EXPECT_GT(clamped, 0) << "inputs too small to exercise the clamp";
  expect_close(read(y), want, 1e-4, "shared expert");
}

// The QAT roundings against a brute-force nearest-grid search (ties to the even code).
TEST_F(CpuOps, QatRoundingsMatchBruteForce) {
  std::vector<float> e4m3, e2m1 = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int e = 0; e < 16; ++e)
    for (int m = 0; m < 8; ++m)
      if (!(e == 15 && m == 7)) e4m3.push_back(e == 0 ? m / 512.0f : std::ldexp(1 + m / 8.0f, e - 7));
  const auto nearest = [](const std::vector<float>& grid, double v) {
    size_t best = 0;
    for (size_t i = 1; i < grid.size(); ++i) {
      const double d0 = std::fabs(std::fabs(v) - grid[best]), d1 = std::fabs(std::fabs(v) - grid[i]);
      if (d1 < d0 || (d1 == d0 && i % 2 == 0)) best = i;
    }
    return std::copysign(double(grid[best]), v);
  };
  const auto check = [&](bool fp4, int64_t block, double maxv, double floor_amax) {
    auto x = randn(4 * block, 3);
    x[5] = 0.0f;
    x[block + 1] = -x[block + 2];  // a repeated magnitude
    Tensor t = f32({4, block}, x);
    ASSERT_TRUE((fp4 ? be_.round_fp4_blocks(t, block) : be_.round_fp8_blocks(t, block, block)).is_ok());
    const auto got = read(t);
    for (int64_t b = 0; b < 4; ++b) {
      double amax = floor_amax;
      for (int64_t i = 0; i < block; ++i) amax = std::max(amax, double(std::fabs(x[b * block + i])));
      const double s = std::exp2(std::ceil(std::log2(float(amax) * float(1 / maxv))));
      for (int64_t i = 0; i < block; ++i)
        ASSERT_EQ(got[b * block + i], float(nearest(fp4 ? e2m1 : e4m3, x[b * block + i] / s) * s))
            << (fp4 ? "fp4" : "fp8") << " block " << b << " value " << x[b * block + i];
    }
  };
  check(false, 64, 448, 1e-4);
  check(true, 32, 6, 6 * std::ldexp(1.0, -126));
}

TEST_F(CpuOps, HadamardIsSylvesterOrthonormal) {
  const int64_t n = 16;
  const auto x = randn(2 * n);
  Tensor t = f32({2, n}, x);
  ASSERT_TRUE(be_.hadamard(t, n).is_ok());
  std::vector<double> want(2 * n);
  for (int64_t r = 0; r < 2; ++r)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j)  // H[i][j] = (-1)^popcount(i & j)
        want[r * n + i] += (__builtin_popcountll(i & j) % 2 ? -1.0 : 1.0) * x[r * n + j] / 4.0;
  expect_close(read(t), want, 1e-5, "hadamard");
}

TEST_F(CpuOps, BadArgumentsAreErrors) {
  Tensor x = f32({2, 8}, randn(16));
  Tensor w = f32({3, 7}, randn(21));
  Tensor y = poisoned({2, 3});
  const Status s = be_.matmul(w, x, y, MatmulMode::Exact);
  EXPECT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("matmul"), std::string::npos) << s.message();
  EXPECT_FALSE(be_.round_fp8_blocks(x, 6, 4).is_ok());
  EXPECT_FALSE(be_.hadamard(x, 3).is_ok());
}

}  // namespace
}  // namespace dsv4::backend
