#include "text/engram_vocab.h"

#include <utf8proc.h>

#include <cstdlib>
#include <unordered_map>

#include "text/tokenizer.h"

namespace dsv4::text {
namespace {

constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD
constexpr char32_t kSentinel = 0xE000;

std::u32string decode_utf8(std::string_view s) {
  std::u32string out;
  const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(s.data());
  utf8proc_ssize_t i = 0, n = static_cast<utf8proc_ssize_t>(s.size());
  while (i < n) {
    utf8proc_int32_t cp;
    const utf8proc_ssize_t len = utf8proc_iterate(p + i, n - i, &cp);
    if (len <= 0) return {};
    out.push_back(static_cast<char32_t>(cp));
    i += len;
  }
  return out;
}

std::string encode_utf8(const std::u32string& s) {
  std::string out;
  for (char32_t c : s) {
    utf8proc_uint8_t buf[4];
    const utf8proc_ssize_t len = utf8proc_encode_char(static_cast<utf8proc_int32_t>(c), buf);
    out.append(reinterpret_cast<const char*>(buf), static_cast<size_t>(len));
  }
  return out;
}

// utf8proc's NFKC / NFD of valid UTF-8.
std::string normalize_form(std::string_view s, int options) {
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                          static_cast<utf8proc_ssize_t>(s.size()), &out,
                                          static_cast<utf8proc_option_t>(options | UTF8PROC_STABLE));
  if (n < 0) return std::string(s);
  std::string r(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
  std::free(out);
  return r;
}

bool is_mark(char32_t c) {  // General_Category = Mark (what StripAccents removes)
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat == UTF8PROC_CATEGORY_MN || cat == UTF8PROC_CATEGORY_MC || cat == UTF8PROC_CATEGORY_ME;
}

// Rust's char::is_whitespace: the White_Space property.
bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// Rust's char::to_lowercase: the simple mapping, except U+0130's unconditional
// two-character lowercase in SpecialCasing.
void append_lower(char32_t c, std::u32string& out) {
  if (c == 0x130) {
    out += U"i\u0307";
    return;
  }
  out.push_back(static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c))));
}

}  // namespace

std::string engram_normalize(std::string_view text) {
  if (find_invalid_utf8(text) != std::string_view::npos) return std::string(text);
  const std::string nfd = normalize_form(normalize_form(text, UTF8PROC_COMPOSE | UTF8PROC_COMPAT), UTF8PROC_DECOMPOSE);
  std::u32string s;
  bool in_run = false;  // inside a run of [ \t\r\n], which becomes one space
  for (char32_t c : decode_utf8(nfd)) {
    if (is_mark(c)) continue;  // StripAccents
    std::u32string lower;
    append_lower(c, lower);
    for (char32_t l : lower) {
      const bool ws = l == U' ' || l == U'\t' || l == U'\r' || l == U'\n';
      if (ws && in_run) continue;
      in_run = ws;
      s.push_back(ws ? U' ' : l);
    }
  }
  if (s == U" ") s = std::u32string(1, kSentinel);  // a lone space survives Strip
  size_t begin = 0, end = s.size();
  while (begin < end && is_white_space(s[begin])) ++begin;
  while (end > begin && is_white_space(s[end - 1])) --end;
  s = s.substr(begin, end - begin);
  for (char32_t& c : s)
    if (c == kSentinel) c = U' ';
  return encode_utf8(s);
}

Result<CompressedVocab> compressed_token_map(const TokenizerVocab& vocab) {
  if (vocab.token_types.size() != vocab.tokens.size())
    return Status::errorf("engram vocabulary: {} token types for {} tokens", vocab.token_types.size(),
                          vocab.tokens.size());
  CompressedVocab out;
  out.token_map.resize(vocab.tokens.size());
  std::unordered_map<std::string, int32_t> ids;
  for (size_t i = 0; i < vocab.tokens.size(); ++i) {
    std::string key;
    if (vocab.token_types[i] != TokenType::kUnused) {
      const std::string text = utf8_lossy(byte_level_token_bytes(vocab.tokens[i]));
      if (text.find(kReplacementChar) != std::string::npos) {
        key = vocab.tokens[i];
      } else {
        key = engram_normalize(text);
        if (key.empty()) key = text;
      }
    }
    auto [it, inserted] = ids.emplace(std::move(key), static_cast<int32_t>(ids.size()));
    out.token_map[i] = it->second;
  }
  out.size = static_cast<uint32_t>(ids.size());
  return out;
}

}  // namespace dsv4::text
