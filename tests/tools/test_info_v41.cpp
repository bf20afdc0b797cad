// `dsv4 info` on V4.1: the V4.1-Flash preset's schedule, Engram tables and shared caches,
// and a converted tiny-v41 fixture file.
#include <gtest/gtest.h>

#include <string>

#include "support/test_support.h"

namespace dsv4 {
namespace {

std::string cli() { return test::cli_path().string(); }

void expect_contains(const std::string& out, const std::string& part) {
  EXPECT_NE(out.find(part), std::string::npos) << "output lacks \"" << part << "\":\n" << out;
}

TEST(InfoV41CliTest, Flash41PresetPlan) {
  const auto r = test::run_command(cli() + " info --preset flash41 --ctx 1048576");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_contains(r.output, "architecture: deepseek41");
  expect_contains(r.output, "hidden 5120, 40 layers + 3 MTP blocks");
  expect_contains(r.output, "KV + index source, candidate source");
  expect_contains(r.output, "KV [2, 8, 14, 20], index [2, 8, 14, 20, 24, 28, 32, 36]");
  expect_contains(r.output, "table rows [384006168, 384016682]");
  expect_contains(r.output, "3,200 B");                    // growth per token, reference bf16
  expect_contains(r.output, "188.83 GiB");                 // the two tables as I8 rows
  expect_contains(r.output, "48 rows of 264 B read per token");
  expect_contains(r.output, "RMSNorm eps         1e-20");
}

TEST(InfoV41CliTest, ConvertedFixture) {
  test::TempDir dir;
  const std::string out = (dir / "t.gguf").string();
  auto r = test::run_command(cli() + " convert " + (test::shared_dir() / "fixtures/tiny-v41/checkpoint").string() +
                             " -o " + out + " --recipe f32");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = test::run_command(cli() + " info " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_contains(r.output, "catalog check: ok");
  expect_contains(r.output, "index source, uses candidates");
}

}  // namespace
}  // namespace dsv4
