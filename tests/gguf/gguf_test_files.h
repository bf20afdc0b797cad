// Helpers for the GGUF tests: small files with random tensors, metadata with every value
// type, and byte-level comparisons.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "gguf/gguf_file.h"
#include "gguf/gguf_writer.h"

namespace dsv4::gguf::testing {

struct TensorSpec {
  std::string name;
  GgmlType type;
  std::vector<uint64_t> ne;
  std::vector<uint8_t> bytes;  // random, of the size the type and shape need
};

inline std::vector<TensorSpec> random_tensors(std::mt19937_64& rng) {
  const std::vector<std::tuple<std::string, GgmlType, std::vector<uint64_t>>> shapes = {
      {"token_embd.weight", GgmlType::Q8_0, {64, 7}},
      {"output_norm.weight", GgmlType::F32, {13}},
      {"blk.0.ffn_gate_exps.weight", GgmlType::Q2_K, {256, 3, 2}},
      {"blk.0.ffn_gate_tid2eid.weight", GgmlType::I32, {6, 5}},
      {"blk.0.attn_kv.weight", GgmlType::BF16, {9, 4, 1, 2}},
      {"blk.0.exp_probs_b.bias", GgmlType::F16, {3}},
  };
  std::vector<TensorSpec> out;
  for (const auto& [name, type, ne] : shapes) {
    uint64_t rows = 1;
    for (size_t d = 1; d < ne.size(); ++d) rows *= ne[d];
    std::vector<uint8_t> bytes(*ggml_row_bytes(type, ne[0]) * rows);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
    out.push_back({name, type, ne, std::move(bytes)});
  }
  return out;
}

// Metadata using every GGUF value type, extremes, strings with odd bytes, and arrays of
// every element type including strings and nested arrays.
inline std::vector<std::pair<std::string, Value>> every_type_metadata() {
  using V = Value;
  std::vector<std::pair<std::string, Value>> md = {
      {"general.architecture", V::string("deepseek4")},
      {"test.u8", V::u8(255)},
      {"test.i8", V::i8(-128)},
      {"test.u16", V::u16(65535)},
      {"test.i16", V::i16(-32768)},
      {"test.u32", V::u32(4294967295u)},
      {"test.i32", V::i32(-2147483647 - 1)},
      {"test.u64", V::u64(18446744073709551615ull)},
      {"test.i64", V::i64(-9223372036854775807ll - 1)},
      {"test.f32", V::f32(-1.5e-7f)},
      {"test.f64", V::f64(3.141592653589793)},
      {"test.bool_true", V::boolean(true)},
      {"test.bool_false", V::boolean(false)},
      {"test.string", V::string("h\xc3\xa9llo \"w\"\n\tworld")},
      {"test.empty_string", V::string("")},
      {"test.nul_string", V::string(std::string("a\0b", 3))},
      {"test.array_u8", V::array(ValueType::UINT8, {V::u8(0), V::u8(255)})},
      {"test.array_i8", V::array(ValueType::INT8, {V::i8(-1), V::i8(127)})},
      {"test.array_u16", V::array(ValueType::UINT16, {V::u16(1), V::u16(65535)})},
      {"test.array_i16", V::array(ValueType::INT16, {V::i16(-300)})},
      {"test.array_u32", V::array_u32({0, 0, 4, 128, 4})},
      {"test.array_i32", V::array_i32({-1, 2, -3})},
      {"test.array_u64", V::array(ValueType::UINT64, {V::u64(1ull << 63)})},
      {"test.array_i64", V::array(ValueType::INT64, {V::i64(-(1ll << 62))})},
      {"test.array_f32", V::array_f32({10.0f, -0.25f, 1e-6f})},
      {"test.array_f64", V::array(ValueType::FLOAT64, {V::f64(1e300), V::f64(-2.5)})},
      {"test.array_bool", V::array(ValueType::BOOL, {V::boolean(true), V::boolean(false)})},
      {"test.array_string", V::array_string({"<｜begin▁of▁sentence｜>", "", "Ġthe", "a b"})},
      {"test.array_empty", V::array(ValueType::UINT32, {})},
      {"test.array_nested",
       V::array(ValueType::ARRAY, {V::array_u32({1, 2, 3}), V::array_u32({}), V::array_u32({7})})},
      {"test.array_nested_strings",
       V::array(ValueType::ARRAY, {V::array_string({"x", "yz"}), V::array(ValueType::ARRAY, {})})},
  };
  return md;
}

inline bool values_equal(const Value& a, const Value& b) {
  if (a.type() != b.type()) return false;
  switch (a.type()) {
    case ValueType::UINT8:
    case ValueType::UINT16:
    case ValueType::UINT32:
    case ValueType::UINT64: return a.as_u64() == b.as_u64();
    case ValueType::INT8:
    case ValueType::INT16:
    case ValueType::INT32:
    case ValueType::INT64: return a.as_i64() == b.as_i64();
    case ValueType::FLOAT32:
    case ValueType::FLOAT64: return a.as_f64() == b.as_f64();
    case ValueType::BOOL: return a.as_bool() == b.as_bool();
    case ValueType::STRING: return a.as_string() == b.as_string();
    case ValueType::ARRAY:
      if (a.elem_type() != b.elem_type() || a.as_array().size() != b.as_array().size()) return false;
      for (size_t i = 0; i < a.as_array().size(); ++i)
        if (!values_equal(a.as_array()[i], b.as_array()[i])) return false;
      return true;
  }
  return false;
}

// Writes `tensors` with `metadata`; data goes in in pieces of `piece` bytes so chunked
// streaming is exercised.
inline Status write_file(const std::string& path, const std::vector<std::pair<std::string, Value>>& metadata,
                         const std::vector<TensorSpec>& tensors, WriterOptions opts = {}, size_t piece = 7,
                         std::vector<std::string>* outputs = nullptr) {
  GgufWriter w(path, opts);
  for (const auto& [k, v] : metadata) w.set(k, v);
  for (const auto& t : tensors) DSV4_TRY(w.add_tensor(t.name, t.type, t.ne));
  DSV4_TRY(w.begin());
  for (const auto& t : tensors)
    for (size_t at = 0; at < t.bytes.size(); at += piece)
      DSV4_TRY(w.write_tensor_data({t.bytes.data() + at, std::min(piece, t.bytes.size() - at)}));
  DSV4_TRY(w.finish());
  if (outputs) *outputs = w.output_paths();
  return Status::ok();
}

inline std::vector<uint8_t> read_bytes(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

inline void write_bytes(const std::filesystem::path& p, const std::vector<uint8_t>& bytes) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace dsv4::gguf::testing
