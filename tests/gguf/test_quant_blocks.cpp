// Dequantisation, f32 dot products and quantise->dequantise error of every GGUF element
// type (quant.h). Bit-identity with the Python `gguf` package is checked separately by
// tests/python/test_quant_vs_gguf.py.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "gguf/iq2xxs_tables.h"
#include "gguf/quant.h"
#include "gguf/quant_decode.h"
#include "gguf/quant_internal.h"
#include "support/test_support.h"
#include "gguf/quant_test_data.h"

namespace dsv4 {
namespace {

std::string name_of(GgmlType t) { return std::string(ggml_type_name(t)); }

// The scalar reference decode of one row: quant_decode.h block by block.
std::vector<float> reference_decode(GgmlType type, const std::vector<uint8_t>& bytes, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n), std::numeric_limits<float>::quiet_NaN());
  const uint8_t* p = bytes.data();
  auto each = [&](auto block_tag, int elems, auto&& decode) {
    using Block = decltype(block_tag);
    for (int64_t b = 0; b < n / elems; ++b) {
      Block blk;
      std::memcpy(&blk, p + b * sizeof(Block), sizeof blk);
      decode(blk, out.data() + b * elems);
    }
  };
  auto plain = [](const auto& blk, float* o) { quant::decode_block(blk, o); };
  auto iq = [](const auto& blk, float* o) { quant::decode_block(blk, o, quant::host_iq_tables()); };
  switch (type) {
    case GgmlType::F32: std::memcpy(out.data(), p, static_cast<size_t>(n) * 4); break;
    case GgmlType::F16:
    case GgmlType::BF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = type == GgmlType::F16 ? fp16_to_f32(h) : bf16_to_f32(h);
      }
      break;
    case GgmlType::I32:
      for (int64_t i = 0; i < n; ++i) {
        int32_t v;
        std::memcpy(&v, p + 4 * i, 4);
        out[i] = static_cast<float>(v);
      }
      break;
    case GgmlType::Q8_0: each(block_q8_0{}, QK8_0, plain); break;
    case GgmlType::MXFP4: each(block_mxfp4{}, QK_MXFP4, plain); break;
    case GgmlType::Q2_K: each(block_q2_K{}, QK_K, plain); break;
    case GgmlType::Q3_K: each(block_q3_K{}, QK_K, plain); break;
    case GgmlType::Q4_K: each(block_q4_K{}, QK_K, plain); break;
    case GgmlType::Q5_K: each(block_q5_K{}, QK_K, plain); break;
    case GgmlType::Q6_K: each(block_q6_K{}, QK_K, plain); break;
    case GgmlType::IQ2_XXS:
      each(block_iq2_xxs{}, QK_K, [](const block_iq2_xxs& blk, float* o) {
        quant::decode_block(blk, o, quant::kIq2xxsGrid, quant::kIq2xxsSigns);
      });
      break;
    case GgmlType::Q4_0: each(block_q4_0{}, QK4_0, iq); break;
    case GgmlType::Q4_1: each(block_q4_1{}, QK4_0, iq); break;
    case GgmlType::Q5_0: each(block_q5_0{}, QK4_0, iq); break;
    case GgmlType::Q5_1: each(block_q5_1{}, QK4_0, iq); break;
    case GgmlType::IQ4_NL: each(block_iq4_nl{}, QK4_0, iq); break;
    case GgmlType::IQ4_XS: each(block_iq4_xs{}, QK_K, iq); break;
    case GgmlType::IQ2_XS: each(block_iq2_xs{}, QK_K, iq); break;
    case GgmlType::IQ2_S: each(block_iq2_s{}, QK_K, iq); break;
    case GgmlType::IQ3_XXS: each(block_iq3_xxs{}, QK_K, iq); break;
    case GgmlType::IQ3_S: each(block_iq3_s{}, QK_K, iq); break;
    case GgmlType::IQ1_S: each(block_iq1_s{}, QK_K, iq); break;
    case GgmlType::IQ1_M: each(block_iq1_m{}, QK_K, iq); break;
    default: ADD_FAILURE() << "no reference decode for " << name_of(type);
  }
  return out;
}

int64_t block_elems(GgmlType t) { return ggml_traits(t).block_elems; }

TEST(QuantBlocks, DequantizeMatchesScalarDecoderBitForBit) {
  std::mt19937_64 rng(test::test_seed());
  for (GgmlType type : test::decodable_types()) {
    // An odd number of blocks, so no path can assume pairs or multiples of 8.
    const int64_t n = block_elems(type) * 13;
    const auto bytes = test::random_row_bytes(type, n, rng);
    const auto want = reference_decode(type, bytes, n);
    std::vector<float> got(static_cast<size_t>(n), std::numeric_limits<float>::quiet_NaN());
    dequantize_row(type, bytes.data(), got.data(), n);
    ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0)
        << name_of(type) << " seed " << test::test_seed();
    for (float v : got) ASSERT_TRUE(std::isfinite(v)) << name_of(type) << " seed " << test::test_seed();
  }
}

// Every field at its extremes: payload bytes all 0x00, 0xFF, 0x55 or 0xAA (levels, scales
// and masks at their ends), fp16 scales at +-65504, +-smallest subnormal and +-0, MXFP4
// exponents 0, 1, 254 and 255. The vector decoder must still agree with the scalar one.
TEST(QuantBlocks, DequantizeExtremeFieldValues) {
  const uint16_t scales[] = {0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x0000, 0x8000};
  for (GgmlType type : test::decodable_types()) {
    const auto& traits = ggml_traits(type);
    if (traits.block_elems == 1) continue;  // plain types: every bit pattern is covered above
    for (uint8_t fill : {0x00, 0xFF, 0x55, 0xAA}) {
      std::vector<uint8_t> bytes(traits.block_bytes * 6, fill);
      for (int b = 0; b < 6; ++b) {
        uint8_t* blk = bytes.data() + b * traits.block_bytes;
        auto put = [&](size_t off) { std::memcpy(blk + off, &scales[b], 2); };
        switch (type) {
          case GgmlType::Q8_0: case GgmlType::Q4_K: case GgmlType::Q5_K: case GgmlType::IQ2_XXS: put(0); break;
          case GgmlType::Q4_0: case GgmlType::Q5_0: case GgmlType::IQ4_NL: case GgmlType::IQ4_XS:
          case GgmlType::IQ2_XS: case GgmlType::IQ2_S: case GgmlType::IQ3_XXS: case GgmlType::IQ3_S:
          case GgmlType::IQ1_S: put(0); break;
          case GgmlType::Q4_1: case GgmlType::Q5_1: put(0); put(2); break;
          case GgmlType::IQ1_M: {
            block_iq1_m m;
            std::memcpy(&m, blk, sizeof m);
            test::set_iq1_m_scale(m, scales[b]);
            std::memcpy(blk, &m, sizeof m);
            break;
          }
          case GgmlType::Q2_K: put(80); put(82); break;
          case GgmlType::Q3_K: put(108); break;
          case GgmlType::Q6_K: put(208); break;
          case GgmlType::MXFP4: blk[0] = static_cast<uint8_t>(b < 3 ? b : 250 + b); break;  // 0,1,2,253,254,255
          default: break;
        }
        if (type == GgmlType::Q4_K || type == GgmlType::Q5_K) put(2);
      }
      const int64_t n = traits.block_elems * 6;
      const auto want = reference_decode(type, bytes, n);
      std::vector<float> got(static_cast<size_t>(n), std::numeric_limits<float>::quiet_NaN());
      dequantize_row(type, bytes.data(), got.data(), n);
      ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0) << name_of(type) << " fill " << int(fill);
    }
  }
}

// |dot - exact| within the f32 summation bound: (terms per accumulator + tree) * eps * sum|w x|.
void expect_dot_close(float got, const std::vector<float>& w, const std::vector<float>& x, const std::string& what) {
  double exact = 0, magnitude = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    exact += static_cast<double>(w[i]) * x[i];
    magnitude += std::fabs(static_cast<double>(w[i]) * x[i]);
  }
  const double bound = (static_cast<double>(w.size()) / 8 + 16) * std::ldexp(1.0, -24) * magnitude;
  EXPECT_LE(std::fabs(got - exact), bound) << what << " exact " << exact << " seed " << test::test_seed();
}

TEST(QuantBlocks, DotRowF32MatchesDoubleReference) {
  std::mt19937_64 rng(test::test_seed());
  for (GgmlType type : test::decodable_types()) {
    for (int64_t blocks : {1, 3, 17}) {
      const int64_t n = block_elems(type) == 1 ? 37 * blocks : block_elems(type) * blocks;
      const auto bytes = test::random_row_bytes(type, n, rng);
      std::vector<float> w(static_cast<size_t>(n));
      dequantize_row(type, bytes.data(), w.data(), n);
      const auto x = test::random_normal(static_cast<size_t>(n), rng);
      const std::string what = name_of(type) + " n=" + std::to_string(n);
      expect_dot_close(dot_row_f32(type, bytes.data(), x.data(), n), w, x, what + " (vector)");
      expect_dot_close(quant::dot_row_f32_scalar(type, bytes.data(), x.data(), n), w, x, what + " (scalar)");
    }
  }
}

// dot_row_f32 uses exactly the decoded weights: against a one-hot x every other product
// is a zero, so the result is the weight itself, to the bit.
TEST(QuantBlocks, DotRowF32UsesExactlyTheDecodedWeights) {
  std::mt19937_64 rng(test::test_seed());
  for (GgmlType type : test::decodable_types()) {
    const int64_t n = block_elems(type) == 1 ? 200 : block_elems(type) * 3;
    const auto bytes = test::random_row_bytes(type, n, rng);
    std::vector<float> w(static_cast<size_t>(n));
    dequantize_row(type, bytes.data(), w.data(), n);
    std::vector<float> x(static_cast<size_t>(n), 0.0f);
    for (int trial = 0; trial < 64; ++trial) {
      const size_t i = static_cast<size_t>(rng() % static_cast<uint64_t>(n));
      x[i] = 1.0f;
      ASSERT_EQ(dot_row_f32(type, bytes.data(), x.data(), n), w[i]) << name_of(type) << " element " << i;
      ASSERT_EQ(quant::dot_row_f32_scalar(type, bytes.data(), x.data(), n), w[i]) << name_of(type) << " element " << i;
      x[i] = 0.0f;
    }
  }
}

TEST(QuantBlocks, DotRowF32PropagatesNaN) {
  std::mt19937_64 rng(test::test_seed());
  for (GgmlType type : test::decodable_types()) {
    const int64_t n = block_elems(type) == 1 ? 64 : block_elems(type) * 2;
    const auto bytes = test::random_row_bytes(type, n, rng);
    auto x = test::random_normal(static_cast<size_t>(n), rng);
    x[static_cast<size_t>(n) - 1] = std::numeric_limits<float>::quiet_NaN();
    EXPECT_TRUE(std::isnan(dot_row_f32(type, bytes.data(), x.data(), n))) << name_of(type);
  }
}

// The vector F16 encoder against the scalar one on every kind of f32 (NaN, infinities,
// subnormals, values past fp16's range), and the decoder on every fp16 code.
TEST(QuantBlocks, F16RowsMatchScalarConversionsOnAllBitPatterns) {
  std::mt19937_64 rng(test::test_seed());
  const int64_t n = 1 << 16;
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) v = f32_from_bits(static_cast<uint32_t>(rng()));
  std::vector<uint16_t> h(static_cast<size_t>(n), 0xA5A5);
  quantize_row(GgmlType::F16, x.data(), h.data(), n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(h[i], f32_to_fp16(x[i])) << "bits " << f32_to_bits(x[i]);
  for (int64_t i = 0; i < n; ++i) h[i] = static_cast<uint16_t>(i);
  std::vector<float> back(static_cast<size_t>(n));
  dequantize_row(GgmlType::F16, h.data(), back.data(), n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(f32_to_bits(back[i]), f32_to_bits(fp16_to_f32(h[i]))) << i;
}

// Relative RMS error of quantise -> dequantise on standard-normal rows, with the bound each
// type must meet (measured values and ggml's are in docs/QUANT.md; the bounds leave ~10%).
struct RoundTripCase {
  GgmlType type;
  double max_relative_rmse;
};

double relative_rmse(const std::vector<float>& a, const std::vector<float>& b) {
  double err = 0, ref = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    err += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    ref += static_cast<double>(a[i]) * a[i];
  }
  return std::sqrt(err / ref);
}

TEST(QuantBlocks, QuantizeRoundTripErrorBounds) {
  const RoundTripCase cases[] = {
      {GgmlType::F32, 0.0},     {GgmlType::F16, 3.0e-4},  {GgmlType::BF16, 2.4e-3},
      {GgmlType::Q8_0, 0.0065}, {GgmlType::Q6_K, 0.0200}, {GgmlType::Q5_K, 0.0400},
      {GgmlType::Q4_K, 0.0780}, {GgmlType::Q3_K, 0.1600}, {GgmlType::Q2_K, 0.3100},
      {GgmlType::MXFP4, 0.1300},
  };
  std::mt19937_64 rng(test::test_seed());
  for (const auto& c : cases) {
    ASSERT_TRUE(can_quantize(c.type));
    const int64_t n = QK_K * 33;
    const auto x = test::random_normal(static_cast<size_t>(n), rng);
    std::vector<uint8_t> q(*ggml_row_bytes(c.type, n), 0xA5);
    quantize_row(c.type, x.data(), q.data(), n);
    std::vector<float> back(static_cast<size_t>(n), std::numeric_limits<float>::quiet_NaN());
    dequantize_row(c.type, q.data(), back.data(), n);
    const double e = relative_rmse(x, back);
    EXPECT_LE(e, c.max_relative_rmse) << name_of(c.type) << " seed " << test::test_seed();
    // A lossy type that reproduced its input exactly would mean the test data were trivial.
    if (c.max_relative_rmse > 1e-3) {
      EXPECT_GT(e, c.max_relative_rmse / 20) << name_of(c.type);
    }
  }
}

// Rows with structure that random normals never produce: an all-zero block, a constant
// block, a one-signed block, a single outlier, tiny and large magnitudes.
TEST(QuantBlocks, QuantizeHandlesExtremeBlocks) {
  std::mt19937_64 rng(test::test_seed());
  const std::vector<GgmlType> types = {GgmlType::Q8_0, GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K,
                                       GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::MXFP4};
  const int64_t n = QK_K * 6;
  std::vector<float> x(static_cast<size_t>(n));
  std::uniform_real_distribution<float> u(0.5f, 1.5f);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t block = i / QK_K;
    switch (block) {
      case 0: x[i] = 0.0f; break;
      case 1: x[i] = 0.75f; break;
      case 2: x[i] = -u(rng); break;
      case 3: x[i] = (i % QK_K == 77) ? 100.0f : 0.01f * u(rng); break;
      case 4: x[i] = 0.05f * (u(rng) - 1.0f); break;
      default: x[i] = 300.0f * (u(rng) - 1.0f); break;
    }
  }
  for (GgmlType type : types) {
    std::vector<uint8_t> q(*ggml_row_bytes(type, n), 0xA5);
    quantize_row(type, x.data(), q.data(), n);
    std::vector<float> back(static_cast<size_t>(n), std::numeric_limits<float>::quiet_NaN());
    dequantize_row(type, q.data(), back.data(), n);
    for (int64_t i = 0; i < QK_K; ++i) ASSERT_EQ(back[i], 0.0f) << name_of(type) << " zero block, element " << i;
    for (int64_t b = 1; b < 6; ++b) {
      double amax = 0, err = 0;
      for (int64_t i = b * QK_K; i < (b + 1) * QK_K; ++i) {
        ASSERT_TRUE(std::isfinite(back[i])) << name_of(type) << " block " << b;
        amax = std::fmax(amax, std::fabs(x[i]));
        err = std::fmax(err, std::fabs(back[i] - x[i]));
      }
      // Every element within the block's largest magnitude (Q2_K: 2 bits, so coarse).
      EXPECT_LE(err, amax * (type == GgmlType::Q2_K ? 0.6 : 0.35)) << name_of(type) << " block " << b;
    }
    // The outlier of block 3 must survive: it sets the scale.
    EXPECT_NEAR(back[3 * QK_K + 77], 100.0f, 100.0f * (type == GgmlType::MXFP4 ? 0.34 : 0.1)) << name_of(type);
  }
}

}  // namespace
}  // namespace dsv4
