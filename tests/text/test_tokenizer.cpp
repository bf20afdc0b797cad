#include <gtest/gtest.h>

#include <random>

#include "gguf/gguf_file.h"
#include "gguf/gguf_writer.h"
#include "support/test_support.h"
#include "text/builtin_tokenizer.h"
#include "text/tokenizer.h"

namespace dsv4::text {
namespace {

const Tokenizer& builtin() {
  static std::shared_ptr<const Tokenizer> tok = [] {
    auto r = Tokenizer::builtin();
    EXPECT_TRUE(r.is_ok()) << r.status().message();
    return r.is_ok() ? *r : nullptr;
  }();
  return *tok;
}

const TokenizerVocab& builtin_vocab() {
  static const TokenizerVocab v = [] {
    auto r = parse_tokenizer_json(builtin_tokenizer_json(), "builtin");
    EXPECT_TRUE(r.is_ok()) << r.status().message();
    return r.is_ok() ? *r : TokenizerVocab{};
  }();
  return v;
}

std::vector<TokenId> encode(const Tokenizer& tok, std::string_view s) {
  auto r = tok.encode(s);
  EXPECT_TRUE(r.is_ok()) << r.status().message();
  return r.is_ok() ? *r : std::vector<TokenId>{};
}

TEST(Tokenizer, SpecExampleIds) {
  // checkpoint-tokenizer-chat.md §4: the V4 test expectation.
  EXPECT_EQ(encode(builtin(), "<｜User｜>你好<｜Assistant｜><think>推理</think>答案<｜end▁of▁sentence｜>"),
            (std::vector<TokenId>{128803, 30594, 128804, 128821, 36101, 128822, 7624, 1}));
  EXPECT_EQ(builtin().bos_id(), 0);
  EXPECT_EQ(builtin().eos_id(), 1);
  EXPECT_EQ(builtin().find_token("</think>"), 128822);
  EXPECT_EQ(builtin().find_token("｜DSML｜"), 128825);
  EXPECT_TRUE(builtin().is_added(128825));
  EXPECT_FALSE(builtin().is_added(30594));
}

TEST(Tokenizer, AddedTokensAreAtomicAndPartialOnesAreText) {
  const Tokenizer& t = builtin();
  auto ids = encode(t, "x<｜User｜>y");
  ASSERT_EQ(ids.size(), 3u);
  EXPECT_EQ(ids[1], 128803);
  for (TokenId id : encode(t, "<｜User <think <｜DSML｜"))
    EXPECT_TRUE(id == 128825 || !t.is_added(id)) << id;
  // The longest added token wins where two start at the same place.
  auto tail = encode(t, "</think>");
  EXPECT_EQ(tail, (std::vector<TokenId>{128822}));
}

TEST(Tokenizer, RoundTripsRandomText) {
  std::mt19937_64 rng(test::test_seed());
  const std::vector<std::string> alphabet = {"a", "Z", " ", "  ", "\n", "\t", "7", "123456", "é", "你", "好",
                                             "😀", "👨‍👩‍👧", "<｜User｜>", "</think>", ".", "'s", "\xc2\xa0"};
  for (int n = 0; n < 300; ++n) {
    std::string s;
    for (int k = std::uniform_int_distribution<int>(0, 30)(rng); k > 0; --k)
      s += alphabet[std::uniform_int_distribution<size_t>(0, alphabet.size() - 1)(rng)];
    auto ids = encode(builtin(), s);
    EXPECT_EQ(builtin().decode(ids), s) << "seed " << test::test_seed();
  }
}

TEST(Tokenizer, RejectsInvalidUtf8WithItsOffset) {
  auto r = builtin().encode(std::string("ok\xff", 3));
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("offset 2"), std::string::npos) << r.status().message();
  EXPECT_FALSE(builtin().encode("\xed\xa0\x80").is_ok());  // a surrogate
  EXPECT_FALSE(builtin().encode("\xc0\xaf").is_ok());      // overlong
}

TEST(Utf8, LossyFollowsMaximalSubparts) {
  EXPECT_EQ(utf8_lossy("a\xe2\x82" "b"), "a\xEF\xBF\xBD" "b");                   // one U+FFFD for E2 82
  EXPECT_EQ(utf8_lossy("\xf0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD");                 // F0 then 80: two
  EXPECT_EQ(utf8_lossy("\xf4\x90\x80\x80"),  // above U+10FFFF: four
            "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(utf8_lossy("é😀"), "é😀");
  EXPECT_EQ(find_invalid_utf8("abc"), std::string_view::npos);
  EXPECT_EQ(find_invalid_utf8("ab\x80"), 2u);
}

TEST(StreamDecoder, NeverSplitsACharacter) {
  const Tokenizer& t = builtin();
  // Emoji and rare CJK encode as several byte tokens each.
  const std::string text = "a😀b👨‍👩‍👧 龘𠀀 x";
  auto ids = encode(t, text);
  ASSERT_GT(ids.size(), 8u);
  StreamDecoder dec(t);
  std::string joined;
  for (TokenId id : ids) {
    const std::string piece = dec.push(id);
    EXPECT_EQ(find_invalid_utf8(piece), std::string_view::npos) << "after id " << id;
    joined += piece;
  }
  joined += dec.flush();
  EXPECT_EQ(joined, text);
}

TEST(StreamDecoder, HoldsAnIncompleteTailAndReplacesWhatCannotComplete) {
  const Tokenizer& t = builtin();
  auto emoji = encode(t, "😀");
  ASSERT_GT(emoji.size(), 1u);
  StreamDecoder dec(t);
  EXPECT_EQ(dec.push(emoji[0]), "");  // only the first bytes: held back
  EXPECT_EQ(dec.flush(), "\xEF\xBF\xBD");
  // A held prefix followed by plain text becomes U+FFFD, then the text.
  auto a = encode(t, "a");
  EXPECT_EQ(dec.push(emoji[0]), "");
  EXPECT_EQ(dec.push(a[0]), "\xEF\xBF\xBD" "a");
  EXPECT_EQ(dec.flush(), "");
}

TEST(Tokenizer, LoadsFromGgufMetadataWrittenFromTokenizerJson) {
  test::TempDir dir;
  const std::string path = (dir / "tok.gguf").string();
  {
    gguf::GgufWriter w(path);
    ASSERT_TRUE(write_tokenizer_metadata(builtin_tokenizer_json(), "builtin", w).is_ok());  // the JSON entry point
    ASSERT_TRUE(w.begin().is_ok());
    ASSERT_TRUE(w.finish().is_ok());
  }
  auto file = gguf::GgufFile::open(path);
  ASSERT_TRUE(file.is_ok()) << file.status().message();
  EXPECT_EQ(*file->get_string("tokenizer.ggml.pre"), "joyai-llm");  // llama.cpp's name for this tokenizer
  EXPECT_EQ(*file->get_uint("tokenizer.ggml.padding_token_id"), 1u);
  EXPECT_EQ(*file->get_bool("tokenizer.ggml.add_bos_token"), false);
  auto tok = Tokenizer::from_gguf(*file);
  ASSERT_TRUE(tok.is_ok()) << tok.status().message();
  EXPECT_EQ(tok->vocab_size(), 129280u);
  const std::string s = "Hello, 世界! <｜User｜>  x = 12345;\n\n\tdef f(): pass 😀";
  EXPECT_EQ(encode(*tok, s), encode(builtin(), s));
}

TEST(Tokenizer, RejectsUnsupportedGgufTokenizers) {
  test::TempDir dir;
  auto write = [&](const char* name, const char* model, const char* pre) {
    const std::string path = (dir / name).string();
    gguf::GgufWriter w(path);
    write_tokenizer_metadata(builtin_vocab(), w);
    w.set("tokenizer.ggml.model", gguf::Value::string(model));
    w.set("tokenizer.ggml.pre", gguf::Value::string(pre));
    EXPECT_TRUE(w.begin().is_ok());
    EXPECT_TRUE(w.finish().is_ok());
    return path;
  };
  auto llama = gguf::GgufFile::open(write("a.gguf", "llama", "deepseek-v3"));
  ASSERT_TRUE(llama.is_ok());
  auto r1 = Tokenizer::from_gguf(*llama);
  ASSERT_FALSE(r1.is_ok());
  EXPECT_NE(r1.status().message().find("'llama'"), std::string::npos) << r1.status().message();
  auto qwen = gguf::GgufFile::open(write("b.gguf", "gpt2", "qwen2"));
  ASSERT_TRUE(qwen.is_ok());
  auto r2 = Tokenizer::from_gguf(*qwen);
  ASSERT_FALSE(r2.is_ok());
  EXPECT_NE(r2.status().message().find("'qwen2'"), std::string::npos) << r2.status().message();
  auto joy = gguf::GgufFile::open(write("c.gguf", "gpt2", "joyai-llm"));
  ASSERT_TRUE(joy.is_ok());
  EXPECT_TRUE(Tokenizer::from_gguf(*joy).is_ok());
}

}  // namespace
}  // namespace dsv4::text
