// Element i of a weight row, decoded exactly as gguf/quant_decode.h's decode_block defines
// it: the same f32 operations in the same order, each rounded on its own (__fmul_rn,
// __fsub_rn, __fadd_rn, so nvcc cannot contract a product and a difference into an FMA
// that decode_block's mul_unfused forbids). The Exact matmul, get_rows and the Exact
// experts read weights through this; tests/cuda/test_cuda_backend.cpp checks it bit for bit
// against dequantize_row for every type.
//
// Rows must be 2-byte aligned (the fp16 fields are read as uint16_t); F32 rows 4-byte.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "gguf/ggml_types.h"
#include "gguf/quant_blocks.h"
#include "gguf/quant_decode.h"
#include "util/float_formats.h"

namespace dsv4::cuda::exact {

struct Tables {
  const uint64_t* grid = nullptr;  // IQ2_XXS: ggml's iq2xxs_grid (256 entries)
  const uint8_t* signs = nullptr;  // and ksigns_iq2xs (128 entries)
};

// The weight types element<T> covers (every matrix type of the catalog, plus I32 tables).
inline bool supported(GgmlType t) {
  switch (t) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16:
    case GgmlType::I32:
    case GgmlType::Q8_0:
    case GgmlType::MXFP4:
    case GgmlType::Q2_K:
    case GgmlType::Q3_K:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
    case GgmlType::Q6_K:
    case GgmlType::IQ2_XXS:
      return true;
    default:
      return false;
  }
}

template <GgmlType T>
__device__ __forceinline__ float element(const uint8_t* row, int64_t i, const Tables& t);

template <>
__device__ __forceinline__ float element<GgmlType::F32>(const uint8_t* row, int64_t i, const Tables&) {
  return reinterpret_cast<const float*>(row)[i];
}

template <>
__device__ __forceinline__ float element<GgmlType::I32>(const uint8_t* row, int64_t i, const Tables&) {
  return static_cast<float>(reinterpret_cast<const int32_t*>(row)[i]);
}

template <>
__device__ __forceinline__ float element<GgmlType::F16>(const uint8_t* row, int64_t i, const Tables&) {
  return fp16_to_f32(reinterpret_cast<const uint16_t*>(row)[i]);
}

template <>
__device__ __forceinline__ float element<GgmlType::BF16>(const uint8_t* row, int64_t i, const Tables&) {
  return bf16_to_f32(reinterpret_cast<const uint16_t*>(row)[i]);
}

// out[i] = qs[i] * d.
template <>
__device__ __forceinline__ float element<GgmlType::Q8_0>(const uint8_t* row, int64_t i, const Tables&) {
  const block_q8_0& b = reinterpret_cast<const block_q8_0*>(row)[i / QK8_0];
  return __fmul_rn(static_cast<float>(b.qs[i % QK8_0]), fp16_to_f32(b.d));
}

// out[j] = value(qs[j] & 15) * d, out[j + 16] = value(qs[j] >> 4) * d.
template <>
__device__ __forceinline__ float element<GgmlType::MXFP4>(const uint8_t* row, int64_t i, const Tables&) {
  const block_mxfp4& b = reinterpret_cast<const block_mxfp4*>(row)[i / QK_MXFP4];
  const int j = static_cast<int>(i % QK_MXFP4);
  const uint32_t byte = b.qs[j % (QK_MXFP4 / 2)];
  const uint32_t code = j < QK_MXFP4 / 2 ? (byte & 0xFu) : (byte >> 4);
  return __fmul_rn(static_cast<float>(quant::mxfp4_doubled_value(code)), e8m0_to_f32_half(b.e));
}

// out[i] = mul_unfused(d * (sc & 15), q) - dmin * (sc >> 4).
template <>
__device__ __forceinline__ float element<GgmlType::Q2_K>(const uint8_t* row, int64_t i, const Tables&) {
  const block_q2_K& b = reinterpret_cast<const block_q2_K*>(row)[i / QK_K];
  const int e = static_cast<int>(i % QK_K);
  const int n = e / 128, s = (e % 128) / 32, l = e % 32;
  const uint32_t sc = b.scales[e / 16];
  const float dl = __fmul_rn(fp16_to_f32(b.d), static_cast<float>(sc & 0xFu));
  const float ml = __fmul_rn(fp16_to_f32(b.dmin), static_cast<float>(sc >> 4));
  const int q = (b.qs[n * 32 + l] >> (2 * s)) & 3;
  return __fsub_rn(__fmul_rn(dl, static_cast<float>(q)), ml);
}

// out[i] = (d * scale) * (low - (hmask bit clear ? 4 : 0)).
template <>
__device__ __forceinline__ float element<GgmlType::Q3_K>(const uint8_t* row, int64_t i, const Tables&) {
  const block_q3_K& b = reinterpret_cast<const block_q3_K*>(row)[i / QK_K];
  const int e = static_cast<int>(i % QK_K);
  const int n = e / 128, s = (e % 128) / 32, l = e % 32;
  const float dl = __fmul_rn(fp16_to_f32(b.d), static_cast<float>(quant::q3_k_scale(b.scales, e / 16)));
  const int low = (b.qs[n * 32 + l] >> (2 * s)) & 3;
  const int high_clear = ((b.hmask[l] >> (e / 32)) & 1) ? 0 : 4;
  return __fmul_rn(dl, static_cast<float>(low - high_clear));
}

// out = mul_unfused(d * sc, q) - dmin * m, q the nibble (j % 2) of qs[(j / 2) * 32 + l].
template <>
__device__ __forceinline__ float element<GgmlType::Q4_K>(const uint8_t* row, int64_t i, const Tables&) {
  const block_q4_K& b = reinterpret_cast<const block_q4_K*>(row)[i / QK_K];
  const int e = static_cast<int>(i % QK_K);
  const int j = e / 32, l = e % 32;
  uint8_t sc, m;
  quant::k4_scale_min(b.scales, j, sc, m);
  const float dl = __fmul_rn(fp16_to_f32(b.d), static_cast<float>(sc));
  const float ml = __fmul_rn(fp16_to_f32(b.dmin), static_cast<float>(m));
  const int q = (b.qs[(j / 2) * 32 + l] >> (4 * (j % 2))) & 0xF;
  return __fsub_rn(__fmul_rn(dl, static_cast<float>(q)), ml);
}

// As Q4_K with bit j of qh[l] as the fifth bit.
template <>
__device__ __forceinline__ float element<GgmlType::Q5_K>(const uint8_t* row, int64_t i, const Tables&) {
  const block_q5_K& b = reinterpret_cast<const block_q5_K*>(row)[i / QK_K];
  const int e = static_cast<int>(i % QK_K);
  const int j = e / 32, l = e % 32;
  uint8_t sc, m;
  quant::k4_scale_min(b.scales, j, sc, m);
  const float dl = __fmul_rn(fp16_to_f32(b.d), static_cast<float>(sc));
  const float ml = __fmul_rn(fp16_to_f32(b.dmin), static_cast<float>(m));
  const int q = ((b.qs[(j / 2) * 32 + l] >> (4 * (j % 2))) & 0xF) | (((b.qh[l] >> j) & 1) << 4);
  return __fsub_rn(__fmul_rn(dl, static_cast<float>(q)), ml);
}

// out[i] = (d * scales[i / 16]) * ((low | high << 4) - 32).
template <>
__device__ __forceinline__ float element<GgmlType::Q6_K>(const uint8_t* row, int64_t i, const Tables&) {
  const block_q6_K& b = reinterpret_cast<const block_q6_K*>(row)[i / QK_K];
  const int e = static_cast<int>(i % QK_K);
  const int n = e / 128, r = e % 128;
  const int low = (b.ql[n * 64 + r % 64] >> (4 * (r / 64))) & 0xF;
  const int high = (b.qh[n * 32 + r % 32] >> (2 * (r / 32))) & 3;
  const float dl = __fmul_rn(fp16_to_f32(b.d), static_cast<float>(b.scales[e / 16]));
  return __fmul_rn(dl, static_cast<float>((low | (high << 4)) - 32));
}

// db = d * (0.5 + scale) * 0.25; out = ±db * grid byte.
template <>
__device__ __forceinline__ float element<GgmlType::IQ2_XXS>(const uint8_t* row, int64_t i, const Tables& t) {
  const block_iq2_xxs& b = reinterpret_cast<const block_iq2_xxs*>(row)[i / QK_K];
  const int e = static_cast<int>(i % QK_K);
  const int g = e / 32, k = (e % 32) / 8, el = e % 8;
  const uint32_t indices = b.qs[4 * g] | (static_cast<uint32_t>(b.qs[4 * g + 1]) << 16);
  const uint32_t signs_scale = b.qs[4 * g + 2] | (static_cast<uint32_t>(b.qs[4 * g + 3]) << 16);
  const float db =
      __fmul_rn(__fmul_rn(fp16_to_f32(b.d), __fadd_rn(0.5f, static_cast<float>(signs_scale >> 28))), 0.25f);
  const uint64_t magnitudes = t.grid[(indices >> (8 * k)) & 0xFF];
  const uint32_t signs = t.signs[(signs_scale >> (7 * k)) & 127];
  const float v = __fmul_rn(db, static_cast<float>((magnitudes >> (8 * el)) & 0xFF));
  return ((signs >> el) & 1) ? -v : v;
}

// Calls f(std::integral_constant<GgmlType, T>{}) for the runtime type t (one of supported()).
template <class F>
auto dispatch(GgmlType t, F&& f) {
  using std::integral_constant;
  switch (t) {
    case GgmlType::F32: return f(integral_constant<GgmlType, GgmlType::F32>{});
    case GgmlType::F16: return f(integral_constant<GgmlType, GgmlType::F16>{});
    case GgmlType::BF16: return f(integral_constant<GgmlType, GgmlType::BF16>{});
    case GgmlType::I32: return f(integral_constant<GgmlType, GgmlType::I32>{});
    case GgmlType::Q8_0: return f(integral_constant<GgmlType, GgmlType::Q8_0>{});
    case GgmlType::MXFP4: return f(integral_constant<GgmlType, GgmlType::MXFP4>{});
    case GgmlType::Q2_K: return f(integral_constant<GgmlType, GgmlType::Q2_K>{});
    case GgmlType::Q3_K: return f(integral_constant<GgmlType, GgmlType::Q3_K>{});
    case GgmlType::Q4_K: return f(integral_constant<GgmlType, GgmlType::Q4_K>{});
    case GgmlType::Q5_K: return f(integral_constant<GgmlType, GgmlType::Q5_K>{});
    case GgmlType::Q6_K: return f(integral_constant<GgmlType, GgmlType::Q6_K>{});
    default: return f(integral_constant<GgmlType, GgmlType::IQ2_XXS>{});
  }
}

}  // namespace dsv4::cuda::exact
