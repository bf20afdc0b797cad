// `dsv4 synth` benchmark options and `dsv4 bench` end to end on the CPU, through the built
// program: a trunk-only random-blocks file at the q2k recipe's types, and every kind of
// figure with its bound in the output and the JSON file (the numbers themselves are not
// checked: timings vary; they must be positive and finite).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "support/test_support.h"

namespace dsv4 {
namespace {

std::string cli() { return test::cli_path().string(); }

void expect_contains(const std::string& out, const std::string& part) {
  EXPECT_NE(out.find(part), std::string::npos) << "output lacks \"" << part << "\":\n" << out;
}

class BenchCliTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new test::TempDir();
    model_ = (*dir_ / "bench.gguf").string();
    const auto r = test::run_command(cli() + " synth --preset tiny --seed 3 --no-tokenizer --recipe q2k --no-mtp "
                                             "--fill random-blocks --threads 2 -o " + model_);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    synth_output_ = r.output;
  }
  static void TearDownTestSuite() { delete dir_; }
  static test::TempDir* dir_;
  static std::string model_, synth_output_;
};
test::TempDir* BenchCliTest::dir_ = nullptr;
std::string BenchCliTest::model_, BenchCliTest::synth_output_;

TEST_F(BenchCliTest, SynthWritesATrunkOnlyRandomBlocksFile) {
  expect_contains(synth_output_, "wrote " + model_ + ":");  // no " + mtp-..." sidecar
  expect_contains(synth_output_, "6 layers + 0 MTP, recipe q2k, fill random-blocks");
  expect_contains(synth_output_, "GB/s");
  EXPECT_FALSE(std::ifstream((*dir_ / "mtp-bench.gguf").string()).good());
  const auto dry = test::run_command(cli() + " synth --preset flash --seed 1 --recipe q2k --no-mtp --dry-run -o " +
                                     (*dir_ / "flash.gguf").string());
  ASSERT_EQ(dry.exit_code, 0) << dry.output;
  expect_contains(dry.output, "would write");
  expect_contains(dry.output, "43 layers + 0 MTP");
  EXPECT_FALSE(std::ifstream((*dir_ / "flash.gguf").string()).good());
  const auto info = test::run_command(cli() + " info " + model_);
  ASSERT_EQ(info.exit_code, 0) << info.output;
  expect_contains(info.output, "q2_K");
  expect_contains(info.output, "q6_K");
}

TEST_F(BenchCliTest, EveryFigureWithItsBound) {
  const std::string json = (*dir_ / "bench.json").string();
  const auto r = test::run_command(cli() + " bench --backend cpu -t 2 -m " + model_ +
                                   " --prefill 40 --chunk 16 --depths 70 --batches 3 --batch-depth 20 --steps 2 "
                                   "--repeats 1 --prefill-repeats 1 --warmup 2 --label tiny --json " + json);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_contains(r.output, "backend cpu");
  expect_contains(r.output, "TABLE|dsv4|tiny decode B=1 D=70|");
  expect_contains(r.output, "TABLE|dsv4|tiny aggregate B=3 D=20|");
  expect_contains(r.output, "TABLE|dsv4|tiny prefill P=40 chunk=16|");
  std::ifstream in(json);
  ASSERT_TRUE(in.good());
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["error"], "");
  EXPECT_EQ(j["numerics"], "exact");
  EXPECT_GT(j["copy_gbs"].get<double>(), 0);
  EXPECT_GT(j["compute_tflops"].get<double>(), 0);
  ASSERT_EQ(j["results"].size(), 3u);
  for (const auto& f : j["results"]) {
    for (const char* key : {"tokens_per_second", "bound_tokens_per_second", "ratio"}) {
      const double v = f[key].get<double>();
      EXPECT_TRUE(std::isfinite(v) && v > 0) << key << " = " << v << " in " << f.dump();
    }
  }
  EXPECT_EQ(j["results"][0]["kind"], "decode");
  EXPECT_EQ(j["results"][1]["kind"], "aggregate");
  EXPECT_EQ(j["results"][2]["kind"], "prefill");
  // Three sequences touch more distinct experts than one.
  EXPECT_GT(j["results"][1]["distinct_experts_per_layer"].get<double>(),
            j["results"][0]["distinct_experts_per_layer"].get<double>());
}

// Depth from a real prefill instead of the synthetic fill; errors name the flag.
TEST_F(BenchCliTest, PrefillFillAndBadFlags) {
  const auto r = test::run_command(cli() + " bench --backend cpu -t 2 -m " + model_ +
                                   " --parts decode --depths 24 --fill prefill --chunk 16 --steps 1 --repeats 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_contains(r.output, "TABLE|dsv4|decode B=1 D=24|");
  const auto bad = test::run_command(cli() + " bench --backend cpu -m " + model_ + " --batches 65");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  expect_contains(bad.output, "--batches 65");
  const auto parts = test::run_command(cli() + " bench --backend cpu -m " + model_ + " --parts nothing");
  EXPECT_EQ(parts.exit_code, 2) << parts.output;
  expect_contains(parts.output, "unknown part");
}

}  // namespace
}  // namespace dsv4
