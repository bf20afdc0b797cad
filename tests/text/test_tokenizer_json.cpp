#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "text/builtin_tokenizer.h"
#include "text/tokenizer_json.h"

namespace dsv4::text {
namespace {

const TokenizerVocab& builtin_vocab() {
  static const TokenizerVocab vocab = [] {
    auto r = parse_tokenizer_json(builtin_tokenizer_json(), "builtin tokenizer.json");
    EXPECT_TRUE(r.is_ok()) << r.status().message();
    return r.is_ok() ? std::move(r).value() : TokenizerVocab{};
  }();
  return vocab;
}

TEST(BuiltinTokenizer, IsTheDeepSeekV4Table) {
  const TokenizerVocab& v = builtin_vocab();
  ASSERT_EQ(v.tokens.size(), 129280u);
  EXPECT_EQ(v.merges.size(), 127741u);
  EXPECT_EQ(v.bos_id, 0u);
  EXPECT_EQ(v.eos_id, 1u);
  EXPECT_EQ(v.pad_id, 1u);  // the tokenizer_config's pad_token, as llama.cpp's converter writes it
  EXPECT_EQ(v.pre, "joyai-llm");
  // Rows of the V4 added-token table (spec checkpoint-tokenizer-chat.md §4).
  const std::pair<uint32_t, const char*> rows[] = {
      {0, "<｜begin▁of▁sentence｜>"}, {1, "<｜end▁of▁sentence｜>"}, {2, "<｜▁pad▁｜>"},
      {128000, "<｜place▁holder▁no▁0｜>"}, {128799, "<｜place▁holder▁no▁799｜>"},
      {128800, "<｜fim▁hole｜>"}, {128803, "<｜User｜>"}, {128804, "<｜Assistant｜>"},
      {128805, "<|EOT|>"}, {128821, "<think>"}, {128822, "</think>"}, {128825, "｜DSML｜"},
      {128828, "<｜latest_reminder｜>"}, {128829, "<｜action｜>"}, {128840, "<dsml:"},
      {128846, "<｜end_of_query｜>"}, {128847, "<|place_holder_mm_span_0021|>"},
      {129261, "<|place_holder_mm_span_0435|>"}, {129264, "<｜image2｜>"}, {129265, "<｜/table>｜"},
      {129279, "<｜image｜>"}};
  for (const auto& [id, text] : rows) EXPECT_EQ(v.tokens[id], text) << "id " << id;
  EXPECT_EQ(v.token_types[0], TokenType::kControl);
  EXPECT_EQ(v.token_types[128803], TokenType::kControl);      // looks like <｜…｜>
  EXPECT_EQ(v.token_types[128821], TokenType::kUserDefined);  // <think>: not special
  EXPECT_EQ(v.token_types[128825], TokenType::kUserDefined);  // ｜DSML｜
  EXPECT_EQ(v.token_types[300], TokenType::kNormal);
  EXPECT_EQ(v.merges[0], "Ġ t");
}

TEST(TokenizerJson, PadsToTheModelVocabulary) {
  TokenizerJsonOptions opts;
  opts.min_vocab_size = 129290;
  auto r = parse_tokenizer_json(builtin_tokenizer_json(), "builtin", opts);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  ASSERT_EQ(r->tokens.size(), 129290u);
  EXPECT_EQ(r->tokens[129285], "[PAD129285]");
  EXPECT_EQ(r->token_types[129285], TokenType::kUnused);
}

// Each mutation of a small valid file must give an error that names the problem.
TEST(TokenizerJson, RejectsWhatItCannotTokenize) {
  nlohmann::json base = nlohmann::json::parse(builtin_tokenizer_json());
  base["model"]["vocab"] = {{"a", 0}, {"b", 1}, {"ab", 2}, {"<s>", 3}, {"</s>", 4}};
  base["model"]["merges"] = {"a b"};
  base["added_tokens"] = nlohmann::json::array();
  TokenizerJsonOptions opts;
  opts.bos_token = "<s>";
  opts.eos_token = opts.pad_token = "</s>";
  ASSERT_TRUE(parse_tokenizer_json(base.dump(), "t.json", opts).is_ok());

  struct Case {
    const char* what;
    std::function<void(nlohmann::json&)> mutate;
    const char* expect;
  };
  const Case cases[] = {
      {"not BPE", [](auto& j) { j["model"]["type"] = "Unigram"; }, "model.type is Unigram"},
      {"byte fallback", [](auto& j) { j["model"]["byte_fallback"] = true; }, "byte_fallback"},
      {"other regex", [](auto& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\d+"; },
       "step 0 regex"},
      {"duplicate id", [](auto& j) { j["model"]["vocab"]["c"] = 1; }, "id 1 used by both"},
      {"bad merge", [](auto& j) { j["model"]["merges"] = {"abc"}; }, "merge 'abc'"},
      {"negative id", [](auto& j) { j["model"]["vocab"]["c"] = -4; }, "has id -4"},
      {"no decoder", [](auto& j) { j["decoder"] = nullptr; }, "decoder.type is null"},
  };
  for (const Case& c : cases) {
    nlohmann::json j = base;
    c.mutate(j);
    auto r = parse_tokenizer_json(j.dump(), "t.json", opts);
    ASSERT_FALSE(r.is_ok()) << c.what;
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos) << r.status().message();
    EXPECT_EQ(r.status().message().rfind("t.json", 0), 0u) << r.status().message();
  }
  EXPECT_FALSE(parse_tokenizer_json("{not json", "t.json", opts).is_ok());
  opts.bos_token = "<missing>";
  auto r = parse_tokenizer_json(base.dump(), "t.json", opts);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("BOS token '<missing>'"), std::string::npos);
}

}  // namespace
}  // namespace dsv4::text
