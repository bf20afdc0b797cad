// GLP steering and KV grafts on a synthetic tiny model (CPU reference): strength 0 changes
// nothing, projection leaves no component along the direction, addition adds exactly, a
// steered run moves a chosen logit in the direction the arithmetic predicts, files fail
// closed; a bank made from a prompt plants exactly the rows prefilling it left.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "gguf/gguf_file.h"
#include "gguf/gguf_writer.h"
#include "gguf/quant.h"
#include "model/kv_graft.h"
#include "model/model.h"
#include "model/steering.h"
#include "model/trace.h"
#include "support/test_support.h"
#include "support/tiny_synth.h"
#include "synth/presets.h"
#include "synth/synth.h"

namespace dsv4 {
namespace {

class Interventions : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<test::TempDir>();
    // F32 dense weights: the head's rows are read back exactly below.
    SynthOptions so = test::tiny_synth_options(17, GgmlType::Q8_0, GgmlType::F32);
    so.layout = WriteLayout::Bundled;
    path_ = (dir_->path() / "tiny.gguf").string();
    ASSERT_TRUE(write_synthetic_model(path_, so).is_ok());
  }
  static void TearDownTestSuite() { dir_.reset(); }
  void SetUp() override {
    auto m = Model::load(path_, cpu_, {});
    ASSERT_TRUE(m.is_ok()) << m.status().message();
    model_ = std::move(m).value();
  }

  std::unique_ptr<Sequence> sequence(std::shared_ptr<const KvGraft> graft = nullptr) {
    SequenceOptions so;
    so.max_context = 256;
    so.graft = std::move(graft);
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
  std::vector<float> logits(const std::vector<int32_t>& t, ForwardTrace* trace = nullptr) {
    auto seq = sequence();
    const BatchItem item{seq.get(), t, true, false};
    ForwardOutput out;
    const Status st = model_->forward(std::span<const BatchItem>(&item, 1), out, trace);
    EXPECT_TRUE(st.is_ok()) << st.message();
    return out.logits;
  }
  SteeringFile file(SteerMode mode, SteerHook hook, std::vector<SteeringDirection> dirs) const {
    SteeringFile f;
    f.mode = mode;
    f.hook = hook;
    f.alpha = 1.0f;
    f.model_identity = model_->config().identity();
    f.directions = std::move(dirs);
    return f;
  }
  std::vector<float> random_direction(size_t n, uint64_t salt) {
    std::mt19937_64 rng(test::test_seed() + salt);
    return test::random_normal(n, rng);
  }

  static std::unique_ptr<test::TempDir> dir_;
  static std::string path_;
  backend::CpuBackend cpu_{2};
  std::unique_ptr<Model> model_;
};

std::unique_ptr<test::TempDir> Interventions::dir_;
std::string Interventions::path_;

TEST_F(Interventions, StrengthZeroIsBitIdentical) {
  const auto t = tokens(30, 1);
  const auto plain = logits(t);
  const uint32_t D = model_->config().hidden;
  for (SteerMode mode : {SteerMode::Project, SteerMode::Add}) {
    ASSERT_TRUE(model_->bind_steering(file(mode, SteerHook::FfnOut, {{2, random_direction(D, 2)}}), 0.0f).is_ok());
    EXPECT_EQ(logits(t), plain) << steer_mode_name(mode);
  }
  model_->unbind_steering();
  EXPECT_EQ(logits(t), plain);
}

// The hooked activation after projection has no component along the direction (to fp32
// rounding); addition adds exactly alpha * v; per-stream directions act on their slice.
TEST_F(Interventions, ProjectionRemovesAndAdditionAdds) {
  const auto t = tokens(20, 3);
  const uint32_t D = model_->config().hidden, hc = model_->config().hc_mult;
  const std::vector<float> d = random_direction(D, 4);
  double norm = 0;
  for (float v : d) norm += double(v) * v;
  norm = std::sqrt(norm);

  ASSERT_TRUE(model_->bind_steering(file(SteerMode::Project, SteerHook::FfnOut, {{3, d}}), 1.0f).is_ok());
  ForwardTrace trace;
  logits(t, &trace);
  const TracedTensor* before = trace.find("layers.3.ffn_out");
  const TracedTensor* after = trace.find("layers.3.ffn_out_steered");
  ASSERT_TRUE(before && after);
  // A random direction can be nearly orthogonal to one row by chance, so the precondition
  // (something to remove) is asked of all rows together: |x.d| over |x| is ~1/sqrt(D) there.
  double removed = 0, total = 0;
  for (int64_t r = 0; r < after->rows(); ++r) {
    double along = 0, size = 0, orig = 0;
    for (uint32_t i = 0; i < D; ++i) {
      along += after->f32[r * D + i] * d[i] / norm;
      size += double(after->f32[r * D + i]) * after->f32[r * D + i];
      orig += before->f32[r * D + i] * d[i] / norm;
    }
    EXPECT_LE(std::fabs(along), 1e-5 * std::sqrt(size)) << "row " << r;
    removed += orig * orig;
    for (uint32_t i = 0; i < D; ++i) total += double(before->f32[r * D + i]) * before->f32[r * D + i];
  }
  EXPECT_GT(std::sqrt(removed), 1e-2 * std::sqrt(total)) << "the test needs a component to remove";

  // Add mode, per-stream width at the post-layer hook: each stream slice gets alpha * v_s.
  const std::vector<float> v = random_direction(size_t{hc} * D, 5);
  const float alpha = 0.75f;
  ASSERT_TRUE(model_->bind_steering(file(SteerMode::Add, SteerHook::PostLayerStreams, {{1, v}}), alpha).is_ok());
  ForwardTrace trace2;
  logits(t, &trace2);
  const TracedTensor* s0 = trace2.find("layers.1.out_streams");
  const TracedTensor* s1 = trace2.find("layers.1.out_streams_steered");
  ASSERT_TRUE(s0 && s1);
  for (size_t i = 0; i < s1->f32.size(); ++i)
    ASSERT_EQ(s1->f32[i], s0->f32[i] + alpha * v[i % (size_t{hc} * D)]) << i;
  model_->unbind_steering();
}

// A direction whose effect the arithmetic predicts: v = W_out[k] * output_norm (elementwise)
// at the last layer's post-layer streams. Adding alpha v to every stream raises token k's
// logit relative to the rest; projecting it out leaves logit k ~ 0 (the head's collapse is
// a combination of the streams, and RMSNorm rescales: logit_k = v . h / rms).
TEST_F(Interventions, SteeringMovesTheChosenLogitAsPredicted) {
  auto file_r = gguf::GgufFile::open(path_);
  ASSERT_TRUE(file_r.is_ok());
  const ModelConfig& c = model_->config();
  const uint32_t D = c.hidden, last = c.n_layers - 1, k = 77;
  const gguf::TensorInfo* out = file_r->find_tensor("output.weight");
  const gguf::TensorInfo* norm = file_r->find_tensor("output_norm.weight");
  ASSERT_TRUE(out && norm && out->type == GgmlType::F32);
  std::vector<float> v(D), w(D);
  dequantize_row(norm->type, norm->data, w.data(), D);
  const float* row = reinterpret_cast<const float*>(out->data) + size_t{k} * D;
  for (uint32_t i = 0; i < D; ++i) v[i] = row[i] * w[i];

  const auto t = tokens(12, 6);
  const auto base = logits(t);
  const auto relative = [&](const std::vector<float>& l, int64_t r) {
    double mean = 0;
    for (uint32_t j = 0; j < c.vocab_size; ++j) mean += l[r * c.vocab_size + j];
    return l[r * c.vocab_size + k] - mean / c.vocab_size;
  };
  double previous = 0;
  for (float alpha : {0.0f, 2.0f, 5.0f}) {
    ASSERT_TRUE(model_->bind_steering(file(SteerMode::Add, SteerHook::PostLayerStreams, {{last, v}}), alpha).is_ok());
    const auto l = logits(t);
    double gain = 0;
    for (int64_t r = 0; r < 12; ++r) gain += relative(l, r) - relative(base, r);
    gain /= 12;
    if (alpha == 0.0f) EXPECT_EQ(gain, 0.0);
    else EXPECT_GT(gain, previous + 0.1) << "alpha " << alpha;  // a measured rise, growing with alpha
    previous = gain;
  }
  ASSERT_TRUE(model_->bind_steering(file(SteerMode::Project, SteerHook::PostLayerStreams, {{last, v}}), 1.0f).is_ok());
  const auto projected = logits(t);
  int had_a_component = 0;
  for (int64_t r = 0; r < 12; ++r) {
    double scale = 0;
    for (uint32_t j = 0; j < c.vocab_size; ++j) scale = std::max(scale, double(std::fabs(projected[r * c.vocab_size + j])));
    EXPECT_LE(std::fabs(projected[r * c.vocab_size + k]), 1e-4 * scale) << "row " << r;
    had_a_component += std::fabs(base[r * c.vocab_size + k]) > 1e-2 * scale;
  }
  EXPECT_GE(had_a_component, 6);  // the projection had something to remove
  model_->unbind_steering();
}

TEST_F(Interventions, SteeringFilesRoundTripAndFailClosed) {
  const uint32_t D = model_->config().hidden;
  const auto dir = dir_->path();
  SteeringFile f = file(SteerMode::Project, SteerHook::FfnOut, {{0, random_direction(D, 7)}, {4, random_direction(D, 8)}});
  f.alpha = 0.4f;
  ASSERT_TRUE(f.write((dir / "ok.gguf").string()).is_ok());
  auto r = SteeringFile::read((dir / "ok.gguf").string(), model_->config());
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(r->alpha, 0.4f);
  ASSERT_EQ(r->directions.size(), 2u);
  EXPECT_EQ(r->directions[1].values, f.directions[1].values);

  const auto refused = [&](SteeringFile bad, const char* name, const char* words) {
    const std::string p = (dir / name).string();
    ASSERT_TRUE(bad.write(p).is_ok());
    auto rr = SteeringFile::read(p, model_->config());
    ASSERT_FALSE(rr.is_ok()) << name;
    EXPECT_NE(rr.status().message().find(words), std::string::npos) << rr.status().message();
  };
  SteeringFile wide = f;
  wide.directions[0].values.resize(2 * D, 0.5f);  // not hidden wide, and the FFN hook takes no per-stream vector
  refused(wide, "wide.gguf", "width");
  SteeringFile outside = f;
  outside.directions[1].layer = model_->config().n_layers;
  refused(outside, "outside.gguf", "layer");
  SteeringFile nan = f;
  nan.directions[0].values[3] = std::nanf("");
  refused(nan, "nan.gguf", "non-finite");
  SteeringFile other = f;
  other.model_identity = "deepseek4 vocab=1";
  refused(other, "other.gguf", "another model");
  // An unknown mode cannot be written through SteeringFile; patch the key in a copy.
  {
    gguf::GgufWriter w((dir / "mode.gguf").string());
    w.set("glp.version", gguf::Value::u32(1));
    w.set("glp.mode", gguf::Value::string("scale"));
    w.set("glp.hook", gguf::Value::string("ffn_out_pre_residual"));
    w.set("glp.alpha", gguf::Value::f32(1));
    w.set("glp.model.identity", gguf::Value::string(model_->config().identity()));
    w.set("glp.layers", gguf::Value::array_i32({0}));
    ASSERT_TRUE(w.add_tensor("glp.dir.0", GgmlType::F32, {D}).is_ok());
    ASSERT_TRUE(w.begin().is_ok());
    std::vector<float> ones(D, 1.0f);
    ASSERT_TRUE(w.write_tensor_data({reinterpret_cast<const uint8_t*>(ones.data()), D * sizeof(float)}).is_ok());
    ASSERT_TRUE(w.finish().is_ok());
    auto rr = SteeringFile::read((dir / "mode.gguf").string(), model_->config());
    ASSERT_FALSE(rr.is_ok());
    EXPECT_NE(rr.status().message().find("glp.mode"), std::string::npos) << rr.status().message();
  }
}

// A bank made from prompt P plants, in every covered layer, exactly the compressed rows
// prefilling P left (bit-identical), and the grafted sequence starts at F = |P|.
TEST_F(Interventions, GraftFromAPromptPlantsItsRows) {
  const ModelConfig& c = model_->config();
  const auto p = tokens(32, 9);  // 2 x the largest ratio (16)
  auto src = sequence();
  ASSERT_TRUE(model_->prefill(*src, p).is_ok());
  auto bank = model_->extract_graft(*src);
  ASSERT_TRUE(bank.is_ok()) << bank.status().message();
  EXPECT_EQ(bank->footprint, 32);
  for (const KvGraftLayer& l : bank->layers) EXPECT_EQ(l.slots * static_cast<int64_t>(c.ratio(l.block)), 32);

  const std::string path = (dir_->path() / "bank.gguf").string();
  ASSERT_TRUE(bank->write(path, true).is_ok());
  auto read = KvGraft::read(path, c);
  ASSERT_TRUE(read.is_ok()) << read.status().message();
  EXPECT_EQ(read->hash, bank->hash);
  auto graft = std::make_shared<const KvGraft>(std::move(read).value());
  auto g = sequence(graft);
  ASSERT_TRUE(g);
  EXPECT_EQ(g->position(), 32);
  EXPECT_EQ(g->window_start(), 32);
  auto again = model_->extract_graft(*g);  // the grafted sequence is itself "grafted": refused
  EXPECT_FALSE(again.is_ok());
  for (const KvGraftLayer& l : graft->layers) {
    const LayerPlan& lp = model_->plan().layers[l.block];
    auto kv = model_->cache().read_rows(*g, lp.kv_list, 0, l.slots);
    ASSERT_TRUE(kv.is_ok());
    EXPECT_EQ(*kv, bank->find(l.block)->kv) << "layer " << l.block;
    if (lp.key_list >= 0) {
      auto keys = model_->cache().read_rows(*g, lp.key_list, 0, l.slots);
      ASSERT_TRUE(keys.is_ok());
      EXPECT_EQ(*keys, bank->find(l.block)->keys) << "layer " << l.block;
    }
  }
  // It decodes: finite logits, deterministic, and different from the ungrafted sequence.
  const auto next = tokens(5, 10);
  auto a = model_->prefill(*g, next, true);
  ASSERT_TRUE(a.is_ok()) << a.status().message();
  for (float x : *a) ASSERT_TRUE(std::isfinite(x));
  auto g2 = sequence(graft);
  EXPECT_EQ(*model_->prefill(*g2, next, true), *a);
  EXPECT_NE(logits(next), *a);
}

// One slot count for every layer (hf2q's banks): F = N x the largest ratio; the small-ratio
// layers have rows only just below F, and everything still runs.
TEST_F(Interventions, GraftFootprintAndRefusals) {
  const ModelConfig& c = model_->config();
  KvGraft g;
  g.model_identity = c.identity();
  std::mt19937_64 rng(test::test_seed() + 11);
  for (uint32_t b = 0; b < c.n_layers; ++b) {
    if (!c.ratio(b)) continue;
    KvGraftLayer l;
    l.block = b;
    l.slots = 3;
    l.kv = test::random_normal(3 * c.head_dim, rng, 0.5f);
    if (c.attention_kind(b) == AttentionKind::CSA) l.keys = test::random_normal(3 * c.index_head_dim, rng, 0.5f);
    g.layers.push_back(l);
  }
  ASSERT_TRUE(g.finalize(c).is_ok());
  uint32_t max_ratio = 0;
  for (uint32_t b = 0; b < c.n_layers; ++b) max_ratio = std::max(max_ratio, c.ratio(b));
  EXPECT_EQ(g.footprint, 3 * int64_t{max_ratio});
  auto s = sequence(std::make_shared<const KvGraft>(g));
  ASSERT_TRUE(s);
  EXPECT_EQ(s->position(), g.footprint);
  auto r = model_->prefill(*s, tokens(9, 12), true);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  for (float x : *r) ASSERT_TRUE(std::isfinite(x));

  KvGraft wrong = g;
  wrong.layers[0].kv.pop_back();
  EXPECT_FALSE(wrong.finalize(c).is_ok());
  KvGraft other = g;
  other.model_identity = "deepseek4 vocab=7";
  SequenceOptions so;
  so.max_context = 256;
  so.graft = std::make_shared<const KvGraft>(other);
  auto refused = model_->new_sequence(so);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.status().message().find("another model"), std::string::npos);
  const std::string path = (dir_->path() / "other.gguf").string();
  ASSERT_TRUE(other.write(path, true).is_ok());
  EXPECT_FALSE(KvGraft::read(path, c).is_ok());
}

}  // namespace
}  // namespace dsv4
