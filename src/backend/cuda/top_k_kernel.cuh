// Top-k of each row's visible indexer scores (attention_ops.h top_k). The block-wide
// selection is an exact radix select of the k-th largest score (four 8-bit digit passes
// over order-preserving integer keys), then an index-ordered compaction that keeps every
// score above it and the lowest-index ties at it. That is the CPU's rule (highest score
// first, equal scores keep the lower index) and gives its output order (ascending), so the
// selection is identical to the CPU's for the same scores.
//
// Short rows: one block per row. Long rows (decode at long contexts): first every chunk of
// a row selects its own top-k in parallel blocks, then one block per row selects among the
// chunks' candidates. Exact: under the total order (score descending, index ascending) an
// element with fewer than k elements before it in the row has fewer than k before it in its
// chunk, so the row's top-k is among the candidates; the candidate list is in ascending
// index order, so ties still go to the lower index. Included by attention_ops.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/attention_kernels.cuh"
#include "backend/cuda/dependent_launch.cuh"

namespace dsv4::cuda::attn {

// Keys staged in shared memory when a block selects among at most this many (128 KB);
// longer lists are read from global memory in each pass.
constexpr int kTopKStageMax = 32768;
// Rows longer than this take the two-phase path, in chunks of at least kTopKChunk.
constexpr int kTopKTwoPhaseFrom = 16384;
constexpr int kTopKChunk = 8192;

// Larger float -> larger key, -0 == +0 (the CPU compares with == and >); NaN sorts lowest.
// Key 0 is never a number's: the two-phase path marks absent candidates with it.
__device__ __forceinline__ uint32_t order_key(float x) {
  uint32_t u = __float_as_uint(x);
  if ((u & 0x7fffffffu) == 0) u = 0;
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// order_key(-inf): a score of -inf marks an entry that does not exist (grafts, backend.h). It
// takes part in the selection like any key but is never written out: the selection is the
// top-k's with those entries dropped, in order, and -1 padding after the rest (what a
// separate one-warp pass over the top-k's output did, 11 us a CSA layer at one row in ncu).
constexpr uint32_t kAbsentKey = ~0xff800000u;

struct TopKKernelArgs {
  DeviceRows scores;
  int ratio = 0;
  StepMeta m;
  int k = 0;
  int32_t* idx = nullptr;
  int64_t idx_ld = 0;
  int stage_cap = 0;         // keys the dynamic shared memory holds
  int chunk = 0;             // two-phase: scores per chunk
  int chunks = 0;            // two-phase: chunks per row (0: one phase)
  int32_t* cand = nullptr;   // two-phase: [n][chunks][k] candidate indices, -1 = none
};

template <int NW>
struct TopKShared {
  int hist[256];
  int pick_bin, pick_above;
  int warp_gt[NW], warp_eq[NW], warp_eq_base[NW], warp_out_base[NW];
  int written;
};

// The whole block, in ascending position order: index_of(position) of every key of
// key_at(0..len) above `threshold` and of the first `need` keys equal to it, except absent ones
// (kAbsentKey) when drop_absent, written to out. Returns how many were written.
template <int THREADS, class KeyAt, class IndexOf>
__device__ int block_compact(int len, uint32_t threshold, int need, bool drop_absent, const KeyAt& key_at,
                             const IndexOf& index_of, int32_t* out, TopKShared<THREADS / 32>& sh) {
  constexpr int NW = THREADS / 32;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // Warp w owns a contiguous segment, lanes read it 32 at a time. gt: keys above the
  // threshold that are written; ties at an absent threshold are never written.
  const bool write_ties = !(drop_absent && threshold == kAbsentKey);
  const int seg = ((len + NW - 1) / NW + 31) / 32 * 32;
  const int w_begin = warp * seg, w_end = w_begin + seg < len ? w_begin + seg : len;
  int gt = 0, eq = 0;
  for (int base = w_begin; base < w_end; base += 32) {
    const int i = base + lane;
    const uint32_t key = i < w_end ? key_at(i) : 0;
    gt += __popc(__ballot_sync(kFullMask, i < w_end && key > threshold && !(drop_absent && key == kAbsentKey)));
    eq += __popc(__ballot_sync(kFullMask, i < w_end && key == threshold));
  }
  if (lane == 0) {
    sh.warp_gt[warp] = gt;
    sh.warp_eq[warp] = eq;
  }
  __syncthreads();
  if (tid == 0) {
    int eq_before = 0, out_before = 0;
    for (int w = 0; w < NW; ++w) {
      sh.warp_eq_base[w] = eq_before;
      sh.warp_out_base[w] = out_before;
      int ties = need - eq_before;
      ties = ties < 0 ? 0 : (ties > sh.warp_eq[w] ? sh.warp_eq[w] : ties);
      out_before += sh.warp_gt[w] + (write_ties ? ties : 0);
      eq_before += sh.warp_eq[w];
    }
    sh.written = out_before;
  }
  __syncthreads();
  const int written = sh.written;
  int eq_run = sh.warp_eq_base[warp], out_run = sh.warp_out_base[warp];
  const unsigned below = (1u << lane) - 1;
  for (int base = w_begin; base < w_end; base += 32) {
    const int i = base + lane;
    const uint32_t key = i < w_end ? key_at(i) : 0;
    const bool is_eq = i < w_end && key == threshold;
    const unsigned eq_mask = __ballot_sync(kFullMask, is_eq);
    const bool pick = (i < w_end && key > threshold) || (is_eq && eq_run + __popc(eq_mask & below) < need);
    const bool write = pick && !(drop_absent && key == kAbsentKey);
    const unsigned write_mask = __ballot_sync(kFullMask, write);
    if (write) out[out_run + __popc(write_mask & below)] = index_of(i);
    eq_run += __popc(eq_mask);
    out_run += __popc(write_mask);
  }
  return written;
}

// The whole block: index_of(position) of the `take` largest of key_at(0..len) (ties: lower
// position first), in ascending position order, less absent ones when drop_absent, to out.
// Returns how many were written.
template <int THREADS, class KeyAt, class IndexOf>
__device__ int block_select(int len, int take, bool drop_absent, const KeyAt& key_at, const IndexOf& index_of,
                            int32_t* out, TopKShared<THREADS / 32>& sh) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // Radix select: after each pass `prefix` holds the k-th largest key's top bits and `need`
  // how many keys with exactly those bits are still to be taken.
  uint32_t prefix = 0, mask = 0;
  int need = take;
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    for (int i = tid; i < 256; i += THREADS) sh.hist[i] = 0;
    __syncthreads();
    for (int base = 0; base + warp * 32 < len; base += 4 * THREADS) {  // warp-uniform condition
      int bins[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {  // four independent loads in flight
        const int i = base + u * THREADS + tid;
        bins[u] = -1;
        if (i < len) {
          const uint32_t key = key_at(i);
          if ((key & mask) == prefix) bins[u] = static_cast<int>((key >> shift) & 0xffu);
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        if (!__any_sync(kFullMask, bins[u] >= 0)) continue;  // later passes: most keys are out
        // One atomic per distinct bin of the warp: the top digits of similar scores coincide.
        const unsigned peers = __match_any_sync(kFullMask, bins[u]);
        if (bins[u] >= 0 && lane == __ffs(peers) - 1) atomicAdd(&sh.hist[bins[u]], __popc(peers));
      }
    }
    __syncthreads();
    if (warp == 0) {
      // Lane l holds bins 255-8l down to 248-8l; counts accumulate from the top.
      int c[8], sum = 0;
#pragma unroll
      for (int e = 0; e < 8; ++e) sum += (c[e] = sh.hist[255 - 8 * lane - e]);
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
            sh.pick_bin = 255 - 8 * lane - e;
            sh.pick_above = acc;
            break;
          }
          acc += c[e];
        }
      }
    }
    __syncthreads();
    prefix |= static_cast<uint32_t>(sh.pick_bin) << shift;
    mask |= 0xffu << shift;
    need -= sh.pick_above;
    __syncthreads();
  }
  const uint32_t threshold = prefix;  // the take-th largest key; `need` of its ties are taken
  return block_compact<THREADS>(len, threshold, need, drop_absent, key_at, index_of, out, sh);
}

__device__ __forceinline__ int visible_scores(const TopKKernelArgs& p, int r) {
  const int s = p.m.row_seq[r];
  const int64_t visible = s < 0 ? 0 : (p.m.positions[r] + 1) / p.ratio;
  return static_cast<int>(visible < p.scores.cols ? visible : p.scores.cols);
}

// One block per row: every visible score (one phase), or the chunks' candidates (the
// second phase of the two-phase path). A row with more scores than StepRows::max_end
// promised (the chunks do not cover it) is selected in one phase from global memory.
template <int THREADS>
__global__ void __launch_bounds__(THREADS) top_k_kernel(const TopKKernelArgs p) {
  ::dsv4::cuda::dependent_kernel_prologue();
  extern __shared__ uint32_t staged[];
  __shared__ TopKShared<THREADS / 32> sh;
  const int r = blockIdx.x, tid = threadIdx.x;
  const int v = visible_scores(p, r);
  const int take = p.k < v ? p.k : v;
  int32_t* out = p.idx + static_cast<int64_t>(r) * p.idx_ld;
  const float* row = row_ptr(p.scores, r);
  const auto key_of_row = [&](int i) { return order_key(row[i]); };
  const auto position = [](int i) { return i; };
  int written = 0;
  if (take == v) {  // every visible entry that exists (none for padding rows)
    written = block_compact<THREADS>(v, 0u, v, true, key_of_row, position, out, sh);
  } else if (p.chunks > 0 && v <= p.chunks * p.chunk) {  // (a row past the plan's bound reads all its scores)
    const int32_t* cand = p.cand + static_cast<int64_t>(r) * p.chunks * p.k;
    const int len = p.chunks * p.k;  // <= stage_cap (host)
    for (int i = tid; i < len; i += THREADS) staged[i] = cand[i] >= 0 ? order_key(row[cand[i]]) : 0u;
    __syncthreads();
    written = block_select<THREADS>(len, take, true, [&](int i) { return staged[i]; }, [&](int i) { return cand[i]; },
                                    out, sh);
  } else if (v <= p.stage_cap) {
    for (int i = tid; i < v; i += THREADS) staged[i] = order_key(row[i]);
    __syncthreads();
    written = block_select<THREADS>(v, take, true, [&](int i) { return staged[i]; }, position, out, sh);
  } else {
    written = block_select<THREADS>(v, take, true, key_of_row, position, out, sh);
  }
  for (int j = written + tid; j < p.k; j += THREADS) out[j] = -1;
}

// First phase: block (r, c) writes the top-k of chunk c of row r's visible scores as
// ascending indices, -1 padded, to cand[r][c].
template <int THREADS>
__global__ void __launch_bounds__(THREADS) top_k_chunk_kernel(const TopKKernelArgs p) {
  ::dsv4::cuda::dependent_kernel_prologue();
  extern __shared__ uint32_t staged[];
  __shared__ TopKShared<THREADS / 32> sh;
  const int r = blockIdx.x, c = blockIdx.y, tid = threadIdx.x;
  const int v = visible_scores(p, r);
  if (v <= p.k) return;  // the second phase takes every entry itself
  const int begin = c * p.chunk;
  const int len = v - begin < 0 ? 0 : (v - begin < p.chunk ? v - begin : p.chunk);
  const int take = p.k < len ? p.k : len;
  int32_t* out = p.cand + (static_cast<int64_t>(r) * p.chunks + c) * p.k;
  if (take == len) {
    for (int j = tid; j < p.k; j += THREADS) out[j] = j < len ? begin + j : -1;
    return;
  }
  const float* row = row_ptr(p.scores, r) + begin;
  const auto index_of = [&](int i) { return begin + i; };
  // Absent entries stay among the candidates: the second phase selects as one phase would.
  if (len <= p.stage_cap) {
    for (int i = tid; i < len; i += THREADS) staged[i] = order_key(row[i]);
    __syncthreads();
    block_select<THREADS>(len, take, false, [&](int i) { return staged[i]; }, index_of, out, sh);
  } else {
    block_select<THREADS>(len, take, false, [&](int i) { return order_key(row[i]); }, index_of, out, sh);
  }
}

}  // namespace dsv4::cuda::attn
