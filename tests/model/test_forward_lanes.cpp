// The forward pass keeps the lanes' contract (backend.h: between a fork and its join, no op of
// one lane touches what an op of the other writes), checked on the CPU: the same model on a
// backend that runs every side-lane op only at the join, after the main lane's (the
// LaneReorderingBackend), gives the bits of the CPU running everything in program order, in
// chunked prefill, decode steps and a batch of sequences, QAT on and off, exact and fast
// numerics. The GPU runs the lanes at the same time (tests/cuda: LanesChangeNoBit); this is
// the check CI can hold without one. A planted violation shows the check can fail.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "model/model.h"
#include "support/lane_reordering_backend.h"
#include "support/test_support.h"
#include "support/tiny_synth.h"
#include "synth/presets.h"

namespace dsv4 {
namespace {

using backend::MatmulMode;

std::vector<int32_t> tokens(size_t n, uint64_t salt) {
  std::mt19937_64 rng(test::test_seed() + salt);
  std::uniform_int_distribution<int32_t> id(0, test::kTinyVocab - 1);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = id(rng);
  return t;
}

std::unique_ptr<Sequence> sequence(const Model& m) {
  SequenceOptions so;
  so.max_context = 128;
  auto s = m.new_sequence(so);
  EXPECT_TRUE(s.is_ok()) << s.status().message();
  return s.is_ok() ? std::move(s).value() : nullptr;
}

// The logits (every row, or with `all` false each step's last rows) of: a 70-token prompt in chunks of 16, 7, 1, 4, 12, 30 (each at most 64
// rows: the steps with lanes), 12 decode steps, and a step of three sequences (2, 9 and 33
// rows) followed by one mixing a decode row and a 6-row chunk.
std::vector<float> scenarios(const Model& m, bool all) {
  std::vector<float> out;
  const auto append = [&](const Result<std::vector<float>>& r) {
    EXPECT_TRUE(r.is_ok()) << r.status().message();
    if (r.is_ok()) out.insert(out.end(), r->begin(), r->end());
  };
  {
    auto seq = sequence(m);
    const auto t = tokens(70, 1);
    size_t at = 0;
    const std::vector<size_t> chunks = {16, 7, 1, 4, 12, 30};
    for (size_t i = 0; at < t.size(); ++i) {
      const size_t len = std::min(chunks[i % chunks.size()], t.size() - at);
      append(m.prefill(*seq, std::span<const int32_t>(t.data() + at, len), all));
      at += len;
    }
    for (const int32_t tok : tokens(12, 2)) append(m.decode(*seq, tok));
  }
  std::vector<std::unique_ptr<Sequence>> seqs;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<BatchItem> items;
  for (size_t i = 0; i < 3; ++i) {
    seqs.push_back(sequence(m));
    prompts.push_back(tokens(std::vector<size_t>{2, 9, 33}[i], 10 + i));
  }
  for (size_t i = 0; i < 3; ++i) items.push_back({seqs[i].get(), prompts[i], all, false});
  ForwardOutput fo;
  Status s = m.forward(items, fo);
  EXPECT_TRUE(s.is_ok()) << s.message();
  out.insert(out.end(), fo.logits.begin(), fo.logits.end());
  const auto more = tokens(7, 20);
  const std::vector<BatchItem> step = {{seqs[0].get(), std::span<const int32_t>(more.data(), 1), all, false},
                                       {seqs[2].get(), std::span<const int32_t>(more.data() + 1, 6), all, false}};
  s = m.forward(step, fo);
  EXPECT_TRUE(s.is_ok()) << s.message();
  out.insert(out.end(), fo.logits.begin(), fo.logits.end());
  return out;
}

TEST(ForwardLanes, SideLaneOpsRunLateGiveTheSameBits) {
  test::TempDir dir;
  const std::string path = (dir.path() / "tiny.gguf").string(), path41 = (dir.path() / "tiny41.gguf").string();
  ASSERT_TRUE(write_synthetic_model(path, test::tiny_synth_options(31, GgmlType::MXFP4, GgmlType::Q8_0)).is_ok());
  SynthOptions v41 = test::tiny_synth_options(32, GgmlType::MXFP4, GgmlType::Q8_0);
  v41.config = tiny41_config();  // its vocabulary: the Engram's compressed one is DeepSeek's
  v41.config.context_length = 256;
  const auto written = write_synthetic_model(path41, v41);
  ASSERT_TRUE(written.is_ok()) << written.status().message();
  struct Case {
    const char* what;
    std::string path;
    bool qat;
    MatmulMode mode;
  };
  for (const Case& k : {Case{"V4, exact, qat off", path, false, MatmulMode::Exact},
                        Case{"V4, exact, qat on", path, true, MatmulMode::Exact},
                        Case{"V4, fast, qat on", path, true, MatmulMode::Quantized},
                        Case{"V4.1, exact, qat on", path41, true, MatmulMode::Exact}}) {
    SCOPED_TRACE(k.what);
    ModelOptions mo;
    mo.qat = k.qat;
    mo.matmul = k.mode;
    mo.cache.max_sequences = 4;
    backend::CpuBackend in_order(2), inner(2);
    test::LaneReorderingBackend late(inner);
    auto a = Model::load(k.path, in_order, mo);
    auto b = Model::load(k.path, late, mo);
    ASSERT_TRUE(a.is_ok() && b.is_ok()) << (a.is_ok() ? b.status().message() : a.status().message());
    const bool all = k.path == path;  // V4.1's rows are 129280 wide: each step's last row only
    const std::vector<float> want = scenarios(**a, all), got = scenarios(**b, all);
    ASSERT_FALSE(want.empty());
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0)
        << "the side lane's ops run after the main lane's changed the logits";
    EXPECT_GT(late.deferred_ops(), 0) << "no op ran on a side lane";
  }
}

// The check can fail: a main-lane op that reads a side lane's result before the join reads
// the old value on the reordering backend, the new one in program order.
TEST(ForwardLanes, AMissingJoinChangesTheResult) {
  const auto run = [](backend::Backend& be) {
    std::vector<int64_t> shape = {4, 8};
    backend::Tensor t = be.alloc(GgmlType::F32, shape).value(), u = be.alloc(GgmlType::F32, shape).value();
    EXPECT_TRUE(be.fill(t, 2.0f).is_ok());
    EXPECT_TRUE(be.fork_lane(1).is_ok());
    EXPECT_TRUE(be.fill(t, 1.0f).is_ok());
    EXPECT_TRUE(be.main_lane().is_ok());
    EXPECT_TRUE(be.copy_rows(t, u).is_ok());  // reads the side lane's t without joining
    EXPECT_TRUE(be.join_lane(1).is_ok());
    float host[32];
    EXPECT_TRUE(be.download(u, host, sizeof host).is_ok());
    return host[0];
  };
  backend::CpuBackend cpu(1), inner(1);
  test::LaneReorderingBackend late(inner);
  EXPECT_EQ(run(cpu), 1.0f);
  EXPECT_EQ(run(late), 2.0f);
}

}  // namespace
}  // namespace dsv4
