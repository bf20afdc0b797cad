// The fast integer dot products (quantize_activations + dot_row_quantized) against the
// reference dot_row_f32, within a bound derived from the activation quantisation error:
// each activation x_i is replaced by d_b*q_i with |x_i - d_b*q_i| <= c*d_b (c = 0.5 for
// Q8_K's f32 scale; 0.5 + 127*2^-11 for Q8_0, whose scale is stored as fp16), so
//   |dot_quantized - dot_f32| <= sum_b c*d_b * sum_{i in b} |w_i|  + f32 summation error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "gguf/quant.h"
#include "gguf/quant_internal.h"
#include "gguf/quant_test_data.h"
#include "support/test_support.h"

namespace dsv4 {
namespace {

// Per-element activation scale d_b of the block holding each element.
std::vector<double> activation_scales(GgmlType act, const std::vector<uint8_t>& qx, int64_t n) {
  std::vector<double> d(static_cast<size_t>(n));
  if (act == GgmlType::Q8_0) {
    for (int64_t i = 0; i < n; ++i) {
      block_q8_0 b;
      std::memcpy(&b, qx.data() + (i / QK8_0) * sizeof b, sizeof b);
      d[i] = fp16_to_f32(b.d) * (0.5 + 127.0 * std::ldexp(1.0, -11));
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      block_q8_K b;
      std::memcpy(&b, qx.data() + (i / QK_K) * sizeof b, sizeof b);
      d[i] = std::fabs(b.d) * 0.5;
    }
  }
  return d;
}

TEST(QuantDot, QuantizedDotWithinActivationErrorBound) {
  std::mt19937_64 rng(test::test_seed());
  for (GgmlType type : test::decodable_types()) {
    const GgmlType act = dot_activation_type(type);
    const bool quantized = act != GgmlType::F32;
    // Every block type has an integer path; the plain types (f32, f16, bf16, i32) do not.
    EXPECT_EQ(quantized, ggml_traits(type).block_elems > 1) << ggml_type_name(type);
    for (int64_t blocks : {1, 5}) {
      const int64_t n = QK_K * blocks;  // a multiple of every block size
      const auto w_bytes = test::random_row_bytes(type, n, rng);
      const auto x = test::random_normal(static_cast<size_t>(n), rng);
      std::vector<float> w(static_cast<size_t>(n));
      dequantize_row(type, w_bytes.data(), w.data(), n);

      const size_t act_bytes = quantized ? *ggml_row_bytes(act, n) : static_cast<size_t>(n) * sizeof(float);
      std::vector<uint8_t> qx(act_bytes, 0xA5);
      quantize_activations(act, x.data(), qx.data(), n);
      const float got = dot_row_quantized(type, w_bytes.data(), qx.data(), n);
      const float ref = dot_row_f32(type, w_bytes.data(), x.data(), n);

      double bound = 0, magnitude = 0;
      const auto d = quantized ? activation_scales(act, qx, n) : std::vector<double>(static_cast<size_t>(n), 0.0);
      for (int64_t i = 0; i < n; ++i) {
        bound += d[i] * std::fabs(w[i]);
        magnitude += std::fabs(static_cast<double>(w[i]) * x[i]);
      }
      bound += (static_cast<double>(n) / 4 + 64) * std::ldexp(1.0, -24) * (magnitude + bound) * 2;
      EXPECT_LE(std::fabs(static_cast<double>(got) - ref), bound)
          << ggml_type_name(type) << " n=" << n << " seed " << test::test_seed();
      const float portable = quant::dot_row_quantized_scalar(type, w_bytes.data(), qx.data(), n);
      EXPECT_LE(std::fabs(static_cast<double>(portable) - ref), bound)
          << ggml_type_name(type) << " (portable path) n=" << n << " seed " << test::test_seed();
      // The bound must not be vacuous: it stays well below the size of the products.
      if (quantized) {
        EXPECT_LT(bound, 0.05 * magnitude) << ggml_type_name(type);
      }
    }
  }
}

TEST(QuantDot, Q8KActivationsMatchGgmlLayout) {
  std::mt19937_64 rng(test::test_seed());
  const int64_t n = QK_K * 3;
  auto x = test::random_normal(static_cast<size_t>(n), rng);
  std::fill(x.begin() + QK_K, x.begin() + 2 * QK_K, 0.0f);  // an all-zero super-block
  std::vector<block_q8_K> q(3);
  std::memset(q.data(), 0xA5, q.size() * sizeof(block_q8_K));
  quantize_activations(GgmlType::Q8_K, x.data(), q.data(), n);
  for (int b = 0; b < 3; ++b) {
    int amax = 0;
    for (int s = 0; s < 16; ++s) {
      int sum = 0;
      for (int i = 0; i < 16; ++i) {
        sum += q[b].qs[16 * s + i];
        amax = std::max(amax, std::abs(static_cast<int>(q[b].qs[16 * s + i])));
      }
      EXPECT_EQ(q[b].bsums[s], sum) << "block " << b << " group " << s;
    }
    if (b == 1) {
      EXPECT_EQ(q[b].d, 0.0f);
      EXPECT_EQ(amax, 0);
      continue;
    }
    EXPECT_EQ(amax, 127) << "block " << b;  // the extreme maps to +-127 exactly
    for (int i = 0; i < QK_K; ++i)
      EXPECT_LE(std::fabs(x[b * QK_K + i] - q[b].d * q[b].qs[i]), 0.5001f * std::fabs(q[b].d)) << b << ":" << i;
  }
}

// The activation blocks byte for byte against ggml's algorithm written out plainly
// (quantize_row_q8_K_ref: first value of largest magnitude, -127/max, round half to even).
TEST(QuantDot, Q8KActivationsMatchPlainReference) {
  std::mt19937_64 rng(test::test_seed());
  const int64_t nb = 7;
  auto x = test::random_normal(static_cast<size_t>(nb * QK_K), rng);
  x[QK_K + 5] = 9.0f;  // a tie of magnitudes with opposite signs: the first wins
  x[QK_K + 9] = -9.0f;
  for (int i = 0; i < QK_K; ++i) x[2 * QK_K + i] = 0.5f * static_cast<float>(i % 5) - 1.0f;  // exact ties
  std::vector<block_q8_K> got(nb);
  std::memset(got.data(), 0xA5, got.size() * sizeof(block_q8_K));
  quantize_activations(GgmlType::Q8_K, x.data(), got.data(), nb * QK_K);
  std::vector<block_q8_K> portable(nb);
  quant::quantize_q8_K_scalar(x.data(), portable.data(), nb * QK_K);
  ASSERT_EQ(std::memcmp(got.data(), portable.data(), nb * sizeof(block_q8_K)), 0) << "vector vs portable";
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x.data() + b * QK_K;
    float max = 0, amax = 0;
    for (int i = 0; i < QK_K; ++i)
      if (std::fabs(xb[i]) > amax) {
        amax = std::fabs(xb[i]);
        max = xb[i];
      }
    const float iscale = -127.f / max;
    EXPECT_EQ(got[b].d, 1 / iscale) << b;
    for (int i = 0; i < QK_K; ++i) {
      const int want = std::min(127, static_cast<int>(std::nearbyint(iscale * xb[i])));
      ASSERT_EQ(got[b].qs[i], want) << "block " << b << " element " << i;
    }
  }
}

// Several activation rows against one weight row give each row's single-row result to the
// bit, for every group size (the kernels split rows into groups of 4, 2 and 1).
TEST(QuantDot, BatchedRowsEqualSingleRowsBitForBit) {
  DSV4_SKIP_UNLESS_RELEASE_NUMERICS();
  std::mt19937_64 rng(test::test_seed());
  for (GgmlType type : test::decodable_types()) {
    const int64_t n = QK_K * 3;
    const auto w = test::random_row_bytes(type, n, rng);
    for (int64_t rows : {1, 2, 3, 5, 7}) {
      const int64_t x_stride = n + 8;  // rows need not be packed
      const auto x = test::random_normal(static_cast<size_t>(x_stride * rows), rng);
      std::vector<float> got(static_cast<size_t>(rows), std::numeric_limits<float>::quiet_NaN());
      dot_rows_f32(type, w.data(), x.data(), x_stride, rows, n, got.data());
      for (int64_t r = 0; r < rows; ++r)
        ASSERT_EQ(f32_to_bits(got[r]), f32_to_bits(dot_row_f32(type, w.data(), x.data() + r * x_stride, n)))
            << ggml_type_name(type) << " f32 row " << r << " of " << rows;

      const GgmlType act = dot_activation_type(type);
      const size_t act_bytes = act == GgmlType::F32 ? n * sizeof(float) : *ggml_row_bytes(act, n);
      const size_t act_stride = act_bytes + 4;
      std::vector<uint8_t> qx(act_stride * rows);
      for (int64_t r = 0; r < rows; ++r) quantize_activations(act, x.data() + r * x_stride, qx.data() + r * act_stride, n);
      std::fill(got.begin(), got.end(), std::numeric_limits<float>::quiet_NaN());
      dot_rows_quantized(type, w.data(), qx.data(), act_stride, rows, n, got.data());
      for (int64_t r = 0; r < rows; ++r)
        ASSERT_EQ(f32_to_bits(got[r]), f32_to_bits(dot_row_quantized(type, w.data(), qx.data() + r * act_stride, n)))
            << ggml_type_name(type) << " quantized row " << r << " of " << rows;
    }
  }
}

TEST(QuantDot, QuantizedDotPropagatesNaNWeights) {
  // A NaN weight scale must not vanish in the integer path.
  std::mt19937_64 rng(test::test_seed());
  const int64_t n = QK_K;
  auto w_bytes = test::random_row_bytes(GgmlType::Q4_K, n, rng);
  block_q4_K b;
  std::memcpy(&b, w_bytes.data(), sizeof b);
  b.d = 0x7E00;  // fp16 NaN
  std::memcpy(w_bytes.data(), &b, sizeof b);
  const auto x = test::random_normal(static_cast<size_t>(n), rng);
  std::vector<block_q8_K> q(1);
  quantize_activations(GgmlType::Q8_K, x.data(), q.data(), n);
  EXPECT_TRUE(std::isnan(dot_row_quantized(GgmlType::Q4_K, w_bytes.data(), q.data(), n)));
}

}  // namespace
}  // namespace dsv4
