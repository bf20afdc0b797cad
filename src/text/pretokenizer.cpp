#include "text/pretokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

namespace dsv4::text {

bool is_deepseek_v3_pre_name(std::string_view name) {
  return name == "deepseek-v3" || name == "joyai-llm";
}

namespace {

struct CodeDeleter {
  void operator()(pcre2_code* c) const { pcre2_code_free(c); }
};
struct MatchDataDeleter {
  void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
};
using Code = std::unique_ptr<pcre2_code, CodeDeleter>;
using MatchData = std::unique_ptr<pcre2_match_data, MatchDataDeleter>;

}  // namespace

struct PreTokenizer::Impl {
  std::vector<Code> regexes;
};

PreTokenizer::PreTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PreTokenizer::PreTokenizer(PreTokenizer&&) noexcept = default;
PreTokenizer& PreTokenizer::operator=(PreTokenizer&&) noexcept = default;
PreTokenizer::~PreTokenizer() = default;

Result<PreTokenizer> PreTokenizer::deepseek_v3() {
  auto impl = std::make_unique<Impl>();
  for (std::string_view pattern : kDeepSeekV3SplitRegexes) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    // UCP: \s, \S and friends follow Unicode properties, as in the Oniguruma regexes
    // Hugging Face tokenizers runs.
    Code code(pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                            PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr));
    if (!code) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(error, msg, sizeof msg);
      return Status::errorf("pre-tokenizer regex '{}': {} at offset {}", pattern,
                            reinterpret_cast<const char*>(msg), offset);
    }
    // JIT is an optimisation only; the interpreter gives the same matches.
    (void)pcre2_jit_compile(code.get(), PCRE2_JIT_COMPLETE);
    impl->regexes.push_back(std::move(code));
  }
  return PreTokenizer(std::move(impl));
}

void PreTokenizer::split(std::string_view text, std::vector<std::string_view>& pieces) const {
  // Each regex splits every piece the previous one produced ("Isolated": the matches and
  // the gaps between them both become pieces; nothing is dropped).
  std::vector<std::string_view> current{text};
  std::vector<std::string_view> next;
  MatchData match(pcre2_match_data_create(1, nullptr));
  for (size_t r = 0; r < impl_->regexes.size(); ++r) {
    const pcre2_code* code = impl_->regexes[r].get();
    next.clear();
    for (std::string_view piece : current) {
      const auto* subject = reinterpret_cast<PCRE2_SPTR>(piece.data());
      size_t start = 0, emitted = 0;
      while (start < piece.size()) {
        // The text was checked to be UTF-8 by the caller.
        const int rc = pcre2_match(code, subject, piece.size(), start, PCRE2_NO_UTF_CHECK,
                                   match.get(), nullptr);
        if (rc < 0) break;
        const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(match.get());
        const size_t b = ov[0], e = ov[1];
        if (e == b) {  // the patterns cannot match empty; guard against looping anyway
          start = b + 1;
          while (start < piece.size() && (static_cast<unsigned char>(piece[start]) & 0xC0) == 0x80) ++start;
          continue;
        }
        if (b > emitted) next.push_back(piece.substr(emitted, b - emitted));
        next.push_back(piece.substr(b, e - b));
        emitted = start = e;
      }
      if (emitted < piece.size()) next.push_back(piece.substr(emitted));
    }
    std::swap(current, next);
  }
  pieces.insert(pieces.end(), current.begin(), current.end());
}

}  // namespace dsv4::text
