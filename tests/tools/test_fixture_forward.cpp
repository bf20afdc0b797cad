// The forward pass against DeepSeek's official reference on the tiny-v4 fixture
// (shared/fixtures/tiny-v4/README.md: cases and tolerances). The fixture checkpoint is
// converted with `dsv4 convert --recipe f32` (lossless), loaded on the CPU backend in
// the fp32 reference mode, and compared per row by relative L2 error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "model/model.h"
#include "tools/fixture_reference.h"

namespace dsv4 {
namespace {

using test::compare_rows;
using test::RowErrors;

// README "QAT off (strict)": every row within 1e-4 and the same argmax.
void expect_strict(const RowErrors& e, const char* what) {
  ASSERT_TRUE(e.finite) << what;
  EXPECT_LE(e.max(), 1e-4) << what << ": median " << e.median();
  EXPECT_EQ(e.argmax_same, static_cast<int>(e.rel.size())) << what;
  std::printf("[ measured ] %s: median %.3g max %.3g argmax %d/%zu\n", what, e.median(), e.max(),
              e.argmax_same, e.rel.size());
}

// README "QAT on (statistical)": median <= 2e-2, argmax >= 90 %, no NaN/inf.
void expect_statistical(const RowErrors& e, const char* what) {
  ASSERT_TRUE(e.finite) << what;
  EXPECT_LE(e.median(), 2e-2) << what;
  EXPECT_GE(e.argmax_same, static_cast<int>(std::ceil(0.9 * e.rel.size()))) << what;
  std::printf("[ measured ] %s: median %.3g max %.3g argmax %d/%zu\n", what, e.median(), e.max(),
              e.argmax_same, e.rel.size());
}

class FixtureForward : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { cpu_ = std::make_unique<backend::CpuBackend>(2); }
  static void TearDownTestSuite() { cpu_.reset(); }

  std::unique_ptr<Model> load(bool qat) {
    ModelOptions o;
    o.qat = qat;
    auto m = Model::load(test::fixture_gguf_f32(), *cpu_, o);
    EXPECT_TRUE(m.is_ok()) << m.status().message();
    return m.is_ok() ? std::move(m).value() : nullptr;
  }
  static std::unique_ptr<Sequence> sequence(const Model& m, bool mtp = false) {
    SequenceOptions so;
    so.max_context = 256;
    so.with_mtp = mtp;
    auto s = m.new_sequence(so);
    EXPECT_TRUE(s.is_ok()) << s.status().message();
    return std::move(s).value();
  }
  // Logits of every token, fed in chunks of `chunk` (0: one call).
  static std::vector<float> prefill_all(const Model& m, Sequence& seq, const std::vector<int32_t>& tokens,
                                        size_t chunk = 0) {
    std::vector<float> logits;
    if (chunk == 0) chunk = tokens.size();
    for (size_t at = 0; at < tokens.size(); at += chunk) {
      const size_t len = std::min(chunk, tokens.size() - at);
      auto r = m.prefill(seq, std::span<const int32_t>(tokens.data() + at, len), true);
      EXPECT_TRUE(r.is_ok()) << r.status().message();
      logits.insert(logits.end(), r->begin(), r->end());
    }
    return logits;
  }
  // Prefill 40 tokens of decode_tokens, then feed the rest one at a time (teacher forced).
  static std::vector<float> decode_rows(const Model& m, const std::vector<int32_t>& tokens,
                                        size_t prefill, size_t steps) {
    auto seq = sequence(m);
    auto first = m.prefill(*seq, std::span<const int32_t>(tokens.data(), prefill));
    EXPECT_TRUE(first.is_ok()) << first.status().message();
    std::vector<float> rows = *first;
    for (size_t j = 0; j < steps; ++j) {
      auto r = m.decode(*seq, tokens[prefill + j]);
      EXPECT_TRUE(r.is_ok()) << r.status().message();
      rows.insert(rows.end(), r->begin(), r->end());
    }
    return rows;
  }
  std::vector<float> mtp_rows(const Model& m, const std::vector<int32_t>& tokens) {
    auto seq = sequence(m, true);
    BatchItem item{seq.get(), tokens, true, true};
    ForwardOutput out;
    EXPECT_TRUE(m.forward(std::span<const BatchItem>(&item, 1), out).is_ok());
    const size_t width = out.streams.size() / tokens.size();
    MtpItem mi{seq.get(), std::span<const float>(out.streams.data(), (tokens.size() - 1) * width),
               std::span<const int32_t>(tokens.data() + 1, tokens.size() - 1)};
    auto r = m.mtp(std::span<const MtpItem>(&mi, 1));
    EXPECT_TRUE(r.is_ok()) << r.status().message();
    return r.is_ok() ? *r : std::vector<float>{};
  }

  const test::FixtureReference& ref_ = test::FixtureReference::get();
  static std::unique_ptr<backend::CpuBackend> cpu_;
  static constexpr int64_t kVocab = 512;
};

std::unique_ptr<backend::CpuBackend> FixtureForward::cpu_;

TEST_F(FixtureForward, PrefillLogitsQatOff) {
  auto m = load(false);
  ASSERT_TRUE(m);
  auto seq = sequence(*m);
  expect_strict(compare_rows(prefill_all(*m, *seq, ref_.i32("tokens")), ref_.f32("logits_noqat"), kVocab),
                "logits_noqat");
}

TEST_F(FixtureForward, PrefillLogitsQatOn) {
  auto m = load(true);
  ASSERT_TRUE(m);
  auto seq = sequence(*m);
  expect_statistical(compare_rows(prefill_all(*m, *seq, ref_.i32("tokens")), ref_.f32("logits_qat"), kVocab),
                     "logits_qat");
}

TEST_F(FixtureForward, DecodeTeacherForced) {
  const auto tokens = ref_.i32("decode_tokens");
  auto off = load(false);
  ASSERT_TRUE(off);
  expect_strict(compare_rows(decode_rows(*off, tokens, 40, 32), ref_.f32("decode_logits_noqat"), kVocab),
                "decode_logits_noqat");
  auto on = load(true);
  ASSERT_TRUE(on);
  expect_statistical(compare_rows(decode_rows(*on, tokens, 40, 32), ref_.f32("decode_logits_qat"), kVocab),
                     "decode_logits_qat");
}

// Issue 4: the 40-token prefill and 32 greedy decode steps with QAT on reproduce
// decode_tokens[40:72] exactly. The README (item 5) only promises the first 8: step 7
// (logits at position 47) has a top-2 gap of 0.0042, the next smallest is 0.033 (step 21),
// the rest exceed 0.08. A failure from step 7 on, with the teacher-forced logits still
// within tolerance, is most likely that near-tie flipping under a change of fp32 rounding
// order, not a wrong forward pass; the printed gap says how close the step was.
TEST_F(FixtureForward, GreedyDecodeQat) {
  const auto want = ref_.i32("decode_tokens");
  auto m = load(true);
  ASSERT_TRUE(m);
  auto seq = sequence(*m);
  auto logits = m->prefill(*seq, std::span<const int32_t>(want.data(), 40));
  ASSERT_TRUE(logits.is_ok());
  int same = 0;
  for (int j = 0; j < 32; ++j) {
    std::vector<float> sorted = *logits;
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
    const int32_t next = static_cast<int32_t>(std::max_element(logits->begin(), logits->end()) - logits->begin());
    ASSERT_EQ(next, want[40 + j]) << "greedy step " << j << " (top-2 gap " << sorted[0] - sorted[1] << ")";
    ++same;
    logits = m->decode(*seq, next);
    ASSERT_TRUE(logits.is_ok()) << logits.status().message();
  }
  std::printf("[ measured ] greedy QAT decode: %d of 32 tokens equal decode_tokens\n", same);
}

TEST_F(FixtureForward, ShortPrefillThenDecodeQat) {
  const auto tokens = ref_.i32("tokens");
  auto m = load(true);
  ASSERT_TRUE(m);
  expect_statistical(compare_rows(decode_rows(*m, tokens, 3, 69), ref_.f32("short_decode_logits_qat"), kVocab),
                     "short_decode_logits_qat");
}

TEST_F(FixtureForward, MtpDraftLogits) {
  const auto tokens = ref_.i32("tokens");
  auto off = load(false);
  ASSERT_TRUE(off);
  expect_strict(compare_rows(mtp_rows(*off, tokens), ref_.f32("mtp_logits_noqat"), kVocab), "mtp_logits_noqat");
  auto on = load(true);
  ASSERT_TRUE(on);
  expect_statistical(compare_rows(mtp_rows(*on, tokens), ref_.f32("mtp_logits_qat"), kVocab), "mtp_logits_qat");
}

// README item 2: the QAT rules reproduce the fixture's rounded values exactly.
TEST_F(FixtureForward, QatRulesExact) {
  struct Case {
    const char* in;
    const char* out;
    int64_t in_cols, out_cols, cols;
    bool fp4;
  };
  const Case cases[] = {
      {"noqat.layers.0.kv", "qat.layers.0.kv", 256, 256, 192, false},
      {"qat.layers.1.compressed_kv_prequant_nope", "qat.layers.1.compressed_kv", 192, 256, 192, false},
      {"qat.layers.2.compressed_kv_prequant_nope", "qat.layers.2.compressed_kv", 192, 256, 192, false},
      {"qat.layers.1.indexer_kv_prequant", "qat.layers.1.indexer_kv", 128, 128, 128, true},
      {"qat.layers.3.indexer_kv_prequant", "qat.layers.3.indexer_kv", 128, 128, 128, true},
  };
  for (const Case& c : cases) {
    const std::vector<float> in = ref_.f32(c.in), want = ref_.f32(c.out);
    const int64_t rows = static_cast<int64_t>(in.size()) / c.in_cols;
    auto t = cpu_->alloc(GgmlType::F32, std::vector<int64_t>{rows, c.in_cols});
    ASSERT_TRUE(t.is_ok());
    ASSERT_TRUE(cpu_->upload(*t, in.data(), in.size() * sizeof(float)).is_ok());
    ASSERT_TRUE((c.fp4 ? cpu_->round_fp4_blocks(*t, 32) : cpu_->round_fp8_blocks(*t, c.cols, 64)).is_ok());
    std::vector<float> got(in.size());
    ASSERT_TRUE(cpu_->download(*t, got.data(), got.size() * sizeof(float)).is_ok());
    int mismatches = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < c.cols; ++i) mismatches += got[r * c.in_cols + i] != want[r * c.out_cols + i];
    EXPECT_EQ(mismatches, 0) << c.in << " -> " << c.out;
  }
}

// Chunked prefill gives bit-identical logits for every chunk size (QAT on: every size of
// the issue; QAT off: one; test_forward_invariance.cpp covers more patterns).
TEST_F(FixtureForward, ChunkInvariance) {
  const auto tokens = ref_.i32("tokens");
  for (bool qat : {false, true}) {
    auto m = load(qat);
    ASSERT_TRUE(m);
    auto whole = sequence(*m);
    const std::vector<float> want = prefill_all(*m, *whole, tokens);
    for (size_t chunk : qat ? std::vector<size_t>{1, 3, 7, 16} : std::vector<size_t>{7}) {
      auto seq = sequence(*m);
      EXPECT_EQ(prefill_all(*m, *seq, tokens, chunk), want) << "chunk " << chunk << " qat " << qat;
    }
  }
}

// Sequences of different lengths in one batch give bit-identical logits to each alone.
TEST_F(FixtureForward, BatchInvariance) {
  const auto tokens = ref_.i32("tokens");
  auto m = load(true);
  ASSERT_TRUE(m);
  const std::vector<std::pair<size_t, size_t>> spans = {{0, 72}, {5, 2}, {10, 23}, {30, 41}};
  std::vector<std::vector<float>> alone;
  for (auto [at, len] : spans) {
    auto seq = sequence(*m);
    alone.push_back(prefill_all(*m, *seq, std::vector<int32_t>(tokens.begin() + at, tokens.begin() + at + len)));
  }
  std::vector<std::unique_ptr<Sequence>> seqs;
  std::vector<BatchItem> batch;
  for (auto [at, len] : spans) {
    seqs.push_back(sequence(*m));
    batch.push_back({seqs.back().get(), std::span<const int32_t>(tokens.data() + at, len), true, false});
  }
  ForwardOutput out;
  ASSERT_TRUE(m->forward(batch, out).is_ok());
  size_t row = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    const std::vector<float> got(out.logits.begin() + row * kVocab,
                                 out.logits.begin() + (row + spans[i].second) * kVocab);
    EXPECT_EQ(got, alone[i]) << "sequence " << i;
    row += spans[i].second;
  }
}

}  // namespace
}  // namespace dsv4
