// AVX2 block decoders and f32 dot products. Each decoder produces exactly the floats of
// quant_decode.h (same f32 operations, products kept unfused) one block at a time; the dot
// product decodes a block into a stack buffer and accumulates x*w with FMAs in f32.
// Without AVX2 every entry point answers false and quant.cpp's scalar reference runs.
#include <cmath>
#include <cstring>
#include <type_traits>

#include "gguf/iq2xxs_tables.h"
#include "gguf/quant_decode.h"
#include "gguf/quant_internal.h"
#include "util/float_formats.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define DSV4_QUANT_AVX2 1
#endif

namespace dsv4::quant {

#if defined(DSV4_QUANT_AVX2)
namespace {

// The quantised bytes of a block are loaded up front rather than at a loop-dependent
// offset: GCC 12 at -O3 rewrote such loads into a null-based address and then deleted the
// whole decoder as unreachable (an -fdelete-null-pointer-checks miscompile).

// Forces a product to be rounded on its own (see mul_unfused in quant_decode.h).
inline __m256 mul_unfused_ps(__m256 a, __m256 b) {
  __m256 p = _mm256_mul_ps(a, b);
  asm("" : "+x"(p));
  return p;
}

// 8 signed bytes of `v`'s low 64 bits as floats.
inline __m256 i8x8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

// Writes 16 int8 levels as floats: out = scale*q - offset (without kOffset: scale*q).
template <bool kOffset>
inline void emit16(__m128i q, float scale, float offset, float* out) {
  const __m256 s = _mm256_set1_ps(scale);
  const __m256 lo = i8x8_to_ps(q);
  const __m256 hi = i8x8_to_ps(_mm_srli_si128(q, 8));
  if constexpr (kOffset) {
    const __m256 o = _mm256_set1_ps(offset);
    _mm256_storeu_ps(out, _mm256_sub_ps(mul_unfused_ps(s, lo), o));
    _mm256_storeu_ps(out + 8, _mm256_sub_ps(mul_unfused_ps(s, hi), o));
  } else {
    _mm256_storeu_ps(out, _mm256_mul_ps(s, lo));
    _mm256_storeu_ps(out + 8, _mm256_mul_ps(s, hi));
  }
}

// 32 levels: the first 16 with (scale0, offset0), the last 16 with (scale1, offset1).
template <bool kOffset>
inline void emit32(__m256i q, float scale0, float offset0, float scale1, float offset1, float* out) {
  emit16<kOffset>(_mm256_castsi256_si128(q), scale0, offset0, out);
  emit16<kOffset>(_mm256_extracti128_si256(q, 1), scale1, offset1, out + 16);
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
// Bits [shift, shift + width) of every byte; the shift count is a register operand because
// it is a loop variable.
inline __m256i bits_at(__m256i v, int shift, int mask) {
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(static_cast<char>(mask)));
}

// The 32-element decoders are forced inline: a call per 32 elements would cost as much as
// the work.
[[gnu::always_inline]] inline void decode(const block_q8_0& b, float* out) {
  const __m256 d = _mm256_set1_ps(fp16_to_f32(b.d));
  for (int k = 0; k < 4; ++k) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.qs + 8 * k));
    _mm256_storeu_ps(out + 8 * k, _mm256_mul_ps(i8x8_to_ps(q), d));
  }
}

[[gnu::always_inline]] inline void decode(const block_mxfp4& b, float* out) {
  const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs));
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(codes, nibble));
  const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(codes, 4), nibble));
  const __m256 d = _mm256_set1_ps(e8m0_to_f32_half(b.e));
  _mm256_storeu_ps(out + 0, _mm256_mul_ps(i8x8_to_ps(lo), d));
  _mm256_storeu_ps(out + 8, _mm256_mul_ps(i8x8_to_ps(_mm_srli_si128(lo, 8)), d));
  _mm256_storeu_ps(out + 16, _mm256_mul_ps(i8x8_to_ps(hi), d));
  _mm256_storeu_ps(out + 24, _mm256_mul_ps(i8x8_to_ps(_mm_srli_si128(hi, 8)), d));
}

// ---- K-quant levels --------------------------------------------------------------------------
// Each K-quant block is produced as 8 chunks of 32 int8 levels (all K-quant levels fit in a
// signed byte) with, per 16 elements, the scale and offset of w = scale*q - offset. The same
// walk feeds the float decoder and the integer dot product.
//   sink(chunk, q, scale0, offset0, scale1, offset1)

template <typename Sink>
[[gnu::always_inline]] inline void levels(const block_q2_K& b, Sink&& sink) {
  const float d = fp16_to_f32(b.d), dmin = fp16_to_f32(b.dmin);
  const __m256i qs[2] = {load32(b.qs), load32(b.qs + 32)};
  for (int n = 0; n < 2; ++n)
    for (int s = 0; s < 4; ++s) {
      const int sb = n * 8 + s * 2;
      const uint8_t sc0 = b.scales[sb], sc1 = b.scales[sb + 1];
      sink(n * 4 + s, bits_at(qs[n], 2 * s, 3), d * static_cast<float>(sc0 & 0xF), dmin * static_cast<float>(sc0 >> 4),
           d * static_cast<float>(sc1 & 0xF), dmin * static_cast<float>(sc1 >> 4));
    }
}

template <typename Sink>
[[gnu::always_inline]] inline void levels(const block_q3_K& b, Sink&& sink) {
  const float d = fp16_to_f32(b.d);
  const __m256i hmask = load32(b.hmask);
  const __m256i four = _mm256_set1_epi8(4);
  const __m256i qs[2] = {load32(b.qs), load32(b.qs + 32)};
  for (int n = 0; n < 2; ++n)
    for (int s = 0; s < 4; ++s) {
      const int chunk = n * 4 + s;  // i / 32, also the hmask bit
      // low + 4*high - 4, in [-4, 3]
      const __m256i high4 = _mm256_slli_epi16(bits_at(hmask, chunk, 1), 2);
      const __m256i q = _mm256_sub_epi8(_mm256_or_si256(bits_at(qs[n], 2 * s, 3), high4), four);
      sink(chunk, q, d * static_cast<float>(q3_k_scale(b.scales, 2 * chunk)), 0.0f,
           d * static_cast<float>(q3_k_scale(b.scales, 2 * chunk + 1)), 0.0f);
    }
}

template <typename Block, bool kFifthBit, typename Sink>
[[gnu::always_inline]] inline void levels_k4(const Block& b, Sink&& sink) {
  const float d = fp16_to_f32(b.d), dmin = fp16_to_f32(b.dmin);
  __m256i qh = _mm256_setzero_si256();
  if constexpr (kFifthBit) qh = load32(b.qh);
  const __m256i qs[4] = {load32(b.qs), load32(b.qs + 32), load32(b.qs + 64), load32(b.qs + 96)};
  for (int n = 0; n < 4; ++n)
    for (int half = 0; half < 2; ++half) {
      const int j = 2 * n + half;
      __m256i q = bits_at(qs[n], 4 * half, 0xF);
      if constexpr (kFifthBit) q = _mm256_or_si256(q, _mm256_slli_epi16(bits_at(qh, j, 1), 4));
      uint8_t sc, m;
      k4_scale_min(b.scales, j, sc, m);
      const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(m);
      sink(j, q, dl, ml, dl, ml);
    }
}
template <typename Sink>
[[gnu::always_inline]] inline void levels(const block_q4_K& b, Sink&& sink) { levels_k4<block_q4_K, false>(b, sink); }
template <typename Sink>
[[gnu::always_inline]] inline void levels(const block_q5_K& b, Sink&& sink) { levels_k4<block_q5_K, true>(b, sink); }

template <typename Sink>
[[gnu::always_inline]] inline void levels(const block_q6_K& b, Sink&& sink) {
  const float d = fp16_to_f32(b.d);
  const __m256i bias = _mm256_set1_epi8(32);
  const __m256i ql[4] = {load32(b.ql), load32(b.ql + 32), load32(b.ql + 64), load32(b.ql + 96)};
  const __m256i qhs[2] = {load32(b.qh), load32(b.qh + 32)};
  for (int n = 0; n < 2; ++n)
    for (int s = 0; s < 4; ++s) {
      const __m256i low = bits_at(ql[2 * n + s % 2], 4 * (s / 2), 0xF);
      const __m256i high = _mm256_slli_epi16(bits_at(qhs[n], 2 * s, 3), 4);
      const __m256i q = _mm256_sub_epi8(_mm256_or_si256(low, high), bias);
      const int sb = n * 8 + s * 2;
      sink(n * 4 + s, q, d * static_cast<float>(b.scales[sb]), 0.0f, d * static_cast<float>(b.scales[sb + 1]), 0.0f);
    }
}

// Levels are the signed grid magnitudes (8, 25, 43); one scale d*(0.5 + s)*0.25 per 32.
template <typename Sink>
[[gnu::always_inline]] inline void levels(const block_iq2_xxs& b, Sink&& sink) {
  const float d = fp16_to_f32(b.d);
  const __m256i bit_of_byte = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
  for (int g = 0; g < QK_K / 32; ++g) {
    const uint32_t indices = b.qs[4 * g] | (static_cast<uint32_t>(b.qs[4 * g + 1]) << 16);
    const uint32_t signs_scale = b.qs[4 * g + 2] | (static_cast<uint32_t>(b.qs[4 * g + 3]) << 16);
    const float db = d * (0.5f + static_cast<float>(signs_scale >> 28)) * 0.25f;
    auto grid = [&](int k) { return static_cast<long long>(kIq2xxsGrid[(indices >> (8 * k)) & 0xFF]); };
    auto signs = [&](int k) {
      return static_cast<long long>(kIq2xxsSigns[(signs_scale >> (7 * k)) & 127] * 0x0101010101010101ull);
    };
    const __m256i mag = _mm256_setr_epi64x(grid(0), grid(1), grid(2), grid(3));
    const __m256i sign_bytes = _mm256_setr_epi64x(signs(0), signs(1), signs(2), signs(3));
    const __m256i negate = _mm256_cmpeq_epi8(_mm256_and_si256(sign_bytes, bit_of_byte), bit_of_byte);
    const __m256i q = _mm256_sub_epi8(_mm256_xor_si256(mag, negate), negate);  // -mag where negate
    sink(g, q, db, 0.0f, db, 0.0f);
  }
}

// The i-quants added for published files (IQ4_XS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S,
// IQ1_M): their portable level decoder (quant_decode.h) fills a stack buffer that is then
// read 32 levels at a time; one definition of the levels for every path.
template <typename Block, typename Sink>
  requires requires(const Block& b, Levels256& v) { quant::levels(b, host_iq_tables(), v); }
[[gnu::always_inline]] inline void levels(const Block& b, Sink&& sink) {
  alignas(32) Levels256 v;
  quant::levels(b, host_iq_tables(), v);
  for (int c = 0; c < QK_K / 32; ++c)
    sink(c, load32(reinterpret_cast<const uint8_t*>(v.q) + 32 * c), v.scale[2 * c], 0.0f, v.scale[2 * c + 1], 0.0f);
}

// The 32-element types (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL): levels, one scale and offset.
template <typename Block>
  requires kLevels32<Block>
[[gnu::always_inline]] inline __m256i levels32(const Block& b, float& scale, float& offset) {
  alignas(32) Levels32 v;
  quant::levels(b, host_iq_tables(), v);
  scale = v.scale;
  offset = v.offset;
  return load32(reinterpret_cast<const uint8_t*>(v.q));
}

template <typename Block>
  requires kLevels32<Block>
[[gnu::always_inline]] inline void decode(const Block& b, float* out) {
  float scale, offset;
  const __m256i q = levels32(b, scale, offset);
  emit32<true>(q, scale, offset, scale, offset, out);
}

template <typename Block>
constexpr bool kHasOffset = std::is_same_v<Block, block_q2_K> || std::is_same_v<Block, block_q4_K> ||
                            std::is_same_v<Block, block_q5_K>;

// The float decoder of every K-quant (and IQ2_XXS): scale*q - offset, products unfused.
template <typename Block>
void decode_levels(const Block& b, float* out) {
  levels(b, [&](int chunk, __m256i q, float s0, float o0, float s1, float o1) {
    emit32<kHasOffset<Block>>(q, s0, o0, s1, o1, out + 32 * chunk);
  });
}
void decode(const block_q2_K& b, float* out) { decode_levels(b, out); }
void decode(const block_q3_K& b, float* out) { decode_levels(b, out); }
void decode(const block_q4_K& b, float* out) { decode_levels(b, out); }
void decode(const block_q5_K& b, float* out) { decode_levels(b, out); }
void decode(const block_q6_K& b, float* out) { decode_levels(b, out); }
void decode(const block_iq2_xxs& b, float* out) { decode_levels(b, out); }
void decode(const block_iq4_xs& b, float* out) { decode_levels(b, out); }
void decode(const block_iq2_xs& b, float* out) { decode_levels(b, out); }
void decode(const block_iq2_s& b, float* out) { decode_levels(b, out); }
void decode(const block_iq3_xxs& b, float* out) { decode_levels(b, out); }
void decode(const block_iq3_s& b, float* out) { decode_levels(b, out); }
void decode(const block_iq1_s& b, float* out) { decode_levels(b, out); }
void decode(const block_iq1_m& b, float* out) { decode_levels(b, out); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// Every dot kernel below takes kRows activation rows (x + r*x_stride) against one weight
// row and decodes each weight block once for all of them. Each row's arithmetic is the same
// whatever kRows is, so batching never changes a result.
//   out[r] = dot(weights, x_r)

inline float reduce4(const __m256 acc[4]) {
  return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

// Decodes one block at a time into a stack buffer and accumulates it against each x.
template <typename Block, int kElems, int kRows>
void dot_blocks(const void* row, const float* x, int64_t x_stride, int64_t n, float* out) {
  __m256 acc[kRows][4];
  for (auto& a : acc) a[0] = a[1] = a[2] = a[3] = _mm256_setzero_ps();
  alignas(32) float w[kElems];
  const Block* blocks = static_cast<const Block*>(row);
  for (int64_t b = 0; b < n / kElems; ++b) {
    decode(blocks[b], w);
    for (int r = 0; r < kRows; ++r) {
      const float* xb = x + r * x_stride + b * kElems;
      for (int i = 0; i < kElems; i += 32)
        for (int k = 0; k < 4; ++k)
          acc[r][k] = _mm256_fmadd_ps(_mm256_load_ps(w + i + 8 * k), _mm256_loadu_ps(xb + i + 8 * k), acc[r][k]);
    }
  }
  for (int r = 0; r < kRows; ++r) out[r] = reduce4(acc[r]);
}

// The K-quants without the stack buffer: each chunk of 32 levels becomes the same floats
// the decoder writes (scale*q - offset, product unfused) and goes straight into the FMAs.
template <typename Block, int kRows>
void dot_levels(const void* row, const float* x, int64_t x_stride, int64_t n, float* out) {
  __m256 acc[kRows][4];
  for (auto& a : acc) a[0] = a[1] = a[2] = a[3] = _mm256_setzero_ps();
  const Block* blocks = static_cast<const Block*>(row);
  for (int64_t b = 0; b < n / QK_K; ++b) {
    const float* xb = x + b * QK_K;
    levels(blocks[b], [&](int chunk, __m256i q, float s0, float o0, float s1, float o1) {
      const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
      for (int h = 0; h < 2; ++h) {
        const __m256 s = _mm256_set1_ps(h == 0 ? s0 : s1);
        for (int k = 0; k < 2; ++k) {
          const __m256 qf = i8x8_to_ps(k == 0 ? halves[h] : _mm_srli_si128(halves[h], 8));
          __m256 w = mul_unfused_ps(s, qf);
          if constexpr (kHasOffset<Block>) w = _mm256_sub_ps(w, _mm256_set1_ps(h == 0 ? o0 : o1));
          const int lane = 2 * h + k;
          for (int r = 0; r < kRows; ++r)
            acc[r][lane] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xb + r * x_stride + 32 * chunk + 8 * lane), acc[r][lane]);
        }
      }
    });
  }
  for (int r = 0; r < kRows; ++r) out[r] = reduce4(acc[r]);
}

template <typename Block, int kElems>
void dequant_blocks(const void* row, float* dst, int64_t n) {
  const Block* blocks = static_cast<const Block*>(row);
  for (int64_t b = 0; b < n / kElems; ++b) decode(blocks[b], dst + b * kElems);
}

// Plain types: 8 elements per step as floats.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p, bool bf16) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

float dot_plain(GgmlType type, const void* row, const float* x, int64_t n) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  const bool bf16 = type == GgmlType::BF16;
  auto at = [&](int64_t i) {
    if (type == GgmlType::F32) return load8(static_cast<const float*>(row) + i);
    return load8(static_cast<const uint16_t*>(row) + i, bf16);
  };
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int k = 0; k < 4; ++k) acc[k] = _mm256_fmadd_ps(at(i + 8 * k), _mm256_loadu_ps(x + i + 8 * k), acc[k]);
  for (; i + 8 <= n; i += 8) acc[0] = _mm256_fmadd_ps(at(i), _mm256_loadu_ps(x + i), acc[0]);
  float sum = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  for (; i < n; ++i) {
    const float w = type == GgmlType::F32 ? static_cast<const float*>(row)[i]
                    : bf16                ? bf16_to_f32(static_cast<const uint16_t*>(row)[i])
                                          : fp16_to_f32(static_cast<const uint16_t*>(row)[i]);
    sum = __builtin_fmaf(w, x[i], sum);
  }
  return sum;
}

// ---- integer dot products with quantised activations ---------------------------------------

// sum over pairs of q*y as 8 int32 lanes (lanes 0-3: bytes 0-15, lanes 4-7: bytes 16-31).
// maddubs needs an unsigned operand: |q| times y carrying q's sign (|q| <= 127 and |y| <= 127
// here, so the int16 pair sums, at most 2*127*127, cannot saturate).
inline __m256i dot_i8_lanes(__m256i q, __m256i y) {
  const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(y, q));
  return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

// Activation rows are act + r*act_stride bytes, each nb Q8_K blocks.
template <typename Block, int kRows>
void dot_q8_K_blocks(const void* row, const uint8_t* act, size_t act_stride, int64_t nb, float* out) {
  const Block* blocks = static_cast<const Block*>(row);
  __m256 acc[kRows];
  float offsets[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps(), offsets[r] = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const block_q8_K* a[kRows];
    __m256 block_acc[kRows];
    float block_offsets[kRows];
    for (int r = 0; r < kRows; ++r) {
      a[r] = reinterpret_cast<const block_q8_K*>(act + r * act_stride) + b;
      block_acc[r] = _mm256_setzero_ps();
      block_offsets[r] = 0.0f;
    }
    levels(blocks[b], [&](int chunk, __m256i q, float s0, float o0, float s1, float o1) {
      const __m256 scale = _mm256_setr_m128(_mm_set1_ps(s0), _mm_set1_ps(s1));
      for (int r = 0; r < kRows; ++r) {
        const __m256i sums = dot_i8_lanes(q, load32(reinterpret_cast<const uint8_t*>(a[r]->qs) + 32 * chunk));
        block_acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, block_acc[r]);
        if constexpr (kHasOffset<Block>)
          block_offsets[r] += o0 * static_cast<float>(a[r]->bsums[2 * chunk]) + o1 * static_cast<float>(a[r]->bsums[2 * chunk + 1]);
      }
    });
    for (int r = 0; r < kRows; ++r) {
      acc[r] = _mm256_fmadd_ps(block_acc[r], _mm256_set1_ps(a[r]->d), acc[r]);
      offsets[r] += a[r]->d * block_offsets[r];
    }
  }
  for (int r = 0; r < kRows; ++r) out[r] = hsum(acc[r]) - offsets[r];
}

[[gnu::always_inline]] inline __m256i mxfp4_levels(const block_mxfp4& b) {
  const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs));
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(codes, nibble));
  const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(codes, 4), nibble));
  return _mm256_setr_m128i(lo, hi);
}

template <int kRows>
void dot_q8_0_blocks(GgmlType type, const void* row, const uint8_t* act, size_t act_stride, int64_t nb, float* out) {
  __m256 acc[kRows];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i q;
    float scale;
    if (type == GgmlType::MXFP4) {
      const block_mxfp4& w = static_cast<const block_mxfp4*>(row)[b];
      q = mxfp4_levels(w);
      scale = e8m0_to_f32_half(w.e);
    } else {
      const block_q8_0& w = static_cast<const block_q8_0*>(row)[b];
      q = load32(reinterpret_cast<const uint8_t*>(w.qs));
      scale = _cvtsh_ss(w.d);  // the hardware conversion: exact, and this path need not keep NaN payloads
    }
    for (int r = 0; r < kRows; ++r) {
      const block_q8_0& a = reinterpret_cast<const block_q8_0*>(act + r * act_stride)[b];
      const __m256i sums = dot_i8_lanes(q, load32(reinterpret_cast<const uint8_t*>(a.qs)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(scale * _cvtsh_ss(a.d)), acc[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) out[r] = hsum(acc[r]);
}

// The 32-element level types against Q8_0 activations: scale*d8*sum(q*y) - offset*d8*sum(y).
template <typename Block, int kRows>
void dot_levels32_q8_0(const void* row, const uint8_t* act, size_t act_stride, int64_t nb, float* out) {
  __m256 acc[kRows];
  float offsets[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps(), offsets[r] = 0.0f;
  const __m256i ones = _mm256_set1_epi8(1);
  for (int64_t b = 0; b < nb; ++b) {
    float scale, offset;
    const __m256i q = levels32(static_cast<const Block*>(row)[b], scale, offset);
    for (int r = 0; r < kRows; ++r) {
      const block_q8_0& a = reinterpret_cast<const block_q8_0*>(act + r * act_stride)[b];
      const __m256i y = load32(reinterpret_cast<const uint8_t*>(a.qs));
      const float d8 = _cvtsh_ss(a.d);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_i8_lanes(q, y)), _mm256_set1_ps(scale * d8), acc[r]);
      if (offset != 0.0f) {
        const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(ones, y), _mm256_set1_epi16(1));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
        s4 = _mm_hadd_epi32(s4, s4);
        s4 = _mm_hadd_epi32(s4, s4);
        offsets[r] += offset * d8 * static_cast<float>(_mm_cvtsi128_si32(s4));
      }
    }
  }
  for (int r = 0; r < kRows; ++r) out[r] = hsum(acc[r]) - offsets[r];
}

// Splits n_rows into groups of 4, 2 and 1 and calls f(first_row, std::integral_constant<kRows>).
template <typename F>
void for_row_groups(int64_t n_rows, F&& f) {
  int64_t r = 0;
  for (; r + 4 <= n_rows; r += 4) f(r, std::integral_constant<int, 4>{});
  if (r + 2 <= n_rows) f(r, std::integral_constant<int, 2>{}), r += 2;
  if (r < n_rows) f(r, std::integral_constant<int, 1>{});
}

// ggml's quantize_row_q8_0_ref, 8 lanes at a time: q = roundf(x / d), roundf being round
// half away from zero (truncate, then step away from zero when the dropped part is >= 1/2).
void quantize_q8_0_blocks(const float* x, block_q8_0* y, int64_t nb) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
  for (int64_t b = 0; b < nb; ++b, x += QK8_0) {
    __m256 v[4];
    for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(x + 8 * k);
    // max is order-independent for non-NaN input, so the lanes may reduce in any order.
    const __m256 m01 = _mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask));
    const __m256 m23 = _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask));
    const float amax = hmax(_mm256_max_ps(m01, m23));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[b].d = f32_to_fp16(d);
    __m256i q32[4];
    for (int k = 0; k < 4; ++k) {
      const __m256 scaled = _mm256_mul_ps(v[k], _mm256_set1_ps(id));
      const __m256 t = _mm256_round_ps(scaled, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
      const __m256 away = _mm256_cmp_ps(_mm256_and_ps(_mm256_sub_ps(scaled, t), abs_mask), half, _CMP_GE_OQ);
      const __m256 step = _mm256_and_ps(away, _mm256_or_ps(one, _mm256_andnot_ps(abs_mask, scaled)));
      q32[k] = _mm256_cvtps_epi32(_mm256_add_ps(t, step));
    }
    // int32 -> int8 with the lane interleaving of the packs undone.
    const __m256i q16a = _mm256_packs_epi32(q32[0], q32[1]), q16b = _mm256_packs_epi32(q32[2], q32[3]);
    const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16a, q16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y[b].qs), q8);
  }
}

}  // namespace

bool dot_rows_f32_vector(GgmlType type, const void* row, const float* x, int64_t x_stride, int64_t n_x, int64_t n,
                         float* out) {
  switch (type) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16:
      for (int64_t r = 0; r < n_x; ++r) out[r] = dot_plain(type, row, x + r * x_stride, n);
      return true;
    case GgmlType::Q8_0:
    case GgmlType::MXFP4:
    case GgmlType::Q2_K:
    case GgmlType::Q3_K:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
    case GgmlType::Q6_K:
    case GgmlType::IQ2_XXS:
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::Q5_0:
    case GgmlType::Q5_1:
    case GgmlType::IQ4_NL:
    case GgmlType::IQ4_XS:
    case GgmlType::IQ2_XS:
    case GgmlType::IQ2_S:
    case GgmlType::IQ3_XXS:
    case GgmlType::IQ3_S:
    case GgmlType::IQ1_S:
    case GgmlType::IQ1_M: break;
    default: return false;
  }
  for_row_groups(n_x, [&](int64_t r0, auto rows) {
    constexpr int R = decltype(rows)::value;
    const float* xr = x + r0 * x_stride;
    float* o = out + r0;
    switch (type) {
      case GgmlType::Q8_0: dot_blocks<block_q8_0, QK8_0, R>(row, xr, x_stride, n, o); break;
      case GgmlType::MXFP4: dot_blocks<block_mxfp4, QK_MXFP4, R>(row, xr, x_stride, n, o); break;
      case GgmlType::Q2_K: dot_levels<block_q2_K, R>(row, xr, x_stride, n, o); break;
      case GgmlType::Q3_K: dot_levels<block_q3_K, R>(row, xr, x_stride, n, o); break;
      case GgmlType::Q4_K: dot_levels<block_q4_K, R>(row, xr, x_stride, n, o); break;
      case GgmlType::Q5_K: dot_levels<block_q5_K, R>(row, xr, x_stride, n, o); break;
      case GgmlType::Q6_K: dot_levels<block_q6_K, R>(row, xr, x_stride, n, o); break;
      case GgmlType::Q4_0: dot_blocks<block_q4_0, QK4_0, R>(row, xr, x_stride, n, o); break;
      case GgmlType::Q4_1: dot_blocks<block_q4_1, QK4_0, R>(row, xr, x_stride, n, o); break;
      case GgmlType::Q5_0: dot_blocks<block_q5_0, QK4_0, R>(row, xr, x_stride, n, o); break;
      case GgmlType::Q5_1: dot_blocks<block_q5_1, QK4_0, R>(row, xr, x_stride, n, o); break;
      case GgmlType::IQ4_NL: dot_blocks<block_iq4_nl, QK4_0, R>(row, xr, x_stride, n, o); break;
      case GgmlType::IQ4_XS: dot_levels<block_iq4_xs, R>(row, xr, x_stride, n, o); break;
      case GgmlType::IQ2_XS: dot_levels<block_iq2_xs, R>(row, xr, x_stride, n, o); break;
      case GgmlType::IQ2_S: dot_levels<block_iq2_s, R>(row, xr, x_stride, n, o); break;
      case GgmlType::IQ3_XXS: dot_levels<block_iq3_xxs, R>(row, xr, x_stride, n, o); break;
      case GgmlType::IQ3_S: dot_levels<block_iq3_s, R>(row, xr, x_stride, n, o); break;
      case GgmlType::IQ1_S: dot_levels<block_iq1_s, R>(row, xr, x_stride, n, o); break;
      case GgmlType::IQ1_M: dot_levels<block_iq1_m, R>(row, xr, x_stride, n, o); break;
      default: dot_levels<block_iq2_xxs, R>(row, xr, x_stride, n, o); break;
    }
  });
  return true;
}

bool dequantize_row_vector(GgmlType type, const void* src, float* dst, int64_t n) {
  switch (type) {
    case GgmlType::BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(s + i, true));
      for (; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      return true;
    }
    case GgmlType::F16: {
      // F16C, except for 8-element groups holding an fp16 exponent of all ones: the hardware
      // quiets signalling NaNs, the scalar path keeps every payload bit (as numpy does).
      const uint16_t* s = static_cast<const uint16_t*>(src);
      const __m128i exp_mask = _mm_set1_epi16(0x7C00);
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
        if (_mm_movemask_epi8(_mm_cmpeq_epi16(_mm_and_si128(h, exp_mask), exp_mask)) == 0) {
          _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
        } else {
          for (int k = 0; k < 8; ++k) dst[i + k] = fp16_to_f32(s[i + k]);
        }
      }
      for (; i < n; ++i) dst[i] = fp16_to_f32(s[i]);
      return true;
    }
    case GgmlType::Q8_0: dequant_blocks<block_q8_0, QK8_0>(src, dst, n); return true;
    case GgmlType::MXFP4: dequant_blocks<block_mxfp4, QK_MXFP4>(src, dst, n); return true;
    case GgmlType::Q2_K: dequant_blocks<block_q2_K, QK_K>(src, dst, n); return true;
    case GgmlType::Q3_K: dequant_blocks<block_q3_K, QK_K>(src, dst, n); return true;
    case GgmlType::Q4_K: dequant_blocks<block_q4_K, QK_K>(src, dst, n); return true;
    case GgmlType::Q5_K: dequant_blocks<block_q5_K, QK_K>(src, dst, n); return true;
    case GgmlType::Q6_K: dequant_blocks<block_q6_K, QK_K>(src, dst, n); return true;
    case GgmlType::IQ2_XXS: dequant_blocks<block_iq2_xxs, QK_K>(src, dst, n); return true;
    case GgmlType::Q4_0: dequant_blocks<block_q4_0, QK4_0>(src, dst, n); return true;
    case GgmlType::Q4_1: dequant_blocks<block_q4_1, QK4_0>(src, dst, n); return true;
    case GgmlType::Q5_0: dequant_blocks<block_q5_0, QK4_0>(src, dst, n); return true;
    case GgmlType::Q5_1: dequant_blocks<block_q5_1, QK4_0>(src, dst, n); return true;
    case GgmlType::IQ4_NL: dequant_blocks<block_iq4_nl, QK4_0>(src, dst, n); return true;
    case GgmlType::IQ4_XS: dequant_blocks<block_iq4_xs, QK_K>(src, dst, n); return true;
    case GgmlType::IQ2_XS: dequant_blocks<block_iq2_xs, QK_K>(src, dst, n); return true;
    case GgmlType::IQ2_S: dequant_blocks<block_iq2_s, QK_K>(src, dst, n); return true;
    case GgmlType::IQ3_XXS: dequant_blocks<block_iq3_xxs, QK_K>(src, dst, n); return true;
    case GgmlType::IQ3_S: dequant_blocks<block_iq3_s, QK_K>(src, dst, n); return true;
    case GgmlType::IQ1_S: dequant_blocks<block_iq1_s, QK_K>(src, dst, n); return true;
    case GgmlType::IQ1_M: dequant_blocks<block_iq1_m, QK_K>(src, dst, n); return true;
    default: return false;  // F32 is a copy
  }
}

namespace {

// ggml's quantize_row_q8_K_ref, vectorised: scale -127/max from the signed value of largest
// magnitude (the first such), levels rounded to nearest even and capped at 127, per-16 sums.
void quantize_q8_K_blocks(const float* x, block_q8_K* y, int64_t nb) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t b = 0; b < nb; ++b, x += QK_K) {
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < QK_K; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask));
    const float amax = hmax(m);
    if (amax == 0.0f) {
      std::memset(&y[b], 0, sizeof y[b]);
      continue;
    }
    float max = 0.0f;
    for (int i = 0; i < QK_K; ++i)
      if (std::fabs(x[i]) == amax) {
        max = x[i];
        break;
      }
    const float iscale = -127.f / max;
    const __m256 scale = _mm256_set1_ps(iscale);
    for (int i = 0; i < QK_K; i += 32) {
      __m256i q32[4];
      for (int k = 0; k < 4; ++k) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * k), scale),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q32[k] = _mm256_min_epi32(_mm256_cvtps_epi32(r), _mm256_set1_epi32(127));
      }
      const __m256i q16a = _mm256_packs_epi32(q32[0], q32[1]), q16b = _mm256_packs_epi32(q32[2], q32[3]);
      const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16a, q16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y[b].qs + i), q8);
      // Per-16 sums: widen to int16, add neighbours pairwise, then fold.
      const __m256i lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q8));
      const __m256i hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q8, 1));
      const __m256i s32lo = _mm256_madd_epi16(lo, _mm256_set1_epi16(1)), s32hi = _mm256_madd_epi16(hi, _mm256_set1_epi16(1));
      const __m256i h = _mm256_hadd_epi32(s32lo, s32hi);
      const __m256i h2 = _mm256_hadd_epi32(h, h);
      const __m128i sums = _mm_add_epi32(_mm256_castsi256_si128(h2), _mm256_extracti128_si256(h2, 1));
      y[b].bsums[i / 16] = static_cast<int16_t>(_mm_cvtsi128_si32(sums));
      y[b].bsums[i / 16 + 1] = static_cast<int16_t>(_mm_extract_epi32(sums, 1));
    }
    y[b].d = 1 / iscale;
  }
}

}  // namespace

bool dot_rows_quantized_vector(GgmlType type, const void* row, const void* act, size_t act_stride, int64_t n_act,
                               int64_t n, float* out) {
  switch (type) {
    case GgmlType::Q8_0:
    case GgmlType::MXFP4:
    case GgmlType::Q2_K:
    case GgmlType::Q3_K:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
    case GgmlType::Q6_K:
    case GgmlType::IQ2_XXS:
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::Q5_0:
    case GgmlType::Q5_1:
    case GgmlType::IQ4_NL:
    case GgmlType::IQ4_XS:
    case GgmlType::IQ2_XS:
    case GgmlType::IQ2_S:
    case GgmlType::IQ3_XXS:
    case GgmlType::IQ3_S:
    case GgmlType::IQ1_S:
    case GgmlType::IQ1_M: break;
    default: return false;
  }
  const uint8_t* a = static_cast<const uint8_t*>(act);
  for_row_groups(n_act, [&](int64_t r0, auto rows) {
    constexpr int R = decltype(rows)::value;
    const uint8_t* ar = a + r0 * act_stride;
    float* o = out + r0;
    switch (type) {
      case GgmlType::Q8_0:
      case GgmlType::MXFP4: dot_q8_0_blocks<R>(type, row, ar, act_stride, n / QK8_0, o); break;
      case GgmlType::Q2_K: dot_q8_K_blocks<block_q2_K, R>(row, ar, act_stride, n / QK_K, o); break;
      case GgmlType::Q3_K: dot_q8_K_blocks<block_q3_K, R>(row, ar, act_stride, n / QK_K, o); break;
      case GgmlType::Q4_K: dot_q8_K_blocks<block_q4_K, R>(row, ar, act_stride, n / QK_K, o); break;
      case GgmlType::Q5_K: dot_q8_K_blocks<block_q5_K, R>(row, ar, act_stride, n / QK_K, o); break;
      case GgmlType::Q6_K: dot_q8_K_blocks<block_q6_K, R>(row, ar, act_stride, n / QK_K, o); break;
      case GgmlType::Q4_0: dot_levels32_q8_0<block_q4_0, R>(row, ar, act_stride, n / QK4_0, o); break;
      case GgmlType::Q4_1: dot_levels32_q8_0<block_q4_1, R>(row, ar, act_stride, n / QK4_0, o); break;
      case GgmlType::Q5_0: dot_levels32_q8_0<block_q5_0, R>(row, ar, act_stride, n / QK4_0, o); break;
      case GgmlType::Q5_1: dot_levels32_q8_0<block_q5_1, R>(row, ar, act_stride, n / QK4_0, o); break;
      case GgmlType::IQ4_NL: dot_levels32_q8_0<block_iq4_nl, R>(row, ar, act_stride, n / QK4_0, o); break;
      case GgmlType::IQ4_XS: dot_q8_K_blocks<block_iq4_xs, R>(row, ar, act_stride, n / QK_K, o); break;
      case GgmlType::IQ2_XS: dot_q8_K_blocks<block_iq2_xs, R>(row, ar, act_stride, n / QK_K, o); break;
      case GgmlType::IQ2_S: dot_q8_K_blocks<block_iq2_s, R>(row, ar, act_stride, n / QK_K, o); break;
      case GgmlType::IQ3_XXS: dot_q8_K_blocks<block_iq3_xxs, R>(row, ar, act_stride, n / QK_K, o); break;
      case GgmlType::IQ3_S: dot_q8_K_blocks<block_iq3_s, R>(row, ar, act_stride, n / QK_K, o); break;
      case GgmlType::IQ1_S: dot_q8_K_blocks<block_iq1_s, R>(row, ar, act_stride, n / QK_K, o); break;
      case GgmlType::IQ1_M: dot_q8_K_blocks<block_iq1_m, R>(row, ar, act_stride, n / QK_K, o); break;
      default: dot_q8_K_blocks<block_iq2_xxs, R>(row, ar, act_stride, n / QK_K, o); break;
    }
  });
  return true;
}

bool quantize_q8_K_vector(const float* src, block_q8_K* dst, int64_t n) {
  quantize_q8_K_blocks(src, dst, n / QK_K);
  return true;
}

bool quantize_row_vector(GgmlType type, const float* src, void* dst, int64_t n) {
  if (type == GgmlType::Q8_0) {
    quantize_q8_0_blocks(src, static_cast<block_q8_0*>(dst), n / QK8_0);
    return true;
  }
  if (type == GgmlType::F16) {
    // F16C rounds to nearest even like f32_to_fp16; groups with a NaN take the scalar path
    // so the NaN encoding is the one f32_to_fp16 defines.
    uint16_t* out = static_cast<uint16_t*>(dst);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(src + i);
      if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) == 0) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
      } else {
        for (int k = 0; k < 8; ++k) out[i + k] = f32_to_fp16(src[i + k]);
      }
    }
    for (; i < n; ++i) out[i] = f32_to_fp16(src[i]);
    return true;
  }
  return false;
}

#else  // no AVX2

bool dot_rows_f32_vector(GgmlType, const void*, const float*, int64_t, int64_t, int64_t, float*) { return false; }
bool dequantize_row_vector(GgmlType, const void*, float*, int64_t) { return false; }
bool dot_rows_quantized_vector(GgmlType, const void*, const void*, size_t, int64_t, int64_t, float*) { return false; }
bool quantize_row_vector(GgmlType, const float*, void*, int64_t) { return false; }
bool quantize_q8_K_vector(const float*, block_q8_K*, int64_t) { return false; }

#endif

}  // namespace dsv4::quant
