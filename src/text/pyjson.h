// JSON text exactly as Python's json.dumps(value, ensure_ascii=False) writes it, which is
// what DeepSeek's chat encoder embeds in prompts (tool schemas, response formats, tool-call
// arguments): separators ", " and ": ", keys in their original order, non-ASCII written
// raw, floats in Python repr form (2.0, 1e-05, 1e+16, NaN, Infinity).
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <string_view>

namespace dsv4::text {

using OrderedJson = nlohmann::ordered_json;

std::string python_json_dumps(const OrderedJson& value);
std::string python_json_string(std::string_view s);  // one quoted, escaped JSON string
std::string python_float_repr(double x);             // repr(float): "1.5", "1e-05", "NaN"

}  // namespace dsv4::text
