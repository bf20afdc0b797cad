// The fast CPU path (the portable version; quant_avx2.cpp has the vector one): activations quantised once per row (ggml's Q8_0 blocks of 32, or Q8_K
// super-blocks of 256 with per-16 sums), then integer products with the weights' levels.
//
// Every weight block is viewed as int8 levels q with, per 16 elements s, a float scale a_s
// and offset b_s (w = a_s*q - b_s; the fp16 super-block scales already folded in). Against
// Q8_K activations (x ~ d8*q8) a block then contributes
//     sum_s a_s*d8 * (sum_{i in s} q_i*q8_i)  -  d8 * sum_s b_s * bsum8_s
// with the inner sums exact in int32 (ggml's vec_dot_*_q8_K in the same form).
#include <cmath>
#include <cstring>

#include "gguf/iq2xxs_tables.h"
#include "gguf/quant.h"
#include "gguf/quant_decode.h"
#include "gguf/quant_internal.h"
#include "util/float_formats.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace dsv4 {
namespace {

using quant::k4_scale_min;
using quant::q3_k_scale;

// ---- integer views of the weight blocks -------------------------------------------------

struct LevelBlock {
  int8_t q[QK_K];
  float scale[QK_K / 16];   // a_s
  float offset[QK_K / 16];  // b_s
  bool has_offset;
};

void levels_of(const block_q2_K& b, LevelBlock& v) {
  const float d = fp16_to_f32(b.d), dmin = fp16_to_f32(b.dmin);
  for (int i = 0; i < QK_K; ++i) v.q[i] = static_cast<int8_t>((b.qs[(i / 128) * 32 + i % 32] >> (2 * ((i % 128) / 32))) & 3);
  for (int s = 0; s < 16; ++s) {
    v.scale[s] = d * static_cast<float>(b.scales[s] & 0xF);
    v.offset[s] = dmin * static_cast<float>(b.scales[s] >> 4);
  }
  v.has_offset = true;
}

void levels_of(const block_q3_K& b, LevelBlock& v) {
  const float d = fp16_to_f32(b.d);
  for (int i = 0; i < QK_K; ++i) {
    const int low = (b.qs[(i / 128) * 32 + i % 32] >> (2 * ((i % 128) / 32))) & 3;
    v.q[i] = static_cast<int8_t>(low - (((b.hmask[i % 32] >> (i / 32)) & 1) ? 0 : 4));
  }
  for (int s = 0; s < 16; ++s) v.scale[s] = d * static_cast<float>(q3_k_scale(b.scales, s));
  v.has_offset = false;
}

template <typename Block, bool kFifthBit>
void levels_k4(const Block& b, LevelBlock& v) {
  const float d = fp16_to_f32(b.d), dmin = fp16_to_f32(b.dmin);
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, m;
    k4_scale_min(b.scales, j, sc, m);
    for (int h = 0; h < 2; ++h) {
      v.scale[2 * j + h] = d * static_cast<float>(sc);
      v.offset[2 * j + h] = dmin * static_cast<float>(m);
    }
    for (int l = 0; l < 32; ++l) {
      int q = (b.qs[(j / 2) * 32 + l] >> (4 * (j % 2))) & 0xF;
      if constexpr (kFifthBit) q |= ((b.qh[l] >> j) & 1) << 4;
      v.q[32 * j + l] = static_cast<int8_t>(q);
    }
  }
  v.has_offset = true;
}
void levels_of(const block_q4_K& b, LevelBlock& v) { levels_k4<block_q4_K, false>(b, v); }
void levels_of(const block_q5_K& b, LevelBlock& v) { levels_k4<block_q5_K, true>(b, v); }

void levels_of(const block_q6_K& b, LevelBlock& v) {
  const float d = fp16_to_f32(b.d);
  for (int i = 0; i < QK_K; ++i) {
    const int n = i / 128, r = i % 128;
    const int low = (b.ql[n * 64 + r % 64] >> (4 * (r / 64))) & 0xF;
    const int high = (b.qh[n * 32 + r % 32] >> (2 * (r / 32))) & 3;
    v.q[i] = static_cast<int8_t>((low | (high << 4)) - 32);
  }
  for (int s = 0; s < 16; ++s) v.scale[s] = d * static_cast<float>(b.scales[s]);
  v.has_offset = false;
}

// Levels are the signed grid bytes (8, 25 or 43); the scale d*(0.5 + s)*0.25 per 32.
void levels_of(const block_iq2_xxs& b, LevelBlock& v) {
  const float d = fp16_to_f32(b.d);
  for (int g = 0; g < 8; ++g) {
    const uint32_t indices = b.qs[4 * g] | (static_cast<uint32_t>(b.qs[4 * g + 1]) << 16);
    const uint32_t signs_scale = b.qs[4 * g + 2] | (static_cast<uint32_t>(b.qs[4 * g + 3]) << 16);
    const float db = d * (0.5f + static_cast<float>(signs_scale >> 28)) * 0.25f;
    v.scale[2 * g] = v.scale[2 * g + 1] = db;
    for (int k = 0; k < 4; ++k) {
      const uint64_t grid = quant::kIq2xxsGrid[(indices >> (8 * k)) & 0xFF];
      const uint8_t signs = quant::kIq2xxsSigns[(signs_scale >> (7 * k)) & 127];
      for (int e = 0; e < 8; ++e) {
        const int mag = static_cast<int>((grid >> (8 * e)) & 0xFF);
        v.q[32 * g + 8 * k + e] = static_cast<int8_t>(((signs >> e) & 1) ? -mag : mag);
      }
    }
  }
  v.has_offset = false;
}

// The i-quants of 256 read through their levels (quant_decode.h); no offsets.
template <typename Block>
void levels_of_iq(const Block& b, LevelBlock& v) {
  quant::Levels256 l;
  quant::levels(b, quant::host_iq_tables(), l);
  std::memcpy(v.q, l.q, sizeof v.q);
  std::memcpy(v.scale, l.scale, sizeof v.scale);
  v.has_offset = false;
}
void levels_of(const block_iq4_xs& b, LevelBlock& v) { levels_of_iq(b, v); }
void levels_of(const block_iq2_xs& b, LevelBlock& v) { levels_of_iq(b, v); }
void levels_of(const block_iq2_s& b, LevelBlock& v) { levels_of_iq(b, v); }
void levels_of(const block_iq3_xxs& b, LevelBlock& v) { levels_of_iq(b, v); }
void levels_of(const block_iq3_s& b, LevelBlock& v) { levels_of_iq(b, v); }
void levels_of(const block_iq1_s& b, LevelBlock& v) { levels_of_iq(b, v); }
void levels_of(const block_iq1_m& b, LevelBlock& v) { levels_of_iq(b, v); }

// sum over 16 elements of q*q8, for each of the 16 groups of a super-block.
void group_sums(const int8_t* q, const int8_t* q8, int32_t* sums) {
#if defined(__AVX2__)
  for (int s = 0; s < 16; s += 2) {
    const __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * s)));
    const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q8 + 16 * s)));
    const __m256i c = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * s + 16)));
    const __m256i e = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q8 + 16 * s + 16)));
    // Pairwise int16 products summed to int32, then both groups reduced together.
    const __m256i p0 = _mm256_madd_epi16(a, b), p1 = _mm256_madd_epi16(c, e);
    const __m256i h = _mm256_hadd_epi32(p0, p1);       // [p0 pairs | p1 pairs] per 128-bit lane
    const __m256i h2 = _mm256_hadd_epi32(h, h);         // lane sums
    const __m128i lanes = _mm_add_epi32(_mm256_castsi256_si128(h2), _mm256_extracti128_si256(h2, 1));
    sums[s] = _mm_cvtsi128_si32(lanes);
    sums[s + 1] = _mm_extract_epi32(lanes, 1);
  }
#else
  for (int s = 0; s < 16; ++s) {
    int32_t acc = 0;
    for (int i = 0; i < 16; ++i) acc += static_cast<int32_t>(q[16 * s + i]) * q8[16 * s + i];
    sums[s] = acc;
  }
#endif
}

template <typename Block>
float dot_k_q8_K(const void* row, const block_q8_K* act, int64_t nb) {
  const Block* blocks = static_cast<const Block*>(row);
  LevelBlock v;
  int32_t sums[16];
  float total = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    levels_of(blocks[b], v);
    group_sums(v.q, act[b].qs, sums);
    float scaled = 0.0f, offsets = 0.0f;
    for (int s = 0; s < 16; ++s) {
      scaled += v.scale[s] * static_cast<float>(sums[s]);
      if (v.has_offset) offsets += v.offset[s] * static_cast<float>(act[b].bsums[s]);
    }
    total += act[b].d * (scaled - offsets);
  }
  return total;
}

// ---- Q8_0-activation types -------------------------------------------------------------------

int32_t dot32_i8(const int8_t* a, const int8_t* b) {
#if defined(__AVX2__)
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  // |x| * (y with x's sign): unsigned x signed bytes, as maddubs needs (|x| <= 127 here).
  const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x));
  const __m256i p32 = _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(p32), _mm256_extracti128_si256(p32, 1));
  s = _mm_hadd_epi32(s, s);
  s = _mm_hadd_epi32(s, s);
  return _mm_cvtsi128_si32(s);
#else
  int32_t acc = 0;
  for (int i = 0; i < 32; ++i) acc += static_cast<int32_t>(a[i]) * b[i];
  return acc;
#endif
}

float dot_q8_0_q8_0(const void* row, const block_q8_0* act, int64_t nb) {
  const block_q8_0* w = static_cast<const block_q8_0*>(row);
  float total = 0.0f;
  for (int64_t b = 0; b < nb; ++b)
    total += fp16_to_f32(w[b].d) * fp16_to_f32(act[b].d) * static_cast<float>(dot32_i8(w[b].qs, act[b].qs));
  return total;
}

// MXFP4 levels are ggml's doubled E2M1 values (|q| <= 12), scaled by 2^(e-128).
float dot_mxfp4_q8_0(const void* row, const block_q8_0* act, int64_t nb) {
  const block_mxfp4* w = static_cast<const block_mxfp4*>(row);
  float total = 0.0f;
  int8_t q[QK_MXFP4];
  for (int64_t b = 0; b < nb; ++b) {
    for (int j = 0; j < QK_MXFP4 / 2; ++j) {
      q[j] = static_cast<int8_t>(quant::mxfp4_doubled_value(w[b].qs[j] & 0xFu));
      q[j + QK_MXFP4 / 2] = static_cast<int8_t>(quant::mxfp4_doubled_value(w[b].qs[j] >> 4));
    }
    total += e8m0_to_f32_half(w[b].e) * fp16_to_f32(act[b].d) * static_cast<float>(dot32_i8(q, act[b].qs));
  }
  return total;
}

// The 32-element types against Q8_0 activations: scale*d8*sum(q*q8) - offset*d8*sum(q8).
template <typename Block>
float dot_levels32_q8_0(const void* row, const block_q8_0* act, int64_t nb) {
  const Block* w = static_cast<const Block*>(row);
  float total = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    quant::Levels32 v;
    quant::levels(w[b], quant::host_iq_tables(), v);
    int32_t sum = 0;
    for (int i = 0; i < 32; ++i) sum += act[b].qs[i];
    const float d8 = fp16_to_f32(act[b].d);
    total += d8 * (v.scale * static_cast<float>(dot32_i8(v.q, act[b].qs)) - v.offset * static_cast<float>(sum));
  }
  return total;
}

// ggml's quantize_row_q8_K_ref: scale from the signed extreme (-127/max) so the largest
// magnitude maps to +-127 exactly; per-16 sums for the K-quant offsets.
void quantize_q8_K(const float* x, block_q8_K* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += QK_K) {
    float max = 0, amax = 0;
    for (int i = 0; i < QK_K; ++i) {
      if (std::fabs(x[i]) > amax) {
        amax = std::fabs(x[i]);
        max = x[i];
      }
    }
    if (amax == 0.0f) {
      std::memset(&y[b], 0, sizeof y[b]);
      continue;
    }
    const float iscale = -127.f / max;
    for (int i = 0; i < QK_K; ++i) {
      const int v = static_cast<int>(std::nearbyint(iscale * x[i]));
      y[b].qs[i] = static_cast<int8_t>(v < 127 ? v : 127);
    }
    for (int s = 0; s < QK_K / 16; ++s) {
      int sum = 0;
      for (int i = 0; i < 16; ++i) sum += y[b].qs[16 * s + i];
      y[b].bsums[s] = static_cast<int16_t>(sum);
    }
    y[b].d = 1 / iscale;
  }
}

}  // namespace

GgmlType dot_activation_type(GgmlType weight_type) {
  switch (weight_type) {
    case GgmlType::Q8_0:
    case GgmlType::MXFP4:
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::Q5_0:
    case GgmlType::Q5_1:
    case GgmlType::IQ4_NL: return GgmlType::Q8_0;
    case GgmlType::IQ4_XS:
    case GgmlType::IQ2_XS:
    case GgmlType::IQ2_S:
    case GgmlType::IQ3_XXS:
    case GgmlType::IQ3_S:
    case GgmlType::IQ1_S:
    case GgmlType::IQ1_M:
    case GgmlType::Q2_K:
    case GgmlType::Q3_K:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
    case GgmlType::Q6_K:
    case GgmlType::IQ2_XXS: return GgmlType::Q8_K;
    default: return GgmlType::F32;
  }
}

namespace quant {

void quantize_q8_K_scalar(const float* x, block_q8_K* y, int64_t n) { quantize_q8_K(x, y, n / QK_K); }

float dot_row_quantized_scalar(GgmlType weight_type, const void* row, const void* act, int64_t n) {
  const auto* q8_0 = static_cast<const block_q8_0*>(act);
  const auto* q8_K = static_cast<const block_q8_K*>(act);
  switch (weight_type) {
    case GgmlType::Q8_0: return dot_q8_0_q8_0(row, q8_0, n / QK8_0);
    case GgmlType::MXFP4: return dot_mxfp4_q8_0(row, q8_0, n / QK_MXFP4);
    case GgmlType::Q2_K: return dot_k_q8_K<block_q2_K>(row, q8_K, n / QK_K);
    case GgmlType::Q3_K: return dot_k_q8_K<block_q3_K>(row, q8_K, n / QK_K);
    case GgmlType::Q4_K: return dot_k_q8_K<block_q4_K>(row, q8_K, n / QK_K);
    case GgmlType::Q5_K: return dot_k_q8_K<block_q5_K>(row, q8_K, n / QK_K);
    case GgmlType::Q6_K: return dot_k_q8_K<block_q6_K>(row, q8_K, n / QK_K);
    case GgmlType::IQ2_XXS: return dot_k_q8_K<block_iq2_xxs>(row, q8_K, n / QK_K);
    case GgmlType::IQ4_XS: return dot_k_q8_K<block_iq4_xs>(row, q8_K, n / QK_K);
    case GgmlType::IQ2_XS: return dot_k_q8_K<block_iq2_xs>(row, q8_K, n / QK_K);
    case GgmlType::IQ2_S: return dot_k_q8_K<block_iq2_s>(row, q8_K, n / QK_K);
    case GgmlType::IQ3_XXS: return dot_k_q8_K<block_iq3_xxs>(row, q8_K, n / QK_K);
    case GgmlType::IQ3_S: return dot_k_q8_K<block_iq3_s>(row, q8_K, n / QK_K);
    case GgmlType::IQ1_S: return dot_k_q8_K<block_iq1_s>(row, q8_K, n / QK_K);
    case GgmlType::IQ1_M: return dot_k_q8_K<block_iq1_m>(row, q8_K, n / QK_K);
    case GgmlType::Q4_0: return dot_levels32_q8_0<block_q4_0>(row, q8_0, n / QK4_0);
    case GgmlType::Q4_1: return dot_levels32_q8_0<block_q4_1>(row, q8_0, n / QK4_0);
    case GgmlType::Q5_0: return dot_levels32_q8_0<block_q5_0>(row, q8_0, n / QK4_0);
    case GgmlType::Q5_1: return dot_levels32_q8_0<block_q5_1>(row, q8_0, n / QK4_0);
    case GgmlType::IQ4_NL: return dot_levels32_q8_0<block_iq4_nl>(row, q8_0, n / QK4_0);
    default: return dot_row_f32(weight_type, row, static_cast<const float*>(act), n);
  }
}

}  // namespace quant

void quantize_activations(GgmlType act_type, const float* x, void* dst, int64_t n) {
  switch (act_type) {
    case GgmlType::Q8_0: quantize_row(GgmlType::Q8_0, x, dst, n); return;
    case GgmlType::Q8_K:
      if (!quant::quantize_q8_K_vector(x, static_cast<block_q8_K*>(dst), n))
        quant::quantize_q8_K_scalar(x, static_cast<block_q8_K*>(dst), n);
      return;
    default: std::memcpy(dst, x, static_cast<size_t>(n) * sizeof(float)); return;
  }
}

float dot_row_quantized(GgmlType weight_type, const void* row, const void* act, int64_t n) {
  float result;
  if (quant::dot_rows_quantized_vector(weight_type, row, act, 0, 1, n, &result)) return result;
  return quant::dot_row_quantized_scalar(weight_type, row, act, n);
}

void dot_rows_quantized(GgmlType weight_type, const void* row, const void* act, size_t act_stride, int64_t n_act,
                        int64_t n, float* out) {
  if (quant::dot_rows_quantized_vector(weight_type, row, act, act_stride, n_act, n, out)) return;
  for (int64_t r = 0; r < n_act; ++r)
    out[r] = quant::dot_row_quantized_scalar(weight_type, row, static_cast<const uint8_t*>(act) + r * act_stride, n);
}

}  // namespace dsv4
