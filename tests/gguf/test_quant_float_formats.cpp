// util/float_formats.h against double-precision references: every code of the 8- and
// 16-bit formats decodes to its defining value, and encoding rounds to nearest with ties to
// the even code, checked at every midpoint between neighbouring values.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "support/test_support.h"
#include "util/float_formats.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace dsv4 {
namespace {

// The value of an E4M3 (fn) code from its definition.
double e4m3_reference(uint8_t c) {
  const int sign = (c & 0x80) ? -1 : 1;
  const int exp = (c >> 3) & 0xF, man = c & 7;
  if (exp == 0) return sign * std::ldexp(man / 8.0, -6);
  return sign * std::ldexp(1.0 + man / 8.0, exp - 7);
}

// Rounds through a sorted table of non-negative representable values with codes: nearest,
// ties to the even code (LSB 0), beyond the last value saturating to it.
template <typename Code>
Code nearest_even(double v, const std::vector<std::pair<double, Code>>& table) {
  for (size_t k = 0; k + 1 < table.size(); ++k) {
    const double lo = table[k].first, hi = table[k + 1].first;
    if (v > hi) continue;
    const double mid = (lo + hi) / 2;
    if (v < mid) return table[k].second;
    if (v > mid) return table[k + 1].second;
    return (table[k].second & 1) == 0 ? table[k].second : table[k + 1].second;
  }
  return table.back().second;
}

TEST(FloatFormats, E4M3DecodesEveryCode) {
  for (int c = 0; c < 256; ++c) {
    const float v = e4m3_to_f32(static_cast<uint8_t>(c));
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(v)) << c;
      continue;
    }
    EXPECT_EQ(static_cast<double>(v), e4m3_reference(static_cast<uint8_t>(c))) << c;
    EXPECT_EQ(std::signbit(v), (c & 0x80) != 0) << c;
    EXPECT_EQ(f32_to_e4m3(v), c) << "round trip of code " << c;
  }
  EXPECT_EQ(e4m3_to_f32(0x7E), kE4M3Max);
}

std::vector<std::pair<double, uint8_t>> e4m3_table() {
  std::vector<std::pair<double, uint8_t>> t;
  for (int c = 0; c < 0x7F; ++c) t.emplace_back(e4m3_reference(static_cast<uint8_t>(c)), static_cast<uint8_t>(c));
  return t;
}

TEST(FloatFormats, E4M3RoundsToNearestEvenAtEveryMidpoint) {
  const auto table = e4m3_table();
  for (size_t k = 0; k + 1 < table.size(); ++k) {
    const float mid = static_cast<float>((table[k].first + table[k + 1].first) / 2);  // exact in f32
    for (float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      const uint8_t want = nearest_even<uint8_t>(v, table);
      EXPECT_EQ(f32_to_e4m3(v), want) << "v=" << v;
      EXPECT_EQ(f32_to_e4m3(-v), want | 0x80) << "v=" << -v;
    }
  }
  // Saturation (the "fn" variant has no infinity) and NaN.
  for (float v : {448.0f, 449.0f, 464.0f, 480.0f, 1e6f, std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(f32_to_e4m3(v), 0x7E) << v;
    EXPECT_EQ(f32_to_e4m3(-v), 0xFE) << v;
  }
  EXPECT_EQ(f32_to_e4m3(std::numeric_limits<float>::quiet_NaN()) & 0x7F, 0x7F);
  EXPECT_EQ(f32_to_e4m3(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(f32_to_e4m3(-0.0f), 0x80);
}

TEST(FloatFormats, E4M3MatchesReferenceOnRandomValues) {
  const auto table = e4m3_table();
  std::mt19937_64 rng(test::test_seed());
  std::uniform_real_distribution<double> log_mag(-12.0, 9.5);
  for (int i = 0; i < 200000; ++i) {
    const float v = static_cast<float>(std::exp2(log_mag(rng)));
    ASSERT_EQ(f32_to_e4m3(v), nearest_even<uint8_t>(v, table)) << "v=" << v << " seed " << test::test_seed();
  }
}

TEST(FloatFormats, E2M1DecodesAndRoundsTiesToEven) {
  const double magnitudes[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  std::vector<std::pair<double, uint8_t>> table;
  for (uint8_t c = 0; c < 16; ++c) {
    const double want = (c & 8 ? -1 : 1) * magnitudes[c & 7];
    EXPECT_EQ(static_cast<double>(e2m1_to_f32(c)), want) << int(c);
    if (c < 8) table.emplace_back(magnitudes[c], c);
  }
  // The ties named by the format's users: value -> value.
  const std::pair<float, float> ties[] = {{0.25f, 0.0f}, {0.75f, 1.0f}, {1.25f, 1.0f}, {1.75f, 2.0f},
                                          {2.5f, 2.0f},  {3.5f, 4.0f},  {5.0f, 4.0f}};
  for (auto [in, out] : ties) {
    EXPECT_EQ(e2m1_to_f32(f32_to_e2m1(in)), out) << in;
    EXPECT_EQ(e2m1_to_f32(f32_to_e2m1(-in)), -out) << -in;
  }
  for (size_t k = 0; k + 1 < table.size(); ++k) {
    const float mid = static_cast<float>((table[k].first + table[k + 1].first) / 2);
    for (float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 100.0f)})
      EXPECT_EQ(f32_to_e2m1(v), nearest_even<uint8_t>(v, table)) << v;
  }
  EXPECT_EQ(f32_to_e2m1(7.0f), 7);
  EXPECT_EQ(f32_to_e2m1(-1e30f), 15);
  EXPECT_EQ(f32_to_e2m1(std::numeric_limits<float>::infinity()), 7);
}

TEST(FloatFormats, E8M0IsAPowerOfTwo) {
  for (int b = 0; b < 255; ++b) {
    EXPECT_EQ(static_cast<double>(e8m0_to_f32(static_cast<uint8_t>(b))), std::ldexp(1.0, b - 127)) << b;
    EXPECT_EQ(static_cast<double>(e8m0_to_f32_half(static_cast<uint8_t>(b))), std::ldexp(1.0, b - 128)) << b;
  }
  EXPECT_TRUE(std::isnan(e8m0_to_f32(255)));
  EXPECT_EQ(static_cast<double>(e8m0_to_f32_half(255)), std::ldexp(1.0, 127));  // ggml's convention
}

double fp16_reference(uint16_t h) {
  const int sign = (h & 0x8000) ? -1 : 1;
  const int exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  if (exp == 0) return sign * std::ldexp(man, -24);
  if (exp == 31) return man ? std::numeric_limits<double>::quiet_NaN() : sign * std::numeric_limits<double>::infinity();
  return sign * std::ldexp(1024 + man, exp - 25);
}

TEST(FloatFormats, Fp16EveryCodeAndEveryMidpoint) {
  std::vector<std::pair<double, uint16_t>> table;
  for (uint32_t h = 0; h < 65536; ++h) {
    const float v = fp16_to_f32(static_cast<uint16_t>(h));
    const double want = fp16_reference(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(v)) << h;
      // The payload survives the widening, and narrowing keeps it NaN.
      ASSERT_EQ((f32_to_bits(v) >> 13) & 0x3FF, h & 0x3FF) << h;
      ASSERT_EQ(f32_to_fp16(v) & 0x7C00, 0x7C00) << h;
      ASSERT_NE(f32_to_fp16(v) & 0x3FF, 0) << h;
      continue;
    }
    ASSERT_EQ(static_cast<double>(v), want) << h;
    ASSERT_EQ(f32_to_fp16(v), h) << h;
    if (h <= 0x7C00) table.emplace_back(want, static_cast<uint16_t>(h));
  }
  // Neighbours k, k+1: just below the midpoint gives k, just above k+1, on it the even code.
  for (size_t k = 0; k + 1 < table.size(); ++k) {
    if (std::isinf(table[k + 1].first)) break;
    const float mid = static_cast<float>((table[k].first + table[k + 1].first) / 2);
    const uint16_t lo = table[k].second, hi = table[k + 1].second;
    ASSERT_EQ(f32_to_fp16(std::nextafter(mid, 0.0f)), lo) << mid;
    ASSERT_EQ(f32_to_fp16(std::nextafter(mid, 1e9f)), hi) << mid;
    ASSERT_EQ(f32_to_fp16(mid), (lo & 1) == 0 ? lo : hi) << mid;
  }
  // Beyond the midpoint of 65504 and 65536 (65520) the result is infinity, below it 65504.
  EXPECT_EQ(f32_to_fp16(65519.996f), 0x7BFF);
  EXPECT_EQ(f32_to_fp16(65520.0f), 0x7C00);
  EXPECT_EQ(f32_to_fp16(-1e10f), 0xFC00);
}

#if defined(__F16C__)
TEST(FloatFormats, Fp16MatchesHardwareConversionOnRandomBits) {
  std::mt19937_64 rng(test::test_seed());
  for (int i = 0; i < 1000000; ++i) {
    const float v = f32_from_bits(static_cast<uint32_t>(rng()));
    if (std::isnan(v)) continue;
    ASSERT_EQ(f32_to_fp16(v), _cvtss_sh(v, 0)) << "bits " << f32_to_bits(v) << " seed " << test::test_seed();
  }
}
#endif

TEST(FloatFormats, Bf16RoundsToNearestEvenAndKeepsNaN) {
  std::mt19937_64 rng(test::test_seed());
  for (int i = 0; i < 1000000; ++i) {
    const uint32_t u = static_cast<uint32_t>(rng());
    const float v = f32_from_bits(u);
    const uint16_t got = f32_to_bf16(v);
    if (std::isnan(v)) {
      ASSERT_TRUE(std::isnan(bf16_to_f32(got))) << u;
      continue;
    }
    // Reference: the nearer of the two bf16 neighbours in double, ties to the even one.
    const uint16_t down = static_cast<uint16_t>(u >> 16), up = static_cast<uint16_t>(down + 1);
    const double dv = v, dd = bf16_to_f32(down), du = bf16_to_f32(up);
    // Past the largest finite bf16 the upper neighbour is infinity; rounding treats it as 2^128.
    const double upper = std::isinf(du) && !std::isinf(dv) ? std::copysign(std::ldexp(1.0, 128), dv) : du;
    const double err_down = std::fabs(dv - dd), err_up = std::fabs(dv - upper);
    const uint16_t want = err_down < err_up ? down : err_up < err_down ? up : ((down & 1) == 0 ? down : up);
    ASSERT_EQ(got, want) << "bits " << u;
    ASSERT_EQ(f32_to_bits(bf16_to_f32(got)), static_cast<uint32_t>(got) << 16);
  }
}

}  // namespace
}  // namespace dsv4
