// The tensor element types of GGUF files, with ggml's numeric ids and block geometry.
// This is the one definition of every type: the GGUF reader and writer, the converter,
// the CPU backend and the CUDA kernels all use it. Byte layouts of the quantised blocks
// are in quant_blocks.h; the arithmetic on them is in quant.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace dsv4 {

// ggml's enum ggml_type values, as stored in a GGUF tensor-info record.
enum class GgmlType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 = 9,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,
  IQ2_XXS = 16,
  IQ2_XS = 17,
  IQ3_XXS = 18,
  IQ1_S = 19,
  IQ4_NL = 20,
  IQ3_S = 21,
  IQ2_S = 22,
  IQ4_XS = 23,
  I8 = 24,
  I16 = 25,
  I32 = 26,
  I64 = 27,
  F64 = 28,
  IQ1_M = 29,
  BF16 = 30,
  TQ1_0 = 34,
  TQ2_0 = 35,
  MXFP4 = 39,
};

struct GgmlTypeTraits {
  GgmlType type;
  std::string_view name;   // as ggml prints it: "q8_0", "q2_K", "bf16", ...
  uint32_t block_elems;    // elements per block (1 for plain types)
  uint32_t block_bytes;    // bytes per block
  bool supported;          // dsv4 can dequantise it (the types a deepseek4 file may hold)
};

// Traits of a type id read from a file; nullopt for ids ggml does not define.
std::optional<GgmlTypeTraits> ggml_type_traits(uint32_t type_id);
const GgmlTypeTraits& ggml_traits(GgmlType type);  // for a known enum value
std::string_view ggml_type_name(GgmlType type);
std::optional<GgmlType> ggml_type_from_name(std::string_view name);  // "q2_k" or "Q2_K"

// Bytes of a row of `n` elements, or nullopt when n is not a multiple of the block size.
std::optional<uint64_t> ggml_row_bytes(GgmlType type, uint64_t n);

}  // namespace dsv4
