// `dsv4 info` and `dsv4 gguf copy` on every malformed GGUF of tests/data/gguf-malformed/,
// through the built program under a 2 GiB address-space limit: each must exit with the
// failure code and a message naming the file, never abort or run out of memory (issue 9:
// a 64-byte file whose general.alignment was 2^30 made `gguf copy` pad a header to 1 GiB).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "support/test_support.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;

#if defined(__SANITIZE_ADDRESS__)
#define DSV4_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DSV4_TEST_ASAN 1
#endif
#endif

// AddressSanitizer reserves terabytes of address space for its shadow, so the limit only
// applies to the plain build; under ASan an abort or a leak still fails the test.
std::string limited(const std::string& command) {
#ifdef DSV4_TEST_ASAN
  return command;
#else
  return "ulimit -v 2097152 && " + command;  // KiB: 2 GiB
#endif
}

fs::path corpus_dir() { return test::source_dir() / "tests" / "data" / "gguf-malformed"; }

// The files a user would open: later parts of split sets are reached through their first.
std::vector<fs::path> malformed_files() {
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(corpus_dir()))
    if (entry.path().filename().string().find("-00002-of-") == std::string::npos) files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  return files;
}

void expect_clean_failure(const test::CommandResult& r, const std::string& prefix, const fs::path& file) {
  EXPECT_EQ(r.exit_code, 1) << r.output;  // kExitFailure: not a signal, not a usage error
  EXPECT_EQ(r.output.rfind(prefix + ": ", 0), 0u) << r.output;
  const std::string stem = file.filename().string().substr(0, file.filename().string().find('-'));
  EXPECT_NE(r.output.find((file.parent_path() / stem).string()), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("terminate called"), std::string::npos) << r.output;
}

TEST(GgufCliTest, TheAlignmentBombIsRejectedCleanly) {
  const fs::path bomb = corpus_dir() / "alignment_huge.gguf";
  ASSERT_TRUE(fs::exists(bomb)) << bomb;
  test::TempDir dir;
  const auto info = test::run_command(limited(test::cli_path().string() + " info " + bomb.string()));
  expect_clean_failure(info, "dsv4 info", bomb);
  EXPECT_NE(info.output.find(bomb.string() + ": metadata key 'general.alignment': 1073741824 exceeds the limit of "
                                             "65536"),
            std::string::npos)
      << info.output;
  const auto copy = test::run_command(
      limited(test::cli_path().string() + " gguf copy " + bomb.string() + " " + (dir / "out.gguf").string()));
  expect_clean_failure(copy, "dsv4 gguf copy", bomb);
  EXPECT_NE(copy.output.find("'general.alignment': 1073741824 exceeds the limit of 65536"), std::string::npos)
      << copy.output;
  EXPECT_TRUE(fs::is_empty(dir.path()));
}

TEST(GgufCliTest, EveryMalformedFileFailsWithAMessage) {
  const auto files = malformed_files();
  ASSERT_GE(files.size(), 50u);
  test::TempDir dir;
  for (const fs::path& file : files) {
    SCOPED_TRACE(file.filename().string());
    expect_clean_failure(test::run_command(limited(test::cli_path().string() + " info " + file.string())),
                         "dsv4 info", file);
    expect_clean_failure(test::run_command(limited(test::cli_path().string() + " gguf copy " + file.string() + " " +
                                                   (dir / "out.gguf").string())),
                         "dsv4 gguf copy", file);
    EXPECT_TRUE(fs::is_empty(dir.path())) << "an output or temporary was left behind";
  }
}

}  // namespace
}  // namespace dsv4
