#include "text/tokenizer.h"

#include <array>
#include <mutex>
#include <queue>
#include <unordered_map>

#include "gguf/gguf_file.h"
#include "text/builtin_tokenizer.h"
#include "text/pretokenizer.h"

namespace dsv4::text {

// ---- UTF-8 -------------------------------------------------------------------------

namespace {

enum class Utf8Step { kValid, kInvalid, kIncomplete };

// Examines the sequence starting at s[i]: kValid with its length, kInvalid with the length
// of the maximal invalid subpart (>= 1) to replace by one U+FFFD, or kIncomplete when the
// string ends inside a sequence that could still become valid.
std::pair<Utf8Step, size_t> utf8_step(std::string_view s, size_t i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return {Utf8Step::kValid, 1};
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;  // range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;  // at most U+10FFFF
  } else {
    return {Utf8Step::kInvalid, 1};
  }
  for (size_t k = 1; k <= need; ++k) {
    if (i + k >= s.size()) return {Utf8Step::kIncomplete, k};
    const auto b = static_cast<unsigned char>(s[i + k]);
    const unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) return {Utf8Step::kInvalid, k};
  }
  return {Utf8Step::kValid, need + 1};
}

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";

// Appends the valid prefix of `s` to `out` (invalid parts as U+FFFD); returns how many
// bytes were consumed: all of them unless an incomplete sequence ends `s` and
// `keep_incomplete_tail` is set.
size_t append_lossy(std::string_view s, bool keep_incomplete_tail, std::string& out) {
  size_t i = 0;
  while (i < s.size()) {
    auto [step, len] = utf8_step(s, i);
    if (step == Utf8Step::kIncomplete) {
      if (keep_incomplete_tail) return i;
      step = Utf8Step::kInvalid;
    }
    if (step == Utf8Step::kValid) out.append(s.substr(i, len));
    else out.append(kReplacement);
    i += len;
  }
  return i;
}

}  // namespace

size_t find_invalid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    auto [step, len] = utf8_step(s, i);
    if (step != Utf8Step::kValid) return i;
    i += len;
  }
  return std::string_view::npos;
}

std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  append_lossy(s, false, out);
  return out;
}

// ---- GPT-2 byte <-> character mapping -------------------------------------------------

namespace {

// bytes_to_unicode(): printable Latin-1 bytes map to themselves, the other 68 to U+0100+n.
std::array<uint32_t, 256> byte_to_codepoint() {
  std::array<uint32_t, 256> m{};
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    m[b] = printable ? b : next++;
  }
  return m;
}

void append_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

uint32_t decode_codepoint(std::string_view s, size_t i, size_t len) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (len == 1) return b0;
  uint32_t cp = b0 & (0x7F >> len);
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  return cp;
}

// Hugging Face's ByteLevel decoder: a token whose every character is one of the 256
// mapped characters decodes to those bytes; any other token (added tokens such as
// <｜User｜>) decodes to its own UTF-8 text.
std::string byte_level_decode(std::string_view token,
                              const std::unordered_map<uint32_t, uint8_t>& to_byte) {
  std::string out;
  for (size_t i = 0; i < token.size();) {
    auto [step, len] = utf8_step(token, i);
    if (step != Utf8Step::kValid) return std::string(token);
    auto it = to_byte.find(decode_codepoint(token, i, len));
    if (it == to_byte.end()) return std::string(token);
    out.push_back(static_cast<char>(it->second));
    i += len;
  }
  return out;
}

}  // namespace

// ---- Tokenizer ----------------------------------------------------------------------

struct Tokenizer::Impl {
  struct Merge {
    uint32_t rank;
    TokenId result;
  };
  // A byte trie over the added tokens for leftmost-longest matching.
  struct TrieNode {
    std::vector<std::pair<uint8_t, int32_t>> children;
    TokenId token = -1;
  };

  std::vector<std::string> text;   // vocabulary strings
  std::vector<std::string> bytes;  // decoded bytes
  std::vector<TokenType> types;
  std::unordered_map<std::string, TokenId> vocab;  // BPE entries only
  std::unordered_map<std::string, TokenId> added;
  std::unordered_map<uint64_t, Merge> merges;      // (left << 32 | right) -> merge
  std::array<TokenId, 256> byte_token{};
  std::vector<TrieNode> trie;
  std::array<int32_t, 256> trie_root{};            // first byte -> node (or -1)
  PreTokenizer pre;
  TokenId bos = 0, eos = 0, pad = 0;

  explicit Impl(PreTokenizer p) : pre(std::move(p)) {}

  void add_to_trie(std::string_view s, TokenId id);
  // Length of the longest added token starting at text[i] (0 if none), and its id.
  std::pair<size_t, TokenId> match_added(std::string_view s, size_t i) const;
  void bpe(std::string_view piece, std::vector<TokenId>& out) const;
};

void Tokenizer::Impl::add_to_trie(std::string_view s, TokenId id) {
  if (s.empty()) return;
  const auto first = static_cast<uint8_t>(s[0]);
  if (trie_root[first] < 0) {
    trie_root[first] = static_cast<int32_t>(trie.size());
    trie.emplace_back();
  }
  int32_t node = trie_root[first];
  for (size_t k = 1; k < s.size(); ++k) {
    const auto c = static_cast<uint8_t>(s[k]);
    int32_t child = -1;
    for (const auto& [ch, idx] : trie[node].children)
      if (ch == c) child = idx;
    if (child < 0) {
      child = static_cast<int32_t>(trie.size());
      trie[node].children.emplace_back(c, child);
      trie.emplace_back();
    }
    node = child;
  }
  trie[node].token = id;
}

std::pair<size_t, TokenId> Tokenizer::Impl::match_added(std::string_view s, size_t i) const {
  int32_t node = trie_root[static_cast<uint8_t>(s[i])];
  size_t best_len = 0;
  TokenId best = -1;
  for (size_t k = i + 1; node >= 0; ++k) {
    if (trie[node].token >= 0) {
      best_len = k - i;
      best = trie[node].token;
    }
    if (k == s.size()) break;
    const auto c = static_cast<uint8_t>(s[k]);
    int32_t next = -1;
    for (const auto& [ch, idx] : trie[node].children)
      if (ch == c) next = idx;
    node = next;
  }
  return {best_len, best};
}

void Tokenizer::Impl::bpe(std::string_view piece, std::vector<TokenId>& out) const {
  // Symbols form a linked list; candidate merges wait in a min-heap ordered by rank then
  // position, as in Hugging Face's BPE (stale entries are skipped when popped).
  struct Symbol {
    TokenId id;
    int32_t prev, next;
  };
  struct Candidate {
    uint32_t rank;
    int32_t left, right;
    TokenId left_id, right_id, result;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : left > o.left;
    }
  };
  const auto n = static_cast<int32_t>(piece.size());
  if (n == 1) {
    out.push_back(byte_token[static_cast<uint8_t>(piece[0])]);
    return;
  }
  std::vector<Symbol> sym(n);
  for (int32_t i = 0; i < n; ++i) sym[i] = {byte_token[static_cast<uint8_t>(piece[i])], i - 1, i + 1 < n ? i + 1 : -1};
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto consider = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    auto it = merges.find(static_cast<uint64_t>(sym[l].id) << 32 | static_cast<uint32_t>(sym[r].id));
    if (it != merges.end()) heap.push({it->second.rank, l, r, sym[l].id, sym[r].id, it->second.result});
  };
  for (int32_t i = 0; i + 1 < n; ++i) consider(i, i + 1);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    Symbol& l = sym[c.left];
    if (l.id != c.left_id || l.next != c.right || sym[c.right].id != c.right_id) continue;
    l.id = c.result;
    Symbol& r = sym[c.right];
    l.next = r.next;
    if (r.next >= 0) sym[r.next].prev = c.left;
    r.id = -1;
    consider(l.prev, c.left);
    consider(c.left, l.next);
  }
  for (int32_t i = 0; i >= 0; i = sym[i].next) out.push_back(sym[i].id);
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Result<Tokenizer> Tokenizer::from_vocab(const TokenizerVocab& v) {
  const size_t n = v.tokens.size();
  if (n == 0 || n > (1u << 24)) return Status::errorf("tokenizer: {} tokens, expected 1..{}", n, 1u << 24);
  if (v.token_types.size() != n)
    return Status::errorf("tokenizer: {} token types for {} tokens", v.token_types.size(), n);
  for (auto [what, id] : {std::pair{"bos", v.bos_id}, {"eos", v.eos_id}, {"padding", v.pad_id}})
    if (id >= n) return Status::errorf("tokenizer: {} token id {} out of range (vocabulary of {})", what, id, n);
  if (!is_deepseek_v3_pre_name(v.pre))
    return Status::errorf("tokenizer: pre-tokenizer '{}' is not supported (expected deepseek-v3 or joyai-llm)", v.pre);

  DSV4_ASSIGN_OR_RETURN(PreTokenizer pre, PreTokenizer::deepseek_v3());
  auto impl = std::make_unique<Impl>(std::move(pre));
  impl->text = v.tokens;
  impl->types = v.token_types;
  impl->bos = static_cast<TokenId>(v.bos_id);
  impl->eos = static_cast<TokenId>(v.eos_id);
  impl->pad = static_cast<TokenId>(v.pad_id);

  const auto b2c = byte_to_codepoint();
  std::unordered_map<uint32_t, uint8_t> c2b;
  for (uint32_t b = 0; b < 256; ++b) c2b[b2c[b]] = static_cast<uint8_t>(b);

  impl->trie_root.fill(-1);
  impl->bytes.resize(n);
  impl->vocab.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const auto id = static_cast<TokenId>(i);
    impl->bytes[i] = byte_level_decode(v.tokens[i], c2b);
    switch (v.token_types[i]) {
      case TokenType::kControl:
      case TokenType::kUserDefined:
        impl->added.emplace(v.tokens[i], id);
        impl->add_to_trie(v.tokens[i], id);
        break;
      case TokenType::kNormal:
        impl->vocab.emplace(v.tokens[i], id);
        break;
      default:
        break;
    }
  }
  for (uint32_t b = 0; b < 256; ++b) {
    std::string ch;
    append_utf8(b2c[b], ch);
    auto it = impl->vocab.find(ch);
    if (it == impl->vocab.end())
      return Status::errorf("tokenizer: byte 0x{:02x} has no token '{}' (not a byte-level BPE vocabulary)", b, ch);
    impl->byte_token[b] = it->second;
  }
  impl->merges.reserve(v.merges.size());
  for (size_t r = 0; r < v.merges.size(); ++r) {
    const std::string& m = v.merges[r];
    const size_t sp = m.find(' ');
    if (sp == std::string::npos || m.find(' ', sp + 1) != std::string::npos)
      return Status::errorf("tokenizer: merge {} '{}' is not two tokens separated by one space", r, m);
    const std::string left = m.substr(0, sp), right = m.substr(sp + 1);
    auto l = impl->vocab.find(left), rt = impl->vocab.find(right), res = impl->vocab.find(left + right);
    if (l == impl->vocab.end() || rt == impl->vocab.end() || res == impl->vocab.end())
      return Status::errorf("tokenizer: merge {} '{}': a part or the result is not in the vocabulary", r, m);
    // A pair listed twice keeps its first (lowest) rank, as Hugging Face does.
    impl->merges.emplace(static_cast<uint64_t>(l->second) << 32 | static_cast<uint32_t>(rt->second),
                         Impl::Merge{static_cast<uint32_t>(r), res->second});
  }
  return Tokenizer(std::move(impl));
}

Result<Tokenizer> Tokenizer::from_gguf(const gguf::GgufFile& file) {
  auto ctx = [&](const Status& s) { return s.with_context(file.path()); };
  DSV4_ASSIGN_OR_RETURN(std::string model, file.get_string("tokenizer.ggml.model"));
  if (model != "gpt2")
    return Status::errorf("{}: tokenizer.ggml.model is '{}', expected 'gpt2' (byte-level BPE)", file.path(), model);
  TokenizerVocab v;
  DSV4_ASSIGN_OR_RETURN(v.pre, file.get_string("tokenizer.ggml.pre"));
  if (!is_deepseek_v3_pre_name(v.pre))
    return Status::errorf("{}: tokenizer.ggml.pre is '{}'; only the DeepSeek-V3 pre-tokenizer (deepseek-v3, "
                          "joyai-llm) is supported", file.path(), v.pre);
  DSV4_ASSIGN_OR_RETURN(v.tokens, file.get_string_array("tokenizer.ggml.tokens"));
  DSV4_ASSIGN_OR_RETURN(v.merges, file.get_string_array("tokenizer.ggml.merges"));
  const gguf::Value* types = file.find("tokenizer.ggml.token_type");
  if (!types || !types->is_array())
    return Status::errorf("{}: tokenizer.ggml.token_type missing or not an array", file.path());
  if (types->as_array().size() != v.tokens.size())
    return Status::errorf("{}: tokenizer.ggml.token_type has {} entries for {} tokens", file.path(),
                          types->as_array().size(), v.tokens.size());
  v.token_types.reserve(v.tokens.size());
  for (const gguf::Value& t : types->as_array()) {
    if (!t.is_integer()) return Status::errorf("{}: tokenizer.ggml.token_type holds non-integers", file.path());
    const int64_t x = t.type() == gguf::ValueType::INT32 || t.type() == gguf::ValueType::INT8 ||
                              t.type() == gguf::ValueType::INT16 || t.type() == gguf::ValueType::INT64
                          ? t.as_i64()
                          : static_cast<int64_t>(t.as_u64());
    v.token_types.push_back(static_cast<TokenType>(x));
  }
  auto id = [&](const char* key, uint64_t fallback) -> Result<uint32_t> {
    if (!file.find(key)) return static_cast<uint32_t>(fallback);
    DSV4_ASSIGN_OR_RETURN(uint64_t x, file.get_uint(key));
    return static_cast<uint32_t>(std::min<uint64_t>(x, UINT32_MAX));
  };
  DSV4_ASSIGN_OR_RETURN(v.bos_id, id("tokenizer.ggml.bos_token_id", 0));
  DSV4_ASSIGN_OR_RETURN(v.eos_id, id("tokenizer.ggml.eos_token_id", 1));
  DSV4_ASSIGN_OR_RETURN(v.pad_id, id("tokenizer.ggml.padding_token_id", v.eos_id));
  auto r = from_vocab(v);
  if (!r.is_ok()) return ctx(r.status());
  return r;
}

Result<std::shared_ptr<const Tokenizer>> Tokenizer::builtin() {
  static std::once_flag once;
  static Result<std::shared_ptr<const Tokenizer>> cached = Status::error("unset");
  std::call_once(once, [] {
    auto vocab = parse_tokenizer_json(builtin_tokenizer_json(), "built-in tokenizer.json");
    if (!vocab.is_ok()) {
      cached = vocab.status();
      return;
    }
    auto tok = from_vocab(*vocab);
    if (!tok.is_ok()) {
      cached = tok.status();
      return;
    }
    cached = std::shared_ptr<const Tokenizer>(std::make_shared<Tokenizer>(std::move(tok).value()));
  });
  return cached;
}

Result<std::vector<TokenId>> Tokenizer::encode(std::string_view text) const {
  if (size_t bad = find_invalid_utf8(text); bad != std::string_view::npos)
    return Status::errorf("tokenizer: input is not valid UTF-8 (byte {} at offset {})",
                          static_cast<unsigned char>(text[bad]), bad);
  std::vector<TokenId> out;
  out.reserve(text.size() / 3 + 4);
  std::vector<std::string_view> pieces;
  auto encode_plain = [&](std::string_view segment) {
    if (segment.empty()) return;
    pieces.clear();
    impl_->pre.split(segment, pieces);
    for (std::string_view p : pieces) impl_->bpe(p, out);
  };
  size_t plain_start = 0;
  for (size_t i = 0; i < text.size();) {
    if (impl_->trie_root[static_cast<uint8_t>(text[i])] >= 0) {
      auto [len, id] = impl_->match_added(text, i);
      if (len > 0) {
        encode_plain(text.substr(plain_start, i - plain_start));
        out.push_back(id);
        i += len;
        plain_start = i;
        continue;
      }
    }
    ++i;
  }
  encode_plain(text.substr(plain_start));
  return out;
}

std::string byte_level_token_bytes(std::string_view token) {
  static const std::unordered_map<uint32_t, uint8_t> c2b = [] {
    std::unordered_map<uint32_t, uint8_t> m;
    const auto b2c = byte_to_codepoint();
    for (uint32_t b = 0; b < 256; ++b) m[b2c[b]] = static_cast<uint8_t>(b);
    return m;
  }();
  return byte_level_decode(token, c2b);
}

std::string Tokenizer::decode(std::span<const TokenId> ids) const {
  std::string out;
  for (TokenId id : ids) out.append(token_bytes(id));
  return out;
}

std::string_view Tokenizer::token_bytes(TokenId id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->bytes.size()) return {};
  return impl_->bytes[id];
}

std::string_view Tokenizer::token_text(TokenId id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->text.size()) return {};
  return impl_->text[id];
}

size_t Tokenizer::vocab_size() const { return impl_->text.size(); }
TokenId Tokenizer::bos_id() const { return impl_->bos; }
TokenId Tokenizer::eos_id() const { return impl_->eos; }
TokenId Tokenizer::pad_id() const { return impl_->pad; }

bool Tokenizer::is_added(TokenId id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->types.size()) return false;
  const TokenType t = impl_->types[id];
  return t == TokenType::kControl || t == TokenType::kUserDefined;
}

std::optional<TokenId> Tokenizer::find_token(std::string_view text) const {
  const std::string key(text);
  if (auto it = impl_->added.find(key); it != impl_->added.end()) return it->second;
  if (auto it = impl_->vocab.find(key); it != impl_->vocab.end()) return it->second;
  return std::nullopt;
}

// ---- StreamDecoder ------------------------------------------------------------------

std::string StreamDecoder::push(TokenId id) {
  pending_.append(tokenizer_->token_bytes(id));
  std::string out;
  const size_t used = append_lossy(pending_, /*keep_incomplete_tail=*/true, out);
  pending_.erase(0, used);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out;
  append_lossy(pending_, false, out);
  pending_.clear();
  return out;
}

}  // namespace dsv4::text
