// Helpers shared by the tests: paths, temporary folders, random data.
#pragma once

#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

namespace dsv4::test {

std::filesystem::path source_dir();   // repository root
std::filesystem::path shared_dir();   // ../shared (spec, fixtures)
std::filesystem::path fixture_dir();  // shared/fixtures/tiny-v4
std::filesystem::path cli_path();     // the built dsv4 program

// A fresh, empty folder under the build tree, removed when the object dies.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

// Seed for random test data: fresh each run unless DSV4_TEST_SEED is set; the value is
// printed by tests that fail so a failure can be replayed.
uint64_t test_seed();
std::vector<float> random_normal(size_t n, std::mt19937_64& rng, float stddev = 1.0f);

// Whether this code was compiled as the release build is (GCC, optimised, no sanitizer).
// Tests that compare last bits across code paths, or with a reference's arithmetic order,
// hold for the fused products GCC chooses; the sanitizer build is clang's, whose fusions
// differ, and skips them (they run in the release build).
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DSV4_TEST_CLANG_ASAN 1
#endif
#endif
#if defined(__OPTIMIZE__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__) && \
    !defined(DSV4_TEST_CLANG_ASAN)
inline constexpr bool kReleaseNumerics = true;
#else
inline constexpr bool kReleaseNumerics = false;
#endif
#define DSV4_SKIP_UNLESS_RELEASE_NUMERICS() \
  if (!::dsv4::test::kReleaseNumerics) GTEST_SKIP() << "last-bit check of the release build's (GCC's) arithmetic"

// Runs a shell command, returning its exit code and combined output.
struct CommandResult {
  int exit_code;
  std::string output;
};
CommandResult run_command(const std::string& command);

}  // namespace dsv4::test
