// Every intermediate of DeepSeek's reference run on the tiny-v4 fixture against the
// forward pass's trace (model/trace.h), at the fixture README's tolerances:
//   QAT off (rule 3, strict): every row within 1e-4 relative L2; the indexer's and the
//     router's choices the same set in every row.
//   QAT on (rule 4, statistical): the choices the same in >= 90 % of the rows of every
//     layer; continuous quantities median per-row relative L2 <= 2e-2, all finite.
// The measured agreement of every quantity is printed ("[ measured ]" lines).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "model/model.h"
#include "model/trace.h"
#include "tools/fixture_reference.h"

namespace dsv4 {
namespace {

using test::FixtureReference;

constexpr size_t kPrompt = 72;

class FixtureIntermediates : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { cpu_ = std::make_unique<backend::CpuBackend>(2); }
  static void TearDownTestSuite() {
    traces_.clear();
    cpu_.reset();
  }

  static std::unique_ptr<Model> load(bool qat) {
    ModelOptions o;
    o.qat = qat;
    auto m = Model::load(test::fixture_gguf_f32(), *cpu_, o);
    EXPECT_TRUE(m.is_ok()) << m.status().message();
    return m.is_ok() ? std::move(m).value() : nullptr;
  }

  // The reference's calls, traced: the prompt fed in chunks of `chunk` tokens (0: one
  // call), then the MTP block fed the reference's own final streams at positions 0..70
  // with tokens[1..71], so that the MTP intermediates test the block alone.
  static ForwardTrace run(bool qat, size_t chunk = 0) {
    ForwardTrace trace;
    const FixtureReference& ref = FixtureReference::get();
    const std::vector<int32_t> tokens = ref.i32("tokens");
    auto m = load(qat);
    if (!m || tokens.size() != kPrompt) return trace;
    SequenceOptions so;
    so.max_context = 256;
    so.with_mtp = true;
    auto seq = m->new_sequence(so);
    EXPECT_TRUE(seq.is_ok()) << seq.status().message();
    if (!seq.is_ok()) return trace;
    if (chunk == 0) chunk = kPrompt;
    for (size_t at = 0; at < kPrompt; at += chunk) {
      const BatchItem item{seq->get(), std::span<const int32_t>(tokens.data() + at, std::min(chunk, kPrompt - at)),
                           false, false};
      ForwardOutput out;
      const Status s = m->forward(std::span<const BatchItem>(&item, 1), out, &trace);
      EXPECT_TRUE(s.is_ok()) << s.message();
    }
    const std::vector<float> streams = ref.f32(std::string(qat ? "qat" : "noqat") + ".final_streams");
    const size_t width = streams.size() / kPrompt;
    const MtpItem mi{seq->get(), std::span<const float>(streams.data(), (kPrompt - 1) * width),
                     std::span<const int32_t>(tokens.data() + 1, kPrompt - 1)};
    const auto drafts = m->mtp(std::span<const MtpItem>(&mi, 1), &trace);
    EXPECT_TRUE(drafts.is_ok()) << drafts.status().message();
    return trace;
  }
  static const ForwardTrace& trace(bool qat) {
    auto it = traces_.find(qat);
    if (it == traces_.end()) it = traces_.emplace(qat, run(qat)).first;
    return it->second;
  }

  // Compares every `<mode>.` intermediate of the reference with the trace.
  static void compare_all(bool qat);

  static std::unique_ptr<backend::CpuBackend> cpu_;
  static std::map<bool, ForwardTrace> traces_;
};

std::unique_ptr<backend::CpuBackend> FixtureIntermediates::cpu_;
std::map<bool, ForwardTrace> FixtureIntermediates::traces_;

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Rows whose non-negative entries form the same set (the reference sorts them ascending,
// -1 for unused slots; so does the trace, but only the set is the contract).
std::vector<int64_t> differing_rows(const std::vector<int32_t>& got, const std::vector<int32_t>& want, int64_t cols) {
  std::vector<int64_t> rows;
  for (int64_t r = 0; r * cols < static_cast<int64_t>(want.size()); ++r) {
    std::vector<int32_t> a(got.begin() + r * cols, got.begin() + (r + 1) * cols);
    std::vector<int32_t> b(want.begin() + r * cols, want.begin() + (r + 1) * cols);
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    if (a != b) rows.push_back(r);
  }
  return rows;
}

void FixtureIntermediates::compare_all(bool qat) {
  const FixtureReference& ref = FixtureReference::get();
  const ForwardTrace& tr = trace(qat);
  const std::string mode = qat ? "qat." : "noqat.";
  int compared = 0;
  for (const convert::StTensor& want : ref.file().tensors()) {
    if (want.name.rfind(mode, 0) != 0 || want.shape.size() < 2) continue;  // 1-D: the *_rel_margin diagnostics
    std::string name = want.name.substr(mode.size());
    // The reference keeps only the FP8-rounded dims of the pre-rounding entries.
    if (ends_with(name, "_prequant_nope")) name.resize(name.size() - 5);
    const int64_t rows = static_cast<int64_t>(want.shape[0]);
    const int64_t cols = static_cast<int64_t>(want.n_elements()) / rows;
    const TracedTensor* got = tr.find(name);
    ASSERT_NE(got, nullptr) << "the trace has no " << name;
    ASSERT_EQ(got->rows(), rows) << name;
    ASSERT_GE(got->cols, cols) << name;
    ++compared;

    if (want.dtype == convert::StDtype::I32) {  // index_topk, router_experts
      ASSERT_EQ(got->cols, cols) << name;
      const std::vector<int64_t> bad = differing_rows(got->i32, ref.i32(want.name), cols);
      const int64_t same = rows - static_cast<int64_t>(bad.size());
      if (qat)
        EXPECT_GE(same, static_cast<int64_t>(std::ceil(0.9 * rows))) << name;
      else
        EXPECT_EQ(same, rows) << name;
      // Where a choice differs, the reference's margin says how close it was to a tie.
      const std::string margin_name = want.name.substr(0, want.name.rfind('.')) +
                                      (ends_with(name, "index_topk") ? ".index_rel_margin" : ".router_rel_margin");
      const std::vector<float> margins =
          ref.file().find(margin_name) ? ref.f32(margin_name) : std::vector<float>{};
      std::string detail;
      for (int64_t r : bad)
        detail += " row " + std::to_string(r) +
                  (margins.empty() ? std::string() : " (margin " + std::to_string(margins[r]) + ")");
      std::printf("[ measured ] %s%s: same set in %lld/%lld rows%s\n", mode.c_str(), name.c_str(),
                  static_cast<long long>(same), static_cast<long long>(rows), detail.c_str());
      continue;
    }
    const test::RowErrors e = test::compare_rows(got->f32, ref.f32(want.name), cols, got->cols, cols);
    ASSERT_TRUE(e.finite) << name;
    ASSERT_EQ(static_cast<int64_t>(e.rel.size()), rows) << name;
    if (qat)
      EXPECT_LE(e.median(), 2e-2) << name;
    else
      EXPECT_LE(e.max(), 1e-4) << name << ": median " << e.median();
    std::printf("[ measured ] %s%s: per-row relative L2 median %.3g max %.3g\n", mode.c_str(),
                want.name.substr(mode.size()).c_str(), e.median(), e.max());
  }
  // The fixture holds 41 noqat and 53 qat intermediates besides the 1-D margins.
  EXPECT_EQ(compared, qat ? 53 : 41);
}

TEST_F(FixtureIntermediates, QatOffStrict) { compare_all(false); }

TEST_F(FixtureIntermediates, QatOnStatistical) { compare_all(true); }

// The trace names every quantity trace.h lists, with one row per token or per entry, and
// the indexer only ever picks entries visible to the query (entry e from position
// e*ratio + ratio - 1 on), distinct and ascending.
TEST_F(FixtureIntermediates, TraceNamesEveryQuantity) {
  const ForwardTrace& tr = trace(true);
  auto m = load(true);
  ASSERT_TRUE(m);
  const ModelConfig& c = m->config();
  const auto expect_rows = [&](const std::string& name, int64_t rows) {
    const TracedTensor* t = tr.find(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(t->rows(), rows) << name;
  };
  const int64_t n = kPrompt;
  expect_rows("final_streams", n);
  for (uint32_t b = 0; b < c.n_blocks(); ++b) {
    const std::string p = c.is_mtp(b) ? "mtp." + std::to_string(b - c.n_layers) + "." : "layers." + std::to_string(b) + ".";
    const int64_t rows = c.is_mtp(b) ? n - 1 : n;
    for (const char* q : {"attn_in", "kv", "attn_out", "router_experts", "router_weights", "ffn_out", "out_streams"})
      expect_rows(p + q, rows);
    const int64_t ratio = c.ratio(b);
    EXPECT_EQ(tr.find(p + "compressed_kv") != nullptr, ratio != 0) << p;
    EXPECT_EQ(tr.find(p + "index_topk") != nullptr, c.attention_kind(b) == AttentionKind::CSA) << p;
    if (ratio == 0) continue;
    expect_rows(p + "compressed_kv_prequant", n / ratio);
    expect_rows(p + "compressed_kv", n / ratio);
    if (c.attention_kind(b) != AttentionKind::CSA) continue;
    expect_rows(p + "indexer_kv_prequant", n / ratio);
    expect_rows(p + "indexer_kv", n / ratio);
    expect_rows(p + "index_topk", n);
    const TracedTensor* topk = tr.find(p + "index_topk");
    ASSERT_NE(topk, nullptr);
    for (int64_t t = 0; t < topk->rows(); ++t) {
      const int64_t visible = (t + 1) / ratio;
      int32_t last = -1;
      for (int64_t j = 0; j < topk->cols; ++j) {
        const int32_t e = topk->i32[t * topk->cols + j];
        if (e < 0) continue;
        EXPECT_LT(e, visible) << p << "index_topk row " << t;
        EXPECT_GT(e, last) << p << "index_topk row " << t;
        last = e;
      }
      EXPECT_EQ(last >= 0, visible > 0) << p << "index_topk row " << t;
    }
  }
}

// A prefill in chunks traced into one ForwardTrace reads exactly like the single call
// (entries recorded as each call completes them, index offsets removed).
TEST_F(FixtureIntermediates, ChunkedTraceEqualsSingleCall) {
  const ForwardTrace& whole = trace(true);
  const ForwardTrace chunked = run(true, 7);
  ASSERT_EQ(chunked.tensors().size(), whole.tensors().size());
  for (const auto& [name, t] : whole.tensors()) {
    const TracedTensor* c = chunked.find(name);
    ASSERT_NE(c, nullptr) << name;
    EXPECT_EQ(c->cols, t.cols) << name;
    EXPECT_EQ(c->f32, t.f32) << name;
    EXPECT_EQ(c->i32, t.i32) << name;
  }
}

}  // namespace
}  // namespace dsv4
