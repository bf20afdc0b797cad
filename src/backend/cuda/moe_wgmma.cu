// Routed experts on wgmma with the weights decoded into the A fragments (moe_wgmma.h).
//
// Block: G warpgroups (4 for the K-quants, 2 for Q8_0, whose raw rows take twice the shared
// memory), one expert tile (<= 128 pairs) x 64G weight rows. Warpgroup g owns block rows
// 64g..64g+63 (gate/up: the first G/2 warpgroups gate rows, the others the same rows of up;
// down: 64G consecutive rows) and every column (pair) of the tile: one
// wgmma.m64n128k16 (n64 / n96 when the tile holds <= 64 / <= 96 pairs) per 16 of k, A from registers,
// B from shared memory, 64 f32 accumulators per thread (n96 for tiles of 65-96 pairs: 48).
//
// k streams through two shared-memory stages of 256 (one K-quant super-block, eight Q8_0
// blocks): each holds the raw block bytes of the 64G rows (16-byte cp.async copies of each
// row's span, whatever its alignment, as mmq_kernel.cuh does) and the tile's activation rows,
// 128 x 256 BF16 as four 64-wide tiles in the 128-byte swizzle the K-major B descriptor names,
// read by all G warpgroups (so 4 warpgroups halve the activation traffic per product, and
// give each scheduler 4 warps to hide the decode's latency: with 2, ncu measured 42-51% of
// the issue slots busy, 4.4 cycles per issued instruction). The copies of stage s + 1 run
// while stage s multiplies.
//
// A fragment of m64nNk16 (per warp: 16 rows, lane = 4 * g + t): a0 = row g, k 2t..2t+1;
// a1 = row g + 8, same k; a2 = row g, k 2t+8..2t+9; a3 = row g + 8, same k: each lane decodes
// 8 weights per 16 of k: Q2_K / Q3_K in BF16 pair arithmetic (WgPairDecode below), Q8_0 (and
// every type with KernelChoice::moe_wgmma_pair_decode off) in f32 as quant_decode.h defines
// them, rounded to BF16 (WgDecode). The decode of step kk + 1 runs while step kk's wgmma
// does; two register sets alternate, and a set is rewritten only after wgmma.wait_group 1
// has retired the wgmma that read it.
#include "backend/cuda/moe_wgmma.h"

#include <cstring>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/matvec.h"
#include "backend/cuda/wgmma.cuh"
#include "backend/cuda/mmq_kernel.cuh"  // MmqType (raw block geometry), cp.async, ld_a2/ld_a4/ld_u16

namespace dsv4::cuda::detail {
namespace {

constexpr int kStageK = 256;
constexpr int kSteps = kStageK / 16;
constexpr int kTokens = kMoeWgmmaTileTokens;
constexpr int kBSubBytes = kTokens * 128;    // 128 rows x 64 BF16, one swizzled k-tile
constexpr int kBBytes = 4 * kBSubBytes;      // the stage's 256 of k

enum class WgMode { kGateUp, kDown };

template <GgmlType T>
struct WgStage {
  using C = MmqType<T>;
  static constexpr int kGroups = T == GgmlType::Q8_0 ? 2 : 4;  // warpgroups per block
  static constexpr int kThreads = 128 * kGroups;
  static constexpr int kRows = 64 * kGroups;  // weight rows per block (gate/up: half of each)
  static constexpr int kW = kRows * C::kSlotBytes;
  static constexpr int kBytes = kBBytes + ((kW + 1023) & ~1023);  // B first: 1024-byte aligned
  static constexpr int kSmem = 2 * kBytes + 1024;                 // + slack to align the base
  static_assert(kThreads == 2 * kRows, "two copying threads per block row");
};

struct WgArgs {
  const uint8_t* w[2] = {nullptr, nullptr};  // gate/up: gate, up; down: down
  int64_t row_bytes = 0;
  int64_t matrix_stride = 0;  // bytes between experts
  int64_t n = 0;              // rows per expert
  int64_t k = 0;
  const __nv_bfloat16* act = nullptr;  // [rows][k]
  ExpertTiles tiles;
  int top_k = 1;
  const float* pair_weight = nullptr;
  float limit = 0.0f;
  void* out = nullptr;  // gate/up: BF16 [pairs][n]; down: f32 [pairs][n]
  bool n96 = false;     // tiles of 65-96 pairs on m64n96k16
};

// ---- wgmma with A in registers ---------------------------------------------------------

__device__ __forceinline__ void wgmma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                         std::integral_constant<int, 128>) {
  asm volatile(
      "{\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "
      "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, 1, 1, 1, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

__device__ __forceinline__ void wgmma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                         std::integral_constant<int, 96>) {
  asm volatile(
      "{\n"
      "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, "
      "{%48, %49, %50, %51}, %52, 1, 1, 1, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

__device__ __forceinline__ void wgmma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                         std::integral_constant<int, 64>) {
  asm volatile(
      "{\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, 1, 1, 1, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &v, sizeof(u));
  return u;
}

// ---- per-type decoders: the two weight pairs (k 16s+2t, +1) and (16s+2t+8, +9) of a row ----
// `row`: the row's span of this stage in shared memory (skew applied).

template <GgmlType T>
struct WgDecode;

// block_q2_K: scales[16] (low nibble scale, high nibble min), qs[64], d, dmin. Element e:
// (qs[32 (e / 128) + e % 32] >> 2 ((e % 128) / 32)) & 3, sub-block e / 16.
template <>
struct WgDecode<GgmlType::Q2_K> {
  float d = 0.0f, dmin = 0.0f;
  __device__ __forceinline__ void begin(const uint8_t* row) {
    const uint32_t dd = ld_a4(row + 80);
    d = half_to_float(dd);
    dmin = half_to_float(dd >> 16);
  }
  template <int S>
  __device__ __forceinline__ void pairs(const uint8_t* row, int t, uint32_t& lo, uint32_t& hi) const {
    const uint32_t sc = row[S];
    const float dl = d * static_cast<float>(sc & 0xFu), ml = dmin * static_cast<float>(sc >> 4);
    const uint8_t* q = row + 16 + 32 * (S / 8) + 16 * (S % 2) + 2 * t;
    constexpr int kShift = 2 * ((S % 8) / 2);
    const uint32_t b0 = ld_u16(q) >> kShift, b1 = ld_u16(q + 8) >> kShift;
    auto v = [&](uint32_t bits) { return fmaf(small_int_to_float(static_cast<int>(bits & 3u)), dl, -ml); };
    lo = pack_bf16(v(b0), v(b0 >> 8));
    hi = pack_bf16(v(b1), v(b1 >> 8));
  }
};

// block_q3_K: hmask[32], qs[64], scales[12] (16 six-bit scales, + 32), d. Element e:
// d * (scale - 32) * (low 2 bits of qs as Q2_K + 4 * bit e / 32 of hmask[e % 32] - 4).
template <>
struct WgDecode<GgmlType::Q3_K> {
  float d = 0.0f;
  uint32_t sc[4] = {0, 0, 0, 0};  // byte j % 4 of sc[j / 4]: scale j + 32 (ggml's unpacking)
  __device__ __forceinline__ void begin(const uint8_t* row) {
    d = half_to_float(ld_u16(row + 108));
    const uint32_t a0 = ld_a2(row + 96), a1 = ld_a2(row + 100), tmp = ld_a2(row + 104);
    sc[0] = (a0 & 0x0F0F0F0Fu) | (((tmp >> 0) & 0x03030303u) << 4);
    sc[1] = (a1 & 0x0F0F0F0Fu) | (((tmp >> 2) & 0x03030303u) << 4);
    sc[2] = ((a0 >> 4) & 0x0F0F0F0Fu) | (((tmp >> 4) & 0x03030303u) << 4);
    sc[3] = ((a1 >> 4) & 0x0F0F0F0Fu) | (((tmp >> 6) & 0x03030303u) << 4);
  }
  template <int S>
  __device__ __forceinline__ void pairs(const uint8_t* row, int t, uint32_t& lo, uint32_t& hi) const {
    const int scale = static_cast<int>((sc[S / 4] >> (8 * (S % 4))) & 0xFFu) - 32;
    const float dl = d * small_int_to_float(scale);
    const int l = 16 * (S % 2) + 2 * t;
    constexpr int kShift = 2 * ((S % 8) / 2), kHigh = S / 2;
    const uint32_t q0 = ld_u16(row + 32 + 32 * (S / 8) + l) >> kShift, q1 = ld_u16(row + 40 + 32 * (S / 8) + l) >> kShift;
    const uint32_t h0 = ld_u16(row + l) >> kHigh, h1 = ld_u16(row + l + 8) >> kHigh;
    auto v = [&](uint32_t q, uint32_t h) {
      return dl * small_int_to_float(static_cast<int>((q & 3u) | ((h & 1u) << 2)) - 4);
    };
    lo = pack_bf16(v(q0, h0), v(q0 >> 8, h0 >> 8));
    hi = pack_bf16(v(q1, h1), v(q1 >> 8, h1 >> 8));
  }
};

// block_q8_0: d, qs[32]; eight blocks per stage.
template <>
struct WgDecode<GgmlType::Q8_0> {
  __device__ __forceinline__ void begin(const uint8_t*) {}
  template <int S>
  __device__ __forceinline__ void pairs(const uint8_t* row, int t, uint32_t& lo, uint32_t& hi) const {
    const uint8_t* b = row + 34 * (S / 2);
    const float d = half_to_float(ld_u16(b));
    const uint8_t* q = b + 2 + 16 * (S % 2) + 2 * t;
    const uint32_t b0 = ld_u16(q), b1 = ld_u16(q + 8);
    auto v = [&](uint32_t bits) { return d * static_cast<float>(static_cast<int8_t>(bits & 0xFFu)); };
    lo = pack_bf16(v(b0), v(b0 >> 8));
    hi = pack_bf16(v(b1), v(b1 >> 8));
  }
};

// ---- pair decoders: Q2_K / Q3_K in BF16 pair arithmetic (KernelChoice::moe_wgmma_pair_decode) ----
//
// The f32 decoders above spend ~30 (Q2_K) and ~43 (Q3_K) instructions per row and step on 4
// weights, and the wgmma tiles are bound by that decode: a tile costs about the same whatever
// its pairs (docs/PERFORMANCE.md, ninth run). These make each pair of weights with four or six
// operations on packed BF16:
// * a code of 2 bits (Q3_K: 3 with its hmask bit) goes into the low mantissa bits of the BF16
//   128.0 (0x4300), so one AND/OR turns two codes into the BF16 pair (128 + q0, 128 + q1), and
//   a subtraction of 128 (Q3_K: 132, folding its -4) makes them exact small integers;
// * one fma.rn.bf16x2 applies the sub-block's scale and minimum (Q3_K: one mul.rn.bf16x2).
// The four lanes t = 0..3 of a row need the same sub-block scale in each step: each computes,
// at every fourth step, the scale of step S + t in f32 (rounded once to BF16), and the step
// takes it from lane t = S % 4 by a shuffle. The qs bytes of a lane repeat every other step
// with another shift: they are loaded (and spread to one byte per 16-bit half) once per 8
// steps, Q3_K's hmask bytes once per stage.
// Error: the scale d * sc and the minimum dmin * m are rounded to BF16 (2^-9 relative each)
// before the fma, which rounds once more: |error| <= 2^-9 (|q d sc| + |dmin m| + |w|) per
// weight, where the f32 decoders had 2^-9 |w|. docs/CUDA.md, "Routed experts on wgmma".

__device__ __forceinline__ uint32_t spread_bytes(uint32_t two_bytes) {  // b0 -> bits 0-7, b1 -> 16-23
  return __byte_perm(two_bytes, 0u, 0x4140u);
}
__device__ __forceinline__ uint32_t bf16x2_sub(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("sub.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t bf16x2_fma(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
// (a & mask) | add in one LOP3: written out, the compiler splits it in two (one immediate each).
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t mask, uint32_t add) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(mask), "r"(add));
  return d;
}
// The scale computed by lane 4g + (S % 4) of this lane's row group g.
template <int S>
__device__ __forceinline__ uint32_t scale_of_step(uint32_t mine, int lane) {
  return __shfl_sync(0xFFFFFFFFu, mine, (lane & ~3) | (S % 4));
}

constexpr uint32_t kBf16Pair128 = 0x43004300u;  // (128, 128)
constexpr uint32_t kBf16Pair132 = 0x43044304u;  // (132, 132)

template <GgmlType T>
struct WgPairDecode;

template <>
struct WgPairDecode<GgmlType::Q2_K> {
  float d = 0.0f, neg_dmin = 0.0f;
  uint32_t qs[2][2] = {{0, 0}, {0, 0}};  // [S % 2][k 2t.. / 2t+8..]: spread qs bytes of this half stage
  uint32_t scale = 0, minimum = 0;       // step 4 (S / 4) + t's (d sc, d sc) and (-dmin m, -dmin m)
  __device__ __forceinline__ void begin(const uint8_t* row, int) {
    const uint32_t dd = ld_a4(row + 80);
    d = half_to_float(dd);
    neg_dmin = -half_to_float(dd >> 16);
  }
  template <int S>
  __device__ __forceinline__ void load(const uint8_t* row, int t) {
    if constexpr (S % 8 == 0) {
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const uint8_t* q = row + 16 + 32 * (S / 8) + 16 * p + 2 * t;
        qs[p][0] = spread_bytes(ld_u16(q));
        qs[p][1] = spread_bytes(ld_u16(q + 8));
      }
    }
    if constexpr (S % 4 == 0) {
      const uint32_t sc = row[S + t];
      const float dl = d * small_int_to_float(static_cast<int>(sc & 0xFu));
      const float ml = neg_dmin * small_int_to_float(static_cast<int>(sc >> 4));
      scale = pack_bf16(dl, dl);
      minimum = pack_bf16(ml, ml);
    }
  }
  template <int S>
  __device__ __forceinline__ void pairs(int lane, uint32_t& lo, uint32_t& hi) const {
    const uint32_t dl = scale_of_step<S>(scale, lane), ml = scale_of_step<S>(minimum, lane);
    constexpr int kShift = 2 * ((S % 8) / 2);
    auto v = [&](uint32_t spread) {
      const uint32_t codes = and_or(spread >> kShift, 0x00030003u, kBf16Pair128);  // (128 + q0, 128 + q1)
      return bf16x2_fma(bf16x2_sub(codes, kBf16Pair128), dl, ml);
    };
    lo = v(qs[S % 2][0]);
    hi = v(qs[S % 2][1]);
  }
};

template <>
struct WgPairDecode<GgmlType::Q3_K> {
  float d = 0.0f;
  uint32_t sc[4] = {0, 0, 0, 0};         // as WgDecode<Q3_K>
  uint32_t qs[2][2] = {{0, 0}, {0, 0}};  // as Q2_K's
  uint32_t hm[2][2] = {{0, 0}, {0, 0}};  // [S % 2][lo / hi]: spread hmask bytes, the whole stage
  uint32_t scale = 0;
  __device__ __forceinline__ void begin(const uint8_t* row, int t) {
    WgDecode<GgmlType::Q3_K> f;
    f.begin(row);
    d = f.d;
#pragma unroll
    for (int i = 0; i < 4; ++i) sc[i] = f.sc[i];
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      hm[p][0] = spread_bytes(ld_u16(row + 16 * p + 2 * t));
      hm[p][1] = spread_bytes(ld_u16(row + 16 * p + 2 * t + 8));
    }
  }
  template <int S>
  __device__ __forceinline__ void load(const uint8_t* row, int t) {
    if constexpr (S % 8 == 0) {
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const uint8_t* q = row + 32 + 32 * (S / 8) + 16 * p + 2 * t;
        qs[p][0] = spread_bytes(ld_u16(q));
        qs[p][1] = spread_bytes(ld_u16(q + 8));
      }
    }
    if constexpr (S % 4 == 0) {  // scale S + t: byte t of sc[S / 4]
      const int s6 = static_cast<int>((sc[S / 4] >> (8 * t)) & 0xFFu) - 32;
      const float dl = d * small_int_to_float(s6);
      scale = pack_bf16(dl, dl);
    }
  }
  template <int S>
  __device__ __forceinline__ void pairs(int lane, uint32_t& lo, uint32_t& hi) const {
    const uint32_t dl = scale_of_step<S>(scale, lane);
    constexpr int kShift = 2 * ((S % 8) / 2), kHigh = S / 2;
    auto v = [&](uint32_t q, uint32_t h) {
      const uint32_t high = kHigh >= 2 ? h >> (kHigh - 2) : h << (2 - kHigh);  // the hmask bit to bit 2
      const uint32_t codes = and_or(high, 0x00040004u, and_or(q >> kShift, 0x00030003u, kBf16Pair128));
      return bf16x2_mul(bf16x2_sub(codes, kBf16Pair132), dl);  // d sc (q + 4 h - 4)
    };
    lo = v(qs[S % 2][0], hm[S % 2][0]);
    hi = v(qs[S % 2][1], hm[S % 2][1]);
  }
};

// ---- the kernel ---------------------------------------------------------------------------

// Block row r's source row (gate/up: rows 0..R/2-1 of the tile in gate, then the same rows of up).
template <WgMode M, int R>
__device__ __forceinline__ const uint8_t* row_source(const WgArgs& a, int64_t expert, int64_t tile, int r) {
  const uint8_t* base = a.w[0];
  int64_t row;
  if constexpr (M == WgMode::kGateUp) {
    row = tile * (R / 2) + r % (R / 2);
    if (r >= R / 2) base = a.w[1];
  } else {
    row = tile * R + r;
  }
  return base + expert * a.matrix_stride + row * a.row_bytes;
}

// Stage `stage`'s copies into `buf`: weights (two threads per block row, as mmq_kernel.cuh),
// then the live columns' 256 activations (32 chunks of 16 bytes per column).
template <GgmlType T>
__device__ __forceinline__ void issue_stage(const WgArgs& a, const uint8_t* copy_row, const int* col_act, int live,
                                            int stage, uint8_t* buf) {
  using C = MmqType<T>;
  constexpr int kThreads = WgStage<T>::kThreads;
  {
    const int r = threadIdx.x >> 1, h = threadIdx.x & 1;
    const uint8_t* src = copy_row + static_cast<int64_t>(stage) * C::kStageBytes;
    const uint8_t* end = src + C::kStageBytes;
    const uint8_t* aligned = reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(src) & ~uintptr_t{15});
    uint8_t* dst = buf + kBBytes + r * C::kSlotBytes;
#pragma unroll
    for (int ch = 0; ch < C::kSlotChunks; ch += 2) {
      const int c = ch + h;
      if (c < C::kSlotChunks && aligned + 16 * c < end) cp_async16(dst + 16 * c, aligned + 16 * c);
    }
  }
  const int64_t k0 = static_cast<int64_t>(stage) * kStageK;
  for (int q = threadIdx.x; q < live * 32; q += kThreads) {
    const int col = q >> 5, piece = q & 31;  // piece: 8 BF16 of the stage's 256
    const int sub = piece >> 3, chunk = piece & 7;
    uint8_t* dst = buf + sub * kBSubBytes + col * 128 + ((chunk ^ (col & 7)) << 4);
    cp_async16(dst, a.act + static_cast<int64_t>(col_act[col]) * a.k + k0 + 8 * piece);
  }
}

// The 16 steps of one stage for one warpgroup: A decoded from `row0` / `row1` (rows g, g + 8).
template <GgmlType T, bool Pair, int NB>
__device__ __forceinline__ void multiply_stage(const uint8_t* row0, const uint8_t* row1, uint32_t b_base, int lane,
                                               float (&acc)[64]) {
  const int t = lane & 3;
  using Decode = std::conditional_t<Pair, WgPairDecode<T>, WgDecode<T>>;
  Decode d0, d1;
  if constexpr (Pair) {
    d0.begin(row0, t);
    d1.begin(row1, t);
  } else {
    d0.begin(row0);
    d1.begin(row1);
  }
  uint32_t a[2][4];
  const std::integral_constant<int, NB> width{};
  auto decode = [&](auto step, uint32_t (&frag)[4]) {
    constexpr int S = decltype(step)::value;
    if constexpr (Pair) {
      d0.template load<S>(row0, t);
      d1.template load<S>(row1, t);
      d0.template pairs<S>(lane, frag[0], frag[2]);
      d1.template pairs<S>(lane, frag[1], frag[3]);
    } else {
      d0.template pairs<S>(row0, t, frag[0], frag[2]);
      d1.template pairs<S>(row1, t, frag[1], frag[3]);
    }
  };
  auto issue = [&](auto step, const uint32_t (&frag)[4]) {
    constexpr int S = decltype(step)::value;
    wgmma_fence();
    wgmma_rs(acc, frag, wgmma_swizzle128_descriptor(b_base + (S / 4) * kBSubBytes + (S % 4) * 32), width);
    wgmma_commit();
  };
  decode(std::integral_constant<int, 0>{}, a[0]);
  [&]<int... S>(std::integer_sequence<int, S...>) {
    (
        [&] {
          issue(std::integral_constant<int, S>{}, a[S % 2]);
          if constexpr (S + 1 < kSteps) {
            wgmma_wait<1>();  // the wgmma of step S - 1, which read a[(S + 1) % 2], has retired
            decode(std::integral_constant<int, S + 1>{}, a[(S + 1) % 2]);
          }
        }(),
        ...);
  }(std::make_integer_sequence<int, kSteps>{});
  wgmma_wait<0>();
  wgmma_fence_accumulators<NB / 2>(acc);  // m64nNk16: N / 2 accumulators
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }

template <GgmlType T, WgMode M, bool Pair>
__global__ void __launch_bounds__(WgStage<T>::kThreads, 1) moe_wgmma_kernel(const WgArgs a) {
  using C = MmqType<T>;
  using S = WgStage<T>;
  constexpr int kRows = S::kRows, kGroups = S::kGroups;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) & 1023u)) & 1023u);
  __shared__ int col_act[kTokens], col_out[kTokens];
  __shared__ float col_weight[kTokens];
  __shared__ int tile_info[2];  // expert, live pairs

  const int64_t tile = blockIdx.x;
  const int task = static_cast<int>(blockIdx.y);
  allow_next_kernel();
  wait_for_previous_kernel();  // the tile tables and activations come from the kernels before
  if (task >= *a.tiles.n_tiles) return;
  if (threadIdx.x < kTokens) {
    const int c = threadIdx.x;
    const int first = a.tiles.tile_first[task], count = a.tiles.tile_count[task];
    const int pair = a.tiles.sorted_pairs[first + min(c, count - 1)];
    col_act[c] = M == WgMode::kGateUp ? pair / a.top_k : pair;
    col_out[c] = c < count ? pair : -1;
    col_weight[c] = M == WgMode::kGateUp && c < count ? a.pair_weight[pair] : 0.0f;
    if (c == 0) {
      tile_info[0] = a.tiles.tile_expert[task];
      tile_info[1] = count;
    }
  }
  __syncthreads();
  const int64_t expert = tile_info[0];
  const int live = tile_info[1];
  // The narrowest product that holds the tile's pairs: m64n64k16, n96 (KernelChoice::
  // moe_wgmma_n96: a tile of 65-96 pairs, the most common at 4096 tokens over 256 experts,
  // then spends no tensor time on 32 empty columns) or n128.
  const int width = live <= 64 ? 64 : live <= 96 && a.n96 ? 96 : 128;
  const int stages = static_cast<int>(a.k / kStageK);

  const uint8_t* copy_row = row_source<M, kRows>(a, expert, tile, static_cast<int>(threadIdx.x >> 1));
  issue_stage<T>(a, copy_row, col_act, live, 0, smem);
  cp_async_commit();

  const int group = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, t = lane & 3;
  const int r0 = 64 * group + 16 * warp + g;  // block rows of this lane's A fragments: r0, r0 + 8
  const uint8_t* src0 = row_source<M, kRows>(a, expert, tile, r0);
  const uint8_t* src1 = row_source<M, kRows>(a, expert, tile, r0 + 8);

  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.0f;

  for (int s = 0; s < stages; ++s) {
    cp_async_wait<0>();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async wrote what wgmma reads
    __syncthreads();  // every copy of stage s landed; every warpgroup is done with stage s - 1
    if (s + 1 < stages) issue_stage<T>(a, copy_row, col_act, live, s + 1, smem + ((s + 1) & 1) * S::kBytes);
    cp_async_commit();
    uint8_t* buf = smem + (s & 1) * S::kBytes;
    const int64_t offset = static_cast<int64_t>(s) * C::kStageBytes;
    const uint8_t* row0 = buf + kBBytes + r0 * C::kSlotBytes + (reinterpret_cast<uintptr_t>(src0 + offset) & 15);
    const uint8_t* row1 = buf + kBBytes + (r0 + 8) * C::kSlotBytes + (reinterpret_cast<uintptr_t>(src1 + offset) & 15);
    const uint32_t b_base = static_cast<uint32_t>(__cvta_generic_to_shared(buf));
    if (width == 128) {
      multiply_stage<T, Pair, 128>(row0, row1, b_base, lane, acc);
    } else if (width == 96) {
      multiply_stage<T, Pair, 96>(row0, row1, b_base, lane, acc);
    } else {
      multiply_stage<T, Pair, 64>(row0, row1, b_base, lane, acc);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the stages are free for the exchange below

  // Accumulator register 4j + 2h + e: row 16 warp + g + 8h of the warpgroup, column 8j + 2t + e.
  const int regs = width / 2;
  if constexpr (M == WgMode::kGateUp) {
    // The up warpgroups (kGroups / 2 ..) hand their accumulators to the gate warpgroups
    // holding the same rows.
    constexpr int kHalf = kGroups / 2;
    float* up = reinterpret_cast<float*>(smem) + (group % kHalf) * 64 * 128;  // [reg][128 threads]
    const int tid = threadIdx.x % 128;
    if (group >= kHalf) {
#pragma unroll
      for (int i = 0; i < 64; ++i)
        if (i < regs) up[i * 128 + tid] = acc[i];
    }
    __syncthreads();
    if (group >= kHalf) return;
    auto* h = static_cast<__nv_bfloat16*>(a.out);
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      if (i >= regs) break;
      const int col = 8 * (i / 4) + 2 * t + (i & 1);
      const int out = col_out[col];
      if (out < 0) continue;
      const float gate = fminf(acc[i], a.limit);
      const float u = fminf(fmaxf(up[i * 128 + tid], -a.limit), a.limit);
      const int64_t row = tile * (kRows / 2) + 64 * group + 16 * warp + g + 8 * ((i >> 1) & 1);
      h[static_cast<int64_t>(out) * a.n + row] = __float2bfloat16_rn(col_weight[col] * silu(gate) * u);
    }
  } else {
    auto* partial = static_cast<float*>(a.out);
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      if (i >= regs) break;
      const int col = 8 * (i / 4) + 2 * t + (i & 1);
      const int out = col_out[col];
      if (out < 0) continue;
      const int64_t row = tile * kRows + r0 + 8 * ((i >> 1) & 1);
      partial[static_cast<int64_t>(out) * a.n + row] = acc[i];
    }
  }
}

template <GgmlType T, WgMode M, bool Pair>
cudaError_t allow_shared_memory() {
  static std::once_flag once;
  static cudaError_t attribute = cudaSuccess;
  std::call_once(once, [&] {
    attribute = cudaFuncSetAttribute(&moe_wgmma_kernel<T, M, Pair>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     WgStage<T>::kSmem);
  });
  return attribute;
}

template <GgmlType T, WgMode M>
Status launch(const WgArgs& a, cudaStream_t stream) {
  // Row tiles: gate/up R/2 rows of each matrix, down R rows.
  const int64_t row_tiles = M == WgMode::kGateUp ? a.n / (WgStage<T>::kRows / 2) : a.n / WgStage<T>::kRows;
  constexpr bool kHasPair = T == GgmlType::Q2_K || T == GgmlType::Q3_K;
  const bool pair = kHasPair && kernel_choice().moe_wgmma_pair_decode;
  auto kernel = pair ? &moe_wgmma_kernel<T, M, kHasPair> : &moe_wgmma_kernel<T, M, false>;
  const cudaError_t attribute = pair ? allow_shared_memory<T, M, kHasPair>() : allow_shared_memory<T, M, false>();
  DSV4_CUDA_TRY(attribute);
  if (a.tiles.max_tiles <= 0 || row_tiles <= 0) return Status::ok();
  if (a.tiles.max_tiles > 65535)
    return Status::error("moe_wgmma: " + std::to_string(a.tiles.max_tiles) + " expert tiles, limit 65535");
  WgArgs args = a;
  args.n96 = kernel_choice().moe_wgmma_n96;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(row_tiles), static_cast<unsigned>(a.tiles.max_tiles));
  config.blockDim = dim3(WgStage<T>::kThreads);
  config.dynamicSmemBytes = WgStage<T>::kSmem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = programmatic_launch() ? 1 : 0;
  config.attrs = attr;
  config.numAttrs = 1;
  DSV4_CUDA_TRY(cudaLaunchKernelEx(&config, kernel, args));
  return Status::ok();
}

template <WgMode M>
Status dispatch(GgmlType type, const WgArgs& a, cudaStream_t stream) {
  switch (type) {
    case GgmlType::Q2_K: return launch<GgmlType::Q2_K, M>(a, stream);
    case GgmlType::Q3_K: return launch<GgmlType::Q3_K, M>(a, stream);
    case GgmlType::Q8_0: return launch<GgmlType::Q8_0, M>(a, stream);
    default: return Status::error("moe_wgmma: weight type " + std::string(ggml_type_name(type)) + " not supported");
  }
}

// k is a multiple of every supported type's block (moe_wgmma_applies).
int64_t row_bytes(GgmlType type, int64_t k) { return static_cast<int64_t>(*ggml_row_bytes(type, static_cast<uint64_t>(k))); }

}  // namespace

bool moe_wgmma_supported(GgmlType type) {
  return type == GgmlType::Q2_K || type == GgmlType::Q3_K || type == GgmlType::Q8_0;
}

bool moe_wgmma_applies(const ExpertWeights& w, int64_t pairs) {
  return moe_wgmma_supported(w.gate_up_type) && moe_wgmma_supported(w.down_type) && w.hidden % kStageK == 0 &&
         w.ffn % kStageK == 0 && w.n_experts > 0 && pairs >= kMoeWgmmaMinPairsPerExpert * w.n_experts;
}

Status moe_wgmma_gate_up(const ExpertWeights& w, const __nv_bfloat16* x, const float* pair_weight, int top_k,
                         float limit, const ExpertTiles& tiles, __nv_bfloat16* h, cudaStream_t stream) {
  WgArgs a;
  a.w[0] = static_cast<const uint8_t*>(w.gate);
  a.w[1] = static_cast<const uint8_t*>(w.up);
  a.row_bytes = row_bytes(w.gate_up_type, w.hidden);
  a.matrix_stride = a.row_bytes * w.ffn;
  a.n = w.ffn;
  a.k = w.hidden;
  a.act = x;
  a.tiles = tiles;
  a.top_k = top_k;
  a.pair_weight = pair_weight;
  a.limit = limit;
  a.out = h;
  return dispatch<WgMode::kGateUp>(w.gate_up_type, a, stream);
}

Status moe_wgmma_down(const ExpertWeights& w, const __nv_bfloat16* h, const ExpertTiles& tiles, float* partial,
                      cudaStream_t stream) {
  WgArgs a;
  a.w[0] = static_cast<const uint8_t*>(w.down);
  a.row_bytes = row_bytes(w.down_type, w.ffn);
  a.matrix_stride = a.row_bytes * w.hidden;
  a.n = w.hidden;
  a.k = w.ffn;
  a.act = h;
  a.tiles = tiles;
  a.out = partial;
  return dispatch<WgMode::kDown>(w.down_type, a, stream);
}

}  // namespace dsv4::cuda::detail
