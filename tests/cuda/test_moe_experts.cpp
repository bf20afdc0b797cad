// moe_experts (src/backend/cuda/moe_experts.h) against a double-precision CPU reference of the
// clamped SwiGLU experts on the dequantised weights, for the per-token path (1-2 tokens) and
// the expert-sorted tiled path, with poisoned outputs.
#include "backend/cuda/moe_experts.h"

#include "backend/cuda/matvec.h"
#include "backend/cuda/moe_wgmma.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <thread>
#include <utility>

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

// Random expert stacks (gate and up [experts * ffn][hidden], down [experts * hidden][ffn]),
// drawn gate, up, down from rng; on the device as `w`, and decoded to f32 for a reference
// when `decoded` (gate_f, up_f, down_f; empty otherwise).
struct RandomExperts {
  RandomExperts(TypePair types, int64_t experts, int64_t hidden, int64_t ffn, std::mt19937_64& rng,
                bool decoded = true)
      : gate(random_weights(types.gate_up, experts * ffn, hidden, rng)),
        up(random_weights(types.gate_up, experts * ffn, hidden, rng)),
        down(random_weights(types.down, experts * hidden, ffn, rng)),
        d_gate(DeviceBuffer::from(gate)),
        d_up(DeviceBuffer::from(up)),
        d_down(DeviceBuffer::from(down)),
        w{types.gate_up, d_gate.get(), d_up.get(), types.down, d_down.get(), experts, hidden, ffn} {
    if (!decoded) return;
    gate_f = dequantize(types.gate_up, gate.data(), experts * ffn, hidden);
    up_f = dequantize(types.gate_up, up.data(), experts * ffn, hidden);
    down_f = dequantize(types.down, down.data(), experts * hidden, ffn);
  }
  std::vector<uint8_t> gate, up, down;
  DeviceBuffer d_gate, d_up, d_down;
  ExpertWeights w;
  std::vector<float> gate_f, up_f, down_f;
};

double silu(double v) { return v / (1.0 + std::exp(-v)); }

// f(i) for i in [0, n) on every hardware thread (the references of the larger cases).
template <class F>
void parallel_for(int64_t n, F&& f) {
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(n, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int64_t w = 0; w < workers; ++w)
    pool.emplace_back([&, w] {
      for (int64_t i = w; i < n; i += workers) f(i);
    });
  for (auto& t : pool) t.join();
}

// The experts in double on the dequantised weights ([experts][ffn][hidden] gate and up,
// [experts][hidden][ffn] down), every token's top_k slots summed; returns how many gate or up
// products passed the clamp (the data must reach it).
int64_t reference_experts(const std::vector<float>& gate_f, const std::vector<float>& up_f,
                          const std::vector<float>& down_f, int64_t hidden, int64_t ffn, const std::vector<float>& x,
                          const std::vector<int32_t>& ids, const std::vector<float>& weights, int top_k,
                          std::vector<double>& want) {
  const int64_t tokens = static_cast<int64_t>(x.size()) / hidden;
  want.assign(static_cast<size_t>(tokens * hidden), 0.0);
  std::vector<int64_t> clamped(static_cast<size_t>(tokens), 0);
  parallel_for(tokens, [&](int64_t t) {
    std::vector<float> h(static_cast<size_t>(ffn));
    for (int s = 0; s < top_k; ++s) {
      const int64_t e = ids[t * top_k + s];
      for (int64_t i = 0; i < ffn; ++i) {
        double g = 0.0, u = 0.0;
        const float* gr = &gate_f[(e * ffn + i) * hidden];
        const float* ur = &up_f[(e * ffn + i) * hidden];
        for (int64_t j = 0; j < hidden; ++j) {
          g += static_cast<double>(gr[j]) * x[t * hidden + j];
          u += static_cast<double>(ur[j]) * x[t * hidden + j];
        }
        clamped[t] += (g > kLimit) + (std::fabs(u) > kLimit);
        h[i] = static_cast<float>(weights[t * top_k + s] * silu(std::min<double>(g, kLimit)) *
                                  std::clamp<double>(u, -kLimit, kLimit));
      }
      for (int64_t i = 0; i < hidden; ++i) {
        double acc = 0.0;
        const float* dr = &down_f[(e * hidden + i) * ffn];
        for (int64_t j = 0; j < ffn; ++j) acc += static_cast<double>(dr[j]) * h[j];
        want[t * hidden + i] += acc;
      }
    }
  });
  return std::accumulate(clamped.begin(), clamped.end(), int64_t{0});
}

TEST_P(MoeTest, MatchesCpuReference) {
  const auto [gu_type, down_type] = GetParam();
  std::mt19937_64 rng(dsv4::test::test_seed());
  SCOPED_TRACE("seed " + std::to_string(dsv4::test::test_seed()));
  const int64_t experts = 8, hidden = 1024, ffn = 512;
  const int top_k = 6;
  RandomExperts ex(TypePair{gu_type, down_type}, experts, hidden, ffn, rng);
  const auto &gate_f = ex.gate_f, &up_f = ex.up_f, &down_f = ex.down_f;
  const ExpertWeights& w = ex.w;

  // Activations scaled so that gate and up products reach past the clamp.
  auto product = [&](const std::vector<float>& m, int64_t e, int64_t i, const float* x, int64_t k) {
    double s = 0.0;
    for (int64_t j = 0; j < k; ++j) s += static_cast<double>(m[(e * (m.size() / experts / k) + i) * k + j]) * x[j];
    return s;
  };

  // Default kernels (fused decode for 1-16 tokens, tensor-core tiles of 8 or 64 pairs beyond:
  // 16 and 17 tokens on either side of the switch, 40 and 96 tokens give 240 and 576 pairs
  // over 8 experts) and the earlier ones (KernelChoice off).
  // Batch-invariant mode: the decode path in slices of 16 tokens (17 and 40 tokens).
  // From 17 tokens (12.75 pairs per expert) the wgmma tiles run where both types allow
  // (moe_wgmma.h); 40 and 96 tokens also with moe_wgmma off, on the int8 tiles.
  struct Run {
    int64_t tokens;
    bool legacy;
    bool invariant = false;
    bool wgmma = true;
  };
  for (const Run run : {Run{1, false}, Run{2, false}, Run{5, false}, Run{16, false}, Run{17, false}, Run{40, false},
                        Run{96, false}, Run{40, false, false, false}, Run{96, false, false, false}, Run{1, true}, Run{2, true}, Run{5, true},
                        Run{40, true}, Run{17, false, true}, Run{40, false, true}}) {
    const int64_t tokens = run.tokens;
    SCOPED_TRACE("tokens " + std::to_string(tokens) +
                 (run.legacy      ? ", legacy kernels"
                  : run.invariant ? ", batch-invariant"
                  : run.wgmma     ? ", default kernels"
                                  : ", default kernels without wgmma"));
    KernelChoice choice = run.legacy ? KernelChoice{false, false, false, false, false, false} : KernelChoice{};
    choice.batch_invariant = run.invariant;
    choice.moe_wgmma = run.wgmma && !run.legacy;
    set_kernel_choice(choice);
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

    std::vector<double> want;
    EXPECT_GT(reference_experts(gate_f, up_f, down_f, hidden, ffn, x, ids, weights, top_k, want), 0)
        << "the data never reaches the clamp";

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
    if (run.invariant) {  // each token alone, and the last 3 together: the same bits as in the batch
      for (const auto [first, count] : {std::pair<int64_t, int64_t>{0, 1}, {tokens - 1, 1}, {tokens / 2, 1},
                                        {tokens - 3, 3}}) {
        d_y.poison();
        const ExpertRouting part{d_ids.get<int32_t>() + first * top_k, d_w.get<float>() + first * top_k, count, top_k};
        ASSERT_OK(moe_experts(w, d_x.get<float>() + first * hidden, part, kLimit, d_y.get<float>(), ws.get(),
                              ws.bytes(), nullptr));
        ASSERT_CUDA(cudaDeviceSynchronize());
        const auto alone = d_y.to_host<float>(static_cast<size_t>(count * hidden));
        EXPECT_EQ(0, std::memcmp(alone.data(), y.data() + first * hidden, alone.size() * sizeof(float)))
            << count << " tokens from token " << first << " differ from the same tokens among " << tokens;
      }
    }
  }
  set_kernel_choice(KernelChoice{});
}

// The decode path at V4-Flash's expert shapes (hidden 4096, ffn 2048: one unit per lane for the
// 2-3-bit types, four for Q8_0), one token, the recipe's type pairs.
TEST(MoeDecode, FlashShapes) {
  std::mt19937_64 rng(dsv4::test::test_seed() + 7);
  SCOPED_TRACE("seed " + std::to_string(dsv4::test::test_seed()));
  const int64_t experts = 7, hidden = 4096, ffn = 2048;
  const int top_k = 6;
  for (const TypePair types : {TypePair{GgmlType::Q2_K, GgmlType::Q3_K}, TypePair{GgmlType::Q8_0, GgmlType::Q8_0},
                               TypePair{GgmlType::MXFP4, GgmlType::MXFP4}}) {
    SCOPED_TRACE(type_name(types.gate_up) + "/" + type_name(types.down));
    RandomExperts ex(types, experts, hidden, ffn, rng, /*decoded=*/false);
    const auto &gate = ex.gate, &up = ex.up, &down = ex.down;  // decoded row by row below
    const ExpertWeights& w = ex.w;
    ASSERT_TRUE(detail::moe_decode_applies(w, 1, top_k));
    std::vector<float> x = dsv4::test::random_normal(static_cast<size_t>(hidden), rng, 0.05f);
    const std::vector<int32_t> ids = {3, 0, 6, 1, 5, 2};
    const std::vector<float> weights = {0.4f, 0.3f, 0.2f, 0.25f, 0.2f, 0.15f};
    std::vector<double> want(static_cast<size_t>(hidden), 0.0);
    std::vector<float> row(static_cast<size_t>(hidden));
    std::vector<float> h(static_cast<size_t>(ffn));
    for (int s = 0; s < top_k; ++s) {
      const int64_t e = ids[s];
      for (int64_t i = 0; i < ffn; ++i) {
        double g = 0.0, u = 0.0;
        dequantize_row(types.gate_up, gate.data() + (e * ffn + i) * row_bytes(types.gate_up, hidden), row.data(), hidden);
        for (int64_t j = 0; j < hidden; ++j) g += static_cast<double>(row[j]) * x[j];
        dequantize_row(types.gate_up, up.data() + (e * ffn + i) * row_bytes(types.gate_up, hidden), row.data(), hidden);
        for (int64_t j = 0; j < hidden; ++j) u += static_cast<double>(row[j]) * x[j];
        h[i] = static_cast<float>(weights[s] * silu(std::min<double>(g, kLimit)) * std::clamp<double>(u, -kLimit, kLimit));
      }
      std::vector<float> drow(static_cast<size_t>(ffn));
      for (int64_t i = 0; i < hidden; ++i) {
        dequantize_row(types.down, down.data() + (e * hidden + i) * row_bytes(types.down, ffn), drow.data(), ffn);
        double acc = 0.0;
        for (int64_t j = 0; j < ffn; ++j) acc += static_cast<double>(drow[j]) * h[j];
        want[i] += acc;
      }
    }
    DeviceBuffer d_x = DeviceBuffer::from(x), d_ids = DeviceBuffer::from(ids), d_w = DeviceBuffer::from(weights);
    DeviceBuffer d_y(static_cast<size_t>(hidden) * sizeof(float));
    DeviceBuffer ws(moe_experts_workspace_bytes(w, 1, top_k));
    ws.poison();
    d_y.poison();
    const ExpertRouting routing{d_ids.get<int32_t>(), d_w.get<float>(), 1, top_k};
    ASSERT_OK(moe_experts(w, d_x.get<float>(), routing, kLimit, d_y.get<float>(), ws.get(), ws.bytes(), nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    EXPECT_LT(relative_error(d_y.to_host<float>(want.size()), want), kBound);
  }
}

// Which token counts take the fused decode kernels (moe_experts_fused_decode): up to 16 always,
// up to 64 while the pairs are spread thin (V4-Flash's 256 experts), not with decode64 off or in
// batch-invariant mode (slices of 16), never beyond 64.
TEST(MoeDecode, TakesManySequencesSpreadOverExperts) {
  const ExpertWeights flash{GgmlType::Q2_K, nullptr, nullptr, GgmlType::Q3_K, nullptr, 256, 4096, 2048};
  const ExpertWeights few{GgmlType::Q2_K, nullptr, nullptr, GgmlType::Q3_K, nullptr, 8, 1024, 512};
  set_kernel_choice(KernelChoice{});
  EXPECT_TRUE(moe_experts_fused_decode(flash, 1, 6));
  EXPECT_TRUE(moe_experts_fused_decode(flash, 16, 6));
  EXPECT_TRUE(moe_experts_fused_decode(flash, 64, 6));
  EXPECT_FALSE(moe_experts_fused_decode(flash, 65, 6));
  EXPECT_TRUE(moe_experts_fused_decode(few, 16, 6));
  EXPECT_FALSE(moe_experts_fused_decode(few, 17, 6)) << "17 tokens over 8 experts: the tiles share rows";
  KernelChoice narrow;
  narrow.moe_decode_wide = false;
  set_kernel_choice(narrow);
  EXPECT_TRUE(moe_experts_fused_decode(flash, 16, 6));
  EXPECT_FALSE(moe_experts_fused_decode(flash, 17, 6));
  KernelChoice invariant;
  invariant.batch_invariant = true;
  set_kernel_choice(invariant);
  EXPECT_FALSE(moe_experts_fused_decode(flash, 64, 6));
  set_kernel_choice(KernelChoice{});
}

// Every decode kernel variant (DSV4_MOE_DECODE_VARIANT, moe_experts.h) against the reference
// and bit-identical to variant 0 (all claim its bits), over shapes whose lane groups differ
// (hidden 4096 / 1024 / 256: 32, 8 and 2 lanes a Q2_K row, 1 a Q6_K row at 256; ffn 2048 /
// 512 / 256: 16, 4 and 2 lanes a Q3_K row), odd expert counts, top_k 1-8 and 1-64 tokens
// (partial stages, last blocks); the last token alone gives its bits among the others, and the
// gate/up blocks in pair-first order give the row-block-first order's bits.
class MoeDecodeVariants : public ::testing::TestWithParam<TypePair> {};

TEST_P(MoeDecodeVariants, MatchDefaultBits) {
  const auto [gu_type, down_type] = GetParam();
  std::mt19937_64 rng(dsv4::test::test_seed() + 13);
  SCOPED_TRACE("seed " + std::to_string(dsv4::test::test_seed()));
  struct Shape {
    int64_t experts, hidden, ffn;
    int top_k;
    std::vector<int64_t> tokens;
  };
  for (const Shape& shape : {Shape{7, 4096, 2048, 6, {1, 3}}, Shape{9, 1024, 512, 8, {1, 2, 5, 16, 64}},
                             Shape{5, 1024, 512, 1, {1, 16}}, Shape{3, 256, 256, 3, {1, 7, 40}}}) {
    const auto [experts, hidden, ffn, top_k, token_counts] = shape;
    SCOPED_TRACE("experts " + std::to_string(experts) + ", hidden " + std::to_string(hidden) + ", ffn " +
                 std::to_string(ffn) + ", top_k " + std::to_string(top_k));
    RandomExperts ex(TypePair{gu_type, down_type}, experts, hidden, ffn, rng);
    const auto &gate_f = ex.gate_f, &up_f = ex.up_f, &down_f = ex.down_f;
    const ExpertWeights& w = ex.w;
    for (const int64_t tokens : token_counts) {
      SCOPED_TRACE("tokens " + std::to_string(tokens));
      ASSERT_TRUE(detail::moe_decode_applies(w, tokens, top_k));
      // x scaled so that some gate and up sums pass the clamp.
      std::vector<float> x = dsv4::test::random_normal(static_cast<size_t>(tokens * hidden), rng);
      double rms = 0.0;
      for (int64_t i = 0; i < 32; ++i) {
        double g = 0.0;
        for (int64_t j = 0; j < hidden; ++j) g += static_cast<double>(gate_f[i * hidden + j]) * x[j];
        rms += g * g;
      }
      const float scale = static_cast<float>(8.0 / std::sqrt(rms / 32 + 1e-30));
      for (auto& v : x) v *= scale;
      std::vector<int32_t> ids(static_cast<size_t>(tokens * top_k));
      std::vector<float> weights(ids.size());
      std::vector<int32_t> perm(static_cast<size_t>(experts));
      std::uniform_real_distribution<float> uni(0.1f, 1.0f);
      for (int64_t t = 0; t < tokens; ++t) {
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        for (int s = 0; s < top_k; ++s) {
          ids[t * top_k + s] = perm[s];
          weights[t * top_k + s] = uni(rng) * 1.5f / static_cast<float>(top_k);
        }
      }
      std::vector<double> want;
      reference_experts(gate_f, up_f, down_f, hidden, ffn, x, ids, weights, top_k, want);

      DeviceBuffer d_x = DeviceBuffer::from(x), d_ids = DeviceBuffer::from(ids), d_w = DeviceBuffer::from(weights);
      DeviceBuffer d_y(static_cast<size_t>(tokens * hidden) * sizeof(float));
      DeviceBuffer ws(detail::moe_decode_workspace_bytes(w, tokens, top_k));
      const ExpertRouting routing{d_ids.get<int32_t>(), d_w.get<float>(), tokens, top_k};
      std::vector<float> base;
      for (int variant = 0; variant < detail::kMoeDecodeVariants; ++variant) {
        SCOPED_TRACE("variant " + std::to_string(variant));
        detail::set_moe_decode_variant(variant);
        ws.poison();
        d_y.poison();
        ASSERT_OK(detail::moe_decode(w, d_x.get<float>(), routing, kLimit, d_y.get<float>(), ws.get(), ws.bytes(),
                                     nullptr));
        ASSERT_CUDA(cudaDeviceSynchronize());
        const auto y = d_y.to_host<float>(want.size());
        EXPECT_LT(relative_error(y, want), kBound);
        if (variant == 0) {
          base = y;
        } else {
          EXPECT_EQ(0, std::memcmp(base.data(), y.data(), y.size() * sizeof(float)))
              << "variant " << variant << " differs from variant 0";
        }
        {  // gate/up blocks pair first instead of row block first: the same bits
          KernelChoice pair_first;
          pair_first.moe_decode_rows_first = false;
          set_kernel_choice(pair_first);
          d_y.poison();
          const Status st = detail::moe_decode(w, d_x.get<float>(), routing, kLimit, d_y.get<float>(), ws.get(),
                                               ws.bytes(), nullptr);
          set_kernel_choice(KernelChoice{});
          ASSERT_OK(st);
          ASSERT_CUDA(cudaDeviceSynchronize());
          const auto y2 = d_y.to_host<float>(want.size());
          EXPECT_EQ(0, std::memcmp(y.data(), y2.data(), y.size() * sizeof(float))) << "pair-first order differs";
        }
        if (tokens > 1) {  // the last token alone: the same bits as among the others
          d_y.poison();
          const ExpertRouting last{d_ids.get<int32_t>() + (tokens - 1) * top_k, d_w.get<float>() + (tokens - 1) * top_k,
                                   1, top_k};
          ASSERT_OK(detail::moe_decode(w, d_x.get<float>() + (tokens - 1) * hidden, last, kLimit, d_y.get<float>(),
                                       ws.get(), ws.bytes(), nullptr));
          ASSERT_CUDA(cudaDeviceSynchronize());
          const auto alone = d_y.to_host<float>(static_cast<size_t>(hidden));
          EXPECT_EQ(0, std::memcmp(alone.data(), y.data() + (tokens - 1) * hidden, alone.size() * sizeof(float)))
              << "the last token alone differs";
        }
      }
      detail::set_moe_decode_variant(detail::kMoeDecodeDefaultVariant);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Types, MoeDecodeVariants,
                         ::testing::Values(TypePair{GgmlType::Q2_K, GgmlType::Q3_K}, TypePair{GgmlType::Q2_K, GgmlType::Q2_K},
                                           TypePair{GgmlType::Q8_0, GgmlType::Q8_0}, TypePair{GgmlType::Q4_K, GgmlType::Q6_K},
                                           TypePair{GgmlType::Q3_K, GgmlType::Q4_K}, TypePair{GgmlType::Q6_K, GgmlType::Q8_0},
                                           TypePair{GgmlType::MXFP4, GgmlType::MXFP4}),
                         [](const ::testing::TestParamInfo<TypePair>& info) {
                           return type_name(info.param.gate_up) + "_" + type_name(info.param.down);
                         });

// The wgmma tiles (moe_wgmma.h) on their own: 16 experts with skewed routing, so that tiles
// hold from a few to 128 pairs (the 64- and 128-column products, experts split over several
// tiles), against the double-precision reference; the same bits on a second run. BF16
// roundings of x, the decoded weights and h (2^-9 relative each) bound the error well below
// the int8 paths' kBound; the pair decoders of Q2_K / Q3_K (the default) round the sub-block
// scales and minima to BF16 as well, and are run beside the f32 decoders ("wgdecode").
class MoeWgmma : public ::testing::TestWithParam<bool> {};

TEST_P(MoeWgmma, MatchesCpuReference) {
  std::mt19937_64 rng(dsv4::test::test_seed() + 11);
  SCOPED_TRACE("seed " + std::to_string(dsv4::test::test_seed()));
  constexpr double kWgmmaBound = 1e-2;
  const int64_t experts = 16, hidden = 1024, ffn = 512;
  const int top_k = 6;
  KernelChoice choice;
  choice.moe_wgmma_pair_decode = GetParam();
  set_kernel_choice(choice);
  for (const TypePair types : {TypePair{GgmlType::Q2_K, GgmlType::Q3_K}, TypePair{GgmlType::Q8_0, GgmlType::Q8_0},
                               TypePair{GgmlType::Q3_K, GgmlType::Q2_K}}) {
    SCOPED_TRACE(type_name(types.gate_up) + "/" + type_name(types.down));
    RandomExperts ex(types, experts, hidden, ffn, rng);
    const auto &gate_f = ex.gate_f, &up_f = ex.up_f, &down_f = ex.down_f;
    const ExpertWeights& w = ex.w;
    for (const int64_t tokens : {30, 90, 200}) {  // 11, 34 and 75 pairs per expert on average
      SCOPED_TRACE("tokens " + std::to_string(tokens));
      ASSERT_TRUE(detail::moe_wgmma_applies(w, tokens * top_k));
      // Expert e drawn with weight (e + 1)^2 (without repeats within a token): counts from a
      // few pairs to several tiles.
      std::vector<double> pick(experts);
      for (int64_t e = 0; e < experts; ++e) pick[e] = static_cast<double>((e + 1) * (e + 1));
      std::vector<int32_t> ids(static_cast<size_t>(tokens * top_k));
      std::vector<float> weights(ids.size());
      std::uniform_real_distribution<float> uni(0.1f, 1.0f);
      for (int64_t t = 0; t < tokens; ++t) {
        std::vector<double> left = pick;
        for (int s = 0; s < top_k; ++s) {
          std::discrete_distribution<int> draw(left.begin(), left.end());
          const int e = draw(rng);
          left[e] = 0.0;
          ids[t * top_k + s] = e;
          weights[t * top_k + s] = uni(rng) / top_k;
        }
      }
      std::vector<float> x = dsv4::test::random_normal(static_cast<size_t>(tokens * hidden), rng);
      // Scaled so that gate and up products reach past the clamp (about 8 rms).
      double rms = 0.0;
      for (int64_t i = 0; i < 32; ++i) {
        double p = 0.0;
        for (int64_t j = 0; j < hidden; ++j) p += static_cast<double>(gate_f[i * hidden + j]) * x[j];
        rms += p * p;
      }
      const float scale = static_cast<float>(8.0 / std::sqrt(rms / 32));
      for (auto& v : x) v *= scale;

      std::vector<double> want;
      EXPECT_GT(reference_experts(gate_f, up_f, down_f, hidden, ffn, x, ids, weights, top_k, want), 0)
          << "the data never reaches the clamp";

      DeviceBuffer d_x = DeviceBuffer::from(x), d_ids = DeviceBuffer::from(ids), d_w = DeviceBuffer::from(weights);
      DeviceBuffer d_y(static_cast<size_t>(tokens * hidden) * sizeof(float));
      DeviceBuffer ws(moe_experts_workspace_bytes(w, tokens, top_k));
      const ExpertRouting routing{d_ids.get<int32_t>(), d_w.get<float>(), tokens, top_k};
      std::vector<float> first;
      for (int pass = 0; pass < 2; ++pass) {
        ws.poison();
        d_y.poison();
        ASSERT_OK(moe_experts(w, d_x.get<float>(), routing, kLimit, d_y.get<float>(), ws.get(), ws.bytes(), nullptr));
        ASSERT_CUDA(cudaDeviceSynchronize());
        const auto y = d_y.to_host<float>(want.size());
        if (pass == 0) {
          const double err = relative_error(y, want);
          std::printf("[ moe wgmma ] %s/%s, %lld tokens, %s decode: relative L2 %.3g (bound %.0e)\n",
                      type_name(types.gate_up).c_str(), type_name(types.down).c_str(), static_cast<long long>(tokens),
                      GetParam() ? "pair" : "f32", err, kWgmmaBound);
          EXPECT_LT(err, kWgmmaBound);
          first = y;
        } else {
          EXPECT_EQ(0, std::memcmp(first.data(), y.data(), y.size() * sizeof(float))) << "not deterministic";
        }
      }
    }
  }
  set_kernel_choice(KernelChoice{});
}

INSTANTIATE_TEST_SUITE_P(Decoders, MoeWgmma, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& info) { return info.param ? "pair" : "f32"; });

INSTANTIATE_TEST_SUITE_P(Types, MoeTest,
                         ::testing::Values(TypePair{GgmlType::IQ2_XXS, GgmlType::Q2_K},
                                           TypePair{GgmlType::Q2_K, GgmlType::Q2_K},
                                           TypePair{GgmlType::Q2_K, GgmlType::Q3_K},
                                           TypePair{GgmlType::Q6_K, GgmlType::Q8_0},
                                           TypePair{GgmlType::Q3_K, GgmlType::Q3_K},
                                           TypePair{GgmlType::Q4_K, GgmlType::Q6_K},
                                           TypePair{GgmlType::MXFP4, GgmlType::MXFP4},
                                           TypePair{GgmlType::Q8_0, GgmlType::BF16},
                                           // the types of published files: each once as gate/up, once as down
                                           TypePair{GgmlType::Q4_0, GgmlType::Q5_0},
                                           TypePair{GgmlType::Q5_0, GgmlType::IQ4_NL},
                                           TypePair{GgmlType::IQ4_NL, GgmlType::IQ4_XS},
                                           TypePair{GgmlType::IQ4_XS, GgmlType::Q5_K},
                                           TypePair{GgmlType::Q5_K, GgmlType::IQ2_XS},
                                           TypePair{GgmlType::IQ2_XS, GgmlType::IQ2_S},
                                           TypePair{GgmlType::IQ2_S, GgmlType::IQ3_XXS},
                                           TypePair{GgmlType::IQ3_XXS, GgmlType::IQ3_S},
                                           TypePair{GgmlType::IQ3_S, GgmlType::IQ1_S},
                                           TypePair{GgmlType::IQ1_S, GgmlType::IQ1_M},
                                           TypePair{GgmlType::IQ1_M, GgmlType::Q4_1},
                                           TypePair{GgmlType::Q4_1, GgmlType::Q5_1},
                                           TypePair{GgmlType::Q5_1, GgmlType::Q4_0}),
                         [](const auto& info) {
                           return type_name(info.param.gate_up) + "_" + type_name(info.param.down);
                         });

}  // namespace
}  // namespace dsv4::cuda::test
