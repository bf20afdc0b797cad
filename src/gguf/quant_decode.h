// Decoding one quantised block into floats: the one definition of what each block's bytes
// mean. Header-only and free of host-only calls so the CUDA kernels use the same code
// (DSV4_HOST_DEVICE). Every value is produced by exactly the f32 operations ggml and the
// `gguf` Python package use (for example (d*sc)*q - (dmin*m) with two roundings, never a
// fused multiply-add), so dequantisation is bit-identical to gguf.quants.dequantize.
#pragma once

#include <cstdint>
#include <type_traits>

#include "gguf/quant_blocks.h"
#include "util/float_formats.h"

namespace dsv4::quant {

// a*b rounded to f32 before any later addition: stops the compiler from contracting
// `a*b - c` into an FMA, which would change the last bit.
DSV4_HOST_DEVICE inline float mul_unfused(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  float p = a * b;
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+x"(p));
#elif defined(__aarch64__)
  asm("" : "+w"(p));
#endif
  return p;
#endif
}

// ggml's kvalues_mxfp4: the E2M1 grid doubled, {0,1,2,3,4,6,8,12} with bit 3 the sign.
DSV4_HOST_DEVICE inline int mxfp4_doubled_value(uint32_t code) {
  const uint32_t mag = code & 7u;
  const int v = mag < 4 ? static_cast<int>(mag) : static_cast<int>((2u + (mag & 1u)) << ((mag >> 1) - 1u));
  return (code & 8u) ? -v : v;
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K block.
DSV4_HOST_DEVICE inline void k4_scale_min(const uint8_t* scales, int j, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = scales[j] & 63;
    m = scales[j + 4] & 63;
  } else {
    sc = static_cast<uint8_t>((scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4));
    m = static_cast<uint8_t>((scales[j + 4] >> 4) | ((scales[j] >> 6) << 4));
  }
}

// The signed 6-bit scale of sub-block j (0..15) of a Q3_K block, in [-32, 31].
DSV4_HOST_DEVICE inline int q3_k_scale(const uint8_t* scales, int j) {
  const int low = j < 8 ? (scales[j] & 0xF) : (scales[j - 8] >> 4);
  const int high = (scales[8 + (j % 4)] >> (2 * (j / 4))) & 3;
  return (low | (high << 4)) - 32;
}

DSV4_HOST_DEVICE inline void decode_block(const block_q8_0& b, float* out) {
  const float d = fp16_to_f32(b.d);
  for (int i = 0; i < QK8_0; ++i) out[i] = static_cast<float>(b.qs[i]) * d;
}

DSV4_HOST_DEVICE inline void decode_block(const block_mxfp4& b, float* out) {
  const float d = e8m0_to_f32_half(b.e);
  for (int j = 0; j < QK_MXFP4 / 2; ++j) {
    out[j] = static_cast<float>(mxfp4_doubled_value(b.qs[j] & 0xFu)) * d;
    out[j + QK_MXFP4 / 2] = static_cast<float>(mxfp4_doubled_value(b.qs[j] >> 4)) * d;
  }
}

// Element n*128 + s*32 + l takes bits 2s..2s+1 of qs[n*32 + l]; sub-blocks of 16.
DSV4_HOST_DEVICE inline void decode_block(const block_q2_K& b, float* out) {
  const float d = fp16_to_f32(b.d);
  const float dmin = fp16_to_f32(b.dmin);
  for (int i = 0; i < QK_K; ++i) {
    const int n = i / 128, s = (i % 128) / 32, l = i % 32;
    const uint8_t sc = b.scales[i / 16];
    const float dl = d * static_cast<float>(sc & 0xF);
    const float ml = dmin * static_cast<float>(sc >> 4);
    const int q = (b.qs[n * 32 + l] >> (2 * s)) & 3;
    out[i] = mul_unfused(dl, static_cast<float>(q)) - ml;
  }
}

// Low two bits as in Q2_K; the third bit is bit (i/32) of hmask[i%32], and a CLEAR bit
// subtracts 4.
DSV4_HOST_DEVICE inline void decode_block(const block_q3_K& b, float* out) {
  const float d = fp16_to_f32(b.d);
  for (int i = 0; i < QK_K; ++i) {
    const int n = i / 128, s = (i % 128) / 32, l = i % 32;
    const float dl = d * static_cast<float>(q3_k_scale(b.scales, i / 16));
    const int low = (b.qs[n * 32 + l] >> (2 * s)) & 3;
    const int high_clear = ((b.hmask[l] >> (i / 32)) & 1) ? 0 : 4;
    out[i] = dl * static_cast<float>(low - high_clear);
  }
}

// Sub-block j (32 elements) uses nibble j%2 of qs[(j/2)*32 + l].
DSV4_HOST_DEVICE inline void decode_block(const block_q4_K& b, float* out) {
  const float d = fp16_to_f32(b.d);
  const float dmin = fp16_to_f32(b.dmin);
  for (int j = 0; j < QK_K / 32; ++j) {
    uint8_t sc, m;
    k4_scale_min(b.scales, j, sc, m);
    const float dl = d * static_cast<float>(sc);
    const float ml = dmin * static_cast<float>(m);
    for (int l = 0; l < 32; ++l) {
      const int q = (b.qs[(j / 2) * 32 + l] >> (4 * (j % 2))) & 0xF;
      out[j * 32 + l] = mul_unfused(dl, static_cast<float>(q)) - ml;
    }
  }
}

// As Q4_K plus a fifth bit: bit j of qh[l].
DSV4_HOST_DEVICE inline void decode_block(const block_q5_K& b, float* out) {
  const float d = fp16_to_f32(b.d);
  const float dmin = fp16_to_f32(b.dmin);
  for (int j = 0; j < QK_K / 32; ++j) {
    uint8_t sc, m;
    k4_scale_min(b.scales, j, sc, m);
    const float dl = d * static_cast<float>(sc);
    const float ml = dmin * static_cast<float>(m);
    for (int l = 0; l < 32; ++l) {
      const int q = ((b.qs[(j / 2) * 32 + l] >> (4 * (j % 2))) & 0xF) | (((b.qh[l] >> j) & 1) << 4);
      out[j * 32 + l] = mul_unfused(dl, static_cast<float>(q)) - ml;
    }
  }
}

// Element n*128 + r: low nibble (r/64) of ql[n*64 + r%64], high bits 2*(r/32) of
// qh[n*32 + r%32]; q - 32 times the int8 scale of its 16-element sub-block.
DSV4_HOST_DEVICE inline void decode_block(const block_q6_K& b, float* out) {
  const float d = fp16_to_f32(b.d);
  for (int i = 0; i < QK_K; ++i) {
    const int n = i / 128, r = i % 128;
    const int low = (b.ql[n * 64 + r % 64] >> (4 * (r / 64))) & 0xF;
    const int high = (b.qh[n * 32 + r % 32] >> (2 * (r / 32))) & 3;
    const float dl = d * static_cast<float>(b.scales[i / 16]);
    out[i] = dl * static_cast<float>((low | (high << 4)) - 32);
  }
}

// 8 groups of 32: two little-endian u32 per group; the first holds four 8-bit indices into
// the 256-entry E8-lattice grid (8 bytes of magnitudes each), the second four 7-bit sign
// indices (bit 7 of each sign byte is the parity) and a 4-bit scale in its top bits.
// `grid` and `ksigns` are ggml's iq2xxs_grid and ksigns_iq2xs (gguf/iq2xxs_tables.h); they
// are parameters so device code can pass its own copy in constant memory.
DSV4_HOST_DEVICE inline void decode_block(const block_iq2_xxs& b, float* out, const uint64_t* grid,
                                          const uint8_t* ksigns) {
  const float d = fp16_to_f32(b.d);
  for (int g = 0; g < QK_K / 32; ++g) {
    const uint32_t indices = b.qs[4 * g] | (static_cast<uint32_t>(b.qs[4 * g + 1]) << 16);
    const uint32_t signs_scale = b.qs[4 * g + 2] | (static_cast<uint32_t>(b.qs[4 * g + 3]) << 16);
    const float db = d * (0.5f + static_cast<float>(signs_scale >> 28)) * 0.25f;
    for (int k = 0; k < 4; ++k) {
      const uint64_t magnitudes = grid[(indices >> (8 * k)) & 0xFF];
      const uint8_t signs = ksigns[(signs_scale >> (7 * k)) & 127];
      for (int e = 0; e < 8; ++e) {
        const float v = db * static_cast<float>((magnitudes >> (8 * e)) & 0xFF);
        out[g * 32 + k * 8 + e] = ((signs >> e) & 1) ? -v : v;
      }
    }
  }
}

// ---- the types read through integer levels ----------------------------------------------------
// Every block below is defined by its int8 levels q and, per 16 elements (per block for the
// 32-element types), a float scale and offset: x = scale*q - offset, the product rounded on
// its own. These are exactly the f32 operations of gguf.quants.dequantize (an IQ1 level is
// 8*(grid + shift) with scale dl/8: both scalings by 8 are exact), so the float decoder, the
// vector decoder and the integer dot products all read the same levels.

// The codebooks the i-quants need (iq_tables.h on the host; device code passes its own copies).
struct IqTables {
  const uint64_t* iq2xs_grid;   // 512
  const uint64_t* iq2s_grid;    // 1024
  const uint32_t* iq3xxs_grid;  // 256
  const uint32_t* iq3s_grid;    // 512
  const uint64_t* iq1s_grid;    // 2048, signed bytes
  const int8_t* iq4nl_values;   // 16
  const uint8_t* ksigns;        // 128 (ksigns_iq2xs)
};

// 32-element blocks: levels and one (scale, offset).
struct Levels32 {
  int8_t q[32];
  float scale;
  float offset;  // 0 except Q4_1 / Q5_1 (-m)
};

// The 256-element i-quants: levels and a scale per 16 (no offsets).
struct Levels256 {
  int8_t q[QK_K];
  float scale[QK_K / 16];
};

// Nibble j of a 32-element block: the low nibbles of qs[0..15] are elements 0..15.
DSV4_HOST_DEVICE inline int nibble32(const uint8_t* qs, int j) { return j < 16 ? qs[j] & 0xF : qs[j - 16] >> 4; }
DSV4_HOST_DEVICE inline uint32_t le32(const uint8_t* p) {
  return p[0] | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

DSV4_HOST_DEVICE inline void levels(const block_q4_0& b, const IqTables&, Levels32& v) {
  for (int j = 0; j < 32; ++j) v.q[j] = static_cast<int8_t>(nibble32(b.qs, j) - 8);
  v.scale = fp16_to_f32(b.d);
  v.offset = 0.0f;
}

DSV4_HOST_DEVICE inline void levels(const block_q4_1& b, const IqTables&, Levels32& v) {
  for (int j = 0; j < 32; ++j) v.q[j] = static_cast<int8_t>(nibble32(b.qs, j));
  v.scale = fp16_to_f32(b.d);
  v.offset = -fp16_to_f32(b.m);
}

DSV4_HOST_DEVICE inline void levels(const block_q5_0& b, const IqTables&, Levels32& v) {
  const uint32_t qh = le32(b.qh);
  for (int j = 0; j < 32; ++j) v.q[j] = static_cast<int8_t>((nibble32(b.qs, j) | (((qh >> j) & 1) << 4)) - 16);
  v.scale = fp16_to_f32(b.d);
  v.offset = 0.0f;
}

DSV4_HOST_DEVICE inline void levels(const block_q5_1& b, const IqTables&, Levels32& v) {
  const uint32_t qh = le32(b.qh);
  for (int j = 0; j < 32; ++j) v.q[j] = static_cast<int8_t>(nibble32(b.qs, j) | (((qh >> j) & 1) << 4));
  v.scale = fp16_to_f32(b.d);
  v.offset = -fp16_to_f32(b.m);
}

DSV4_HOST_DEVICE inline void levels(const block_iq4_nl& b, const IqTables& t, Levels32& v) {
  for (int j = 0; j < 32; ++j) v.q[j] = t.iq4nl_values[nibble32(b.qs, j)];
  v.scale = fp16_to_f32(b.d);
  v.offset = 0.0f;
}

// Sub-block j (32 elements): 6-bit scale ls (nibble j%2 of scales_l[j/2], bits 2j of
// scales_h on top), scale d*(ls - 32); IQ4_NL levels, low nibbles first.
DSV4_HOST_DEVICE inline void levels(const block_iq4_xs& b, const IqTables& t, Levels256& v) {
  const float d = fp16_to_f32(b.d);
  for (int j = 0; j < QK_K / 32; ++j) {
    const int ls = ((b.scales_l[j / 2] >> (4 * (j % 2))) & 0xF) | (((b.scales_h >> (2 * j)) & 3) << 4);
    v.scale[2 * j] = v.scale[2 * j + 1] = d * static_cast<float>(ls - 32);
    for (int l = 0; l < 16; ++l) {
      v.q[32 * j + l] = t.iq4nl_values[b.qs[16 * j + l] & 0xF];
      v.q[32 * j + 16 + l] = t.iq4nl_values[b.qs[16 * j + l] >> 4];
    }
  }
}

// 8 grid bytes with the sign bits of `signs` (bit e negates element e).
DSV4_HOST_DEVICE inline void signed_grid8(uint64_t grid, uint32_t signs, int8_t* q) {
  for (int e = 0; e < 8; ++e) {
    const int mag = static_cast<int>((grid >> (8 * e)) & 0xFF);
    q[e] = static_cast<int8_t>(((signs >> e) & 1) ? -mag : mag);
  }
}

// The scale d*(0.5 + s)*0.25 of a 4-bit IQ2 scale s.
DSV4_HOST_DEVICE inline float iq2_scale(float d, int s) { return d * (0.5f + static_cast<float>(s)) * 0.25f; }

// Group g of 8: 9-bit grid index and 7-bit sign index in qs[g]; scale of 16-element
// sub-block s in nibble s%2 of scales[s/2].
DSV4_HOST_DEVICE inline void levels(const block_iq2_xs& b, const IqTables& t, Levels256& v) {
  const float d = fp16_to_f32(b.d);
  for (int s = 0; s < QK_K / 16; ++s) v.scale[s] = iq2_scale(d, (b.scales[s / 2] >> (4 * (s % 2))) & 0xF);
  for (int g = 0; g < QK_K / 8; ++g)
    signed_grid8(t.iq2xs_grid[b.qs[g] & 511], t.ksigns[b.qs[g] >> 9], v.q + 8 * g);
}

// Group g of 8: 10-bit grid index (qs[g], 2 bits of qh[g/4]), sign bits in qs[32 + g].
DSV4_HOST_DEVICE inline void levels(const block_iq2_s& b, const IqTables& t, Levels256& v) {
  const float d = fp16_to_f32(b.d);
  for (int s = 0; s < QK_K / 16; ++s) v.scale[s] = iq2_scale(d, (b.scales[s / 2] >> (4 * (s % 2))) & 0xF);
  for (int g = 0; g < QK_K / 8; ++g) {
    const int index = b.qs[g] | (((b.qh[g / 4] >> (2 * (g % 4))) & 3) << 8);
    signed_grid8(t.iq2s_grid[index], b.qs[QK_K / 8 + g], v.q + 8 * g);
  }
}

// Sub-block ib (32): grid indices qs[8ib..8ib+7] (4 elements each), then the u32 at
// qs[64 + 4ib]: four 7-bit sign indices (one per 8) and the scale d*(0.5 + s)*0.5 on top.
DSV4_HOST_DEVICE inline void levels(const block_iq3_xxs& b, const IqTables& t, Levels256& v) {
  const float d = fp16_to_f32(b.d);
  for (int ib = 0; ib < QK_K / 32; ++ib) {
    const uint32_t aux = le32(b.qs + QK_K / 4 + 4 * ib);
    v.scale[2 * ib] = v.scale[2 * ib + 1] = d * (0.5f + static_cast<float>(aux >> 28)) * 0.5f;
    for (int l = 0; l < 4; ++l) {
      const uint64_t grid = t.iq3xxs_grid[b.qs[8 * ib + 2 * l]] |
                            (static_cast<uint64_t>(t.iq3xxs_grid[b.qs[8 * ib + 2 * l + 1]]) << 32);
      signed_grid8(grid, t.ksigns[(aux >> (7 * l)) & 127], v.q + 32 * ib + 8 * l);
    }
  }
}

// Entry e (4 elements): 9-bit grid index (qs[e], bit e%8 of qh[e/8]); element i negated by
// bit i%8 of signs[i/8]; scale d*(1 + 2s) per 32 with s in nibble ib%2 of scales[ib/2].
DSV4_HOST_DEVICE inline void levels(const block_iq3_s& b, const IqTables& t, Levels256& v) {
  const float d = fp16_to_f32(b.d);
  for (int ib = 0; ib < QK_K / 32; ++ib)
    v.scale[2 * ib] = v.scale[2 * ib + 1] = d * static_cast<float>(1 + 2 * ((b.scales[ib / 2] >> (4 * (ib % 2))) & 0xF));
  for (int g = 0; g < QK_K / 8; ++g) {
    auto index = [&](int e) { return b.qs[e] | (((b.qh[e / 8] >> (e % 8)) & 1) << 8); };
    const uint64_t grid = t.iq3s_grid[index(2 * g)] | (static_cast<uint64_t>(t.iq3s_grid[index(2 * g + 1)]) << 32);
    signed_grid8(grid, b.signs[g], v.q + 8 * g);
  }
}

// 8 ternary grid levels g with the shift +-1/8 as levels 8g +- 1.
DSV4_HOST_DEVICE inline void iq1_grid8(uint64_t grid, int shift, int8_t* q) {
  for (int e = 0; e < 8; ++e) q[e] = static_cast<int8_t>(8 * static_cast<int8_t>((grid >> (8 * e)) & 0xFF) + shift);
}

// Sub-block ib (32): word qh[ib] holds the high 3 bits of four 11-bit grid indices (bits
// 3l..3l+2), the scale d*(2s + 1) (bits 12-14) and the shift sign (bit 15: -1/8).
DSV4_HOST_DEVICE inline void levels(const block_iq1_s& b, const IqTables& t, Levels256& v) {
  const float d = fp16_to_f32(b.d);
  for (int ib = 0; ib < QK_K / 32; ++ib) {
    const uint32_t w = b.qh[ib];
    const float dl = d * static_cast<float>(2 * ((w >> 12) & 7) + 1);
    v.scale[2 * ib] = v.scale[2 * ib + 1] = dl * 0.125f;
    const int shift = (w & 0x8000) ? -1 : 1;
    for (int l = 0; l < 4; ++l)
      iq1_grid8(t.iq1s_grid[b.qs[4 * ib + l] | (((w >> (3 * l)) & 7) << 8)], shift, v.q + 32 * ib + 8 * l);
  }
}

// The fp16 scale is the top nibbles of the four u16 words of `scales` (word 0 lowest).
DSV4_HOST_DEVICE inline uint16_t iq1_m_scale_bits(const block_iq1_m& b) {
  uint16_t w[4];
  for (int k = 0; k < 4; ++k) w[k] = static_cast<uint16_t>(b.scales[2 * k] | (b.scales[2 * k + 1] << 8));
  return static_cast<uint16_t>((w[0] >> 12) | ((w[1] >> 8) & 0x00F0) | ((w[2] >> 4) & 0x0F00) | (w[3] & 0xF000));
}

// Group k of 8: 11-bit grid index (qs[k], bits 0-2 of nibble k%2 of qh[k/2]), shift sign in
// bit 3 of that nibble; 3-bit scale of 16-element sub-block s at bit 3*(s%4) of word s/4.
DSV4_HOST_DEVICE inline void levels(const block_iq1_m& b, const IqTables& t, Levels256& v) {
  const float d = fp16_to_f32(iq1_m_scale_bits(b));
  for (int s = 0; s < QK_K / 16; ++s) {
    const uint32_t word = b.scales[2 * (s / 4)] | (static_cast<uint32_t>(b.scales[2 * (s / 4) + 1]) << 8);
    const float dl = d * static_cast<float>(2 * ((word >> (3 * (s % 4))) & 7) + 1);
    v.scale[s] = dl * 0.125f;
  }
  for (int k = 0; k < QK_K / 8; ++k) {
    const int nib = (b.qh[k / 2] >> (4 * (k % 2))) & 0xF;
    iq1_grid8(t.iq1s_grid[b.qs[k] | ((nib & 7) << 8)], (nib & 8) ? -1 : 1, v.q + 8 * k);
  }
}

// Which level form a block type has: the 32-element blocks one scale, the i-quants 16.
template <typename Block> inline constexpr bool kLevels32 = false;
template <> inline constexpr bool kLevels32<block_q4_0> = true;
template <> inline constexpr bool kLevels32<block_q4_1> = true;
template <> inline constexpr bool kLevels32<block_q5_0> = true;
template <> inline constexpr bool kLevels32<block_q5_1> = true;
template <> inline constexpr bool kLevels32<block_iq4_nl> = true;
template <typename Block>
using LevelsOf = std::conditional_t<kLevels32<Block>, Levels32, Levels256>;

DSV4_HOST_DEVICE inline void emit_levels(const Levels32& v, float* out) {
  for (int j = 0; j < 32; ++j) out[j] = mul_unfused(v.scale, static_cast<float>(v.q[j])) - v.offset;
}
DSV4_HOST_DEVICE inline void emit_levels(const Levels256& v, float* out) {
  for (int i = 0; i < QK_K; ++i) out[i] = v.scale[i / 16] * static_cast<float>(v.q[i]);
}

// Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL (32 elements) and IQ4_XS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S,
// IQ1_S, IQ1_M (256).
template <typename Block>
DSV4_HOST_DEVICE inline void decode_block(const Block& b, float* out, const IqTables& t) {
  LevelsOf<Block> v;
  levels(b, t, v);
  emit_levels(v, out);
}

}  // namespace dsv4::quant
