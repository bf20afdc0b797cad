// The BF16 split of f32 values (src/backend/cuda/bf16_split.h, the arithmetic of the CUDA
// backend's split Float32 products) compiled for the host: the parts sum to each value
// exactly, and the split products of 3 and 6 terms, summed exactly (double), stay within
// the errors the header states against the double product of the f32 operands.
#include "backend/cuda/bf16_split.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <set>
#include <utility>
#include <vector>

namespace dsv4 {
namespace {

using cuda::Bf16SplitSide;

double value_of(const cuda::Bf16Parts& p) {
  return static_cast<double>(bf16_to_f32(p.part[0])) + bf16_to_f32(p.part[1]) + bf16_to_f32(p.part[2]);
}

TEST(Bf16Split, PartsSumToTheValueExactly) {
  std::mt19937_64 rng(20261208);
  std::uniform_int_distribution<uint32_t> mantissa(0, (1u << 23) - 1);
  std::uniform_int_distribution<int> exponent(-110, 126);  // below: the lo part would be a bf16 subnormal
  int inexact = 0, wrong_hi = 0;
  for (int i = 0; i < 1000000; ++i) {
    const uint32_t sign = (i & 1) ? 0x80000000u : 0u;
    const uint32_t bits = sign | static_cast<uint32_t>(exponent(rng) + 127) << 23 | mantissa(rng);
    const float v = f32_from_bits(bits);
    if (std::fabs(v) >= 3.3895e38f) continue;  // hi would round past bf16's largest finite value
    const cuda::Bf16Parts p = cuda::bf16_split(v);
    if (value_of(p) != static_cast<double>(v)) ++inexact;
    if (p.part[0] != f32_to_bf16(v)) ++wrong_hi;
  }
  EXPECT_EQ(inexact, 0);
  EXPECT_EQ(wrong_hi, 0);
  // Values with fewer significant bits leave zero parts; zero splits into zeros.
  for (float v : {0.0f, 1.0f, -1.5f, 3.0f / 1024.0f, 1.0f + 1.0f / 512.0f}) {
    const cuda::Bf16Parts p = cuda::bf16_split(v);
    EXPECT_EQ(value_of(p), static_cast<double>(v)) << v;
  }
  EXPECT_EQ(cuda::bf16_split(1.0f).part[1], 0);
  EXPECT_TRUE(std::isnan(bf16_to_f32(cuda::bf16_split(NAN).part[0])));
}

// Each term pairs one activation part with one weight part, no pair twice: 3 terms are
// hi.hi, hi.mid, mid.hi; 6 add mid.mid, hi.lo, lo.hi.
TEST(Bf16Split, TermsPairDistinctParts) {
  const std::set<std::pair<int, int>> three{{0, 0}, {0, 1}, {1, 0}},
      six{{0, 0}, {0, 1}, {1, 0}, {1, 1}, {0, 2}, {2, 0}};
  for (int terms : {3, 6}) {
    std::set<std::pair<int, int>> pairs;
    for (int t = 0; t < terms; ++t)
      pairs.insert({cuda::bf16_split_part(Bf16SplitSide::activations, t),
                    cuda::bf16_split_part(Bf16SplitSide::weights, t)});
    EXPECT_EQ(pairs, terms == 3 ? three : six) << terms << " terms";
  }
  EXPECT_TRUE(cuda::bf16_split_terms_valid(3));
  EXPECT_TRUE(cuda::bf16_split_terms_valid(6));
  EXPECT_FALSE(cuda::bf16_split_terms_valid(0));
  EXPECT_FALSE(cuda::bf16_split_terms_valid(4));
}

// The model's shapes (k = 4096; outputs of a compressor's width) with activations of unit
// scale and weights of 0.02: per-row relative L2 of the split product (its part products
// summed exactly) against the double product. 3 terms: bf16_split.h's ~5e-6 (the bound of
// the Float32 mode, 1e-5, with room for the GPU's f32 sums); 6 terms: below 1e-7.
TEST(Bf16Split, SplitProductsStayWithinTheirErrors) {
  std::mt19937_64 rng(8122026);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int rows = 16, n = 64, k = 4096;
  std::vector<float> x(static_cast<size_t>(rows) * k), w(static_cast<size_t>(n) * k);
  for (float& v : x) v = normal(rng);
  for (float& v : w) v = 0.02f * normal(rng);
  std::vector<cuda::Bf16Parts> xp(x.size()), wp(w.size());
  for (size_t i = 0; i < x.size(); ++i) xp[i] = cuda::bf16_split(x[i]);
  for (size_t i = 0; i < w.size(); ++i) wp[i] = cuda::bf16_split(w[i]);
  for (int terms : {3, 6}) {
    double worst = 0.0;
    for (int r = 0; r < rows; ++r) {
      double err2 = 0.0, ref2 = 0.0;
      for (int o = 0; o < n; ++o) {
        double want = 0.0, got = 0.0;
        for (int j = 0; j < k; ++j) {
          const size_t xi = static_cast<size_t>(r) * k + j, wi = static_cast<size_t>(o) * k + j;
          want += static_cast<double>(x[xi]) * w[wi];
          for (int t = 0; t < terms; ++t)
            got += static_cast<double>(bf16_to_f32(xp[xi].part[cuda::bf16_split_part(Bf16SplitSide::activations, t)])) *
                   bf16_to_f32(wp[wi].part[cuda::bf16_split_part(Bf16SplitSide::weights, t)]);
        }
        err2 += (got - want) * (got - want);
        ref2 += want * want;
      }
      worst = std::max(worst, std::sqrt(err2 / ref2));
    }
    std::printf("split product, %d terms: worst row relative error %.3g\n", terms, worst);
    EXPECT_LT(worst, terms == 3 ? 8e-6 : 1e-7) << terms << " terms";
    EXPECT_GT(worst, terms == 3 ? 1e-6 : 0.0) << "3 terms leave out ~2^-18 of each product";
  }
}

}  // namespace
}  // namespace dsv4
