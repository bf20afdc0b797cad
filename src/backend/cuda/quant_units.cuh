// Per-type decoding of 32 consecutive weights of one row into packed int8 values plus the
// float factors that turn integer dot products with Q8 activations (activation_quant.h)
// back into the product with the dequantised weights:
//
//   dot(w[0..31], x[0..31]) = dx * (a0 * idot(q[0..3], xq[0..15]) + a1 * idot(q[4..7], xq[16..31]))
//                             - (b0 * s16[0] + b1 * s16[1])
//
// where xq, dx are the activation's int8 values and scale, s16 the two sums dx * sum(xq) over
// 16 elements, and idot a sum of __dp4a. Every type fits this one form: scales go into a,
// ggml's subtracted minimums and biases (Q2_K/Q4_K mins, Q3_K's -4, Q6_K's -32) into b. The
// element value is a*q - b exactly as quant_decode.h defines it, up to f32 rounding.
// Block byte offsets follow quant_blocks.h; blocks may sit at any byte address (they are
// read from the per-warp shared-memory stages of matvec_kernel.cuh with unaligned word loads).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "gguf/ggml_types.h"
#include "gguf/quant_blocks.h"
#include "gguf/quant_decode.h"
#include "util/float_formats.h"

namespace dsv4::cuda {

struct Unit32 {
  int q[8];
  float a0, a1, b0, b1;
};

// IQ2_XXS needs ggml's grid and sign tables; kernels copy them into shared memory (the lanes
// of a warp index them divergently, which constant memory would serialise).
struct Iq2Tables {
  const uint64_t* grid;  // 256 entries
  const uint8_t* signs;  // 128 entries
};

// N consecutive 32-bit words starting at any byte address (reads up to 4 bytes past the end).
template <int N>
__device__ __forceinline__ void load_words(const uint8_t* p, uint32_t (&out)[N]) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  const uint32_t* base = reinterpret_cast<const uint32_t*>(addr & ~uintptr_t{3});
  const uint32_t shift = static_cast<uint32_t>(addr & 3) * 8;
  uint32_t w[N + 1];
#pragma unroll
  for (int i = 0; i <= N; ++i) w[i] = base[i];
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = __funnelshift_r(w[i], w[i + 1], shift);
}

__device__ __forceinline__ float half_at(const uint8_t* p) {
  const uint16_t bits = static_cast<uint16_t>(p[0] | (p[1] << 8));
  return __half2float(__ushort_as_half(bits));
}

// Four MXFP4 codes (one per byte, 0..15) to the int8 values of ggml's doubled E2M1 grid.
__device__ __forceinline__ int mxfp4_bytes_to_int8(uint32_t codes) {
  const uint32_t v = codes & 0x07070707u;
  const uint32_t t = v | (v >> 4);
  const uint32_t sel = (t & 0xFFu) | ((t >> 8) & 0xFF00u);
  const uint32_t pos = __byte_perm(0x03020100u, 0x0C080604u, sel);  // 0 1 2 3 | 4 6 8 12
  const uint32_t neg = __byte_perm(0xFDFEFF00u, 0xF4F8FAFCu, sel);  // their negatives
  const uint32_t m = ((codes >> 3) & 0x01010101u) * 0xFFu;
  return static_cast<int>((pos & ~m) | (neg & m));
}

// Four sign bits to a byte mask of 0x01 per set bit.
__device__ __forceinline__ uint32_t spread_bits4(uint32_t s) { return (s * 0x00204081u) & 0x01010101u; }

// QuantUnit<T>::decode fills kSub consecutive Unit32 (a "wide unit" of 32*kSub weights) from
// one place in a row, so that words shared by several 32-weight groups (Q2_K's and Q3_K's 2-bit
// planes, Q4_K's two nibbles, Q6_K's high bits) are read once and the per-step overhead is
// spread over more bytes. `at` points at the wide unit's first block; `part` is the wide unit's
// index inside that block (0 for types with whole blocks per wide unit).
template <GgmlType T>
struct QuantUnit;

template <>
struct QuantUnit<GgmlType::Q8_0> {
  static constexpr bool kOffsets = false;  // b0/b1 nonzero
  static constexpr int kBlockBytes = sizeof(block_q8_0);
  static constexpr int kSub = 1;             // 32 weights per wide unit
  static constexpr int kBlocksPerUnit = 1;   // whole blocks per wide unit (when > 0)
  static constexpr int kUnitsPerBlock = 1;
  __device__ static void decode(const uint8_t* blk, int, const Iq2Tables&, Unit32 (&u)[kSub], int) {
    uint32_t w[8];
    load_words<8>(blk + 2, w);
#pragma unroll
    for (int i = 0; i < 8; ++i) u[0].q[i] = static_cast<int>(w[i]);
    u[0].a0 = u[0].a1 = half_at(blk);
    u[0].b0 = u[0].b1 = 0.0f;
  }
};

template <>
struct QuantUnit<GgmlType::Q2_K> {
  static constexpr bool kOffsets = true;  // b0/b1 nonzero
  static constexpr int kBlockBytes = sizeof(block_q2_K);
  static constexpr int kSub = 4;  // one 32-byte plane of qs: 4 shifts x 32 weights
  static constexpr int kBlocksPerUnit = 0;
  static constexpr int kUnitsPerBlock = 2;
  __device__ static void decode(const uint8_t* blk, int n, const Iq2Tables&, Unit32 (&u)[kSub], int) {
    uint32_t w[8];
    load_words<8>(blk + 16 + 32 * n, w);
    const float d = half_at(blk + 80), dmin = half_at(blk + 82);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int i = 0; i < 8; ++i) u[j].q[i] = static_cast<int>((w[i] >> (2 * j)) & 0x03030303u);
      const int sub = 4 * n + j;
      const uint32_t sc0 = blk[2 * sub], sc1 = blk[2 * sub + 1];
      u[j].a0 = d * static_cast<float>(sc0 & 0xF);
      u[j].a1 = d * static_cast<float>(sc1 & 0xF);
      u[j].b0 = dmin * static_cast<float>(sc0 >> 4);
      u[j].b1 = dmin * static_cast<float>(sc1 >> 4);
    }
  }
};

template <>
struct QuantUnit<GgmlType::Q3_K> {
  static constexpr bool kOffsets = true;  // b0/b1 nonzero
  static constexpr int kBlockBytes = sizeof(block_q3_K);
  static constexpr int kSub = 4;
  static constexpr int kBlocksPerUnit = 0;
  static constexpr int kUnitsPerBlock = 2;
  __device__ static void decode(const uint8_t* blk, int n, const Iq2Tables&, Unit32 (&u)[kSub], int) {
    uint32_t w[8], h[8];
    load_words<8>(blk + 32 + 32 * n, w);
    load_words<8>(blk, h);
    const float d = half_at(blk + 108);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int sub = 4 * n + j;
#pragma unroll
      for (int i = 0; i < 8; ++i)
        u[j].q[i] = static_cast<int>(((w[i] >> (2 * j)) & 0x03030303u) | (((h[i] >> sub) & 0x01010101u) << 2));
      u[j].a0 = d * static_cast<float>(quant::q3_k_scale(blk + 96, 2 * sub));
      u[j].a1 = d * static_cast<float>(quant::q3_k_scale(blk + 96, 2 * sub + 1));
      u[j].b0 = 4.0f * u[j].a0;
      u[j].b1 = 4.0f * u[j].a1;
    }
  }
};

template <>
struct QuantUnit<GgmlType::Q4_K> {
  static constexpr bool kOffsets = true;  // b0/b1 nonzero
  static constexpr int kBlockBytes = sizeof(block_q4_K);
  static constexpr int kSub = 2;  // both nibbles of 32 bytes
  static constexpr int kBlocksPerUnit = 0;
  static constexpr int kUnitsPerBlock = 4;
  __device__ static void decode(const uint8_t* blk, int p, const Iq2Tables&, Unit32 (&u)[kSub], int) {
    uint32_t w[8];
    load_words<8>(blk + 16 + 32 * p, w);
    const float d = half_at(blk), dmin = half_at(blk + 2);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int i = 0; i < 8; ++i) u[j].q[i] = static_cast<int>((w[i] >> (4 * j)) & 0x0F0F0F0Fu);
      uint8_t sc, m;
      quant::k4_scale_min(blk + 4, 2 * p + j, sc, m);
      u[j].a0 = u[j].a1 = d * static_cast<float>(sc);
      u[j].b0 = u[j].b1 = dmin * static_cast<float>(m);
    }
  }
};

template <>
struct QuantUnit<GgmlType::Q6_K> {
  static constexpr bool kOffsets = true;  // b0/b1 nonzero
  static constexpr int kBlockBytes = sizeof(block_q6_K);
  static constexpr int kSub = 4;  // one half block: 64 bytes of ql, 32 of qh
  static constexpr int kBlocksPerUnit = 0;
  static constexpr int kUnitsPerBlock = 2;
  __device__ static void decode(const uint8_t* blk, int n, const Iq2Tables&, Unit32 (&u)[kSub], int) {
    uint32_t l0[8], l1[8], h[8];
    load_words<8>(blk + 64 * n, l0);
    load_words<8>(blk + 64 * n + 32, l1);
    load_words<8>(blk + 128 + 32 * n, h);
    const float d = half_at(blk + 208);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint32_t lo = ((j & 1) ? l1[i] : l0[i]) >> (4 * (j >> 1));
        u[j].q[i] = static_cast<int>((lo & 0x0F0F0F0Fu) | (((h[i] >> (2 * j)) & 0x03030303u) << 4));
      }
      const int sub = 4 * n + j;
      u[j].a0 = d * static_cast<float>(static_cast<int8_t>(blk[192 + 2 * sub]));
      u[j].a1 = d * static_cast<float>(static_cast<int8_t>(blk[192 + 2 * sub + 1]));
      u[j].b0 = 32.0f * u[j].a0;
      u[j].b1 = 32.0f * u[j].a1;
    }
  }
};

template <>
struct QuantUnit<GgmlType::MXFP4> {
  static constexpr bool kOffsets = false;  // b0/b1 nonzero
  static constexpr int kBlockBytes = sizeof(block_mxfp4);
  static constexpr int kSub = 4;  // four consecutive blocks; a row's last unit may hold fewer
  static constexpr int kBlocksPerUnit = 4;
  static constexpr int kUnitsPerBlock = 1;
  __device__ static void decode(const uint8_t* blk, int, const Iq2Tables&, Unit32 (&u)[kSub], int valid) {
#pragma unroll
    for (int b = 0; b < kSub; ++b) {
      if (b < valid) {
        const uint8_t* p = blk + b * kBlockBytes;
        uint32_t w[4];
        load_words<4>(p + 1, w);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          u[b].q[i] = mxfp4_bytes_to_int8(w[i] & 0x0F0F0F0Fu);            // elements 4i..4i+3
          u[b].q[4 + i] = mxfp4_bytes_to_int8((w[i] >> 4) & 0x0F0F0F0Fu);  // elements 16+4i..
        }
        u[b].a0 = u[b].a1 = e8m0_to_f32_half(p[0]);
        u[b].b0 = u[b].b1 = 0.0f;
      }
    }
  }
};

template <>
struct QuantUnit<GgmlType::IQ2_XXS> {
  static constexpr bool kOffsets = false;  // b0/b1 nonzero
  static constexpr int kBlockBytes = sizeof(block_iq2_xxs);
  static constexpr int kSub = 4;  // half a block
  static constexpr int kBlocksPerUnit = 0;
  static constexpr int kUnitsPerBlock = 2;
  __device__ static void decode(const uint8_t* blk, int half, const Iq2Tables& t, Unit32 (&u)[kSub], int) {
    uint32_t w[8];
    load_words<8>(blk + 2 + 32 * half, w);
    const float d = half_at(blk);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t indices = w[2 * j], signs_scale = w[2 * j + 1];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint64_t g = t.grid[(indices >> (8 * k)) & 0xFF];
        const uint32_t s = t.signs[(signs_scale >> (7 * k)) & 127];
        // Grid bytes are never 0, so negating a byte as (b ^ 0xFF) + 1 cannot carry.
        const uint32_t m_lo = spread_bits4(s & 0xF), m_hi = spread_bits4(s >> 4);
        u[j].q[2 * k] = static_cast<int>((static_cast<uint32_t>(g) ^ (m_lo * 0xFFu)) + m_lo);
        u[j].q[2 * k + 1] = static_cast<int>((static_cast<uint32_t>(g >> 32) ^ (m_hi * 0xFFu)) + m_hi);
      }
      u[j].a0 = u[j].a1 = d * (0.5f + static_cast<float>(signs_scale >> 28)) * 0.25f;
      u[j].b0 = u[j].b1 = 0.0f;
    }
  }
};

// The wide unit `unit` of a row: its first block and its part inside that block.
template <class U>
__device__ __forceinline__ const uint8_t* unit_address(const uint8_t* row, int unit, int& part) {
  if constexpr (U::kBlocksPerUnit > 0) {
    part = 0;
    return row + unit * U::kBlocksPerUnit * U::kBlockBytes;
  } else {
    part = unit % U::kUnitsPerBlock;
    return row + (unit / U::kUnitsPerBlock) * U::kBlockBytes;
  }
}

}  // namespace dsv4::cuda
