// The cache manager on a synthetic tiny model: forks share pages until one side writes,
// snapshots rewind exactly, slots and pages run out with clear errors and come back.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <span>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "model/model.h"
#include "support/test_support.h"
#include "support/tiny_synth.h"
#include "synth/presets.h"
#include "synth/synth.h"

namespace dsv4 {
namespace {

class KvCacheTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<test::TempDir>();
    SynthOptions so = test::tiny_synth_options(9, GgmlType::Q8_0, GgmlType::Q8_0);
    path_ = (dir_->path() / "tiny.gguf").string();
    ASSERT_TRUE(write_synthetic_model(path_, so).is_ok());
  }
  static void TearDownTestSuite() { dir_.reset(); }

  void SetUp() override {
    ModelOptions mo;
    mo.cache.page_rows = 4;   // pages end inside the test sequences
    mo.cache.max_sequences = 4;
    auto m = Model::load(path_, cpu_, mo);
    ASSERT_TRUE(m.is_ok()) << m.status().message();
    model_ = std::move(m).value();
  }

  std::unique_ptr<Sequence> sequence() {
    SequenceOptions so;
    so.max_context = 256;
    auto s = model_->new_sequence(so);
    EXPECT_TRUE(s.is_ok()) << s.status().message();
    return s.is_ok() ? std::move(s).value() : nullptr;
  }
  static std::vector<int32_t> tokens(size_t n, uint64_t salt) {
    std::mt19937_64 rng(test::test_seed() + salt);
    std::uniform_int_distribution<int32_t> id(0, 511);
    std::vector<int32_t> t(n);
    for (auto& x : t) x = id(rng);
    return t;
  }
  std::vector<float> logits(Sequence& seq, const std::vector<int32_t>& t) {
    auto r = model_->prefill(seq, t, true);
    EXPECT_TRUE(r.is_ok()) << r.status().message();
    return r.is_ok() ? std::move(r).value() : std::vector<float>{};
  }

  static std::unique_ptr<test::TempDir> dir_;
  static std::string path_;
  backend::CpuBackend cpu_{2};
  std::unique_ptr<Model> model_;
};

std::unique_ptr<test::TempDir> KvCacheTest::dir_;
std::string KvCacheTest::path_;

// A fork continues exactly like the original would, and neither sees the other's rows:
// 37 tokens end inside a page of CSA entries (ratio 4, 4 rows a page) and inside an HCA
// block, so both sides' next writes land in a shared page and must copy it first.
TEST_F(KvCacheTest, ForkSharesPagesAndCopiesOnWrite) {
  const auto prefix = tokens(37, 1), a_next = tokens(29, 2), b_next = tokens(23, 3), b_more = tokens(9, 4);
  auto ref_a = sequence(), ref_b = sequence();
  logits(*ref_a, prefix);
  logits(*ref_b, prefix);
  const auto want_a = logits(*ref_a, a_next), want_b = logits(*ref_b, b_next), want_b_more = logits(*ref_b, b_more);
  ref_a.reset();
  ref_b.reset();

  auto a = sequence();
  logits(*a, prefix);
  const uint64_t before_fork = model_->cache().free_pages(256);
  auto b = model_->fork(*a);
  ASSERT_TRUE(b.is_ok()) << b.status().message();
  EXPECT_EQ(model_->cache().free_pages(256), before_fork);  // shared, not copied
  EXPECT_EQ((*b)->position(), a->position());
  EXPECT_EQ(logits(**b, b_next), want_b);  // b writes into the shared pages first (copies them)
  EXPECT_EQ(logits(*a, a_next), want_a);   // a sees only its own rows
  EXPECT_EQ(logits(**b, b_more), want_b_more);  // and b still its own, after a wrote
}

// Snapshots at a block boundary and off one: restoring and continuing equals a sequence
// that never went further, however far the sequence went past the snapshot.
TEST_F(KvCacheTest, RestoreRewindsExactly) {
  for (size_t at : {32, 35}) {
    const auto prefix = tokens(at, 4 + at), later = tokens(20, 5), detour = tokens(60, 6);
    auto ref = sequence();
    logits(*ref, prefix);
    const auto want = logits(*ref, later);
    ref.reset();

    auto s = sequence();
    logits(*s, prefix);
    auto snap = model_->snapshot(*s);
    ASSERT_TRUE(snap.is_ok()) << snap.status().message();
    EXPECT_EQ(snap->position(), static_cast<int64_t>(at));
    EXPECT_GT(snap->bytes(), 0u);
    logits(*s, detour);
    const uint64_t grown = s->committed_bytes();
    ASSERT_TRUE(model_->restore(*s, *snap).is_ok());
    EXPECT_EQ(s->position(), static_cast<int64_t>(at));
    EXPECT_LT(s->committed_bytes(), grown);  // the detour's pages are released
    EXPECT_EQ(logits(*s, later), want) << "snapshot at " << at;
  }
}

TEST_F(KvCacheTest, RestoreRefusesASnapshotFromTheFuture) {
  auto s = sequence();
  logits(*s, tokens(12, 7));
  auto snap = model_->snapshot(*s);
  ASSERT_TRUE(snap.is_ok());
  auto other = sequence();
  logits(*other, tokens(4, 8));
  EXPECT_FALSE(model_->restore(*other, *snap).is_ok());
}

TEST_F(KvCacheTest, SlotsRunOutAndComeBack) {
  std::vector<std::unique_ptr<Sequence>> held;
  for (int i = 0; i < 4; ++i) held.push_back(sequence());
  EXPECT_EQ(model_->cache().free_slots(), 0u);
  SequenceOptions so;
  so.max_context = 256;
  auto extra = model_->new_sequence(so);
  ASSERT_FALSE(extra.is_ok());
  EXPECT_EQ(extra.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(extra.status().message().find("slots"), std::string::npos) << extra.status().message();
  held.pop_back();
  EXPECT_EQ(model_->cache().free_slots(), 1u);
  EXPECT_TRUE(model_->new_sequence(so).is_ok());
}

TEST_F(KvCacheTest, PagesRunOutWithoutChangingTheSequence) {
  backend::CpuBackend cpu(1);
  ModelOptions mo;
  mo.cache.page_rows = 4;
  mo.cache.max_sequences = 2;
  mo.cache.pool_bytes = 64 * 1024;  // a few pages of each width
  auto m = Model::load(path_, cpu, mo);
  ASSERT_TRUE(m.is_ok()) << m.status().message();
  SequenceOptions so;
  so.max_context = 256;
  auto s = (*m)->new_sequence(so);
  ASSERT_TRUE(s.is_ok());
  const auto r = (*m)->prefill(**s, tokens(250, 9));
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("page"), std::string::npos) << r.status().message();
  EXPECT_EQ((*s)->position(), 0);
  EXPECT_TRUE((*m)->prefill(**s, tokens(8, 10)).is_ok());
}

}  // namespace
}  // namespace dsv4

namespace dsv4 {
namespace {

// Model::fill_for_benchmark: an empty sequence jumps to a depth with its pages committed and
// random finite contents; decoding on is finite, sampled tokens are valid, and the contents
// depend on the seed only.
TEST_F(KvCacheTest, FillForBenchmark) {
  auto a = sequence(), b = sequence(), c = sequence();
  const uint64_t empty_bytes = a->committed_bytes();
  ASSERT_TRUE(model_->fill_for_benchmark(*a, 150, 21).is_ok());
  ASSERT_TRUE(model_->fill_for_benchmark(*b, 150, 21).is_ok());
  ASSERT_TRUE(model_->fill_for_benchmark(*c, 150, 22).is_ok());
  EXPECT_EQ(a->position(), 150);
  // 150 tokens: 37 CSA entries and keys (10 pages of 4), 9 entries of the ratio-16 layers.
  EXPECT_GT(a->committed_bytes(), empty_bytes);
  EXPECT_EQ(a->committed_bytes(), b->committed_bytes());

  const std::vector<int32_t> next = {17, 301, 42};
  const std::vector<float> la = logits(*a, next), lb = logits(*b, next), lc = logits(*c, next);
  ASSERT_EQ(la.size(), 3u * 512);
  bool finite = true;
  for (float x : la) finite = finite && std::isfinite(x);
  EXPECT_TRUE(finite);
  EXPECT_EQ(la, lb);
  EXPECT_NE(la, lc);
  EXPECT_EQ(a->position(), 153);
  b.reset();  // four slots
  c.reset();

  // A sampled step from the filled depth (the benchmark's decode step).
  auto d = sequence();
  ASSERT_TRUE(model_->fill_for_benchmark(*d, 200, 23).is_ok());
  const SampleSpec greedy{.temperature = 0, .adjust = {}};
  const int32_t token = 5;
  const BatchItem item{d.get(), std::span<const int32_t>(&token, 1), false, false, &greedy};
  ForwardOutput out;
  ASSERT_TRUE(model_->forward(std::span<const BatchItem>(&item, 1), out).is_ok());
  ASSERT_EQ(out.tokens.size(), 1u);
  EXPECT_GE(out.tokens[0], 0);
  EXPECT_LT(out.tokens[0], 512);

  EXPECT_FALSE(model_->fill_for_benchmark(*a, 10, 1).is_ok());   // not empty
  auto e = sequence();
  EXPECT_FALSE(model_->fill_for_benchmark(*e, 257, 1).is_ok());  // past its context
  EXPECT_EQ(e->position(), 0);
}

}  // namespace
}  // namespace dsv4
