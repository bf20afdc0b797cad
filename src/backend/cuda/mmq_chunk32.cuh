// The A fragments of the types with one scale (and minimum) per 32 weights, for the generic
// tensor-core stage product of mmq_kernel.cuh: Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL (one block per
// 32-wide chunk) and Q5_K, IQ4_XS (one sub-block of 32 of the stage's super-block per chunk).
//
// MmqChunk32<T>::load(row, c, t, lo, hi, scale, min): chunk c of one stage row (shared
// memory) as lane t of its row sees it: lo = the int8 values of elements 4t..4t+3, hi those of
// 16+4t..16+4t+3 (quant_units.cuh's byte tricks), and the weight w = scale * q + min of
// quant_decode.h (min 0 and unread where kMins is false). Included by mmq_kernel.cuh after
// its shared-memory word loads (ld_a2, ld_a4, half_to_float).
#pragma once

#include <cstdint>

#include "backend/cuda/quant_units.cuh"

namespace dsv4::cuda::detail {

template <GgmlType T>
struct MmqChunk32;

template <>
struct MmqChunk32<GgmlType::Q4_0> {
  static constexpr bool kMins = false;
  __device__ __forceinline__ static void load(const uint8_t* row, int c, int t, uint32_t& lo, uint32_t& hi,
                                              float& scale, float& min) {
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
  __device__ __forceinline__ static void load(const uint8_t* row, int c, int t, uint32_t& lo, uint32_t& hi,
                                              float& scale, float& min) {
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
  __device__ __forceinline__ static void load(const uint8_t* row, int c, int t, uint32_t& lo, uint32_t& hi,
                                              float& scale, float& min) {
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
  __device__ __forceinline__ static void load(const uint8_t* row, int c, int t, uint32_t& lo, uint32_t& hi,
                                              float& scale, float& min) {
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
  __device__ __forceinline__ static void load(const uint8_t* row, int c, int t, uint32_t& lo, uint32_t& hi,
                                              float& scale, float& min) {
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
  __device__ __forceinline__ static void load(const uint8_t* row, int c, int t, uint32_t& lo, uint32_t& hi,
                                              float& scale, float& min) {
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
  __device__ __forceinline__ static void load(const uint8_t* row, int c, int t, uint32_t& lo, uint32_t& hi,
                                              float& scale, float& min) {
    const uint32_t head = ld_a4(row), scales_l = ld_a4(row + 4);
    const uint32_t w = ld_a4(row + 8 + 16 * c + 4 * t);
    lo = static_cast<uint32_t>(iq4nl_bytes_to_int8(w & 0x0F0F0F0Fu));
    hi = static_cast<uint32_t>(iq4nl_bytes_to_int8((w >> 4) & 0x0F0F0F0Fu));
    const int ls = static_cast<int>(((scales_l >> (4 * c)) & 0xF) | (((head >> (16 + 2 * c)) & 3) << 4));
    scale = half_to_float(head) * static_cast<float>(ls - 32);
    min = 0.0f;
  }
};

}  // namespace dsv4::cuda::detail
