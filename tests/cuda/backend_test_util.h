// Helpers for checking the CUDA backend against the CPU backend: one CudaBackend (scratch
// poisoned with NaN) and one CpuBackend per test suite, tensors with the same contents on
// both, downloads of strided views, and comparisons that name the op, shape, seed and the
// worst element.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "gguf/gguf_file.h"
#include "support/test_support.h"

namespace dsv4::cuda::test {

using backend::Backend;
using backend::Tensor;

// A fixed seed per check (CI-style determinism); DSV4_TEST_SEED mixes in another to explore.
inline uint64_t seed_for(uint64_t fixed) {
  return std::getenv("DSV4_TEST_SEED") ? dsv4::test::test_seed() ^ fixed : fixed;
}

inline std::vector<int64_t> dims(std::initializer_list<int64_t> d) { return std::vector<int64_t>(d); }

// The same tensor on both backends.
struct Both {
  Tensor cpu, gpu;
  Both columns(int64_t begin, int64_t count) const { return {cpu.columns(begin, count), gpu.columns(begin, count)}; }
  Both slice(int64_t begin, int64_t count) const { return {cpu.slice(begin, count), gpu.slice(begin, count)}; }
  Both view(int64_t offset, int64_t rows, int64_t cols, int64_t stride) const {
    return {cpu.view(offset, rows, cols, stride), gpu.view(offset, rows, cols, stride)};
  }
};

// Contents of any tensor (strided views through a contiguous copy), as raw elements.
template <class T>
std::vector<T> fetch(Backend& be, const Tensor& t) {
  Tensor src = t;
  if (!t.contiguous()) {
    auto c = be.alloc(t.type, dims({t.rows(), t.cols()}));
    EXPECT_TRUE(c.is_ok()) << c.status().message();
    if (!c.is_ok()) return {};
    const Status s = be.copy_rows(t, *c);
    EXPECT_TRUE(s.is_ok()) << s.message();
    src = *c;
  }
  std::vector<T> out(static_cast<size_t>(t.n_elements()));
  const Status s = be.download(src, out.data(), out.size() * sizeof(T));
  EXPECT_TRUE(s.is_ok()) << s.message();
  return out;
}

class BackendPair : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    setenv("DSV4_POISON_SCRATCH", "1", 1);  // as CI runs the CPU tests: unread scratch is NaN
    auto b = backend::CudaBackend::create({});
    ASSERT_TRUE(b.is_ok()) << b.status().message();
    gpu_ = std::move(b).value();
    cpu_ = std::make_unique<backend::CpuBackend>(0);
  }
  static void TearDownTestSuite() {
    gpu_.reset();
    cpu_.reset();
  }
  void SetUp() override { ASSERT_TRUE(gpu_) << "no CUDA backend"; }
  void TearDown() override {
    gpu_->begin_step();
    cpu_->begin_step();
    host_.clear();
  }

  // F32/I32 tensor with these values on both backends.
  Both f32(std::vector<int64_t> shape, const std::vector<float>& v) { return make(GgmlType::F32, shape, v.data(), v.size() * 4); }
  Both i32(std::vector<int64_t> shape, const std::vector<int32_t>& v) {
    return make(GgmlType::I32, shape, v.data(), v.size() * 4);
  }
  Both make(GgmlType type, const std::vector<int64_t>& shape, const void* data, size_t bytes) {
    Both b;
    auto c = cpu_->alloc(type, shape);
    auto g = gpu_->alloc(type, shape);
    EXPECT_TRUE(c.is_ok() && g.is_ok());
    if (!c.is_ok() || !g.is_ok()) return b;
    b.cpu = *c;
    b.gpu = *g;
    EXPECT_TRUE(cpu_->upload(b.cpu, data, bytes).is_ok());
    const Status s = gpu_->upload(b.gpu, data, bytes);
    EXPECT_TRUE(s.is_ok()) << s.message();
    return b;
  }
  // A weight through Backend::weight (the CPU's views the host bytes, kept until TearDown).
  Both weight(GgmlType type, std::vector<int64_t> shape, std::vector<uint8_t> bytes) {
    host_.push_back(std::make_unique<std::vector<uint8_t>>(std::move(bytes)));
    gguf::TensorInfo info;
    info.name = "test.weight";
    info.type = type;
    info.ne.assign(shape.rbegin(), shape.rend());
    info.data = host_.back()->data();
    info.nbytes = host_.back()->size();
    Both b;
    auto c = cpu_->weight(info);
    auto g = gpu_->weight(info);
    EXPECT_TRUE(c.is_ok()) << c.status().message();
    EXPECT_TRUE(g.is_ok()) << g.status().message();
    if (c.is_ok()) b.cpu = *c;
    if (g.is_ok()) b.gpu = *g;
    return b;
  }
  // Fills an F32 tensor (any view) with NaN on both backends: outputs start poisoned.
  void poison(const Both& t) {
    ASSERT_TRUE(cpu_->fill(t.cpu, NAN).is_ok());
    ASSERT_TRUE(gpu_->fill(t.gpu, NAN).is_ok());
  }

  static std::unique_ptr<backend::CudaBackend> gpu_;
  static std::unique_ptr<backend::CpuBackend> cpu_;
  std::vector<std::unique_ptr<std::vector<uint8_t>>> host_;
};

inline std::unique_ptr<backend::CudaBackend> BackendPair::gpu_;
inline std::unique_ptr<backend::CpuBackend> BackendPair::cpu_;

// ||got_r - want_r|| / ||want_r|| for each row r (infinite when got_r has a non-finite value
// or differs where want_r is all zero).
inline std::vector<double> row_errors(const std::vector<float>& got, const std::vector<float>& want, int64_t rows,
                                      int64_t cols) {
  std::vector<double> e(static_cast<size_t>(rows), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    double num = 0, den = 0;
    bool finite = true;
    for (int64_t i = 0; i < cols; ++i) {
      const double g = got[r * cols + i], w = want[r * cols + i];
      finite = finite && std::isfinite(g) && std::isfinite(w);
      num += (g - w) * (g - w);
      den += w * w;
    }
    e[r] = !finite ? INFINITY : den > 0 ? std::sqrt(num / den) : (num > 0 ? INFINITY : 0.0);
  }
  return e;
}

// Every row within `bound`; a failure names what, the worst row, its error and the seed.
inline void expect_rows_close(const std::vector<float>& got, const std::vector<float>& want, int64_t rows, int64_t cols,
                              double bound, const std::string& what) {
  ASSERT_EQ(got.size(), static_cast<size_t>(rows * cols)) << what;
  ASSERT_EQ(want.size(), got.size()) << what;
  const auto e = row_errors(got, want, rows, cols);
  int64_t worst = 0;
  for (int64_t r = 1; r < rows; ++r)
    if (!(e[r] <= e[worst])) worst = r;
  EXPECT_LE(e[worst], bound) << what << ": row " << worst << " of " << rows << " x " << cols
                             << " has relative L2 error " << e[worst] << " (bound " << bound << "); first value gpu "
                             << got[worst * cols] << " cpu " << want[worst * cols];
}

// Bit for bit (NaN matches NaN of any payload).
inline void expect_identical(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool same = (std::isnan(got[i]) && std::isnan(want[i])) || std::memcmp(&got[i], &want[i], 4) == 0;
    if (!same && bad++ == 0) first = static_cast<int64_t>(i);
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " elements differ; first at " << first
                    << ": gpu " << (first >= 0 ? got[first] : 0.0f) << " cpu " << (first >= 0 ? want[first] : 0.0f);
}

}  // namespace dsv4::cuda::test
