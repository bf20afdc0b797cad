// The built-in default model: written on first use into DSV4_CACHE_DIR, reused while
// valid, rewritten when it is corrupt.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "gguf/gguf_file.h"
#include "synth/builtin_model.h"
#include "synth/synth.h"
#include "support/test_support.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;

TEST(BuiltinModelTest, WrittenOnceReusedAndRepaired) {
  test::TempDir dir;
  const fs::path cache = dir / "cache";
  ASSERT_EQ(setenv("DSV4_CACHE_DIR", cache.c_str(), 1), 0);
  auto where = builtin_model_path();
  ASSERT_TRUE(where.is_ok());
  EXPECT_EQ(where->parent_path(), cache);

  // A corrupt file in its place (a truncated header) is replaced.
  fs::create_directories(cache);
  { std::ofstream(*where, std::ios::binary) << "GGUF\x03"; }
  EXPECT_FALSE(check_builtin_model(*where).is_ok());
  std::vector<std::string> log;
  auto path = ensure_builtin_model([&](std::string_view line) { log.emplace_back(line); });
  ASSERT_TRUE(path.is_ok()) << path.status().message();
  EXPECT_EQ(*path, *where);
  ASSERT_EQ(log.size(), 1u);
  EXPECT_NE(log[0].find("writing the built-in tiny model"), std::string::npos) << log[0];
  EXPECT_TRUE(check_builtin_model(*path).is_ok()) << check_builtin_model(*path).message();

  auto f = gguf::GgufFile::open(path->string());
  ASSERT_TRUE(f.is_ok());
  EXPECT_EQ(*f->get_string(kSynthPresetKey), "tiny");
  EXPECT_EQ(*f->get_uint(kSynthSeedKey), kBuiltinModelSeed);
  EXPECT_EQ(f->get_string_array("tokenizer.ggml.tokens")->size(), 129280u);

  // Nothing is rewritten while the file is valid, and no temporaries are left behind.
  const auto stamp = fs::last_write_time(*path);
  log.clear();
  ASSERT_TRUE(ensure_builtin_model([&](std::string_view line) { log.emplace_back(line); }).is_ok());
  EXPECT_TRUE(log.empty());
  EXPECT_EQ(fs::last_write_time(*path), stamp);
  size_t n_files = 0;
  for (const auto& e : fs::directory_iterator(cache)) n_files += e.is_regular_file();
  EXPECT_EQ(n_files, 1u);

  // Truncation is detected.
  fs::resize_file(*path, fs::file_size(*path) - 100);
  EXPECT_FALSE(check_builtin_model(*path).is_ok());
  unsetenv("DSV4_CACHE_DIR");
}

}  // namespace
}  // namespace dsv4
