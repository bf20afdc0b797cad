// moe_experts (src/backend/cuda/moe_experts.h) against a double-precision CPU reference of the
// clamped SwiGLU experts on the dequantised weights, for the per-token path (1-2 tokens) and
// the expert-sorted tiled path, with poisoned outputs.
#include "backend/cuda/moe_experts.h"

#include <algorithm>
#include <numeric>

#include "cuda_test_util.h"
#include "support/test_support.h"

namespace dsv4::cuda::test {
namespace {

// Two Q8 activation roundings (x, then h) on the integer paths: about 0.5% each.
constexpr double kBound = 3e-2;
constexpr float kLimit = 10.0f;

struct TypePair {
  GgmlType gate_up, down;
};

class MoeTest : public ::testing::TestWithParam<TypePair> {};

double silu(double v) { return v / (1.0 + std::exp(-v)); }

TEST_P(MoeTest, MatchesCpuReference) {
  const auto [gu_type, down_type] = GetParam();
  std::mt19937_64 rng(dsv4::test::test_seed());
  SCOPED_TRACE("seed " + std::to_string(dsv4::test::test_seed()));
  const int64_t experts = 8, hidden = 1024, ffn = 512;
  const int top_k = 6;
  const auto gate = random_weights(gu_type, experts * ffn, hidden, rng);
  const auto up = random_weights(gu_type, experts * ffn, hidden, rng);
  const auto down = random_weights(down_type, experts * hidden, ffn, rng);
  const auto gate_f = dequantize(gu_type, gate.data(), experts * ffn, hidden);
  const auto up_f = dequantize(gu_type, up.data(), experts * ffn, hidden);
  const auto down_f = dequantize(down_type, down.data(), experts * hidden, ffn);
  DeviceBuffer d_gate = DeviceBuffer::from(gate), d_up = DeviceBuffer::from(up), d_down = DeviceBuffer::from(down);
  const ExpertWeights w{gu_type, d_gate.get(), d_up.get(), down_type, d_down.get(), experts, hidden, ffn};

  // Activations scaled so that gate and up products reach past the clamp.
  auto product = [&](const std::vector<float>& m, int64_t e, int64_t i, const float* x, int64_t k) {
    double s = 0.0;
    for (int64_t j = 0; j < k; ++j) s += static_cast<double>(m[(e * (m.size() / experts / k) + i) * k + j]) * x[j];
    return s;
  };

  for (const int64_t tokens : {int64_t{1}, int64_t{2}, int64_t{5}, int64_t{40}}) {
    SCOPED_TRACE("tokens " + std::to_string(tokens));
    std::vector<float> x = dsv4::test::random_normal(static_cast<size_t>(tokens * hidden), rng);
    double rms = 0.0;
    for (int64_t i = 0; i < 32; ++i) rms += std::pow(product(gate_f, 0, i, x.data(), hidden), 2);
    const float scale = static_cast<float>(8.0 / std::sqrt(rms / 32));
    for (auto& v : x) v *= scale;

    std::vector<int32_t> ids(static_cast<size_t>(tokens * top_k));
    std::vector<float> weights(ids.size());
    std::vector<int32_t> perm(experts);
    std::uniform_real_distribution<float> uni(0.1f, 1.0f);
    for (int64_t t = 0; t < tokens; ++t) {
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      float sum = 0.0f;
      for (int s = 0; s < top_k; ++s) {
        ids[t * top_k + s] = perm[s];
        sum += (weights[t * top_k + s] = uni(rng));
      }
      for (int s = 0; s < top_k; ++s) weights[t * top_k + s] *= 1.5f / sum;
    }

    std::vector<double> want(static_cast<size_t>(tokens * hidden), 0.0);
    int clamped = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      for (int s = 0; s < top_k; ++s) {
        const int64_t e = ids[t * top_k + s];
        std::vector<float> h(ffn);
        for (int64_t i = 0; i < ffn; ++i) {
          const double g = product(gate_f, e, i, &x[t * hidden], hidden);
          const double u = product(up_f, e, i, &x[t * hidden], hidden);
          clamped += (g > kLimit) + (std::fabs(u) > kLimit);
          h[i] = static_cast<float>(weights[t * top_k + s] * silu(std::min<double>(g, kLimit)) *
                                    std::clamp<double>(u, -kLimit, kLimit));
        }
        for (int64_t i = 0; i < hidden; ++i) want[t * hidden + i] += product(down_f, e, i, h.data(), ffn);
      }
    }
    EXPECT_GT(clamped, 0) << "the data never reaches the clamp";

    DeviceBuffer d_x = DeviceBuffer::from(x), d_ids = DeviceBuffer::from(ids), d_w = DeviceBuffer::from(weights);
    DeviceBuffer d_y(static_cast<size_t>(tokens * hidden) * sizeof(float));
    DeviceBuffer ws(moe_experts_workspace_bytes(w, tokens, top_k));
    ws.poison();
    d_y.poison();
    const ExpertRouting routing{d_ids.get<int32_t>(), d_w.get<float>(), tokens, top_k};
    ASSERT_OK(moe_experts(w, d_x.get<float>(), routing, kLimit, d_y.get<float>(), ws.get(), ws.bytes(), nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    const auto y = d_y.to_host<float>(want.size());
    EXPECT_LT(relative_error(y, want), kBound);
  }
}

INSTANTIATE_TEST_SUITE_P(Types, MoeTest,
                         ::testing::Values(TypePair{GgmlType::IQ2_XXS, GgmlType::Q2_K},
                                           TypePair{GgmlType::Q2_K, GgmlType::Q2_K},
                                           TypePair{GgmlType::Q3_K, GgmlType::Q3_K},
                                           TypePair{GgmlType::Q4_K, GgmlType::Q6_K},
                                           TypePair{GgmlType::MXFP4, GgmlType::MXFP4},
                                           TypePair{GgmlType::Q8_0, GgmlType::BF16}),
                         [](const auto& info) {
                           return type_name(info.param.gate_up) + "_" + type_name(info.param.down);
                         });

}  // namespace
}  // namespace dsv4::cuda::test
