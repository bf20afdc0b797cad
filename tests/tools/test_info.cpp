// `dsv4 info` and `dsv4 synth` end to end, through the built program: the built-in model
// on first use, presets, synthetic files, and the errors a user sees.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "support/test_support.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;

std::string cli() { return test::cli_path().string(); }

void expect_contains(const std::string& out, const std::string& part) {
  EXPECT_NE(out.find(part), std::string::npos) << "output lacks \"" << part << "\":\n" << out;
}

TEST(InfoCliTest, FlashPresetPlan) {
  const auto r = test::run_command(cli() + " info --preset flash --ctx 1048576");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_contains(r.output, "hidden 4096, 43 layers + 1 MTP block");
  expect_contains(r.output, "2 window, 21 CSA (ratio 4), 20 HCA (ratio 128)");
  expect_contains(r.output, "WWCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHC | MTP W");
  expect_contains(r.output, "6,880 B");
  expect_contains(r.output, "3514.25 B");
  expect_contains(r.output, "1024 / 256 B");
  expect_contains(r.output, "584 / 68 B");
  expect_contains(r.output, "5.50 MiB");   // windows, reference
  expect_contains(r.output, "11.64 MiB");  // compressor states
  expect_contains(r.output, "5.25 GiB");   // CSA entries at 1M
  expect_contains(r.output, "experts q2_K");
}

// V4-Pro (spec §1.4): its schedule has no window-only trunk layer, and its cache grows by
// the 9,848 B per token (bf16) the spec computes.
TEST(InfoCliTest, ProPresetPlan) {
  const auto r = test::run_command(cli() + " info --preset pro --ctx 1048576");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_contains(r.output, "hidden 7168, 61 layers + 1 MTP block");
  expect_contains(r.output, "0 window, 30 CSA (ratio 4), 31 HCA (ratio 128)");
  expect_contains(r.output, "HHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHCHC | MTP W");
  expect_contains(r.output, "384 experts, top-6 + 1 shared, width 3072, 3 hash-routed layers, routed scale 2.5");
  expect_contains(r.output, "9,848 B");
  expect_contains(r.output, "indexer             64 heads x 128, top-k 1024");
}

// The partition plan (model/partition.h) as `info --gpus N` prints it, and its refusal.
TEST(InfoCliTest, GpuPartitionPlan) {
  const auto flash = test::run_command(cli() + " info --preset flash --experts mxfp4 --gpus 2");
  ASSERT_EQ(flash.exit_code, 0) << flash.output;
  expect_contains(flash.output, "partition over 2 GPUs (139.00 GiB usable each");
  expect_contains(flash.output, "256 experts per layer over 2 GPUs");
  expect_contains(flash.output, "128-255 (128)");
  expect_contains(flash.output, "the cheaper exchange: all-gather + reduce-scatter");
  expect_contains(flash.output, "fits: yes");
  const auto one = test::run_command(cli() + " info --preset flash --experts mxfp4 --gpus 1");
  EXPECT_NE(one.exit_code, 0) << one.output;
  expect_contains(one.output, "does not fit 1 GPU: GPU 0 needs");
  const auto pro = test::run_command(cli() + " info --preset pro --experts q8_0 --gpus 8 --ctx 65536");
  EXPECT_NE(pro.exit_code, 0) << pro.output;
  expect_contains(pro.output, "336-383 ( 48)");
  expect_contains(pro.output, "does not fit 8 GPUs");
  expect_contains(pro.output, "more than its usable 139.00 GiB");
  const auto pro4 = test::run_command(cli() + " info --preset pro --experts q4_K --gpus 8 --gpu-memory 80");
  EXPECT_NE(pro4.exit_code, 0) << pro4.output;
  expect_contains(pro4.output, "usable 80.00 GiB");
  const auto many = test::run_command(cli() + " info --preset tiny --gpus 9");
  EXPECT_NE(many.exit_code, 0) << many.output;
  expect_contains(many.output, "more GPUs than the 8 routed experts");
}

TEST(InfoCliTest, PresetOptions) {
  const auto r = test::run_command(cli() + " info --preset flash --layers 4 --experts q4_K --ctx 4096");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_contains(r.output, "4 layers + 1 MTP block");
  expect_contains(r.output, "WWCH | MTP W");
  expect_contains(r.output, "q4_K");
}

TEST(InfoCliTest, BuiltinModelOnFirstUse) {
  test::TempDir dir;
  const std::string env = "DSV4_CACHE_DIR=" + (dir / "cache").string() + " ";
  const auto first = test::run_command(env + cli() + " info --ctx 72");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  expect_contains(first.output, "writing the built-in tiny model");
  expect_contains(first.output, "built-in model");
  expect_contains(first.output, "synthetic: preset tiny, seed 20260601");
  expect_contains(first.output, "WCHCHW | MTP W");
  expect_contains(first.output, "catalog check: ok");
  expect_contains(first.output, "at 72 tokens:");
  const auto second = test::run_command(env + cli() + " info");
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_EQ(second.output.find("writing the built-in"), std::string::npos) << second.output;
}

TEST(InfoCliTest, SynthThenInfo) {
  test::TempDir dir;
  const std::string path = (dir / "tiny2.gguf").string();
  const auto w = test::run_command(cli() + " synth --preset tiny --layers 2 --experts q4_K --seed " +
                                   std::to_string(test::test_seed()) + " -o " + path);
  ASSERT_EQ(w.exit_code, 0) << w.output;
  expect_contains(w.output, "wrote " + path);
  const auto r = test::run_command(cli() + " info " + path + " --ctx 1000");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_contains(r.output, "2 layers + 1 MTP block");
  expect_contains(r.output, "WC | MTP W");
  expect_contains(r.output, "catalog check: ok");
  expect_contains(r.output, "q4_K");
  // The output exists: synth refuses to replace it without --force.
  const auto again = test::run_command(cli() + " synth --preset tiny --layers 2 --seed 1 -o " + path);
  EXPECT_NE(again.exit_code, 0) << again.output;
}

TEST(InfoCliTest, Errors) {
  test::TempDir dir;
  const auto missing = test::run_command(cli() + " info " + (dir / "nope.gguf").string());
  EXPECT_EQ(missing.exit_code, 1) << missing.output;
  expect_contains(missing.output, "nope.gguf");

  const std::string junk = (dir / "junk.gguf").string();
  { std::ofstream(junk) << "not a gguf file at all"; }
  const auto bad = test::run_command(cli() + " info " + junk);
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  expect_contains(bad.output, "junk.gguf");

  const auto preset = test::run_command(cli() + " info --preset huge");
  EXPECT_NE(preset.exit_code, 0);
  expect_contains(preset.output, "unknown preset");

  const auto both = test::run_command(cli() + " info " + junk + " --preset tiny");
  EXPECT_EQ(both.exit_code, 2) << both.output;

  const auto type = test::run_command(cli() + " synth --preset tiny --experts iq2_xxs --seed 1 -o " +
                                      (dir / "x.gguf").string());
  EXPECT_EQ(type.exit_code, 1) << type.output;
  expect_contains(type.output, "iq2_xxs");
  EXPECT_FALSE(fs::exists(dir / "x.gguf"));

  const auto layers = test::run_command(cli() + " synth --preset tiny --layers 9 --seed 1 -o " +
                                        (dir / "y.gguf").string());
  EXPECT_EQ(layers.exit_code, 2) << layers.output;
  expect_contains(layers.output, "--layers 9");
}

}  // namespace
}  // namespace dsv4
