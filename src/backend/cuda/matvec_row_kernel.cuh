// Matrix-vector kernel for one activation row (decode's case) of Q8_0, Q2_K and Q3_K weights.
// Same streaming as matvec_kernel.cuh (16-byte cp.async copies of each warp's next rows into
// a ring of shared-memory stages; same groups, same activation layout), but the arithmetic is
// cut to what the bytes need:
//  * each lane keeps its slice of the quantised activations in registers for every row it
//    handles (a lane always takes the same units of a row), reloading only when the matrix
//    changes, instead of reading them from L1 again for every row;
//  * block fields are read as aligned 32-bit shared-memory words (Q2_K blocks are 84 bytes,
//    4-byte aligned; Q8_0's 34 and Q3_K's 110 are 2-byte aligned, so one byte permute per word
//    with a selector fixed by the block's parity) rather than assembled from unaligned bytes;
//  * integer products are scaled by the integer sub-block scales before the conversion to
//    float (one per 32 weights; Q2_K's minimums one more), with the activation sums per 16 kept
//    as integers (Q3_K's -4 offset becomes the dp4a chains' starting value), and the block's
//    d / dmin multiply once per 128 weights;
//  * Q2_K's 2-bit values and Q3_K's first three 3-bit planes are masked in place, not shifted
//    (RowUnit<...>::prepare);
//  * two rows per pass of a lane group with no branch between them, so the compiler interleaves
//    their loads, products and shuffle sums.
// The host uses it only when the weights' alignment allows (matvec.cu); everything else runs
// the general kernel.
#pragma once

#include "backend/cuda/activation_quant.h"
#include "backend/cuda/matvec.h"
#include "backend/cuda/matvec_kernel.cuh"
#include "backend/cuda/q8_block.cuh"

namespace dsv4::cuda::detail {

// One lane's activations for one wide unit (W = 32 * kSub values): the int8 values as 16-byte
// chunks, a factor per 32 values (the scale, possibly pre-multiplied, RowUnit::prepare), and
// per 16 values an integer derived from their sum (K-quants only, RowUnit::prepare).
template <int kSub, bool kSums>
struct UnitActivations {
  int4 q[2 * kSub];
  float d[kSub];
  int2 sums[kSums ? kSub : 1];
};

// Sum of the 16 int8 values of a chunk.
__device__ __forceinline__ int chunk_sum(int4 x) {
  const int ones = 0x01010101;
  return __dp4a(x.w, ones, __dp4a(x.z, ones, __dp4a(x.y, ones, __dp4a(x.x, ones, 0))));
}

// Unsigned bytes of `w` times signed bytes of `x`, plus c (dp4a.u32.s32).
__device__ __forceinline__ int dp4a_us(uint32_t w, int x, int c) {
  int d;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(w), "r"(x), "r"(c));
  return d;
}

template <GgmlType T>
struct RowUnit;

// Four bytes starting `sel`'s way from two consecutive aligned words: 0x3210 takes the first
// word, 0x5432 starts two bytes into it.
__device__ __forceinline__ uint32_t word_at(uint32_t lo, uint32_t hi, uint32_t sel) { return __byte_perm(lo, hi, sel); }

// Products of 8 words of weights with 32 activations: the first 16 into lo, the rest into hi,
// starting from c0 / c1.
__device__ __forceinline__ int dot8(const uint32_t* q, int4 x0, int4 x1, int c0, int c1, int& hi) {
  int lo = __dp4a(static_cast<int>(q[0]), x0.x, c0);
  lo = __dp4a(static_cast<int>(q[1]), x0.y, lo);
  lo = __dp4a(static_cast<int>(q[2]), x0.z, lo);
  lo = __dp4a(static_cast<int>(q[3]), x0.w, lo);
  hi = __dp4a(static_cast<int>(q[4]), x1.x, c1);
  hi = __dp4a(static_cast<int>(q[5]), x1.y, hi);
  hi = __dp4a(static_cast<int>(q[6]), x1.z, hi);
  hi = __dp4a(static_cast<int>(q[7]), x1.w, hi);
  return lo;
}

// The same with unsigned weight bytes (0..255).
__device__ __forceinline__ int dot8_unsigned(const uint32_t* q, int4 x0, int4 x1, int& hi) {
  int lo = dp4a_us(q[0], x0.x, 0);
  lo = dp4a_us(q[1], x0.y, lo);
  lo = dp4a_us(q[2], x0.z, lo);
  lo = dp4a_us(q[3], x0.w, lo);
  hi = dp4a_us(q[4], x1.x, 0);
  hi = dp4a_us(q[5], x1.y, hi);
  hi = dp4a_us(q[6], x1.z, hi);
  hi = dp4a_us(q[7], x1.w, hi);
  return lo;
}

__device__ __forceinline__ float half_bits_to_float(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits & 0xFFFFu)));
}

template <>
struct RowUnit<GgmlType::Q8_0> {
  static constexpr int kSub = 1;
  static constexpr bool kSums = false;
  static constexpr int kAlign = 2;  // byte alignment the row must have
  using Act = UnitActivations<kSub, kSums>;
  __device__ static void prepare(Act&) {}
  // dot in two halves, so that the multi-row kernel reads and permutes a unit's weights once
  // for all its rows: weights() gives the unit's 32 weights as 8 words and its scale,
  // product() multiplies them with one row's prepared activations.
  struct Weights {
    uint32_t q[8];
    float d;
  };
  __device__ static void weights(const uint8_t* row, int unit, Weights& w) {
    const uint8_t* blk = row + 34 * unit;
    const int skew = static_cast<int>(reinterpret_cast<uintptr_t>(blk) & 3);  // 0 or 2
    const uint32_t* p = reinterpret_cast<const uint32_t*>(blk - skew);       // stays a shared address
    uint32_t v[9];
#pragma unroll
    for (int i = 0; i < 9; ++i) v[i] = p[i];
    // qs start at byte 2 of the block: byte 2 of v[0] (skew 0) or v[1] itself (skew 2).
    const uint32_t sel = skew != 0 ? 0x7654u : 0x5432u;
#pragma unroll
    for (int i = 0; i < 8; ++i) w.q[i] = word_at(v[i], v[i + 1], sel);
    w.d = half_bits_to_float(skew != 0 ? v[0] >> 16 : v[0]);
  }
  __device__ static float product(const Weights& w, const Act& x) {
    int hi;
    const int lo = dot8(w.q, x.q[0], x.q[1], 0, 0, hi);
    return w.d * x.d[0] * static_cast<float>(lo + hi);
  }
  __device__ static float dot(const uint8_t* row, int unit, const Act& x) {
    Weights w;
    weights(row, unit, w);
    return product(w, x);
  }
};

template <>
struct RowUnit<GgmlType::Q2_K> {
  static constexpr int kSub = 4;
  static constexpr bool kSums = true;
  static constexpr int kAlign = 4;
  using Act = UnitActivations<kSub, kSums>;
  // Sub-unit j's 2-bit values are masked in place (q & 3 << 2j: the value times 4^j, at most
  // 192, multiplied as unsigned bytes); the activation side carries the 4^-j: d[j] * 4^-j, and
  // the integer sums per 16 times 4^j, so every integer of sub-unit j is 4^j times the true one
  // (below 2^24: exact in f32).
  __device__ static void prepare(Act& x) {
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      x.d[j] *= 1.0f / static_cast<float>(1 << (2 * j));
      x.sums[j] = make_int2(chunk_sum(x.q[2 * j]) << (2 * j), chunk_sum(x.q[2 * j + 1]) << (2 * j));
    }
  }
  // Unit = half a block: one 32-byte plane of qs (4 shifts x 32 weights), its 8 scale bytes.
  __device__ static float dot(const uint8_t* row, int unit, const Act& x) {
    const uint32_t* blk = reinterpret_cast<const uint32_t*>(row + 84 * (unit >> 1));
    const int n = unit & 1;
    uint32_t q[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = blk[4 + 8 * n + i];
    const uint32_t sc[2] = {blk[2 * n], blk[2 * n + 1]};  // (scale | min << 4) per 16 weights
    const uint32_t dd = blk[20];                          // d, dmin
    // The 4-bit fields as bytes, then one byte permute (selector 0x444b: byte b, zeros) per field.
    const uint32_t scales[2] = {sc[0] & 0x0F0F0F0Fu, sc[1] & 0x0F0F0F0Fu};
    const uint32_t mins[2] = {(sc[0] >> 4) & 0x0F0F0F0Fu, (sc[1] >> 4) & 0x0F0F0F0Fu};
    float acc_q = 0.0f, acc_m = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t p[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) p[i] = q[i] & (0x03030303u << (2 * j));
      int hi;
      const int lo = dot8_unsigned(p, x.q[2 * j], x.q[2 * j + 1], hi);
      const uint32_t b = 2u * (j & 1);
      const int scale_lo = static_cast<int>(__byte_perm(scales[j >> 1], 0u, 0x4440u | b));
      const int scale_hi = static_cast<int>(__byte_perm(scales[j >> 1], 0u, 0x4440u | (b + 1)));
      const int min_lo = static_cast<int>(__byte_perm(mins[j >> 1], 0u, 0x4440u | b));
      const int min_hi = static_cast<int>(__byte_perm(mins[j >> 1], 0u, 0x4440u | (b + 1)));
      acc_q = fmaf(x.d[j], static_cast<float>(lo * scale_lo + hi * scale_hi), acc_q);
      acc_m = fmaf(x.d[j], static_cast<float>(min_lo * x.sums[j].x + min_hi * x.sums[j].y), acc_m);
    }
    return half_bits_to_float(dd) * acc_q - half_bits_to_float(dd >> 16) * acc_m;
  }
};

template <>
struct RowUnit<GgmlType::Q3_K> {
  static constexpr int kSub = 4;
  static constexpr bool kSums = true;
  static constexpr int kAlign = 2;
  using Act = UnitActivations<kSub, kSums>;
  // Sub-units 0..2 are assembled in place (their 3-bit values times 4^j, at most 112); sub-unit
  // 3's would overflow a signed byte, so it is shifted down. f_j = 4^j for j < 3, 1 for j = 3:
  // d[j] carries 1 / f_j, and sums -4 f_j x the sum per 16 values, the starting value of each
  // dp4a chain, which turns the stored q (0..7) into ggml's q - 4.
  __device__ static void prepare(Act& x) {
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      const int f = j < 3 ? 1 << (2 * j) : 1;
      x.d[j] *= 1.0f / static_cast<float>(f);
      x.sums[j] = make_int2(-4 * f * chunk_sum(x.q[2 * j]), -4 * f * chunk_sum(x.q[2 * j + 1]));
    }
  }
  // Unit = half a block: one 32-byte plane of qs, bits 4n..4n+3 of hmask, 8 of the 16 scales.
  // Weight = d * (scale - 32) * (q - 4) with q = low 2 bits | high bit << 2 in 0..7.
  __device__ static float dot(const uint8_t* row, int unit, const Act& x) {
    const uint8_t* blk = row + 110 * (unit >> 1);
    const int skew = static_cast<int>(reinterpret_cast<uintptr_t>(blk) & 3);  // 0 or 2
    const uint32_t* w = reinterpret_cast<const uint32_t*>(blk - skew);       // stays a shared address
    const uint32_t sel = skew != 0 ? 0x5432u : 0x3210u;
    const int n = unit & 1;
    uint32_t hm[8], q[8];
    {
      uint32_t v[9], u[9];
#pragma unroll
      for (int i = 0; i < 9; ++i) {
        v[i] = w[i];
        u[i] = w[8 + 8 * n + i];
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        hm[i] = word_at(v[i], v[i + 1], sel) >> (4 * n);
        q[i] = word_at(u[i], u[i + 1], sel);
      }
    }
    uint32_t s[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] = w[24 + i];
    const uint32_t a0 = word_at(s[0], s[1], sel), a1 = word_at(s[1], s[2], sel), a2 = word_at(s[2], s[3], sel);
    const float d = half_bits_to_float(word_at(s[3], 0u, sel));
    // 6-bit scales of this unit's 16-weight groups 8n..8n+7 (quant::q3_k_scale), still + 32.
    const uint32_t sc[2] = {((a0 >> (4 * n)) & 0x0F0F0F0Fu) | (((a2 >> (4 * n)) & 0x03030303u) << 4),
                            ((a1 >> (4 * n)) & 0x0F0F0F0Fu) | (((a2 >> (4 * n + 2)) & 0x03030303u) << 4)};
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t p[8];
#pragma unroll
      for (int i = 0; i < 8; ++i)
        p[i] = j < 3 ? (q[i] & (0x03030303u << (2 * j))) | ((hm[i] << (j + 2)) & (0x04040404u << (2 * j)))
                     : ((q[i] >> 6) & 0x03030303u) | ((hm[i] >> 1) & 0x04040404u);
      int hi;
      const int lo = dot8(p, x.q[2 * j], x.q[2 * j + 1], x.sums[j].x, x.sums[j].y, hi);
      const uint32_t s2 = sc[j >> 1] >> (16 * (j & 1));
      const int scale_lo = static_cast<int>(s2 & 0xFFu) - 32, scale_hi = static_cast<int>((s2 >> 8) & 0xFFu) - 32;
      acc = fmaf(x.d[j], static_cast<float>(lo * scale_lo + hi * scale_hi), acc);
    }
    return d * acc;
  }
};

// MXFP4: a wide unit is four 17-byte blocks (128 weights, any byte alignment). Each 32-bit
// word of a block's codes holds elements 4i..4i+3 (low nibbles) and 16+4i..16+4i+3 (high
// nibbles); the codes themselves are the byte-permute selectors of a 16-entry table (ggml's
// doubled E2M1 grid: positive half in two words, negative half in two more; the permute reads
// three selector bits, and bit 3 picks the half with a second permute). The weights come out
// in the order 4i, 16+4i, 4i+1, 16+4i+1 | 4i+2, 16+4i+2, ..., so the activations are permuted
// to that order once per matrix (prepare) instead of the weights once per row.
template <>
struct RowUnit<GgmlType::MXFP4> {
  static constexpr int kSub = 4;
  static constexpr bool kSums = false;
  static constexpr int kAlign = 1;
  using Act = UnitActivations<kSub, kSums>;
  __device__ static void prepare(Act& x) {
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      const uint32_t v[8] = {static_cast<uint32_t>(x.q[2 * j].x),     static_cast<uint32_t>(x.q[2 * j].y),
                             static_cast<uint32_t>(x.q[2 * j].z),     static_cast<uint32_t>(x.q[2 * j].w),
                             static_cast<uint32_t>(x.q[2 * j + 1].x), static_cast<uint32_t>(x.q[2 * j + 1].y),
                             static_cast<uint32_t>(x.q[2 * j + 1].z), static_cast<uint32_t>(x.q[2 * j + 1].w)};
      uint32_t p[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        p[2 * i] = __byte_perm(v[i], v[4 + i], 0x5140u);      // x[4i], x[16+4i], x[4i+1], x[16+4i+1]
        p[2 * i + 1] = __byte_perm(v[i], v[4 + i], 0x7362u);  // x[4i+2], x[16+4i+2], x[4i+3], x[16+4i+3]
      }
      x.q[2 * j] = make_int4(static_cast<int>(p[0]), static_cast<int>(p[1]), static_cast<int>(p[2]),
                             static_cast<int>(p[3]));
      x.q[2 * j + 1] = make_int4(static_cast<int>(p[4]), static_cast<int>(p[5]), static_cast<int>(p[6]),
                                 static_cast<int>(p[7]));
    }
  }
  // ggml's MXFP4 scale 2^(e-128) (e8m0_to_f32_half) without a branch on the common path.
  __device__ static float scale_of(uint32_t e) {
    return __uint_as_float(e < 2u ? (0x00200000u << e) : ((e - 1u) << 23));
  }
  __device__ static float dot(const uint8_t* row, int unit, const Act& x) {
    const uint8_t* p = row + 68 * unit;
    const uint32_t skew = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(p) & 3);
    const uint32_t* w = reinterpret_cast<const uint32_t*>(p - skew);  // stays a shared address
    uint32_t u[17];  // bytes 4i..4i+3 of the unit
    {
      uint32_t v[18];
#pragma unroll
      for (int i = 0; i < 18; ++i) v[i] = w[i];
#pragma unroll
      for (int i = 0; i < 17; ++i) u[i] = __funnelshift_r(v[i], v[i + 1], 8 * skew);
    }
    float acc = 0.0f;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const uint32_t e = (u[(17 * b) / 4] >> (8 * ((17 * b) % 4))) & 0xFFu;
      const int4 xa = x.q[2 * b], xb = x.q[2 * b + 1];
      const int xs[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
      int sum = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        constexpr int kFirst = 1;  // the codes start after the scale byte
        const int o = 17 * b + kFirst + 4 * i;
        const uint32_t codes = (o % 4) == 0 ? u[o / 4] : __funnelshift_r(u[o / 4], u[o / 4 + 1], 8 * (o % 4));
        const uint32_t hi_codes = codes >> 16;
        const uint32_t pos0 = __byte_perm(0x03020100u, 0x0C080604u, codes);
        const uint32_t neg0 = __byte_perm(0xFDFEFF00u, 0xF4F8FAFCu, codes);
        const uint32_t pos1 = __byte_perm(0x03020100u, 0x0C080604u, hi_codes);
        const uint32_t neg1 = __byte_perm(0xFDFEFF00u, 0xF4F8FAFCu, hi_codes);
        const uint32_t pick = ((codes >> 1) & 0x44444444u) | 0x32103210u;  // +4 where the sign bit is set
        sum = __dp4a(static_cast<int>(__byte_perm(pos0, neg0, pick)), xs[2 * i], sum);
        sum = __dp4a(static_cast<int>(__byte_perm(pos1, neg1, pick >> 16)), xs[2 * i + 1], sum);
      }
      acc = fmaf(scale_of(e) * x.d[b], static_cast<float>(sum), acc);
    }
    return acc;
  }
};

// Q4_K and Q6_K: the general decoders of quant_units.cuh (any byte alignment) with the
// activations in registers; the per-16 sums d * sum(q) that carry the minimums / offsets are
// formed once per matrix (prepare), exactly as activation_quant.cu's s16.
template <GgmlType T>
struct DecodedRowUnit {
  using Q = QuantUnit<T>;
  static constexpr int kSub = Q::kSub;
  static constexpr bool kSums = true;
  static constexpr int kAlign = 1;
  struct Act {
    int4 q[2 * kSub];
    float d[kSub];
    float2 s16[kSub];
  };
  __device__ static void prepare(Act& x) {
#pragma unroll
    for (int j = 0; j < kSub; ++j)
      x.s16[j] = make_float2(x.d[j] * static_cast<float>(chunk_sum(x.q[2 * j])),
                             x.d[j] * static_cast<float>(chunk_sum(x.q[2 * j + 1])));
  }
  // dot in two halves, as RowUnit<Q8_0>'s: the unit decoded once, then multiplied.
  struct Weights {
    Unit32 u[kSub];
  };
  __device__ static void weights(const uint8_t* row, int unit, Weights& w) {
    int part;
    const uint8_t* at = unit_address<Q>(row, unit, part);
    Q::decode(at, part, Iq2Tables{nullptr, nullptr}, w.u, kSub);
  }
  __device__ static float product(const Weights& w, const Act& x) {
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      const Unit32& u = w.u[j];
      int lo = __dp4a(u.q[0], x.q[2 * j].x, 0);
      lo = __dp4a(u.q[1], x.q[2 * j].y, lo);
      lo = __dp4a(u.q[2], x.q[2 * j].z, lo);
      lo = __dp4a(u.q[3], x.q[2 * j].w, lo);
      int hi = __dp4a(u.q[4], x.q[2 * j + 1].x, 0);
      hi = __dp4a(u.q[5], x.q[2 * j + 1].y, hi);
      hi = __dp4a(u.q[6], x.q[2 * j + 1].z, hi);
      hi = __dp4a(u.q[7], x.q[2 * j + 1].w, hi);
      sum += x.d[j] * (u.a0 * static_cast<float>(lo) + u.a1 * static_cast<float>(hi));
      sum -= u.b0 * x.s16[j].x + u.b1 * x.s16[j].y;
    }
    return sum;
  }
  __device__ static float dot(const uint8_t* row, int unit, const Act& x) {
    Weights w;
    weights(row, unit, w);
    return product(w, x);
  }
};
template <>
struct RowUnit<GgmlType::Q4_K> : DecodedRowUnit<GgmlType::Q4_K> {};
template <>
struct RowUnit<GgmlType::Q6_K> : DecodedRowUnit<GgmlType::Q6_K> {};

// Whether the one-row units cover a row of k weights of type T exactly (MXFP4's units are four
// blocks: a row with a partial last unit takes the general kernel).
template <GgmlType T>
constexpr bool row_unit_covers(int64_t k) {
  return k % (32 * RowUnit<T>::kSub) == 0;
}

// Lane `slot`'s activations for its S units t * L + slot of one quantised row in the layout of
// activation_quant.h, from global or shared memory (q: the row's values, d: its scales).
template <class U, int S>
__device__ __forceinline__ void load_unit_activations(const int8_t* q, const float* d, int lanes, int slot, int units,
                                                      typename U::Act (&x)[S]) {
  const int4* q16 = reinterpret_cast<const int4*>(q);
#pragma unroll
  for (int t = 0; t < S; ++t) {
    if (t * lanes + slot >= units) continue;  // past the row (and possibly past the buffer)
#pragma unroll
    for (int c = 0; c < 2 * U::kSub; ++c) x[t].q[c] = q16[(t * 2 * U::kSub + c) * lanes + slot];
#pragma unroll
    for (int j = 0; j < U::kSub; ++j) x[t].d[j] = d[(t * U::kSub + j) * lanes + slot];
    U::prepare(x[t]);
  }
}

// Whether RowUnit<T>::dot comes in two halves (weights, product) that the multi-row kernel
// runs once per unit and once per row.
template <GgmlType T>
inline constexpr bool kUnitsSplit = T == GgmlType::Q8_0 || T == GgmlType::Q4_K || T == GgmlType::Q6_K;

// Lane `slot`'s activations for its unit t * L + slot alone (load_unit_activations' t-th).
template <class U>
__device__ __forceinline__ void load_one_unit(const int8_t* q, const float* d, int lanes, int slot, int t,
                                              typename U::Act& x) {
  const int4* q16 = reinterpret_cast<const int4*>(q);
#pragma unroll
  for (int c = 0; c < 2 * U::kSub; ++c) x.q[c] = q16[(t * 2 * U::kSub + c) * lanes + slot];
#pragma unroll
  for (int j = 0; j < U::kSub; ++j) x.d[j] = d[(t * U::kSub + j) * lanes + slot];
  U::prepare(x);
}

// Lane `slot`'s activations of quantised row `row` for its S units t * L + slot.
template <GgmlType T, int S>
__device__ __forceinline__ void load_row_activations(const ActView& act, int64_t row, int slot, int units,
                                                     typename RowUnit<T>::Act (&x)[S]) {
  using U = RowUnit<T>;
  const int L = act.lanes;
  const int4* q = reinterpret_cast<const int4*>(act.q + row * act.padded_k);
  const int64_t parts = row * (act.padded_k / 32);
#pragma unroll
  for (int t = 0; t < S; ++t) {
    if (t * L + slot >= units) continue;  // past the row (and possibly past the buffer)
#pragma unroll
    for (int c = 0; c < 2 * U::kSub; ++c) x[t].q[c] = __ldg(q + (t * 2 * U::kSub + c) * L + slot);
#pragma unroll
    for (int j = 0; j < U::kSub; ++j) x[t].d[j] = __ldg(act.d + parts + (t * U::kSub + j) * L + slot);
    U::prepare(x[t]);
  }
}

// The block quantises the f32 row x (16-byte aligned, k a multiple of the unit) into shared
// memory in activation_quant.h's layout (q, then d; no s16: prepare derives the sums), one
// thread per 32 values with q8_block.cuh's functions, so the bits are those
// quantize_activations_q8 stores. The fused decode experts quantise a token's x with it
// (moe_decode.cu), and the one-row product of one matrix, which then needs no quantisation
// launch (~3.5 us each, 15 per decode layer: issue 10's profiles). Once per block, not per
// warp: every warp reading the whole f32 row from L2 doubled the kernel (2026-12-02 run).
template <int kSub>
__device__ __forceinline__ void quantize_row_to_shared(const float* __restrict__ x, int64_t k, int lanes, int8_t* q,
                                                       float* d) {
  int4* q16 = reinterpret_cast<int4*>(q);
  for (int b = static_cast<int>(threadIdx.x); b < k / 32; b += static_cast<int>(blockDim.x)) {
    const float4* src = reinterpret_cast<const float4*>(x + static_cast<int64_t>(b) * 32);
    float v[32];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float4 f = __ldg(src + i);
      v[4 * i] = f.x;
      v[4 * i + 1] = f.y;
      v[4 * i + 2] = f.z;
      v[4 * i + 3] = f.w;
    }
    uint32_t w[8];
    float scale;
    q8_quantize_thread(v, w, scale);
    const int unit = b / kSub, t = unit / lanes, slot = unit % lanes, part = t * kSub + b % kSub;
    q16[(2 * part) * lanes + slot] = make_int4(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]),
                                               static_cast<int>(w[3]));
    q16[(2 * part + 1) * lanes + slot] = make_int4(static_cast<int>(w[4]), static_cast<int>(w[5]),
                                                   static_cast<int>(w[6]), static_cast<int>(w[7]));
    d[part * lanes + slot] = scale;
  }
}

// Shared-memory bytes quantize_row_to_shared needs for a row of k values (units of W over L
// lanes, padded as activation_quant.h pads rows).
inline int row_quant_smem_bytes(int64_t k, int unit_weights, int lanes) {
  const int64_t padded = padded_row_values(k, ActivationLayout{unit_weights, lanes});
  return static_cast<int>((padded + 15) / 16 * 16 + padded / 32 * 4);
}

// Bytes of one row's quantised activations in shared memory: its values, then its scales
// (quantize_row_to_shared's layout), rounded up to 16 so that rows can follow one another.
__host__ __device__ inline int64_t row_quant_smem_stride(int64_t padded_k) {
  return ((padded_k + 15) / 16 * 16 + padded_k / 32 * 4 + 15) / 16 * 16;
}

// The products of one staged group of `rows` weight rows with one activation row (x: this
// lane's units of it) into out[0, rows): each output is its lane group's units summed in
// order, then the group's shuffle tree. Both row kernels below run exactly this, so an
// output's bits do not depend on how many activation rows share a launch.
template <GgmlType T, int S>
__device__ __forceinline__ void group_row_products(const MatvecArgs& a, const uint8_t* rows_at, int rows,
                                                   const typename RowUnit<T>::Act (&x)[S], int slot,
                                                   int rows_per_pass, int lane_row, float* out) {
  using U = RowUnit<T>;
  const int L = a.lanes_per_row;
  // Two rows per pass of the lane groups, without a branch between them, so their loads,
  // products and shuffle sums interleave; the rows left over take single passes.
  const int pair_rows = 2 * rows_per_pass;
  int rr0 = 0;
  for (; rr0 + pair_rows <= rows; rr0 += pair_rows) {
    const uint8_t* row0 = rows_at + static_cast<int64_t>(rr0 + lane_row) * a.row_bytes;
    const uint8_t* row1 = row0 + static_cast<int64_t>(rows_per_pass) * a.row_bytes;
    float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll
    for (int t = 0; t < S; ++t) {
      const int unit = t * L + slot;
      if (unit < a.units_per_row) {
        acc0 += U::dot(row0, unit, x[t]);
        acc1 += U::dot(row1, unit, x[t]);
      }
    }
#pragma unroll 1
    for (int o = L >> 1; o > 0; o >>= 1) {  // within the lane group
      acc0 += __shfl_xor_sync(0xFFFFFFFFu, acc0, o);
      acc1 += __shfl_xor_sync(0xFFFFFFFFu, acc1, o);
    }
    if (slot == 0) {
      out[rr0 + lane_row] = acc0;
      out[rr0 + rows_per_pass + lane_row] = acc1;
    }
  }
  for (; rr0 < rows; rr0 += rows_per_pass) {
    const int rr = rr0 + lane_row;
    float acc = 0.0f;
    if (rr < rows) {
      const uint8_t* row = rows_at + static_cast<int64_t>(rr) * a.row_bytes;
#pragma unroll
      for (int t = 0; t < S; ++t) {
        const int unit = t * L + slot;
        if (unit < a.units_per_row) acc += U::dot(row, unit, x[t]);
      }
    }
#pragma unroll 1
    for (int o = L >> 1; o > 0; o >>= 1) acc += __shfl_xor_sync(0xFFFFFFFFu, acc, o);
    if (rr < rows && slot == 0) out[rr] = acc;
  }
}

// kPlain with one activation row per matrix (quantised by activation_quant.h, or by the block
// itself when act_smem_bytes > 0); S >= the units per lane (units_per_row / L, rounded up).
template <GgmlType T, int S>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) matvec_row_kernel(const MatvecArgs a) {
  extern __shared__ __align__(16) uint8_t smem[];
  using U = RowUnit<T>;
  allow_next_kernel();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint8_t* ring = smem + static_cast<int64_t>(warp) * kStages * a.stage_bytes;
  const int64_t total = a.n_tasks * a.row_blocks;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s)
    issue_group<MatvecMode::kPlain>(a, first + s * stride, total, ring + s * a.stage_bytes, lane);
  wait_for_previous_kernel();

  const int L = a.lanes_per_row;
  const int slot = lane & (L - 1);
  const int log2_lanes = __ffs(L) - 1;
  const int rows_per_pass = 32 >> log2_lanes, lane_row = lane >> log2_lanes;
  // Fused quantisation (one task): the activations in the last act_smem_bytes of smem.
  int8_t* act_q = reinterpret_cast<int8_t*>(smem + static_cast<int64_t>(kWarpsPerBlock) * kStages * a.stage_bytes);
  const int64_t padded_k = static_cast<int64_t>((a.units_per_row + L - 1) / L) * L * 32 * U::kSub;
  float* act_d = reinterpret_cast<float*>(act_q + (padded_k + 15) / 16 * 16);  // row_quant_smem_bytes' layout
  if (a.act_smem_bytes > 0) {
    quantize_row_to_shared<U::kSub>(a.act.f, a.act.k, L, act_q, act_d);
    __syncthreads();
  }
  typename U::Act x[S];
  int64_t loaded_task = -1;
  for (int64_t it = 0;; ++it) {
    const int64_t g = first + it * stride;
    if (g >= total) break;
    issue_group<MatvecMode::kPlain>(a, g + (kStages - 1) * stride, total,
                                    ring + ((it + kStages - 1) % kStages) * a.stage_bytes, lane);
    int64_t task, r0;
    split_group(a, g, task, r0);
    if (task != loaded_task) {
      if (a.act_smem_bytes > 0) load_unit_activations<U, S>(act_q, act_d, L, slot, a.units_per_row, x);
      else load_row_activations<T, S>(a.act, task, slot, a.units_per_row, x);
      loaded_task = task;
    }
    cp_async_wait<kStages - 1>();
    __syncwarp();
    const uint8_t* stage = ring + (it % kStages) * a.stage_bytes;
    const uint8_t* src = source_rows<MatvecMode::kPlain>(a, task, 0, r0);
    const uint8_t* rows_at = stage + (reinterpret_cast<uintptr_t>(src) & 15);
    const int rows = static_cast<int>(min(static_cast<int64_t>(a.rows_per_group), a.n - r0));
    group_row_products<T, S>(a, rows_at, rows, x, slot, rows_per_pass, lane_row, a.out + task * a.n + r0);
    __syncwarp();
  }
  cp_async_wait<0>();
}

// kPlain with a.act_rows (2..kRowKernelMaxRows, matvec.h) activation rows per matrix: the
// one-row kernel's products for each row in turn over the same staged weights, so every row
// gets the bits matvec_row_kernel gives it alone (a decode step and an MTP verify step agree
// bit for bit). Activation row r of task b is row b * act_rows + r (shared_act: r for every
// task), its outputs row b * act_rows + r of out. The activations are not kept in registers
// across groups (a row's slice costs as many as the one-row kernel holds): each group reloads
// them, from shared memory when the block quantised the rows itself (act_smem_bytes > 0: one
// task, or shared_act; row_quant_smem_stride bytes a row), else from the quantised rows in L1.
// Q8_0, Q4_K and Q6_K (kUnitsSplit) read and decode each unit once for all the rows (the Q6_K
// head's decode is most of its one-row cost); the other types run the whole row per row.
template <GgmlType T, int S>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) matvec_rows_kernel(const MatvecArgs a) {
  extern __shared__ __align__(16) uint8_t smem[];
  using U = RowUnit<T>;
  allow_next_kernel();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint8_t* ring = smem + static_cast<int64_t>(warp) * kStages * a.stage_bytes;
  const int64_t total = a.n_tasks * a.row_blocks;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s)
    issue_group<MatvecMode::kPlain>(a, first + s * stride, total, ring + s * a.stage_bytes, lane);
  wait_for_previous_kernel();

  const int L = a.lanes_per_row;
  const int slot = lane & (L - 1);
  const int log2_lanes = __ffs(L) - 1;
  const int rows_per_pass = 32 >> log2_lanes, lane_row = lane >> log2_lanes;
  uint8_t* act_smem = smem + static_cast<int64_t>(kWarpsPerBlock) * kStages * a.stage_bytes;
  const int64_t padded_k = static_cast<int64_t>((a.units_per_row + L - 1) / L) * L * 32 * U::kSub;
  const int64_t act_stride = row_quant_smem_stride(padded_k);
  const int64_t scales_at = (padded_k + 15) / 16 * 16;
  if (a.act_smem_bytes > 0) {
    for (int r = 0; r < a.act_rows; ++r) {
      int8_t* q = reinterpret_cast<int8_t*>(act_smem + r * act_stride);
      quantize_row_to_shared<U::kSub>(a.act.f + r * a.act.k, a.act.k, L, q, reinterpret_cast<float*>(q + scales_at));
    }
    __syncthreads();
  }
  for (int64_t it = 0;; ++it) {
    const int64_t g = first + it * stride;
    if (g >= total) break;
    issue_group<MatvecMode::kPlain>(a, g + (kStages - 1) * stride, total,
                                    ring + ((it + kStages - 1) % kStages) * a.stage_bytes, lane);
    int64_t task, r0;
    split_group(a, g, task, r0);
    cp_async_wait<kStages - 1>();
    __syncwarp();
    const uint8_t* stage = ring + (it % kStages) * a.stage_bytes;
    const uint8_t* src = source_rows<MatvecMode::kPlain>(a, task, 0, r0);
    const uint8_t* rows_at = stage + (reinterpret_cast<uintptr_t>(src) & 15);
    const int rows = static_cast<int>(min(static_cast<int64_t>(a.rows_per_group), a.n - r0));
    if constexpr (kUnitsSplit<T>) {
      // Each unit's weights read (and decoded) once, then multiplied with every row's
      // activations: RowUnit::dot's two halves, the same operations, the same bits.
      const int64_t row0 = a.shared_act ? 0 : task * a.act_rows;
      const bool fused = a.act_smem_bytes > 0;
      const int8_t* qb = fused ? reinterpret_cast<const int8_t*>(act_smem) : a.act.q + row0 * a.act.padded_k;
      const uint8_t* db = fused ? act_smem + scales_at
                                : reinterpret_cast<const uint8_t*>(a.act.d + row0 * (a.act.padded_k / 32));
      const int64_t q_stride = fused ? act_stride : a.act.padded_k;
      const int64_t d_stride = fused ? act_stride : a.act.padded_k / 32 * 4;
      float* out = a.out + task * a.act_rows * a.n + r0;
      for (int rr0 = 0; rr0 < rows; rr0 += rows_per_pass) {
        const int rr = rr0 + lane_row;
        float acc[kRowKernelMaxRows];
#pragma unroll
        for (int r = 0; r < kRowKernelMaxRows; ++r) acc[r] = 0.0f;
        if (rr < rows) {
          const uint8_t* row = rows_at + static_cast<int64_t>(rr) * a.row_bytes;
#pragma unroll
          for (int t = 0; t < S; ++t) {
            const int unit = t * L + slot;
            if (unit < a.units_per_row) {
              typename U::Weights w;
              U::weights(row, unit, w);
#pragma unroll
              for (int r = 0; r < kRowKernelMaxRows; ++r) {
                if (r < a.act_rows) {
                  typename U::Act x;
                  load_one_unit<U>(qb + r * q_stride, reinterpret_cast<const float*>(db + r * d_stride), L, slot, t,
                                   x);
                  acc[r] += U::product(w, x);
                }
              }
            }
          }
        }
#pragma unroll
        for (int r = 0; r < kRowKernelMaxRows; ++r) {
          if (r < a.act_rows) {
            float v = acc[r];
#pragma unroll 1
            for (int o = L >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
            if (rr < rows && slot == 0) out[r * a.n + rr] = v;
          }
        }
      }
      __syncwarp();
      continue;
    }
#pragma unroll 1
    for (int r = 0; r < a.act_rows; ++r) {
      typename U::Act x[S];
      if (a.act_smem_bytes > 0) {
        const int8_t* q = reinterpret_cast<const int8_t*>(act_smem + r * act_stride);
        load_unit_activations<U, S>(q, reinterpret_cast<const float*>(q + scales_at), L, slot, a.units_per_row, x);
      } else {
        load_row_activations<T, S>(a.act, a.shared_act ? r : task * a.act_rows + r, slot, a.units_per_row, x);
      }
      group_row_products<T, S>(a, rows_at, rows, x, slot, rows_per_pass, lane_row,
                               a.out + (task * a.act_rows + r) * a.n + r0);
    }
    __syncwarp();
  }
  cp_async_wait<0>();
}

}  // namespace dsv4::cuda::detail
