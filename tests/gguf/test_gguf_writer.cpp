// GgufWriter: round trips through GgufFile, alignment, splitting, determinism, and the
// guarantees about temporaries, overwriting and the bytes written per tensor.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "gguf/gguf_split.h"
#include "gguf_test_files.h"
#include "support/test_support.h"
#include "util/mapped_file.h"
#include "util/thread_pool.h"

namespace dsv4::gguf {
namespace {

using namespace dsv4::gguf::testing;
namespace fs = std::filesystem;

void expect_metadata_equal(const GgufFile& f, const std::vector<std::pair<std::string, Value>>& want) {
  for (const auto& [key, value] : want) {
    const Value* got = f.find(key);
    ASSERT_NE(got, nullptr) << key;
    EXPECT_TRUE(values_equal(*got, value))
        << key << ": got " << got->to_display_string(100) << ", want " << value.to_display_string(100);
  }
}

void expect_tensors_equal(const GgufFile& f, const std::vector<TensorSpec>& want) {
  ASSERT_EQ(f.tensors().size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    const TensorInfo& t = f.tensors()[i];
    EXPECT_EQ(t.name, want[i].name);
    EXPECT_EQ(t.type, want[i].type);
    EXPECT_EQ(t.ne, want[i].ne);
    ASSERT_EQ(t.nbytes, want[i].bytes.size()) << t.name;
    ASSERT_NE(t.data, nullptr);
    EXPECT_EQ(0, std::memcmp(t.data, want[i].bytes.data(), t.nbytes)) << t.name;
    EXPECT_EQ(f.find_tensor(t.name), &t);
  }
}

class GgufWriterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    rng_.seed(dsv4::test::test_seed());
    tensors_ = random_tensors(rng_);
  }
  std::mt19937_64 rng_;
  std::vector<TensorSpec> tensors_;
  dsv4::test::TempDir dir_;
};

TEST_F(GgufWriterTest, RoundTripsEveryMetadataTypeAndTensorBytes) {
  SCOPED_TRACE(dsv4::test::test_seed());
  const std::string path = dir_ / "model.gguf";
  const auto md = every_type_metadata();
  ASSERT_TRUE(write_file(path, md, tensors_).is_ok());
  auto f = GgufFile::open(path);
  ASSERT_TRUE(f) << f.status().message();
  EXPECT_EQ(f->version(), kVersion);
  EXPECT_EQ(f->alignment(), 32u);
  ASSERT_EQ(f->metadata().size(), md.size());  // no extra keys at the default alignment
  for (size_t i = 0; i < md.size(); ++i) EXPECT_EQ(f->metadata()[i].first, md[i].first);
  expect_metadata_equal(*f, md);
  expect_tensors_equal(*f, tensors_);
  EXPECT_EQ(f->file_bytes(), fs::file_size(path));
  EXPECT_EQ(f->part_paths(), std::vector<std::string>{path});
}

TEST_F(GgufWriterTest, SetReplacesAnEarlierValueInPlace) {
  const std::string path = dir_ / "m.gguf";
  GgufWriter w(path);
  w.set("a", Value::u32(1));
  w.set("b", Value::string("x"));
  w.set("a", Value::f32(2.5f));
  ASSERT_TRUE(w.begin().is_ok());
  ASSERT_TRUE(w.finish().is_ok());
  auto f = GgufFile::open(path);
  ASSERT_TRUE(f) << f.status().message();
  ASSERT_EQ(f->metadata().size(), 2u);
  EXPECT_EQ(f->metadata()[0].first, "a");
  EXPECT_EQ(f->metadata()[0].second.type(), ValueType::FLOAT32);
  EXPECT_EQ(f->tensors().size(), 0u);
}

class GgufWriterAlignmentTest : public GgufWriterTest, public ::testing::WithParamInterface<uint64_t> {};

TEST_P(GgufWriterAlignmentTest, PlacesEveryTensorOnTheAlignment) {
  const uint64_t alignment = GetParam();
  const std::string path = dir_ / "aligned.gguf";
  ASSERT_TRUE(write_file(path, every_type_metadata(), tensors_, {.alignment = alignment}).is_ok());
  auto f = GgufFile::open(path);
  ASSERT_TRUE(f) << f.status().message();
  EXPECT_EQ(f->alignment(), alignment);
  const Value* key = f->find("general.alignment");
  if (alignment == 32) {
    EXPECT_EQ(key, nullptr);
  } else {
    ASSERT_NE(key, nullptr);
    EXPECT_EQ(key->type(), ValueType::UINT32);
    EXPECT_EQ(key->as_u64(), alignment);
  }
  auto mapped = MappedFile::open(path);
  ASSERT_TRUE(mapped);
  for (const auto& t : f->tensors()) {
    EXPECT_EQ(t.offset % alignment, 0u) << t.name;
    EXPECT_EQ(static_cast<uint64_t>(t.data - mapped->data()) % alignment, 0u)
        << t.name << ": the data's file offset is not aligned";
  }
  EXPECT_EQ(fs::file_size(path) % alignment, 0u);
  expect_tensors_equal(*f, tensors_);
}

INSTANTIATE_TEST_SUITE_P(Alignments, GgufWriterAlignmentTest, ::testing::Values(1, 8, 32, 64, 4096));

TEST_F(GgufWriterTest, WritesGeneralAlignmentFromItsOptionOnly) {
  // A caller's general.alignment would describe a layout the writer did not produce.
  const std::string a = dir_ / "a.gguf", b = dir_ / "b.gguf";
  std::vector<std::pair<std::string, Value>> md = {{"general.alignment", Value::u32(64)}};
  ASSERT_TRUE(write_file(a, md, tensors_).is_ok());
  ASSERT_TRUE(write_file(b, md, tensors_, {.alignment = 128}).is_ok());
  auto fa = GgufFile::open(a);
  auto fb = GgufFile::open(b);
  ASSERT_TRUE(fa && fb);
  EXPECT_EQ(fa->find("general.alignment"), nullptr);
  EXPECT_EQ(fa->alignment(), 32u);
  EXPECT_EQ(fb->find("general.alignment")->as_u64(), 128u);
  expect_tensors_equal(*fa, tensors_);
  expect_tensors_equal(*fb, tensors_);
}

TEST_F(GgufWriterTest, RoundTripsAScalarTensorWithNoDimensions) {
  const std::string path = dir_ / "scalar.gguf";
  const std::vector<TensorSpec> scalar = {{"scale", GgmlType::F32, {}, {0x00, 0x00, 0xc0, 0x3f}}};
  ASSERT_TRUE(write_file(path, {}, scalar).is_ok());
  auto f = GgufFile::open(path);
  ASSERT_TRUE(f) << f.status().message();
  EXPECT_EQ(f->tensors()[0].n_elements(), 1u);
  EXPECT_EQ(f->tensors()[0].shape_string(), "[]");
  expect_tensors_equal(*f, scalar);
}

TEST_F(GgufWriterTest, RejectsAlignmentThatIsNotAPowerOfTwoOrAboveTheLimit) {
  // 2^30 is the alignment of issue 9's reproducer: the header would have been padded to 1 GiB.
  const std::pair<uint64_t, const char*> cases[] = {
      {0, "0 is not a power of two"},
      {48, "48 is not a power of two"},
      {kMaxAlignment * 2, "131072 exceeds the limit of 65536"},
      {uint64_t{1} << 30, "1073741824 exceeds the limit of 65536"},
      {uint64_t{1} << 63, "9223372036854775808 exceeds the limit of 65536"},
  };
  for (const auto& [alignment, expected] : cases) {
    const fs::path path = dir_ / "bad.gguf";
    GgufWriter w(path, {.alignment = alignment});
    ASSERT_TRUE(w.add_tensor("w", GgmlType::F32, {8}));
    Status s = w.begin();
    ASSERT_FALSE(s) << alignment;
    EXPECT_NE(s.message().find(path.string() + ": metadata key 'general.alignment'"), std::string::npos)
        << s.message();
    EXPECT_NE(s.message().find(expected), std::string::npos) << s.message();
    EXPECT_FALSE(fs::exists(path.string() + ".tmp"));
    EXPECT_FALSE(fs::exists(path));
  }
}

TEST_F(GgufWriterTest, WritesAndReadsBackTheLargestAlignment) {
  const std::string path = dir_ / "page.gguf";
  ASSERT_TRUE(write_file(path, every_type_metadata(), tensors_, {.alignment = kMaxAlignment}).is_ok());
  auto f = GgufFile::open(path);
  ASSERT_TRUE(f) << f.status().message();
  EXPECT_EQ(f->alignment(), kMaxAlignment);
  expect_tensors_equal(*f, tensors_);
  // Header and every tensor padded to 64 KiB: the padding never exceeds one alignment each.
  EXPECT_EQ(fs::file_size(path), kMaxAlignment * (1 + tensors_.size()));
}

TEST_F(GgufWriterTest, RefusesWhatTheReaderWouldReject) {
  {
    GgufWriter w(dir_ / "deep.gguf");
    Value v = Value::array_u32({1});
    for (int depth = 1; depth <= kMaxArrayNesting; ++depth) v = Value::array(ValueType::ARRAY, {v});
    w.set("deep", v);  // kMaxArrayNesting + 1 levels
    Status s = w.begin();
    ASSERT_FALSE(s);
    EXPECT_NE(s.message().find("metadata key 'deep': arrays nested more than 8 deep"), std::string::npos)
        << s.message();
  }
  {
    GgufWriter w(dir_ / "many.gguf");
    // One pair plus 4 Mi elements: one value too many.
    w.set("a", Value::array(ValueType::UINT8, Value::Array(kMaxMetadataValues)));
    Status s = w.begin();
    ASSERT_FALSE(s);
    EXPECT_NE(s.message().find("metadata key 'a': array of 4194304 elements takes the metadata past the limit of "
                               "4194304 values"),
              std::string::npos)
        << s.message();
  }
  {
    GgufWriter w(dir_ / "long.gguf");
    w.set("s", Value::string(std::string(kMaxStringBytes + 1, 'x')));
    Status s = w.begin();
    ASSERT_FALSE(s);
    EXPECT_NE(s.message().find("metadata key 's': string of 67108865 bytes exceeds the limit of 67108864 bytes"),
              std::string::npos)
        << s.message();
  }
}

TEST_F(GgufWriterTest, OutputIsDeterministic) {
  const std::string a = dir_ / "a.gguf", b = dir_ / "b.gguf";
  ASSERT_TRUE(write_file(a, every_type_metadata(), tensors_, {}, 5).is_ok());
  ASSERT_TRUE(write_file(b, every_type_metadata(), tensors_, {}, 1000).is_ok());
  EXPECT_EQ(read_bytes(a), read_bytes(b));
}

TEST_F(GgufWriterTest, SplitsByTensorCountWithGgufSplitNamesAndKeys) {
  const std::string path = dir_ / "model.gguf";
  std::vector<std::string> outputs;
  const auto md = every_type_metadata();
  ASSERT_TRUE(write_file(path, md, tensors_, {.split_max_tensors = 4}, 7, &outputs).is_ok());
  ASSERT_EQ(outputs.size(), 2u);
  EXPECT_EQ(outputs[0], (dir_ / "model-00001-of-00002.gguf").string());
  EXPECT_EQ(outputs[1], (dir_ / "model-00002-of-00002.gguf").string());
  EXPECT_FALSE(fs::exists(path));

  // Each part on its own: split keys with llama.cpp's types, metadata only in part 1.
  for (uint32_t p = 0; p < 2; ++p) {
    auto part = GgufFile::open(outputs[p], {.load_split_parts = false});
    ASSERT_TRUE(part) << part.status().message();
    EXPECT_EQ(part->find(kSplitNoKey)->type(), ValueType::UINT16);
    EXPECT_EQ(part->find(kSplitNoKey)->as_u64(), p);
    EXPECT_EQ(part->find(kSplitCountKey)->type(), ValueType::UINT16);
    EXPECT_EQ(part->find(kSplitCountKey)->as_u64(), 2u);
    EXPECT_EQ(part->find(kSplitTensorsCountKey)->type(), ValueType::INT32);
    EXPECT_EQ(part->find(kSplitTensorsCountKey)->as_i64(), static_cast<int64_t>(tensors_.size()));
    EXPECT_EQ(part->tensors().size(), p == 0 ? 4u : tensors_.size() - 4);
    EXPECT_EQ(part->find("general.architecture") != nullptr, p == 0);
  }

  // Opening either part opens the set.
  for (const auto& start : outputs) {
    auto f = GgufFile::open(start);
    ASSERT_TRUE(f) << f.status().message();
    EXPECT_EQ(f->part_paths(), outputs);
    expect_metadata_equal(*f, md);
    expect_tensors_equal(*f, tensors_);
    EXPECT_EQ(f->tensors()[3].part, 0u);
    EXPECT_EQ(f->tensors()[4].part, 1u);
    EXPECT_EQ(f->file_bytes(), fs::file_size(outputs[0]) + fs::file_size(outputs[1]));
  }
}

TEST_F(GgufWriterTest, SplitsByBytesAndKeepsTheAlignmentInEveryPart) {
  const std::string path = dir_ / "big.gguf";
  std::vector<std::string> outputs;
  const uint64_t max_bytes = 600;
  ASSERT_TRUE(write_file(path, every_type_metadata(), tensors_, {.alignment = 64, .split_max_bytes = max_bytes},
                         7, &outputs)
                  .is_ok());
  ASSERT_GT(outputs.size(), 2u);
  EXPECT_LT(outputs.size(), tensors_.size());
  auto f = GgufFile::open(outputs.back());
  ASSERT_TRUE(f) << f.status().message();
  EXPECT_EQ(f->alignment(), 64u);
  expect_tensors_equal(*f, tensors_);
  for (const auto& p : outputs) {
    auto part = GgufFile::open(p, {.load_split_parts = false});
    ASSERT_TRUE(part) << part.status().message();
    EXPECT_EQ(part->alignment(), 64u) << p;
    uint64_t data_bytes = 0;
    for (const auto& t : part->tensors()) data_bytes += (t.nbytes + 63) / 64 * 64;
    EXPECT_TRUE(data_bytes <= max_bytes || part->tensors().size() == 1) << p << ": " << data_bytes << " bytes";
  }
}

TEST_F(GgufWriterTest, SplitRoundTripIsByteIdenticalToTheSingleFileData) {
  const std::string single = dir_ / "one.gguf";
  ASSERT_TRUE(write_file(single, every_type_metadata(), tensors_).is_ok());
  std::vector<std::string> outputs;
  ASSERT_TRUE(write_file(dir_ / "parts.gguf", every_type_metadata(), tensors_, {.split_max_tensors = 1}, 7,
                         &outputs)
                  .is_ok());
  ASSERT_EQ(outputs.size(), tensors_.size());
  auto a = GgufFile::open(single);
  auto b = GgufFile::open(outputs[2]);
  ASSERT_TRUE(a && b);
  ASSERT_EQ(a->tensors().size(), b->tensors().size());
  for (size_t i = 0; i < a->tensors().size(); ++i) {
    const auto& x = a->tensors()[i];
    const auto& y = b->tensors()[i];
    EXPECT_EQ(x.name, y.name);
    EXPECT_EQ(x.shape_string(), y.shape_string());
    ASSERT_EQ(x.nbytes, y.nbytes);
    EXPECT_EQ(0, std::memcmp(x.data, y.data, x.nbytes));
    EXPECT_EQ(y.part, i);
  }
}

TEST_F(GgufWriterTest, AbandonedWriterLeavesNoFiles) {
  const std::string path = dir_ / "partial.gguf";
  {
    GgufWriter w(path, {.split_max_tensors = 2});
    for (const auto& t : tensors_) ASSERT_TRUE(w.add_tensor(t.name, t.type, t.ne).is_ok());
    ASSERT_TRUE(w.begin().is_ok());
    // Complete the first part and half of the second, then give up.
    for (size_t i = 0; i < 3; ++i) ASSERT_TRUE(w.write_tensor_data(tensors_[i].bytes).is_ok());
    ASSERT_TRUE(w.write_tensor_data({tensors_[3].bytes.data(), 1}).is_ok());
    EXPECT_FALSE(fs::is_empty(dir_.path()));  // the temporaries exist while writing
  }
  EXPECT_TRUE(fs::is_empty(dir_.path()));
}

TEST_F(GgufWriterTest, FinishWithMissingBytesFailsAndLeavesNoFiles) {
  const std::string path = dir_ / "short.gguf";
  {
    GgufWriter w(path);
    for (const auto& t : tensors_) ASSERT_TRUE(w.add_tensor(t.name, t.type, t.ne).is_ok());
    ASSERT_TRUE(w.begin().is_ok());
    ASSERT_TRUE(w.write_tensor_data(tensors_[0].bytes).is_ok());
    Status s = w.finish();
    ASSERT_FALSE(s);
    EXPECT_NE(s.message().find("output_norm.weight"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("only 0 of its 52 bytes"), std::string::npos) << s.message();
  }
  EXPECT_TRUE(fs::is_empty(dir_.path()));
}

TEST_F(GgufWriterTest, RejectsBytesBeyondTheCurrentTensor) {
  GgufWriter w(dir_ / "x.gguf");
  ASSERT_TRUE(w.add_tensor("a", GgmlType::F32, {2}).is_ok());
  ASSERT_TRUE(w.add_tensor("b", GgmlType::F32, {2}).is_ok());
  ASSERT_TRUE(w.begin().is_ok());
  const std::vector<uint8_t> twelve(12, 1);
  Status s = w.write_tensor_data(twelve);
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("tensor 'a': 12 bytes given but only 8 of its 8 bytes remain"), std::string::npos)
      << s.message();
  EXPECT_FALSE(w.finish());  // a failed writer stays failed
}

TEST_F(GgufWriterTest, RejectsBytesAfterTheLastTensor) {
  GgufWriter w(dir_ / "x.gguf");
  ASSERT_TRUE(w.add_tensor("a", GgmlType::F32, {1}).is_ok());
  ASSERT_TRUE(w.begin().is_ok());
  const std::vector<uint8_t> four(4, 1);
  ASSERT_TRUE(w.write_tensor_data(four).is_ok());
  Status s = w.write_tensor_data(four);
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("after all 1 declared tensors"), std::string::npos) << s.message();
}

TEST_F(GgufWriterTest, RefusesToOverwriteUnlessAsked) {
  const std::string path = dir_ / "exists.gguf";
  write_bytes(path, {1, 2, 3});
  {
    GgufWriter w(path);
    Status s = w.begin();
    ASSERT_FALSE(s);
    EXPECT_NE(s.message().find("exists"), std::string::npos) << s.message();
  }
  EXPECT_EQ(read_bytes(path), (std::vector<uint8_t>{1, 2, 3}));
  ASSERT_TRUE(write_file(path, every_type_metadata(), tensors_, {.overwrite = true}).is_ok());
  auto f = GgufFile::open(path);
  ASSERT_TRUE(f) << f.status().message();
  expect_tensors_equal(*f, tensors_);
}

TEST_F(GgufWriterTest, RefusesToOverwriteAnyPartOfASplitSet) {
  write_bytes(dir_ / "m-00002-of-00002.gguf", {1});
  Status s = write_file(dir_ / "m.gguf", {}, tensors_, {.split_max_tensors = 3});
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("m-00002-of-00002.gguf: output file exists"), std::string::npos) << s.message();
  EXPECT_FALSE(fs::exists(dir_ / "m-00001-of-00002.gguf"));
}

TEST_F(GgufWriterTest, RejectsInvalidTensorDeclarations) {
  GgufWriter w(dir_ / "x.gguf");
  ASSERT_TRUE(w.add_tensor("a", GgmlType::F32, {4}).is_ok());
  auto expect_error = [&](Status s, const std::string& needle) {
    ASSERT_FALSE(s);
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  };
  expect_error(w.add_tensor("a", GgmlType::F32, {4}), "declared twice");
  expect_error(w.add_tensor("b", GgmlType::F32, {4, 0}), "ne[1] is 0");
  expect_error(w.add_tensor("c", GgmlType::F32, {1, 1, 1, 1, 1}), "5 dimensions");
  expect_error(w.add_tensor("d", GgmlType::Q8_0, {33}), "not a multiple of the q8_0 block size 32");
  expect_error(w.add_tensor("e", GgmlType::F32, {1ull << 40, 1ull << 40}), "overflows");
  expect_error(w.add_tensor("", GgmlType::F32, {1}), "name is empty");
}

TEST_F(GgufWriterTest, RejectsArraysWhoseElementsDoNotMatchTheirType) {
  GgufWriter w(dir_ / "x.gguf");
  w.set("bad", Value::array(ValueType::UINT32, {Value::u32(1), Value::i32(2)}));
  Status s = w.begin();
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("'bad': element [1] has type i32 in an array of u32"), std::string::npos)
      << s.message();
}

TEST_F(GgufWriterTest, RejectsSplitKeysSetByTheCaller) {
  GgufWriter w(dir_ / "x.gguf");
  w.set("split.count", Value::u16(3));
  Status s = w.begin();
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("'split.count'"), std::string::npos) << s.message();
}

// Tensor data produced in parallel pieces (pwrite at each piece's place) gives the same file
// as the same bytes streamed in order, mixed with ordinary writes and the alignment padding,
// split parts included; more bytes than the tensor has left are refused.
TEST_F(GgufWriterTest, ParallelPiecesWriteTheSameFile) {
  SCOPED_TRACE(dsv4::test::test_seed());
  const auto md = every_type_metadata();
  for (uint64_t split : {uint64_t{0}, uint64_t{600}}) {
    WriterOptions opts;
    opts.split_max_bytes = split;
    std::vector<std::string> want_paths;
    ASSERT_TRUE(write_file(dir_ / "serial.gguf", md, tensors_, opts, 7, &want_paths).is_ok());
    ThreadPool pool(3);
    GgufWriter w(dir_ / "parallel.gguf", opts);
    for (const auto& [k, v] : md) w.set(k, v);
    for (const auto& t : tensors_) ASSERT_TRUE(w.add_tensor(t.name, t.type, t.ne).is_ok());
    ASSERT_TRUE(w.begin().is_ok());
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const auto& bytes = tensors_[i].bytes;
      if (i % 2 == 1) {  // every other tensor: a plain write of its first byte, the rest in parallel
        ASSERT_TRUE(w.write_tensor_data({bytes.data(), 1}).is_ok());
      }
      const size_t from = i % 2;
      const Status st = w.write_tensor_data_parallel(
          bytes.size() - from, 5,
          [&](uint64_t offset, std::span<uint8_t> piece) {
            std::memcpy(piece.data(), bytes.data() + from + offset, piece.size());
          },
          pool);
      ASSERT_TRUE(st.is_ok()) << st.message();
    }
    ASSERT_TRUE(w.finish().is_ok());
    ASSERT_EQ(w.output_paths().size(), want_paths.size());
    for (size_t p = 0; p < want_paths.size(); ++p)
      EXPECT_EQ(read_bytes(w.output_paths()[p]), read_bytes(want_paths[p])) << "split " << split << " part " << p;
    if (split) {
      EXPECT_GT(want_paths.size(), 1u);
    }
    for (const auto& p : w.output_paths()) fs::remove(p);
    for (const auto& p : want_paths) fs::remove(p);
  }
  ThreadPool pool(2);
  GgufWriter w(dir_ / "over.gguf");
  ASSERT_TRUE(w.add_tensor("t", GgmlType::F32, {4}).is_ok());
  ASSERT_TRUE(w.begin().is_ok());
  const Status over = w.write_tensor_data_parallel(17, 4, [](uint64_t, std::span<uint8_t>) {}, pool);
  EXPECT_FALSE(over.is_ok());
  EXPECT_NE(over.message().find("only 16 of its 16 bytes remain"), std::string::npos) << over.message();
}

}  // namespace
}  // namespace dsv4::gguf
