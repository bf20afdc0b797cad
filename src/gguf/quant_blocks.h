// Byte layouts of ggml's quantised blocks, identical to ggml-common.h, so that the bytes
// of a GGUF tensor can be viewed as an array of these structs. Plain structs only: the
// CUDA kernels include this header too. The half-precision fields hold IEEE fp16 bits.
#pragma once

#include <cstdint>

namespace dsv4 {

inline constexpr int QK8_0 = 32;
inline constexpr int QK_K = 256;
inline constexpr int K_SCALE_SIZE = 12;
inline constexpr int QK_MXFP4 = 32;
inline constexpr int QK4_0 = 32;  // also Q4_1, Q5_0, Q5_1 and IQ4_NL

using fp16_bits = uint16_t;

// 8-bit: x = d * qs[i].
struct block_q8_0 {
  fp16_bits d;
  int8_t qs[QK8_0];
};
static_assert(sizeof(block_q8_0) == 34);

// 2.625 bits: 16 sub-blocks of 16; 4-bit scale and 4-bit min per sub-block;
// x = d * (scales[j] & 0xF) * q - dmin * (scales[j] >> 4).
struct block_q2_K {
  uint8_t scales[QK_K / 16];
  uint8_t qs[QK_K / 4];
  fp16_bits d;
  fp16_bits dmin;
};
static_assert(sizeof(block_q2_K) == 84);

// 3.4375 bits: high bit in hmask, low 2 bits in qs, 6-bit signed scales packed in 12 bytes.
struct block_q3_K {
  uint8_t hmask[QK_K / 8];
  uint8_t qs[QK_K / 4];
  uint8_t scales[12];
  fp16_bits d;
};
static_assert(sizeof(block_q3_K) == 110);

// 4.5 bits: 8 sub-blocks of 32 with 6-bit scales and mins.
struct block_q4_K {
  fp16_bits d;
  fp16_bits dmin;
  uint8_t scales[K_SCALE_SIZE];
  uint8_t qs[QK_K / 2];
};
static_assert(sizeof(block_q4_K) == 144);

// 5.5 bits.
struct block_q5_K {
  fp16_bits d;
  fp16_bits dmin;
  uint8_t scales[K_SCALE_SIZE];
  uint8_t qh[QK_K / 8];
  uint8_t qs[QK_K / 2];
};
static_assert(sizeof(block_q5_K) == 176);

// 6.5625 bits: 16 sub-blocks of 16 with 8-bit signed scales.
struct block_q6_K {
  uint8_t ql[QK_K / 2];
  uint8_t qh[QK_K / 4];
  int8_t scales[QK_K / 16];
  fp16_bits d;
};
static_assert(sizeof(block_q6_K) == 210);

// Activation-side block used by ggml's K-quant dot products (not a file type here).
struct block_q8_K {
  float d;
  int8_t qs[QK_K];
  int16_t bsums[QK_K / 16];
};
static_assert(sizeof(block_q8_K) == 292);

// 2.0625 bits: lattice (E8) codebook; dequantise only.
struct block_iq2_xxs {
  fp16_bits d;
  uint16_t qs[QK_K / 8];
};
static_assert(sizeof(block_iq2_xxs) == 66);

// ---- 32-element blocks: one fp16 scale (and min) per block -----------------------------------
// Element j < 16 is the low nibble of qs[j], element j >= 16 the high nibble of qs[j - 16].

// 4.5 bits: x = d * (q - 8).
struct block_q4_0 {
  fp16_bits d;
  uint8_t qs[QK4_0 / 2];
};
static_assert(sizeof(block_q4_0) == 18);

// 5 bits: x = d * q + m.
struct block_q4_1 {
  fp16_bits d;
  fp16_bits m;
  uint8_t qs[QK4_0 / 2];
};
static_assert(sizeof(block_q4_1) == 20);

// 5.5 bits: the fifth bit of element j is bit j of the little-endian word qh; x = d * (q - 16).
struct block_q5_0 {
  fp16_bits d;
  uint8_t qh[4];
  uint8_t qs[QK4_0 / 2];
};
static_assert(sizeof(block_q5_0) == 22);

// 6 bits: as Q5_0 without the offset, x = d * q + m.
struct block_q5_1 {
  fp16_bits d;
  fp16_bits m;
  uint8_t qh[4];
  uint8_t qs[QK4_0 / 2];
};
static_assert(sizeof(block_q5_1) == 24);

// 4.5 bits, non-linear: x = d * kvalues_iq4nl[q].
struct block_iq4_nl {
  fp16_bits d;
  uint8_t qs[QK4_0 / 2];
};
static_assert(sizeof(block_iq4_nl) == 18);

// ---- i-quants of 256 (codebooks in iq_tables.h) ----------------------------------------------

// 4.25 bits: IQ4_NL levels with a 6-bit scale per 32 (low 4 bits in scales_l, high 2 in scales_h).
struct block_iq4_xs {
  fp16_bits d;
  uint16_t scales_h;
  uint8_t scales_l[QK_K / 64];
  uint8_t qs[QK_K / 2];
};
static_assert(sizeof(block_iq4_xs) == 136);

// 2.3125 bits: per 8 elements a 9-bit index into iq2xs_grid and a 7-bit sign index; a 4-bit
// scale per 16.
struct block_iq2_xs {
  fp16_bits d;
  uint16_t qs[QK_K / 8];
  uint8_t scales[QK_K / 32];
};
static_assert(sizeof(block_iq2_xs) == 74);

// 2.5625 bits: qs[0..31] the low 8 bits of 10-bit iq2s_grid indices, qs[32..63] one sign bit
// per element, qh the top 2 bits, a 4-bit scale per 16.
struct block_iq2_s {
  fp16_bits d;
  uint8_t qs[QK_K / 4];
  uint8_t qh[QK_K / 32];
  uint8_t scales[QK_K / 32];
};
static_assert(sizeof(block_iq2_s) == 82);

// 3.0625 bits: qs[0..63] indices into iq3xxs_grid (4 elements each), then per 32 elements one
// little-endian u32: four 7-bit sign indices and a 4-bit scale on top.
struct block_iq3_xxs {
  fp16_bits d;
  uint8_t qs[3 * QK_K / 8];
};
static_assert(sizeof(block_iq3_xxs) == 98);

// 3.4375 bits: 9-bit iq3s_grid indices (low 8 in qs, high bit in qh), one sign bit per
// element, a 4-bit scale per 32.
struct block_iq3_s {
  fp16_bits d;
  uint8_t qs[QK_K / 4];
  uint8_t qh[QK_K / 32];
  uint8_t signs[QK_K / 8];
  uint8_t scales[QK_K / 64];
};
static_assert(sizeof(block_iq3_s) == 110);

// 1.5625 bits: per 8 elements an 11-bit index into iq1s_grid (levels -1, 0, 1): low 8 bits
// in qs, high 3 in qh; each qh word (32 elements) also holds a 3-bit scale and the sign of
// the +-1/8 shift.
struct block_iq1_s {
  fp16_bits d;
  uint8_t qs[QK_K / 8];
  uint16_t qh[QK_K / 32];
};
static_assert(sizeof(block_iq1_s) == 50);

// 1.75 bits: as IQ1_S with a shift sign per 8 and a 3-bit scale per 16; the fp16 block scale
// is spread over the top nibbles of the four little-endian u16 words of `scales`.
struct block_iq1_m {
  uint8_t qs[QK_K / 8];
  uint8_t qh[QK_K / 16];
  uint8_t scales[QK_K / 32];
};
static_assert(sizeof(block_iq1_m) == 56);

// OCP microscaling FP4: one E8M0 exponent and 32 E2M1 codes. ggml's nibble order:
// qs[j] holds element j (low nibble) and element j+16 (high nibble).
struct block_mxfp4 {
  uint8_t e;
  uint8_t qs[QK_MXFP4 / 2];
};
static_assert(sizeof(block_mxfp4) == 17);

}  // namespace dsv4
