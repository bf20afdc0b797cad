// Engram's compressed vocabulary against the official build_compressed_token_map:
// DeepSeek's tokenizer (the built-in one) against shared/fixtures/engram-token-map, id for
// id, and the normaliser on the cases the tiny-v41 fixture lists.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "support/test_support.h"
#include "text/builtin_tokenizer.h"
#include "text/engram_vocab.h"
#include "text/tokenizer_json.h"

namespace dsv4::text {
namespace {

// A little-endian int32 .npy file (format 1.0 or 2.0), as numpy.save writes it.
std::vector<int32_t> read_npy_i32(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string bytes = ss.str();
  EXPECT_GE(bytes.size(), 12u);
  EXPECT_EQ(bytes.substr(1, 5), "NUMPY");
  const int major = static_cast<unsigned char>(bytes[6]);
  size_t header_len = 0, start = 0;
  if (major == 1) {
    header_len = static_cast<unsigned char>(bytes[8]) | (static_cast<unsigned char>(bytes[9]) << 8);
    start = 10;
  } else {
    uint32_t n;
    std::memcpy(&n, bytes.data() + 8, 4);
    header_len = n;
    start = 12;
  }
  const std::string header = bytes.substr(start, header_len);
  EXPECT_NE(header.find("'<i4'"), std::string::npos) << header;
  EXPECT_NE(header.find("'fortran_order': False"), std::string::npos) << header;
  std::vector<int32_t> out((bytes.size() - start - header_len) / 4);
  std::memcpy(out.data(), bytes.data() + start + header_len, out.size() * 4);
  return out;
}

TEST(EngramVocabTest, DeepSeekTokenizerMatchesOfficialMapIdForId) {
  auto vocab = parse_tokenizer_json(builtin_tokenizer_json(), "built-in tokenizer.json");
  ASSERT_TRUE(vocab.is_ok()) << vocab.status().message();
  auto map = compressed_token_map(*vocab);
  ASSERT_TRUE(map.is_ok()) << map.status().message();
  const std::vector<int32_t> want =
      read_npy_i32(test::shared_dir() / "fixtures/engram-token-map/engram_token_map.npy");
  ASSERT_EQ(want.size(), 129280u);
  ASSERT_EQ(map->token_map.size(), want.size());
  EXPECT_EQ(map->size, 99092u);
  size_t mismatches = 0;
  for (size_t i = 0; i < want.size(); ++i)
    if (map->token_map[i] != want[i] && ++mismatches <= 10)
      ADD_FAILURE() << "token " << i << " (" << vocab->tokens[i] << "): compressed id " << map->token_map[i]
                    << ", official " << want[i];
  EXPECT_EQ(mismatches, 0u);
}

TEST(EngramVocabTest, NormaliserCases) {
  // The tiny-v41 fixture's normaliser rows (README: "Tokenizer and the Engram compressed token map").
  EXPECT_EQ(engram_normalize("\xC3\xA9"), "e");                 // é
  EXPECT_EQ(engram_normalize("\xC3\x89"), "e");                 // É
  EXPECT_EQ(engram_normalize(" e"), "e");
  EXPECT_EQ(engram_normalize("\xEF\xAC\x81"), "fi");            // ﬁ ligature (NFKC)
  EXPECT_EQ(engram_normalize(" FI"), "fi");
  EXPECT_EQ(engram_normalize("\xEF\xBC\xB7\xEF\xBC\x95"), "w5");  // fullwidth Ｗ５
  EXPECT_EQ(engram_normalize(" "), " ");                        // the lone-space sentinel
  EXPECT_EQ(engram_normalize("  "), " ");
  EXPECT_EQ(engram_normalize("\n"), " ");
  EXPECT_EQ(engram_normalize("\t\n"), " ");
  EXPECT_EQ(engram_normalize("\xC2\xA0"), " ");                 // NBSP: NFKC -> space
  EXPECT_EQ(engram_normalize("Hello  World"), "hello world");
  EXPECT_EQ(engram_normalize(" hello\tworld"), "hello world");
  EXPECT_EQ(engram_normalize("\xCC\x81"), "");                  // a lone combining accent
  EXPECT_EQ(engram_normalize("\xC7\x84"), "dz");                // Ǆ
  EXPECT_EQ(engram_normalize("\xE2\x80\xA6"), "...");           // …
  EXPECT_EQ(engram_normalize("\xC4\xB0"), "i");                 // İ
  EXPECT_EQ(engram_normalize("\xC3\x9F"), "\xC3\x9F");          // ß stays ß
  EXPECT_EQ(engram_normalize("SS"), "ss");
  EXPECT_EQ(engram_normalize("\xE2\x84\x8C"), "h");             // ℌ
  EXPECT_EQ(engram_normalize("\xE4\xB8\xAD"), "\xE4\xB8\xAD");  // 中
}

}  // namespace
}  // namespace dsv4::text
