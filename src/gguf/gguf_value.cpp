#include "gguf/gguf_value.h"

#include <fmt/format.h>

namespace dsv4::gguf {

std::string_view value_type_name(ValueType t) {
  switch (t) {
    case ValueType::UINT8: return "u8";
    case ValueType::INT8: return "i8";
    case ValueType::UINT16: return "u16";
    case ValueType::INT16: return "i16";
    case ValueType::UINT32: return "u32";
    case ValueType::INT32: return "i32";
    case ValueType::FLOAT32: return "f32";
    case ValueType::BOOL: return "bool";
    case ValueType::STRING: return "string";
    case ValueType::ARRAY: return "array";
    case ValueType::UINT64: return "u64";
    case ValueType::INT64: return "i64";
    case ValueType::FLOAT64: return "f64";
  }
  return "unknown";
}

Value Value::array_u32(const std::vector<uint32_t>& xs) {
  Array items;
  items.reserve(xs.size());
  for (uint32_t x : xs) items.push_back(u32(x));
  return array(ValueType::UINT32, std::move(items));
}

Value Value::array_i32(const std::vector<int32_t>& xs) {
  Array items;
  items.reserve(xs.size());
  for (int32_t x : xs) items.push_back(i32(x));
  return array(ValueType::INT32, std::move(items));
}

Value Value::array_f32(const std::vector<float>& xs) {
  Array items;
  items.reserve(xs.size());
  for (float x : xs) items.push_back(f32(x));
  return array(ValueType::FLOAT32, std::move(items));
}

Value Value::array_string(const std::vector<std::string>& xs) {
  Array items;
  items.reserve(xs.size());
  for (const auto& x : xs) items.push_back(string(x));
  return array(ValueType::STRING, std::move(items));
}

bool Value::is_integer() const {
  switch (type_) {
    case ValueType::UINT8:
    case ValueType::INT8:
    case ValueType::UINT16:
    case ValueType::INT16:
    case ValueType::UINT32:
    case ValueType::INT32:
    case ValueType::UINT64:
    case ValueType::INT64: return true;
    default: return false;
  }
}

namespace {

// Strings longer than this are cut in displays (chat templates run to many kilobytes).
constexpr size_t kMaxDisplayStringBytes = 160;

std::string quoted(const std::string& s) {
  std::string out = "\"";
  const size_t n = std::min(s.size(), kMaxDisplayStringBytes);
  for (size_t i = 0; i < n; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20 || c == 0x7f) out += fmt::format("\\x{:02x}", c);
        else out += static_cast<char>(c);
    }
  }
  out += '"';
  if (n < s.size()) out += fmt::format("... ({} bytes)", s.size());
  return out;
}

}  // namespace

std::string Value::to_display_string(size_t max_array_items) const {
  switch (type_) {
    case ValueType::UINT8:
    case ValueType::UINT16:
    case ValueType::UINT32:
    case ValueType::UINT64: return fmt::format("{}", as_u64());
    case ValueType::INT8:
    case ValueType::INT16:
    case ValueType::INT32:
    case ValueType::INT64: return fmt::format("{}", as_i64());
    case ValueType::FLOAT32: return fmt::format("{}", static_cast<float>(as_f64()));
    case ValueType::FLOAT64: return fmt::format("{}", as_f64());
    case ValueType::BOOL: return as_bool() ? "true" : "false";
    case ValueType::STRING: return quoted(as_string());
    case ValueType::ARRAY: {
      const Array& items = as_array();
      std::string out = "[";
      const size_t shown = std::min(items.size(), max_array_items);
      for (size_t i = 0; i < shown; ++i) {
        if (i) out += ", ";
        out += items[i].to_display_string(max_array_items);
      }
      if (shown < items.size()) out += fmt::format("{}... ({} items)", shown ? ", " : "", items.size());
      out += "]";
      return out;
    }
  }
  return "?";
}

}  // namespace dsv4::gguf
