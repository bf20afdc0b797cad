// Prefill products (src/backend/cuda/gemm_prefill.h): the BF16 dequantisation against the
// CPU's, and dequantise + cuBLASLt against a double-precision product, on odd shapes.
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

}  // namespace
}  // namespace dsv4::cuda::test
