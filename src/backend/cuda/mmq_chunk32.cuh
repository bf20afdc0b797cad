// The A fragments of the types with one scale (and minimum) per 32 weights, for the generic
// tensor-core stage product of mmq_kernel.cuh: Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL (one block per
// 32-wide chunk) and Q5_K, IQ4_XS, IQ3_XXS, IQ3_S, IQ1_S (one sub-block of 32 of the stage's
// super-block per chunk).
//
// MmqChunk32<T>::load(row, c, t, tables, lo, hi, scale, min): chunk c of one stage row (shared
// memory) as lane t of its row sees it: lo = the int8 values of elements 4t..4t+3, hi those of
// 16+4t..16+4t+3 (quant_units.cuh's byte tricks), and the weight w = scale * q + min of
// quant_decode.h (min 0 and unread where kMins is false). The i-quants read their grids from
// `tables` (device memory, cuda::detail::iq_tables). MmqChunk16 below: the types with a scale
// per 16 (IQ2_XS, IQ2_S, IQ1_M). Included by mmq_kernel.cuh after its
// shared-memory word loads (ld_a2, ld_a4, ld_u16, half_to_float).
#pragma once

#include <cstdint>

#include "backend/cuda/quant_units.cuh"

namespace dsv4::cuda::detail {

template <GgmlType T>
struct MmqChunk32;

template <>
struct MmqChunk32<GgmlType::Q4_0> {
  static constexpr bool kMins = false;
  __device__ __forceinline__ static void load(const uint8_t* row, int c, int t, const quant::IqTables&, uint32_t& lo,
                                              uint32_t& hi, float& scale, float& min) {
    const uint8_t* b = row + 18 * c;
    const uint32_t w = ld_a2(b + 2 + 4 * t);
    lo = __vsub4(w & 0x0F0F0F0Fu, 0x08080808u);
    hi = __vsub4((w >> 4) & 0x0F0F0F0Fu, 0x08080808u);
    scale = half_to_float(ld_u16(b));
    min = 0.0f;
  }
};

template <>
struct MmqChunk32<GgmlType::Q4_1> {
  static constexpr bool kMins = true;
  __device__ __forceinline__ static void load(const uint8_t* row, int c, int t, const quant::IqTables&, uint32_t& lo,
                                              uint32_t& hi, float& scale, float& min) {
    const uint8_t* b = row + 20 * c;
    const uint32_t dm = ld_a4(b), w = ld_a4(b + 4 + 4 * t);
    lo = w & 0x0F0F0F0Fu;
    hi = (w >> 4) & 0x0F0F0F0Fu;
    scale = half_to_float(dm);
    min = half_to_float(dm >> 16);
  }
};

// The fifth bit of element j: bit j of the word qh.
__device__ __forceinline__ void q5_fragment(uint32_t w, uint32_t qh, int t, uint32_t& lo, uint32_t& hi) {
  lo = (w & 0x0F0F0F0Fu) | (spread_bits4((qh >> (4 * t)) & 0xF) << 4);
  hi = ((w >> 4) & 0x0F0F0F0Fu) | (spread_bits4((qh >> (16 + 4 * t)) & 0xF) << 4);
}

template <>
struct MmqChunk32<GgmlType::Q5_0> {
  static constexpr bool kMins = false;
  __device__ __forceinline__ static void load(const uint8_t* row, int c, int t, const quant::IqTables&, uint32_t& lo,
                                              uint32_t& hi, float& scale, float& min) {
    const uint8_t* b = row + 22 * c;
    uint32_t l, h;
    q5_fragment(ld_a2(b + 6 + 4 * t), ld_a2(b + 2), t, l, h);
    lo = __vsub4(l, 0x10101010u);
    hi = __vsub4(h, 0x10101010u);
    scale = half_to_float(ld_u16(b));
    min = 0.0f;
  }
};

template <>
struct MmqChunk32<GgmlType::Q5_1> {
  static constexpr bool kMins = true;
  __device__ __forceinline__ static void load(const uint8_t* row, int c, int t, const quant::IqTables&, uint32_t& lo,
                                              uint32_t& hi, float& scale, float& min) {
    const uint8_t* b = row + 24 * c;
    const uint32_t dm = ld_a4(b);
    q5_fragment(ld_a4(b + 8 + 4 * t), ld_a4(b + 4), t, lo, hi);
    scale = half_to_float(dm);
    min = half_to_float(dm >> 16);
  }
};

template <>
struct MmqChunk32<GgmlType::IQ4_NL> {
  static constexpr bool kMins = false;
  __device__ __forceinline__ static void load(const uint8_t* row, int c, int t, const quant::IqTables&, uint32_t& lo,
                                              uint32_t& hi, float& scale, float& min) {
    const uint8_t* b = row + 18 * c;
    const uint32_t w = ld_a2(b + 2 + 4 * t);
    lo = static_cast<uint32_t>(iq4nl_bytes_to_int8(w & 0x0F0F0F0Fu));
    hi = static_cast<uint32_t>(iq4nl_bytes_to_int8((w >> 4) & 0x0F0F0F0Fu));
    scale = half_to_float(ld_u16(b));
    min = 0.0f;
  }
};

// Sub-block c: nibble c % 2 of qs[32 (c / 2) + l] (byte 48), fifth bit c of qh[l] (byte 16).
template <>
struct MmqChunk32<GgmlType::Q5_K> {
  static constexpr bool kMins = true;
  __device__ __forceinline__ static void load(const uint8_t* row, int c, int t, const quant::IqTables&, uint32_t& lo,
                                              uint32_t& hi, float& scale, float& min) {
    const uint32_t dd = ld_a4(row);
    const uint32_t w0 = ld_a4(row + 48 + 32 * (c / 2) + 4 * t), w1 = ld_a4(row + 64 + 32 * (c / 2) + 4 * t);
    const uint32_t h0 = ld_a4(row + 16 + 4 * t), h1 = ld_a4(row + 32 + 4 * t);
    const int shift = 4 * (c % 2);
    lo = ((w0 >> shift) & 0x0F0F0F0Fu) | (((h0 >> c) & 0x01010101u) << 4);
    hi = ((w1 >> shift) & 0x0F0F0F0Fu) | (((h1 >> c) & 0x01010101u) << 4);
    uint8_t sc, m;
    quant::k4_scale_min(row + 4, c, sc, m);
    scale = half_to_float(dd) * static_cast<float>(sc);
    min = -(half_to_float(dd >> 16) * static_cast<float>(m));
  }
};

// Sub-block c: 16 bytes of qs at 8 + 16c (low nibbles first), 6-bit scale d * (ls - 32).
template <>
struct MmqChunk32<GgmlType::IQ4_XS> {
  static constexpr bool kMins = false;
  __device__ __forceinline__ static void load(const uint8_t* row, int c, int t, const quant::IqTables&, uint32_t& lo,
                                              uint32_t& hi, float& scale, float& min) {
    const uint32_t head = ld_a4(row), scales_l = ld_a4(row + 4);
    const uint32_t w = ld_a4(row + 8 + 16 * c + 4 * t);
    lo = static_cast<uint32_t>(iq4nl_bytes_to_int8(w & 0x0F0F0F0Fu));
    hi = static_cast<uint32_t>(iq4nl_bytes_to_int8((w >> 4) & 0x0F0F0F0Fu));
    const int ls = static_cast<int>(((scales_l >> (4 * c)) & 0xF) | (((head >> (16 + 2 * c)) & 3) << 4));
    scale = half_to_float(head) * static_cast<float>(ls - 32);
    min = 0.0f;
  }
};

// Sub-block c: grid indices qs[8c..8c+7] (byte 2; one per 4 elements, so lane t's are entries
// t and 4 + t), then the word at 66 + 4c: four 7-bit sign indices (one per 8) and the scale.
template <>
struct MmqChunk32<GgmlType::IQ3_XXS> {
  static constexpr bool kMins = false;
  __device__ __forceinline__ static void load(const uint8_t* row, int c, int t, const quant::IqTables& tab,
                                              uint32_t& lo, uint32_t& hi, float& scale, float& min) {
    const uint32_t aux = ld_a2(row + 66 + 4 * c);
    const uint32_t s0 = ksigns_of((aux >> (7 * (t / 2))) & 127), s1 = ksigns_of((aux >> (7 * (2 + t / 2))) & 127);
    const int half = 4 * (t % 2);
    lo = static_cast<uint32_t>(negate_bytes(__ldg(tab.iq3xxs_grid + row[2 + 8 * c + t]), (s0 >> half) & 0xF));
    hi = static_cast<uint32_t>(negate_bytes(__ldg(tab.iq3xxs_grid + row[6 + 8 * c + t]), (s1 >> half) & 0xF));
    scale = half_to_float(ld_u16(row)) * (0.5f + static_cast<float>(aux >> 28)) * 0.5f;
    min = 0.0f;
  }
};

// Sub-block c: entries 8c + e (4 elements each; lane t's are e = t and 4 + t): 9-bit index
// (qs at byte 2, qh[c] at byte 66), sign nibbles of signs[4c + e / 2] (byte 74), scale d * (1 + 2s)
// with s in nibble c % 2 of scales[c / 2] (byte 106).
template <>
struct MmqChunk32<GgmlType::IQ3_S> {
  static constexpr bool kMins = false;
  __device__ __forceinline__ static void load(const uint8_t* row, int c, int t, const quant::IqTables& tab,
                                              uint32_t& lo, uint32_t& hi, float& scale, float& min) {
    const uint32_t qh = row[66 + c];
    auto entry = [&](int e) {
      const uint32_t index = row[2 + 8 * c + e] | (((qh >> e) & 1) << 8);
      const uint32_t signs = (row[74 + 4 * c + e / 2] >> (4 * (e % 2))) & 0xF;
      return static_cast<uint32_t>(negate_bytes(__ldg(tab.iq3s_grid + index), signs));
    };
    lo = entry(t);
    hi = entry(4 + t);
    const uint32_t s = (row[106 + c / 2] >> (4 * (c % 2))) & 0xF;
    scale = half_to_float(ld_u16(row)) * static_cast<float>(1 + 2 * s);
    min = 0.0f;
  }
};

// Sub-block c: the u16 qh[c] (byte 34) holds the high index bits of its four groups of 8, the
// scale and the shift sign; grid index bytes qs[4c + l] (byte 2). Lane t's elements are half
// t % 2 of groups t / 2 and 2 + t / 2. Levels 8g +- 1 with scale dl / 8.
template <>
struct MmqChunk32<GgmlType::IQ1_S> {
  static constexpr bool kMins = false;
  __device__ __forceinline__ static void load(const uint8_t* row, int c, int t, const quant::IqTables& tab,
                                              uint32_t& lo, uint32_t& hi, float& scale, float& min) {
    const uint32_t w = ld_u16(row + 34 + 2 * c);
    const int shift = (w & 0x8000u) ? -1 : 1;
    auto group = [&](int l) {
      const uint64_t g = __ldg(tab.iq1s_grid + (row[2 + 4 * c + l] | (((w >> (3 * l)) & 7) << 8)));
      return static_cast<uint32_t>(iq1_bytes_to_levels(static_cast<uint32_t>(g >> (32 * (t % 2))), shift));
    };
    lo = group(t / 2);
    hi = group(2 + t / 2);
    scale = half_to_float(ld_u16(row)) * static_cast<float>(2 * ((w >> 12) & 7) + 1) * 0.125f;
    min = 0.0f;
  }
};

// ---- a scale per 16: IQ2_XS, IQ2_S, IQ1_M ------------------------------------------------------
// MmqChunk16<T>::load(row, c, t, tables, lo, hi, scale_lo, scale_hi): as MmqChunk32 with the
// scales of elements 0..15 (lo) and 16..31 (hi) of chunk c apart; two k16 MMAs per chunk.

template <GgmlType T>
struct MmqChunk16;

// The IQ2 scale d * (0.5 + s) * 0.25 of both nibbles of scale byte `sc`.
__device__ __forceinline__ void iq2_chunk_scales(float d, uint32_t sc, float& lo, float& hi) {
  lo = d * (0.5f + static_cast<float>(sc & 0xF)) * 0.25f;
  hi = d * (0.5f + static_cast<float>(sc >> 4)) * 0.25f;
}

// Group 4c + l of 8: the u16 qs (byte 2): 9-bit grid index, 7-bit sign index; scales[c] at 66.
template <>
struct MmqChunk16<GgmlType::IQ2_XS> {
  __device__ __forceinline__ static void load(const uint8_t* row, int c, int t, const quant::IqTables& tab,
                                              uint32_t& lo, uint32_t& hi, float& scale_lo, float& scale_hi) {
    const int half = t % 2;
    auto group = [&](int l) {
      const uint32_t v = ld_u16(row + 2 + 2 * (4 * c + l));
      const uint64_t g = __ldg(tab.iq2xs_grid + (v & 511));
      return static_cast<uint32_t>(
          negate_bytes(static_cast<uint32_t>(g >> (32 * half)), (ksigns_of(v >> 9) >> (4 * half)) & 0xF));
    };
    lo = group(t / 2);
    hi = group(2 + t / 2);
    iq2_chunk_scales(half_to_float(ld_u16(row)), row[66 + c], scale_lo, scale_hi);
  }
};

// Group g = 4c + l: index qs[g] | bits 2l of qh[c] (bytes 2, 66), sign byte qs[32 + g] (34),
// scales[c] at 74.
template <>
struct MmqChunk16<GgmlType::IQ2_S> {
  __device__ __forceinline__ static void load(const uint8_t* row, int c, int t, const quant::IqTables& tab,
                                              uint32_t& lo, uint32_t& hi, float& scale_lo, float& scale_hi) {
    const int half = t % 2;
    const uint32_t qh = row[66 + c];
    auto group = [&](int l) {
      const int g = 4 * c + l;
      const uint32_t index = row[2 + g] | (((qh >> (2 * l)) & 3) << 8);
      const uint64_t grid = __ldg(tab.iq2s_grid + index);
      return static_cast<uint32_t>(
          negate_bytes(static_cast<uint32_t>(grid >> (32 * half)), (row[34 + g] >> (4 * half)) & 0xF));
    };
    lo = group(t / 2);
    hi = group(2 + t / 2);
    iq2_chunk_scales(half_to_float(ld_u16(row)), row[74 + c], scale_lo, scale_hi);
  }
};

// Group k = 4c + l: index qs[k] (byte 0) with the low 3 bits of nibble k % 2 of qh[k / 2]
// (byte 32), bit 3 the shift sign; 3-bit scales of 16 in the u16 words of `scales` (byte 48),
// whose top nibbles hold the fp16 block scale.
template <>
struct MmqChunk16<GgmlType::IQ1_M> {
  __device__ __forceinline__ static void load(const uint8_t* row, int c, int t, const quant::IqTables& tab,
                                              uint32_t& lo, uint32_t& hi, float& scale_lo, float& scale_hi) {
    const int half = t % 2;
    auto group = [&](int l) {
      const int k = 4 * c + l;
      const uint32_t nib = (row[32 + k / 2] >> (4 * (k % 2))) & 0xF;
      const uint64_t g = __ldg(tab.iq1s_grid + (row[k] | ((nib & 7) << 8)));
      return static_cast<uint32_t>(iq1_bytes_to_levels(static_cast<uint32_t>(g >> (32 * half)), (nib & 8) ? -1 : 1));
    };
    lo = group(t / 2);
    hi = group(2 + t / 2);
    const uint32_t s01 = ld_a4(row + 48), s23 = ld_a4(row + 52);
    const uint32_t sw[4] = {s01 & 0xFFFFu, s01 >> 16, s23 & 0xFFFFu, s23 >> 16};
    const uint32_t bits = (sw[0] >> 12) | ((sw[1] >> 8) & 0x00F0u) | ((sw[2] >> 4) & 0x0F00u) | (sw[3] & 0xF000u);
    const float d = half_to_float(bits);
    const uint32_t word = sw[c / 2];
    scale_lo = d * static_cast<float>(2 * ((word >> (3 * ((2 * c) % 4))) & 7) + 1) * 0.125f;
    scale_hi = d * static_cast<float>(2 * ((word >> (3 * ((2 * c + 1) % 4))) & 7) + 1) * 0.125f;
  }
};

}  // namespace dsv4::cuda::detail
