// The safetensors reader: round trip through the writer, and every malformed header is a
// clear error (truncated file, bad JSON, unknown dtype, offsets out of range or
// inconsistent with the shape, overlapping tensors), never a crash.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <random>

#include "convert/safetensors.h"
#include "convert/safetensors_writer.h"
#include "support/test_support.h"

namespace dsv4::convert {
namespace {

void write_bytes(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A file with the given header JSON and `data_bytes` bytes of data.
std::string file_with_header(const std::string& header, size_t data_bytes) {
  std::string s(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(n >> (8 * i));
  return s + header + std::string(data_bytes, '\x11');
}

std::string open_error(const std::filesystem::path& path) {
  auto f = SafetensorsFile::open(path);
  EXPECT_FALSE(f.is_ok());
  return f.is_ok() ? "" : f.status().message();
}

TEST(Safetensors, WriterRoundTrip) {
  test::TempDir dir;
  std::mt19937_64 rng(test::test_seed());
  const std::vector<float> a = test::random_normal(6 * 5, rng);
  std::vector<uint8_t> b(7);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  {
    SafetensorsWriter w(dir / "x.safetensors", {{"format", "pt"}});
    w.add_tensor("a.weight", StDtype::F32, {6, 5});
    w.add_tensor("b", StDtype::F8_E8M0, {7});
    ASSERT_TRUE(w.begin().is_ok());
    ASSERT_TRUE(w.write({reinterpret_cast<const uint8_t*>(a.data()), 40}).is_ok());
    ASSERT_TRUE(w.write({reinterpret_cast<const uint8_t*>(a.data()) + 40, a.size() * 4 - 40}).is_ok());
    ASSERT_TRUE(w.write(b).is_ok());
    EXPECT_FALSE(std::filesystem::exists(dir / "x.safetensors"));  // still the .tmp
    ASSERT_TRUE(w.finish().is_ok());
  }
  auto f = SafetensorsFile::open(dir / "x.safetensors");
  ASSERT_TRUE(f.is_ok()) << f.status().message();
  EXPECT_EQ(f->metadata().at("format"), "pt");
  const StTensor* ta = f->find("a.weight");
  ASSERT_NE(ta, nullptr);
  EXPECT_EQ(ta->dtype, StDtype::F32);
  EXPECT_EQ(ta->shape, (std::vector<uint64_t>{6, 5}));
  EXPECT_EQ(std::memcmp(ta->data, a.data(), a.size() * 4), 0);
  const StTensor* tb = f->find("b");
  ASSERT_NE(tb, nullptr);
  EXPECT_EQ(std::vector<uint8_t>(tb->data, tb->data + tb->nbytes), b);
  EXPECT_EQ(f->find("c"), nullptr);
  // Headers are padded to 8 bytes, as the Python library writes them.
  EXPECT_EQ((tb->data - ta->data), 120);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(ta->data) % 8, 0u);
  f->release(ta->bytes());  // pages come back on the next read
  EXPECT_EQ(std::memcmp(ta->data, a.data(), a.size() * 4), 0);

  // The same bytes from memory give the same tensors; release() must leave a buffer that
  // is not a file mapping alone (MADV_DONTNEED would zero anonymous pages).
  std::ifstream in(dir / "x.safetensors", std::ios::binary);
  const std::vector<uint8_t> file_bytes{std::istreambuf_iterator<char>(in), {}};
  auto m = SafetensorsFile::open_bytes("x.safetensors", file_bytes);
  ASSERT_TRUE(m.is_ok()) << m.status().message();
  const StTensor* ma = m->find("a.weight");
  ASSERT_NE(ma, nullptr);
  m->release(ma->bytes());
  EXPECT_EQ(std::memcmp(ma->data, a.data(), a.size() * 4), 0);
  ASSERT_NE(m->find("b"), nullptr);
  EXPECT_EQ(std::vector<uint8_t>(m->find("b")->data, m->find("b")->data + 7), b);
  EXPECT_EQ(m->metadata(), f->metadata());
}

TEST(Safetensors, WriterRemovesTemporaryWithoutFinish) {
  test::TempDir dir;
  {
    SafetensorsWriter w(dir / "y.safetensors");
    w.add_tensor("t", StDtype::F32, {4});
    ASSERT_TRUE(w.begin().is_ok());
    EXPECT_FALSE(w.finish().is_ok());  // 0 of 16 bytes written
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(Safetensors, MalformedFilesGiveClearErrors) {
  test::TempDir dir;
  const auto p = dir / "bad.safetensors";
  struct Case {
    std::string bytes;
    std::string expect;
  };
  const std::string good = R"({"t":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";
  const std::vector<Case> cases = {
      {"", "truncated"},
      {std::string("\x05\0\0", 3), "truncated"},
      {file_with_header(good, 16).substr(0, 20), "truncated"},
      {std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + "{}", "exceeds the limit"},
      {file_with_header(R"({"t": {"dtype": )", 0), "not valid JSON"},
      {file_with_header(R"([1, 2])", 0), "not a JSON object"},
      {file_with_header(R"({"t":{"dtype":"F4X","shape":[2],"data_offsets":[0,2]}})", 2), "unknown dtype \"F4X\""},
      {file_with_header(R"({"t":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})", 12), "beyond the data section"},
      {file_with_header(R"({"t":{"dtype":"F32","shape":[2,3],"data_offsets":[0,16]}})", 16), "needs 24 bytes"},
      {file_with_header(R"({"t":{"dtype":"F32","shape":[2,-3],"data_offsets":[0,16]}})", 16), "non-negative integer"},
      {file_with_header(R"({"t":{"dtype":"F32","shape":[2,2],"data_offsets":[16,0]}})", 16), "run backwards"},
      {file_with_header(R"({"t":{"dtype":"F32","shape":[2,2]}})", 16), "missing \"data_offsets\""},
      {file_with_header(R"({"t":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                        R"("u":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})", 8), "overlap"},
      {file_with_header(R"({"t":{"dtype":"U8","shape":[4294967296,4294967296,16],"data_offsets":[0,4]}})", 4),
       "overflows"},
      {file_with_header(R"({"__metadata__":{"format":3}})", 0), "not a string"},
      // fuzz_safetensors found this one: a number beyond double range made the JSON
      // library throw out_of_range (not parse_error), which escaped open() and aborted.
      {file_with_header(R"({"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"s":3e7943})", 1),
       "not valid JSON"},
  };
  for (const Case& c : cases) {
    write_bytes(p, c.bytes);
    const std::string msg = open_error(p);
    EXPECT_NE(msg.find(c.expect), std::string::npos) << "expected \"" << c.expect << "\" in: " << msg;
    EXPECT_NE(msg.find("bad.safetensors"), std::string::npos) << msg;
    // open_bytes shares open()'s parser, so it must reject the same bytes the same way.
    auto from_memory = SafetensorsFile::open_bytes(
        "mem.safetensors", {reinterpret_cast<const uint8_t*>(c.bytes.data()), c.bytes.size()});
    ASSERT_FALSE(from_memory.is_ok()) << c.expect;
    EXPECT_NE(from_memory.status().message().find(c.expect), std::string::npos) << from_memory.status().message();
    EXPECT_NE(from_memory.status().message().find("mem.safetensors"), std::string::npos);
  }
  EXPECT_NE(open_error(dir / "absent.safetensors").find("absent.safetensors"), std::string::npos);
}

TEST(Safetensors, CheckpointIndexProblems) {
  test::TempDir dir;
  {
    SafetensorsWriter w(dir / "a.safetensors");
    w.add_tensor("x", StDtype::BF16, {3});
    ASSERT_TRUE(w.begin().is_ok());
    const uint8_t bytes[6] = {1, 2, 3, 4, 5, 6};
    ASSERT_TRUE(w.write(bytes).is_ok());
    ASSERT_TRUE(w.finish().is_ok());
  }
  auto error = [&](const std::string& index) {
    write_bytes(dir / "model.safetensors.index.json", index);
    auto c = Checkpoint::open(dir.path());
    EXPECT_FALSE(c.is_ok());
    return c.is_ok() ? std::string() : c.status().message();
  };
  EXPECT_NE(error(R"({"weight_map":{"x":"a.safetensors","y":"b.safetensors"}})").find("missing shard"),
            std::string::npos);
  EXPECT_NE(error(R"({"weight_map":{"x":"a.safetensors","y":"a.safetensors"}})").find("tensor y is missing"),
            std::string::npos);
  EXPECT_NE(error(R"({"weight_map":{"x":"../a.safetensors"}})").find("not a file name"), std::string::npos);
  EXPECT_NE(error(R"({"weight_map":)").find("not valid JSON"), std::string::npos);
  EXPECT_NE(error(R"({"metadata":{"total_size":1e999},"weight_map":{"x":"a.safetensors"}})").find("not valid JSON"),
            std::string::npos);
  EXPECT_NE(error(R"({"metadata":{}})").find("weight_map"), std::string::npos);

  write_bytes(dir / "model.safetensors.index.json", R"({"metadata":{"total_size":6},"weight_map":{"x":"a.safetensors"}})");
  auto ok = Checkpoint::open(dir.path());
  ASSERT_TRUE(ok.is_ok()) << ok.status().message();
  ASSERT_NE(ok->find("x"), nullptr);
  EXPECT_EQ(ok->data_bytes(), 6u);

  std::filesystem::remove(dir / "model.safetensors.index.json");
  auto none = Checkpoint::open(dir.path());
  ASSERT_FALSE(none.is_ok());
  EXPECT_NE(none.status().message().find("model.safetensors"), std::string::npos);
}

}  // namespace
}  // namespace dsv4::convert
