// Decoding one quantised block into floats: the one definition of what each block's bytes
// mean. Header-only and free of host-only calls so the CUDA kernels use the same code
// (DSV4_HOST_DEVICE). Every value is produced by exactly the f32 operations ggml and the
// `gguf` Python package use (for example (d*sc)*q - (dmin*m) with two roundings, never a
// fused multiply-add), so dequantisation is bit-identical to gguf.quants.dequantize.
#pragma once

#include <cstdint>

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

}  // namespace dsv4::quant
