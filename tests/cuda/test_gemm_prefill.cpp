// Prefill products (src/backend/cuda/gemm_prefill.h): the BF16 dequantisation against the
// CPU's, and dequantise + cuBLASLt against a double-precision product, on odd shapes; the
// BF16 split of f32 values and the split products against double precision.
#include "backend/cuda/gemm_prefill.h"

#include <cublasLt.h>

#include "cuda_test_util.h"
#include "support/test_support.h"

namespace dsv4::cuda::test {
namespace {

// bf16 keeps 8 significant bits: each dequantised weight within 2^-8 of its f32 value.
constexpr double kBf16ElementBound = 1.0 / 256;
// Against the product of the same bf16 operands only f32 accumulation remains.
constexpr double kGemmBound = 1e-4;

class PrefillTest : public ::testing::TestWithParam<GgmlType> {};

TEST_P(PrefillTest, DequantiseAndMultiply) {
  const GgmlType type = GetParam();
  std::mt19937_64 rng(dsv4::test::test_seed());
  SCOPED_TRACE("seed " + std::to_string(dsv4::test::test_seed()));
  const int64_t k = ggml_traits(type).block_elems == 256 ? 768 : 224;
  const int64_t n = 136, m = 67;
  const auto w = random_weights(type, n, k, rng);
  const auto wf = dequantize(type, w.data(), n, k);
  DeviceBuffer dw = DeviceBuffer::from(w);
  DeviceBuffer dwb(static_cast<size_t>(n * k) * sizeof(__nv_bfloat16));

  if (type != GgmlType::BF16) {
    dwb.poison();
    ASSERT_OK(dequantize_to_bf16(type, dw.get(), n, k, dwb.get<__nv_bfloat16>(), nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    const auto got = dwb.to_host<uint16_t>(static_cast<size_t>(n * k));
    int bad = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const float g = bf16_to_f32(got[i]);
      if (!(std::fabs(g - wf[i]) <= kBf16ElementBound * std::fabs(wf[i]) + 1e-30)) ++bad;
    }
    EXPECT_EQ(bad, 0) << "of " << got.size() << " weights";
  }

  const auto x = dsv4::test::random_normal(static_cast<size_t>(m * k), rng);
  std::vector<uint16_t> xb(x.size());
  for (size_t i = 0; i < x.size(); ++i) xb[i] = f32_to_bf16(x[i]);
  DeviceBuffer dx = DeviceBuffer::from(xb);
  DeviceBuffer dc(static_cast<size_t>(m * n) * sizeof(float));
  DeviceBuffer ws(kCublasLtWorkspaceBytes);
  cublasLtHandle_t handle = nullptr;
  ASSERT_EQ(cublasLtCreate(&handle), CUBLAS_STATUS_SUCCESS);
  dc.poison();
  const Status st = gemm_prefill(handle, type, dw.get(), n, k, dx.get<__nv_bfloat16>(), m, dc.get<float>(),
                                 dwb.get<__nv_bfloat16>(), ws.get(), ws.bytes(), nullptr);
  cublasLtDestroy(handle);
  ASSERT_OK(st);
  ASSERT_CUDA(cudaDeviceSynchronize());
  const auto c = dc.to_host<float>(static_cast<size_t>(m * n));

  std::vector<double> want(c.size());
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < n; ++i) {
      double s = 0.0;
      for (int64_t j = 0; j < k; ++j)
        s += static_cast<double>(bf16_to_f32(f32_to_bf16(wf[i * k + j]))) * bf16_to_f32(xb[r * k + j]);
      want[r * n + i] = s;
    }
  EXPECT_LT(relative_error(c, want), kGemmBound);
}

INSTANTIATE_TEST_SUITE_P(Types, PrefillTest,
                         ::testing::Values(GgmlType::Q8_0, GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K,
                                           GgmlType::Q6_K, GgmlType::MXFP4, GgmlType::IQ2_XXS, GgmlType::BF16,
                                           GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1,
                                           GgmlType::IQ4_NL, GgmlType::Q5_K, GgmlType::IQ4_XS, GgmlType::IQ2_XS,
                                           GgmlType::IQ2_S, GgmlType::IQ3_XXS, GgmlType::IQ3_S, GgmlType::IQ1_S,
                                           GgmlType::IQ1_M),
                         [](const auto& info) { return type_name(info.param); });

// split_to_bf16: the parts of every value are bf16(v), bf16(v - hi), bf16(v - hi - mid) in
// the order of each layout, and hi + mid + lo is v exactly (values over 2^-40..2^40, a
// strided source). The split products of 3 and 6 terms against the double product of the
// f32 operands: 3 terms drop ~2^-18 of each product, 6 terms leave the f32 sums' error.
TEST(SplitProducts, PartsAreExactAndProductsMatchDouble) {
  std::mt19937_64 rng(dsv4::test::test_seed());
  SCOPED_TRACE("seed " + std::to_string(dsv4::test::test_seed()));
  const int64_t m = 70, n = 72, k = 1032, ldx = k + 3;
  std::uniform_int_distribution<int> exponent(-40, 40);
  std::vector<float> x(static_cast<size_t>(m * ldx)), w(static_cast<size_t>(n * k));
  const auto xs = dsv4::test::random_normal(x.size(), rng), ws = dsv4::test::random_normal(w.size(), rng, 0.05f);
  for (size_t i = 0; i < x.size(); ++i) x[i] = xs[i] * (i < 64 ? std::ldexp(1.0f, exponent(rng)) : 1.0f);
  for (size_t i = 0; i < w.size(); ++i) w[i] = ws[i];
  DeviceBuffer dx = DeviceBuffer::from(x), dw = DeviceBuffer::from(w);
  DeviceBuffer ws_buf(kCublasLtWorkspaceBytes);
  cublasLtHandle_t handle = nullptr;
  ASSERT_EQ(cublasLtCreate(&handle), CUBLAS_STATUS_SUCCESS);
  std::vector<double> want(static_cast<size_t>(m * n));
  for (int64_t r = 0; r < m; ++r)
    for (int64_t o = 0; o < n; ++o) {
      double s = 0.0;
      for (int64_t j = 0; j < k; ++j) s += static_cast<double>(x[r * ldx + j]) * w[o * k + j];
      want[r * n + o] = s;
    }
  for (int terms : {3, 6}) {
    SCOPED_TRACE(std::to_string(terms) + " terms");
    DeviceBuffer da(static_cast<size_t>(m * terms * k) * 2), db(static_cast<size_t>(n * terms * k) * 2);
    da.poison();
    db.poison();
    ASSERT_OK(split_to_bf16(dx.get<float>(), ldx, m, k, terms, Bf16SplitSide::activations, da.get<__nv_bfloat16>(),
                            nullptr));
    ASSERT_OK(split_to_bf16(dw.get<float>(), k, n, k, terms, Bf16SplitSide::weights, db.get<__nv_bfloat16>(), nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    const auto a = da.to_host<uint16_t>(static_cast<size_t>(m * terms * k));
    int bad = 0, inexact = 0;
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < k; ++j) {
        const float v = x[r * ldx + j];
        const uint16_t hi = f32_to_bf16(v);
        const uint16_t mid = f32_to_bf16(v - bf16_to_f32(hi));
        const uint16_t lo = f32_to_bf16(v - bf16_to_f32(hi) - bf16_to_f32(mid));
        const uint16_t part[3] = {hi, mid, lo};
        for (int t = 0; t < terms; ++t)
          if (a[(r * terms + t) * k + j] != part[bf16_split_part(Bf16SplitSide::activations, t)]) ++bad;
        if (static_cast<double>(bf16_to_f32(hi)) + bf16_to_f32(mid) + bf16_to_f32(lo) != static_cast<double>(v))
          ++inexact;
      }
    EXPECT_EQ(bad, 0) << "activation parts";
    EXPECT_EQ(inexact, 0) << "values not the sum of their parts";
    const auto b = db.to_host<uint16_t>(static_cast<size_t>(n * terms * k));
    bad = 0;
    for (int64_t o = 0; o < n; ++o)
      for (int64_t j = 0; j < k; ++j) {
        const float v = w[o * k + j];
        const uint16_t hi = f32_to_bf16(v);
        const uint16_t mid = f32_to_bf16(v - bf16_to_f32(hi));
        const uint16_t part[3] = {hi, mid, f32_to_bf16(v - bf16_to_f32(hi) - bf16_to_f32(mid))};
        for (int t = 0; t < terms; ++t)
          if (b[(o * terms + t) * k + j] != part[bf16_split_part(Bf16SplitSide::weights, t)]) ++bad;
      }
    EXPECT_EQ(bad, 0) << "weight parts";

    // C 16-byte aligned, not 256 (the backend's direct case: a column slice of y).
    const int64_t ldc = n + 8;
    DeviceBuffer dc(static_cast<size_t>(m * ldc) * sizeof(float));
    dc.poison();
    ASSERT_OK(gemm_bf16_split(handle, da.get<__nv_bfloat16>(), db.get<__nv_bfloat16>(), dc.get<float>() + 4, ldc, m, n,
                              k, terms, ws_buf.get(), ws_buf.bytes(), nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    const auto c = dc.to_host<float>(static_cast<size_t>(m * ldc));
    std::vector<float> got(want.size());
    for (int64_t r = 0; r < m; ++r)
      for (int64_t o = 0; o < n; ++o) got[r * n + o] = c[r * ldc + 4 + o];
    const double err = relative_error(got, want);
    std::printf("split product, %d terms: relative error %.3g\n", terms, err);
    // The f32 sums of the tensor cores add ~5e-7 (the f32 GEMM's own error) to either.
    EXPECT_LT(err, terms == 3 ? 1e-5 : 2e-6);
  }
  cublasLtDestroy(handle);
  EXPECT_FALSE(split_to_bf16(dx.get<float>(), ldx, m, k, 4, Bf16SplitSide::activations, nullptr, nullptr).is_ok());
  EXPECT_FALSE(split_to_bf16(dx.get<float>(), ldx, m, 1030, 3, Bf16SplitSide::activations, nullptr, nullptr).is_ok());
}

}  // namespace
}  // namespace dsv4::cuda::test
