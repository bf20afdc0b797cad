#include "support/test_support.h"

#include <array>
#include <cstdio>
#include <cstdlib>
#include <sys/wait.h>
#include <unistd.h>

namespace dsv4::test {

std::filesystem::path source_dir() { return DSV4_SOURCE_DIR; }
std::filesystem::path shared_dir() { return DSV4_SHARED_DIR; }
std::filesystem::path fixture_dir() { return shared_dir() / "fixtures" / "tiny-v4"; }
std::filesystem::path cli_path() { return DSV4_CLI; }

TempDir::TempDir() {
  static int counter = 0;
  path_ = std::filesystem::path(DSV4_BINARY_DIR) / "test-tmp" /
          (std::to_string(getpid()) + "-" + std::to_string(counter++));
  std::filesystem::remove_all(path_);
  std::filesystem::create_directories(path_);
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

uint64_t test_seed() {
  static const uint64_t seed = []() -> uint64_t {
    if (const char* s = std::getenv("DSV4_TEST_SEED")) return std::strtoull(s, nullptr, 10);
    return static_cast<uint64_t>(std::random_device{}()) << 32 | std::random_device{}();
  }();
  return seed;
}

std::vector<float> random_normal(size_t n, std::mt19937_64& rng, float stddev) {
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

CommandResult run_command(const std::string& command) {
  CommandResult r{-1, {}};
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t got;
  while ((got = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), got);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace dsv4::test
