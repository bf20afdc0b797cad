// Byte-level BPE tokenizer (GPT-2 style, as DeepSeek-V3/V4 use it), built from GGUF
// metadata (tokenizer.ggml.*) or a TokenizerVocab. Encoding matches Hugging Face
// `tokenizers` on the same tokenizer.json:
//   1. added tokens (GGUF types CONTROL and USER_DEFINED) are cut out first, leftmost-
//      longest, and become single ids wherever they appear;
//   2. the text between them is split by the DeepSeek-V3 pre-tokenizer;
//   3. each piece is mapped byte by byte to GPT-2's printable characters and merged by
//      BPE rank.
// Decoding maps tokens back to bytes; StreamDecoder releases only whole UTF-8 characters.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "text/tokenizer_json.h"
#include "util/status.h"

namespace dsv4::gguf {
class GgufFile;
}

namespace dsv4::text {

using TokenId = int32_t;

class Tokenizer {
 public:
  static Result<Tokenizer> from_gguf(const gguf::GgufFile& file);
  static Result<Tokenizer> from_vocab(const TokenizerVocab& vocab);
  // The tokenizer compiled into the program (builtin_tokenizer_json()); parsed once.
  static Result<std::shared_ptr<const Tokenizer>> builtin();

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Fails only on text that is not valid UTF-8 (the error gives the byte offset).
  Result<std::vector<TokenId>> encode(std::string_view text) const;

  // The bytes the ids stand for, concatenated (may end inside a UTF-8 character, or be
  // invalid UTF-8 for arbitrary id sequences). Out-of-range ids decode to nothing.
  std::string decode(std::span<const TokenId> ids) const;
  std::string_view token_bytes(TokenId id) const;  // decoded bytes of one token
  std::string_view token_text(TokenId id) const;   // the vocabulary string (byte-level form)

  size_t vocab_size() const;
  TokenId bos_id() const;
  TokenId eos_id() const;
  TokenId pad_id() const;
  bool is_added(TokenId id) const;  // CONTROL or USER_DEFINED: matched atomically
  // The id of an added token or vocabulary entry spelled exactly `text` (e.g. "</think>").
  std::optional<TokenId> find_token(std::string_view text) const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Turns a stream of ids into text without ever splitting a UTF-8 character: bytes of an
// incomplete character are held until the next token completes it. Bytes that can never
// form a valid character become U+FFFD, as Hugging Face's lossy decode does.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer) : tokenizer_(&tokenizer) {}
  std::string push(TokenId id);  // the text that became complete with this token
  std::string flush();           // whatever is held (an incomplete tail becomes U+FFFD)
  void reset() { pending_.clear(); }

 private:
  const Tokenizer* tokenizer_;
  std::string pending_;
};

// Hugging Face's ByteLevel decoder on one vocabulary string: each character back to its
// byte, or the string's own bytes when one character is outside GPT-2's byte alphabet.
std::string byte_level_token_bytes(std::string_view token);

// Validates UTF-8 (no overlongs, no surrogates, at most U+10FFFF); returns the offset of
// the first bad byte, or npos.
size_t find_invalid_utf8(std::string_view s);

// Replaces every invalid UTF-8 sequence with U+FFFD (Rust's from_utf8_lossy rules).
std::string utf8_lossy(std::string_view s);

}  // namespace dsv4::text
