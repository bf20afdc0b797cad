// The step features on the GPU against the CPU backend: sampling (the op token for token on
// the same logits; whole decode runs replayed as CUDA graphs), GLP steering and KV grafts
// (the model's logits in Exact mode with QAT off, where the bound is 1e-5 per row), and
// graph replay against direct launches (identical tokens).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/matvec.h"
#include "backend/sampling.h"
#include "model/kv_graft.h"
#include "model/model.h"
#include "runtime/speculative.h"
#include "support/test_support.h"
#include "synth/presets.h"
#include "synth/synth.h"

namespace dsv4 {
namespace {

using backend::Tensor;

int32_t bits(float f) {
  int32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

class CudaStepFeatures : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<test::TempDir>();
    ModelConfig c = tiny_config();
    c.vocab_size = 512;
    c.context_length = 256;
    SynthOptions so;
    so.config = c;
    so.seed = 23;
    so.write_tokenizer = false;
    so.expert_type = GgmlType::Q8_0;
    so.dense_type = GgmlType::Q8_0;
    so.layout = WriteLayout::Bundled;
    path_ = (dir_->path() / "tiny.gguf").string();
    ASSERT_TRUE(write_synthetic_model(path_, so).is_ok());
    cpu_ = std::make_unique<backend::CpuBackend>(0);
    auto g = backend::CudaBackend::create({});
    ASSERT_TRUE(g.is_ok()) << g.status().message();
    gpu_ = std::move(g).value();
  }
  static void TearDownTestSuite() {
    gpu_.reset();
    cpu_.reset();
    dir_.reset();
  }
  void SetUp() override { ASSERT_TRUE(gpu_); }

  static std::unique_ptr<Model> load(backend::Backend& be, bool graphs = true,
                                     backend::MatmulMode matmul = backend::MatmulMode::Exact) {
    ModelOptions mo;
    mo.qat = false;
    mo.cache.max_sequences = 8;
    mo.graphs = graphs;
    mo.matmul = matmul;
    auto m = Model::load(path_, be, mo);
    EXPECT_TRUE(m.is_ok()) << m.status().message();
    return m.is_ok() ? std::move(m).value() : nullptr;
  }
  static std::vector<int32_t> tokens(size_t n, uint64_t salt) {
    std::mt19937_64 rng(salt);
    std::uniform_int_distribution<int32_t> id(0, 511);
    std::vector<int32_t> t(n);
    for (auto& x : t) x = id(rng);
    return t;
  }
  static double max_row_error(const std::vector<float>& got, const std::vector<float>& want) {
    EXPECT_EQ(got.size(), want.size());
    double worst = 0;
    for (size_t r = 0; r * 512 < std::min(got.size(), want.size()); ++r) {
      double num = 0, den = 0;
      for (size_t i = r * 512; i < (r + 1) * 512; ++i) {
        if (!std::isfinite(got[i])) return INFINITY;
        num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
        den += double(want[i]) * want[i];
      }
      worst = std::max(worst, std::sqrt(num / den));
    }
    return worst;
  }
  // Three sequences decode 12 steps sampled on the backend (a bucket of 4).
  static std::vector<int32_t> sampled_run(const Model& m, bool greedy) {
    SequenceOptions so;
    so.max_context = 128;
    std::vector<std::unique_ptr<Sequence>> seqs;
    std::vector<int32_t> last, out;
    for (int s = 0; s < 3; ++s) {
      seqs.push_back(std::move(m.new_sequence(so)).value());
      const auto t = tokens(5 + 9 * s, 40 + s);
      EXPECT_TRUE(m.prefill(*seqs.back(), t).is_ok());
      last.push_back(t.back());
    }
    for (int step = 0; step < 12; ++step) {
      std::vector<SampleSpec> specs(3);
      std::vector<BatchItem> batch;
      for (int s = 0; s < 3; ++s) {
        specs[s].temperature = greedy ? 0.0f : 0.9f;
        specs[s].top_p = greedy ? 1.0f : 0.9f;
        specs[s].seed = 7 + s;
        specs[s].counter = static_cast<uint64_t>(seqs[s]->position());
        batch.push_back({seqs[s].get(), std::span<const int32_t>(&last[s], 1), false, false, &specs[s]});
      }
      ForwardOutput fo;
      const Status st = m.forward(batch, fo);
      EXPECT_TRUE(st.is_ok()) << st.message();
      if (!st.is_ok()) return out;
      for (int s = 0; s < 3; ++s) out.push_back(last[s] = fo.tokens[s]);
    }
    return out;
  }

  static std::unique_ptr<test::TempDir> dir_;
  static std::string path_;
  static std::unique_ptr<backend::CpuBackend> cpu_;
  static std::unique_ptr<backend::CudaBackend> gpu_;
};

std::unique_ptr<test::TempDir> CudaStepFeatures::dir_;
std::string CudaStepFeatures::path_;
std::unique_ptr<backend::CpuBackend> CudaStepFeatures::cpu_;
std::unique_ptr<backend::CudaBackend> CudaStepFeatures::gpu_;

// The op on identical logits: the same token on both backends for every parameter set.
TEST_F(CudaStepFeatures, SampleOpMatchesTheCpuTokenForToken) {
  const int64_t rows = 48, vocab = 129280;
  std::mt19937_64 rng(99);
  std::vector<float> logits = test::random_normal(rows * vocab, rng, 2.0f);
  std::vector<int32_t> params;
  for (int64_t r = 0; r < rows; ++r) {
    const float t = r % 4 == 0 ? 0.0f : 0.5f + 0.1f * (r % 7);
    const float top_p = r % 3 == 0 ? 0.8f : 1.0f, min_p = r % 5 == 0 ? 0.05f : 0.0f;
    const int32_t top_k = r % 6 == 1 ? 40 : 0;
    params.insert(params.end(), {bits(t), bits(top_p), bits(min_p), top_k, static_cast<int32_t>(r), 0,
                                 static_cast<int32_t>(3 * r), 0});
  }
  const std::vector<int32_t> adjust = {2, 5, bits(1.5f), bits(0.25f), 9, 77, bits(1.0f), bits(-3.0f), -1, 0, 0, 0};
  std::vector<int32_t> tokens[2];
  backend::Backend* bes[2] = {cpu_.get(), gpu_.get()};
  for (int b = 0; b < 2; ++b) {
    backend::Backend& be = *bes[b];
    Tensor l = be.alloc(GgmlType::F32, std::vector<int64_t>{rows, vocab}).value();
    Tensor p = be.alloc(GgmlType::I32, std::vector<int64_t>{rows, backend::kSampleFields}).value();
    Tensor a = be.alloc(GgmlType::I32, std::vector<int64_t>{3, backend::kAdjustFields}).value();
    Tensor o = be.alloc(GgmlType::I32, std::vector<int64_t>{rows}).value();
    ASSERT_TRUE(be.upload(l, logits.data(), logits.size() * 4).is_ok());
    ASSERT_TRUE(be.upload(p, params.data(), params.size() * 4).is_ok());
    ASSERT_TRUE(be.upload(a, adjust.data(), adjust.size() * 4).is_ok());
    ASSERT_TRUE(be.sample(l, p, &a, o).is_ok());
    tokens[b].resize(rows);
    ASSERT_TRUE(be.download(o, tokens[b].data(), rows * 4).is_ok());
  }
  EXPECT_EQ(tokens[1], tokens[0]);
}

// The greedy arg-max where its vector loads could go wrong: rows that start off a 16-byte
// boundary (a column view), widths that leave a tail (not a multiple of 4), ties at the top
// (the lowest id wins), NaN anywhere (never wins) and rows of only -inf / NaN (token 0).
TEST_F(CudaStepFeatures, GreedyArgmaxTiesNaNAndUnalignedRows) {
  const int64_t rows = 24, stride = 130001;
  std::mt19937_64 rng(2026);
  // Few distinct values: every row has many ties at its maximum.
  std::vector<float> logits(rows * stride);
  std::uniform_int_distribution<int> level(0, 40);
  for (float& v : logits) v = 0.25f * static_cast<float>(level(rng)) - 3.0f;
  for (int64_t r = 0; r < rows; ++r) {
    float* row = logits.data() + r * stride;
    for (int64_t i = r; i < stride; i += 977) row[i] = NAN;
    if (r == 5) std::fill(row, row + stride, -INFINITY);
    if (r == 6) std::fill(row, row + stride, NAN);
    if (r == 7) row[stride - 1] = 100.0f;  // the maximum in the scalar tail
  }
  std::vector<int32_t> params;
  for (int64_t r = 0; r < rows; ++r)
    params.insert(params.end(), {bits(0.0f), bits(1.0f), bits(0.0f), 0, static_cast<int32_t>(r), 0, 0, 0});
  for (int64_t first : {int64_t{0}, int64_t{1}, int64_t{3}})
    for (int64_t width : {int64_t{129280}, int64_t{129997}, int64_t{5}}) {
      SCOPED_TRACE(::testing::Message() << "first column " << first << ", width " << width);
      std::vector<int32_t> tokens[2];
      backend::Backend* bes[2] = {cpu_.get(), gpu_.get()};
      for (int b = 0; b < 2; ++b) {
        backend::Backend& be = *bes[b];
        Tensor all = be.alloc(GgmlType::F32, std::vector<int64_t>{rows, stride}).value();
        Tensor p = be.alloc(GgmlType::I32, std::vector<int64_t>{rows, backend::kSampleFields}).value();
        Tensor o = be.alloc(GgmlType::I32, std::vector<int64_t>{rows}).value();
        ASSERT_TRUE(be.upload(all, logits.data(), logits.size() * 4).is_ok());
        ASSERT_TRUE(be.upload(p, params.data(), params.size() * 4).is_ok());
        const std::vector<int32_t> poison(rows, -7);
        ASSERT_TRUE(be.upload(o, poison.data(), rows * 4).is_ok());
        ASSERT_TRUE(be.sample(all.columns(first, width), p, nullptr, o).is_ok());
        tokens[b].resize(rows);
        ASSERT_TRUE(be.download(o, tokens[b].data(), rows * 4).is_ok());
      }
      EXPECT_EQ(tokens[1], tokens[0]);
      // The CPU's rule, restated: the first maximum of the non-NaN values, 0 if none is finite.
      for (int64_t r = 0; r < rows; ++r) {
        const float* row = logits.data() + r * stride + first;
        int32_t want = 0;
        for (int64_t i = 0; i < width; ++i)
          if (!std::isnan(row[i]) && (std::isnan(row[want]) || row[i] > row[want])) want = static_cast<int32_t>(i);
        if (!std::isfinite(row[want])) want = std::isinf(row[want]) && row[want] > 0 ? want : 0;
        EXPECT_EQ(tokens[1][r], want) << "row " << r;
      }
    }
}

TEST_F(CudaStepFeatures, SteerOpMatchesTheCpu) {
  const int64_t rows = 7, width = 4 * 256;
  std::mt19937_64 rng(5);
  const std::vector<float> x = test::random_normal(rows * width, rng);
  std::vector<float> dir = test::random_normal(width, rng), alpha = {0.0f, 1.0f, 0.5f, -2.0f, 1.0f, 0.0f, 3.0f};
  for (bool project : {true, false})
    for (int64_t dir_width : {int64_t{256}, width}) {
      std::vector<float> got[2];
      backend::Backend* bes[2] = {cpu_.get(), gpu_.get()};
      for (int b = 0; b < 2; ++b) {
        backend::Backend& be = *bes[b];
        Tensor xt = be.alloc(GgmlType::F32, std::vector<int64_t>{rows, width}).value();
        Tensor dt = be.alloc(GgmlType::F32, std::vector<int64_t>{dir_width}).value();
        Tensor at = be.alloc(GgmlType::F32, std::vector<int64_t>{rows}).value();
        ASSERT_TRUE(be.upload(xt, x.data(), x.size() * 4).is_ok());
        ASSERT_TRUE(be.upload(dt, dir.data(), dir_width * 4).is_ok());
        ASSERT_TRUE(be.upload(at, alpha.data(), alpha.size() * 4).is_ok());
        ASSERT_TRUE(be.steer(xt, dt, 256, project, at).is_ok());
        got[b].resize(x.size());
        ASSERT_TRUE(be.download(xt, got[b].data(), x.size() * 4).is_ok());
      }
      double worst = 0;
      for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, double(std::fabs(got[1][i] - got[0][i])));
      EXPECT_LE(worst, 1e-5) << (project ? "project" : "add") << " width " << dir_width;
      for (int64_t i = 0; i < width; ++i) EXPECT_EQ(got[1][i], x[i]);  // alpha 0: untouched
    }
}

// Sampled decode steps (bucketed, recorded as graphs and replayed on the GPU) give the CPU's
// tokens (greedy: the arg-max of logits within 1e-5; sampled: the same draw except where two
// candidates' noisy scores are within the logits' difference), and graph replay gives exactly
// the tokens of direct launches.
TEST_F(CudaStepFeatures, GraphReplayedDecodeMatchesTheCpu) {
  auto cm = load(*cpu_), gm = load(*gpu_), direct = load(*gpu_, false);
  ASSERT_TRUE(cm && gm && direct);
  for (bool greedy : {true, false}) {
    const auto want = sampled_run(*cm, greedy), got = sampled_run(*gm, greedy), plain = sampled_run(*direct, greedy);
    ASSERT_EQ(got.size(), 36u);
    EXPECT_EQ(got, plain) << "graph replay vs direct launches";
    int same = 0;
    for (size_t i = 0; i < got.size(); ++i) same += got[i] == want[i];
    if (greedy) EXPECT_EQ(same, 36);
    else EXPECT_GE(same, 32) << "sampled tokens equal to the CPU's";
  }
}

// Graph-recorded decode steps with lanes (a fork and a join per sublayer inside the graph)
// replay the tokens of a backend without lanes, also with a spin at every fork on either
// lane, greedy and sampled.
TEST_F(CudaStepFeatures, GraphsWithLanesReplayTheTokensWithout) {
  const auto backend_with = [](bool lanes, int delay_us, bool delay_main) {
    backend::CudaBackendOptions o;
    o.lanes = lanes;
    o.lane_delay_us = delay_us;
    o.lane_delay_main = delay_main;
    auto b = backend::CudaBackend::create(o);
    EXPECT_TRUE(b.is_ok()) << b.status().message();
    return b.is_ok() ? std::move(b).value() : nullptr;
  };
  auto plain = backend_with(false, 0, false), side = backend_with(true, 200, false), main = backend_with(true, 200, true);
  ASSERT_TRUE(plain && side && main);
  auto want_model = load(*plain), lanes_model = load(*gpu_), side_model = load(*side), main_model = load(*main);
  ASSERT_TRUE(want_model && lanes_model && side_model && main_model);
  for (bool greedy : {true, false}) {
    SCOPED_TRACE(greedy ? "greedy" : "sampled");
    const auto want = sampled_run(*want_model, greedy);
    ASSERT_EQ(want.size(), 36u);
    EXPECT_EQ(sampled_run(*lanes_model, greedy), want) << "lanes";
    EXPECT_EQ(sampled_run(*side_model, greedy), want) << "lanes, side lane delayed";
    EXPECT_EQ(sampled_run(*main_model, greedy), want) << "lanes, main lane delayed";
  }
}

// A scratch arena of many chunks (a 64 KB first chunk): the decode step that outgrew it is
// recorded without allocating (begin_step does not merge chunks while capturing), and a
// prefill that grows the arena after the graphs exist leaves their memory in place (no merge
// once a graph holds the addresses): the replayed tokens stay those of direct launches.
TEST_F(CudaStepFeatures, GraphsSurviveAGrowingScratch) {
  backend::CudaBackendOptions o;
  o.scratch_bytes = 64 << 10;
  auto small = backend::CudaBackend::create(o);
  ASSERT_TRUE(small.is_ok()) << small.status().message();
  auto m = load(**small), direct = load(*gpu_, false);
  ASSERT_TRUE(m && direct);
  const auto want = sampled_run(*direct, true);
  ASSERT_EQ(want.size(), 36u);
  EXPECT_EQ(sampled_run(*m, true), want) << "graphs recorded over a many-chunk arena";
  {  // grow the arena past what the recorded steps used
    SequenceOptions so;
    so.max_context = 200;
    auto seq = std::move(m->new_sequence(so)).value();
    ASSERT_TRUE(m->prefill(*seq, tokens(150, 9)).is_ok());
  }
  EXPECT_EQ(sampled_run(*m, true), want) << "replays after the arena grew";
}

TEST_F(CudaStepFeatures, SteeringAndGraftsMatchTheCpu) {
  auto cm = load(*cpu_), gm = load(*gpu_);
  ASSERT_TRUE(cm && gm);
  const ModelConfig& c = cm->config();
  SteeringFile f;
  f.mode = SteerMode::Project;
  f.hook = SteerHook::PostLayerStreams;
  f.model_identity = c.identity();
  std::mt19937_64 rng(31);
  f.directions = {{1, test::random_normal(size_t{c.hc_mult} * c.hidden, rng)}, {4, test::random_normal(c.hidden, rng)}};
  ASSERT_TRUE(cm->bind_steering(f, 0.8f).is_ok());
  ASSERT_TRUE(gm->bind_steering(f, 0.8f).is_ok());
  const auto p = tokens(32, 3), next = tokens(9, 4);
  SequenceOptions so;
  so.max_context = 128;
  std::vector<float> logits[2];
  Model* models[2] = {cm.get(), gm.get()};
  for (int b = 0; b < 2; ++b) {
    auto src = std::move(models[b]->new_sequence(so)).value();
    ASSERT_TRUE(models[b]->prefill(*src, p).is_ok());
    auto bank = models[b]->extract_graft(*src);
    ASSERT_TRUE(bank.is_ok()) << bank.status().message();
    SequenceOptions gso = so;
    gso.graft = std::make_shared<const KvGraft>(std::move(bank).value());
    auto g = models[b]->new_sequence(gso);
    ASSERT_TRUE(g.is_ok()) << g.status().message();
    auto r = models[b]->prefill(**g, next, true);
    ASSERT_TRUE(r.is_ok()) << r.status().message();
    logits[b] = *r;
  }
  EXPECT_LE(max_row_error(logits[1], logits[0]), 1e-5);
}

// MTP speculation on the GPU (greedy): the verify step is one graph-replayed step per
// (sequence bucket, k + 1 rows) with each row's arg-max picked on the device, the rollback
// Model::rewind. Its tokens must be plain greedy decoding's (device-sampled, graph-replayed
// one-row steps), for k = 1, 3, 4 and adaptive k, one sequence and three in a step, over 48
// tokens (the window of 8 wraps, compression blocks of 4 and 16 close many times):
//   exact mode      every case (each row's result does not depend on the rows beside it);
//   quantised mode  the cases whose verify steps have at most 8 rows (kRowKernelMaxRows:
//                   row-local by construction, as the plain steps of 4 rows are). Wider
//                   verify steps run the tensor-core products, whose sums run in another
//                   order than the row kernels', so a near-tie can flip, as it can between
//                   plain decoding at batch 4 and at batch 20 (docs/CUDA.md); those cases
//                   print where they first differ and are not asserted;
//   quantised, batch-invariant kernels (KernelChoice::batch_invariant)  every case.
TEST_F(CudaStepFeatures, SpeculativeGreedyMatchesPlainGreedy) {
  struct Mode {
    backend::MatmulMode matmul;
    bool invariant;
  };
  for (const Mode mm : {Mode{backend::MatmulMode::Exact, false}, Mode{backend::MatmulMode::Quantized, false},
                        Mode{backend::MatmulMode::Quantized, true}}) {
    const backend::MatmulMode mode = mm.matmul;
    SCOPED_TRACE(mode == backend::MatmulMode::Exact ? "exact" : mm.invariant ? "quantized, batch-invariant" : "quantized");
    cuda::KernelChoice choice;
    choice.batch_invariant = mm.invariant;
    cuda::set_kernel_choice(choice);
    auto m = load(*gpu_, true, mode);
    ASSERT_TRUE(m && m->has_mtp());
    constexpr size_t kTokens = 48;
    constexpr int kSeqs = 3;
    std::vector<std::vector<int32_t>> prompts, want(kSeqs);
    for (int s = 0; s < kSeqs; ++s) prompts.push_back(tokens(7 + 6 * s, 70 + s));
    {  // plain greedy, three sequences per step (a bucket of 4), sampled on the device
      SequenceOptions so;
      so.max_context = 160;
      std::vector<std::unique_ptr<Sequence>> seqs;
      std::vector<int32_t> last;
      for (int s = 0; s < kSeqs; ++s) {
        seqs.push_back(std::move(m->new_sequence(so)).value());
        auto logits = m->prefill(*seqs.back(), prompts[s]);
        ASSERT_TRUE(logits.is_ok());
        last.push_back(static_cast<int32_t>(std::max_element(logits->begin(), logits->end()) - logits->begin()));
        want[s].push_back(last.back());
      }
      SampleSpec greedy;
      greedy.temperature = 0;
      while (want[0].size() < kTokens) {
        std::vector<BatchItem> batch;
        for (int s = 0; s < kSeqs; ++s) batch.push_back({seqs[s].get(), std::span<const int32_t>(&last[s], 1), false, false, &greedy});
        ForwardOutput fo;
        ASSERT_TRUE(m->forward(batch, fo).is_ok());
        for (int s = 0; s < kSeqs; ++s) want[s].push_back(last[s] = fo.tokens[s]);
      }
    }
    for (const int k : {1, 3, 4, 0}) {  // 0: adaptive, up to 4
      for (const int n_seqs : {1, kSeqs}) {
        SCOPED_TRACE(::testing::Message() << "k " << (k ? std::to_string(k) : "adaptive") << ", " << n_seqs << " sequences");
        runtime::SpecOptions o;
        o.max_k = k ? k : 4;
        o.adaptive = k == 0;
        runtime::SpeculativeDecoder dec(*m, o);
        SequenceOptions so;
        so.max_context = 160;
        so.with_mtp = true;
        std::vector<std::unique_ptr<Sequence>> seqs;
        std::vector<runtime::SpecSequence> spec(n_seqs);
        std::vector<std::vector<int32_t>> got(n_seqs);
        std::vector<runtime::SpecSequence*> step;
        for (int s = 0; s < n_seqs; ++s) {
          seqs.push_back(std::move(m->new_sequence(so)).value());
          spec[s].sequence = seqs.back().get();
          auto first = dec.start(spec[s], prompts[s]);
          ASSERT_TRUE(first.is_ok()) << first.status().message();
          got[s].push_back(*first);
          step.push_back(&spec[s]);
        }
        std::vector<std::vector<int32_t>> emitted;
        while (std::any_of(got.begin(), got.end(), [](const auto& g) { return g.size() < kTokens; })) {
          const Status st = dec.step(step, emitted);
          ASSERT_TRUE(st.is_ok()) << st.message();
          for (int s = 0; s < n_seqs; ++s) got[s].insert(got[s].end(), emitted[s].begin(), emitted[s].end());
        }
        // Rows of the widest verify step: the bucket of sequences times k + 1.
        const int bucket = n_seqs == 1 ? 1 : 4, widest = bucket * ((k ? k : 4) + 1);
        const bool asserted = mode == backend::MatmulMode::Exact || mm.invariant || widest <= cuda::kRowKernelMaxRows;
        for (int s = 0; s < n_seqs; ++s) {
          got[s].resize(kTokens);
          if (asserted) {
            EXPECT_EQ(got[s], want[s]) << "sequence " << s;
          } else {
            const size_t first = std::mismatch(got[s].begin(), got[s].end(), want[s].begin()).first - got[s].begin();
            std::printf("[ measured ] quantized, %d-row verify steps, sequence %d: %s\n", widest, s,
                        first == kTokens ? "the same tokens" : ("first differs at token " + std::to_string(first)).c_str());
          }
          EXPECT_GT(spec[s].stats.drafted, 0);
        }
      }
    }
  }
  cuda::set_kernel_choice(cuda::KernelChoice{});
}


// A verify step's rows are its decode steps', bit for bit, in the quantised (default) mode:
// on a model of K-quant matrices (Q2_K experts, Q6_K where the widths allow, Q8_0 elsewhere),
// feeding 24 tokens one a step and 2, 3, 4, 5 (MTP verify of k = 1..4) or 8 a step gives the
// same logits and final streams, across the 8-token window's wraps and the 4- and 16-token
// compression blocks (matvec.h, kRowKernelMaxRows; attention_ops.cu's row-local splits).
// Then speculative greedy decoding at k = 1..4 and adaptive k, graph-replayed, equals plain
// greedy decoding token for token.
TEST_F(CudaStepFeatures, VerifyRowsAreDecodeStepsBitForBit) {
  cuda::set_kernel_choice(cuda::KernelChoice{});
  const std::string kquant = (dir_->path() / "kquant.gguf").string();
  {
    ModelConfig c = tiny_config();
    c.vocab_size = 512;
    c.context_length = 256;
    SynthOptions so;
    so.config = c;
    so.seed = 29;
    so.write_tokenizer = false;
    so.expert_type = GgmlType::Q2_K;
    so.dense_type = GgmlType::Q6_K;
    so.layout = WriteLayout::Bundled;
    ASSERT_TRUE(write_synthetic_model(kquant, so).is_ok());
  }
  const auto load_kquant = [&](bool graphs) -> std::unique_ptr<Model> {
    ModelOptions mo;
    mo.qat = false;
    mo.cache.max_sequences = 4;
    mo.graphs = graphs;
    mo.matmul = backend::MatmulMode::Quantized;
    auto m = Model::load(kquant, *gpu_, mo);
    EXPECT_TRUE(m.is_ok()) << m.status().message();
    return m.is_ok() ? std::move(m).value() : nullptr;
  };
  const std::vector<int32_t> prompt = tokens(13, 91), fed = tokens(24, 92);
  {
    auto m = load_kquant(false);
    ASSERT_TRUE(m);
    SequenceOptions so;
    so.max_context = 128;
    // Tokens fed `width` a step; every row's logits and final streams.
    const auto run = [&](size_t width, std::vector<float>& logits, std::vector<float>& streams) {
      auto seq = std::move(m->new_sequence(so)).value();
      ASSERT_TRUE(m->prefill(*seq, prompt).is_ok());
      for (size_t i = 0; i < fed.size(); i += width) {
        const size_t n = std::min(width, fed.size() - i);
        std::vector<BatchItem> batch{{seq.get(), std::span<const int32_t>(fed.data() + i, n), true, true, nullptr}};
        ForwardOutput fo;
        ASSERT_TRUE(m->forward(batch, fo).is_ok());
        ASSERT_EQ(fo.rows, static_cast<int64_t>(n));
        logits.insert(logits.end(), fo.logits.begin(), fo.logits.end());
        streams.insert(streams.end(), fo.streams.begin(), fo.streams.end());
      }
    };
    std::vector<float> want_logits, want_streams;
    run(1, want_logits, want_streams);
    ASSERT_EQ(want_logits.size(), fed.size() * 512);
    for (const float v : want_logits) ASSERT_TRUE(std::isfinite(v));
    for (const size_t width : {2, 3, 4, 5, 8}) {
      SCOPED_TRACE(::testing::Message() << width << " tokens a step");
      std::vector<float> logits, streams;
      run(width, logits, streams);
      ASSERT_EQ(logits.size(), want_logits.size());
      ASSERT_EQ(streams.size(), want_streams.size());
      for (size_t t = 0; t < fed.size(); ++t) {
        EXPECT_EQ(0, std::memcmp(logits.data() + t * 512, want_logits.data() + t * 512, 512 * sizeof(float)))
            << "logits of token " << t << " differ from its one-token step";
      }
      EXPECT_EQ(0, std::memcmp(streams.data(), want_streams.data(), streams.size() * sizeof(float)))
          << "final streams differ from the one-token steps'";
    }
  }
  // Greedy, device-sampled and graph-replayed: plain decoding against speculation.
  auto m = load_kquant(true);
  ASSERT_TRUE(m && m->has_mtp());
  constexpr size_t kTokens = 40;
  std::vector<int32_t> want;
  {
    SequenceOptions so;
    so.max_context = 160;
    auto seq = std::move(m->new_sequence(so)).value();
    auto logits = m->prefill(*seq, prompt);
    ASSERT_TRUE(logits.is_ok());
    int32_t last = static_cast<int32_t>(std::max_element(logits->begin(), logits->end()) - logits->begin());
    want.push_back(last);
    SampleSpec greedy;
    greedy.temperature = 0;
    while (want.size() < kTokens) {
      std::vector<BatchItem> batch{{seq.get(), std::span<const int32_t>(&last, 1), false, false, &greedy}};
      ForwardOutput fo;
      ASSERT_TRUE(m->forward(batch, fo).is_ok());
      want.push_back(last = fo.tokens[0]);
    }
  }
  for (const int k : {1, 2, 3, 4, 0}) {  // 0: adaptive, up to 4
    SCOPED_TRACE(::testing::Message() << "k " << (k ? std::to_string(k) : "adaptive"));
    runtime::SpecOptions o;
    o.max_k = k ? k : 4;
    o.adaptive = k == 0;
    runtime::SpeculativeDecoder dec(*m, o);
    SequenceOptions so;
    so.max_context = 160;
    so.with_mtp = true;
    auto seq = std::move(m->new_sequence(so)).value();
    runtime::SpecSequence spec;
    spec.sequence = seq.get();
    auto first = dec.start(spec, prompt);
    ASSERT_TRUE(first.is_ok()) << first.status().message();
    std::vector<int32_t> got{*first};
    std::vector<runtime::SpecSequence*> step{&spec};
    std::vector<std::vector<int32_t>> emitted;
    while (got.size() < kTokens) {
      const Status st = dec.step(step, emitted);
      ASSERT_TRUE(st.is_ok()) << st.message();
      got.insert(got.end(), emitted[0].begin(), emitted[0].end());
    }
    got.resize(kTokens);
    EXPECT_EQ(got, want);
    EXPECT_GT(spec.stats.drafted, 0);
  }
}

}  // namespace
}  // namespace dsv4
