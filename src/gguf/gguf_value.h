// GGUF metadata values: every type GGUF v3 defines, arrays included.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace dsv4::gguf {

enum class ValueType : uint32_t {
  UINT8 = 0,
  INT8 = 1,
  UINT16 = 2,
  INT16 = 3,
  UINT32 = 4,
  INT32 = 5,
  FLOAT32 = 6,
  BOOL = 7,
  STRING = 8,
  ARRAY = 9,
  UINT64 = 10,
  INT64 = 11,
  FLOAT64 = 12,
};

std::string_view value_type_name(ValueType t);  // "u32", "f32", "string", "array", ...

// One metadata value. Scalars keep their declared GGUF type so a file round-trips byte
// for byte; arrays are homogeneous (elem_type) and may nest.
class Value {
 public:
  using Array = std::vector<Value>;
  Value() : type_(ValueType::UINT8), v_(uint64_t{0}) {}

  static Value u8(uint8_t x) { return Value(ValueType::UINT8, uint64_t{x}); }
  static Value i8(int8_t x) { return Value(ValueType::INT8, int64_t{x}); }
  static Value u16(uint16_t x) { return Value(ValueType::UINT16, uint64_t{x}); }
  static Value i16(int16_t x) { return Value(ValueType::INT16, int64_t{x}); }
  static Value u32(uint32_t x) { return Value(ValueType::UINT32, uint64_t{x}); }
  static Value i32(int32_t x) { return Value(ValueType::INT32, int64_t{x}); }
  static Value u64(uint64_t x) { return Value(ValueType::UINT64, x); }
  static Value i64(int64_t x) { return Value(ValueType::INT64, x); }
  static Value f32(float x) { return Value(ValueType::FLOAT32, double{x}); }
  static Value f64(double x) { return Value(ValueType::FLOAT64, x); }
  static Value boolean(bool x) { return Value(ValueType::BOOL, x); }
  static Value string(std::string x) { return Value(ValueType::STRING, std::move(x)); }
  static Value array(ValueType elem_type, Array items) {
    Value v(ValueType::ARRAY, std::move(items));
    v.elem_type_ = elem_type;
    return v;
  }
  // Convenience builders for homogeneous arrays.
  static Value array_u32(const std::vector<uint32_t>& xs);
  static Value array_i32(const std::vector<int32_t>& xs);
  static Value array_f32(const std::vector<float>& xs);
  static Value array_string(const std::vector<std::string>& xs);

  ValueType type() const { return type_; }
  ValueType elem_type() const { return elem_type_; }  // meaningful for ARRAY only

  bool is_integer() const;  // any of the 8 integer types
  bool is_float() const { return type_ == ValueType::FLOAT32 || type_ == ValueType::FLOAT64; }
  bool is_string() const { return type_ == ValueType::STRING; }
  bool is_array() const { return type_ == ValueType::ARRAY; }
  bool is_bool() const { return type_ == ValueType::BOOL; }

  // Raw accessors; call only after checking the kind above.
  uint64_t as_u64() const { return std::get<uint64_t>(v_); }  // unsigned integer types
  int64_t as_i64() const { return std::get<int64_t>(v_); }    // signed integer types
  double as_f64() const { return std::get<double>(v_); }      // FLOAT32 / FLOAT64
  bool as_bool() const { return std::get<bool>(v_); }
  const std::string& as_string() const { return std::get<std::string>(v_); }
  const Array& as_array() const { return std::get<Array>(v_); }

  std::string to_display_string(size_t max_array_items = 8) const;  // for `dsv4 info`

 private:
  using Storage = std::variant<uint64_t, int64_t, double, bool, std::string, Array>;
  Value(ValueType t, Storage v) : type_(t), v_(std::move(v)) {}
  ValueType type_;
  ValueType elem_type_ = ValueType::UINT8;
  Storage v_;
};

}  // namespace dsv4::gguf
