// Top-k of each row's visible indexer scores (attention_ops.h top_k), one block per row:
// an exact radix select of the k-th largest score (four 8-bit digit passes over
// order-preserving integer keys), then an index-ordered compaction that keeps every score
// above it and the lowest-index ties at it. That is the CPU's rule (highest score first,
// equal scores keep the lower index) and gives its output order (ascending) directly, so
// the selection is identical to the CPU's for the same scores. Included by attention_ops.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/attention_kernels.cuh"

namespace dsv4::cuda::attn {

// Scores staged in shared memory when a row has at most this many (128 KB); longer rows
// read the scores from global memory in each pass.
constexpr int kTopKStageMax = 32768;

// Larger float -> larger key, -0 == +0 (the CPU compares with == and >); NaN sorts lowest.
__device__ __forceinline__ uint32_t order_key(float x) {
  uint32_t u = __float_as_uint(x);
  if ((u & 0x7fffffffu) == 0) u = 0;
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct TopKKernelArgs {
  DeviceRows scores;
  int ratio = 0;
  StepMeta m;
  int k = 0;
  int32_t* idx = nullptr;
  int64_t idx_ld = 0;
  int stage_cap = 0;  // keys the dynamic shared memory holds
};

template <int THREADS>
__global__ void __launch_bounds__(THREADS) top_k_kernel(const TopKKernelArgs p) {
  constexpr int NW = THREADS / 32;
  extern __shared__ uint32_t staged[];
  __shared__ int hist[256];
  __shared__ int pick_bin, pick_above;
  __shared__ int warp_gt[NW], warp_eq[NW], warp_eq_base[NW], warp_out_base[NW];
  const int r = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int s = p.m.row_seq[r];
  const int64_t visible = s < 0 ? 0 : (p.m.positions[r] + 1) / p.ratio;
  const int v = static_cast<int>(visible < p.scores.cols ? visible : p.scores.cols);
  const int take = p.k < v ? p.k : v;
  int32_t* out = p.idx + static_cast<int64_t>(r) * p.idx_ld;
  if (take == v) {  // every visible entry (none for padding rows), then -1
    for (int j = tid; j < p.k; j += THREADS) out[j] = j < v ? j : -1;
    return;
  }
  const float* row = row_ptr(p.scores, r);
  const bool in_smem = v <= p.stage_cap;
  if (in_smem) {
    for (int i = tid; i < v; i += THREADS) staged[i] = order_key(row[i]);
    __syncthreads();
  }
  const auto key_at = [&](int i) { return in_smem ? staged[i] : order_key(row[i]); };

  // Radix select: after each pass `prefix` holds the k-th largest key's top bits and `need`
  // how many keys with exactly those bits are still to be taken.
  uint32_t prefix = 0, mask = 0;
  int need = take;
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    for (int i = tid; i < 256; i += THREADS) hist[i] = 0;
    __syncthreads();
    for (int base = 0; base + warp * 32 < v; base += THREADS) {  // warp-uniform condition
      const int i = base + tid;
      int bin = -1;
      if (i < v) {
        const uint32_t key = key_at(i);
        if ((key & mask) == prefix) bin = static_cast<int>((key >> shift) & 0xffu);
      }
      // One atomic per distinct bin of the warp: the top digits of similar scores coincide.
      const unsigned peers = __match_any_sync(kFullMask, bin);
      if (bin >= 0 && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
    }
    __syncthreads();
    if (warp == 0) {
      // Lane l holds bins 255-8l down to 248-8l; counts accumulate from the top.
      int c[8], sum = 0;
#pragma unroll
      for (int e = 0; e < 8; ++e) sum += (c[e] = hist[255 - 8 * lane - e]);
      int incl = sum;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int up = __shfl_up_sync(kFullMask, incl, off);
        if (lane >= off) incl += up;
      }
      const int excl = incl - sum;
      const unsigned here = __ballot_sync(kFullMask, excl < need && need <= incl);
      if (lane == __ffs(here) - 1) {
        int acc = excl;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          if (acc + c[e] >= need) {
            pick_bin = 255 - 8 * lane - e;
            pick_above = acc;
            break;
          }
          acc += c[e];
        }
      }
    }
    __syncthreads();
    prefix |= static_cast<uint32_t>(pick_bin) << shift;
    mask |= 0xffu << shift;
    need -= pick_above;
    __syncthreads();
  }
  const uint32_t threshold = prefix;  // the k-th largest key; `need` of its ties are taken

  // Index-ordered compaction: warp w owns a contiguous segment, lanes read it 32 at a time.
  const int seg = ((v + NW - 1) / NW + 31) / 32 * 32;
  const int w_begin = warp * seg, w_end = w_begin + seg < v ? w_begin + seg : v;
  int gt = 0, eq = 0;
  for (int base = w_begin; base < w_end; base += 32) {
    const int i = base + lane;
    const uint32_t key = i < w_end ? key_at(i) : 0;
    gt += __popc(__ballot_sync(kFullMask, i < w_end && key > threshold));
    eq += __popc(__ballot_sync(kFullMask, i < w_end && key == threshold));
  }
  if (lane == 0) {
    warp_gt[warp] = gt;
    warp_eq[warp] = eq;
  }
  __syncthreads();
  if (tid == 0) {
    int eq_before = 0, out_before = 0;
    for (int w = 0; w < NW; ++w) {
      warp_eq_base[w] = eq_before;
      warp_out_base[w] = out_before;
      int ties = need - eq_before;
      ties = ties < 0 ? 0 : (ties > warp_eq[w] ? warp_eq[w] : ties);
      out_before += warp_gt[w] + ties;
      eq_before += warp_eq[w];
    }
  }
  __syncthreads();
  int eq_run = warp_eq_base[warp], out_run = warp_out_base[warp];
  const unsigned below = (1u << lane) - 1;
  for (int base = w_begin; base < w_end; base += 32) {
    const int i = base + lane;
    const uint32_t key = i < w_end ? key_at(i) : 0;
    const bool is_eq = i < w_end && key == threshold;
    const unsigned eq_mask = __ballot_sync(kFullMask, is_eq);
    const bool pick = (i < w_end && key > threshold) || (is_eq && eq_run + __popc(eq_mask & below) < need);
    const unsigned pick_mask = __ballot_sync(kFullMask, pick);
    if (pick) out[out_run + __popc(pick_mask & below)] = i;
    eq_run += __popc(eq_mask);
    out_run += __popc(pick_mask);
  }
  for (int j = take + tid; j < p.k; j += THREADS) out[j] = -1;
}

}  // namespace dsv4::cuda::attn
