// The int8 tensor-core products (src/backend/cuda/mmq.h) against a double-precision product
// of the CPU's dequantised weights (gguf/quant.h): fresh random blocks, odd row counts and
// depths, 1-64 activation rows, batches at unaligned offsets, k split across clusters, and
// outputs poisoned with NaN. A failure reports where the error sits (rows of one m16 tile,
// columns of one n8 tile, one k split) to point at the fragment or stage code at fault.
#include "backend/cuda/mmq.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "backend/cuda/matvec.h"
#include "cuda_test_util.h"
#include "support/test_support.h"

namespace dsv4::cuda::test {
namespace {

// Against the product with the Q8-rounded activations only f32 accumulation of the exact
// int32 chunk products differs; against the exact activations the Q8 rounding dominates.
constexpr double kBoundRounded = 1e-4;
constexpr double kBoundExact = 2e-2;

struct Case {
  int64_t n, k, batch;
  int rows;
  int64_t stride_pad;  // extra bytes between batch matrices (a multiple of the type's alignment)
};

int alignment(GgmlType t) {
  switch (t) {
    case GgmlType::Q2_K:
    case GgmlType::Q4_K:
    case GgmlType::Q4_1:
    case GgmlType::Q5_1:
    case GgmlType::Q5_K:
    case GgmlType::IQ4_XS:
    case GgmlType::IQ1_M: return 4;
    case GgmlType::MXFP4: return 1;
    default: return 2;
  }
}

// Rows (weight rows) and columns (activation rows) whose error is far above the rest, to tell
// a fragment row or column mapping error from a scale error that touches everything.
std::string locate(const std::vector<float>& y, const std::vector<double>& want, int64_t n, int64_t cols) {
  std::vector<double> row_err(static_cast<size_t>(n), 0.0), row_ref(static_cast<size_t>(n), 0.0);
  std::vector<double> col_err(static_cast<size_t>(cols), 0.0), col_ref(static_cast<size_t>(cols), 0.0);
  int64_t nonfinite = 0, first_nonfinite = -1;
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t i = 0; i < n; ++i) {
      const size_t at = static_cast<size_t>(c * n + i);
      if (!std::isfinite(y[at])) {
        if (first_nonfinite < 0) first_nonfinite = static_cast<int64_t>(at);
        ++nonfinite;
        continue;
      }
      const double e = (y[at] - want[at]) * (y[at] - want[at]), r = want[at] * want[at];
      row_err[i] += e;
      row_ref[i] += r;
      col_err[c] += e;
      col_ref[c] += r;
    }
  std::ostringstream s;
  s << "non-finite outputs: " << nonfinite;
  if (first_nonfinite >= 0) s << " (first: column " << first_nonfinite / n << ", row " << first_nonfinite % n << ")";
  auto worst = [&s](const std::vector<double>& err, const std::vector<double>& ref, const char* what) {
    s << "; worst " << what << ":";
    std::vector<std::pair<double, int64_t>> v;
    for (size_t i = 0; i < err.size(); ++i) v.push_back({ref[i] > 0 ? std::sqrt(err[i] / ref[i]) : 0.0, i});
    std::sort(v.rbegin(), v.rend());
    for (size_t i = 0; i < std::min<size_t>(6, v.size()); ++i) s << " " << v[i].second << " (" << v[i].first << ")";
  };
  worst(row_err, row_ref, "weight rows (mod 16 = fragment row)");
  worst(col_err, col_ref, "activation rows (mod 8 = fragment column)");
  return s.str();
}

void run_case(GgmlType type, const Case& c, std::mt19937_64& rng, bool through_matvec) {
  SCOPED_TRACE(type_name(type) + " n=" + std::to_string(c.n) + " k=" + std::to_string(c.k) +
               " batch=" + std::to_string(c.batch) + " rows=" + std::to_string(c.rows) +
               " pad=" + std::to_string(c.stride_pad) + (through_matvec ? " (matvec)" : " (mma_matmul)"));
  const size_t stride = row_bytes(type, c.k) * c.n + c.stride_pad;
  const std::vector<uint8_t> w = random_weight_batch(type, c.n, c.k, c.batch, stride, rng);
  const std::vector<float> x = dsv4::test::random_normal(static_cast<size_t>(c.batch * c.rows * c.k), rng);
  DeviceBuffer dw = DeviceBuffer::from(w), dx = DeviceBuffer::from(x);
  const int64_t outputs = c.batch * c.rows * c.n;
  DeviceBuffer dy(static_cast<size_t>(outputs) * sizeof(float));
  const MatvecWeights mw{type, dw.get(), c.n, c.k, c.batch, static_cast<int64_t>(stride)};
  ASSERT_TRUE(mma_matmul_applies(mw, c.rows));
  DeviceBuffer ws(through_matvec ? matvec_workspace_bytes(mw, c.rows) : mma_matmul_workspace_bytes(mw, c.rows));
  ws.poison();
  dy.poison();
  if (through_matvec) {
    ASSERT_OK(matvec(mw, dx.get<float>(), c.rows, dy.get<float>(), ws.get(), ws.bytes(), nullptr));
  } else {
    ASSERT_OK(mma_matmul(mw, dx.get<float>(), c.rows, dy.get<float>(), ws.get(), ws.bytes(), nullptr));
  }
  ASSERT_CUDA(cudaDeviceSynchronize());
  const auto y = dy.to_host<float>(static_cast<size_t>(outputs));

  const std::vector<float> xr = q8_round_trip(x);
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
  EXPECT_LT(e_rounded, kBoundRounded) << locate(y, want_rounded, c.n, c.batch * c.rows);
  EXPECT_LT(relative_error(y, want_exact), kBoundExact);
}

class MmqTest : public ::testing::TestWithParam<GgmlType> {};

TEST_P(MmqTest, OddShapesAllColumnTiles) {
  const GgmlType type = GetParam();
  std::mt19937_64 rng(dsv4::test::test_seed());
  SCOPED_TRACE("seed " + std::to_string(dsv4::test::test_seed()));
  const int64_t block = ggml_traits(type).block_elems;
  const int64_t k_odd = block == 256 ? 768 : 224;  // 224: a partial last stage of 7 blocks
  const int64_t pad = alignment(type);
  // 1 to 64 rows (column tiles 1, 2, 4 (24 rows), 8 and partial ones), rows past n (37, 130),
  // batches whose matrices start off 16-byte boundaries.
  for (const Case& c : {Case{37, k_odd, 1, 1, 0}, Case{37, k_odd, 1, 2, 0}, Case{130, k_odd, 2, 9, pad},
                        Case{64, 2 * k_odd, 1, 16, 0}, Case{70, k_odd, 1, 24, 0}, Case{70, k_odd, 1, 33, 0},
                        Case{5, k_odd, 3, 64, 3 * pad},
                        Case{129, 3 * k_odd, 1, 5, 0}})
    run_case(type, c, rng, false);
}

TEST_P(MmqTest, KSplitAcrossClusters) {
  // Few row tiles: the host splits k over clusters of up to 8 blocks whose rank 0 adds the
  // others' partial tiles.
  const GgmlType type = GetParam();
  std::mt19937_64 rng(dsv4::test::test_seed() + 1);
  SCOPED_TRACE("seed " + std::to_string(dsv4::test::test_seed()));
  run_case(type, Case{100, 8192, 1, 16, 0}, rng, false);
  run_case(type, Case{64, 2048, 2, 3, 0}, rng, false);
  run_case(type, Case{200, 4096 + 256, 1, 40, 0}, rng, false);  // 17 stages: a short last rank
}

TEST_P(MmqTest, ThroughMatvec) {
  const GgmlType type = GetParam();
  std::mt19937_64 rng(dsv4::test::test_seed() + 2);
  SCOPED_TRACE("seed " + std::to_string(dsv4::test::test_seed()));
  const int64_t k = ggml_traits(type).block_elems == 256 ? 1024 : 992;
  run_case(type, Case{96, k, 2, 4, 0}, rng, true);
  run_case(type, Case{40, k, 1, 48, 0}, rng, true);  // beyond the dp4a kernels' 16 rows
}

TEST_P(MmqTest, BulkCopiesGiveTheCopyPathsBits) {
  // Whole stages (k a multiple of 256) of Q8_0 and Q6_K with up to 16 rows fill by bulk copies
  // (MmqArgs::bulk) in a ring of 2 stages; the same product in a ring of 3
  // (KernelChoice::mmq_bulk_ring2 off) and through 16-byte cp.async (KernelChoice::mmq_bulk off)
  // must give the same bits: only how the bytes reach shared memory differs. Matrices start off
  // 16-byte boundaries (pad), so the bulk copies run from below a row's span to past its end;
  // k split over clusters (8192).
  const GgmlType type = GetParam();
  if (type != GgmlType::Q8_0 && type != GgmlType::Q6_K) GTEST_SKIP() << "no bulk copies for this type";
  std::mt19937_64 rng(dsv4::test::test_seed() + 3);
  SCOPED_TRACE("seed " + std::to_string(dsv4::test::test_seed()));
  for (const Case& c : {Case{100, 1024, 3, 16, alignment(type)}, Case{70, 8192, 1, 12, 0}, Case{33, 512, 2, 5, 0}}) {
    SCOPED_TRACE(type_name(type) + " n=" + std::to_string(c.n) + " k=" + std::to_string(c.k) +
                 " rows=" + std::to_string(c.rows));
    const size_t stride = row_bytes(type, c.k) * c.n + c.stride_pad;
    const std::vector<uint8_t> w = random_weight_batch(type, c.n, c.k, c.batch, stride, rng);
    const std::vector<float> x = dsv4::test::random_normal(static_cast<size_t>(c.batch * c.rows * c.k), rng);
    DeviceBuffer dw = DeviceBuffer::from(w), dx = DeviceBuffer::from(x);
    const MatvecWeights mw{type, dw.get(), c.n, c.k, c.batch, static_cast<int64_t>(stride)};
    ASSERT_TRUE(mma_matmul_applies(mw, c.rows));
    const size_t outputs = static_cast<size_t>(c.batch * c.rows * c.n);
    std::vector<float> y[3];
    for (int path = 0; path < 3; ++path) {  // bulk in a ring of 2, bulk in a ring of 3, cp.async
      KernelChoice choice;
      choice.mmq_bulk = path < 2;
      choice.mmq_bulk_ring2 = path == 0;
      set_kernel_choice(choice);
      DeviceBuffer ws(mma_matmul_workspace_bytes(mw, c.rows)), dy(outputs * sizeof(float));
      ws.poison();
      dy.poison();
      const Status st = mma_matmul(mw, dx.get<float>(), c.rows, dy.get<float>(), ws.get(), ws.bytes(), nullptr);
      set_kernel_choice(KernelChoice{});
      ASSERT_OK(st);
      ASSERT_CUDA(cudaDeviceSynchronize());
      y[path] = dy.to_host<float>(outputs);
    }
    for (size_t i = 0; i < outputs; ++i) ASSERT_TRUE(std::isfinite(y[0][i])) << "output " << i;
    EXPECT_EQ(std::memcmp(y[0].data(), y[1].data(), outputs * sizeof(float)), 0) << "ring of 2 against ring of 3";
    EXPECT_EQ(std::memcmp(y[0].data(), y[2].data(), outputs * sizeof(float)), 0) << "bulk against cp.async";
  }
}

TEST(Mmq, RejectsWhatItCannotTake) {
  std::vector<uint8_t> bytes(4096);
  DeviceBuffer dw = DeviceBuffer::from(bytes);
  MatvecWeights w{GgmlType::Q2_K, dw.get(), 8, 256, 2, 86};  // stride 86: Q2_K blocks need 4-byte alignment
  EXPECT_FALSE(mma_matmul_applies(w, 4));
  EXPECT_FALSE(mma_matmul(w, nullptr, 4, nullptr, nullptr, 0, nullptr).is_ok());
  EXPECT_FALSE(matvec(w, nullptr, 20, nullptr, nullptr, 0, nullptr).is_ok());  // > 16 rows and no tensor-core path
  w.batch_stride_bytes = 0;
  EXPECT_TRUE(mma_matmul_applies(w, 64));
  EXPECT_FALSE(mma_matmul_applies(w, 65));
  w.type = GgmlType::IQ2_XXS;
  EXPECT_FALSE(mma_matmul_applies(w, 4));
}

INSTANTIATE_TEST_SUITE_P(Types, MmqTest,
                         ::testing::Values(GgmlType::Q8_0, GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K,
                                           GgmlType::Q6_K, GgmlType::MXFP4, GgmlType::Q4_0, GgmlType::Q4_1,
                                           GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::IQ4_NL, GgmlType::Q5_K,
                                           GgmlType::IQ4_XS, GgmlType::IQ3_XXS, GgmlType::IQ3_S, GgmlType::IQ1_S,
                                           GgmlType::IQ2_XS, GgmlType::IQ2_S, GgmlType::IQ1_M),
                         [](const auto& info) { return type_name(info.param); });

}  // namespace
}  // namespace dsv4::cuda::test
