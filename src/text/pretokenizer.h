// The DeepSeek-V3 pre-tokenizer (used unchanged by V4): three regex splits, each keeping
// the matches and the text between them as separate pieces (HF "Isolated" behaviour),
// applied one after another; BPE then runs on each piece. Regexes are compiled with PCRE2
// (UTF mode, Unicode properties). GGUF names it "deepseek-v3"; llama.cpp V4 forks write
// "joyai-llm" for the same regexes.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "util/status.h"

namespace dsv4::text {

// As in tokenizer.json after JSON unescaping (the CR/LF inside the classes are literal
// control characters there; PCRE2 reads "\r\n" the same).
inline constexpr std::array<std::string_view, 3> kDeepSeekV3SplitRegexes = {
    "\\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| "
    "?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
};

// True for the GGUF tokenizer.ggml.pre names that mean these regexes.
bool is_deepseek_v3_pre_name(std::string_view name);

class PreTokenizer {
 public:
  static Result<PreTokenizer> deepseek_v3();
  PreTokenizer(PreTokenizer&&) noexcept;
  PreTokenizer& operator=(PreTokenizer&&) noexcept;
  ~PreTokenizer();

  // Splits valid UTF-8 `text` into pieces whose concatenation is `text`; appends views
  // into `text` to `pieces`.
  void split(std::string_view text, std::vector<std::string_view>& pieces) const;

 private:
  struct Impl;
  explicit PreTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsv4::text
