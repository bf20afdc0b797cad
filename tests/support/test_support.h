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

// Runs a shell command, returning its exit code and combined output.
struct CommandResult {
  int exit_code;
  std::string output;
};
CommandResult run_command(const std::string& command);

}  // namespace dsv4::test
