// Element i of a weight row, decoded exactly as gguf/quant_decode.h's decode_block defines
// it: the same f32 operations in the same order, each rounded on its own (__fmul_rn,
// __fsub_rn, __fadd_rn, so nvcc cannot contract a product and a difference into an FMA
// that decode_block's mul_unfused forbids). The Exact matmul, get_rows and the Exact
// experts read weights through this; tests/cuda/test_cuda_backend.cpp checks it bit for bit
// against dequantize_row for every type.
//
// Rows must be 2-byte aligned (the fp16 fields are read as uint16_t); F32 rows 4-byte. The
// i-quants read their codebooks through Tables (device memory; tables_ready says which).
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
  quant::IqTables iq{};            // the other i-quants' codebooks (cuda::detail::iq_tables)
};

// The weight types element<T> covers: every type the CPU decodes (gguf/quant.h) and I32 tables.
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
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::Q5_0:
    case GgmlType::Q5_1:
    case GgmlType::IQ4_NL:
    case GgmlType::IQ4_XS:
    case GgmlType::IQ2_XS:
    case GgmlType::IQ2_S:
    case GgmlType::IQ3_XXS:
    case GgmlType::IQ3_S:
    case GgmlType::IQ1_S:
    case GgmlType::IQ1_M:
      return true;
    default:
      return false;
  }
}

// Whether `t` holds the device tables that type `type` reads (every i-quant needs some).
inline bool tables_ready(GgmlType type, const Tables& t) {
  switch (type) {
    case GgmlType::IQ2_XXS: return t.grid != nullptr && t.signs != nullptr;
    case GgmlType::IQ4_NL:
    case GgmlType::IQ4_XS: return t.iq.iq4nl_values != nullptr;
    case GgmlType::IQ2_XS: return t.iq.iq2xs_grid != nullptr && t.iq.ksigns != nullptr;
    case GgmlType::IQ2_S: return t.iq.iq2s_grid != nullptr;
    case GgmlType::IQ3_XXS: return t.iq.iq3xxs_grid != nullptr && t.iq.ksigns != nullptr;
    case GgmlType::IQ3_S: return t.iq.iq3s_grid != nullptr;
    case GgmlType::IQ1_S:
    case GgmlType::IQ1_M: return t.iq.iq1s_grid != nullptr;
    default: return true;
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

// ---- the types read through integer levels (quant_decode.h's levels(), emit_levels) -------------
// 32-element blocks: x = mul_unfused(scale, q) - offset; 256-element i-quants: x = scale * q
// with the scale of the element's 16 (computed in decode's order, every step rounded).

__device__ __forceinline__ float level32(float scale, int q, float offset) {
  return __fsub_rn(__fmul_rn(scale, static_cast<float>(q)), offset);
}
__device__ __forceinline__ float level256(float scale, int q) { return __fmul_rn(scale, static_cast<float>(q)); }
// Byte e of a grid entry with bit e of `signs` as its sign.
__device__ __forceinline__ int signed_byte(uint64_t grid, uint32_t signs, int e) {
  const int mag = static_cast<int>((grid >> (8 * e)) & 0xFF);
  return ((signs >> e) & 1) ? -mag : mag;
}
// IQ1 level 8 * g + shift of the signed grid byte e.
__device__ __forceinline__ int iq1_level(uint64_t grid, int shift, int e) {
  return 8 * static_cast<int8_t>((grid >> (8 * e)) & 0xFF) + shift;
}

template <>
__device__ __forceinline__ float element<GgmlType::Q4_0>(const uint8_t* row, int64_t i, const Tables&) {
  const block_q4_0& b = reinterpret_cast<const block_q4_0*>(row)[i / QK4_0];
  return level32(fp16_to_f32(b.d), quant::nibble32(b.qs, static_cast<int>(i % QK4_0)) - 8, 0.0f);
}

template <>
__device__ __forceinline__ float element<GgmlType::Q4_1>(const uint8_t* row, int64_t i, const Tables&) {
  const block_q4_1& b = reinterpret_cast<const block_q4_1*>(row)[i / QK4_0];
  return level32(fp16_to_f32(b.d), quant::nibble32(b.qs, static_cast<int>(i % QK4_0)), -fp16_to_f32(b.m));
}

template <>
__device__ __forceinline__ float element<GgmlType::Q5_0>(const uint8_t* row, int64_t i, const Tables&) {
  const block_q5_0& b = reinterpret_cast<const block_q5_0*>(row)[i / QK4_0];
  const int j = static_cast<int>(i % QK4_0);
  const int q = quant::nibble32(b.qs, j) | (((quant::le32(b.qh) >> j) & 1) << 4);
  return level32(fp16_to_f32(b.d), q - 16, 0.0f);
}

template <>
__device__ __forceinline__ float element<GgmlType::Q5_1>(const uint8_t* row, int64_t i, const Tables&) {
  const block_q5_1& b = reinterpret_cast<const block_q5_1*>(row)[i / QK4_0];
  const int j = static_cast<int>(i % QK4_0);
  const int q = quant::nibble32(b.qs, j) | (((quant::le32(b.qh) >> j) & 1) << 4);
  return level32(fp16_to_f32(b.d), q, -fp16_to_f32(b.m));
}

template <>
__device__ __forceinline__ float element<GgmlType::IQ4_NL>(const uint8_t* row, int64_t i, const Tables& t) {
  const block_iq4_nl& b = reinterpret_cast<const block_iq4_nl*>(row)[i / QK4_0];
  return level32(fp16_to_f32(b.d), t.iq.iq4nl_values[quant::nibble32(b.qs, static_cast<int>(i % QK4_0))], 0.0f);
}

// Sub-block j of 32: scale d * (ls - 32), IQ4_NL levels with the low nibbles first.
template <>
__device__ __forceinline__ float element<GgmlType::IQ4_XS>(const uint8_t* row, int64_t i, const Tables& t) {
  const block_iq4_xs& b = reinterpret_cast<const block_iq4_xs*>(row)[i / QK_K];
  const int e = static_cast<int>(i % QK_K);
  const int j = e / 32, l = e % 32;
  const int ls = ((b.scales_l[j / 2] >> (4 * (j % 2))) & 0xF) | (((b.scales_h >> (2 * j)) & 3) << 4);
  const float scale = __fmul_rn(fp16_to_f32(b.d), static_cast<float>(ls - 32));
  const int code = l < 16 ? b.qs[16 * j + l] & 0xF : b.qs[16 * j + l - 16] >> 4;
  return level256(scale, t.iq.iq4nl_values[code]);
}

// The IQ2 scale d * (0.5 + s) * 0.25 of the 4-bit scale of 16-element sub-block e / 16.
__device__ __forceinline__ float iq2_nibble_scale(float d, const uint8_t* scales, int e) {
  const int s = e / 16;
  const int v = (scales[s / 2] >> (4 * (s % 2))) & 0xF;
  return __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, static_cast<float>(v))), 0.25f);
}

template <>
__device__ __forceinline__ float element<GgmlType::IQ2_XS>(const uint8_t* row, int64_t i, const Tables& t) {
  const block_iq2_xs& b = reinterpret_cast<const block_iq2_xs*>(row)[i / QK_K];
  const int e = static_cast<int>(i % QK_K);
  const uint32_t q = b.qs[e / 8];
  const int v = signed_byte(t.iq.iq2xs_grid[q & 511], t.iq.ksigns[q >> 9], e % 8);
  return level256(iq2_nibble_scale(fp16_to_f32(b.d), b.scales, e), v);
}

template <>
__device__ __forceinline__ float element<GgmlType::IQ2_S>(const uint8_t* row, int64_t i, const Tables& t) {
  const block_iq2_s& b = reinterpret_cast<const block_iq2_s*>(row)[i / QK_K];
  const int e = static_cast<int>(i % QK_K);
  const int g = e / 8;
  const int index = b.qs[g] | (((b.qh[g / 4] >> (2 * (g % 4))) & 3) << 8);
  const int v = signed_byte(t.iq.iq2s_grid[index], b.qs[QK_K / 8 + g], e % 8);
  return level256(iq2_nibble_scale(fp16_to_f32(b.d), b.scales, e), v);
}

template <>
__device__ __forceinline__ float element<GgmlType::IQ3_XXS>(const uint8_t* row, int64_t i, const Tables& t) {
  const block_iq3_xxs& b = reinterpret_cast<const block_iq3_xxs*>(row)[i / QK_K];
  const int e = static_cast<int>(i % QK_K);
  const int ib = e / 32, l = (e % 32) / 8, el = e % 8;
  const uint32_t aux = quant::le32(b.qs + QK_K / 4 + 4 * ib);
  const float scale =
      __fmul_rn(__fmul_rn(fp16_to_f32(b.d), __fadd_rn(0.5f, static_cast<float>(aux >> 28))), 0.5f);
  const uint64_t grid = t.iq.iq3xxs_grid[b.qs[8 * ib + 2 * l + el / 4]];
  return level256(scale, signed_byte(grid << (32 * (el / 4)), t.iq.ksigns[(aux >> (7 * l)) & 127], el));
}

template <>
__device__ __forceinline__ float element<GgmlType::IQ3_S>(const uint8_t* row, int64_t i, const Tables& t) {
  const block_iq3_s& b = reinterpret_cast<const block_iq3_s*>(row)[i / QK_K];
  const int e = static_cast<int>(i % QK_K);
  const int ib = e / 32, g = e / 8, el = e % 8;
  const float scale =
      __fmul_rn(fp16_to_f32(b.d), static_cast<float>(1 + 2 * ((b.scales[ib / 2] >> (4 * (ib % 2))) & 0xF)));
  const int entry = 2 * g + el / 4;
  const int index = b.qs[entry] | (((b.qh[entry / 8] >> (entry % 8)) & 1) << 8);
  const uint64_t grid = t.iq.iq3s_grid[index];
  return level256(scale, signed_byte(grid << (32 * (el / 4)), b.signs[g], el));
}

template <>
__device__ __forceinline__ float element<GgmlType::IQ1_S>(const uint8_t* row, int64_t i, const Tables& t) {
  const block_iq1_s& b = reinterpret_cast<const block_iq1_s*>(row)[i / QK_K];
  const int e = static_cast<int>(i % QK_K);
  const int ib = e / 32, l = (e % 32) / 8;
  const uint32_t w = b.qh[ib];
  const float dl = __fmul_rn(fp16_to_f32(b.d), static_cast<float>(2 * ((w >> 12) & 7) + 1));
  const uint64_t grid = t.iq.iq1s_grid[b.qs[4 * ib + l] | (((w >> (3 * l)) & 7) << 8)];
  return level256(__fmul_rn(dl, 0.125f), iq1_level(grid, (w & 0x8000) ? -1 : 1, e % 8));
}

template <>
__device__ __forceinline__ float element<GgmlType::IQ1_M>(const uint8_t* row, int64_t i, const Tables& t) {
  const block_iq1_m& b = reinterpret_cast<const block_iq1_m*>(row)[i / QK_K];
  const int e = static_cast<int>(i % QK_K);
  const int s = e / 16, k = e / 8;
  const uint32_t word = b.scales[2 * (s / 4)] | (static_cast<uint32_t>(b.scales[2 * (s / 4) + 1]) << 8);
  const float dl = __fmul_rn(fp16_to_f32(quant::iq1_m_scale_bits(b)), static_cast<float>(2 * ((word >> (3 * (s % 4))) & 7) + 1));
  const int nib = (b.qh[k / 2] >> (4 * (k % 2))) & 0xF;
  const uint64_t grid = t.iq.iq1s_grid[b.qs[k] | ((nib & 7) << 8)];
  return level256(__fmul_rn(dl, 0.125f), iq1_level(grid, (nib & 8) ? -1 : 1, e % 8));
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
    case GgmlType::Q4_0: return f(integral_constant<GgmlType, GgmlType::Q4_0>{});
    case GgmlType::Q4_1: return f(integral_constant<GgmlType, GgmlType::Q4_1>{});
    case GgmlType::Q5_0: return f(integral_constant<GgmlType, GgmlType::Q5_0>{});
    case GgmlType::Q5_1: return f(integral_constant<GgmlType, GgmlType::Q5_1>{});
    case GgmlType::IQ4_NL: return f(integral_constant<GgmlType, GgmlType::IQ4_NL>{});
    case GgmlType::IQ4_XS: return f(integral_constant<GgmlType, GgmlType::IQ4_XS>{});
    case GgmlType::IQ2_XS: return f(integral_constant<GgmlType, GgmlType::IQ2_XS>{});
    case GgmlType::IQ2_S: return f(integral_constant<GgmlType, GgmlType::IQ2_S>{});
    case GgmlType::IQ3_XXS: return f(integral_constant<GgmlType, GgmlType::IQ3_XXS>{});
    case GgmlType::IQ3_S: return f(integral_constant<GgmlType, GgmlType::IQ3_S>{});
    case GgmlType::IQ1_S: return f(integral_constant<GgmlType, GgmlType::IQ1_S>{});
    case GgmlType::IQ1_M: return f(integral_constant<GgmlType, GgmlType::IQ1_M>{});
    default: return f(integral_constant<GgmlType, GgmlType::IQ2_XXS>{});
  }
}

}  // namespace dsv4::cuda::exact
