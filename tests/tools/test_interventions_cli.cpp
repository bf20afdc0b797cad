// `dsv4 glp make`, `dsv4 graft make`, `dsv4 info --kv-graft` and the --glp / --kv-graft
// flags end to end through the built program, on a synthetic three-layer model (ratios 0,
// 4, 16), checked against the same quantities computed here through the Model API: a
// direction is the mean difference of the hooked activations (recomputed in double), a
// bank made by the CLI and planted with --kv-graft gives exactly the logits of planting the
// prompt's own compressed rows, strength 0 is bit-identical to no steering.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "gguf/gguf_file.h"
#include "model/kv_graft.h"
#include "model/model.h"
#include "model/steering.h"
#include "model/trace.h"
#include "support/test_support.h"
#include "text/tokenizer.h"

namespace dsv4 {
namespace {

std::string cli() { return test::cli_path().string(); }

void expect_contains(const std::string& out, const std::string& part) {
  EXPECT_NE(out.find(part), std::string::npos) << "output lacks \"" << part << "\":\n" << out;
}

std::vector<float> read_npy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t start = bytes.find('\n') + 1;
  std::vector<float> v((bytes.size() - start) / sizeof(float));
  std::memcpy(v.data(), bytes.data() + start, v.size() * sizeof(float));
  return v;
}

void write_text(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

std::string ids_text(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t t : ids) s += std::to_string(t) + " ";
  return s;
}

class InterventionsCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<test::TempDir>();
    model_path_ = synthetic(3);
  }
  // A synthetic tiny model of `layers` layers, written once per build (each test runs in
  // its own process): into a temporary name, then renamed, so parallel tests never read a
  // half-written file.
  static std::string synthetic(int layers) {
    const auto cache = std::filesystem::path(DSV4_BINARY_DIR) / "test-cache-interventions";
    std::filesystem::create_directories(cache);
    const std::string name = (cache / ("tiny" + std::to_string(layers) + ".gguf")).string();
    if (std::filesystem::exists(name)) return name;
    const std::string temp = (dir_->path() / ("tiny" + std::to_string(layers) + ".gguf")).string();
    const auto r = test::run_command(cli() + " synth --preset tiny --layers " + std::to_string(layers) +
                                     " --seed 41 -o " + temp + " 2>&1");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    // The MTP sidecar first: the trunk's name is what other processes look for.
    const std::string sidecar = (dir_->path() / ("mtp-tiny" + std::to_string(layers) + ".gguf")).string();
    if (std::filesystem::exists(sidecar))
      std::filesystem::rename(sidecar, cache / ("mtp-tiny" + std::to_string(layers) + ".gguf"));
    std::filesystem::rename(temp, name);
    return name;
  }
  static void TearDownTestSuite() { dir_.reset(); }
  void SetUp() override {
    auto m = Model::load(model_path_, cpu_, {});
    ASSERT_TRUE(m.is_ok()) << m.status().message();
    model_ = std::move(m).value();
  }
  std::string path(const std::string& name) const { return (dir_->path() / name).string(); }
  std::unique_ptr<Sequence> sequence(std::shared_ptr<const KvGraft> graft = nullptr) {
    SequenceOptions so;
    so.max_context = 256;
    so.graft = std::move(graft);
    auto s = model_->new_sequence(so);
    EXPECT_TRUE(s.is_ok()) << s.status().message();
    return s.is_ok() ? std::move(s).value() : nullptr;
  }
  // The traced activations of one prompt.
  ForwardTrace trace_of(const std::vector<int32_t>& ids) {
    auto seq = sequence();
    const BatchItem item{seq.get(), std::span<const int32_t>(ids)};
    ForwardOutput out;
    ForwardTrace trace;
    EXPECT_TRUE(model_->forward(std::span<const BatchItem>(&item, 1), out, &trace).is_ok());
    return trace;
  }
  static std::vector<int32_t> random_ids(size_t n, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<int32_t> ids(n);
    for (auto& t : ids) t = static_cast<int32_t>(rng() % 1000 + 100);
    return ids;
  }

  static inline std::unique_ptr<test::TempDir> dir_;
  static inline std::string model_path_;
  backend::CpuBackend cpu_{1};
  std::unique_ptr<Model> model_;
};

TEST_F(InterventionsCli, GlpMakeWritesTheMeanDifferenceAndAddModeMovesActivationsByIt) {
  const std::vector<std::string> pos = {"A bright and cheerful morning", "We won the game", "so\nhappy"};
  const std::vector<std::string> neg = {"A grey, gloomy evening", "They lost everything today"};
  write_text(path("pos.txt"), pos[0] + "\n" + pos[1] + "\n\"so\\nhappy\"\n\n");
  write_text(path("neg.txt"), neg[0] + "\n" + neg[1] + "\n");
  const auto r = test::run_command(cli() + " glp make -t 1 -m " + model_path_ + " --positive " + path("pos.txt") +
                                   " --negative " + path("neg.txt") + " --layers 1-2 --alpha 0.75 --force -o " +
                                   path("dir.gguf") + " 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto file = SteeringFile::read(path("dir.gguf"), model_->config());
  ASSERT_TRUE(file.is_ok()) << file.status().message();
  EXPECT_EQ(file->mode, SteerMode::Add);
  EXPECT_EQ(file->hook, SteerHook::FfnOut);
  EXPECT_EQ(file->alpha, 0.75f);
  ASSERT_EQ(file->directions.size(), 2u);

  // The mean difference, independently: per prompt the mean over its tokens, in double.
  gguf::OpenOptions header_only;
  header_only.map_data = false;
  auto gf = gguf::GgufFile::open(model_path_, header_only);
  ASSERT_TRUE(gf.is_ok());
  auto tok = text::Tokenizer::from_gguf(*gf);
  ASSERT_TRUE(tok.is_ok());
  const size_t D = model_->config().hidden;
  for (size_t li = 0; li < 2; ++li) {
    const uint32_t layer = 1 + static_cast<uint32_t>(li);
    std::vector<double> expect(D, 0.0);
    for (int sign : {+1, -1}) {
      const auto& set = sign > 0 ? pos : neg;
      for (const std::string& p : set) {
        auto ids = tok->encode(p);
        ASSERT_TRUE(ids.is_ok());
        const ForwardTrace t = trace_of(*ids);
        const TracedTensor* x = t.find("layers." + std::to_string(layer) + ".ffn_out");
        ASSERT_NE(x, nullptr);
        for (int64_t row = 0; row < x->rows(); ++row)
          for (size_t k = 0; k < D; ++k)
            expect[k] += sign * double(x->f32[row * D + k]) / double(x->rows()) / double(set.size());
      }
    }
    const SteeringDirection& d = file->directions[li];
    ASSERT_EQ(d.layer, layer);
    ASSERT_EQ(d.values.size(), D);
    double err = 0, norm = 0;
    for (size_t k = 0; k < D; ++k) {
      ASSERT_TRUE(std::isfinite(d.values[k]));
      err = std::max(err, std::fabs(d.values[k] - expect[k]));
      norm = std::max(norm, std::fabs(expect[k]));
    }
    EXPECT_GT(norm, 0.0);
    EXPECT_LE(err, 1e-6 * norm) << "layer " << layer;
  }

  // Bound in add mode at strength 0.5, the first steered layer's FFN output moves by 0.5 d.
  ASSERT_TRUE(model_->bind_steering(*file, 0.5f).is_ok());
  const std::vector<int32_t> probe = random_ids(20, 5);
  const ForwardTrace steered = trace_of(probe);
  model_->unbind_steering();
  const ForwardTrace plain = trace_of(probe);
  const TracedTensor* before = plain.find("layers.1.ffn_out");
  const TracedTensor* same = steered.find("layers.1.ffn_out");
  const TracedTensor* after = steered.find("layers.1.ffn_out_steered");
  ASSERT_TRUE(before && same && after);
  ASSERT_EQ(before->f32, same->f32);  // nothing before the hook is steered
  const std::vector<float>& v = file->directions[0].values;
  for (int64_t row = 0; row < after->rows(); ++row)
    for (size_t k = 0; k < D; ++k) {
      const double want = double(before->f32[row * D + k]) + 0.5 * double(v[k]);
      ASSERT_NEAR(after->f32[row * D + k], want, 1e-6 * (1 + std::fabs(want))) << row << "," << k;
    }
}

TEST_F(InterventionsCli, ScoreWithGlpAlphaZeroIsUnsteeredAndBadFlagsAreRefused) {
  write_text(path("p2.txt"), "one two three\n");
  write_text(path("n2.txt"), "four five six\n");
  auto r = test::run_command(cli() + " glp make -t 1 -m " + model_path_ + " --positive " + path("p2.txt") +
                             " --negative " + path("n2.txt") + " --hook residual_stream_post_layer --alpha 3 --force -o " +
                             path("post.gguf") + " 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  write_text(path("q.tok"), ids_text(random_ids(12, 9)));
  const std::string score = cli() + " score -t 1 -m " + model_path_ + " --tokens " + path("q.tok") + " ";
  ASSERT_EQ(test::run_command(score + "-o " + path("plain.npy")).exit_code, 0);
  ASSERT_EQ(test::run_command(score + "--glp " + path("post.gguf") + " --glp-alpha 0 -o " + path("zero.npy")).exit_code, 0);
  ASSERT_EQ(test::run_command(score + "--glp " + path("post.gguf") + " -o " + path("three.npy")).exit_code, 0);
  const auto plain = read_npy(path("plain.npy")), zero = read_npy(path("zero.npy")), three = read_npy(path("three.npy"));
  ASSERT_FALSE(plain.empty());
  EXPECT_EQ(plain, zero);
  EXPECT_NE(plain, three);
  for (float x : three) ASSERT_TRUE(std::isfinite(x));

  r = test::run_command(score + "--glp " + path("post.gguf") + " --glp-alpha inf -o " + path("x.npy") + " 2>&1");
  EXPECT_NE(r.exit_code, 0);
  expect_contains(r.output, "--glp-alpha 'inf': expected a finite number");
  r = test::run_command(score + "--glp " + path("post.gguf") + " --glp-layers 2-1 -o " + path("x.npy") + " 2>&1");
  EXPECT_NE(r.exit_code, 0);
  expect_contains(r.output, "runs backwards");
  r = test::run_command(score + "--glp " + path("post.gguf") + " --glp-layers 7 -o " + path("x.npy") + " 2>&1");
  EXPECT_NE(r.exit_code, 0);
  expect_contains(r.output, "layer 7 is outside the model");
  r = test::run_command(score + "--glp-alpha 1 -o " + path("x.npy") + " 2>&1");
  EXPECT_NE(r.exit_code, 0);
  expect_contains(r.output, "need --glp FILE");
  // A direction for another model: same preset, two layers.
  const std::string other = synthetic(2);
  r = test::run_command(cli() + " score -t 1 -m " + other + " --tokens " + path("q.tok") + " --glp " + path("post.gguf") +
                        " -o " + path("x.npy") + " 2>&1");
  EXPECT_NE(r.exit_code, 0);
  expect_contains(r.output, "made for another model");
}

TEST_F(InterventionsCli, GraftMadeByTheCliPlantsThePromptsRows) {
  const std::vector<int32_t> prompt = random_ids(40, 21);
  write_text(path("p40.tok"), ids_text(prompt));
  const std::string make = cli() + " graft make -t 1 -m " + model_path_ + " --tokens " + path("p40.tok") + " --force ";
  auto r = test::run_command(make + "-o " + path("bank.gguf") + " 2>&1");
  EXPECT_EQ(r.exit_code, 1);
  expect_contains(r.output, "the prompt has 40 tokens, not a multiple of the largest compress ratio 16: the nearest "
                            "valid lengths are 32 and 48 (--truncate keeps the first 32)");
  r = test::run_command(make + "--truncate -o " + path("bank.gguf") + " 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_contains(r.output, "footprint 32 tokens");

  // The bank holds exactly the rows prefilling the first 32 tokens leaves.
  const std::vector<int32_t> p32(prompt.begin(), prompt.begin() + 32);
  auto seq = sequence();
  ASSERT_TRUE(model_->prefill(*seq, p32).is_ok());
  auto own = model_->extract_graft(*seq);
  ASSERT_TRUE(own.is_ok()) << own.status().message();
  auto bank = KvGraft::read(path("bank.gguf"), model_->config());
  ASSERT_TRUE(bank.is_ok()) << bank.status().message();
  EXPECT_EQ(bank->footprint, 32);
  ASSERT_EQ(bank->layers.size(), own->layers.size());
  for (size_t i = 0; i < own->layers.size(); ++i) {
    EXPECT_EQ(bank->layers[i].slots, own->layers[i].slots);
    EXPECT_EQ(bank->layers[i].kv, own->layers[i].kv);
    EXPECT_EQ(bank->layers[i].keys, own->layers[i].keys);
  }
  EXPECT_EQ(bank->hash, own->hash);

  // Planted through `dsv4 score --kv-graft`: the logits of planting the prompt's own rows.
  const std::vector<int32_t> next = random_ids(10, 22);
  write_text(path("next.tok"), ids_text(next));
  r = test::run_command(cli() + " score -t 1 -m " + model_path_ + " --tokens " + path("next.tok") + " --kv-graft " +
                        path("bank.gguf") + " -o " + path("grafted.npy") + " 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto planted = sequence(std::make_shared<KvGraft>(std::move(*own)));
  ASSERT_EQ(planted->position(), 32);
  auto logits = model_->prefill(*planted, next, true);
  ASSERT_TRUE(logits.is_ok());
  EXPECT_EQ(read_npy(path("grafted.npy")), *logits);

  r = test::run_command(cli() + " info --kv-graft " + path("bank.gguf") + " -m " + model_path_ + " 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_contains(r.output, "footprint F: 32 tokens");
  expect_contains(r.output, "layer   1: N = 8 (+ indexer keys)");
  expect_contains(r.output, "layer   2: N = 2\n");
  expect_contains(r.output, "fits " + model_path_ + ": yes");
  const std::string other = synthetic(2);
  r = test::run_command(cli() + " info --kv-graft " + path("bank.gguf") + " -m " + other + " 2>&1");
  EXPECT_EQ(r.exit_code, 1);
  expect_contains(r.output, "fits " + other + ": no");
  expect_contains(r.output, "made for another model");

  write_text(path("p8.tok"), ids_text(random_ids(8, 3)));
  r = test::run_command(cli() + " graft make -t 1 -m " + model_path_ + " --tokens " + path("p8.tok") + " --truncate -o " +
                        path("short.gguf") + " 2>&1");
  EXPECT_EQ(r.exit_code, 1);
  expect_contains(r.output, "at least 16 tokens");
}

}  // namespace
}  // namespace dsv4
