// Routed experts for 1-16 tokens (decode, kMoeDecodeMaxTokens), and up to 64 spread over many
// experts (kMoeDecodeWideMaxTokens): two kernels per layer instead of four (moe_experts.h,
// KernelChoice::moe_decode).
//
// gate/up kernel: one block per (token, expert slot) pair and 32 consecutive rows of the
// expert's gate and up matrices, 4 warps of 8 rows each. Blocks are numbered row block first
// (KernelChoice::moe_decode_rows_first): the blocks running at one time hold the same rows of
// every pair, so pairs of one expert (other tokens) meet in L2 and memory serves their rows
// once. The block first asks for its weight
// rows (16-byte cp.async copies into per-warp rings of shared-memory stages, one gate row and
// the same up row per stage, as the one-row matvec kernel does), quantises the token's
// activations into shared memory itself (one thread per block of 32, q8_block.cuh, in the
// layout each lane reads its slice from) instead of a separate launch, then runs the one-row
// kernel's arithmetic (RowUnit, matvec_row_kernel.cuh: activations in registers, gate and up
// rows paired in one pass) and applies the clamped SwiGLU and the routing weight. The 32
// results are one Q8 block of h: warp 0 quantises them and writes them where the down
// kernel's lanes read them, so h never exists in f32.
//
// down kernel: one block of top_k warps per token and range of output rows; warp s streams
// rows of the expert of slot s with that pair's h in registers, and the block adds the top_k
// products of each row in slot order (no atomics, no partial buffer).
//
// Both kernels read the routing ids before waiting for the previous kernel (programmatic
// dependent launch) to start streaming weights early, and check them again after the wait:
// if the early read was stale the stages are thrown away and refilled, so the result never
// depends on it.
//
// Variants (DSV4_MOE_DECODE_VARIANT, moe_decode_variant()), all with the default's bits: each
// row's per-lane products and the lane group's shuffle tree are the same, only the work per pass
// and the warps per block change.
//  0: the kernels above (the default until 2026-12-07).
//  1 ("pairs"): both kernels take two rows per lane group in each pass (their products
//     interleave) and reduce them with a transposed butterfly: the first level sends the other
//     row's values, so 4 values (gate/up of two rows) cost 6 shuffles and 2 values cost 5
//     instead of 20 and 10, on the same tree. Gate/up stages hold two rows.
//  2 ("wide", the default): gate/up blocks of 8 warps x 4 rows (twice the warps per
//     multiprocessor at one token, registers capped for 3 blocks), one row a pass; down as in 1.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/matvec_launch.cuh"
#include "backend/cuda/matvec_row_kernel.cuh"
#include "backend/cuda/moe_experts.h"
#include "backend/cuda/q8_block.cuh"

namespace dsv4::cuda {

namespace detail {

namespace {

constexpr int kGateUpWarps = 4;  // 8 rows each: one Q8 block of h per block (variant 2: 8 warps x 4 rows)
constexpr int kDecodeStages = 3;

struct DecodeArgs {
  const uint8_t* gate = nullptr;
  const uint8_t* up = nullptr;
  const uint8_t* down = nullptr;
  int64_t gu_row_bytes = 0;  // rows of hidden weights
  int64_t dn_row_bytes = 0;  // rows of ffn weights
  int n_experts = 0, hidden = 0, ffn = 0, top_k = 0;
  const float* x = nullptr;         // [tokens][hidden]
  const int32_t* ids = nullptr;     // [tokens][top_k]
  const float* weights = nullptr;   // [tokens][top_k]
  float limit = 0.0f;
  // gate/up geometry: units of the gate/up type per row, lanes per row, rows per stage.
  int gu_units = 0, gu_lanes = 0, gu_rows_per_stage = 0, gu_segment = 0;
  int x_padded = 0;                 // values of a quantised x row (activation_quant.h layout)
  // down geometry
  int dn_units = 0, dn_lanes = 0, dn_rows_per_stage = 0, dn_segment = 0;
  int dn_rows_per_block = 0, dn_blocks_per_token = 0;
  // h quantised for the down rows: [pairs][h_padded] int8, [pairs][h_padded / 32] f32
  int8_t* hq = nullptr;
  float* hd = nullptr;
  int64_t h_padded = 0;
  int h_sub_per_unit = 0;           // down unit weights / 32
  float* y = nullptr;               // [tokens][hidden]
  bool rows_first = true;           // gate/up blocks: row block first, then pair (KernelChoice)
};

// 16-byte copies of `bytes` bytes at src (any alignment) into a segment (see issue_group).
__device__ __forceinline__ void copy_span(uint8_t* dst, const uint8_t* src, int64_t bytes, int lane) {
  const uint8_t* aligned = reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(src) & ~uintptr_t{15});
  const int64_t chunks = (src - aligned + bytes + 15) / 16;
  for (int64_t c = lane; c < chunks; c += 32) cp_async16(dst + 16 * c, aligned + 16 * c);
}

// copy_span with 32-bit counts (a stage is far below 2^31 bytes): fewer instructions per copy.
__device__ __forceinline__ void copy_span32(uint8_t* dst, const uint8_t* src, int bytes, int lane) {
  const int skew = static_cast<int>(reinterpret_cast<uintptr_t>(src) & 15);
  const uint8_t* aligned = src - skew;
  const int chunks = (skew + bytes + 15) >> 4;
  for (int c = lane; c < chunks; c += 32) cp_async16(dst + 16 * c, aligned + 16 * c);
}

// The expert of pair p: read by lane 0 and shared, so the whole warp agrees even if the value
// is being written (the early, unchecked read).
__device__ __forceinline__ int warp_expert(const int32_t* ids, int p, int n_experts, bool early) {
  int e = 0;
  if ((threadIdx.x & 31) == 0) e = early ? __ldcg(ids + p) : ids[p];
  e = __shfl_sync(0xFFFFFFFFu, e, 0);
  return min(max(e, 0), n_experts - 1);
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }

// h of one row: the clamped SwiGLU of its gate and up sums times the routing weight (spec 4.3).
__device__ __forceinline__ float swiglu_h(float g, float u, float limit, float route_weight) {
  const float gate = fminf(g, limit);
  const float up = fminf(fmaxf(u, -limit), limit);
  return route_weight * silu(gate) * up;
}

// Sums of v[0..3] over each group of L >= 4 lanes on the butterfly's tree (levels L/2 .. 1 in
// that order, each lane adding its partner's value: the bits of `v += shfl_xor(v, o)` per value),
// transposed: at level L/2 a lane keeps v[0..1] or v[2..3] and sends the other two, at level
// L/4 it keeps one. Returns the full sum of v[2 * (lane & L/2 != 0) + (lane & L/4 != 0)].
__device__ __forceinline__ float group_sum4_transposed(const float (&v)[4], int L, int lane) {
  const int o1 = L >> 1, o2 = L >> 2;
  const bool hi1 = (lane & o1) != 0, hi2 = (lane & o2) != 0;
  float k0 = hi1 ? v[2] : v[0], k1 = hi1 ? v[3] : v[1];
  const float s0 = hi1 ? v[0] : v[2], s1 = hi1 ? v[1] : v[3];
  k0 += __shfl_xor_sync(0xFFFFFFFFu, s0, o1);
  k1 += __shfl_xor_sync(0xFFFFFFFFu, s1, o1);
  float k = hi2 ? k1 : k0;
  k += __shfl_xor_sync(0xFFFFFFFFu, hi2 ? k0 : k1, o2);
#pragma unroll 1
  for (int o = L >> 3; o > 0; o >>= 1) k += __shfl_xor_sync(0xFFFFFFFFu, k, o);
  return k;
}

// The same for two values and L >= 2: the full sum of (lane & L/2) != 0 ? b : a.
__device__ __forceinline__ float group_sum2_transposed(float a, float b, int L, int lane) {
  const int o1 = L >> 1;
  const bool hi = (lane & o1) != 0;
  float k = hi ? b : a;
  k += __shfl_xor_sync(0xFFFFFFFFu, hi ? a : b, o1);
#pragma unroll 1
  for (int o = L >> 2; o > 0; o >>= 1) k += __shfl_xor_sync(0xFFFFFFFFu, k, o);
  return k;
}

// Position of value i (0..31) of 32-block b in a row of the activation layout
// (activation_quant.h) with `sub` 32-blocks per unit and L lanes: byte offset of the value and
// the index of the block's scale.
__device__ __forceinline__ void layout_position(int b, int sub, int lanes, int i, int64_t& q_at, int64_t& d_at) {
  const int unit = b / sub, t = unit / lanes, slot = unit % lanes, s = b % sub;
  q_at = ((static_cast<int64_t>(t) * sub + s) * 2 * lanes + (i >> 4) * lanes + slot) * 16 + (i & 15);
  d_at = (static_cast<int64_t>(t) * sub + s) * lanes + slot;
}

// Blocks per multiprocessor the gate/up kernel of W warps asks registers for: 3 for the wide
// variant's 8 warps where one unit per lane leaves room (80 registers: 384 blocks, one token of
// V4-Flash, in one wave), 2 for Q3_K and Q6_K, whose decoders spill at 80; else none.
template <GgmlType T, int W, int S>
constexpr int gate_up_min_blocks() {
  if (W != 8 || S != 1) return 0;  // no minimum (as __launch_bounds__(W * 32))
  return T == GgmlType::Q3_K || T == GgmlType::Q6_K ? 2 : 3;
}

// W warps of 32 / W rows; P: two rows per lane group and pass (variant 1).
template <GgmlType T, int S, int W, bool P>
__global__ void __launch_bounds__(W * 32, gate_up_min_blocks<T, W, S>()) moe_decode_gate_up_kernel(const DecodeArgs a) {
  using U = RowUnit<T>;
  extern __shared__ __align__(16) uint8_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row_blocks = a.ffn / 32;
  // Row block first: the pairs of one expert (other tokens) read the same rows together.
  const int pairs = static_cast<int>(gridDim.x) / row_blocks;
  const int pair = a.rows_first ? blockIdx.x % pairs : blockIdx.x / row_blocks;
  const int rb = a.rows_first ? blockIdx.x / pairs : blockIdx.x % row_blocks;
  const int token = pair / a.top_k;
  constexpr int kRowsPerWarp = 32 / W;
  const int row0 = rb * 32 + warp * kRowsPerWarp;
  const int rps = a.gu_rows_per_stage;
  const int stage_bytes = 2 * a.gu_segment;
  uint8_t* ring = smem + warp * kDecodeStages * stage_bytes;
  int8_t* xq = reinterpret_cast<int8_t*>(smem + W * kDecodeStages * stage_bytes);
  float* xd = reinterpret_cast<float*>(smem + W * kDecodeStages * stage_bytes + a.x_padded);
  float* hs = xd + a.x_padded / 32;  // the block's 32 results
  const int64_t matrix_bytes = a.gu_row_bytes * a.ffn;
  const int n_stages = kRowsPerWarp / rps;

  allow_next_kernel();
  int expert = warp_expert(a.ids, pair, a.n_experts, true);
  auto issue = [&](int st, int e) {
    if (st < n_stages) {
      const int64_t at = e * matrix_bytes + static_cast<int64_t>(row0 + st * rps) * a.gu_row_bytes;
      uint8_t* dst = ring + (st % kDecodeStages) * stage_bytes;
      if constexpr (P) {
        copy_span32(dst, a.gate + at, rps * static_cast<int>(a.gu_row_bytes), lane);
        copy_span32(dst + a.gu_segment, a.up + at, rps * static_cast<int>(a.gu_row_bytes), lane);
      } else {
        copy_span(dst, a.gate + at, rps * a.gu_row_bytes, lane);
        copy_span(dst + a.gu_segment, a.up + at, rps * a.gu_row_bytes, lane);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < kDecodeStages - 1; ++s) issue(s, expert);
  wait_for_previous_kernel();
  const int confirmed = warp_expert(a.ids, pair, a.n_experts, false);
  if (confirmed != expert) {  // the early read was stale: drop the stages and ask again
    cp_async_wait<0>();
    __syncwarp();
    expert = confirmed;
#pragma unroll
    for (int s = 0; s < kDecodeStages - 1; ++s) issue(s, expert);
  }

  // The token's activations, quantised by the block into the layout of its lanes' slices.
  quantize_row_to_shared<U::kSub>(a.x + static_cast<int64_t>(token) * a.hidden, a.hidden, a.gu_lanes, xq, xd);
  __syncthreads();
  const int L = a.gu_lanes;
  const int slot = lane & (L - 1);
  const int rows_per_pass = 32 / L, lane_row = lane / L;
  typename U::Act x[S];
  load_unit_activations<U, S>(xq, xd, L, slot, a.gu_units, x);
  const float route_weight = a.weights[pair];

  for (int st = 0; st < n_stages; ++st) {
    issue(st + kDecodeStages - 1, expert);
    cp_async_wait<kDecodeStages - 1>();
    __syncwarp();
    const uint8_t* stage = ring + (st % kDecodeStages) * stage_bytes;
    const int64_t at = expert * matrix_bytes + static_cast<int64_t>(row0 + st * rps) * a.gu_row_bytes;
    const uint8_t* g_rows = stage + (reinterpret_cast<uintptr_t>(a.gate + at) & 15);
    const uint8_t* u_rows = stage + a.gu_segment + (reinterpret_cast<uintptr_t>(a.up + at) & 15);
    if constexpr (P) {
      float* h_out = hs + warp * kRowsPerWarp + st * rps;
      // Rows ra and rb of the stage in one pass (an inactive one reads row 0, which every stage
      // holds, and is dropped).
      for (int rr0 = 0; rr0 < rps; rr0 += 2 * rows_per_pass) {
        const int ra = rr0 + lane_row, rb2 = ra + rows_per_pass;
        const bool active_a = ra < rps, active_b = rb2 < rps;
        const int64_t off_a = static_cast<int64_t>(active_a ? ra : 0) * a.gu_row_bytes;
        const int64_t off_b = static_cast<int64_t>(active_b ? rb2 : 0) * a.gu_row_bytes;
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // gate a, up a, gate b, up b
#pragma unroll
        for (int t = 0; t < S; ++t) {
          const int unit = t * L + slot;
          if (unit < a.gu_units) {
            v[0] += U::dot(g_rows + off_a, unit, x[t]);
            v[1] += U::dot(u_rows + off_a, unit, x[t]);
            v[2] += U::dot(g_rows + off_b, unit, x[t]);
            v[3] += U::dot(u_rows + off_b, unit, x[t]);
          }
        }
        if (L >= 4) {
          const float k = group_sum4_transposed(v, L, lane);
          const float other = __shfl_xor_sync(0xFFFFFFFFu, k, L >> 2);
          // slot 0 holds row a's gate sum (other: its up sum), slot L/2 row b's
          if (slot == 0 && active_a) h_out[ra] = swiglu_h(k, other, a.limit, route_weight);
          if (slot == (L >> 1) && active_b) h_out[rb2] = swiglu_h(k, other, a.limit, route_weight);
        } else {
#pragma unroll 1
          for (int o = L >> 1; o > 0; o >>= 1) {
#pragma unroll
            for (int i = 0; i < 4; ++i) v[i] += __shfl_xor_sync(0xFFFFFFFFu, v[i], o);
          }
          if (slot == 0 && active_a) h_out[ra] = swiglu_h(v[0], v[1], a.limit, route_weight);
          if (slot == 0 && active_b) h_out[rb2] = swiglu_h(v[2], v[3], a.limit, route_weight);
        }
      }
    } else {
      for (int rr0 = 0; rr0 < rps; rr0 += rows_per_pass) {
        const int rr = rr0 + lane_row;
        const bool active = rr < rps;
        float g = 0.0f, u = 0.0f;
        if (active) {
          const uint8_t* gr = g_rows + static_cast<int64_t>(rr) * a.gu_row_bytes;
          const uint8_t* ur = u_rows + static_cast<int64_t>(rr) * a.gu_row_bytes;
#pragma unroll
          for (int t = 0; t < S; ++t) {
            const int unit = t * L + slot;
            if (unit < a.gu_units) {
              g += U::dot(gr, unit, x[t]);
              u += U::dot(ur, unit, x[t]);
            }
          }
        }
#pragma unroll 1
        for (int o = L >> 1; o > 0; o >>= 1) {
          g += __shfl_xor_sync(0xFFFFFFFFu, g, o);
          u += __shfl_xor_sync(0xFFFFFFFFu, u, o);
        }
        if (active && slot == 0) {
          const float gate = fminf(g, a.limit);
          const float up = fminf(fmaxf(u, -a.limit), a.limit);
          hs[warp * kRowsPerWarp + st * rps + rr] = route_weight * silu(gate) * up;  // swiglu_h
        }
      }
    }
    __syncwarp();
  }
  cp_async_wait<0>();
  __syncthreads();
  if (warp == 0) {
    float d;
    const int q = q8_quantize_warp(hs[lane], d);
    int64_t q_at, d_at;
    layout_position(rb, a.h_sub_per_unit, a.dn_lanes, lane, q_at, d_at);
    a.hq[pair * a.h_padded + q_at] = static_cast<int8_t>(q);
    if (lane == 0) a.hd[pair * (a.h_padded / 32) + d_at] = d;
  }
}

// P: two rows per lane group and pass (variants 1 and 2).
template <GgmlType T, int S, bool P>
__global__ void __launch_bounds__(8 * 32) moe_decode_down_kernel(const DecodeArgs a) {
  using U = RowUnit<T>;
  extern __shared__ __align__(16) uint8_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;  // warp = slot
  const int token = blockIdx.x / a.dn_blocks_per_token;
  const int r0 = (blockIdx.x % a.dn_blocks_per_token) * a.dn_rows_per_block;
  const int rows = min(a.dn_rows_per_block, a.hidden - r0);
  const int pair = token * a.top_k + warp;
  const int rps = a.dn_rows_per_stage;
  const int stage_bytes = a.dn_segment;
  uint8_t* ring = smem + warp * kDecodeStages * stage_bytes;
  float* part = reinterpret_cast<float*>(smem + a.top_k * kDecodeStages * stage_bytes);  // [top_k][rows]
  const int64_t matrix_bytes = a.dn_row_bytes * a.hidden;
  const int n_stages = (rows + rps - 1) / rps;

  allow_next_kernel();
  int expert = warp_expert(a.ids, pair, a.n_experts, true);
  auto issue = [&](int st, int e) {
    if (st < n_stages) {
      const int first = r0 + st * rps;
      const int count = min(rps, r0 + rows - first);
      const uint8_t* src = a.down + e * matrix_bytes + static_cast<int64_t>(first) * a.dn_row_bytes;
      uint8_t* dst = ring + (st % kDecodeStages) * stage_bytes;
      if constexpr (P) {
        copy_span32(dst, src, count * static_cast<int>(a.dn_row_bytes), lane);
      } else {
        copy_span(dst, src, count * a.dn_row_bytes, lane);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < kDecodeStages - 1; ++s) issue(s, expert);
  wait_for_previous_kernel();  // h comes from the gate/up kernel
  const int confirmed = warp_expert(a.ids, pair, a.n_experts, false);
  if (confirmed != expert) {
    cp_async_wait<0>();
    __syncwarp();
    expert = confirmed;
#pragma unroll
    for (int s = 0; s < kDecodeStages - 1; ++s) issue(s, expert);
  }
  const int L = a.dn_lanes;
  const int slot = lane & (L - 1);
  const int rows_per_pass = 32 / L, lane_row = lane / L;
  typename U::Act x[S];
  load_unit_activations<U, S>(a.hq + pair * a.h_padded, a.hd + pair * (a.h_padded / 32), L, slot, a.dn_units, x);

  for (int st = 0; st < n_stages; ++st) {
    issue(st + kDecodeStages - 1, expert);
    cp_async_wait<kDecodeStages - 1>();
    __syncwarp();
    const int first = r0 + st * rps;
    const int count = min(rps, r0 + rows - first);
    const uint8_t* src = a.down + expert * matrix_bytes + static_cast<int64_t>(first) * a.dn_row_bytes;
    const uint8_t* stage_rows = ring + (st % kDecodeStages) * stage_bytes + (reinterpret_cast<uintptr_t>(src) & 15);
    if constexpr (P) {
      float* out = part + warp * a.dn_rows_per_block + st * rps;
      // Rows ra and rb of the stage in one pass (an inactive one reads row 0 and is dropped).
      for (int rr0 = 0; rr0 < count; rr0 += 2 * rows_per_pass) {
        const int ra = rr0 + lane_row, rb = ra + rows_per_pass;
        const bool active_a = ra < count, active_b = rb < count;
        const uint8_t* row_a = stage_rows + static_cast<int64_t>(active_a ? ra : 0) * a.dn_row_bytes;
        const uint8_t* row_b = stage_rows + static_cast<int64_t>(active_b ? rb : 0) * a.dn_row_bytes;
        float acc_a = 0.0f, acc_b = 0.0f;
#pragma unroll
        for (int t = 0; t < S; ++t) {
          const int unit = t * L + slot;
          if (unit < a.dn_units) {
            acc_a += U::dot(row_a, unit, x[t]);
            acc_b += U::dot(row_b, unit, x[t]);
          }
        }
        if (L >= 2) {
          const float k = group_sum2_transposed(acc_a, acc_b, L, lane);  // slot 0: row a, slot L/2: row b
          if (slot == 0 && active_a) out[ra] = k;
          if (slot == (L >> 1) && active_b) out[rb] = k;
        } else {
          if (active_a) out[ra] = acc_a;
          if (active_b) out[rb] = acc_b;
        }
      }
    } else {
      for (int rr0 = 0; rr0 < count; rr0 += rows_per_pass) {
        const int rr = rr0 + lane_row;
        const bool active = rr < count;
        float acc = 0.0f;
        if (active) {
          const uint8_t* row = stage_rows + static_cast<int64_t>(rr) * a.dn_row_bytes;
#pragma unroll
          for (int t = 0; t < S; ++t) {
            const int unit = t * L + slot;
            if (unit < a.dn_units) acc += U::dot(row, unit, x[t]);
          }
        }
#pragma unroll 1
        for (int o = L >> 1; o > 0; o >>= 1) acc += __shfl_xor_sync(0xFFFFFFFFu, acc, o);
        if (active && slot == 0) part[warp * a.dn_rows_per_block + st * rps + rr] = acc;
      }
    }
    __syncwarp();
  }
  cp_async_wait<0>();
  __syncthreads();
  for (int i = threadIdx.x; i < rows; i += blockDim.x) {
    float sum = 0.0f;
    for (int s = 0; s < a.top_k; ++s) sum += part[s * a.dn_rows_per_block + i];
    a.y[static_cast<int64_t>(token) * a.hidden + r0 + i] = sum;
  }
}

// Units, lanes and registers (S units per lane) of one row of k values of type T; false when the
// one-row units do not cover such a row.
template <GgmlType T>
bool row_geometry(int64_t k, int& units, int& lanes, int& steps) {
  constexpr int kWeights = 32 * RowUnit<T>::kSub;
  if (!row_unit_covers<T>(k)) return false;
  units = static_cast<int>(k / kWeights);
  lanes = lanes_per_row(k, kWeights);
  steps = (units + lanes - 1) / lanes;
  return true;
}

// Rows per stage: as many as fit the byte target, a whole number of passes of the lane groups
// (capped at `limit`), at least one.
int rows_per_stage(int64_t row_bytes, int sources, int lanes, int limit, int64_t target) {
  const int per_pass = 32 / lanes;
  int rows = static_cast<int>(std::max<int64_t>(1, target / (sources * row_bytes)));
  if (rows >= per_pass) rows = rows / per_pass * per_pass;
  return std::max(1, std::min(rows, limit));
}

int64_t segment_bytes(int64_t rows, int64_t row_bytes) { return (rows * row_bytes + 15 + 15) / 16 * 16 + 16; }

// DSV4_MOE_DECODE_VARIANT (0-2, default kMoeDecodeDefaultVariant): read at the first launch; set_moe_decode_variant
// overrides it (the checks run every variant in one process).
std::atomic<int> g_variant{-1};

int64_t stage_target_bytes() {
  const char* env = std::getenv("DSV4_MOE_DECODE_STAGE_BYTES");  // tuning knob for measurements
  const int64_t v = env != nullptr ? std::atoll(env) : 0;
  return v >= 256 && v <= 32768 ? v : 4096;
}

// Raises a kernel's dynamic shared-memory limit when a launch needs more than any before it
// (a function attribute: set once per size, not on every call).
Status allow_shared_bytes(const void* kernel, int64_t bytes) {
  static std::mutex mutex;
  static std::vector<std::pair<const void*, int64_t>> allowed;
  std::lock_guard<std::mutex> lock(mutex);
  for (auto& entry : allowed) {
    if (entry.first != kernel) continue;
    if (entry.second < bytes) {
      DSV4_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
      entry.second = bytes;
    }
    return Status::ok();
  }
  DSV4_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  allowed.emplace_back(kernel, bytes);
  return Status::ok();
}

// Shared memory of a gate/up block of `warps` warps.
int64_t gate_up_smem_bytes(int warps, int64_t segment, int x_padded) {
  return int64_t{warps} * kDecodeStages * 2 * segment + x_padded + (x_padded / 32) * 4 + 32 * 4;
}

template <GgmlType T, int S, int W, bool P>
Status launch_gate_up(const DecodeArgs& a, int pairs, cudaStream_t stream) {
  auto kernel = &moe_decode_gate_up_kernel<T, S, W, P>;
  const int64_t smem = gate_up_smem_bytes(W, a.gu_segment, a.x_padded);
  if (smem > kMaxSharedBytes) return Status::error("moe_experts (decode): gate/up stages of " + std::to_string(smem) + " bytes");
  DSV4_TRY(allow_shared_bytes(reinterpret_cast<const void*>(kernel), smem));
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(int64_t{pairs} * (a.ffn / 32)));
  config.blockDim = dim3(W * 32);
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  cudaLaunchAttribute pdl{};
  pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl.val.programmaticStreamSerializationAllowed = 1;
  if (programmatic_launch_enabled()) {
    config.attrs = &pdl;
    config.numAttrs = 1;
  }
  DSV4_CUDA_TRY(cudaLaunchKernelEx(&config, kernel, a));
  return Status::ok();
}

template <GgmlType T, int S, bool P>
Status launch_down(const DecodeArgs& a, int tokens, cudaStream_t stream) {
  auto kernel = &moe_decode_down_kernel<T, S, P>;
  const int64_t smem = int64_t{a.top_k} * kDecodeStages * a.dn_segment + int64_t{a.top_k} * a.dn_rows_per_block * 4;
  if (smem > kMaxSharedBytes) return Status::error("moe_experts (decode): down stages of " + std::to_string(smem) + " bytes");
  DSV4_TRY(allow_shared_bytes(reinterpret_cast<const void*>(kernel), smem));
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(int64_t{tokens} * a.dn_blocks_per_token));
  config.blockDim = dim3(a.top_k * 32);
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  cudaLaunchAttribute pdl{};
  pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl.val.programmaticStreamSerializationAllowed = 1;
  if (programmatic_launch_enabled()) {
    config.attrs = &pdl;
    config.numAttrs = 1;
  }
  DSV4_CUDA_TRY(cudaLaunchKernelEx(&config, kernel, a));
  return Status::ok();
}

// The kernel of a variant (the header's list): warps per gate/up block, two rows a pass.
int gate_up_warps(int variant) { return variant == 2 ? 8 : kGateUpWarps; }
bool gate_up_pairs(int variant) { return variant == 1; }
bool down_pairs(int variant) { return variant == 1 || variant == 2; }

template <GgmlType T, int S>
Status launch_gate_up_variant(const DecodeArgs& a, int variant, int pairs, cudaStream_t stream) {
  if (gate_up_warps(variant) == 8) return launch_gate_up<T, S, 8, false>(a, pairs, stream);
  if (gate_up_pairs(variant)) return launch_gate_up<T, S, kGateUpWarps, true>(a, pairs, stream);
  return launch_gate_up<T, S, kGateUpWarps, false>(a, pairs, stream);
}

template <GgmlType T, int S>
Status launch_down_variant(const DecodeArgs& a, int variant, int tokens, cudaStream_t stream) {
  if (down_pairs(variant)) return launch_down<T, S, true>(a, tokens, stream);
  return launch_down<T, S, false>(a, tokens, stream);
}

// The kernels for S = 1, 2 (and 4 for Q8_0 and Q4_K, whose units are narrower).
template <GgmlType T>
Status launch_gate_up_steps(const DecodeArgs& a, int steps, int variant, int pairs, cudaStream_t stream) {
  if (steps <= 1) return launch_gate_up_variant<T, 1>(a, variant, pairs, stream);
  if (steps <= 2) return launch_gate_up_variant<T, 2>(a, variant, pairs, stream);
  if constexpr (T == GgmlType::Q8_0 || T == GgmlType::Q4_K)
    if (steps <= 4) return launch_gate_up_variant<T, 4>(a, variant, pairs, stream);
  return Status::error("moe_experts (decode): rows too long for the gate/up kernel");
}

template <GgmlType T>
Status launch_down_steps(const DecodeArgs& a, int steps, int variant, int tokens, cudaStream_t stream) {
  if (steps <= 1) return launch_down_variant<T, 1>(a, variant, tokens, stream);
  if (steps <= 2) return launch_down_variant<T, 2>(a, variant, tokens, stream);
  if constexpr (T == GgmlType::Q8_0 || T == GgmlType::Q4_K)
    if (steps <= 4) return launch_down_variant<T, 4>(a, variant, tokens, stream);
  return Status::error("moe_experts (decode): rows too long for the down kernel");
}

constexpr int max_steps(GgmlType t) { return t == GgmlType::Q8_0 || t == GgmlType::Q4_K ? 4 : 2; }

template <GgmlType T>
bool geometry(int64_t k, int& units, int& lanes, int& steps, int& unit_weights) {
  unit_weights = 32 * RowUnit<T>::kSub;
  return row_geometry<T>(k, units, lanes, steps) && steps <= max_steps(T);
}

bool geometry_of(GgmlType type, int64_t k, int& units, int& lanes, int& steps, int& unit_weights) {
  switch (type) {
    case GgmlType::Q8_0: return geometry<GgmlType::Q8_0>(k, units, lanes, steps, unit_weights);
    case GgmlType::Q2_K: return geometry<GgmlType::Q2_K>(k, units, lanes, steps, unit_weights);
    case GgmlType::Q3_K: return geometry<GgmlType::Q3_K>(k, units, lanes, steps, unit_weights);
    case GgmlType::Q4_K: return geometry<GgmlType::Q4_K>(k, units, lanes, steps, unit_weights);
    case GgmlType::Q6_K: return geometry<GgmlType::Q6_K>(k, units, lanes, steps, unit_weights);
    case GgmlType::MXFP4: return geometry<GgmlType::MXFP4>(k, units, lanes, steps, unit_weights);
    default: return false;
  }
}

int row_alignment(GgmlType type) {
  switch (type) {
    case GgmlType::Q8_0: return RowUnit<GgmlType::Q8_0>::kAlign;
    case GgmlType::Q2_K: return RowUnit<GgmlType::Q2_K>::kAlign;
    case GgmlType::Q3_K: return RowUnit<GgmlType::Q3_K>::kAlign;
    default: return 1;
  }
}

}  // namespace

int moe_decode_variant() {
  int v = g_variant.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* env = std::getenv("DSV4_MOE_DECODE_VARIANT");  // tuning knob for measurements
    v = env != nullptr ? std::atoi(env) : kMoeDecodeDefaultVariant;
    if (v < 0 || v >= kMoeDecodeVariants) v = kMoeDecodeDefaultVariant;
    int expected = -1;
    if (!g_variant.compare_exchange_strong(expected, v)) v = expected;
  }
  return v;
}

void set_moe_decode_variant(int variant) {
  g_variant.store(variant >= 0 && variant < kMoeDecodeVariants ? variant : kMoeDecodeDefaultVariant,
                  std::memory_order_relaxed);
}

bool moe_decode_applies(const ExpertWeights& w, int64_t tokens, int top_k) {
  if (tokens < 1 || tokens > kMoeDecodeWideMaxTokens || top_k < 1 || top_k > 8) return false;
  if (w.hidden % 32 != 0 || w.ffn % 32 != 0 || w.hidden > (1 << 20) || w.ffn > (1 << 20)) return false;
  int units, lanes, steps, unit_weights;
  if (!geometry_of(w.gate_up_type, w.hidden, units, lanes, steps, unit_weights)) return false;
  if (!geometry_of(w.down_type, w.ffn, units, lanes, steps, unit_weights)) return false;
  const auto& gu = ggml_traits(w.gate_up_type);
  const auto& dn = ggml_traits(w.down_type);
  const int64_t gu_row = w.hidden / gu.block_elems * gu.block_bytes, dn_row = w.ffn / dn.block_elems * dn.block_bytes;
  return gu_row % row_alignment(w.gate_up_type) == 0 && dn_row % row_alignment(w.down_type) == 0;
}

size_t moe_decode_workspace_bytes(const ExpertWeights& w, int64_t tokens, int top_k) {
  int units, lanes, steps, unit_weights;
  if (!geometry_of(w.down_type, w.ffn, units, lanes, steps, unit_weights)) return 0;
  const ActivationLayout layout{unit_weights, lanes};
  return quantized_activations_bytes(tokens * top_k, w.ffn, layout);
}

Status moe_decode(const ExpertWeights& w, const float* x, const ExpertRouting& routing, float swiglu_limit, float* y,
                  void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (!moe_decode_applies(w, routing.tokens, routing.top_k))
    return Status::error("moe_experts (decode): these shapes and types take the general path");
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0) return Status::error("moe_experts (decode): x not 16-byte aligned");
  const size_t need = moe_decode_workspace_bytes(w, routing.tokens, routing.top_k);
  if (workspace_bytes < need)
    return Status::error("moe_experts (decode): workspace of " + std::to_string(workspace_bytes) + " bytes, need " +
                         std::to_string(need));
  const auto& gu = ggml_traits(w.gate_up_type);
  const auto& dn = ggml_traits(w.down_type);
  DecodeArgs a;
  a.gate = static_cast<const uint8_t*>(w.gate);
  a.up = static_cast<const uint8_t*>(w.up);
  a.down = static_cast<const uint8_t*>(w.down);
  a.gu_row_bytes = w.hidden / gu.block_elems * gu.block_bytes;
  a.dn_row_bytes = w.ffn / dn.block_elems * dn.block_bytes;
  a.n_experts = static_cast<int>(w.n_experts);
  a.hidden = static_cast<int>(w.hidden);
  a.ffn = static_cast<int>(w.ffn);
  a.top_k = routing.top_k;
  a.x = x;
  a.ids = routing.ids;
  a.weights = routing.weights;
  a.limit = swiglu_limit;
  a.y = y;
  a.rows_first = kernel_choice().moe_decode_rows_first;
  const int64_t target = stage_target_bytes();

  const int variant = moe_decode_variant();
  const int gu_rows_per_warp = 32 / gate_up_warps(variant);
  int gu_steps = 0, gu_weights = 0;
  geometry_of(w.gate_up_type, w.hidden, a.gu_units, a.gu_lanes, gu_steps, gu_weights);
  a.x_padded = static_cast<int>(padded_row_values(w.hidden, {gu_weights, a.gu_lanes}));
  a.gu_rows_per_stage = rows_per_stage(a.gu_row_bytes, 2, a.gu_lanes, gu_rows_per_warp, target);
  if (gate_up_pairs(variant)) {
    // Stages of both rows of a pass where three blocks still fit a multiprocessor.
    const int want = std::min(2 * (32 / a.gu_lanes), gu_rows_per_warp);
    if (want > a.gu_rows_per_stage &&
        gate_up_smem_bytes(gate_up_warps(variant), segment_bytes(want, a.gu_row_bytes), a.x_padded) <=
            kMaxSharedBytes / 3)
      a.gu_rows_per_stage = want;
  }
  while (gu_rows_per_warp % a.gu_rows_per_stage != 0) --a.gu_rows_per_stage;
  a.gu_segment = static_cast<int>(segment_bytes(a.gu_rows_per_stage, a.gu_row_bytes));

  int dn_steps = 0, dn_weights = 0;
  geometry_of(w.down_type, w.ffn, a.dn_units, a.dn_lanes, dn_steps, dn_weights);
  a.dn_rows_per_stage = rows_per_stage(a.dn_row_bytes, 1, a.dn_lanes, 64, target);
  a.dn_segment = static_cast<int>(segment_bytes(a.dn_rows_per_stage, a.dn_row_bytes));
  // Rows per block: about three blocks per multiprocessor over all tokens, whole stages.
  DSV4_ASSIGN_OR_RETURN(const int sms, sm_count());
  const int64_t want_blocks = 3 * int64_t{sms};
  int64_t rows = (w.hidden * routing.tokens + want_blocks - 1) / want_blocks;
  rows = (rows + a.dn_rows_per_stage - 1) / a.dn_rows_per_stage * a.dn_rows_per_stage;
  a.dn_rows_per_block = static_cast<int>(std::min<int64_t>(rows, w.hidden));
  a.dn_blocks_per_token = static_cast<int>((w.hidden + a.dn_rows_per_block - 1) / a.dn_rows_per_block);
  const ActivationLayout h_layout{dn_weights, a.dn_lanes};
  const QuantizedActivations hq =
      quantized_activations_view(workspace, routing.tokens * routing.top_k, w.ffn, h_layout);
  a.hq = hq.q;
  a.hd = hq.d;
  a.h_padded = hq.padded_k;
  a.h_sub_per_unit = dn_weights / 32;

  const int pairs = static_cast<int>(routing.tokens * routing.top_k);
  switch (w.gate_up_type) {
    case GgmlType::Q8_0: DSV4_TRY(launch_gate_up_steps<GgmlType::Q8_0>(a, gu_steps, variant, pairs, stream)); break;
    case GgmlType::Q2_K: DSV4_TRY(launch_gate_up_steps<GgmlType::Q2_K>(a, gu_steps, variant, pairs, stream)); break;
    case GgmlType::Q3_K: DSV4_TRY(launch_gate_up_steps<GgmlType::Q3_K>(a, gu_steps, variant, pairs, stream)); break;
    case GgmlType::Q4_K: DSV4_TRY(launch_gate_up_steps<GgmlType::Q4_K>(a, gu_steps, variant, pairs, stream)); break;
    case GgmlType::Q6_K: DSV4_TRY(launch_gate_up_steps<GgmlType::Q6_K>(a, gu_steps, variant, pairs, stream)); break;
    case GgmlType::MXFP4: DSV4_TRY(launch_gate_up_steps<GgmlType::MXFP4>(a, gu_steps, variant, pairs, stream)); break;
    default: return Status::error("moe_experts (decode): unreachable gate/up type");
  }
  const int tokens = static_cast<int>(routing.tokens);
  switch (w.down_type) {
    case GgmlType::Q8_0: return launch_down_steps<GgmlType::Q8_0>(a, dn_steps, variant, tokens, stream);
    case GgmlType::Q2_K: return launch_down_steps<GgmlType::Q2_K>(a, dn_steps, variant, tokens, stream);
    case GgmlType::Q3_K: return launch_down_steps<GgmlType::Q3_K>(a, dn_steps, variant, tokens, stream);
    case GgmlType::Q4_K: return launch_down_steps<GgmlType::Q4_K>(a, dn_steps, variant, tokens, stream);
    case GgmlType::Q6_K: return launch_down_steps<GgmlType::Q6_K>(a, dn_steps, variant, tokens, stream);
    case GgmlType::MXFP4: return launch_down_steps<GgmlType::MXFP4>(a, dn_steps, variant, tokens, stream);
    default: return Status::error("moe_experts (decode): unreachable down type");
  }
}

}  // namespace detail

}  // namespace dsv4::cuda
