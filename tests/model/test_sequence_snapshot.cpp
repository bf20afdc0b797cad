// fork, snapshot, restore, export and import on a synthetic tiny model (the fixture's
// geometry, random weights): a restored, forked or imported sequence continues exactly
// as a fresh run on the same tokens (bit-identical logits), at compressed-entry
// boundaries and between them; copies are charged to the shared budget; bad snapshots and
// damaged bytes are errors.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "model/model.h"
#include "support/test_support.h"
#include "support/tiny_synth.h"
#include "synth/presets.h"
#include "synth/synth.h"

namespace dsv4 {
namespace {

class SequenceSnapshots : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<test::TempDir>();
    SynthOptions so = test::tiny_synth_options(11, GgmlType::Q8_0, GgmlType::Q8_0);
    const std::string path = (dir_->path() / "tiny.gguf").string();
    auto r = write_synthetic_model(path, so);
    ASSERT_TRUE(r.is_ok()) << r.status().message();
    cpu_ = std::make_unique<backend::CpuBackend>(2);
    auto m = Model::load(path, *cpu_, {});
    ASSERT_TRUE(m.is_ok()) << m.status().message();
    model_ = std::move(m).value();
  }
  static void TearDownTestSuite() {
    model_.reset();
    cpu_.reset();
    dir_.reset();
  }
  void SetUp() override { ASSERT_TRUE(model_); }

  static std::unique_ptr<Sequence> sequence(std::shared_ptr<CacheBudget> budget = nullptr, uint64_t ctx = 128) {
    SequenceOptions so;
    so.max_context = ctx;
    so.shared_budget = std::move(budget);
    auto s = model_->new_sequence(so);
    EXPECT_TRUE(s.is_ok()) << s.status().message();
    return std::move(s).value();
  }
  static std::vector<int32_t> tokens(size_t n, uint64_t salt) {
    std::mt19937_64 rng(test::test_seed() * 31 + salt);
    std::uniform_int_distribution<int32_t> id(0, 511);
    std::vector<int32_t> t(n);
    for (auto& x : t) x = id(rng);
    return t;
  }
  // All logits of `t` fed to `seq` in chunks of `chunk`.
  static std::vector<float> feed(Sequence& seq, std::span<const int32_t> t, size_t chunk = 7) {
    std::vector<float> out;
    for (size_t at = 0; at < t.size(); at += chunk) {
      auto r = model_->prefill(seq, t.subspan(at, std::min(chunk, t.size() - at)), true);
      EXPECT_TRUE(r.is_ok()) << r.status().message();
      if (!r.is_ok()) return {};
      out.insert(out.end(), r->begin(), r->end());
    }
    return out;
  }
  // The logits of the last `tail` tokens of `t` in a fresh run over all of `t`.
  static std::vector<float> fresh_tail(const std::vector<int32_t>& t, size_t tail) {
    auto seq = sequence();
    std::vector<float> all = feed(*seq, t, 5);
    const size_t vocab = model_->config().vocab_size;
    return std::vector<float>(all.end() - static_cast<std::ptrdiff_t>(tail * vocab), all.end());
  }
  static std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  }

  static std::unique_ptr<test::TempDir> dir_;
  static std::unique_ptr<backend::CpuBackend> cpu_;
  static std::unique_ptr<Model> model_;
};
std::unique_ptr<test::TempDir> SequenceSnapshots::dir_;
std::unique_ptr<backend::CpuBackend> SequenceSnapshots::cpu_;
std::unique_ptr<Model> SequenceSnapshots::model_;

// Snapshot at p, run on with other tokens, restore, continue: equal to a fresh run on the
// prefix and the continuation. p covers the start, entry boundaries (ratios 4 and 16) and
// points between them; the detour crosses several boundaries.
TEST_F(SequenceSnapshots, RestoreThenForwardEqualsAFreshRun) {
  const std::vector<int32_t> base = tokens(110, 1);
  for (size_t p : {1u, 3u, 4u, 16u, 17u, 32u, 45u, 64u}) {
    SCOPED_TRACE(p);
    auto seq = sequence();
    feed(*seq, std::span(base).first(p));
    auto snap = model_->snapshot(*seq);
    ASSERT_TRUE(snap.is_ok()) << snap.status().message();
    EXPECT_EQ(snap->position(), static_cast<int64_t>(p));
    EXPECT_GT(snap->bytes(), 0u);
    feed(*seq, std::span(base).subspan(p, 40), 11);  // the detour
    ASSERT_TRUE(model_->restore(*seq, *snap).is_ok());
    EXPECT_EQ(seq->position(), static_cast<int64_t>(p));
    const std::vector<int32_t> cont = tokens(23, 100 + p);
    const std::vector<float> got = feed(*seq, cont, 6);
    const std::vector<float> want = fresh_tail(concat({base.begin(), base.begin() + p}, cont), cont.size());
    ASSERT_EQ(got.size(), want.size());
    EXPECT_TRUE(got == want) << "restored run differs from the fresh run at p = " << p;
    // The same snapshot again, after another detour.
    ASSERT_TRUE(model_->restore(*seq, *snap).is_ok());
    EXPECT_TRUE(feed(*seq, cont, 23) == want);
  }
}

TEST_F(SequenceSnapshots, ForkIsIndependentAndChargedToTheBudget) {
  const std::vector<int32_t> base = tokens(37, 2), a = tokens(20, 3), b = tokens(20, 4);
  auto plan = CachePlan::compute(model_->config(), 128, false);
  ASSERT_TRUE(plan.is_ok());
  auto budget = std::make_shared<CacheBudget>(10 * plan->total());
  auto parent = sequence(budget);
  feed(*parent, base);
  const uint64_t one = budget->used();
  auto child = model_->fork(*parent);
  ASSERT_TRUE(child.is_ok()) << child.status().message();
  EXPECT_EQ((*child)->position(), parent->position());
  // The fork gets its own windows and compressor states; the compressed rows are shared
  // (copy on write) and stay charged to the parent's pages until the child writes.
  const uint64_t fixed = parent->plan().fixed();
  EXPECT_EQ(budget->used(), one + fixed);
  EXPECT_EQ((*child)->committed_bytes(), parent->committed_bytes());
  const std::vector<float> pa = feed(*parent, a), cb = feed(**child, b);
  EXPECT_TRUE(pa == fresh_tail(concat(base, a), a.size()));
  EXPECT_TRUE(cb == fresh_tail(concat(base, b), b.size()));
  EXPECT_GT(budget->used(), one + fixed);  // the child's own pages, written since
  child->reset();
  EXPECT_LT(budget->used(), one + fixed);

  // A fork that does not fit is refused and leaves the budget as it was.
  auto tight = std::make_shared<CacheBudget>(one + fixed - 1);
  auto small = sequence(tight);
  feed(*small, base);
  const uint64_t before = tight->used();
  auto refused = model_->fork(*small);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(tight->used(), before);
}

// The prefix cache's move: fork a sequence that has gone past p, restore the fork to the
// parent's snapshot at p, continue differently.
TEST_F(SequenceSnapshots, ForkThenRestoreToTheParentsSnapshot) {
  const std::vector<int32_t> base = tokens(70, 5), cont = tokens(19, 6);
  auto parent = sequence();
  feed(*parent, std::span(base).first(32));
  auto snap = model_->snapshot(*parent);
  ASSERT_TRUE(snap.is_ok());
  feed(*parent, std::span(base).subspan(32));
  auto child = model_->fork(*parent);
  ASSERT_TRUE(child.is_ok());
  ASSERT_TRUE(model_->restore(**child, *snap).is_ok());
  EXPECT_TRUE(feed(**child, cont) == fresh_tail(concat({base.begin(), base.begin() + 32}, cont), cont.size()));
  // The parent is untouched.
  const std::vector<int32_t> more = tokens(9, 7);
  EXPECT_TRUE(feed(*parent, more) == fresh_tail(concat(base, more), more.size()));
}

TEST_F(SequenceSnapshots, ExportImportContinuesExactly) {
  const std::vector<int32_t> base = tokens(50, 8), cont = tokens(21, 9);
  auto seq = sequence();
  feed(*seq, base);
  auto bytes = model_->export_sequence(*seq);
  ASSERT_TRUE(bytes.is_ok()) << bytes.status().message();
  auto budget = std::make_shared<CacheBudget>(uint64_t{1} << 30);
  SequenceOptions so;
  so.max_context = 128;
  so.shared_budget = budget;
  auto copy = model_->import_sequence(*bytes, so);
  ASSERT_TRUE(copy.is_ok()) << copy.status().message();
  EXPECT_EQ((*copy)->position(), 50);
  EXPECT_EQ(budget->used(), (*copy)->committed_bytes());
  EXPECT_TRUE(feed(**copy, cont) == fresh_tail(concat(base, cont), cont.size()));

  // Damaged bytes: every truncation point tried on a sample, a bad magic, trailing bytes,
  // a context too small for the position.
  for (size_t cut : {size_t{0}, size_t{7}, size_t{8}, size_t{30}, bytes->size() / 2, bytes->size() - 1}) {
    auto r = model_->import_sequence(std::span(*bytes).first(cut), so);
    EXPECT_FALSE(r.is_ok()) << cut;
  }
  std::vector<uint8_t> bad = *bytes;
  bad[0] ^= 1;
  EXPECT_FALSE(model_->import_sequence(bad, so).is_ok());
  bad = *bytes;
  bad.push_back(0);
  auto trailing = model_->import_sequence(bad, so);
  ASSERT_FALSE(trailing.is_ok());
  EXPECT_NE(trailing.status().message().find("after the state's end"), std::string::npos);
  bad = *bytes;
  bad[8 + 16] = 0xff;  // the position's low byte: no longer matches the entry counts
  EXPECT_FALSE(model_->import_sequence(bad, so).is_ok());
  SequenceOptions tiny_ctx = so;
  tiny_ctx.max_context = 40;
  EXPECT_FALSE(model_->import_sequence(*bytes, tiny_ctx).is_ok());
  EXPECT_EQ(budget->used(), (*copy)->committed_bytes());  // refusals allocate nothing that stays
}

TEST_F(SequenceSnapshots, BadRestoresAreErrors) {
  auto seq = sequence();
  feed(*seq, tokens(10, 10));
  EXPECT_FALSE(model_->restore(*seq, SequenceSnapshot{}).is_ok());
  auto ahead = sequence();
  feed(*ahead, tokens(20, 11));
  auto snap = model_->snapshot(*ahead);
  ASSERT_TRUE(snap.is_ok());
  const Status beyond = model_->restore(*seq, *snap);
  ASSERT_FALSE(beyond.is_ok());
  EXPECT_EQ(beyond.code(), StatusCode::kOutOfRange);
  EXPECT_EQ(seq->position(), 10);
  auto other_ctx = sequence(nullptr, 64);
  feed(*other_ctx, tokens(30, 12));
  EXPECT_FALSE(model_->restore(*other_ctx, *snap).is_ok());
}

}  // namespace
}  // namespace dsv4
