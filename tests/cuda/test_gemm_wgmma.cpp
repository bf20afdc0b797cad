// Hand-written wgmma BF16 product (src/backend/cuda/gemm_wgmma.h) against a double-precision
// product of the same bf16 operands, f32 and bf16 outputs, several tile counts and depths.
#include "backend/cuda/gemm_wgmma.h"

#include <cmath>

#include "cuda_test_util.h"
#include "support/test_support.h"

namespace dsv4::cuda::test {
namespace {

// Only f32 accumulation order differs from the exact product of the bf16 operands.
constexpr double kF32OutBound = 1e-5;
// A bf16 output keeps 8 significant bits: at most 2^-9 relative per element after rounding.
constexpr double kBf16OutBound = 1.0 / 256;

struct Shape {
  int64_t m, n, k;
};

std::vector<uint16_t> random_bf16(size_t count, std::mt19937_64& rng) {
  const auto x = dsv4::test::random_normal(count, rng);
  std::vector<uint16_t> b(count);
  for (size_t i = 0; i < count; ++i) b[i] = f32_to_bf16(x[i]);
  return b;
}

// Every element must have been written (the poison is NaN); the rows in `rows` must match
// the double-precision product within `bound` (relative, over those rows).
void check_rows(const std::vector<float>& got, const std::vector<uint16_t>& a, const std::vector<uint16_t>& w,
                const Shape& s, const std::vector<int64_t>& rows, double bound) {
  int64_t unwritten = 0;
  for (float g : got) unwritten += std::isfinite(g) ? 0 : 1;
  EXPECT_EQ(unwritten, 0) << "of " << got.size();
  std::vector<float> w_f(w.size());
  for (size_t i = 0; i < w.size(); ++i) w_f[i] = bf16_to_f32(w[i]);
  std::vector<float> picked;
  std::vector<double> want;
  std::vector<double> a_row(static_cast<size_t>(s.k));
  for (int64_t r : rows) {
    for (int64_t j = 0; j < s.k; ++j) a_row[j] = bf16_to_f32(a[r * s.k + j]);
    for (int64_t i = 0; i < s.n; ++i) {
      double sum = 0.0;
      const float* wi = &w_f[i * s.k];
      for (int64_t j = 0; j < s.k; ++j) sum += a_row[j] * wi[j];
      want.push_back(sum);
      picked.push_back(got[r * s.n + i]);
    }
  }
  EXPECT_LT(relative_error(picked, want), bound);
}

class WgmmaTest : public ::testing::TestWithParam<Shape> {};

TEST_P(WgmmaTest, MatchesDoubleProduct) {
  const Shape s = GetParam();
  std::mt19937_64 rng(dsv4::test::test_seed());
  SCOPED_TRACE("seed " + std::to_string(dsv4::test::test_seed()));
  const auto a = random_bf16(static_cast<size_t>(s.m * s.k), rng);
  const auto w = random_bf16(static_cast<size_t>(s.n * s.k), rng);
  // All rows when small; otherwise every 128-row tile's first and last row plus random rows.
  std::vector<int64_t> rows;
  if (s.m * s.n * s.k <= (int64_t{1} << 26)) {
    for (int64_t r = 0; r < s.m; ++r) rows.push_back(r);
  } else {
    for (int64_t t = 0; t < s.m; t += kWgmmaTileM) rows.insert(rows.end(), {t, t + kWgmmaTileM - 1});
    for (int i = 0; i < 8; ++i) rows.push_back(static_cast<int64_t>(rng() % static_cast<uint64_t>(s.m)));
  }
  DeviceBuffer da = DeviceBuffer::from(a), dw = DeviceBuffer::from(w);
  const size_t count = static_cast<size_t>(s.m * s.n);

  DeviceBuffer c32(count * sizeof(float));
  c32.poison();
  ASSERT_OK(gemm_wgmma_bf16(da.get<__nv_bfloat16>(), dw.get<__nv_bfloat16>(), c32.get<float>(), s.m, s.n, s.k,
                            nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  check_rows(c32.to_host<float>(count), a, w, s, rows, kF32OutBound);

  DeviceBuffer c16(count * sizeof(__nv_bfloat16));
  c16.poison();
  ASSERT_OK(gemm_wgmma_bf16(da.get<__nv_bfloat16>(), dw.get<__nv_bfloat16>(), c16.get<__nv_bfloat16>(), s.m, s.n,
                            s.k, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const auto got16 = c16.to_host<uint16_t>(count);
  std::vector<float> got(count);
  for (size_t i = 0; i < count; ++i) got[i] = bf16_to_f32(got16[i]);
  check_rows(got, a, w, s, rows, kBf16OutBound);
}

INSTANTIATE_TEST_SUITE_P(Shapes, WgmmaTest,
                         ::testing::Values(Shape{128, 128, 64}, Shape{256, 256, 256}, Shape{384, 640, 320},
                                           Shape{512, 1024, 4096}, Shape{4096, 1024, 4096}),
                         [](const auto& info) {
                           const Shape& s = info.param;
                           return "m" + std::to_string(s.m) + "_n" + std::to_string(s.n) + "_k" + std::to_string(s.k);
                         });

TEST(WgmmaShapes, RejectsShapesOffTheTile) {
  DeviceBuffer buf(size_t{1} << 20);
  const auto* p = buf.get<__nv_bfloat16>();
  float* c = buf.get<float>();
  EXPECT_FALSE(gemm_wgmma_bf16(p, p, c, 100, 128, 64, nullptr).is_ok());
  EXPECT_FALSE(gemm_wgmma_bf16(p, p, c, 128, 96, 64, nullptr).is_ok());
  EXPECT_FALSE(gemm_wgmma_bf16(p, p, c, 128, 128, 72, nullptr).is_ok());
  EXPECT_FALSE(gemm_wgmma_bf16(p, p, c, 0, 128, 64, nullptr).is_ok());
  EXPECT_FALSE(gemm_wgmma_bf16(p + 1, p, c, 128, 128, 64, nullptr).is_ok());
}

}  // namespace
}  // namespace dsv4::cuda::test
