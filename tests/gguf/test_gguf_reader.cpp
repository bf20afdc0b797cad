// GgufFile: header-only opening, in-memory images, typed getters, split sets and their
// failure modes, Value display.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "gguf/gguf_split.h"
#include "gguf_test_files.h"
#include "support/test_support.h"

namespace dsv4::gguf {
namespace {

using namespace dsv4::gguf::testing;
namespace fs = std::filesystem;

void expect_error(const Status& s, const std::string& needle) {
  ASSERT_FALSE(s.is_ok()) << "expected an error containing: " << needle;
  EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
}

class GgufReaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    rng_.seed(dsv4::test::test_seed());
    tensors_ = random_tensors(rng_);
    path_ = dir_ / "model.gguf";
    ASSERT_TRUE(write_file(path_, every_type_metadata(), tensors_).is_ok());
  }
  std::mt19937_64 rng_;
  std::vector<TensorSpec> tensors_;
  dsv4::test::TempDir dir_;
  std::string path_;
};

TEST_F(GgufReaderTest, TensorViewsPointIntoTheMappingAtTheDeclaredOffsets) {
  SCOPED_TRACE(dsv4::test::test_seed());
  auto f = GgufFile::open(path_);
  ASSERT_TRUE(f) << f.status().message();
  const auto file_bytes = read_bytes(path_);
  const auto& ts = f->tensors();
  ASSERT_EQ(ts.size(), tensors_.size());
  const uint8_t* data_start = ts[0].data - ts[0].offset;
  for (size_t i = 0; i < ts.size(); ++i) {
    EXPECT_EQ(ts[i].data, data_start + ts[i].offset);
    EXPECT_EQ(ts[i].bytes().size(), tensors_[i].bytes.size());
    EXPECT_TRUE(std::equal(ts[i].bytes().begin(), ts[i].bytes().end(), tensors_[i].bytes.begin()));
    EXPECT_EQ(ts[i].part, 0u);
  }
  const auto& q2 = *f->find_tensor("blk.0.ffn_gate_exps.weight");
  EXPECT_EQ(q2.n_elements(), 256u * 3 * 2);
  EXPECT_EQ(q2.n_rows(), 6u);
  EXPECT_EQ(q2.shape_string(), "[2, 3, 256]");
  EXPECT_EQ(f->find_tensor("missing"), nullptr);
}

TEST_F(GgufReaderTest, HeaderOnlyOpeningReadsTheSameHeaderWithoutData) {
  auto full = GgufFile::open(path_);
  auto header = GgufFile::open(path_, {.map_data = false});
  ASSERT_TRUE(full && header) << header.status().message();
  ASSERT_EQ(header->metadata().size(), full->metadata().size());
  for (size_t i = 0; i < full->metadata().size(); ++i) {
    EXPECT_EQ(header->metadata()[i].first, full->metadata()[i].first);
    EXPECT_TRUE(values_equal(header->metadata()[i].second, full->metadata()[i].second));
  }
  ASSERT_EQ(header->tensors().size(), full->tensors().size());
  for (size_t i = 0; i < full->tensors().size(); ++i) {
    EXPECT_EQ(header->tensors()[i].data, nullptr);
    EXPECT_EQ(header->tensors()[i].offset, full->tensors()[i].offset);
    EXPECT_EQ(header->tensors()[i].nbytes, full->tensors()[i].nbytes);
  }
}

TEST_F(GgufReaderTest, InMemoryImagesParseLikeFiles) {
  const auto bytes = read_bytes(path_);
  auto f = GgufFile::open_bytes("memory.gguf", bytes);
  ASSERT_TRUE(f) << f.status().message();
  EXPECT_EQ(f->path(), "memory.gguf");
  ASSERT_EQ(f->tensors().size(), tensors_.size());
  for (size_t i = 0; i < tensors_.size(); ++i)
    EXPECT_EQ(0, std::memcmp(f->tensors()[i].data, tensors_[i].bytes.data(), tensors_[i].bytes.size()));
  auto truncated = GgufFile::open_bytes("memory.gguf", {bytes.data(), bytes.size() - 30});
  expect_error(truncated.status(), "memory.gguf: tensor 'blk.0.exp_probs_b.bias' (#5): data at offset");
}

TEST_F(GgufReaderTest, TypedGettersConvertWhereTheValueFitsAndNameTheKeyOtherwise) {
  auto f = GgufFile::open(path_);
  ASSERT_TRUE(f);
  EXPECT_EQ(*f->get_string("general.architecture"), "deepseek4");
  EXPECT_EQ(*f->get_uint("test.u8"), 255u);
  EXPECT_EQ(*f->get_uint("test.u64"), 18446744073709551615ull);
  EXPECT_EQ(*f->get_int("test.i64"), -9223372036854775807ll - 1);
  EXPECT_EQ(*f->get_int("test.u32"), 4294967295ll);
  EXPECT_EQ(*f->get_float("test.f32"), static_cast<double>(-1.5e-7f));
  EXPECT_EQ(*f->get_float("test.i16"), -32768.0);
  EXPECT_TRUE(*f->get_bool("test.bool_true"));
  EXPECT_EQ(*f->get_uint_array("test.array_u32"), (std::vector<uint64_t>{0, 0, 4, 128, 4}));
  EXPECT_EQ(*f->get_float_array("test.array_f32"),
            (std::vector<double>{10.0, -0.25, static_cast<double>(1e-6f)}));
  EXPECT_EQ(*f->get_float_array("test.array_i32"), (std::vector<double>{-1, 2, -3}));
  EXPECT_EQ(f->get_string_array("test.array_string")->at(2), "Ġthe");

  const std::string where = path_ + ": metadata key ";
  expect_error(f->get_uint("test.i8").status(), where + "'test.i8': value -128 is negative");
  expect_error(f->get_int("test.u64").status(), "does not fit a signed 64-bit integer");
  expect_error(f->get_string("test.u32").status(), where + "'test.u32': type u32, expected string");
  expect_error(f->get_bool("test.u8").status(), "type u8, expected bool");
  expect_error(f->get_float("test.string").status(), "type string, expected a number");
  expect_error(f->get_uint("no.such.key").status(), where + "'no.such.key': missing");
  expect_error(f->get_uint_array("test.array_i32").status(), "element [0] = -1 is negative");
  expect_error(f->get_uint_array("test.array_string").status(), "type array of string, expected an array of integers");
  expect_error(f->get_string_array("test.array_u32").status(), "expected an array of strings");
}

TEST(GgufValueTest, DisplayStringsAreShortAndEscaped) {
  EXPECT_EQ(Value::u32(7).to_display_string(), "7");
  EXPECT_EQ(Value::i8(-3).to_display_string(), "-3");
  EXPECT_EQ(Value::f32(0.1f).to_display_string(), "0.1");
  EXPECT_EQ(Value::boolean(true).to_display_string(), "true");
  EXPECT_EQ(Value::string("a\"b\n").to_display_string(), "\"a\\\"b\\n\"");
  EXPECT_EQ(Value::array_u32({1, 2, 3, 4}).to_display_string(2), "[1, 2, ... (4 items)]");
  EXPECT_EQ(Value::array(ValueType::ARRAY, {Value::array_u32({5})}).to_display_string(), "[[5]]");
  const std::string long_text(1000, 'x');
  const std::string shown = Value::string(long_text).to_display_string();
  EXPECT_LT(shown.size(), 200u);
  EXPECT_NE(shown.find("(1000 bytes)"), std::string::npos);
  EXPECT_TRUE(Value::i64(1).is_integer());
  EXPECT_FALSE(Value::f64(1).is_integer());
  EXPECT_EQ(value_type_name(ValueType::FLOAT64), "f64");
}

class GgufSplitReaderTest : public GgufReaderTest {
 protected:
  void SetUp() override {
    GgufReaderTest::SetUp();
    ASSERT_TRUE(write_file(dir_ / "split.gguf", every_type_metadata(), tensors_, {.split_max_tensors = 2}, 7,
                           &parts_)
                    .is_ok());
    ASSERT_EQ(parts_.size(), 3u);
  }
  std::vector<std::string> parts_;
};

TEST_F(GgufSplitReaderTest, HeaderOnlyOpeningFollowsTheParts) {
  auto f = GgufFile::open(parts_[1], {.map_data = false});
  ASSERT_TRUE(f) << f.status().message();
  EXPECT_EQ(f->part_paths(), parts_);
  EXPECT_EQ(f->tensors().size(), tensors_.size());
  EXPECT_EQ(f->tensors().back().part, 2u);
}

TEST_F(GgufSplitReaderTest, AMissingPartIsAClearError) {
  fs::remove(parts_[2]);
  auto f = GgufFile::open(parts_[0]);
  expect_error(f.status(), "split part 3 of 3 is missing or unreadable");
  expect_error(f.status(), "split-00003-of-00003.gguf");
}

TEST_F(GgufSplitReaderTest, PartsOfDifferentSetsAreRejected) {
  // Replace part 2 of 3 with part 2 of a two-part set of the same tensors.
  const fs::path other = dir_ / "other";
  fs::create_directories(other);
  std::vector<std::string> other_parts;
  ASSERT_TRUE(write_file(other / "x.gguf", {}, tensors_, {.split_max_tensors = 3}, 7, &other_parts).is_ok());
  fs::copy_file(other_parts[1], parts_[1], fs::copy_options::overwrite_existing);
  expect_error(GgufFile::open(parts_[0]).status(), "metadata key 'split.count' is 2, but");
}

TEST_F(GgufSplitReaderTest, APartInTheWrongPlaceIsRejected) {
  fs::copy_file(parts_[0], parts_[1], fs::copy_options::overwrite_existing);
  expect_error(GgufFile::open(parts_[0]).status(), "split-00002-of-00003.gguf: metadata key 'split.no' is 0, expected 1");
}

TEST_F(GgufSplitReaderTest, ARenamedPartIsRejected) {
  fs::copy_file(parts_[1], dir_ / "renamed.gguf");
  expect_error(GgufFile::open(dir_ / "renamed.gguf").status(),
               "file name does not end in '-00002-of-00003.gguf'");
  // Read as a lone part it is fine.
  auto lone = GgufFile::open(dir_ / "renamed.gguf", {.load_split_parts = false});
  ASSERT_TRUE(lone) << lone.status().message();
  EXPECT_EQ(lone->tensors().size(), 2u);
}

// The caps of gguf_file.h that the bytes left cannot enforce: sparse files big enough for
// the counts to fit, so only the limit stops them (before anything is allocated).
class GgufReaderLimitsTest : public ::testing::Test {
 protected:
  // A header followed by zeros up to `size` bytes (sparse: nothing is written there).
  std::string sparse_file(const std::vector<uint8_t>& header, uint64_t size) {
    const fs::path path = dir_ / "sparse.gguf";
    write_bytes(path, header);
    fs::resize_file(path, size);
    return path.string();
  }
  static void put_u32(std::vector<uint8_t>& b, uint32_t x) {
    for (int i = 0; i < 4; ++i) b.push_back(static_cast<uint8_t>(x >> (8 * i)));
  }
  static void put_u64(std::vector<uint8_t>& b, uint64_t x) {
    for (int i = 0; i < 8; ++i) b.push_back(static_cast<uint8_t>(x >> (8 * i)));
  }
  static std::vector<uint8_t> preamble(uint64_t n_tensors, uint64_t n_kv) {
    std::vector<uint8_t> b = {'G', 'G', 'U', 'F'};
    put_u32(b, 3);
    put_u64(b, n_tensors);
    put_u64(b, n_kv);
    return b;
  }
  dsv4::test::TempDir dir_;
};

TEST_F(GgufReaderLimitsTest, KeyValueCountBeyondTheValueBudget) {
  const uint64_t n_kv = kMaxMetadataValues + 1;
  const std::string path = sparse_file(preamble(0, n_kv), 24 + n_kv * 13);
  for (bool map_data : {true, false}) {
    auto f = GgufFile::open(path, {.map_data = map_data});
    expect_error(f.status(), path + ": kv_count: 4194305 exceeds the limit of 4194304 metadata values in all");
  }
}

TEST_F(GgufReaderLimitsTest, ArrayElementsBeyondTheValueBudget) {
  // One pair whose u8 array has one element more than the budget leaves (4 Mi - 1).
  std::vector<uint8_t> b = preamble(0, 1);
  put_u64(b, 3);
  b.insert(b.end(), {'a', 'r', 'r'});
  put_u32(b, static_cast<uint32_t>(ValueType::ARRAY));
  put_u32(b, static_cast<uint32_t>(ValueType::UINT8));
  put_u64(b, kMaxMetadataValues);
  const std::string path = sparse_file(b, b.size() + kMaxMetadataValues);
  for (bool map_data : {true, false}) {
    auto f = GgufFile::open(path, {.map_data = map_data});
    expect_error(f.status(), path + ": metadata key 'arr' (#0): array of 4194304 elements exceeds the limit of "
                                    "4194304 metadata values in all");
  }
}

TEST_F(GgufReaderLimitsTest, TheValueBudgetIsSharedByThePartsOfASplitSet) {
  // Each part alone is within the limit; the set is not (the first part opens: the error
  // names the second).
  auto part = [&](uint16_t no, uint64_t elements) {
    std::vector<uint8_t> b = preamble(0, 4);
    auto key = [&](std::string_view k, ValueType t) {
      put_u64(b, k.size());
      b.insert(b.end(), k.begin(), k.end());
      put_u32(b, static_cast<uint32_t>(t));
    };
    key(kSplitNoKey, ValueType::UINT16);
    b.insert(b.end(), {static_cast<uint8_t>(no), 0});
    key(kSplitCountKey, ValueType::UINT16);
    b.insert(b.end(), {2, 0});
    key(kSplitTensorsCountKey, ValueType::INT32);
    put_u32(b, 0);
    key("arr", ValueType::ARRAY);
    put_u32(b, static_cast<uint32_t>(ValueType::UINT8));
    put_u64(b, elements);
    const fs::path path = dir_ / fmt::format("set-0000{}-of-00002.gguf", no + 1);
    write_bytes(path, b);
    fs::resize_file(path, b.size() + elements);
    return path.string();
  };
  const std::string first = part(0, kMaxMetadataValues - 304);
  const std::string second = part(1, 1000);
  ASSERT_TRUE(GgufFile::open(second, {.load_split_parts = false}));
  auto f = GgufFile::open(first, {.map_data = false});
  expect_error(f.status(), second + ": metadata key 'arr' (#3): array of 1000 elements exceeds the limit of "
                                    "4194304 metadata values in all (all parts of a split set together; 300 were "
                                    "left for this part)");
}

TEST_F(GgufReaderLimitsTest, TheLargestAlignmentIsAccepted) {
  const fs::path path = dsv4::test::source_dir() / "fuzz" / "corpus" / "gguf" / "valid_align_max.gguf";
  auto f = GgufFile::open(path.string());
  ASSERT_TRUE(f) << f.status().message();
  EXPECT_EQ(f->alignment(), kMaxAlignment);
}

}  // namespace
}  // namespace dsv4::gguf
