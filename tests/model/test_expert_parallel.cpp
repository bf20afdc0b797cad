// Expert-parallel routed experts (model/expert_parallel.h) on N CPU backends, each holding
// only its range of the experts, combined through the host collectives: y equals the
// single-backend Backend::moe_experts bit for bit (N = 1, 2, 3; F32 and Q8_0 stacks; the
// tiny model's geometry), and the one-backend layer itself matches a double-precision sum.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <thread>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/host_collective.h"
#include "gguf/quant.h"
#include "model/expert_parallel.h"
#include "model/partition.h"
#include "support/test_support.h"
#include "synth/presets.h"

namespace dsv4 {
namespace {

using backend::CpuBackend;
using backend::Tensor;

struct Stacks {
  GgmlType type;
  int64_t e, inter, d;
  std::vector<uint8_t> gate, up, down;  // stored rows, expert-major
  size_t gate_expert_bytes() const { return gate.size() / e; }
  size_t down_expert_bytes() const { return down.size() / e; }
};

std::vector<uint8_t> quantized(GgmlType type, const std::vector<float>& v, int64_t row) {
  const size_t rb = ggml_row_bytes(type, row).value();
  std::vector<uint8_t> out(rb * (v.size() / row));
  for (size_t r = 0; r < v.size() / row; ++r) quantize_row(type, &v[r * row], &out[r * rb], row);
  return out;
}

Tensor upload(CpuBackend& be, GgmlType type, std::vector<int64_t> shape, const void* data, size_t bytes) {
  Tensor t = be.alloc(type, shape).value();
  EXPECT_TRUE(be.upload(t, data, bytes).is_ok());
  return t;
}

std::vector<float> read(CpuBackend& be, const Tensor& t) {
  std::vector<float> v(t.n_elements());
  EXPECT_TRUE(be.download(t, v.data(), v.size() * sizeof(float)).is_ok());
  return v;
}

class ExpertParallel : public ::testing::TestWithParam<GgmlType> {};

TEST_P(ExpertParallel, EqualsTheSingleBackendLayerBitForBit) {
  const ModelConfig c = tiny_config();
  const GgmlType type = GetParam();
  std::mt19937_64 rng(test::test_seed());
  Stacks s{type, c.n_experts, c.expert_ffn, c.hidden, {}, {}, {}};
  s.gate = quantized(type, test::random_normal(s.e * s.inter * s.d, rng, 0.05f), s.d);
  s.up = quantized(type, test::random_normal(s.e * s.inter * s.d, rng, 0.05f), s.d);
  s.down = quantized(type, test::random_normal(s.e * s.d * s.inter, rng, 0.05f), s.inter);
  const int64_t n = 9, k = c.n_experts_used;
  const std::vector<float> x = test::random_normal(n * s.d, rng, 1.0f);
  const std::vector<float> y0 = test::random_normal(n * s.d, rng, 1.0f);  // what y held: overwritten
  const std::vector<float> logits = test::random_normal(n * s.e, rng, 1.0f), bias = test::random_normal(s.e, rng, 0.1f);
  const std::vector<int32_t> tokens(n, 0);

  // One backend with every expert: the reference.
  CpuBackend ref(1);
  const Tensor gate = upload(ref, type, {s.e, s.inter, s.d}, s.gate.data(), s.gate.size());
  const Tensor up = upload(ref, type, {s.e, s.inter, s.d}, s.up.data(), s.up.size());
  const Tensor down = upload(ref, type, {s.e, s.d, s.inter}, s.down.data(), s.down.size());
  const Tensor xt = upload(ref, GgmlType::F32, {n, s.d}, x.data(), x.size() * 4);
  Tensor experts = ref.alloc(GgmlType::I32, std::vector<int64_t>{n, k}).value();
  Tensor weights = ref.alloc(GgmlType::F32, std::vector<int64_t>{n, k}).value();
  const Tensor bias_t = upload(ref, GgmlType::F32, {s.e}, bias.data(), bias.size() * 4);
  ASSERT_TRUE(ref.route(upload(ref, GgmlType::F32, {n, s.e}, logits.data(), logits.size() * 4), &bias_t, nullptr,
                        upload(ref, GgmlType::I32, {n}, tokens.data(), tokens.size() * 4), static_cast<int>(k),
                        c.routed_scale, experts, weights).is_ok());
  std::vector<int32_t> ids(n * k);
  ASSERT_TRUE(ref.download(experts, ids.data(), ids.size() * 4).is_ok());
  const std::vector<float> w = read(ref, weights);
  Tensor yt = upload(ref, GgmlType::F32, {n, s.d}, y0.data(), y0.size() * 4);
  ref.begin_step();
  ASSERT_TRUE(ref.moe_experts(xt, gate, up, down, experts, weights, c.swiglu_limit[0],
                              backend::MatmulMode::Exact, yt).is_ok());
  const std::vector<float> want = read(ref, yt);

  // The reference itself against a double-precision sum over the dequantized weights.
  {
    std::vector<float> g(s.d), u(s.d), dn(s.inter);
    double worst = 0, scale = 0;
    for (int64_t t = 0; t < n; ++t) {
      std::vector<double> out(s.d, 0.0);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = ids[t * k + j];
        std::vector<double> h(s.inter);
        for (int64_t i = 0; i < s.inter; ++i) {
          const size_t rb = s.gate_expert_bytes() / s.inter;
          dequantize_row(type, &s.gate[e * s.gate_expert_bytes() + i * rb], g.data(), s.d);
          dequantize_row(type, &s.up[e * s.gate_expert_bytes() + i * rb], u.data(), s.d);
          double a = 0, b = 0;
          for (int64_t q = 0; q < s.d; ++q) {
            a += double(g[q]) * x[t * s.d + q];
            b += double(u[q]) * x[t * s.d + q];
          }
          const double lim = c.swiglu_limit[0];
          a = std::min(a, lim);
          b = std::clamp(b, -lim, lim);
          h[i] = a / (1 + std::exp(-a)) * b * w[t * k + j];
        }
        for (int64_t o = 0; o < s.d; ++o) {
          const size_t rb = s.down_expert_bytes() / s.d;
          dequantize_row(type, &s.down[e * s.down_expert_bytes() + o * rb], dn.data(), s.inter);
          double acc = 0;
          for (int64_t i = 0; i < s.inter; ++i) acc += double(dn[i]) * h[i];
          out[o] += acc;
        }
      }
      for (int64_t o = 0; o < s.d; ++o) {
        ASSERT_TRUE(std::isfinite(want[t * s.d + o]));
        worst = std::max(worst, std::fabs(want[t * s.d + o] - out[o]));
        scale = std::max(scale, std::fabs(out[o]));
      }
    }
    // Exact mode quantizes nothing but the weights; fp32 accumulation over 256 / 128 terms.
    EXPECT_LE(worst / scale, 1e-5) << "single-backend layer vs double (seed " << test::test_seed() << ")";
  }

  for (int n_ranks : {1, 2, 3}) {
    SCOPED_TRACE(testing::Message() << n_ranks << " ranks");
    backend::HostCollectiveGroup group(n_ranks);
    std::vector<std::unique_ptr<CpuBackend>> bes;
    std::vector<ExpertShard> shards;
    std::vector<Tensor> xs, es, ws, ys;
    for (int r = 0; r < n_ranks; ++r) {
      bes.push_back(std::make_unique<CpuBackend>(1));
      CpuBackend& be = *bes.back();
      const ExpertRange range = expert_range(c.n_experts, n_ranks, r);
      ExpertShard shard{c.n_experts, range.first, range.count, {}, {}, {}};
      // Only this rank's experts are on its backend.
      shard.gate = upload(be, type, {range.count, s.inter, s.d}, &s.gate[range.first * s.gate_expert_bytes()],
                          range.count * s.gate_expert_bytes());
      shard.up = upload(be, type, {range.count, s.inter, s.d}, &s.up[range.first * s.gate_expert_bytes()],
                        range.count * s.gate_expert_bytes());
      shard.down = upload(be, type, {range.count, s.d, s.inter}, &s.down[range.first * s.down_expert_bytes()],
                          range.count * s.down_expert_bytes());
      shards.push_back(shard);
      xs.push_back(upload(be, GgmlType::F32, {n, s.d}, x.data(), x.size() * 4));
      es.push_back(upload(be, GgmlType::I32, {n, k}, ids.data(), ids.size() * 4));
      ws.push_back(upload(be, GgmlType::F32, {n, k}, w.data(), w.size() * 4));
      ys.push_back(upload(be, GgmlType::F32, {n, s.d}, y0.data(), y0.size() * 4));
    }
    std::vector<Status> st(n_ranks, Status::ok());
    std::vector<std::thread> threads;
    for (int r = 0; r < n_ranks; ++r)
      threads.emplace_back([&, r] {
        bes[r]->begin_step();
        st[r] = expert_parallel_moe(*bes[r], group.rank(r), shards[r], xs[r], es[r], ws[r], c.swiglu_limit[0],
                                    backend::MatmulMode::Exact, ys[r]);
      });
    for (auto& t : threads) t.join();
    for (int r = 0; r < n_ranks; ++r) {
      ASSERT_TRUE(st[r].is_ok()) << st[r].message();
      const std::vector<float> got = read(*bes[r], ys[r]);
      ASSERT_EQ(got.size(), want.size());
      EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0) << "rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Types, ExpertParallel, ::testing::Values(GgmlType::F32, GgmlType::Q8_0),
                         [](const auto& info) { return std::string(ggml_type_name(info.param)); });

TEST(ExpertParallelErrors, AShardOutsideItsRangeIsRefused) {
  CpuBackend be(1);
  backend::HostCollectiveGroup group(2);
  ExpertShard shard{8, 0, 3, {}, {}, {}};  // rank 0 of 2 holds experts 0-3
  const std::vector<float> x(4, 1.0f);
  const std::vector<int32_t> ids = {0, 1};
  const Status s = expert_parallel_moe(be, group.rank(0), shard, upload(be, GgmlType::F32, {1, 4}, x.data(), 16),
                                       upload(be, GgmlType::I32, {1, 2}, ids.data(), 8),
                                       upload(be, GgmlType::F32, {1, 2}, x.data(), 8), 10.0f,
                                       backend::MatmulMode::Exact, upload(be, GgmlType::F32, {1, 4}, x.data(), 16));
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("rank 0 of 2 holds experts 0+3, expected 0+4 of 8"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace dsv4
