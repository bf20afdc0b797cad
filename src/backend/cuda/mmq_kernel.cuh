// Products of quantised weights with 1-64 Q8 activation rows on the int8 tensor cores
// (mmq.h): mma.sync m16n8k32 s8.s8.s32, the weights decoded from their GGUF blocks straight
// into the A fragments in registers, the activations (activation_quant.h, layout {32, 1}:
// row-major int8, one f32 scale per 32 values, one sum per 16) as the B fragments, f32
// accumulation of each 32-wide chunk's exact int32 product.
//
// Block of 4 warps = 64 weight rows (16 per warp: one m16 tile; kGateUp: 32 gate rows and the
// same 32 up rows) x 8 * NT activation columns. The k dimension streams through a ring of
// shared-memory stages of 256 weights each (one K-quant super-block, 8 Q8_0 / MXFP4 blocks):
// every stage holds the raw block bytes of the 64 rows (16-byte cp.async copies of each row's
// span, whatever its alignment; for Q8_0 / Q6_K with up to 16 columns one bulk copy a row and
// column on an mbarrier, MmqArgs::bulk), the columns' 256 int8 activations, their scales and sums.
// A cluster of `split` blocks may share one row tile, each taking a contiguous part of k;
// rank 0 adds the others' partial tiles from their shared memory in rank order.
//
// Fragment layout (PTX ISA, mma.m16n8k32 with .s8): lane = 4 * g + t;
//   A: a0 = row g, k 4t..4t+3; a1 = row g+8, same k; a2 = row g, k 16+4t..16+4t+3; a3 = row g+8
//   B: b0 = k 4t..4t+3 of column g; b1 = k 16+4t..16+4t+3 of column g
//   C: c0 = (row g, column 2t), c1 = (g, 2t+1), c2 = (g+8, 2t), c3 = (g+8, 2t+1)
// m16n8k16 .s8 (Q6_K's two halves of a chunk) takes a0, a1 and b0 of the same k 4t..4t+3.
//
// Each chunk's int32 result becomes a float without a conversion instruction: the MMA starts
// from the bits of 1.5 * 2^23, so for |dot| < 2^22 (every type here: at most 32 * 128 * 127)
// the result read as f32 is exactly 1.5 * 2^23 + dot, and one subtraction recovers dot.
//
// Per type (w = the weight of quant_decode.h, x = dx * qx):
//   Q8_0, MXFP4  A = the int8 values (MXFP4: ggml's doubled E2M1 grid), scale per 32 and row.
//   Q4_K         A = 4-bit q; per 32: d*sc on the product, dmin*m times the 32 values' sum.
//   Q2_K         A = sc * q (<= 45, the 4-bit scale of each 16 folded in), d per super-block;
//                dmin * m per 16 times the activation sums of those 16.
//   Q3_K         A = -sc * (q - 4), in [-128, 124]: the signed 6-bit scale of each 16 folded
//                in with 16-bit-lane multiplies; -d per super-block.
//   Q6_K         two k16 MMAs per chunk on A = q - 32, the int8 scales of each 16 applied to
//                their products in f32; d per super-block.
//   Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q5_K, IQ4_XS, IQ3_XXS, IQ3_S, IQ1_S
//                A = the int8 levels (IQ1_S: 8g +- 1), scale per 32 and row on
//                the product, the minimum (Q4_1, Q5_1, Q5_K) times the 32 values' sum
//                (mmq_chunk32.cuh).
//   IQ2_XS, IQ2_S, IQ1_M  two k16 MMAs per chunk on the int8 levels, the scales of each 16
//                (with the row's d folded in) applied to their products in f32.
#pragma once

#include <cooperative_groups.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/matvec_kernel.cuh"
#include "gguf/ggml_types.h"

namespace dsv4::cuda::detail {

inline constexpr int kMmqWarps = 4;
inline constexpr int kMmqThreads = 32 * kMmqWarps;
inline constexpr int kMmqTileRows = 64;      // weight rows per block (kGateUp: 32 gate + 32 up)
inline constexpr int kMmqStageK = 256;       // weights of k per stage
inline constexpr int kMmqStageChunks = kMmqStageK / 32;
inline constexpr int kMmqXStride = kMmqStageK + 16;  // bytes per activation column (bank spread)
inline constexpr int kMmqMaxSplit = 8;       // portable cluster size

enum class MmqMode {
  kPlain,       // out[out_row(col)][row] = W[task] . x[act_row(col)], every column tile live
  kExpertDown,  // the same for expert tiles with any number of live column tiles
  kGateUp,      // out[pair][i] = w_pair * silu(min(gate_i . x, L)) * clamp(up_i . x, -L, L)
};

struct MmqArgs {
  const uint8_t* w[2] = {nullptr, nullptr};  // matrices (kGateUp: gate, up)
  int64_t row_bytes = 0;
  int64_t matrix_stride = 0;  // bytes between consecutive matrices (batch entries or experts)
  int64_t n = 0;              // rows per matrix
  int64_t k = 0;
  int k_stages = 0;           // ceil(k / kMmqStageK)
  int stages_per_split = 0;
  int split = 1;              // cluster size along k
  int64_t row_tiles = 0;      // kPlain: ceil(n / 64); kGateUp: ceil(n / 32)
  // Activations, layout {32, 1}: q [rows][k], d [rows][k / 32], s16 [rows][k / 16].
  const int8_t* q = nullptr;
  const float* d = nullptr;
  const float* s16 = nullptr;
  // Dense tasks (n_tiles == nullptr): task b is matrix b with activation and output rows
  // b * cols_per_task + j, j < cols_per_task.
  int cols_per_task = 0;
  // Expert tiles (moe_experts.cu's sort): task = tile of up to 8 * NT pairs of one expert.
  const int* n_tiles = nullptr;
  const int* tile_expert = nullptr;
  const int* tile_first = nullptr;
  const int* tile_count = nullptr;
  const int* sorted_pairs = nullptr;
  int top_k = 1;                     // kGateUp: activation row = pair / top_k
  const float* pair_weight = nullptr;
  float limit = 0.0f;
  float* out = nullptr;              // [output rows][n]
  quant::IqTables iq{};              // IQ3_XXS, IQ3_S, IQ1_S: set by launch_mmq_type
  // Stages arrive by bulk copies (one cp.async.bulk per weight row span and per activation
  // column, completion on an mbarrier per ring slot) instead of 16-byte cp.async from every
  // thread. Needs k % kMmqStageK == 0 and 16-byte aligned q, d, s16 (mmq_bulk_copies_apply).
  bool bulk = false;
};

// ---- per-type geometry ------------------------------------------------------------------

template <GgmlType T>
struct MmqType;

template <int BlockElems, int BlockBytes, int Align, bool Mins>
struct MmqGeometry {
  static constexpr int kBlockElems = BlockElems;
  static constexpr int kBlockBytes = BlockBytes;
  static constexpr int kAlign = Align;  // byte alignment every block keeps (row bytes, matrix strides)
  static constexpr bool kMins = Mins;   // reads the activation sums per 16
  static constexpr int kStageBytes = kMmqStageK / BlockElems * BlockBytes;  // bytes of one row per stage
  // A row's span starts at any offset within 16 bytes; the slot is a whole number of 16-byte
  // chunks, odd, so that rows g and g + 8 of a warp's loads fall into different banks.
  static constexpr int kSlotChunks = ((kStageBytes + 15 + 15) / 16) | 1;
  static constexpr int kSlotBytes = 16 * kSlotChunks;
};

template <> struct MmqType<GgmlType::Q8_0> : MmqGeometry<32, 34, 2, false> {};
template <> struct MmqType<GgmlType::Q2_K> : MmqGeometry<256, 84, 4, true> {};
template <> struct MmqType<GgmlType::Q3_K> : MmqGeometry<256, 110, 2, false> {};
template <> struct MmqType<GgmlType::Q4_K> : MmqGeometry<256, 144, 4, true> {};
template <> struct MmqType<GgmlType::Q6_K> : MmqGeometry<256, 210, 2, false> {};
template <> struct MmqType<GgmlType::MXFP4> : MmqGeometry<32, 17, 1, false> {};
template <> struct MmqType<GgmlType::Q4_0> : MmqGeometry<32, 18, 2, false> {};
template <> struct MmqType<GgmlType::Q4_1> : MmqGeometry<32, 20, 4, true> {};
template <> struct MmqType<GgmlType::Q5_0> : MmqGeometry<32, 22, 2, false> {};
template <> struct MmqType<GgmlType::Q5_1> : MmqGeometry<32, 24, 4, true> {};
template <> struct MmqType<GgmlType::IQ4_NL> : MmqGeometry<32, 18, 2, false> {};
template <> struct MmqType<GgmlType::Q5_K> : MmqGeometry<256, 176, 4, true> {};
template <> struct MmqType<GgmlType::IQ4_XS> : MmqGeometry<256, 136, 4, false> {};
template <> struct MmqType<GgmlType::IQ3_XXS> : MmqGeometry<256, 98, 2, false> {};
template <> struct MmqType<GgmlType::IQ3_S> : MmqGeometry<256, 110, 2, false> {};
template <> struct MmqType<GgmlType::IQ1_S> : MmqGeometry<256, 50, 2, false> {};
template <> struct MmqType<GgmlType::IQ2_XS> : MmqGeometry<256, 74, 2, false> {};
template <> struct MmqType<GgmlType::IQ2_S> : MmqGeometry<256, 82, 2, false> {};
template <> struct MmqType<GgmlType::IQ1_M> : MmqGeometry<256, 56, 4, false> {};

// Shared memory of one stage and the ring depth for NT column tiles (Ring > 0: that depth).
template <GgmlType T, int NT, int Ring = 0>
struct MmqStage {
  using C = MmqType<T>;
  static constexpr int kCols = 8 * NT;
  static constexpr int kW = kMmqTileRows * C::kSlotBytes;
  static constexpr int kX = kCols * kMmqXStride;
  static constexpr int kD = kCols * kMmqStageChunks * 4;
  static constexpr int kS = C::kMins ? kCols * 2 * kMmqStageChunks * 4 : 0;
  static constexpr int kBytes = kW + kX + kD + kS;
  static constexpr int kRing = Ring > 0 ? Ring : (3 * kBytes <= 112 * 1024 ? 3 : 2);
  static constexpr int kSmem = kRing * kBytes;
};

// ---- small helpers ----------------------------------------------------------------------

inline constexpr int kMmqBiasBits = 0x4B400000;   // 1.5 * 2^23 as f32 bits
inline constexpr float kMmqBias = 12582912.0f;

__device__ __forceinline__ float mmq_value(int biased) { return __int_as_float(biased) - kMmqBias; }
// An integer |v| < 2^22 as f32 by the same bias (an add, not a conversion instruction).
__device__ __forceinline__ float small_int_to_float(int v) { return mmq_value(kMmqBiasBits + v); }

__device__ __forceinline__ void mma_k32(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_k16(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(b0));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* smem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(s));
}

__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem));
}

// Bulk copies (the TMA unit; sm_90): global -> shared, completion counted in bytes on an
// mbarrier of the block's shared memory.
__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(arrivals));
}
// Announce `bytes` more to arrive at the barrier's current phase, without arriving.
__device__ __forceinline__ void mbarrier_expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
}
// Announce `bytes` and arrive (this thread's part of the phase).
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n"
      "}\n" ::"r"(smem_address(bar)),
      "r"(parity)
      : "memory");
}
// `bytes` (a multiple of 16) from 16-byte aligned global memory to 16-byte aligned shared memory.
__device__ __forceinline__ void bulk_copy(void* smem, const void* gmem, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_address(smem)),
      "l"(gmem), "r"(bytes), "r"(smem_address(bar))
      : "memory");
}

// 32-bit words from shared memory at 4-, 2- or 1-byte alignment (the pointers stay derived
// from the shared array, so these compile to shared loads).
__device__ __forceinline__ uint32_t ld_a4(const uint8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }
__device__ __forceinline__ uint32_t ld_a2(const uint8_t* p) {
  const uint32_t skew = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(p) & 2);
  const uint32_t* w = reinterpret_cast<const uint32_t*>(p - skew);
  return __byte_perm(w[0], w[1], skew != 0 ? 0x5432u : 0x3210u);
}
__device__ __forceinline__ uint32_t ld_a1(const uint8_t* p) {
  const uint32_t skew = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(p) & 3);
  const uint32_t* w = reinterpret_cast<const uint32_t*>(p - skew);
  return __funnelshift_r(w[0], w[1], 8 * skew);
}
__device__ __forceinline__ uint32_t ld_u16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }
__device__ __forceinline__ float half_to_float(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits & 0xFFFFu)));
}

}  // namespace dsv4::cuda::detail

#include "backend/cuda/mmq_chunk32.cuh"

namespace dsv4::cuda::detail {

// The activations of one stage as a warp sees them.
struct MmqStageView {
  const uint8_t* x;   // [cols][kMmqXStride] int8
  const float* d;     // [cols][8]
  const float* s16;   // [cols][16]
  quant::IqTables iq;  // the i-quants' codebooks (MmqArgs::iq)
};

// B fragments of chunk c for column tiles j (and j + 1 with x4): lane i addresses row i % 8 of
// matrix i / 8; matrices: (tile j, k 0-15), (tile j, k 16-31), (tile j+1, k 0-15), (tile j+1, 16-31).
// Only the first `live` tiles are loaded (a block-uniform count).
template <int NT>
__device__ __forceinline__ void load_b(const MmqStageView& v, int c, int lane, int live, uint32_t (&b)[NT][2]) {
#pragma unroll
  for (int j = 0; j < NT; j += 2) {
    if (j >= live) break;
    if (j + 1 < NT && j + 1 < live) {
      const int col = 8 * j + 8 * (lane >> 4) + (lane & 7);
      uint32_t r[4];
      ldmatrix_x4(r, v.x + col * kMmqXStride + 32 * c + 16 * ((lane >> 3) & 1));
      b[j][0] = r[0];
      b[j][1] = r[1];
      b[j + 1][0] = r[2];
      b[j + 1][1] = r[3];
    } else {
      const int col = 8 * j + (lane & 7);
      uint32_t r[2];
      ldmatrix_x2(r, v.x + col * kMmqXStride + 32 * c + 16 * ((lane >> 3) & 1));
      b[j][0] = r[0];
      b[j][1] = r[1];
    }
  }
}

// The scales of this lane's two output columns (2t, 2t + 1 of tile j) for chunk c.
__device__ __forceinline__ float2 col_scales(const MmqStageView& v, int j, int t, int c) {
  const int col = 8 * j + 2 * t;
  return make_float2(v.d[col * kMmqStageChunks + c], v.d[(col + 1) * kMmqStageChunks + c]);
}
// The sums of 16 values h (0..15 within the stage) for the same two columns.
__device__ __forceinline__ float2 col_sums(const MmqStageView& v, int j, int t, int h) {
  const int col = 8 * j + 2 * t;
  return make_float2(v.s16[col * 2 * kMmqStageChunks + h], v.s16[(col + 1) * 2 * kMmqStageChunks + h]);
}

// acc[e] += value(C[e]) * row factor * column scale, for a chunk with per-row factors f0 (row
// g) and f1 (row g + 8).
template <int NT>
__device__ __forceinline__ void accumulate_scaled(float (&acc)[NT][4], const int (&cc)[NT][4], const MmqStageView& v,
                                                  int t, int c, int live, float f0, float f1) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    if (j >= live) break;
    const float2 dx = col_scales(v, j, t, c);
    acc[j][0] = fmaf(mmq_value(cc[j][0]), f0 * dx.x, acc[j][0]);
    acc[j][1] = fmaf(mmq_value(cc[j][1]), f0 * dx.y, acc[j][1]);
    acc[j][2] = fmaf(mmq_value(cc[j][2]), f1 * dx.x, acc[j][2]);
    acc[j][3] = fmaf(mmq_value(cc[j][3]), f1 * dx.y, acc[j][3]);
  }
}

// sacc[e] += value(C[e]) * column scale (the row factor comes once per super-block).
template <int NT>
__device__ __forceinline__ void accumulate_unscaled(float (&sacc)[NT][4], const int (&cc)[NT][4],
                                                    const MmqStageView& v, int t, int c, int live) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    if (j >= live) break;
    const float2 dx = col_scales(v, j, t, c);
    sacc[j][0] = fmaf(mmq_value(cc[j][0]), dx.x, sacc[j][0]);
    sacc[j][1] = fmaf(mmq_value(cc[j][1]), dx.y, sacc[j][1]);
    sacc[j][2] = fmaf(mmq_value(cc[j][2]), dx.x, sacc[j][2]);
    sacc[j][3] = fmaf(mmq_value(cc[j][3]), dx.y, sacc[j][3]);
  }
}

template <int NT>
__device__ __forceinline__ void mma_chunk(int (&cc)[NT][4], const uint32_t (&a)[4], const uint32_t (&b)[NT][2],
                                          int live) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    if (j >= live) break;
    cc[j][0] = cc[j][1] = cc[j][2] = cc[j][3] = kMmqBiasBits;
    mma_k32(cc[j], a, b[j][0], b[j][1]);
  }
}

// ---- per-type stage products ------------------------------------------------------------
// r0, r1: the stage spans of rows g and g + 8 (shared memory); chunks: valid 32-wide chunks of
// this stage (8 except in a row's last, partial stage of Q8_0 / MXFP4); live: column tiles
// holding columns of this task (block-uniform; the rest are skipped).

template <GgmlType T, int NT>
struct MmqStageProduct;

// The types of mmq_chunk32.cuh: one k32 MMA per chunk, scale per 32 and row on its product,
// the minimum times the 32 activations' sum.
template <GgmlType T, int NT>
struct MmqStageProductChunk32 {
  __device__ __forceinline__ static void run(const uint8_t* r0, const uint8_t* r1, int chunks, const MmqStageView& v,
                                             int lane, int live, float (&acc)[NT][4]) {
    using U = MmqChunk32<T>;
    const int t = lane & 3;
#pragma unroll
    for (int c = 0; c < kMmqStageChunks; ++c) {
      if (c >= chunks) break;
      uint32_t a[4];
      float f0, f1, m0, m1;
      U::load(r0, c, t, v.iq, a[0], a[2], f0, m0);
      U::load(r1, c, t, v.iq, a[1], a[3], f1, m1);
      uint32_t b[NT][2];
      load_b<NT>(v, c, lane, live, b);
      int cc[NT][4];
      mma_chunk<NT>(cc, a, b, live);
      accumulate_scaled<NT>(acc, cc, v, t, c, live, f0, f1);
      if constexpr (U::kMins) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          if (j >= live) break;
          const float2 lo = col_sums(v, j, t, 2 * c), hi = col_sums(v, j, t, 2 * c + 1);
          const float s_a = lo.x + hi.x, s_b = lo.y + hi.y;
          acc[j][0] = fmaf(m0, s_a, acc[j][0]);
          acc[j][1] = fmaf(m0, s_b, acc[j][1]);
          acc[j][2] = fmaf(m1, s_a, acc[j][2]);
          acc[j][3] = fmaf(m1, s_b, acc[j][3]);
        }
      }
    }
  }
};
// The types of MmqChunk16: per chunk two k16 MMAs (elements 0..15 and 16..31), each product
// scaled by its own 16's scale.
template <GgmlType T, int NT>
struct MmqStageProductChunk16 {
  __device__ __forceinline__ static void run(const uint8_t* r0, const uint8_t* r1, int chunks, const MmqStageView& v,
                                             int lane, int live, float (&acc)[NT][4]) {
    using U = MmqChunk16<T>;
    const int t = lane & 3;
#pragma unroll
    for (int c = 0; c < kMmqStageChunks; ++c) {
      if (c >= chunks) break;
      uint32_t lo0, hi0, lo1, hi1;
      float sl0, sh0, sl1, sh1;
      U::load(r0, c, t, v.iq, lo0, hi0, sl0, sh0);
      U::load(r1, c, t, v.iq, lo1, hi1, sl1, sh1);
      uint32_t b[NT][2];
      load_b<NT>(v, c, lane, live, b);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        if (j >= live) break;
        int lo[4] = {kMmqBiasBits, kMmqBiasBits, kMmqBiasBits, kMmqBiasBits};
        int hi[4] = {kMmqBiasBits, kMmqBiasBits, kMmqBiasBits, kMmqBiasBits};
        mma_k16(lo, lo0, lo1, b[j][0]);
        mma_k16(hi, hi0, hi1, b[j][1]);
        const float2 dx = col_scales(v, j, t, c);
        acc[j][0] = fmaf(fmaf(sl0, mmq_value(lo[0]), sh0 * mmq_value(hi[0])), dx.x, acc[j][0]);
        acc[j][1] = fmaf(fmaf(sl0, mmq_value(lo[1]), sh0 * mmq_value(hi[1])), dx.y, acc[j][1]);
        acc[j][2] = fmaf(fmaf(sl1, mmq_value(lo[2]), sh1 * mmq_value(hi[2])), dx.x, acc[j][2]);
        acc[j][3] = fmaf(fmaf(sl1, mmq_value(lo[3]), sh1 * mmq_value(hi[3])), dx.y, acc[j][3]);
      }
    }
  }
};

template <int NT> struct MmqStageProduct<GgmlType::Q4_0, NT> : MmqStageProductChunk32<GgmlType::Q4_0, NT> {};
template <int NT> struct MmqStageProduct<GgmlType::Q4_1, NT> : MmqStageProductChunk32<GgmlType::Q4_1, NT> {};
template <int NT> struct MmqStageProduct<GgmlType::Q5_0, NT> : MmqStageProductChunk32<GgmlType::Q5_0, NT> {};
template <int NT> struct MmqStageProduct<GgmlType::Q5_1, NT> : MmqStageProductChunk32<GgmlType::Q5_1, NT> {};
template <int NT> struct MmqStageProduct<GgmlType::IQ4_NL, NT> : MmqStageProductChunk32<GgmlType::IQ4_NL, NT> {};
template <int NT> struct MmqStageProduct<GgmlType::Q5_K, NT> : MmqStageProductChunk32<GgmlType::Q5_K, NT> {};
template <int NT> struct MmqStageProduct<GgmlType::IQ4_XS, NT> : MmqStageProductChunk32<GgmlType::IQ4_XS, NT> {};
template <int NT> struct MmqStageProduct<GgmlType::IQ3_XXS, NT> : MmqStageProductChunk32<GgmlType::IQ3_XXS, NT> {};
template <int NT> struct MmqStageProduct<GgmlType::IQ3_S, NT> : MmqStageProductChunk32<GgmlType::IQ3_S, NT> {};
template <int NT> struct MmqStageProduct<GgmlType::IQ1_S, NT> : MmqStageProductChunk32<GgmlType::IQ1_S, NT> {};
template <int NT> struct MmqStageProduct<GgmlType::IQ2_XS, NT> : MmqStageProductChunk16<GgmlType::IQ2_XS, NT> {};
template <int NT> struct MmqStageProduct<GgmlType::IQ2_S, NT> : MmqStageProductChunk16<GgmlType::IQ2_S, NT> {};
template <int NT> struct MmqStageProduct<GgmlType::IQ1_M, NT> : MmqStageProductChunk16<GgmlType::IQ1_M, NT> {};

template <int NT>
struct MmqStageProduct<GgmlType::Q8_0, NT> {
  __device__ __forceinline__ static void run(const uint8_t* r0, const uint8_t* r1, int chunks, const MmqStageView& v, int lane, int live,
                             float (&acc)[NT][4]) {
    const int t = lane & 3;
#pragma unroll
    for (int c = 0; c < kMmqStageChunks; ++c) {
      if (c >= chunks) break;
      const uint8_t* b0 = r0 + 34 * c;
      const uint8_t* b1 = r1 + 34 * c;
      const uint32_t a[4] = {ld_a2(b0 + 2 + 4 * t), ld_a2(b1 + 2 + 4 * t), ld_a2(b0 + 18 + 4 * t),
                             ld_a2(b1 + 18 + 4 * t)};
      const float f0 = half_to_float(ld_u16(b0)), f1 = half_to_float(ld_u16(b1));
      uint32_t b[NT][2];
      load_b<NT>(v, c, lane, live, b);
      int cc[NT][4];
      mma_chunk<NT>(cc, a, b, live);
      accumulate_scaled<NT>(acc, cc, v, t, c, live, f0, f1);
    }
  }
};

template <int NT>
struct MmqStageProduct<GgmlType::MXFP4, NT> {
  // Four codes per byte pair to int8 values, as RowUnit<MXFP4> (matvec_row_kernel.cuh): lo gets
  // elements 4t..4t+3 (low nibbles of the word), hi elements 16+4t..16+4t+3 (high nibbles).
  __device__ static void decode(uint32_t codes, uint32_t& lo, uint32_t& hi) {
    const uint32_t pick = ((codes >> 1) & 0x44444444u) | 0x32103210u;
    const uint32_t v0 = __byte_perm(__byte_perm(0x03020100u, 0x0C080604u, codes),
                                    __byte_perm(0xFDFEFF00u, 0xF4F8FAFCu, codes), pick);
    const uint32_t v1 = __byte_perm(__byte_perm(0x03020100u, 0x0C080604u, codes >> 16),
                                    __byte_perm(0xFDFEFF00u, 0xF4F8FAFCu, codes >> 16), pick >> 16);
    lo = __byte_perm(v0, v1, 0x6420u);
    hi = __byte_perm(v0, v1, 0x7531u);
  }
  __device__ static float scale_of(uint32_t e) {
    return __uint_as_float(e < 2u ? (0x00200000u << e) : ((e - 1u) << 23));
  }
  __device__ __forceinline__ static void run(const uint8_t* r0, const uint8_t* r1, int chunks, const MmqStageView& v, int lane, int live,
                             float (&acc)[NT][4]) {
    const int t = lane & 3;
#pragma unroll
    for (int c = 0; c < kMmqStageChunks; ++c) {
      if (c >= chunks) break;
      const uint8_t* b0 = r0 + 17 * c;
      const uint8_t* b1 = r1 + 17 * c;
      uint32_t a[4];
      decode(ld_a1(b0 + 1 + 4 * t), a[0], a[2]);
      decode(ld_a1(b1 + 1 + 4 * t), a[1], a[3]);
      const float f0 = scale_of(b0[0]), f1 = scale_of(b1[0]);
      uint32_t b[NT][2];
      load_b<NT>(v, c, lane, live, b);
      int cc[NT][4];
      mma_chunk<NT>(cc, a, b, live);
      accumulate_scaled<NT>(acc, cc, v, t, c, live, f0, f1);
    }
  }
};

template <int NT>
struct MmqStageProduct<GgmlType::Q4_K, NT> {
  // quant::k4_scale_min from the three 32-bit words of the 12 scale bytes; j compile-time.
  __device__ static void scale_min(const uint32_t (&s)[3], int j, uint32_t& sc, uint32_t& m) {
    auto byte = [&](int i) { return (s[i >> 2] >> (8 * (i & 3))) & 0xFFu; };
    if (j < 4) {
      sc = byte(j) & 63u;
      m = byte(j + 4) & 63u;
    } else {
      sc = (byte(j + 4) & 0xFu) | ((byte(j - 4) >> 6) << 4);
      m = (byte(j + 4) >> 4) | ((byte(j) >> 6) << 4);
    }
  }
  __device__ __forceinline__ static void run(const uint8_t* r0, const uint8_t* r1, int, const MmqStageView& v, int lane, int live,
                             float (&acc)[NT][4]) {
    const int t = lane & 3;
    const uint32_t dd0 = ld_a4(r0), dd1 = ld_a4(r1);
    const float d0 = half_to_float(dd0), dmin0 = half_to_float(dd0 >> 16);
    const float d1 = half_to_float(dd1), dmin1 = half_to_float(dd1 >> 16);
    const uint32_t s0[3] = {ld_a4(r0 + 4), ld_a4(r0 + 8), ld_a4(r0 + 12)};
    const uint32_t s1[3] = {ld_a4(r1 + 4), ld_a4(r1 + 8), ld_a4(r1 + 12)};
#pragma unroll
    for (int p = 0; p < 4; ++p) {  // 32 bytes of qs: sub-blocks 2p (low nibbles) and 2p + 1 (high)
      const uint32_t w00 = ld_a4(r0 + 16 + 32 * p + 4 * t), w02 = ld_a4(r0 + 32 + 32 * p + 4 * t);
      const uint32_t w10 = ld_a4(r1 + 16 + 32 * p + 4 * t), w12 = ld_a4(r1 + 32 + 32 * p + 4 * t);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int c = 2 * p + h;
        const uint32_t a[4] = {(w00 >> (4 * h)) & 0x0F0F0F0Fu, (w10 >> (4 * h)) & 0x0F0F0F0Fu,
                               (w02 >> (4 * h)) & 0x0F0F0F0Fu, (w12 >> (4 * h)) & 0x0F0F0F0Fu};
        uint32_t sc0, m0, sc1, m1;
        scale_min(s0, c, sc0, m0);
        scale_min(s1, c, sc1, m1);
        uint32_t b[NT][2];
        load_b<NT>(v, c, lane, live, b);
        int cc[NT][4];
        mma_chunk<NT>(cc, a, b, live);
        accumulate_scaled<NT>(acc, cc, v, t, c, live, d0 * small_int_to_float(static_cast<int>(sc0)),
                              d1 * small_int_to_float(static_cast<int>(sc1)));
        const float b0 = dmin0 * small_int_to_float(static_cast<int>(m0));
        const float b1 = dmin1 * small_int_to_float(static_cast<int>(m1));
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          if (j >= live) break;
          const float2 lo = col_sums(v, j, t, 2 * c), hi = col_sums(v, j, t, 2 * c + 1);
          const float s_a = lo.x + hi.x, s_b = lo.y + hi.y;
          acc[j][0] = fmaf(-b0, s_a, acc[j][0]);
          acc[j][1] = fmaf(-b0, s_b, acc[j][1]);
          acc[j][2] = fmaf(-b1, s_a, acc[j][2]);
          acc[j][3] = fmaf(-b1, s_b, acc[j][3]);
        }
      }
    }
  }
};

template <int NT>
struct MmqStageProduct<GgmlType::Q2_K, NT> {
  __device__ __forceinline__ static void run(const uint8_t* r0, const uint8_t* r1, int, const MmqStageView& v, int lane, int live,
                             float (&acc)[NT][4]) {
    const int t = lane & 3;
    const uint32_t dd0 = ld_a4(r0 + 80), dd1 = ld_a4(r1 + 80);
    float sacc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) sacc[j][0] = sacc[j][1] = sacc[j][2] = sacc[j][3] = 0.0f;
    const float dmin0 = half_to_float(dd0 >> 16), dmin1 = half_to_float(dd1 >> 16);
#pragma unroll
    for (int n = 0; n < 2; ++n) {  // the two 32-byte planes of qs (elements 128n..128n+127)
      const uint32_t w00 = ld_a4(r0 + 16 + 32 * n + 4 * t), w02 = ld_a4(r0 + 32 + 32 * n + 4 * t);
      const uint32_t w10 = ld_a4(r1 + 16 + 32 * n + 4 * t), w12 = ld_a4(r1 + 32 + 32 * n + 4 * t);
      const uint32_t sa0 = ld_a4(r0 + 8 * n), sb0 = ld_a4(r0 + 8 * n + 4);  // scale bytes of subs 8n..8n+7
      const uint32_t sa1 = ld_a4(r1 + 8 * n), sb1 = ld_a4(r1 + 8 * n + 4);
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // chunk 4n + j: bits 2j of the plane, sub-blocks 8n + 2j, 8n + 2j + 1
        const int c = 4 * n + j;
        const uint32_t s0 = j < 2 ? sa0 : sb0, s1 = j < 2 ? sa1 : sb1;
        const int lo_at = 8 * ((2 * j) & 3), hi_at = lo_at + 8;
        const uint32_t lo0 = (s0 >> lo_at) & 0xFFu, hi0 = (s0 >> hi_at) & 0xFFu;
        const uint32_t lo1 = (s1 >> lo_at) & 0xFFu, hi1 = (s1 >> hi_at) & 0xFFu;
        const uint32_t a[4] = {((w00 >> (2 * j)) & 0x03030303u) * (lo0 & 0xFu),
                               ((w10 >> (2 * j)) & 0x03030303u) * (lo1 & 0xFu),
                               ((w02 >> (2 * j)) & 0x03030303u) * (hi0 & 0xFu),
                               ((w12 >> (2 * j)) & 0x03030303u) * (hi1 & 0xFu)};
        uint32_t b[NT][2];
        load_b<NT>(v, c, lane, live, b);
        int cc[NT][4];
        mma_chunk<NT>(cc, a, b, live);
        accumulate_unscaled<NT>(sacc, cc, v, t, c, live);
        const float m_lo0 = dmin0 * small_int_to_float(static_cast<int>(lo0 >> 4));
        const float m_hi0 = dmin0 * small_int_to_float(static_cast<int>(hi0 >> 4));
        const float m_lo1 = dmin1 * small_int_to_float(static_cast<int>(lo1 >> 4));
        const float m_hi1 = dmin1 * small_int_to_float(static_cast<int>(hi1 >> 4));
#pragma unroll
        for (int jj = 0; jj < NT; ++jj) {
          if (jj >= live) break;
          const float2 sl = col_sums(v, jj, t, 2 * c), sh = col_sums(v, jj, t, 2 * c + 1);
          acc[jj][0] = fmaf(-m_lo0, sl.x, fmaf(-m_hi0, sh.x, acc[jj][0]));
          acc[jj][1] = fmaf(-m_lo0, sl.y, fmaf(-m_hi0, sh.y, acc[jj][1]));
          acc[jj][2] = fmaf(-m_lo1, sl.x, fmaf(-m_hi1, sh.x, acc[jj][2]));
          acc[jj][3] = fmaf(-m_lo1, sl.y, fmaf(-m_hi1, sh.y, acc[jj][3]));
        }
      }
    }
    const float d0 = half_to_float(dd0), d1 = half_to_float(dd1);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      acc[j][0] = fmaf(d0, sacc[j][0], acc[j][0]);
      acc[j][1] = fmaf(d0, sacc[j][1], acc[j][1]);
      acc[j][2] = fmaf(d1, sacc[j][2], acc[j][2]);
      acc[j][3] = fmaf(d1, sacc[j][3], acc[j][3]);
    }
  }
};

template <int NT>
struct MmqStageProduct<GgmlType::Q3_K, NT> {
  // The signed 6-bit scale of sub-block sub (quant::q3_k_scale) from the 12 scale bytes.
  __device__ static int scale(const uint32_t (&s)[3], int sub) {
    auto byte = [&](int i) { return (s[i >> 2] >> (8 * (i & 3))) & 0xFFu; };
    const uint32_t low = sub < 8 ? (byte(sub) & 0xFu) : (byte(sub - 8) >> 4);
    const uint32_t high = (byte(8 + (sub & 3)) >> (2 * (sub >> 2))) & 3u;
    return static_cast<int>(low | (high << 4)) - 32;
  }
  // Bytes u * (q - 4) mod 256 of four 3-bit values q (0..7) and u = -scale in [-31, 32]: in
  // 16-bit lanes q * (u mod 256) + (-4u mod 256) <= 7 * 255 + 255 never carries into the next
  // lane, and its low byte is the wanted int8 (the true values lie in [-128, 124]).
  __device__ static uint32_t fold(uint32_t q, int u) {
    const uint32_t mul = static_cast<uint32_t>(u) & 0xFFu;
    const uint32_t add = (static_cast<uint32_t>(-4 * u) & 0xFFu) * 0x00010001u;
    const uint32_t even = (q & 0x00FF00FFu) * mul + add;
    const uint32_t odd = ((q >> 8) & 0x00FF00FFu) * mul + add;
    return __byte_perm(even, odd, 0x6240u);
  }
  __device__ __forceinline__ static void run(const uint8_t* r0, const uint8_t* r1, int, const MmqStageView& v, int lane, int live,
                             float (&acc)[NT][4]) {
    const int t = lane & 3;
    const uint32_t h00 = ld_a2(r0 + 4 * t), h02 = ld_a2(r0 + 16 + 4 * t);  // hmask bytes 4t.., 16+4t..
    const uint32_t h10 = ld_a2(r1 + 4 * t), h12 = ld_a2(r1 + 16 + 4 * t);
    const uint32_t s0[3] = {ld_a2(r0 + 96), ld_a2(r0 + 100), ld_a2(r0 + 104)};
    const uint32_t s1[3] = {ld_a2(r1 + 96), ld_a2(r1 + 100), ld_a2(r1 + 104)};
    float sacc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) sacc[j][0] = sacc[j][1] = sacc[j][2] = sacc[j][3] = 0.0f;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const uint32_t q00 = ld_a2(r0 + 32 + 32 * n + 4 * t), q02 = ld_a2(r0 + 48 + 32 * n + 4 * t);
      const uint32_t q10 = ld_a2(r1 + 32 + 32 * n + 4 * t), q12 = ld_a2(r1 + 48 + 32 * n + 4 * t);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int c = 4 * n + j, sub = 8 * n + 2 * j;
        const int hb = 4 * n + j;  // hmask bit of this chunk's elements
        auto q3 = [&](uint32_t q, uint32_t h) {
          return ((q >> (2 * j)) & 0x03030303u) | (((h >> hb) & 0x01010101u) << 2);
        };
        const uint32_t a[4] = {fold(q3(q00, h00), -scale(s0, sub)), fold(q3(q10, h10), -scale(s1, sub)),
                               fold(q3(q02, h02), -scale(s0, sub + 1)), fold(q3(q12, h12), -scale(s1, sub + 1))};
        uint32_t b[NT][2];
        load_b<NT>(v, c, lane, live, b);
        int cc[NT][4];
        mma_chunk<NT>(cc, a, b, live);
        accumulate_unscaled<NT>(sacc, cc, v, t, c, live);
      }
    }
    const float d0 = half_to_float(ld_u16(r0 + 108)), d1 = half_to_float(ld_u16(r1 + 108));
#pragma unroll
    for (int j = 0; j < NT; ++j) {  // A carried -scale: the products are -(the sums)
      acc[j][0] = fmaf(-d0, sacc[j][0], acc[j][0]);
      acc[j][1] = fmaf(-d0, sacc[j][1], acc[j][1]);
      acc[j][2] = fmaf(-d1, sacc[j][2], acc[j][2]);
      acc[j][3] = fmaf(-d1, sacc[j][3], acc[j][3]);
    }
  }
};

template <int NT>
struct MmqStageProduct<GgmlType::Q6_K, NT> {
  // Six-bit q (0..63) per byte to q - 32 as int8: flip bit 5, then copy it into bits 6-7.
  __device__ static uint32_t centre(uint32_t q) {
    const uint32_t v = q ^ 0x20202020u;
    return v | ((v & 0x20202020u) * 6u);
  }
  __device__ __forceinline__ static void run(const uint8_t* r0, const uint8_t* r1, int, const MmqStageView& v, int lane, int live,
                             float (&acc)[NT][4]) {
    const int t = lane & 3;
    float sacc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) sacc[j][0] = sacc[j][1] = sacc[j][2] = sacc[j][3] = 0.0f;
#pragma unroll
    for (int n = 0; n < 2; ++n) {  // elements 128n..128n+127: ql[64n..64n+63], qh[32n..32n+31]
      const uint32_t qh00 = ld_a2(r0 + 128 + 32 * n + 4 * t), qh02 = ld_a2(r0 + 144 + 32 * n + 4 * t);
      const uint32_t qh10 = ld_a2(r1 + 128 + 32 * n + 4 * t), qh12 = ld_a2(r1 + 144 + 32 * n + 4 * t);
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // ql bytes 64n + 32 * half + l: chunks j = half, half + 2
        const uint32_t ql00 = ld_a2(r0 + 64 * n + 32 * half + 4 * t), ql02 = ld_a2(r0 + 64 * n + 32 * half + 16 + 4 * t);
        const uint32_t ql10 = ld_a2(r1 + 64 * n + 32 * half + 4 * t), ql12 = ld_a2(r1 + 64 * n + 32 * half + 16 + 4 * t);
#pragma unroll
        for (int nib = 0; nib < 2; ++nib) {
          const int j = half + 2 * nib;  // element 128n + 32j + l
          const int c = 4 * n + j, sub = 8 * n + 2 * j;
          auto q6 = [&](uint32_t ql, uint32_t qh) {
            return centre(((ql >> (4 * nib)) & 0x0F0F0F0Fu) | (((qh >> (2 * j)) & 0x03030303u) << 4));
          };
          const uint32_t a0 = q6(ql00, qh00), a1 = q6(ql10, qh10), a2 = q6(ql02, qh02), a3 = q6(ql12, qh12);
          const float sc0_lo = small_int_to_float(static_cast<int8_t>(r0[192 + sub]));
          const float sc0_hi = small_int_to_float(static_cast<int8_t>(r0[193 + sub]));
          const float sc1_lo = small_int_to_float(static_cast<int8_t>(r1[192 + sub]));
          const float sc1_hi = small_int_to_float(static_cast<int8_t>(r1[193 + sub]));
          uint32_t b[NT][2];
          load_b<NT>(v, c, lane, live, b);
#pragma unroll
          for (int jj = 0; jj < NT; ++jj) {
            if (jj >= live) break;
            int lo[4] = {kMmqBiasBits, kMmqBiasBits, kMmqBiasBits, kMmqBiasBits};
            int hi[4] = {kMmqBiasBits, kMmqBiasBits, kMmqBiasBits, kMmqBiasBits};
            mma_k16(lo, a0, a1, b[jj][0]);
            mma_k16(hi, a2, a3, b[jj][1]);
            const float2 dx = col_scales(v, jj, t, c);
            sacc[jj][0] = fmaf(fmaf(sc0_lo, mmq_value(lo[0]), sc0_hi * mmq_value(hi[0])), dx.x, sacc[jj][0]);
            sacc[jj][1] = fmaf(fmaf(sc0_lo, mmq_value(lo[1]), sc0_hi * mmq_value(hi[1])), dx.y, sacc[jj][1]);
            sacc[jj][2] = fmaf(fmaf(sc1_lo, mmq_value(lo[2]), sc1_hi * mmq_value(hi[2])), dx.x, sacc[jj][2]);
            sacc[jj][3] = fmaf(fmaf(sc1_lo, mmq_value(lo[3]), sc1_hi * mmq_value(hi[3])), dx.y, sacc[jj][3]);
          }
        }
      }
    }
    const float d0 = half_to_float(ld_u16(r0 + 208)), d1 = half_to_float(ld_u16(r1 + 208));
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      acc[j][0] = fmaf(d0, sacc[j][0], acc[j][0]);
      acc[j][1] = fmaf(d0, sacc[j][1], acc[j][1]);
      acc[j][2] = fmaf(d1, sacc[j][2], acc[j][2]);
      acc[j][3] = fmaf(d1, sacc[j][3], acc[j][3]);
    }
  }
};

// ---- the kernel -------------------------------------------------------------------------

// Column c of the block's tile: activation row, output row (-1: past the tile's columns).
struct MmqColumns {
  int act[64];
  int out[64];
  float weight[64];
  int expert;
  int live;  // column tiles of 8 holding the task's columns
};

// Where stage row r (0..63) of the block reads: matrix base and row index within it.
template <MmqMode M>
__device__ __forceinline__ const uint8_t* mmq_row_source(const MmqArgs& a, int64_t matrix, int64_t tile, int r) {
  int64_t row;
  const uint8_t* base = a.w[0];
  if constexpr (M == MmqMode::kGateUp) {
    row = tile * 32 + (r & 31);
    if (r >= 32) base = a.w[1];
  } else {
    row = tile * kMmqTileRows + r;
  }
  row = min(row, a.n - 1);  // rows past the matrix read its last row; their results are dropped
  return base + matrix * a.matrix_stride + row * a.row_bytes;
}

// One stage's copies. Weights: thread t copies the span of tile row t / 2 (row_src: that row at
// k = 0), its 16-byte chunks t % 2, t % 2 + 2, ... (two threads per row: adjacent chunks in one
// request). Activations: 16 threads per column for the values, 8 for the scales, 16 for the
// sums. A partial last stage (Q8_0, MXFP4) copies what it has; the rest is never read.
template <GgmlType T, int NT, MmqMode M>
__device__ __forceinline__ void mmq_issue_stage(const MmqArgs& a, const MmqColumns& cols, const uint8_t* row_src,
                                                int stage, uint8_t* smem, bool weights, bool activations) {
  using C = MmqType<T>;
  using S = MmqStage<T, NT>;
  static_assert(kMmqThreads == 2 * kMmqTileRows, "two threads per tile row");
  const int64_t k0 = static_cast<int64_t>(stage) * kMmqStageK;
  const int64_t kw = min(static_cast<int64_t>(kMmqStageK), a.k - k0);  // weights of k in this stage
  if (weights) {
    const int r = threadIdx.x >> 1, h = threadIdx.x & 1;
    const uint8_t* src = row_src + static_cast<int64_t>(stage) * C::kStageBytes;
    const uint8_t* end = src + kw / C::kBlockElems * C::kBlockBytes;
    const uint8_t* aligned = reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(src) & ~uintptr_t{15});
    uint8_t* dst = smem + r * C::kSlotBytes;
#pragma unroll
    for (int ch = 0; ch < C::kSlotChunks; ch += 2) {
      const int c = ch + h;
      if (c < C::kSlotChunks && aligned + 16 * c < end) cp_async16(dst + 16 * c, aligned + 16 * c);
    }
  }
  if (activations) {
    uint8_t* xs = smem + S::kW;
    float* ds = reinterpret_cast<float*>(smem + S::kW + S::kX);
    float* ss = reinterpret_cast<float*>(smem + S::kW + S::kX + S::kD);
    const int live_cols = 8 * cols.live;  // columns past them are never read
    const int in_stage = static_cast<int>(kw / 16);  // 16-value pieces of this stage
    const int piece = threadIdx.x & 15;
    for (int col = threadIdx.x >> 4; col < live_cols; col += kMmqThreads / 16)
      if (piece < in_stage)
        cp_async16(xs + col * kMmqXStride + 16 * piece, a.q + static_cast<int64_t>(cols.act[col]) * a.k + k0 + 16 * piece);
    if (a.k % kMmqStageK == 0) {
      // Whole stages: a column's 8 scales and 16 sums are 16-byte aligned runs.
      const int j = threadIdx.x & 1;
      for (int col = threadIdx.x >> 1; col < live_cols; col += kMmqThreads / 2)
        cp_async16(ds + col * kMmqStageChunks + 4 * j,
                   a.d + static_cast<int64_t>(cols.act[col]) * (a.k / 32) + k0 / 32 + 4 * j);
      if constexpr (C::kMins) {
        const int j4 = threadIdx.x & 3;
        for (int col = threadIdx.x >> 2; col < live_cols; col += kMmqThreads / 4)
          cp_async16(ss + col * 2 * kMmqStageChunks + 4 * j4,
                     a.s16 + static_cast<int64_t>(cols.act[col]) * (a.k / 16) + k0 / 16 + 4 * j4);
      }
    } else {
      const int e = threadIdx.x & 7;
      for (int col = threadIdx.x >> 3; col < live_cols; col += kMmqThreads / 8)
        if (2 * e < in_stage)
          cp_async4(ds + col * kMmqStageChunks + e, a.d + static_cast<int64_t>(cols.act[col]) * (a.k / 32) + k0 / 32 + e);
      if constexpr (C::kMins) {
        for (int col = threadIdx.x >> 4; col < live_cols; col += kMmqThreads / 16)
          if (piece < in_stage)
            cp_async4(ss + col * 2 * kMmqStageChunks + piece,
                      a.s16 + static_cast<int64_t>(cols.act[col]) * (a.k / 16) + k0 / 16 + piece);
      }
    }
  }
}

// The same stage by bulk copies (MmqArgs::bulk), completion on `bar`: threads 0-63 copy tile
// row t's span (from its 16-byte aligned start to the 16-byte boundary past its end, as the
// cp.async path), threads 64-127 column t - 64's values, scales and sums. Every thread arrives
// once per stage (the activations part); the weights part only announces its bytes, so the
// prologue may issue a stage's weights before waiting for the previous kernel.
template <GgmlType T, int NT, MmqMode M>
__device__ __forceinline__ void mmq_issue_stage_bulk(const MmqArgs& a, const MmqColumns& cols, const uint8_t* row_src,
                                                     int stage, uint8_t* smem, uint64_t* bar, bool weights,
                                                     bool activations) {
  using C = MmqType<T>;
  using S = MmqStage<T, NT>;
  static_assert(kMmqThreads == 2 * kMmqTileRows, "a thread per tile row, a thread per column");
  static_assert(S::kCols <= kMmqThreads - kMmqTileRows, "a thread per column");
  const int64_t k0 = static_cast<int64_t>(stage) * kMmqStageK;
  if (weights && threadIdx.x < kMmqTileRows) {
    const int r = threadIdx.x;
    const uintptr_t src = reinterpret_cast<uintptr_t>(row_src + static_cast<int64_t>(stage) * C::kStageBytes);
    const uintptr_t begin = src & ~uintptr_t{15}, end = (src + C::kStageBytes + 15) & ~uintptr_t{15};
    const uint32_t bytes = static_cast<uint32_t>(end - begin);  // <= kSlotBytes
    mbarrier_expect_bytes(bar, bytes);
    bulk_copy(smem + r * C::kSlotBytes, reinterpret_cast<const void*>(begin), bytes, bar);
  }
  if (activations) {
    uint32_t bytes = 0;
    const int col = static_cast<int>(threadIdx.x) - kMmqTileRows;
    const bool copies = col >= 0 && col < 8 * cols.live;  // columns past them are never read
    if (copies) {
      bytes = kMmqStageK + kMmqStageChunks * 4 + (C::kMins ? 2 * kMmqStageChunks * 4 : 0);
    }
    mbarrier_arrive_expect_bytes(bar, bytes);
    if (copies) {
      const int64_t act = cols.act[col];
      bulk_copy(smem + S::kW + col * kMmqXStride, a.q + act * a.k + k0, kMmqStageK, bar);
      bulk_copy(smem + S::kW + S::kX + col * kMmqStageChunks * 4, a.d + act * (a.k / 32) + k0 / 32,
                kMmqStageChunks * 4, bar);
      if constexpr (C::kMins)
        bulk_copy(smem + S::kW + S::kX + S::kD + col * 2 * kMmqStageChunks * 4, a.s16 + act * (a.k / 16) + k0 / 16,
                  2 * kMmqStageChunks * 4, bar);
    }
  }
}

__device__ __forceinline__ float mmq_silu(float x) { return x / (1.0f + __expf(-x)); }

template <GgmlType T, int NT, MmqMode M, int Ring = 0>
__global__ void __launch_bounds__(kMmqThreads) mmq_kernel(const MmqArgs a) {
  using C = MmqType<T>;
  using S = MmqStage<T, NT, Ring>;
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ MmqColumns cols;
  __shared__ uint64_t stage_full[S::kRing];  // bulk copies: a slot's bytes have landed
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int rank = static_cast<int>(blockIdx.x) % a.split;
  const int64_t tile = blockIdx.x / a.split;
  const int64_t task = blockIdx.y;
  const bool experts = a.n_tiles != nullptr;

  allow_next_kernel();
  if (experts) {
    // The tile tables come from the sort kernel: wait before reading them.
    wait_for_previous_kernel();
    if (task >= *a.n_tiles) return;  // no cluster on this path (split == 1)
  }
  // Columns of this task.
  if (threadIdx.x < S::kCols) {
    const int c = threadIdx.x;
    int act = 0, out = -1;
    float weight = 0.0f;
    if (experts) {
      const int first = a.tile_first[task], count = a.tile_count[task];
      const int pair = a.sorted_pairs[first + min(c, count - 1)];
      act = M == MmqMode::kGateUp ? pair / a.top_k : pair;
      out = c < count ? pair : -1;
      if constexpr (M == MmqMode::kGateUp) weight = a.pair_weight[pair];
    } else {
      act = static_cast<int>(task * a.cols_per_task + min(c, a.cols_per_task - 1));
      out = c < a.cols_per_task ? static_cast<int>(task * a.cols_per_task + c) : -1;
    }
    if (a.bulk && c < S::kRing) {
      mbarrier_init(&stage_full[c], kMmqThreads);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the copy unit
    }
    cols.act[c] = act;
    cols.out[c] = out;
    cols.weight[c] = weight;
    if (c == 0) {
      cols.expert = experts ? a.tile_expert[task] : 0;
      const int count = experts ? a.tile_count[task] : a.cols_per_task;
      cols.live = min(NT, (count + 7) / 8);
    }
  }
  __syncthreads();
  const int64_t matrix = experts ? cols.expert : task;
  // kPlain: all NT tiles hold columns (dense tasks, or one tile of expert columns), so the
  // per-tile checks fold away.
  const int live = M == MmqMode::kPlain ? NT : cols.live;
  const int first_stage = rank * a.stages_per_split;
  const int last_stage = min(a.k_stages, first_stage + a.stages_per_split);
  const int n_stages = last_stage - first_stage;

  // Prologue: the weights of the first stages are constant and go out before waiting for the
  // kernel that writes the activations (dense tasks); then those stages' activations.
  constexpr int kRing = S::kRing;
  const bool bulk = a.bulk;
  const uint8_t* copy_row =
      mmq_row_source<M>(a, matrix, tile, static_cast<int>(bulk ? threadIdx.x % kMmqTileRows : threadIdx.x >> 1));
  auto issue = [&](int s, bool weights, bool activations) {
    uint8_t* slot = smem + (s % kRing) * S::kBytes;
    if (bulk) {
      mmq_issue_stage_bulk<T, NT, M>(a, cols, copy_row, first_stage + s, slot, &stage_full[s % kRing], weights,
                                     activations);
    } else {
      mmq_issue_stage<T, NT, M>(a, cols, copy_row, first_stage + s, slot, weights, activations);
    }
  };
#pragma unroll
  for (int s = 0; s < kRing - 1; ++s) {
    if (s < n_stages) issue(s, true, false);
    cp_async_commit();
  }
  if (!experts) wait_for_previous_kernel();
#pragma unroll
  for (int s = 0; s < kRing - 1; ++s)
    if (s < n_stages) issue(s, false, true);
  cp_async_commit();

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

  const int row_g = 16 * warp + g;
  const uint8_t* src_g = mmq_row_source<M>(a, matrix, tile, row_g);
  const uint8_t* src_g8 = mmq_row_source<M>(a, matrix, tile, row_g + 8);
  for (int s = 0; s < n_stages; ++s) {
    // Stage s is complete once at most kRing - 2 groups are pending (the first stage also
    // needs the activation group committed after the prologue's weight groups).
    if (bulk) {
      mbarrier_wait(&stage_full[s % kRing], static_cast<uint32_t>(s / kRing) & 1);
    } else if (s == 0) {
      cp_async_wait<0>();
    } else {
      cp_async_wait<kRing - 2>();
    }
    __syncthreads();  // every thread's copies landed; every warp is done with stage s - 1
    const int next = s + kRing - 1;
    if (next < n_stages) issue(next, true, true);
    cp_async_commit();

    const uint8_t* stage = smem + (s % kRing) * S::kBytes;
    const int stage_index = first_stage + s;
    const int64_t offset = static_cast<int64_t>(stage_index) * C::kStageBytes;
    const uintptr_t skew0 = reinterpret_cast<uintptr_t>(src_g + offset) & 15;
    const uintptr_t skew1 = reinterpret_cast<uintptr_t>(src_g8 + offset) & 15;
    const uint8_t* r0 = stage + row_g * C::kSlotBytes + skew0;
    const uint8_t* r1 = stage + (row_g + 8) * C::kSlotBytes + skew1;
    const MmqStageView view{stage + S::kW, reinterpret_cast<const float*>(stage + S::kW + S::kX),
                            reinterpret_cast<const float*>(stage + S::kW + S::kX + S::kD), a.iq};
    const int chunks = static_cast<int>(min(static_cast<int64_t>(kMmqStageK), a.k - int64_t{kMmqStageK} * stage_index) / 32);
    MmqStageProduct<T, NT>::run(r0, r1, chunks, view, lane, live, acc);
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring is free for the partial tiles below

  // Partial tiles of the cluster's other ranks, added in rank order by rank 0.
  float* part = reinterpret_cast<float*>(smem);  // [warp][NT][4][lane]
  if (a.split > 1) {
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) part[((warp * NT + j) * 4 + e) * 32 + lane] = acc[j][e];
    cluster.sync();
    if (rank == 0) {
      for (int r = 1; r < a.split; ++r) {
        const float* other = cluster.map_shared_rank(part, r);
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[j][e] += other[((warp * NT + j) * 4 + e) * 32 + lane];
      }
    }
    cluster.sync();  // the other ranks' shared memory stays alive until rank 0 has read it
    if (rank != 0) return;
  }

  if constexpr (M == MmqMode::kGateUp) {
    // Warps 2 and 3 hold the up rows of warps 0 and 1's gate rows, in the same layout.
    if (warp >= 2) {
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) part[(((warp - 2) * NT + j) * 4 + e) * 32 + lane] = acc[j][e];
    }
    __syncthreads();
    if (warp >= 2) return;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float gate = fminf(acc[j][e], a.limit);
        const float up = fminf(fmaxf(part[((warp * NT + j) * 4 + e) * 32 + lane], -a.limit), a.limit);
        const int col = 8 * j + 2 * t + (e & 1);
        acc[j][e] = cols.weight[col] * mmq_silu(gate) * up;
      }
  }

  const int64_t rows_per_tile = M == MmqMode::kGateUp ? 32 : kMmqTileRows;
  const int64_t row_base = tile * rows_per_tile + 16 * warp + g;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = 8 * j + 2 * t + (e & 1);
      const int64_t row = row_base + (e >> 1) * 8;
      const int out = cols.out[col];
      if (out >= 0 && row < a.n) a.out[static_cast<int64_t>(out) * a.n + row] = acc[j][e];
    }
}

}  // namespace dsv4::cuda::detail
