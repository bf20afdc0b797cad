// The committed malformed GGUF corpus (tests/data/gguf-malformed/, made by
// tests/data/make_malformed_gguf.py): every file must fail to open with an error that names
// the file and the offending field, both when mapped and when reading headers only.
#include <gtest/gtest.h>

#include <filesystem>
#include <set>
#include <string>

#include "gguf/gguf_file.h"
#include "gguf_test_files.h"
#include "support/test_support.h"

namespace dsv4::gguf {
namespace {

namespace fs = std::filesystem;

struct MalformedCase {
  const char* file;
  const char* expected;  // a substring of the error message
};

const MalformedCase kCases[] = {
    {"empty.gguf", "magic: truncated: needs 4 bytes at offset 0 but only 0 are left"},
    {"bad_magic.gguf", "magic: bad magic 0x4c4d4747"},
    {"version_1.gguf", "version: unsupported GGUF version 1"},
    {"version_big_endian.gguf", "big-endian GGUF files are not supported"},
    {"truncated_counts.gguf", "tensor_count: truncated: needs 8 bytes at offset 8 but only 6 are left"},
    {"kv_count_huge.gguf", "kv_count: 1152921504606846976 key-value pairs cannot fit"},
    {"tensor_count_huge.gguf", "tensor_count: 1099511627776 exceeds the limit"},
    {"tensor_count_cannot_fit.gguf", "tensor_count: 1000 tensor infos cannot fit in the 8 bytes left in the file"},
    {"key_length_past_end.gguf", "metadata key #0: string length 1000 at offset 24 exceeds the 19 bytes left in the file"},
    {"duplicate_key.gguf", "metadata key 'a' (#1): duplicate key (first defined as #0)"},
    {"empty_key.gguf", "metadata key #1: empty key at offset 41"},
    {"unknown_value_type.gguf", "metadata key 'a' (#0): unknown value type 13"},
    {"string_value_past_end.gguf", "metadata key 'general.name' (#0): string length 1000"},
    {"string_value_huge.gguf", "metadata key 'general.name' (#0): string length 18446744073709551615"},
    {"array_length_huge.gguf", "metadata key 'arr' (#0): array of 4611686018427387904 u32 elements"},
    {"array_unknown_elem_type.gguf", "metadata key 'arr' (#0): unknown array element type 99"},
    {"array_nested_too_deep.gguf", "arrays nested more than 8 deep"},
    {"array_nested_length_huge.gguf",
     "metadata key 'nest' (#0)[0]: array of 1152921504606846976 u8 elements at offset 56 cannot fit in the 0 bytes left"},
    {"array_string_count_huge.gguf",
     "metadata key 'tokenizer.ggml.tokens' (#0): array of 1099511627776 string elements at offset"},
    {"array_nested_string_length_huge.gguf",
     "metadata key 'nest' (#0)[0][0]: string length 9223372036854775808 at offset 64 exceeds the limit of 67108864"},
    {"array_string_elem_past_end.gguf", "metadata key 'words' (#0)[1]: string length 1000"},
    {"invalid_bool.gguf", "metadata key 'flag' (#0): invalid bool byte 2"},
    {"truncated_in_value.gguf", "metadata key 'a' (#0): truncated: needs 4 bytes"},
    {"alignment_not_power_of_two.gguf", "metadata key 'general.alignment': 48 is not a power of two"},
    {"alignment_zero.gguf", "metadata key 'general.alignment': 0 is not a power of two"},
    {"alignment_wrong_type.gguf", "metadata key 'general.alignment': type u64, expected u32"},
    {"alignment_huge.gguf", "metadata key 'general.alignment': 1073741824 exceeds the limit of 65536"},
    {"alignment_largest_u32.gguf", "metadata key 'general.alignment': 2147483648 exceeds the limit of 65536"},
    {"alignment_above_limit.gguf", "metadata key 'general.alignment': 131072 exceeds the limit of 65536"},
    {"tensor_name_length_huge.gguf", "tensor info #0 name: string length 1125899906842624"},
    {"tensor_empty_name.gguf", "tensor info #0: empty name at offset 24"},
    {"tensor_too_many_dims.gguf", "tensor 'w' (#0): n_dims 5 exceeds the maximum of 4"},
    {"tensor_zero_dim.gguf", "tensor 'w' (#0): dimension ne[1] is 0"},
    {"tensor_dims_overflow.gguf", "tensor 'w' (#0): element count overflows at dimension ne[1] = 4294967296"},
    {"tensor_bytes_overflow.gguf",
     "tensor 'w' (#0): byte size overflows (2147483648 rows of 8589934592 bytes)"},
    {"tensor_unknown_type.gguf", "tensor 'w' (#0): unknown tensor type id 99"},
    {"tensor_row_not_whole_blocks.gguf", "tensor 'w' (#0): row length ne[0] = 33 is not a multiple of the q8_0"},
    {"tensor_misaligned_offset.gguf", "tensor 'w' (#0): data offset 4 is not a multiple of the alignment 32"},
    {"tensor_data_past_end.gguf", "tensor 'w' (#0): data at offset 0 of 64 bytes runs past the end"},
    {"tensor_offset_overflow.gguf", "tensor 'w' (#0): data at offset 18446744073709551584 of 32 bytes runs past"},
    {"tensor_data_section_missing.gguf", "data section: starts at offset 64"},
    {"tensors_overlap.gguf", "tensor 'w2': data [32, 64) overlaps tensor 'w1' at offset 0"},
    {"duplicate_tensor_name.gguf", "tensor 'w' (#1): duplicate tensor name (first defined as #0)"},
    {"truncated_tensor_info.gguf", "tensor 'w' (#0) offset: truncated: needs 8 bytes at offset 49 but only 6"},
    {"split_count_wrong_type.gguf", "metadata key 'split.count': type string, expected an integer"},
    {"split_count_huge.gguf", "metadata key 'split.count': 100000 parts exceeds the limit of 65535"},
    {"split_no_missing.gguf", "metadata key 'split.no' is missing (split.count is 2)"},
    {"split_no_out_of_range-00001-of-00002.gguf", "metadata key 'split.no': 5 is not below split.count 2"},
    {"split_wrong_name.gguf", "file name does not end in '-00001-of-00002.gguf'"},
    {"split_missing-00001-of-00002.gguf", "split part 2 of 2 is missing or unreadable"},
    {"split_count_disagree-00001-of-00002.gguf",
     "/split_count_disagree-00001-of-00002.gguf says 2: the parts disagree"},
    {"split_total_disagree-00001-of-00002.gguf",
     "-00002-of-00002.gguf: metadata key 'split.tensors.count' is 3, but the first part says 2"},
    {"split_tensor_count_wrong-00001-of-00002.gguf",
     "metadata key 'split.tensors.count' is 5, but the 2 parts hold 2 tensors"},
    {"split_part_swapped-00001-of-00002.gguf", "-00002-of-00002.gguf: metadata key 'split.no' is 0, expected 1"},
    {"split_duplicate_tensor-00001-of-00002.gguf",
     "-00002-of-00002.gguf: tensor 'w' is also defined in"},
    {"split_part_corrupt-00001-of-00002.gguf", "split_part_corrupt-00002-of-00002.gguf: kv_count: 3 key-value pairs"},
};

fs::path corpus_dir() { return dsv4::test::source_dir() / "tests" / "data" / "gguf-malformed"; }

class MalformedGgufTest : public ::testing::TestWithParam<MalformedCase> {};

TEST_P(MalformedGgufTest, FailsWithAMessageNamingTheFileAndField) {
  const MalformedCase& c = GetParam();
  const fs::path path = corpus_dir() / c.file;
  ASSERT_TRUE(fs::exists(path)) << path << " (regenerate with tests/data/make_malformed_gguf.py)";
  for (bool map_data : {true, false}) {
    SCOPED_TRACE(map_data ? "mapped" : "headers only");
    auto f = GgufFile::open(path, {.map_data = map_data});
    ASSERT_FALSE(f.is_ok()) << c.file << " opened without error";
    const std::string msg = f.status().message();
    EXPECT_NE(msg.find(c.expected), std::string::npos) << "message: " << msg << "\nexpected: " << c.expected;
    // Every message starts with the file it is about (the part, for a broken split part).
    const std::string stem = std::string(c.file).substr(0, std::string(c.file).find('-'));
    EXPECT_NE(msg.find(corpus_dir().string() + "/" + stem), std::string::npos) << msg;
  }
  // The same bytes from memory fail the same way, except where the failure is in a sibling
  // part (split sets are not followed from memory).
  if (std::string(c.file).rfind("split_", 0) != 0) {
    const auto bytes = testing::read_bytes(path);
    auto m = GgufFile::open_bytes(c.file, bytes);
    ASSERT_FALSE(m.is_ok());
    EXPECT_NE(m.status().message().find(c.expected), std::string::npos) << m.status().message();
  }
}

INSTANTIATE_TEST_SUITE_P(Corpus, MalformedGgufTest, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<MalformedCase>& info) {
                           std::string name = info.param.file;
                           name = name.substr(0, name.find('.'));
                           for (char& ch : name)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return name;
                         });

TEST(MalformedGgufCorpus, EveryFileIsCovered) {
  std::set<std::string> listed;
  for (const auto& c : kCases) listed.insert(c.file);
  for (const auto& entry : fs::directory_iterator(corpus_dir())) {
    const std::string name = entry.path().filename().string();
    // Later parts of a split set are reached through their first part.
    if (name.find("-00002-of-") != std::string::npos) continue;
    EXPECT_TRUE(listed.count(name)) << name << " is in the corpus but not in the table";
  }
}

}  // namespace
}  // namespace dsv4::gguf
