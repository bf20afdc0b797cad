// matvec (src/backend/cuda/matvec.h) against the CPU dequantisation (gguf/quant.h) on fresh
// random blocks, odd shapes, batched matrices at unaligned offsets, and poisoned outputs.
#include "backend/cuda/matvec.h"

#include <cmath>
#include <cstring>
#include <functional>

#include "cuda_test_util.h"
#include "support/test_support.h"

namespace dsv4::cuda::test {
namespace {

// Bounds (docs/CUDA.md): against the product with the Q8-rounded activations the only error
// is f32 accumulation; against the exact f32 activations the Q8 rounding (about 0.5%
// relative for normal data) dominates.
constexpr double kBoundRoundedActivations = 1e-4;
constexpr double kBoundExactActivations = 2e-2;
constexpr double kBoundBf16 = 1e-5;

struct Case {
  int64_t n, k, batch;
  int rows;
  int64_t stride_pad;  // extra bytes between batch matrices (unaligned starts)
};

void run_case(GgmlType type, const Case& c, std::mt19937_64& rng) {
  SCOPED_TRACE(type_name(type) + " n=" + std::to_string(c.n) + " k=" + std::to_string(c.k) +
               " batch=" + std::to_string(c.batch) + " rows=" + std::to_string(c.rows));
  const size_t rb = row_bytes(type, c.k);
  const size_t matrix_bytes = rb * c.n;
  const size_t stride = matrix_bytes + c.stride_pad;
  const std::vector<uint8_t> w = random_weight_batch(type, c.n, c.k, c.batch, stride, rng);
  const std::vector<float> x = dsv4::test::random_normal(static_cast<size_t>(c.batch * c.rows * c.k), rng);

  DeviceBuffer dw = DeviceBuffer::from(w), dx = DeviceBuffer::from(x);
  DeviceBuffer dy(static_cast<size_t>(c.batch * c.rows * c.n) * sizeof(float));
  MatvecWeights mw{type, dw.get(), c.n, c.k, c.batch, static_cast<int64_t>(stride)};
  DeviceBuffer ws(matvec_workspace_bytes(mw, c.rows));
  dy.poison();
  ASSERT_OK(matvec(mw, dx.get<float>(), c.rows, dy.get<float>(), ws.get(), ws.bytes(), nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const auto y = dy.to_host<float>(static_cast<size_t>(c.batch * c.rows * c.n));

  const bool integer = type != GgmlType::BF16;
  const std::vector<float> xr = integer ? q8_round_trip(x) : x;
  std::vector<double> want_rounded(y.size()), want_exact(y.size());
  for (int64_t b = 0; b < c.batch; ++b) {
    const auto deq = dequantize(type, &w[b * stride], c.n, c.k);
    for (int r = 0; r < c.rows; ++r) {
      const int64_t xrow = (b * c.rows + r) * c.k;
      for (int64_t i = 0; i < c.n; ++i) {
        double s_rounded = 0.0, s_exact = 0.0;
        for (int64_t j = 0; j < c.k; ++j) {
          s_rounded += static_cast<double>(deq[i * c.k + j]) * xr[xrow + j];
          s_exact += static_cast<double>(deq[i * c.k + j]) * x[xrow + j];
        }
        want_rounded[(b * c.rows + r) * c.n + i] = s_rounded;
        want_exact[(b * c.rows + r) * c.n + i] = s_exact;
      }
    }
  }
  const double e_rounded = relative_error(y, want_rounded);
  const double e_exact = relative_error(y, want_exact);
  EXPECT_LT(e_rounded, integer ? kBoundRoundedActivations : kBoundBf16);
  if (integer) {
    EXPECT_LT(e_exact, kBoundExactActivations);
  }
}

// Every case runs with the default kernels (the one-row kernel, the tensor-core kernels for 2+
// rows, the BF16 streaming kernel) and again with all of them switched back to the general
// kernels they replaced (KernelChoice), so both paths stay checked.
class MatvecTest : public ::testing::TestWithParam<GgmlType> {
 protected:
  void TearDown() override { set_kernel_choice(KernelChoice{}); }
  static void for_each_choice(const std::function<void()>& body) {
    for (const bool legacy : {false, true}) {
      SCOPED_TRACE(legacy ? "legacy kernels" : "default kernels");
      KernelChoice c;
      if (legacy) {
        c = KernelChoice{false, false, false, false, false};
        c.matvec_rows = false;
      }
      set_kernel_choice(c);
      body();
    }
    set_kernel_choice(KernelChoice{});
  }
};

TEST_P(MatvecTest, OddShapesRowsAndUnalignedBatches) {
  const GgmlType type = GetParam();
  std::mt19937_64 rng(dsv4::test::test_seed());
  SCOPED_TRACE("seed " + std::to_string(dsv4::test::test_seed()));
  const int64_t block = ggml_traits(type).block_elems;
  const int64_t k_odd = block == 256 ? 768 : 224;
  // One activation row (matvec_row_kernel.cuh where the alignment allows): blocks at both
  // 2-byte parities (stride_pad 2), a partial last step per lane (k = 3072: 96 Q8_0 units).
  // Stride pads of 2 keep Q2_K / Q4_K off the tensor-core path (4-byte blocks) and BF16 off
  // the streaming one (16-byte rows): their fallbacks run too.
  for_each_choice([&] {
    for (const Case& c : {Case{37, k_odd, 1, 1, 0}, Case{37, k_odd, 3, 3, 6}, Case{5, k_odd, 2, 16, 2},
                          Case{130, 2 * k_odd, 1, 7, 0}, Case{33, k_odd, 1, 9, 0}, Case{37, k_odd, 3, 1, 2},
                          Case{21, 3072, 2, 1, 4}, Case{33, k_odd, 2, 12, 16}, Case{19, 3072, 2, 1, 32},
                          Case{45, 3072, 1, 5, 0}, Case{29, 8192, 1, 8, 0}, Case{13, k_odd, 3, 4, 2}})
      run_case(type, c, rng);
  });
}

TEST_P(MatvecTest, V4FlashShape4096To1024) {
  const GgmlType type = GetParam();
  std::mt19937_64 rng(dsv4::test::test_seed() + 1);
  SCOPED_TRACE("seed " + std::to_string(dsv4::test::test_seed()));
  for_each_choice([&] {
    run_case(type, Case{1024, 4096, 1, 1, 0}, rng);
    run_case(type, Case{64, 8192, 1, 2, 0}, rng);
    run_case(type, Case{64, 8192, 1, 1, 0}, rng);
    run_case(type, Case{96, 8192, 1, 16, 0}, rng);
  });
}

// shared_x (one x for every matrix of the batch, the shared expert's gate and up): each
// matrix's outputs the bits of that matrix alone, the second matrix before the first in memory
// (a negative stride) or after it; in both kernel choices (the row kernel's one launch, or
// the per-matrix fallback), and with 2 rows (the fallback).
TEST_P(MatvecTest, SharedInputBatchIsEachMatrixAlone) {
  const GgmlType type = GetParam();
  std::mt19937_64 rng(dsv4::test::test_seed() + 3);
  SCOPED_TRACE("seed " + std::to_string(dsv4::test::test_seed()));
  const int64_t block = ggml_traits(type).block_elems;
  for_each_choice([&] {
    for (const int64_t k : {block == 256 ? int64_t{768} : int64_t{224}, int64_t{4096}}) {
      for (const int rows : {1, 2}) {
        for (const bool backwards : {false, true}) {
          SCOPED_TRACE("k " + std::to_string(k) + ", rows " + std::to_string(rows) + (backwards ? ", up first" : ""));
          const int64_t n = 96;
          const size_t rb = row_bytes(type, k), matrix = rb * n, gap = (matrix + 4095) / 4096 * 4096 + 256;
          std::vector<uint8_t> w(gap + matrix);
          const auto a = random_weights(type, n, k, rng), b = random_weights(type, n, k, rng);
          std::memcpy(&w[backwards ? gap : 0], a.data(), a.size());
          std::memcpy(&w[backwards ? 0 : gap], b.data(), b.size());
          const std::vector<float> x = dsv4::test::random_normal(static_cast<size_t>(rows * k), rng);
          DeviceBuffer dw = DeviceBuffer::from(w), dx = DeviceBuffer::from(x);
          const uint8_t* first = dw.get<uint8_t>() + (backwards ? gap : 0);
          const int64_t stride = backwards ? -static_cast<int64_t>(gap) : static_cast<int64_t>(gap);
          MatvecWeights both{type, first, n, k, 2, stride};
          both.shared_x = true;
          DeviceBuffer ws(matvec_workspace_bytes(both, rows));
          DeviceBuffer dy(static_cast<size_t>(2 * rows * n) * sizeof(float));
          dy.poison();
          ASSERT_OK(matvec(both, dx.get<float>(), rows, dy.get<float>(), ws.get(), ws.bytes(), nullptr));
          ASSERT_CUDA(cudaDeviceSynchronize());
          const auto together = dy.to_host<float>(static_cast<size_t>(2 * rows * n));
          for (int m = 0; m < 2; ++m) {
            const MatvecWeights one{type, first + m * stride, n, k, 1, 0};
            DeviceBuffer y1(static_cast<size_t>(rows * n) * sizeof(float));
            y1.poison();
            ASSERT_OK(matvec(one, dx.get<float>(), rows, y1.get<float>(), ws.get(), ws.bytes(), nullptr));
            ASSERT_CUDA(cudaDeviceSynchronize());
            const auto alone = y1.to_host<float>(static_cast<size_t>(rows * n));
            for (const float v : alone) ASSERT_TRUE(std::isfinite(v));
            EXPECT_EQ(0, std::memcmp(alone.data(), together.data() + m * rows * n, alone.size() * sizeof(float)))
                << "matrix " << m << " differs from the same product alone";
          }
        }
      }
    }
  });
}

// Batch-invariant mode (KernelChoice::batch_invariant): a row's outputs are the same bits
// whether it is multiplied alone, with a few rows or with 63 others (either kernel family), and
// they stay within the usual bounds of the reference (1, 17 and 64 rows, batched matrices).
TEST_P(MatvecTest, BatchInvariantRowsEqualAlone) {
  const GgmlType type = GetParam();
  std::mt19937_64 rng(dsv4::test::test_seed() + 2);
  SCOPED_TRACE("seed " + std::to_string(dsv4::test::test_seed()));
  const int64_t block = ggml_traits(type).block_elems;
  // Both kernel families: the tensor-core one where it applies, the dp4a one (matvec_mma off).
  for (const bool mma : {true, false}) {
    SCOPED_TRACE(mma ? "tensor-core kernels" : "dp4a kernels");
    KernelChoice invariant;
    invariant.batch_invariant = true;
    invariant.matvec_mma = mma;
    set_kernel_choice(invariant);
    for (const Case& c : {Case{37, block == 256 ? 768 : 224, 1, 1, 0}, Case{45, 1024, 1, 17, 0}, Case{29, 4096, 1, 64, 0},
                          Case{13, 512, 3, 20, 2}})
      run_case(type, c, rng);
    for (const int64_t k : {int64_t{1024}, int64_t{4096}}) {
      SCOPED_TRACE("k " + std::to_string(k));
      constexpr int64_t kN = 70;
      constexpr int kRows = 64;
      const auto w = random_weights(type, kN, k, rng);
      const std::vector<float> x = dsv4::test::random_normal(static_cast<size_t>(kRows * k), rng);
      DeviceBuffer dw = DeviceBuffer::from(w), dx = DeviceBuffer::from(x);
      const MatvecWeights mw{type, dw.get(), kN, k, 1, 0};
      DeviceBuffer ws(matvec_workspace_bytes(mw, kRows));
      DeviceBuffer dy(static_cast<size_t>(kRows * kN) * sizeof(float));
      const auto product = [&](int first, int rows) {
        dy.poison();
        const Status st = matvec(mw, dx.get<float>() + first * k, rows, dy.get<float>(), ws.get(), ws.bytes(), nullptr);
        EXPECT_TRUE(st.is_ok()) << st.message();
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        return dy.to_host<float>(static_cast<size_t>(rows * kN));
      };
      const std::vector<float> all = product(0, kRows);
      for (const float v : all) ASSERT_TRUE(std::isfinite(v));
      for (const int rows : {1, 2, 5, 16, 17, 33}) {
        for (const int first : {0, kRows - rows}) {
          const std::vector<float> part = product(first, rows);
          EXPECT_EQ(0, std::memcmp(part.data(), all.data() + first * kN, part.size() * sizeof(float)))
              << rows << " rows from row " << first << " differ from the same rows among " << kRows;
        }
      }
    }
  }
  set_kernel_choice(KernelChoice{});
}

// 2..kRowKernelMaxRows rows (KernelChoice::matvec_rows, the default): every row's outputs are
// the bits of the same product of that row alone, for one matrix (the block quantising its
// rows itself, or, for 8 rows of k = 8192, a launch of their own first), batched matrices each
// with their own rows, and one x for every matrix (shared_x); so an MTP verify row equals its
// decode step's product. Every type: the row kernels, the general kernel where one row takes
// it, BF16's streaming kernel.
TEST_P(MatvecTest, FewRowsAreEachRowAlone) {
  const GgmlType type = GetParam();
  std::mt19937_64 rng(dsv4::test::test_seed() + 4);
  SCOPED_TRACE("seed " + std::to_string(dsv4::test::test_seed()));
  set_kernel_choice(KernelChoice{});
  const int64_t block = ggml_traits(type).block_elems;
  constexpr int64_t kN = 45;
  for (const int64_t k : {block == 256 ? int64_t{768} : int64_t{224}, int64_t{1024}, int64_t{4096}, int64_t{8192}}) {
    const size_t matrix = (row_bytes(type, k) * kN + 15) / 16 * 16;  // each matrix 16-byte aligned, to run alone
    const std::vector<uint8_t> w = random_weight_batch(type, kN, k, 3, matrix, rng);
    DeviceBuffer dw = DeviceBuffer::from(w);
    for (const int rows : {2, 3, 5, kRowKernelMaxRows}) {
      for (const int64_t batch : {int64_t{1}, int64_t{3}}) {
        for (const bool shared : {false, true}) {
          if (shared && batch == 1) continue;
          SCOPED_TRACE("k " + std::to_string(k) + ", rows " + std::to_string(rows) + ", batch " +
                       std::to_string(batch) + (shared ? ", shared x" : ""));
          const int64_t x_rows = shared ? rows : batch * rows;
          const std::vector<float> x = dsv4::test::random_normal(static_cast<size_t>(x_rows * k), rng);
          DeviceBuffer dx = DeviceBuffer::from(x);
          MatvecWeights all{type, dw.get(), kN, k, batch, static_cast<int64_t>(matrix)};
          all.shared_x = shared;
          DeviceBuffer ws(std::max(matvec_workspace_bytes(all, rows), matvec_workspace_bytes(MatvecWeights{type, dw.get(), kN, k, 1, 0}, 1)));
          DeviceBuffer dy(static_cast<size_t>(batch * rows * kN) * sizeof(float));
          dy.poison();
          ASSERT_OK(matvec(all, dx.get<float>(), rows, dy.get<float>(), ws.get(), ws.bytes(), nullptr));
          ASSERT_CUDA(cudaDeviceSynchronize());
          const auto together = dy.to_host<float>(static_cast<size_t>(batch * rows * kN));
          for (const float v : together) ASSERT_TRUE(std::isfinite(v));
          DeviceBuffer y1(static_cast<size_t>(kN) * sizeof(float));
          for (int64_t b = 0; b < batch; ++b) {
            const MatvecWeights one{type, dw.get<uint8_t>() + b * matrix, kN, k, 1, 0};
            for (int r = 0; r < rows; ++r) {
              const int64_t x_row = shared ? r : b * rows + r;
              y1.poison();
              ASSERT_OK(matvec(one, dx.get<float>() + x_row * k, 1, y1.get<float>(), ws.get(), ws.bytes(), nullptr));
              ASSERT_CUDA(cudaDeviceSynchronize());
              const auto alone = y1.to_host<float>(static_cast<size_t>(kN));
              EXPECT_EQ(0, std::memcmp(alone.data(), together.data() + (b * rows + r) * kN, alone.size() * sizeof(float)))
                  << "matrix " << b << ", row " << r << " differs from the same row alone";
            }
          }
        }
      }
    }
  }
}

TEST(Matvec, RejectsBadArguments) {
  MatvecWeights w{GgmlType::Q2_K, nullptr, 8, 100, 1, 0};
  EXPECT_FALSE(matvec(w, nullptr, 1, nullptr, nullptr, 0, nullptr).is_ok());  // k not a multiple of 256
  w.k = 256;
  EXPECT_FALSE(matvec(w, nullptr, 17, nullptr, nullptr, 0, nullptr).is_ok());  // too many rows
  w.type = GgmlType::F16;
  EXPECT_FALSE(matvec(w, nullptr, 1, nullptr, nullptr, 0, nullptr).is_ok());  // unsupported type
}

INSTANTIATE_TEST_SUITE_P(Types, MatvecTest,
                         ::testing::Values(GgmlType::Q8_0, GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K,
                                           GgmlType::Q6_K, GgmlType::MXFP4, GgmlType::IQ2_XXS, GgmlType::BF16,
                                           // the types of published files (general kernel only)
                                           GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1,
                                           GgmlType::IQ4_NL, GgmlType::Q5_K, GgmlType::IQ4_XS, GgmlType::IQ2_XS,
                                           GgmlType::IQ2_S, GgmlType::IQ3_XXS, GgmlType::IQ3_S, GgmlType::IQ1_S,
                                           GgmlType::IQ1_M),
                         [](const auto& info) { return type_name(info.param); });

}  // namespace
}  // namespace dsv4::cuda::test
