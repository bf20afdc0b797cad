// Scalar conversions between f32 and the small float formats of GGUF files and of the
// official checkpoint: IEEE fp16, bfloat16, FP8 E4M3 (OCP "fn": no infinities, max 448),
// E8M0 (power-of-two scale bytes) and FP4 E2M1. Header-only and written with integer bit
// manipulation only, so the same functions run in host code and in CUDA device code.
// Every encoder rounds to nearest, ties to even; NaN stays NaN where the format has one.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DSV4_HOST_DEVICE __host__ __device__
#else
#define DSV4_HOST_DEVICE
#endif

namespace dsv4 {

DSV4_HOST_DEVICE inline uint32_t f32_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

DSV4_HOST_DEVICE inline float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// Shifts `mag` right by `shift` (>= 1) rounding to nearest, ties to even.
DSV4_HOST_DEVICE inline uint32_t shift_right_rne(uint32_t mag, int shift) {
  if (shift >= 32) return 0;  // mag < 2^24 here, so the value is below one half
  const uint32_t kept = mag >> shift;
  const uint32_t rest = mag & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  return kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
}

// ---- IEEE binary16 ----------------------------------------------------------------------

DSV4_HOST_DEVICE inline float fp16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0x1F) return f32_from_bits(sign | 0x7F800000u | (man << 13));  // inf, NaN payload kept
  if (exp != 0) return f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
  if (man == 0) return f32_from_bits(sign);
  // Subnormal: normalise the mantissa.
  int e = 113;
  while ((man & 0x400u) == 0) {
    man <<= 1;
    --e;
  }
  return f32_from_bits(sign | (static_cast<uint32_t>(e) << 23) | ((man & 0x3FFu) << 13));
}

DSV4_HOST_DEVICE inline uint16_t f32_to_fp16(float f) {
  const uint32_t u = f32_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));  // quiet NaN
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds past 65504: inf
  const int exp = static_cast<int>(a >> 23);
  if (exp >= 113) {  // normal fp16: drop 13 mantissa bits (a carry may step the exponent)
    const uint32_t rebased = a - (112u << 23);
    return static_cast<uint16_t>(sign | shift_right_rne(rebased, 13));
  }
  if (exp == 0) return sign;  // f32 subnormals are far below fp16's smallest subnormal
  // fp16 subnormal: value = mant * 2^(exp-150), in units of 2^-24.
  const uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
  return static_cast<uint16_t>(sign | shift_right_rne(mant, 126 - exp));
}

// ---- bfloat16 -----------------------------------------------------------------------------

DSV4_HOST_DEVICE inline float bf16_to_f32(uint16_t b) { return f32_from_bits(static_cast<uint32_t>(b) << 16); }

// Same as ggml_compute_fp32_to_bf16: NaN is forced quiet, everything else rounds to even.
DSV4_HOST_DEVICE inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_to_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 64u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// ---- FP8 E4M3 (OCP e4m3fn) ------------------------------------------------------------------
// 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal (m/8 * 2^-6);
// S.1111.111 is NaN; no infinities; largest finite 448.

inline constexpr float kE4M3Max = 448.0f;

DSV4_HOST_DEVICE inline float e4m3_to_f32(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t exp = (c >> 3) & 0xFu;
  const uint32_t man = c & 0x7u;
  if (exp == 0xF && man == 0x7) return f32_from_bits(sign | 0x7FC00000u);
  if (exp == 0) {
    const float mag = static_cast<float>(man) * 0.001953125f;  // m * 2^-9, exact
    return sign ? -mag : mag;
  }
  return f32_from_bits(sign | ((exp + 120u) << 23) | (man << 20));
}

// Round to nearest even; magnitudes beyond 448 (including infinities) saturate to 448.
DSV4_HOST_DEVICE inline uint8_t f32_to_e4m3(float f) {
  const uint32_t u = f32_to_bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint8_t>(sign | 0x7Fu);
  const int exp = static_cast<int>(a >> 23);
  if (exp >= 136) return static_cast<uint8_t>(sign | 0x7Eu);  // >= 512
  if (exp >= 121) {  // normal e4m3 (>= 2^-6): keep 3 mantissa bits
    const uint32_t code = shift_right_rne(a - (120u << 23), 20);
    return static_cast<uint8_t>(sign | (code > 0x7Eu ? 0x7Eu : code));
  }
  if (exp == 0) return sign;
  // Subnormal e4m3: count units of 2^-9; a result of 8 is the smallest normal, code 0x08.
  const uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
  return static_cast<uint8_t>(sign | shift_right_rne(mant, 141 - exp));
}

// ---- E8M0 (exponent-only scale byte) ----------------------------------------------------------

// 2^(b-127); b = 0 is the f32 subnormal 2^-127; b = 255 is NaN.
DSV4_HOST_DEVICE inline float e8m0_to_f32(uint8_t b) {
  if (b == 0xFF) return f32_from_bits(0x7FC00000u);
  if (b == 0) return f32_from_bits(0x00400000u);
  return f32_from_bits(static_cast<uint32_t>(b) << 23);
}

// ggml's MXFP4 scale, 2^(b-128) for every byte (255 gives 2^127, not NaN): ggml stores
// the E2M1 grid doubled (kvalues_mxfp4), so it halves the scale instead.
DSV4_HOST_DEVICE inline float e8m0_to_f32_half(uint8_t b) {
  const uint32_t bits = b < 2 ? (0x00200000u << b) : (static_cast<uint32_t>(b - 1) << 23);
  return f32_from_bits(bits);
}

// ---- FP4 E2M1 ------------------------------------------------------------------------------------
// Nibble: bit 3 sign, bits 0-2 index the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}.

DSV4_HOST_DEVICE inline float e2m1_to_f32(uint8_t code) {
  const uint32_t mag = code & 0x7u;
  // Twice the magnitude is {0,1,2,3,4,6,8,12}: (2 or 3) << (mag/2 - 1) from code 4 on.
  const uint32_t twice = mag < 4 ? mag : (2u + (mag & 1u)) << ((mag >> 1) - 1u);
  const float v = static_cast<float>(twice) * 0.5f;
  return (code & 0x8u) ? -v : v;
}

// Round to nearest, ties to the even code (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
// 3.5->4, 5->4); magnitudes above 6 saturate to 6; NaN encodes as +0 (E2M1 has no NaN, so
// callers that can see NaN must check first).
DSV4_HOST_DEVICE inline uint8_t f32_to_e2m1(float f) {
  const uint32_t u = f32_to_bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 28) & 0x8u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0;
  const float m = f32_from_bits(a);
  uint8_t code;
  // Midpoints between neighbouring magnitudes; at a midpoint the even code wins.
  if (m <= 0.25f) code = 0;
  else if (m < 0.75f) code = 1;
  else if (m <= 1.25f) code = 2;
  else if (m < 1.75f) code = 3;
  else if (m <= 2.5f) code = 4;
  else if (m < 3.5f) code = 5;
  else if (m <= 5.0f) code = 6;
  else code = 7;
  return static_cast<uint8_t>(sign | code);
}

}  // namespace dsv4
