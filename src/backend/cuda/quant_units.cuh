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
#include "gguf/iq2xxs_tables.h"
#include "gguf/iq_tables.h"
#include "gguf/quant_blocks.h"
#include "gguf/quant_decode.h"
#include "util/float_formats.h"

namespace dsv4::cuda {

struct Unit32 {
  int q[8];
  float a0, a1, b0, b1;
};

// IQ2_XXS needs ggml's grid and sign tables; kernels copy them into shared memory (the lanes
// of a warp index them divergently, which constant memory would serialise). The other
// i-quants read their (larger) codebooks from device memory through the read-only cache
// (cuda::detail::iq_tables; IQ1_S's grid alone is 16 KB).
struct Iq2Tables {
  const uint64_t* grid;  // 256 entries
  const uint8_t* signs;  // 128 entries
  quant::IqTables iq{};
};

// Whether a type's units read Iq2Tables::iq.
constexpr bool needs_iq_tables(GgmlType t) {
  return t == GgmlType::IQ2_XS || t == GgmlType::IQ2_S || t == GgmlType::IQ3_XXS || t == GgmlType::IQ3_S ||
         t == GgmlType::IQ1_S || t == GgmlType::IQ1_M;
}

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

// The four bytes of g, byte e negated where bit e of `signs` (0..15) is set: (b ^ 0xFF) - 0xFF
// is -b modulo 256 in each byte, with no borrow between bytes (__vsub4).
__device__ __forceinline__ int negate_bytes(uint32_t g, uint32_t signs) {
  const uint32_t m = spread_bits4(signs) * 0xFFu;
  return static_cast<int>(__vsub4(g ^ m, m));
}

// ggml's ksigns_iq2xs: a 7-bit sign index with its parity as bit 7 (an even count of negated
// values); checked against the table below.
__host__ __device__ constexpr uint32_t ksigns_of(uint32_t index) {
  uint32_t parity = 0;
  for (int b = 0; b < 7; ++b) parity ^= (index >> b) & 1u;
  return index | (parity << 7);
}
constexpr bool ksigns_match_table() {
  for (uint32_t i = 0; i < 128; ++i)
    if (ksigns_of(i) != quant::kIq2xxsSigns[i]) return false;
  return true;
}
static_assert(ksigns_match_table(), "ksigns_of must equal ggml's ksigns_iq2xs");

// kvalues_iq4nl as four words of four int8 (entry 4w + j in byte j of word w), for __byte_perm.
constexpr uint32_t iq4nl_word(int w) {
  uint32_t v = 0;
  for (int j = 0; j < 4; ++j) v |= static_cast<uint32_t>(static_cast<uint8_t>(quant::kIq4nlValues[4 * w + j])) << (8 * j);
  return v;
}
inline constexpr uint32_t kIq4nlWord0 = iq4nl_word(0), kIq4nlWord1 = iq4nl_word(1), kIq4nlWord2 = iq4nl_word(2),
                          kIq4nlWord3 = iq4nl_word(3);

// Four IQ4_NL codes (one per byte, 0..15) to their int8 levels.
__device__ __forceinline__ int iq4nl_bytes_to_int8(uint32_t codes) {
  const uint32_t v = codes & 0x07070707u;
  const uint32_t t = v | (v >> 4);
  const uint32_t sel = (t & 0xFFu) | ((t >> 8) & 0xFF00u);
  const uint32_t lo = __byte_perm(kIq4nlWord0, kIq4nlWord1, sel);  // entries 0..7
  const uint32_t hi = __byte_perm(kIq4nlWord2, kIq4nlWord3, sel);  // entries 8..15
  const uint32_t m = ((codes >> 3) & 0x01010101u) * 0xFFu;
  return static_cast<int>((lo & ~m) | (hi & m));
}

// Four signed IQ1 grid bytes g (-1, 0, 1) to the levels 8g + shift (shift +-1).
__device__ __forceinline__ int iq1_bytes_to_levels(uint32_t g, int shift) {
  const uint32_t u = __vadd4(g, 0x01010101u);  // 0, 1, 2: no byte overflows when shifted by 3
  return static_cast<int>(__vadd4(u << 3, shift > 0 ? 0xF9F9F9F9u : 0xF7F7F7F7u));  // - 8 + shift
}

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

// ---- 32-element blocks: one block per unit (like Q8_0); low nibbles are elements 0..15 ----------

template <>
struct QuantUnit<GgmlType::Q4_0> {
  static constexpr bool kOffsets = false;
  static constexpr int kBlockBytes = sizeof(block_q4_0);
  static constexpr int kSub = 1;
  static constexpr int kBlocksPerUnit = 1;
  static constexpr int kUnitsPerBlock = 1;
  __device__ static void decode(const uint8_t* blk, int, const Iq2Tables&, Unit32 (&u)[kSub], int) {
    uint32_t w[4];
    load_words<4>(blk + 2, w);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      u[0].q[i] = static_cast<int>(__vsub4(w[i] & 0x0F0F0F0Fu, 0x08080808u));
      u[0].q[4 + i] = static_cast<int>(__vsub4((w[i] >> 4) & 0x0F0F0F0Fu, 0x08080808u));
    }
    u[0].a0 = u[0].a1 = half_at(blk);
    u[0].b0 = u[0].b1 = 0.0f;
  }
};

// The fifth bit of element j is bit j of the word qh.
template <>
struct QuantUnit<GgmlType::Q5_0> {
  static constexpr bool kOffsets = false;
  static constexpr int kBlockBytes = sizeof(block_q5_0);
  static constexpr int kSub = 1;
  static constexpr int kBlocksPerUnit = 1;
  static constexpr int kUnitsPerBlock = 1;
  __device__ static void decode(const uint8_t* blk, int, const Iq2Tables&, Unit32 (&u)[kSub], int) {
    uint32_t w[5];
    load_words<5>(blk + 2, w);  // qh, then the 16 bytes of qs
    const uint32_t qh = w[0];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t lo = (w[1 + i] & 0x0F0F0F0Fu) | (spread_bits4((qh >> (4 * i)) & 0xF) << 4);
      const uint32_t hi = ((w[1 + i] >> 4) & 0x0F0F0F0Fu) | (spread_bits4((qh >> (16 + 4 * i)) & 0xF) << 4);
      u[0].q[i] = static_cast<int>(__vsub4(lo, 0x10101010u));
      u[0].q[4 + i] = static_cast<int>(__vsub4(hi, 0x10101010u));
    }
    u[0].a0 = u[0].a1 = half_at(blk);
    u[0].b0 = u[0].b1 = 0.0f;
  }
};

// x = d * q + m: the minimum goes in as the offset b = -m.
template <>
struct QuantUnit<GgmlType::Q4_1> {
  static constexpr bool kOffsets = true;
  static constexpr int kBlockBytes = sizeof(block_q4_1);
  static constexpr int kSub = 1;
  static constexpr int kBlocksPerUnit = 1;
  static constexpr int kUnitsPerBlock = 1;
  __device__ static void decode(const uint8_t* blk, int, const Iq2Tables&, Unit32 (&u)[kSub], int) {
    uint32_t w[4];
    load_words<4>(blk + 4, w);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      u[0].q[i] = static_cast<int>(w[i] & 0x0F0F0F0Fu);
      u[0].q[4 + i] = static_cast<int>((w[i] >> 4) & 0x0F0F0F0Fu);
    }
    u[0].a0 = u[0].a1 = half_at(blk);
    u[0].b0 = u[0].b1 = -half_at(blk + 2);
  }
};

template <>
struct QuantUnit<GgmlType::Q5_1> {
  static constexpr bool kOffsets = true;
  static constexpr int kBlockBytes = sizeof(block_q5_1);
  static constexpr int kSub = 1;
  static constexpr int kBlocksPerUnit = 1;
  static constexpr int kUnitsPerBlock = 1;
  __device__ static void decode(const uint8_t* blk, int, const Iq2Tables&, Unit32 (&u)[kSub], int) {
    uint32_t w[5];
    load_words<5>(blk + 4, w);  // qh, then the 16 bytes of qs
    const uint32_t qh = w[0];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      u[0].q[i] = static_cast<int>((w[1 + i] & 0x0F0F0F0Fu) | (spread_bits4((qh >> (4 * i)) & 0xF) << 4));
      u[0].q[4 + i] = static_cast<int>(((w[1 + i] >> 4) & 0x0F0F0F0Fu) | (spread_bits4((qh >> (16 + 4 * i)) & 0xF) << 4));
    }
    u[0].a0 = u[0].a1 = half_at(blk);
    u[0].b0 = u[0].b1 = -half_at(blk + 2);
  }
};

template <>
struct QuantUnit<GgmlType::IQ4_NL> {
  static constexpr bool kOffsets = false;
  static constexpr int kBlockBytes = sizeof(block_iq4_nl);
  static constexpr int kSub = 1;
  static constexpr int kBlocksPerUnit = 1;
  static constexpr int kUnitsPerBlock = 1;
  __device__ static void decode(const uint8_t* blk, int, const Iq2Tables&, Unit32 (&u)[kSub], int) {
    uint32_t w[4];
    load_words<4>(blk + 2, w);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      u[0].q[i] = iq4nl_bytes_to_int8(w[i] & 0x0F0F0F0Fu);
      u[0].q[4 + i] = iq4nl_bytes_to_int8((w[i] >> 4) & 0x0F0F0F0Fu);
    }
    u[0].a0 = u[0].a1 = half_at(blk);
    u[0].b0 = u[0].b1 = 0.0f;
  }
};

// ---- 256-element blocks -------------------------------------------------------------------------

// As Q4_K with the fifth bit j of qh[l] (qh at byte 16, qs at 48).
template <>
struct QuantUnit<GgmlType::Q5_K> {
  static constexpr bool kOffsets = true;
  static constexpr int kBlockBytes = sizeof(block_q5_K);
  static constexpr int kSub = 2;  // both nibbles of 32 bytes of qs
  static constexpr int kBlocksPerUnit = 0;
  static constexpr int kUnitsPerBlock = 4;
  __device__ static void decode(const uint8_t* blk, int p, const Iq2Tables&, Unit32 (&u)[kSub], int) {
    uint32_t w[8], h[8];
    load_words<8>(blk + 48 + 32 * p, w);
    load_words<8>(blk + 16, h);
    const float d = half_at(blk), dmin = half_at(blk + 2);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int sub = 2 * p + j;
#pragma unroll
      for (int i = 0; i < 8; ++i)
        u[j].q[i] = static_cast<int>(((w[i] >> (4 * j)) & 0x0F0F0F0Fu) | (((h[i] >> sub) & 0x01010101u) << 4));
      uint8_t sc, m;
      quant::k4_scale_min(blk + 4, sub, sc, m);
      u[j].a0 = u[j].a1 = d * static_cast<float>(sc);
      u[j].b0 = u[j].b1 = dmin * static_cast<float>(m);
    }
  }
};

// Half a block: sub-blocks 4h..4h+3 of 32, qs[64h..64h+63] (at byte 8).
template <>
struct QuantUnit<GgmlType::IQ4_XS> {
  static constexpr bool kOffsets = false;
  static constexpr int kBlockBytes = sizeof(block_iq4_xs);
  static constexpr int kSub = 4;
  static constexpr int kBlocksPerUnit = 0;
  static constexpr int kUnitsPerBlock = 2;
  __device__ static void decode(const uint8_t* blk, int half, const Iq2Tables&, Unit32 (&u)[kSub], int) {
    uint32_t w[16];
    load_words<16>(blk + 8 + 64 * half, w);
    const float d = half_at(blk);
    const uint32_t scales_h = blk[2] | (static_cast<uint32_t>(blk[3]) << 8);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int sub = 4 * half + j;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        u[j].q[i] = iq4nl_bytes_to_int8(w[4 * j + i] & 0x0F0F0F0Fu);
        u[j].q[4 + i] = iq4nl_bytes_to_int8((w[4 * j + i] >> 4) & 0x0F0F0F0Fu);
      }
      const int ls = ((blk[4 + sub / 2] >> (4 * (sub % 2))) & 0xF) | (((scales_h >> (2 * sub)) & 3) << 4);
      u[j].a0 = u[j].a1 = d * static_cast<float>(ls - 32);
      u[j].b0 = u[j].b1 = 0.0f;
    }
  }
};

// The IQ2 scale of a 4-bit field.
__device__ __forceinline__ float iq2_unit_scale(float d, uint32_t s) { return d * (0.5f + static_cast<float>(s)) * 0.25f; }

// Half a block: groups of 8 16h..16h+15 (u16 qs at byte 2 + 32h), scales[4h..4h+3] (byte 66).
template <>
struct QuantUnit<GgmlType::IQ2_XS> {
  static constexpr bool kOffsets = false;
  static constexpr int kBlockBytes = sizeof(block_iq2_xs);
  static constexpr int kSub = 4;
  static constexpr int kBlocksPerUnit = 0;
  static constexpr int kUnitsPerBlock = 2;
  __device__ static void decode(const uint8_t* blk, int half, const Iq2Tables& t, Unit32 (&u)[kSub], int) {
    uint32_t w[8];
    load_words<8>(blk + 2 + 32 * half, w);
    const float d = half_at(blk);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint32_t v = (w[2 * j + k / 2] >> (16 * (k % 2))) & 0xFFFFu;
        const uint64_t g = __ldg(t.iq.iq2xs_grid + (v & 511));
        const uint32_t s = ksigns_of(v >> 9);
        u[j].q[2 * k] = negate_bytes(static_cast<uint32_t>(g), s & 0xF);
        u[j].q[2 * k + 1] = negate_bytes(static_cast<uint32_t>(g >> 32), s >> 4);
      }
      const uint32_t sc = blk[66 + 4 * half + j];
      u[j].a0 = iq2_unit_scale(d, sc & 0xF);
      u[j].a1 = iq2_unit_scale(d, sc >> 4);
      u[j].b0 = u[j].b1 = 0.0f;
    }
  }
};

// Half a block: index bytes qs[16h..], sign bytes qs[32 + 16h..], qh[4h..4h+3], scales[4h..].
template <>
struct QuantUnit<GgmlType::IQ2_S> {
  static constexpr bool kOffsets = false;
  static constexpr int kBlockBytes = sizeof(block_iq2_s);
  static constexpr int kSub = 4;
  static constexpr int kBlocksPerUnit = 0;
  static constexpr int kUnitsPerBlock = 2;
  __device__ static void decode(const uint8_t* blk, int half, const Iq2Tables& t, Unit32 (&u)[kSub], int) {
    uint32_t idx[4], sgn[4];
    load_words<4>(blk + 2 + 16 * half, idx);
    load_words<4>(blk + 34 + 16 * half, sgn);
    const float d = half_at(blk);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t qh = blk[66 + 4 * half + j];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint32_t index = ((idx[j] >> (8 * k)) & 0xFF) | (((qh >> (2 * k)) & 3) << 8);
        const uint64_t g = __ldg(t.iq.iq2s_grid + index);
        const uint32_t s = (sgn[j] >> (8 * k)) & 0xFF;
        u[j].q[2 * k] = negate_bytes(static_cast<uint32_t>(g), s & 0xF);
        u[j].q[2 * k + 1] = negate_bytes(static_cast<uint32_t>(g >> 32), s >> 4);
      }
      const uint32_t sc = blk[74 + 4 * half + j];
      u[j].a0 = iq2_unit_scale(d, sc & 0xF);
      u[j].a1 = iq2_unit_scale(d, sc >> 4);
      u[j].b0 = u[j].b1 = 0.0f;
    }
  }
};

// Half a block: sub-blocks 4h..4h+3 of 32; grid indices qs[32h..32h+31] (byte 2 + 32h), the
// sign-and-scale words at byte 66 + 16h.
template <>
struct QuantUnit<GgmlType::IQ3_XXS> {
  static constexpr bool kOffsets = false;
  static constexpr int kBlockBytes = sizeof(block_iq3_xxs);
  static constexpr int kSub = 4;
  static constexpr int kBlocksPerUnit = 0;
  static constexpr int kUnitsPerBlock = 2;
  __device__ static void decode(const uint8_t* blk, int half, const Iq2Tables& t, Unit32 (&u)[kSub], int) {
    uint32_t w[8], aux[4];
    load_words<8>(blk + 2 + 32 * half, w);
    load_words<4>(blk + 66 + 16 * half, aux);
    const float d = half_at(blk);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int l = 0; l < 4; ++l) {
        const uint32_t pair = w[2 * j + l / 2] >> (16 * (l % 2));
        const uint32_t g0 = __ldg(t.iq.iq3xxs_grid + (pair & 0xFF));
        const uint32_t g1 = __ldg(t.iq.iq3xxs_grid + ((pair >> 8) & 0xFF));
        const uint32_t s = ksigns_of((aux[j] >> (7 * l)) & 127);
        u[j].q[2 * l] = negate_bytes(g0, s & 0xF);
        u[j].q[2 * l + 1] = negate_bytes(g1, s >> 4);
      }
      u[j].a0 = u[j].a1 = d * (0.5f + static_cast<float>(aux[j] >> 28)) * 0.5f;
      u[j].b0 = u[j].b1 = 0.0f;
    }
  }
};

// Half a block: sub-blocks ib = 4h..4h+3; index bytes qs[8ib..] (byte 2), the ninth bits in
// qh[ib] (byte 66), sign bytes signs[4ib..] (byte 74), 4-bit scales (byte 106).
template <>
struct QuantUnit<GgmlType::IQ3_S> {
  static constexpr bool kOffsets = false;
  static constexpr int kBlockBytes = sizeof(block_iq3_s);
  static constexpr int kSub = 4;
  static constexpr int kBlocksPerUnit = 0;
  static constexpr int kUnitsPerBlock = 2;
  __device__ static void decode(const uint8_t* blk, int half, const Iq2Tables& t, Unit32 (&u)[kSub], int) {
    uint32_t w[8], sgn[4];
    load_words<8>(blk + 2 + 32 * half, w);
    load_words<4>(blk + 74 + 16 * half, sgn);
    const float d = half_at(blk);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t qh = blk[66 + 4 * half + j];
#pragma unroll
      for (int e = 0; e < 8; ++e) {  // entries of 4 elements
        const uint32_t index = ((w[2 * j + e / 4] >> (8 * (e % 4))) & 0xFF) | (((qh >> e) & 1) << 8);
        const uint32_t s = (sgn[j] >> (8 * (e / 2) + 4 * (e % 2))) & 0xF;
        u[j].q[e] = negate_bytes(__ldg(t.iq.iq3s_grid + index), s);
      }
      const int ib = 4 * half + j;
      const uint32_t sc = (blk[106 + ib / 2] >> (4 * (ib % 2))) & 0xF;
      u[j].a0 = u[j].a1 = d * static_cast<float>(1 + 2 * sc);
      u[j].b0 = u[j].b1 = 0.0f;
    }
  }
};

// Half a block: sub-blocks ib = 4h..4h+3; grid index bytes qs[4ib..] (byte 2), the u16 words
// qh[ib] (byte 34): high index bits, scale, shift sign. Levels 8g +- 1 with scale dl / 8.
template <>
struct QuantUnit<GgmlType::IQ1_S> {
  static constexpr bool kOffsets = false;
  static constexpr int kBlockBytes = sizeof(block_iq1_s);
  static constexpr int kSub = 4;
  static constexpr int kBlocksPerUnit = 0;
  static constexpr int kUnitsPerBlock = 2;
  __device__ static void decode(const uint8_t* blk, int half, const Iq2Tables& t, Unit32 (&u)[kSub], int) {
    uint32_t qs[4], qh[2];
    load_words<4>(blk + 2 + 16 * half, qs);
    load_words<2>(blk + 34 + 8 * half, qh);
    const float d = half_at(blk);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t w = (qh[j / 2] >> (16 * (j % 2))) & 0xFFFFu;
      const int shift = (w & 0x8000u) ? -1 : 1;
#pragma unroll
      for (int l = 0; l < 4; ++l) {
        const uint64_t g = __ldg(t.iq.iq1s_grid + (((qs[j] >> (8 * l)) & 0xFF) | (((w >> (3 * l)) & 7) << 8)));
        u[j].q[2 * l] = iq1_bytes_to_levels(static_cast<uint32_t>(g), shift);
        u[j].q[2 * l + 1] = iq1_bytes_to_levels(static_cast<uint32_t>(g >> 32), shift);
      }
      u[j].a0 = u[j].a1 = d * static_cast<float>(2 * ((w >> 12) & 7) + 1) * 0.125f;
      u[j].b0 = u[j].b1 = 0.0f;
    }
  }
};

// Half a block: groups k = 16h..16h+15 of 8; index bytes qs[k] (byte 0), nibbles of qh (byte
// 32): high index bits and shift sign; 3-bit scales per 16 and the fp16 scale in `scales` (48).
template <>
struct QuantUnit<GgmlType::IQ1_M> {
  static constexpr bool kOffsets = false;
  static constexpr int kBlockBytes = sizeof(block_iq1_m);
  static constexpr int kSub = 4;
  static constexpr int kBlocksPerUnit = 0;
  static constexpr int kUnitsPerBlock = 2;
  __device__ static void decode(const uint8_t* blk, int half, const Iq2Tables& t, Unit32 (&u)[kSub], int) {
    uint32_t qs[4], qh[2], sc[2];
    load_words<4>(blk + 16 * half, qs);
    load_words<2>(blk + 32 + 8 * half, qh);
    load_words<2>(blk + 48, sc);
    const uint32_t sw[4] = {sc[0] & 0xFFFFu, sc[0] >> 16, sc[1] & 0xFFFFu, sc[1] >> 16};
    const uint32_t bits = (sw[0] >> 12) | ((sw[1] >> 8) & 0x00F0u) | ((sw[2] >> 4) & 0x0F00u) | (sw[3] & 0xF000u);
    const float d = __half2float(__ushort_as_half(static_cast<uint16_t>(bits)));
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t h = (qh[j / 2] >> (16 * (j % 2))) & 0xFFFFu;
#pragma unroll
      for (int l = 0; l < 4; ++l) {
        const uint32_t nib = (h >> (4 * l)) & 0xF;
        const uint64_t g = __ldg(t.iq.iq1s_grid + (((qs[j] >> (8 * l)) & 0xFF) | ((nib & 7) << 8)));
        const int shift = (nib & 8) ? -1 : 1;
        u[j].q[2 * l] = iq1_bytes_to_levels(static_cast<uint32_t>(g), shift);
        u[j].q[2 * l + 1] = iq1_bytes_to_levels(static_cast<uint32_t>(g >> 32), shift);
      }
      const int ib = 4 * half + j;  // sub-blocks of 16: 2ib, 2ib + 1 in word ib / 2
      const uint32_t word = sw[ib / 2];
      u[j].a0 = d * static_cast<float>(2 * ((word >> (3 * ((2 * ib) % 4))) & 7) + 1) * 0.125f;
      u[j].a1 = d * static_cast<float>(2 * ((word >> (3 * ((2 * ib + 1) % 4))) & 7) + 1) * 0.125f;
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
