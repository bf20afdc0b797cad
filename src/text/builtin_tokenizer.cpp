#include "text/builtin_tokenizer.h"

// The path comes from cmake/BuiltinTokenizer.cmake; .incbin copies the file's bytes into
// read-only data at assembly time (a generated C array of 6 MB would compile slowly).
#ifndef DSV4_BUILTIN_TOKENIZER_JSON
#error "DSV4_BUILTIN_TOKENIZER_JSON is set by cmake/BuiltinTokenizer.cmake"
#endif

__asm__(
    "  .pushsection .rodata.dsv4_builtin_tokenizer_json, \"a\"\n"
    "  .balign 16\n"
    "  .globl dsv4_builtin_tokenizer_json_begin\n"
    "  .hidden dsv4_builtin_tokenizer_json_begin\n"
    "dsv4_builtin_tokenizer_json_begin:\n"
    "  .incbin \"" DSV4_BUILTIN_TOKENIZER_JSON "\"\n"
    "  .globl dsv4_builtin_tokenizer_json_end\n"
    "  .hidden dsv4_builtin_tokenizer_json_end\n"
    "dsv4_builtin_tokenizer_json_end:\n"
    "  .byte 0\n"
    "  .popsection\n");

extern "C" {
extern const char dsv4_builtin_tokenizer_json_begin[];
extern const char dsv4_builtin_tokenizer_json_end[];
}

namespace dsv4::text {

std::string_view builtin_tokenizer_json() {
  return std::string_view(dsv4_builtin_tokenizer_json_begin,
                          static_cast<size_t>(dsv4_builtin_tokenizer_json_end -
                                              dsv4_builtin_tokenizer_json_begin));
}

}  // namespace dsv4::text
