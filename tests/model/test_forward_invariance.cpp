// The forward pass's cache and batching on a synthetic tiny model (the fixture's
// geometry, random weights): results are bit-identical whatever the chunking and
// batching, short prompts and every compressed-entry boundary included; the cache plan
// and budgets refuse what does not fit.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "model/model.h"
#include "synth/presets.h"
#include "synth/synth.h"
#include "support/test_support.h"
#include "support/tiny_synth.h"

namespace dsv4 {
namespace {

class ForwardInvariance : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<test::TempDir>();
    SynthOptions so = test::tiny_synth_options(7, GgmlType::MXFP4, GgmlType::Q8_0);
    path_ = (dir_->path() / "tiny.gguf").string();
    auto r = write_synthetic_model(path_, so);
    ASSERT_TRUE(r.is_ok()) << r.status().message();
    cpu_ = std::make_unique<backend::CpuBackend>(2);
    auto m = Model::load(path_, *cpu_, {});
    ASSERT_TRUE(m.is_ok()) << m.status().message();
    model_ = std::move(m).value();
  }
  static void TearDownTestSuite() {
    model_.reset();
    cpu_.reset();
    dir_.reset();
  }
  void SetUp() override { ASSERT_TRUE(model_); }

  static std::unique_ptr<Sequence> sequence(uint64_t ctx = 128) {
    SequenceOptions so;
    so.max_context = ctx;
    auto s = model_->new_sequence(so);
    EXPECT_TRUE(s.is_ok()) << s.status().message();
    return std::move(s).value();
  }
  static std::vector<int32_t> tokens(size_t n, uint64_t salt) {
    std::mt19937_64 rng(test::test_seed() + salt);
    std::uniform_int_distribution<int32_t> id(0, 511);
    std::vector<int32_t> t(n);
    for (auto& x : t) x = id(rng);
    return t;
  }
  // Every token's logits, in chunks following `chunks` cyclically.
  static std::vector<float> run(const std::vector<int32_t>& t, const std::vector<size_t>& chunks) {
    auto seq = sequence();
    std::vector<float> out;
    size_t at = 0;
    for (size_t i = 0; at < t.size(); ++i) {
      const size_t len = std::min(chunks[i % chunks.size()], t.size() - at);
      auto r = model_->prefill(*seq, std::span<const int32_t>(t.data() + at, len), true);
      EXPECT_TRUE(r.is_ok()) << r.status().message();
      if (!r.is_ok()) return {};
      out.insert(out.end(), r->begin(), r->end());
      at += len;
    }
    EXPECT_EQ(seq->position(), static_cast<int64_t>(t.size()));
    return out;
  }

  static std::unique_ptr<test::TempDir> dir_;
  static std::string path_;
  static std::unique_ptr<backend::CpuBackend> cpu_;
  static std::unique_ptr<Model> model_;
};

std::unique_ptr<test::TempDir> ForwardInvariance::dir_;
std::string ForwardInvariance::path_;
std::unique_ptr<backend::CpuBackend> ForwardInvariance::cpu_;
std::unique_ptr<Model> ForwardInvariance::model_;

// 70 tokens cross the window (8), 17 CSA entries (ratio 4) and 4 HCA entries (ratio 16);
// chunk size 1 ends a call on every entry boundary, the odd sizes start calls inside,
// at, and just after blocks.
TEST_F(ForwardInvariance, ChunkSizesGiveIdenticalLogits) {
  const auto t = tokens(70, 1);
  const auto whole = run(t, {t.size()});
  ASSERT_EQ(whole.size(), t.size() * 512);
  for (const auto& chunks : std::vector<std::vector<size_t>>{{1}, {3}, {7}, {16}, {4, 12, 1, 15, 2}})
    EXPECT_EQ(run(t, chunks), whole) << "chunks starting " << chunks[0];
}

// Prompts shorter than the compression ratio (and than the window), then decoding.
TEST_F(ForwardInvariance, ShortPromptsThenDecode) {
  const auto t = tokens(40, 2);
  const auto whole = run(t, {t.size()});
  for (size_t first : {1, 2, 3, 5}) {
    std::vector<size_t> chunks = {first};
    chunks.insert(chunks.end(), t.size(), 1);
    EXPECT_EQ(run(t, chunks), whole) << "prompt of " << first;
  }
}

// Sequences of different lengths (shorter than a block, a window, several blocks) in one
// batch, and a batch mixing decode steps with a prefill chunk.
TEST_F(ForwardInvariance, BatchedSequencesMatchEachAlone) {
  const std::vector<size_t> lengths = {2, 9, 33, 50};
  std::vector<std::vector<int32_t>> toks;
  std::vector<std::vector<float>> alone;
  for (size_t i = 0; i < lengths.size(); ++i) {
    toks.push_back(tokens(lengths[i], 10 + i));
    alone.push_back(run(toks.back(), {lengths[i]}));
  }
  std::vector<std::unique_ptr<Sequence>> seqs;
  std::vector<BatchItem> batch;
  for (size_t i = 0; i < lengths.size(); ++i) {
    seqs.push_back(sequence());
    batch.push_back({seqs.back().get(), toks[i], true, false});
  }
  ForwardOutput out;
  ASSERT_TRUE(model_->forward(batch, out).is_ok());
  size_t row = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    EXPECT_EQ(std::vector<float>(out.logits.begin() + row * 512, out.logits.begin() + (row + lengths[i]) * 512),
              alone[i]) << "sequence " << i;
    row += lengths[i];
  }

  // Two sequences continue: one decodes a token, the other prefills 6, in one call.
  const auto more = tokens(7, 20);
  std::vector<BatchItem> step = {{seqs[0].get(), std::span<const int32_t>(more.data(), 1), true, false},
                                 {seqs[3].get(), std::span<const int32_t>(more.data() + 1, 6), true, false}};
  ASSERT_TRUE(model_->forward(step, out).is_ok());
  auto a = toks[0];
  a.push_back(more[0]);
  auto b = toks[3];
  b.insert(b.end(), more.begin() + 1, more.end());
  const auto ra = run(a, {a.size()}), rb = run(b, {b.size()});
  EXPECT_EQ(std::vector<float>(out.logits.begin(), out.logits.begin() + 512),
            std::vector<float>(ra.end() - 512, ra.end()));
  EXPECT_EQ(std::vector<float>(out.logits.begin() + 512, out.logits.end()),
            std::vector<float>(rb.end() - 6 * 512, rb.end()));
}

TEST_F(ForwardInvariance, CachePlanAndLimits) {
  const ModelConfig& c = model_->config();
  auto plan = CachePlan::compute(c, 100, false);
  ASSERT_TRUE(plan.is_ok());
  // Tiny: 6 layers x window 8 x 256 fp32; CSA layers 1, 3 (25 entries + 25 keys each);
  // HCA layers 2, 4 (6 entries each); states: CSA 2 x (8x512 + 8x256) x 2 x 4 B, HCA 2 x 16x256 x 2 x 4 B;
  // every window and state with kRewindTokens (4) rows more.
  static_assert(kRewindTokens == 4);
  EXPECT_EQ(plan->windows, 6u * (8 + 4) * 256 * 4);
  EXPECT_EQ(plan->csa_entries, 2u * 25 * 256 * 4);
  EXPECT_EQ(plan->index_keys, 2u * 25 * 128 * 4);
  EXPECT_EQ(plan->hca_entries, 2u * 6 * 256 * 4);
  EXPECT_EQ(plan->compressor_states, 2u * ((8 + 4) * 512 + (8 + 4) * 256) * 2 * 4 + 2u * (16 + 4) * 256 * 2 * 4);
  EXPECT_EQ(plan->total(), plan->fixed() + plan->csa_entries + plan->index_keys + plan->hca_entries);

  SequenceOptions too_long;
  too_long.max_context = c.context_length + 1;
  auto s = model_->new_sequence(too_long);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.status().message().find("context"), std::string::npos) << s.status().message();

  SequenceOptions small_budget;
  small_budget.max_context = 100;
  small_budget.memory_budget = plan->total() - 1;
  s = model_->new_sequence(small_budget);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.status().message().find("budget"), std::string::npos) << s.status().message();

  // A sequence cannot run past its context.
  auto seq = sequence(10);
  const auto t = tokens(11, 3);
  EXPECT_FALSE(model_->prefill(*seq, t).is_ok());
  EXPECT_EQ(seq->position(), 0);
}

TEST_F(ForwardInvariance, BadInputsAreErrors) {
  backend::CpuBackend cpu(1);
  auto missing = Model::load((dir_->path() / "absent.gguf").string(), cpu, {});
  EXPECT_FALSE(missing.is_ok());
  auto seq = sequence();
  const std::vector<int32_t> bad = {1, 512};
  const auto r = model_->prefill(*seq, bad);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("512"), std::string::npos) << r.status().message();
  EXPECT_EQ(seq->position(), 0);
  ForwardOutput out;
  EXPECT_FALSE(model_->forward({}, out).is_ok());
  const std::vector<int32_t> one = {3};
  const std::vector<BatchItem> twice = {{seq.get(), one, false, false}, {seq.get(), one, false, false}};
  EXPECT_FALSE(model_->forward(twice, out).is_ok());
  EXPECT_FALSE(model_->mtp({}).is_ok());  // empty, and the sequence has no MTP cache
}

// Full-context reservations over one shared budget: memory is charged as pages of rows
// are first written (pages of 4 rows here, so the arithmetic is visible).
TEST_F(ForwardInvariance, SharedBudgetCommitsPagesAsWritten) {
  backend::CpuBackend cpu(1);
  ModelOptions mo;
  mo.cache.page_rows = 4;
  auto m = Model::load(path_, cpu, mo);
  ASSERT_TRUE(m.is_ok()) << m.status().message();
  const Model& model = **m;
  const ModelConfig& c = model.config();
  auto plan = CachePlan::compute(c, 256, false, 4);
  ASSERT_TRUE(plan.is_ok());
  // Room for two sequences' fixed parts and a few pages, far less than two full plans.
  auto budget = std::make_shared<CacheBudget>(2 * plan->fixed() + 40 * 1024);
  SequenceOptions so;
  so.max_context = 256;
  so.shared_budget = budget;
  auto a = model.new_sequence(so), b = model.new_sequence(so);
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  EXPECT_EQ(budget->used(), 2 * plan->fixed());
  const auto t = tokens(16, 4);
  ASSERT_TRUE(model.prefill(**a, t).is_ok());
  // 16 tokens: 4 CSA entries + 4 keys (one page each) in each of 2 layers, 1 HCA entry (one
  // page) in each of 2 layers.
  const uint64_t pages_bytes = 2 * 4 * (256 + 128) * 4 + 2 * 4 * 256 * 4;
  EXPECT_EQ(budget->used(), 2 * plan->fixed() + pages_bytes);
  EXPECT_EQ((*a)->committed_bytes(), plan->fixed() + pages_bytes);
  const auto long_t = tokens(200, 5);
  const auto r = model.prefill(**b, long_t);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("budget"), std::string::npos) << r.status().message();
  EXPECT_EQ((*b)->position(), 0);
  a->reset();
  EXPECT_EQ(budget->used(), plan->fixed());  // b's fixed part only
}

// Sampling on the backend: a greedy token is the arg-max of the same step's logits; the
// padded single-token steps (decode buckets, graphs on a GPU) give exactly the tokens of
// unpadded steps, greedy and sampled, for 3 sequences (a bucket of 4) over 12 steps.
TEST_F(ForwardInvariance, SampledStepsEqualTheirLogitsAndBucketsChangeNothing) {
  const auto run = [&](bool buckets, bool greedy) {
    backend::CpuBackend cpu(2);
    ModelOptions mo;
    mo.decode_buckets = buckets;
    auto m = Model::load(path_, cpu, mo);
    EXPECT_TRUE(m.is_ok()) << m.status().message();
    SequenceOptions so;
    so.max_context = 128;
    std::vector<std::unique_ptr<Sequence>> seqs;
    std::vector<int32_t> last;
    for (int s = 0; s < 3; ++s) {
      seqs.push_back(std::move((*m)->new_sequence(so)).value());
      const auto t = tokens(5 + 7 * s, 40 + s);
      EXPECT_TRUE((*m)->prefill(*seqs.back(), t).is_ok());
      last.push_back(t.back());
    }
    std::vector<int32_t> out;
    for (int step = 0; step < 12; ++step) {
      std::vector<SampleSpec> specs(3);
      std::vector<BatchItem> batch;
      for (int s = 0; s < 3; ++s) {
        specs[s].temperature = greedy ? 0.0f : 0.8f;
        specs[s].top_k = s == 1 ? 40 : 0;
        specs[s].seed = 100 + s;
        specs[s].counter = static_cast<uint64_t>(seqs[s]->position());
        specs[s].adjust = {{last[s], 1.3f, 0.5f}};
        batch.push_back({seqs[s].get(), std::span<const int32_t>(&last[s], 1), false, false, &specs[s]});
      }
      ForwardOutput fo;
      const Status st = (*m)->forward(batch, fo);
      EXPECT_TRUE(st.is_ok()) << st.message();
      if (!st.is_ok()) return out;
      EXPECT_EQ(fo.rows, 0);
      for (int s = 0; s < 3; ++s) {
        EXPECT_GE(fo.tokens[s], 0);
        last[s] = fo.tokens[s];
        out.push_back(fo.tokens[s]);
      }
    }
    return out;
  };
  for (bool greedy : {true, false}) {
    const auto plain = run(false, greedy), padded = run(true, greedy);
    ASSERT_EQ(plain.size(), 36u);
    EXPECT_EQ(padded, plain) << (greedy ? "greedy" : "sampled");
  }

  // Greedy with no adjustment: the arg-max of the logits the same step returns.
  auto seq = sequence();
  const auto t = tokens(9, 50);
  ASSERT_TRUE(model_->prefill(*seq, std::span<const int32_t>(t.data(), 8)).is_ok());
  auto twin = model_->fork(*seq);
  ASSERT_TRUE(twin.is_ok());
  SampleSpec greedy;
  greedy.temperature = 0;
  const BatchItem sampled{seq.get(), std::span<const int32_t>(&t[8], 1), false, false, &greedy};
  ForwardOutput a;
  ASSERT_TRUE(model_->forward(std::span<const BatchItem>(&sampled, 1), a).is_ok());
  const auto logits = model_->decode(**twin, t[8]);
  ASSERT_TRUE(logits.is_ok());
  EXPECT_EQ(a.tokens[0], std::max_element(logits->begin(), logits->end()) - logits->begin());
}

}  // namespace
}  // namespace dsv4
