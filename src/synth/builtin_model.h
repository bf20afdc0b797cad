// The built-in default model: the `tiny` preset with random weights, which the program
// writes itself on first use so `dsv4` runs with no download. It lives in
// $DSV4_CACHE_DIR, or ~/.cache/dsv4/ when that is unset, and is rewritten (atomically:
// a private temporary file renamed into place) whenever it is missing, unreadable, or
// from another generator version.
#pragma once

#include <filesystem>
#include <functional>
#include <string>
#include <string_view>

#include "util/status.h"

namespace dsv4 {

inline constexpr uint64_t kBuiltinModelSeed = 20260601;  // the fixture's weight seed

// Where the built-in model is (or will be) stored.
Result<std::filesystem::path> builtin_model_path();

// Returns the path of a valid built-in model, writing it first when needed. `log` gets a
// line when the file is (re)generated and why.
Result<std::filesystem::path> ensure_builtin_model(
    const std::function<void(std::string_view)>& log = {});

// Whether `path` is a complete built-in model of the current generator version; the
// error says what is wrong with it.
Status check_builtin_model(const std::filesystem::path& path);

}  // namespace dsv4
