// The tiny-v4 fixture for the forward-pass tests: DeepSeek's reference outputs
// (reference.safetensors), the checkpoint converted once per test process with
// `dsv4 convert --recipe f32` (lossless), and per-row comparisons
// (shared/fixtures/tiny-v4/README.md: cases and tolerances).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "convert/safetensors.h"
#include "support/test_support.h"

namespace dsv4::test {

class FixtureReference {
 public:
  // The reference file, opened once per process.
  static const FixtureReference& get() {
    static const FixtureReference ref;
    return ref;
  }

  const convert::SafetensorsFile& file() const { return *file_; }
  const convert::StTensor& tensor(const std::string& name) const {
    const convert::StTensor* t = file_ ? file_->find(name) : nullptr;
    EXPECT_NE(t, nullptr) << name;
    return t ? *t : missing_;
  }
  std::vector<float> f32(const std::string& name) const {
    const convert::StTensor& t = tensor(name);
    EXPECT_EQ(t.dtype, convert::StDtype::F32) << name;
    std::vector<float> v(t.dtype == convert::StDtype::F32 ? t.n_elements() : 0);
    if (!v.empty()) std::memcpy(v.data(), t.data, t.nbytes);
    return v;
  }
  std::vector<int32_t> i32(const std::string& name) const {
    const convert::StTensor& t = tensor(name);
    EXPECT_EQ(t.dtype, convert::StDtype::I32) << name;
    std::vector<int32_t> v(t.dtype == convert::StDtype::I32 ? t.n_elements() : 0);
    if (!v.empty()) std::memcpy(v.data(), t.data, t.nbytes);
    return v;
  }

 private:
  FixtureReference() {
    auto st = convert::SafetensorsFile::open(fixture_dir() / "reference.safetensors");
    EXPECT_TRUE(st.is_ok()) << st.status().message();
    if (st.is_ok()) file_ = std::make_unique<convert::SafetensorsFile>(std::move(st).value());
  }
  std::unique_ptr<convert::SafetensorsFile> file_;
  convert::StTensor missing_;
};

// The fixture checkpoint as an f32 GGUF, converted on first use; empty on failure.
inline const std::string& fixture_gguf_f32() {
  static const TempDir dir;
  static const std::string path = [] {
    const std::string out = (dir / "tiny-f32.gguf").string();
    const auto r = run_command(cli_path().string() + " convert " + (fixture_dir() / "checkpoint").string() +
                               " -o " + out + " --recipe f32 --threads 2");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return r.exit_code == 0 ? out : std::string();
  }();
  return path;
}

// Per-row relative L2 errors ||a - b|| / ||b|| of two [rows, cols] arrays, with the rows
// whose largest entries are at the same place (argmax) and whether `got` is all finite.
struct RowErrors {
  std::vector<double> rel;
  int argmax_same = 0;
  bool finite = true;
  double median() const {
    std::vector<double> s = rel;
    std::sort(s.begin(), s.end());
    return s.empty() ? NAN : s[s.size() / 2];
  }
  double max() const { return rel.empty() ? NAN : *std::max_element(rel.begin(), rel.end()); }
};

// Compares the first `cols` of each row (`got_stride`, `want_stride` values apart).
inline RowErrors compare_rows(const std::vector<float>& got, const std::vector<float>& want, int64_t cols,
                              int64_t got_stride = 0, int64_t want_stride = 0) {
  if (!got_stride) got_stride = cols;
  if (!want_stride) want_stride = cols;
  const int64_t rows = static_cast<int64_t>(want.size()) / want_stride;
  EXPECT_EQ(static_cast<int64_t>(got.size()), rows * got_stride);
  RowErrors e;
  for (int64_t r = 0; r < rows && (r + 1) * got_stride <= static_cast<int64_t>(got.size()); ++r) {
    const float* a = &got[r * got_stride];
    const float* b = &want[r * want_stride];
    double diff = 0, norm = 0;
    for (int64_t i = 0; i < cols; ++i) {
      if (!std::isfinite(a[i])) e.finite = false;
      diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
      norm += double(b[i]) * b[i];
    }
    e.rel.push_back(norm > 0 ? std::sqrt(diff / norm) : (diff == 0 ? 0.0 : INFINITY));
    e.argmax_same += std::max_element(a, a + cols) - a == std::max_element(b, b + cols) - b;
  }
  return e;
}

}  // namespace dsv4::test
