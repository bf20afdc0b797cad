// The whole model on the CUDA backend against the CPU backend, on a synthetic tiny model (the
// fixture's geometry, random weights; tests/model/test_forward_invariance.cpp draws the same):
// a 70-token prefill, chunked prefill, decode steps and a batch of four sequences, QAT on and
// off, Exact and Quantized; the CUDA backend's determinism and batch invariance.
//
// Bounds (docs/CUDA.md, "CUDA backend: the model"):
// * Exact, QAT off: per-row relative L2 of the logits <= 1e-5 (the Exact products are
//   bit-identical to the CPU's; what remains is the odd last-bit difference of a library
//   function or an attention sum, amplified about tenfold by the model).
// * Exact, QAT on: the FP8/FP4 roundings turn any last-bit difference into a full rounding
//   step of one element (2^-4 relative for e4m3, 2^-2 for e2m1), and every later token reads
//   it. Measured on the CPU with one ulp of noise on 0.01%-10% of the matmul outputs (24 runs):
//   median per-row error <= 2.5e-4 with a run of flips early in the sequence, max <= 8.7e-2.
//   The test asserts median <= 1e-3 and arg-max agreement >= 95% (the fixture README's QAT-on
//   bars) and prints how many rows exceed 1e-5 and the max (0.13 seen on the H200 in one row
//   of the batch scenario): when every op is bit-identical (the goal) that count is 0.
// * Quantized (Q8 activations for 1-16 rows, BF16 GEMMs for more) against the CPU's Exact:
//   the CPU's own Quantized mode on this random model (70 prefill + 10 decode rows, 12 token
//   draws) measured medians 0.035-0.17 (QAT off) and 0.12-0.22 (QAT on), maxima up to 0.76,
//   argmax agreement 60-90%: errors of ~0.5% per product amplified by six random layers, and
//   the QAT roundings on top. The CUDA backend's BF16 GEMMs round less than Q8 and its matvec
//   rounds as the CPU does, so the test asserts median <= 0.35 and max <= 1.0 per scenario
//   (unrelated logits give ~1.4), argmax agreement >= 50% over all rows, and two runs
//   bit-identical; it prints the CPU Quantized figures beside the CUDA ones.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/matvec.h"
#include "model/model.h"
#include "support/test_support.h"
#include "synth/presets.h"
#include "synth/synth.h"

namespace dsv4 {
namespace {

using backend::MatmulMode;

constexpr int64_t kVocab = 512;
constexpr double kExactBound = 1e-5;
constexpr double kQatMedianBound = 1e-3;
constexpr double kQuantizedMedianBound = 0.35;
constexpr double kQuantizedMaxBound = 1.0;

uint64_t seed_for(uint64_t fixed) { return std::getenv("DSV4_TEST_SEED") ? test::test_seed() ^ fixed : fixed; }

struct Stats {
  double median = 0, max = 0;
  int64_t rows = 0, above = 0, argmax_agree = 0;
  std::string text() const {
    return "median " + std::to_string(median) + ", max " + std::to_string(max) + ", " + std::to_string(above) + " of " +
           std::to_string(rows) + " rows above 1e-5, argmax agreement " + std::to_string(argmax_agree) + "/" +
           std::to_string(rows);
  }
};

Stats compare(const std::vector<float>& got, const std::vector<float>& want) {
  Stats s;
  EXPECT_EQ(got.size(), want.size());
  s.rows = static_cast<int64_t>(std::min(got.size(), want.size()) / kVocab);
  std::vector<double> e;
  for (int64_t r = 0; r < s.rows; ++r) {
    double num = 0, den = 0;
    bool finite = true;
    for (int64_t i = 0; i < kVocab; ++i) {
      const double g = got[r * kVocab + i], w = want[r * kVocab + i];
      finite = finite && std::isfinite(g);
      num += (g - w) * (g - w);
      den += w * w;
    }
    e.push_back(finite ? std::sqrt(num / den) : INFINITY);
    s.above += e.back() > kExactBound;
    const auto* g = &got[r * kVocab];
    const auto* w = &want[r * kVocab];
    s.argmax_agree += std::max_element(g, g + kVocab) - g == std::max_element(w, w + kVocab) - w;
  }
  if (e.empty()) return s;
  s.max = *std::max_element(e.begin(), e.end());
  std::sort(e.begin(), e.end());
  s.median = e[e.size() / 2];
  return s;
}

// Every logits row of each scenario, in a fixed order.
struct Scenarios {
  std::vector<float> prefill, chunked, decode, batch;
};

class CudaModel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    setenv("DSV4_POISON_SCRATCH", "1", 1);
    dir_ = std::make_unique<test::TempDir>();
    ModelConfig c = tiny_config();
    c.vocab_size = kVocab;
    c.context_length = 256;
    SynthOptions so;
    so.config = c;
    so.seed = 7;
    so.write_tokenizer = false;
    so.expert_type = GgmlType::MXFP4;
    so.dense_type = GgmlType::Q8_0;
    path_ = (dir_->path() / "tiny.gguf").string();
    auto r = write_synthetic_model(path_, so);
    ASSERT_TRUE(r.is_ok()) << r.status().message();
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
  void SetUp() override { ASSERT_TRUE(gpu_) << "no CUDA backend"; }

  static std::unique_ptr<Model> load(backend::Backend& be, bool qat, MatmulMode mode, const std::string& path = path_) {
    ModelOptions mo;
    mo.qat = qat;
    mo.matmul = mode;
    mo.cache.max_sequences = 8;
    auto m = Model::load(path, be, mo);
    EXPECT_TRUE(m.is_ok()) << m.status().message();
    return m.is_ok() ? std::move(m).value() : nullptr;
  }
  static std::vector<int32_t> tokens(size_t n, uint64_t salt) {
    std::mt19937_64 rng(seed_for(salt));
    std::uniform_int_distribution<int32_t> id(0, kVocab - 1);
    std::vector<int32_t> t(n);
    for (auto& x : t) x = id(rng);
    return t;
  }
  static std::unique_ptr<Sequence> sequence(const Model& m) {
    SequenceOptions so;
    so.max_context = 128;
    auto s = m.new_sequence(so);
    EXPECT_TRUE(s.is_ok()) << s.status().message();
    return s.is_ok() ? std::move(s).value() : nullptr;
  }
  // Every token's logits, in chunks following `chunks` cyclically.
  static std::vector<float> prefill(const Model& m, const std::vector<int32_t>& t, const std::vector<size_t>& chunks) {
    auto seq = sequence(m);
    std::vector<float> out;
    if (!seq) return out;
    size_t at = 0;
    for (size_t i = 0; at < t.size(); ++i) {
      const size_t len = std::min(chunks[i % chunks.size()], t.size() - at);
      auto r = m.prefill(*seq, std::span<const int32_t>(t.data() + at, len), true);
      EXPECT_TRUE(r.is_ok()) << r.status().message();
      if (!r.is_ok()) return {};
      out.insert(out.end(), r->begin(), r->end());
      at += len;
    }
    return out;
  }
  // A prompt, then one token per step: the prompt's last logits and each step's.
  static std::vector<float> decode(const Model& m, const std::vector<int32_t>& t, size_t prompt) {
    auto seq = sequence(m);
    if (!seq) return {};
    auto r = m.prefill(*seq, std::span<const int32_t>(t.data(), prompt), false);
    EXPECT_TRUE(r.is_ok()) << r.status().message();
    if (!r.is_ok()) return {};
    std::vector<float> out = *r;
    for (size_t i = prompt; i < t.size(); ++i) {
      auto d = m.decode(*seq, t[i]);
      EXPECT_TRUE(d.is_ok()) << d.status().message();
      if (!d.is_ok()) return {};
      out.insert(out.end(), d->begin(), d->end());
    }
    return out;
  }
  // Four sequences of different lengths in one step, then a step mixing a decode and a
  // prefill chunk.
  static std::vector<float> batch(const Model& m, const std::vector<std::vector<int32_t>>& toks,
                                  const std::vector<int32_t>& more) {
    std::vector<std::unique_ptr<Sequence>> seqs;
    std::vector<BatchItem> items;
    for (const auto& t : toks) {
      seqs.push_back(sequence(m));
      if (!seqs.back()) return {};
      items.push_back({seqs.back().get(), t, true, false});
    }
    ForwardOutput out;
    const Status s = m.forward(items, out);
    EXPECT_TRUE(s.is_ok()) << s.message();
    std::vector<float> all = out.logits;
    const std::vector<BatchItem> step = {{seqs[0].get(), std::span<const int32_t>(more.data(), 1), true, false},
                                         {seqs[3].get(), std::span<const int32_t>(more.data() + 1, 6), true, false}};
    const Status s2 = m.forward(step, out);
    EXPECT_TRUE(s2.is_ok()) << s2.message();
    all.insert(all.end(), out.logits.begin(), out.logits.end());
    return all;
  }

  static Scenarios run(const Model& m) {
    Scenarios s;
    const auto t = tokens(70, 1);
    s.prefill = prefill(m, t, {t.size()});
    s.chunked = prefill(m, t, {16, 7, 1, 4, 12, 30});
    s.decode = decode(m, tokens(32, 2), 20);
    std::vector<std::vector<int32_t>> toks;
    for (size_t i = 0; i < 4; ++i) toks.push_back(tokens(std::vector<size_t>{2, 9, 33, 50}[i], 10 + i));
    s.batch = batch(m, toks, tokens(7, 20));
    return s;
  }

  static std::unique_ptr<test::TempDir> dir_;
  static std::string path_;
  static std::unique_ptr<backend::CpuBackend> cpu_;
  static std::unique_ptr<backend::CudaBackend> gpu_;
};

std::unique_ptr<test::TempDir> CudaModel::dir_;
std::string CudaModel::path_;
std::unique_ptr<backend::CpuBackend> CudaModel::cpu_;
std::unique_ptr<backend::CudaBackend> CudaModel::gpu_;

const char* kNames[] = {"70-token prefill", "chunked prefill", "decode steps", "batch of 4 sequences"};

std::vector<const std::vector<float>*> parts(const Scenarios& s) { return {&s.prefill, &s.chunked, &s.decode, &s.batch}; }

TEST_F(CudaModel, ExactMatchesCpu) {
  for (bool qat : {false, true}) {
    auto cm = load(*cpu_, qat, MatmulMode::Exact);
    auto gm = load(*gpu_, qat, MatmulMode::Exact);
    ASSERT_TRUE(cm && gm);
    const Scenarios want = run(*cm), got = run(*gm);
    for (size_t i = 0; i < 4; ++i) {
      const Stats s = compare(*parts(got)[i], *parts(want)[i]);
      const std::string what = std::string("exact, qat ") + (qat ? "on" : "off") + ", " + kNames[i] + ": " + s.text();
      ASSERT_GT(s.rows, 0) << what;
      if (!qat) {
        EXPECT_LE(s.max, kExactBound) << what;
      } else {  // statistical, as the fixture's QAT-on bars: median and arg-max agreement
        EXPECT_LE(s.median, kQatMedianBound) << what;
        EXPECT_GE(s.argmax_agree * 100, s.rows * 95) << what;
        if (s.above > 0) std::printf("[ NOTE     ] %s (FP8/FP4 rounding flips)\n", what.c_str());
      }
    }
  }
}

// The same run twice gives the same bits; a sequence's logits do not depend on the chunking
// or on the sequences it shares a step with.
TEST_F(CudaModel, ExactDeterministicAndBatchInvariant) {
  for (bool qat : {false, true}) {
    auto gm = load(*gpu_, qat, MatmulMode::Exact);
    ASSERT_TRUE(gm);
    const std::string mode = std::string("exact, qat ") + (qat ? "on" : "off");
    const Scenarios a = run(*gm), b = run(*gm);
    for (size_t i = 0; i < 4; ++i) EXPECT_TRUE(*parts(a)[i] == *parts(b)[i]) << mode << ", " << kNames[i] << ": runs differ";
    EXPECT_TRUE(a.prefill == a.chunked) << mode << ": chunked prefill differs from one chunk";

    const std::vector<size_t> lengths = {2, 9, 33, 50};
    std::vector<std::vector<int32_t>> toks;
    for (size_t i = 0; i < 4; ++i) toks.push_back(tokens(lengths[i], 10 + i));
    size_t row = 0;
    for (size_t i = 0; i < 4; ++i) {
      const auto alone = prefill(*gm, toks[i], {lengths[i]});
      const std::vector<float> in_batch(a.batch.begin() + row * kVocab, a.batch.begin() + (row + lengths[i]) * kVocab);
      EXPECT_TRUE(alone == in_batch) << mode << ": sequence " << i << " alone vs with 3 others";
      row += lengths[i];
    }
  }
}

// Batch-invariant mode (CudaBackendOptions::batch_invariant) in the production numerics: a
// row's logits are the same bits whether its sequence steps alone, with five others (24 rows
// a step: past the 16-row slices of the products and the 16-token slices of the experts), or
// one token at a time instead of in chunks of 3-4 tokens (what MTP speculation's verify rows
// need to give plain decoding's tokens).
TEST_F(CudaModel, QuantizedBatchInvariant) {
  cuda::KernelChoice invariant;
  invariant.batch_invariant = true;
  cuda::set_kernel_choice(invariant);
  for (bool qat : {false, true}) {
    SCOPED_TRACE(qat ? "qat on" : "qat off");
    auto gm = load(*gpu_, qat, MatmulMode::Quantized);
    ASSERT_TRUE(gm);
    constexpr int kSeqs = 6;
    const std::vector<size_t> chunks = {4, 1, 3, 4, 2};  // tokens per step after the prompt
    size_t fed = 0;
    for (size_t c : chunks) fed += c;
    std::vector<std::vector<int32_t>> prompts, more;
    for (int i = 0; i < kSeqs; ++i) {
      prompts.push_back(tokens(3 + 7 * i, 40 + i));
      more.push_back(tokens(fed, 50 + i));
    }
    // Every step's logits rows of every sequence: logits[sequence] in token order.
    const auto run = [&](bool together, bool one_by_one) {
      std::vector<std::unique_ptr<Sequence>> seqs;
      for (int i = 0; i < kSeqs; ++i) {
        seqs.push_back(sequence(*gm));
        EXPECT_TRUE(seqs.back() && gm->prefill(*seqs.back(), prompts[i], false).is_ok());
      }
      std::vector<std::vector<float>> logits(kSeqs);
      size_t at = 0;
      for (const size_t c : chunks) {
        const size_t per_step = one_by_one ? 1 : c;
        for (size_t done = 0; done < c; done += per_step) {
          std::vector<BatchItem> items;
          for (int i = 0; i < kSeqs; ++i) {
            items.push_back({seqs[i].get(), std::span<const int32_t>(more[i].data() + at + done, per_step), true, false});
            if (!together) {
              ForwardOutput out;
              const Status st = gm->forward(items, out);
              EXPECT_TRUE(st.is_ok()) << st.message();
              logits[i].insert(logits[i].end(), out.logits.begin(), out.logits.end());
              items.clear();
            }
          }
          if (together) {
            ForwardOutput out;
            const Status st = gm->forward(items, out);
            EXPECT_TRUE(st.is_ok()) << st.message();
            for (int i = 0; i < kSeqs; ++i)
              logits[i].insert(logits[i].end(), out.logits.begin() + i * per_step * kVocab,
                               out.logits.begin() + (i + 1) * per_step * kVocab);
          }
        }
        at += c;
      }
      return logits;
    };
    const auto together = run(true, false), alone = run(false, false), single = run(false, true);
    for (int i = 0; i < kSeqs; ++i) {
      ASSERT_EQ(together[i].size(), fed * kVocab);
      EXPECT_TRUE(std::all_of(together[i].begin(), together[i].end(), [](float v) { return std::isfinite(v); }));
      EXPECT_TRUE(together[i] == alone[i]) << "sequence " << i << ": with 5 others vs alone";
      EXPECT_TRUE(alone[i] == single[i]) << "sequence " << i << ": chunks of 1-4 tokens vs one token per step";
    }
    if (!qat) {  // what the mode is for: the default kernels give other bits in the 24-row steps
      cuda::set_kernel_choice(cuda::KernelChoice{});
      auto dm = load(*gpu_, qat, MatmulMode::Quantized);
      ASSERT_TRUE(dm);
      std::swap(gm, dm);
      const auto d_together = run(true, false), d_alone = run(false, false);
      int differ = 0;
      for (int i = 0; i < kSeqs; ++i) differ += d_together[i] != d_alone[i];
      std::printf("[ NOTE     ] default kernels: %d of %d sequences' logits differ with 5 others vs alone\n", differ,
                  kSeqs);
      std::swap(gm, dm);
      cuda::set_kernel_choice(invariant);
    }
  }
  cuda::set_kernel_choice(cuda::KernelChoice{});
}

TEST_F(CudaModel, QuantizedCloseToCpu) {
  for (bool qat : {false, true}) {
    auto exact = load(*cpu_, qat, MatmulMode::Exact);
    auto cpu_q = load(*cpu_, qat, MatmulMode::Quantized);
    auto gpu_q = load(*gpu_, qat, MatmulMode::Quantized);
    ASSERT_TRUE(exact && cpu_q && gpu_q);
    const Scenarios want = run(*exact), cq = run(*cpu_q), gq = run(*gpu_q), gq2 = run(*gpu_q);
    int64_t rows = 0, agree = 0;
    for (size_t i = 0; i < 4; ++i) {
      const Stats cpu_s = compare(*parts(cq)[i], *parts(want)[i]);
      const Stats s = compare(*parts(gq)[i], *parts(want)[i]);
      const std::string what = std::string("quantized, qat ") + (qat ? "on" : "off") + ", " + kNames[i] +
                               ": cuda " + s.text() + "; cpu quantized " + cpu_s.text();
      std::printf("[ NOTE     ] %s\n", what.c_str());
      ASSERT_GT(s.rows, 0) << what;
      EXPECT_LE(s.median, kQuantizedMedianBound) << what;
      EXPECT_LE(s.max, kQuantizedMaxBound) << what;
      EXPECT_TRUE(*parts(gq)[i] == *parts(gq2)[i]) << what << ": two runs differ";
      rows += s.rows;
      agree += s.argmax_agree;
    }
    EXPECT_GE(2 * agree, rows) << "quantized, qat " << (qat ? "on" : "off") << ": argmax agrees on " << agree << " of "
                               << rows << " rows";
  }
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Backend lanes (backend.h: a layer's KV path, compressors and shared expert on a second
// stream in steps of up to 64 rows) change no bit: the scenarios' logits with lanes on, off,
// and on with a 300 us spin at every fork on the side lane (a missing join lets the main lane
// read what the side lane has not written yet) or on the main lane (a side lane reading
// main-lane work it did not wait for), in both numerics; the same with BF16 dense weights,
// whose 17-64-row products take the side lane's own cuBLASLt buffers (the 30-row chunk).
TEST_F(CudaModel, LanesChangeNoBit) {
  EXPECT_EQ(gpu_->fork_lane(0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_->join_lane(backend::Backend::kMaxLanes + 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cpu_->fork_lane(2).code(), StatusCode::kInvalidArgument);
  std::vector<std::unique_ptr<backend::CudaBackend>> others;
  const std::vector<std::string> names = {"lanes off", "side lane delayed", "main lane delayed"};
  for (int v = 0; v < 3; ++v) {
    backend::CudaBackendOptions o;
    o.lanes = v != 0;
    o.lane_delay_us = v == 0 ? 0 : 300;
    o.lane_delay_main = v == 2;
    auto g = backend::CudaBackend::create(o);
    ASSERT_TRUE(g.is_ok()) << g.status().message();
    others.push_back(std::move(g).value());
  }
  SynthOptions so;
  so.config = tiny_config();
  so.config.vocab_size = kVocab;
  so.config.context_length = 256;
  so.seed = 11;
  so.write_tokenizer = false;
  so.expert_type = GgmlType::Q8_0;
  so.dense_type = GgmlType::BF16;
  const std::string bf16_path = (dir_->path() / "tiny-bf16.gguf").string();
  ASSERT_TRUE(write_synthetic_model(bf16_path, so).is_ok());
  struct Case {
    const char* what;
    bool qat;
    MatmulMode mode;
    std::string path;
  };
  for (const Case& k : {Case{"exact, qat on", true, MatmulMode::Exact, path_},
                        Case{"quantized, qat on", true, MatmulMode::Quantized, path_},
                        Case{"quantized, qat off, bf16 weights", false, MatmulMode::Quantized, bf16_path}}) {
    auto base = load(*gpu_, k.qat, k.mode, k.path);
    ASSERT_TRUE(base);
    const Scenarios want = run(*base);
    for (int v = 0; v < 3; ++v) {
      auto m = load(*others[v], k.qat, k.mode, k.path);
      ASSERT_TRUE(m);
      const Scenarios got = run(*m);
      for (size_t i = 0; i < 4; ++i) {
        ASSERT_FALSE(parts(want)[i]->empty());
        EXPECT_TRUE(same_bits(*parts(got)[i], *parts(want)[i])) << k.what << ", " << names[v] << ", " << kNames[i];
      }
    }
  }
}

// A hyper-connection site's mixes and hc_pre_norm as one cluster launch (hc_pre_norm_from_fn,
// V4's geometry: 4 streams of 4096) change no bit: a three-layer model at hidden 4096 in the
// Float32 products' numerics (Quantized, QAT on), its decode steps and a batch step of four
// sequences (rows 2..50, then 7) with the cluster on and off.
TEST_F(CudaModel, HyperConnectionClusterChangesNoBit) {
  backend::CudaBackendOptions off;
  off.hc_cluster = false;
  auto g = backend::CudaBackend::create(off);
  ASSERT_TRUE(g.is_ok()) << g.status().message();
  std::unique_ptr<backend::CudaBackend> two_kernels = std::move(g).value();
  EXPECT_TRUE(gpu_->hc_cluster_active());
  EXPECT_FALSE(two_kernels->hc_cluster_active());
  ModelConfig wide = tiny_config();
  wide.hidden = 4096;
  const auto cut = keep_first_layers(wide, 3);  // a window, a CSA and an HCA layer, and the MTP block
  ASSERT_TRUE(cut.is_ok()) << cut.status().message();
  SynthOptions so;
  so.config = *cut;
  so.config.vocab_size = kVocab;
  so.config.context_length = 256;
  so.seed = 13;
  so.write_tokenizer = false;
  so.expert_type = GgmlType::Q8_0;
  so.dense_type = GgmlType::Q8_0;
  const std::string path = (dir_->path() / "tiny-4096.gguf").string();
  const auto written = write_synthetic_model(path, so);
  ASSERT_TRUE(written.is_ok()) << written.status().message();
  auto on_model = load(*gpu_, true, MatmulMode::Quantized, path);
  auto off_model = load(*two_kernels, true, MatmulMode::Quantized, path);
  ASSERT_TRUE(on_model && off_model);
  const auto want = decode(*off_model, tokens(24, 2), 12);
  const auto got = decode(*on_model, tokens(24, 2), 12);
  ASSERT_FALSE(want.empty());
  EXPECT_TRUE(same_bits(got, want)) << "decode steps";
  std::vector<std::vector<int32_t>> toks;
  for (size_t i = 0; i < 4; ++i) toks.push_back(tokens(std::vector<size_t>{2, 9, 33, 50}[i], 10 + i));
  const auto want_batch = batch(*off_model, toks, tokens(7, 20));
  const auto got_batch = batch(*on_model, toks, tokens(7, 20));
  ASSERT_FALSE(want_batch.empty());
  EXPECT_TRUE(same_bits(got_batch, want_batch)) << "batch of 4 sequences";
}

}  // namespace
}  // namespace dsv4
