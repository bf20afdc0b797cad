// libFuzzer: the built-in DeepSeek-V4 tokenizer on arbitrary bytes. Invalid UTF-8 must be
// an error; valid text must round-trip through encode/decode, and the stream decoder must
// give the same text one token at a time.
#include <cstddef>
#include <cstdint>
#include <string>

#include "text/tokenizer.h"

using namespace dsv4::text;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const auto tok = *Tokenizer::builtin();
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto ids = tok->encode(text);
  if (!ids.is_ok()) {
    if (find_invalid_utf8(text) == std::string_view::npos) __builtin_trap();
    return 0;
  }
  if (tok->decode(*ids) != text) __builtin_trap();
  StreamDecoder dec(*tok);
  std::string streamed;
  for (TokenId id : *ids) streamed += dec.push(id);
  streamed += dec.flush();
  if (streamed != text) __builtin_trap();
  return 0;
}
