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

// OCP microscaling FP4: one E8M0 exponent and 32 E2M1 codes. ggml's nibble order:
// qs[j] holds element j (low nibble) and element j+16 (high nibble).
struct block_mxfp4 {
  uint8_t e;
  uint8_t qs[QK_MXFP4 / 2];
};
static_assert(sizeof(block_mxfp4) == 17);

}  // namespace dsv4
