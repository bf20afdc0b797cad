// Reading a Hugging Face tokenizer.json (byte-level BPE, as DeepSeek-V3/V4 ship it) and
// writing it as GGUF tokenizer metadata in llama.cpp's convention:
//   tokenizer.ggml.model = "gpt2", tokenizer.ggml.pre = "joyai-llm" (what llama.cpp's converter
//   writes for this tokenizer: its test tokenisation hashes to that preset, which uses
//   DeepSeek-V3's split regexes), tokenizer.ggml.tokens / token_type / merges, bos/eos/padding
//   ids (padding = the tokenizer_config's pad_token, <｜end▁of▁sentence｜>, as llama.cpp's
//   converter reads it), add_bos_token = add_eos_token = false (the chat encoder writes BOS
//   itself), and tokenizer.chat_template (text/chat_template.h).
// Used by the converter and by the built-in default model (with builtin_tokenizer_json()).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "gguf/gguf_writer.h"
#include "util/status.h"

namespace dsv4::text {

// llama.cpp's token types (tokenizer.ggml.token_type).
enum class TokenType : int32_t {
  kNormal = 1,       // a BPE vocabulary entry (byte-level string)
  kUnknown = 2,
  kControl = 3,      // added token flagged special, or shaped like <｜…｜> / <|…|>
  kUserDefined = 4,  // other added tokens (<think>, ｜DSML｜, …): matched atomically too
  kUnused = 5,       // a hole in the id range, filled with "[PAD<id>]"
  kByte = 6,
};

struct TokenizerJsonOptions {
  // Names of the special tokens; each must exist in the file.
  std::string bos_token = "<｜begin▁of▁sentence｜>";
  std::string eos_token = "<｜end▁of▁sentence｜>";
  std::string pad_token = "<｜end▁of▁sentence｜>";
  // Pads the token list with unused "[PAD<id>]" entries up to this size (the model's
  // vocab_size may exceed the tokenizer's); 0 = no padding.
  uint32_t min_vocab_size = 0;
  // Accept any pre-tokenizer: for reading the vocabulary only (V4.1's Engram token map of
  // a test tokenizer); such a vocabulary must not be written as the model's tokenizer.
  bool vocabulary_only = false;
};

// What GGUF stores of a tokenizer, tokens by id.
struct TokenizerVocab {
  std::vector<std::string> tokens;      // BPE entries in byte-level form, added tokens as text
  std::vector<TokenType> token_types;   // same length as tokens
  std::vector<std::string> merges;      // "left right", in rank order
  std::string pre = "joyai-llm";        // tokenizer.ggml.pre
  uint32_t bos_id = 0;
  uint32_t eos_id = 0;
  uint32_t pad_id = 0;
};

// Parses and checks a tokenizer.json: model type BPE, byte-level pre-tokenizer and decoder,
// no byte fallback, every id in [0, n) used exactly once. `source` names the file in errors.
Result<TokenizerVocab> parse_tokenizer_json(std::string_view json, std::string_view source,
                                            const TokenizerJsonOptions& opts = {});

// Sets the tokenizer.ggml.* keys listed at the top of this file.
void write_tokenizer_metadata(const TokenizerVocab& vocab, gguf::GgufWriter& writer);

// parse_tokenizer_json + write_tokenizer_metadata.
Status write_tokenizer_metadata(std::string_view tokenizer_json, std::string_view source,
                                gguf::GgufWriter& writer, const TokenizerJsonOptions& opts = {});

}  // namespace dsv4::text
