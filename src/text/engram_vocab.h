// V4.1 Engram's compressed vocabulary: tokens whose text normalises alike share one id.
// Exactly DeepSeek's inference/engram.py build_compressed_token_map, which runs the
// Hugging Face `tokenizers` normaliser sequence
//   NFKC -> NFD -> StripAccents -> Lowercase -> Replace([ \t\r\n]+ -> " ")
//   -> Replace(^ $ -> U+E000) -> Strip -> Replace(U+E000 -> " ")
// on each token decoded alone; a token whose decoding is not whole UTF-8 (it contains
// U+FFFD) is keyed by its raw vocabulary string, an empty result by the decoded text, and
// ids are handed out in first-seen order. DeepSeek's tokenizer: 129,280 -> 99,092 ids.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "text/tokenizer_json.h"
#include "util/status.h"

namespace dsv4::text {

// The normaliser sequence above on UTF-8 text (invalid UTF-8 comes back unchanged).
std::string engram_normalize(std::string_view text);

struct CompressedVocab {
  std::vector<int32_t> token_map;  // compressed id of every token id
  uint32_t size = 0;               // number of compressed ids
};

// The map for a tokenizer's vocabulary (ids the vocabulary leaves unused decode to "").
Result<CompressedVocab> compressed_token_map(const TokenizerVocab& vocab);

}  // namespace dsv4::text
