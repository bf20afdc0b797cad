// The one kernel behind every matrix-vector product of the CUDA backend (matvec.cu,
// moe_experts.cu): weights are read straight from their quantised blocks.
//
// Work is split into groups: one task (a weight matrix or an expert tile, with up to NR
// activation rows) and a run of R consecutive output rows. Each warp owns a ring of
// kStages shared-memory stages; it streams the raw bytes of its next groups into them
// with 16-byte cp.async copies (coalesced whatever the block size, and kStages - 1 groups in
// flight while it computes one), then decodes 32 weights per lane and unit (quant_units.cuh)
// and multiplies them with int8 activations by __dp4a, or with f32 activations for BF16.
// A group of the same task may hold several source matrices (gate and up, or the top-k down
// projections of one token); the Mode decides how their sums combine and where they go.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/quant_units.cuh"

namespace dsv4::cuda::detail {

enum class MatvecMode {
  kPlain,      // task b: matrix b, activation rows b*rows + r -> out[(b*rows + r) * n + i]
  kGateUp,     // task = expert tile; sources gate, up; out[pair * n + i] = w * silu(min(g,L)) * clamp(u)
  kDownTiled,  // task = expert tile; out[pair * n + i] = dot (activation row = pair)
  kDownSum,    // task = token t; sources = its top_k experts; out[t * n + i] = sum over them
};

inline constexpr int kStages = 3;
inline constexpr int kWarpsPerBlock = 4;
inline constexpr int kIq2TableBytes = 256 * 8 + 128;

struct ActView {
  const int8_t* q = nullptr;  // quantised activations (integer types), activation_quant.h's layout
  const float* d = nullptr;
  const float* s16 = nullptr;
  const float* f = nullptr;   // f32 activations (BF16 weights), row-major
  int64_t k = 0;
  int64_t padded_k = 0;       // stored values per quantised row
  int unit_weights = 0;       // the quantised layout's W and L (must match the kernel's)
  int lanes = 1;
  int subunits_per_row = 0;   // k / 32
};

struct MatvecArgs {
  const uint8_t* w[2] = {nullptr, nullptr};  // source matrices (gate, up for kGateUp)
  int64_t matrix_stride = 0;                 // bytes between consecutive matrices / experts
  int64_t row_bytes = 0;
  int64_t n = 0;  // output rows per matrix
  int units_per_row = 0;  // wide units (Policy::kUnitWeights weights each)
  int lanes_per_row = 32;  // lanes sharing one row: a power of two; 32 / it rows at a time
  int rows_per_group = 1;
  int64_t row_blocks = 0;
  int segment_stride = 0;  // bytes of one source's rows in a stage
  int stage_bytes = 0;
  ActView act;
  // kPlain
  int64_t n_tasks = 0;
  int act_rows = 0;
  // expert modes; without tile tables (n_tiles null) task j is pair j, expert expert_ids[j]
  const int* n_tiles = nullptr;  // device scalar
  const int* tile_expert = nullptr;
  const int* tile_first = nullptr;
  const int* tile_count = nullptr;
  const int* sorted_pairs = nullptr;
  const int* expert_ids = nullptr;  // [tokens][top_k]
  const float* pair_weight = nullptr;
  int top_k = 0;
  float limit = 0.0f;
  float* out = nullptr;
  // One-row kernel: > 0 when it quantises act.f itself into the last act_smem_bytes of its
  // shared memory (matvec_row_kernel.cuh) instead of reading act.q; one task, or every task
  // with the same activations (shared_act).
  int act_smem_bytes = 0;
  bool shared_act = false;
  const uint64_t* iq2_grid = nullptr;
  const uint8_t* iq2_signs = nullptr;
  quant::IqTables iq{};  // the other i-quants' codebooks (device memory)
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Programmatic dependent launch (PDL): a kernel launched with it may start while the previous
// kernel in the stream finishes; griddepcontrol.wait blocks until that kernel has completed
// and its writes are visible (a no-op without PDL). launch_dependents lets the next kernel
// start early in turn.
__device__ __forceinline__ void wait_for_previous_kernel() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void allow_next_kernel() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

template <GgmlType T>
struct QuantPolicy {
  using Unit = QuantUnit<T>;
  static constexpr bool kIq2 = T == GgmlType::IQ2_XXS;
  static constexpr bool kIqTables = needs_iq_tables(T);
  static constexpr int kUnitWeights = 32 * Unit::kSub;
  // Row element offsets of the activation rows in the quantised layout.
  __device__ static int64_t row_offset(const ActView& act, int row) { return static_cast<int64_t>(row) * act.padded_k; }

  // Wide unit t * L + slot of the row (L = act.lanes): lane `slot` of the row's lane group,
  // its t-th step. `offsets`: row_offset of each activation row.
  template <int NR>
  __device__ static void accumulate(const uint8_t* row, int t, int slot, const ActView& act,
                                    const int64_t (&offsets)[NR], int n_rows, float (&acc)[NR],
                                    const Iq2Tables& tables) {
    const int unit = t * act.lanes + slot;
    // Sub-units past the row's end (MXFP4 and Q8_0 rows of an odd number of 128-weight units).
    // Rows of 256-element blocks hold whole units (k is a multiple of 256): no run-time bound.
    const int valid =
        Unit::kBlocksPerUnit == 0 ? Unit::kSub : min(Unit::kSub, act.subunits_per_row - unit * Unit::kSub);
    int part;
    const uint8_t* at = unit_address<Unit>(row, unit, part);
    Unit32 u[Unit::kSub];
    Unit::decode(at, part, tables, u, valid);
    const int chunk0 = (t * (kUnitWeights / 16)) * act.lanes + slot;  // 16-byte chunk index
    const int sub0 = (t * Unit::kSub) * act.lanes + slot;            // 32-value part index
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      if (r < n_rows) {
        const int4* xq = reinterpret_cast<const int4*>(act.q + offsets[r]) + chunk0;
        const int64_t at32 = offsets[r] / 32 + sub0;
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < Unit::kSub; ++j) {
          if (j < valid) {
            const int4 x0 = __ldg(xq + (2 * j) * act.lanes);
            const int4 x1 = __ldg(xq + (2 * j + 1) * act.lanes);
            const float dx = __ldg(act.d + at32 + j * act.lanes);
            int lo = __dp4a(u[j].q[0], x0.x, 0);
            lo = __dp4a(u[j].q[1], x0.y, lo);
            lo = __dp4a(u[j].q[2], x0.z, lo);
            lo = __dp4a(u[j].q[3], x0.w, lo);
            int hi = __dp4a(u[j].q[4], x1.x, 0);
            hi = __dp4a(u[j].q[5], x1.y, hi);
            hi = __dp4a(u[j].q[6], x1.z, hi);
            hi = __dp4a(u[j].q[7], x1.w, hi);
            sum += dx * (u[j].a0 * static_cast<float>(lo) + u[j].a1 * static_cast<float>(hi));
            if constexpr (Unit::kOffsets) {
              const float2 s = __ldg(reinterpret_cast<const float2*>(act.s16) + at32 + j * act.lanes);
              sum -= u[j].b0 * s.x + u[j].b1 * s.y;
            }
          }
        }
        acc[r] += sum;
      }
    }
  }
};

struct Bf16Policy {
  static constexpr bool kIq2 = false;
  static constexpr bool kIqTables = false;
  static constexpr int kUnitWeights = 32;
  __device__ static int64_t row_offset(const ActView& act, int row) { return static_cast<int64_t>(row) * act.k; }

  template <int NR>
  __device__ static void accumulate(const uint8_t* row, int t, int slot, const ActView& act,
                                    const int64_t (&offsets)[NR], int n_rows, float (&acc)[NR], const Iq2Tables&) {
    const int unit = t * act.lanes + slot;
    uint32_t w[16];
    load_words<16>(row + 64 * unit, w);
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      if (r < n_rows) {
        const float4* x = reinterpret_cast<const float4*>(act.f + offsets[r] + 32 * unit);
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float4 v = __ldg(x + i);
          s = fmaf(__uint_as_float(w[2 * i] << 16), v.x, s);
          s = fmaf(__uint_as_float(w[2 * i] & 0xFFFF0000u), v.y, s);
          s = fmaf(__uint_as_float(w[2 * i + 1] << 16), v.z, s);
          s = fmaf(__uint_as_float(w[2 * i + 1] & 0xFFFF0000u), v.w, s);
        }
        acc[r] += s;
      }
    }
  }
};

template <MatvecMode M>
__device__ __forceinline__ int sources_of(const MatvecArgs& a) {
  if constexpr (M == MatvecMode::kGateUp) return 2;
  if constexpr (M == MatvecMode::kDownSum) return a.top_k;
  return 1;
}

// Base address of source s's rows of group g.
template <MatvecMode M>
__device__ __forceinline__ const uint8_t* source_rows(const MatvecArgs& a, int64_t task, int s, int64_t r0) {
  int64_t matrix;
  const uint8_t* base = a.w[0];
  if constexpr (M == MatvecMode::kPlain) {
    matrix = task;
  } else if constexpr (M == MatvecMode::kDownSum) {
    matrix = a.expert_ids[task * a.top_k + s];
  } else {
    matrix = a.tile_expert != nullptr ? a.tile_expert[task] : a.expert_ids[task];  // direct: task = pair
    if (M == MatvecMode::kGateUp && s == 1) base = a.w[1];
  }
  return base + matrix * a.matrix_stride + r0 * a.row_bytes;
}

// Task and first row of group g (32-bit division: the host keeps the group count below 2^31).
__device__ __forceinline__ void split_group(const MatvecArgs& a, int64_t g, int64_t& task, int64_t& r0) {
  const uint32_t gi = static_cast<uint32_t>(g), blocks = static_cast<uint32_t>(a.row_blocks);
  const uint32_t t = gi / blocks;
  task = t;
  r0 = static_cast<int64_t>(gi - t * blocks) * a.rows_per_group;
}

template <MatvecMode M>
__device__ __forceinline__ void issue_group(const MatvecArgs& a, int64_t g, int64_t total, uint8_t* stage, int lane) {
  if (g < total) {
    int64_t task, r0;
    split_group(a, g, task, r0);
    const int64_t rows = min(static_cast<int64_t>(a.rows_per_group), a.n - r0);
    const int n_src = sources_of<M>(a);
    for (int s = 0; s < n_src; ++s) {
      const uint8_t* src = source_rows<M>(a, task, s, r0);
      const uint8_t* aligned = reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(src) & ~uintptr_t{15});
      const int64_t chunks = (src - aligned + rows * a.row_bytes + 15) / 16;
      uint8_t* dst = stage + s * a.segment_stride;
      for (int64_t c = lane; c < chunks; c += 32) cp_async16(dst + 16 * c, aligned + 16 * c);
    }
  }
  cp_async_commit();
}

// Sum over each aligned group of `width` lanes (a power of two); every lane takes part.
__device__ __forceinline__ float group_sum(float v, int width) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float other = __shfl_xor_sync(0xFFFFFFFFu, v, o);  // every lane, no divergence
    v += o < width ? other : 0.0f;
  }
  return v;
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }

template <class Policy, int NR, MatvecMode M>
__device__ __forceinline__ void compute_group(const MatvecArgs& a, int64_t g, const uint8_t* stage, int lane,
                                              const Iq2Tables& tables) {
  int64_t task, r0;
  split_group(a, g, task, r0);
  const int64_t rows = min(static_cast<int64_t>(a.rows_per_group), a.n - r0);
  const int n_src = sources_of<M>(a);

  int act_rows[NR];
  int out_rows[NR];
  int n_act = 1;
  if constexpr (M == MatvecMode::kPlain) {
    n_act = a.act_rows;
#pragma unroll
    for (int r = 0; r < NR; ++r) act_rows[r] = out_rows[r] = static_cast<int>(task * a.act_rows + r);
  } else if constexpr (M == MatvecMode::kDownSum) {
#pragma unroll
    for (int r = 0; r < NR; ++r) act_rows[r] = out_rows[r] = static_cast<int>(task);
  } else if (a.tile_count == nullptr) {  // one pair per task, no sort (decode)
    act_rows[0] = M == MatvecMode::kGateUp ? static_cast<int>(task) / a.top_k : static_cast<int>(task);
    out_rows[0] = static_cast<int>(task);
  } else {
    n_act = a.tile_count[task];
    const int first = a.tile_first[task];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const int pair = r < n_act ? a.sorted_pairs[first + r] : 0;
      out_rows[r] = pair;
      act_rows[r] = M == MatvecMode::kGateUp ? pair / a.top_k : pair;
    }
  }

  int64_t offsets[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) offsets[r] = r < n_act ? Policy::row_offset(a.act, act_rows[r]) : 0;
  const int L = a.lanes_per_row;
  const int sub_lane = lane & (L - 1);
  for (int64_t rr0 = 0; rr0 < rows; rr0 += 32 / L) {
    const int64_t rr = rr0 + lane / L;
    const bool active = rr < rows;
    float acc[2][NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[0][r] = acc[1][r] = 0.0f;
    for (int s = 0; s < n_src; ++s) {
      const uint8_t* src = source_rows<M>(a, task, s, r0);
      const uint8_t* row = stage + s * a.segment_stride + (reinterpret_cast<uintptr_t>(src) & 15) + rr * a.row_bytes;
      if constexpr (M == MatvecMode::kDownSum) offsets[0] = Policy::row_offset(a.act, static_cast<int>(task * a.top_k + s));
      if (!active) continue;
      const int steps = (a.units_per_row - sub_lane + L - 1) / L;
      if (M == MatvecMode::kGateUp && s == 1) {
        for (int t = 0; t < steps; ++t)
          Policy::template accumulate<NR>(row, t, sub_lane, a.act, offsets, n_act, acc[1], tables);
      } else {
        for (int t = 0; t < steps; ++t)
          Policy::template accumulate<NR>(row, t, sub_lane, a.act, offsets, n_act, acc[0], tables);
      }
    }
    const int64_t i = r0 + rr;
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const float v0 = group_sum(acc[0][r], L);
      float v1 = 0.0f;
      if constexpr (M == MatvecMode::kGateUp) v1 = group_sum(acc[1][r], L);
      if (active && sub_lane == 0 && r < n_act) {
        float v = v0;
        if constexpr (M == MatvecMode::kGateUp) {
          const float gate = fminf(v0, a.limit);
          const float up = fminf(fmaxf(v1, -a.limit), a.limit);
          v = a.pair_weight[out_rows[r]] * silu(gate) * up;
        }
        a.out[static_cast<int64_t>(out_rows[r]) * a.n + i] = v;
      }
    }
  }
}

template <class Policy, int NR, MatvecMode M>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) matvec_kernel(const MatvecArgs a) {
  extern __shared__ __align__(16) uint8_t smem[];
  Iq2Tables tables{nullptr, nullptr, a.iq};
  uint8_t* stages = smem;
  if constexpr (Policy::kIq2) {
    auto* grid = reinterpret_cast<uint64_t*>(smem);
    auto* signs = smem + 256 * 8;
    for (int i = threadIdx.x; i < 256; i += blockDim.x) grid[i] = a.iq2_grid[i];
    for (int i = threadIdx.x; i < 128; i += blockDim.x) signs[i] = a.iq2_signs[i];
    __syncthreads();
    tables.grid = grid;
    tables.signs = signs;
    stages = smem + kIq2TableBytes;
  }
  allow_next_kernel();
  // Weights of a plain product are constant: start streaming them before the activations
  // are ready. Expert modes read routing and tile tables made by earlier kernels first.
  if constexpr (M != MatvecMode::kPlain) wait_for_previous_kernel();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint8_t* ring = stages + static_cast<int64_t>(warp) * kStages * a.stage_bytes;
  int64_t n_tasks = a.n_tasks;
  if constexpr (M == MatvecMode::kGateUp || M == MatvecMode::kDownTiled)
    if (a.n_tiles != nullptr) n_tasks = *a.n_tiles;
  const int64_t total = n_tasks * a.row_blocks;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue_group<M>(a, first + s * stride, total, ring + s * a.stage_bytes, lane);
  if constexpr (M == MatvecMode::kPlain) wait_for_previous_kernel();
  for (int64_t it = 0;; ++it) {
    const int64_t g = first + it * stride;
    if (g >= total) break;
    issue_group<M>(a, g + (kStages - 1) * stride, total, ring + ((it + kStages - 1) % kStages) * a.stage_bytes, lane);
    cp_async_wait<kStages - 1>();
    __syncwarp();
    compute_group<Policy, NR, M>(a, g, ring + (it % kStages) * a.stage_bytes, lane, tables);
    __syncwarp();
  }
  cp_async_wait<0>();
}

}  // namespace dsv4::cuda::detail
