// Device code of the attention-side step operations (attention_ops.h): key lookup shared by
// every kernel, the exact (fp32 SIMT) attention and its split combine, the window ring
// update, the streaming compressor, entry storage, block positions and the exact indexer.
// Included by attention_ops.cu only. Design notes: docs/CUDA.md, "Attention".
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "backend/cuda/attention_ops.h"
#include "backend/cuda/cp_async.cuh"
#include "backend/cuda/dependent_launch.cuh"
#include "backend/cuda/row_finish.cuh"

namespace dsv4::cuda::attn {

constexpr float kNegInf = -INFINITY;
constexpr unsigned kFullMask = 0xffffffffu;

// ---- shared helpers ---------------------------------------------------------------------

struct Seq {
  int first_row, rows, first_pos, slot, window_start;
};
__device__ __forceinline__ Seq load_seq(const int32_t* seqs, int s) {
  const int32_t* f = seqs + kStepSeqFields * static_cast<int64_t>(s);
  return {f[0], f[1], f[2], f[3], f[4]};
}

// A slot's first existing row of a paged list (grafts), 0 without a table.
__device__ __forceinline__ int64_t first_row_of(const DevicePaged& p, int64_t slot) {
  return p.first_row && slot >= 0 && slot < p.slots ? p.first_row[slot] : 0;
}

__device__ __forceinline__ float* row_ptr(const DeviceRows& m, int64_t row) { return m.data + row * m.ld; }

// Row i of slot `slot`'s paged list, or null when no page holds it (the CPU's paged_row).
__device__ __forceinline__ float* paged_row(const DevicePaged& p, int64_t slot, int64_t i) {
  if (slot < 0 || slot >= p.slots || i < 0) return nullptr;
  const int64_t pi = i / p.page_rows;
  if (pi >= p.max_pages) return nullptr;
  const int32_t page = p.page_table[slot * p.table_ld + pi];
  if (page < 0 || (int64_t{page} + 1) * p.page_rows > p.pool.rows) return nullptr;
  return p.pool.data + (int64_t{page} * p.page_rows + i % p.page_rows) * p.pool.ld;
}

__device__ __forceinline__ float4 splat4(float v) { return make_float4(v, v, v, v); }

// ---- attention keys ----------------------------------------------------------------------
//
// Row r at position t reads, in this order, the window positions t-nw+1 .. t (nw =
// min(t+1, window)) from the chunk (positions of this step) or the ring, then nc compressed
// entries: every visible one (HCA) or the `top` slots of selected[r] (CSA; -1 = unused).

enum KeyKind : int { kKeyValid = 0, kKeyMasked = 1, kKeyBad = 2 };

struct RowKeys {
  int64_t t = 0;
  Seq sq{};
  int64_t nw = 0, n_keys = 0, visible = 0;
  int64_t first = 0;  // first existing compressed entry (grafts)
  bool too_many = false;  // more keys than the plan (StepRows::max_end too small): NaN row
};

__device__ __forceinline__ RowKeys row_keys(const AttentionArgs& a, const StepMeta& m, int r, int s,
                                            int64_t max_keys) {
  RowKeys k;
  k.t = m.positions[r];
  k.sq = load_seq(m.seqs, s);
  const int64_t since_start = k.t - k.sq.window_start + 1;  // positions with KV up to t
  k.nw = since_start < a.window ? (since_start > 0 ? since_start : 0) : a.window;
  k.visible = a.ratio > 0 ? (k.t + 1) / a.ratio : 0;
  k.first = a.ratio > 0 && !a.selected ? first_row_of(a.entries, k.sq.slot) : 0;
  if (k.first > k.visible) k.first = k.visible;
  const int64_t nc = a.ratio > 0 ? (a.selected ? a.top : k.visible - k.first) : 0;
  k.n_keys = k.nw + nc;
  if (k.n_keys > max_keys) {
    k.too_many = true;
    k.n_keys = max_keys;
  }
  return k;
}

// Key i of row r's list: its row, or null with kind masked (past the list, CSA -1) or bad
// (a reference outside the buffers; the CPU backend reports those as errors).
__device__ __forceinline__ const float* key_row(const AttentionArgs& a, const StepMeta& m, int r,
                                                const RowKeys& k, int64_t i, int* kind) {
  *kind = kKeyBad;
  if (i >= k.n_keys) {
    *kind = kKeyMasked;
    return nullptr;
  }
  if (k.too_many && i == 0) return nullptr;
  if (i < k.nw) {
    const int64_t pos = k.t - k.nw + 1 + i;
    if (pos >= k.sq.first_pos) {
      const int64_t row = k.sq.first_row + (pos - k.sq.first_pos);
      if (row < 0 || row >= m.n || row >= a.chunk.rows) return nullptr;
      *kind = kKeyValid;
      return row_ptr(a.chunk, row);
    }
    const int64_t M = a.ring_rows > 0 ? a.ring_rows : a.window;
    if (k.sq.slot < 0 || (int64_t{k.sq.slot} + 1) * M > a.ring.rows) return nullptr;
    *kind = kKeyValid;
    return row_ptr(a.ring, int64_t{k.sq.slot} * M + pos % M);
  }
  const int64_t j = i - k.nw;
  int64_t e = k.first + j;
  if (a.selected) {
    e = a.selected[static_cast<int64_t>(r) * a.selected_ld + j];
    if (e == -1) {
      *kind = kKeyMasked;
      return nullptr;
    }
  }
  if (e < first_row_of(a.entries, k.sq.slot) || e >= k.visible) return nullptr;
  const float* p = paged_row(a.entries, k.sq.slot, e);
  if (p) *kind = kKeyValid;
  return p;
}

// ---- exact attention -----------------------------------------------------------------------

constexpr int kKeyTile = 16;  // keys per shared-memory tile of the exact kernel

struct AttentionKernelArgs {
  AttentionArgs a;
  StepMeta m;
  int heads_per_block = 0;  // 8 per warp
  int splits = 1;
  int tiles_per_split = 0;
  int64_t max_keys = 0;
  float* part_o = nullptr;   // [n][splits][heads][d]: unnormalised sums
  float* part_ml = nullptr;  // [n][splits][heads][2]: running max, sum of exponentials
};

__host__ __device__ constexpr size_t exact_attention_smem(int heads_per_block, int d) {
  return sizeof(float) * (static_cast<size_t>(heads_per_block) * d + 2 * kKeyTile * (d + 4)) + 2 * kKeyTile * sizeof(int);
}

// One block: row blockIdx.x, heads [blockIdx.y * HB, +HB), key tiles of split blockIdx.z.
// Q of the block's heads stays in shared memory; key tiles of 16 rows (K = V) stream through
// two buffers (cp.async). Warp w owns heads 8w..8w+7: for the logits lane (j, half) takes key
// j of the tile for four heads; for P.V every lane keeps 4*D4 output dimensions of all eight
// heads in registers, so each key value read from shared memory feeds eight heads. Online
// softmax in fp32 (running max m, sum l); the sink enters only the final denominator.
template <int D4>
__global__ void __launch_bounds__(256, 1) attention_exact_kernel(const AttentionKernelArgs p) {
  ::dsv4::cuda::dependent_kernel_prologue();
  constexpr int D = 128 * D4;
  constexpr int KS = D + 4;  // padded key row: the 16 keys of a tile hit different banks
  extern __shared__ __align__(16) float smem[];
  const AttentionArgs& a = p.a;
  const int HB = p.heads_per_block;
  float* qs = smem;                                          // [HB][D]
  float* ks = smem + static_cast<size_t>(HB) * D;            // [2][kKeyTile][KS]
  int* kinds = reinterpret_cast<int*>(ks + 2 * kKeyTile * KS);  // [2][kKeyTile]

  const int r = blockIdx.x, split = blockIdx.z;
  const int h0 = blockIdx.y * HB;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int s = p.m.row_seq[r];
  if (s < 0) {  // padding row: zeros (with splits the combine writes them)
    if (p.splits == 1)
      for (int i = tid; i < HB * (D / 4); i += blockDim.x) {
        const int h = h0 + i / (D / 4);
        if (h < a.heads)
          *reinterpret_cast<float4*>(a.out + static_cast<int64_t>(r) * a.out_ld + static_cast<int64_t>(h) * D +
                                     (i % (D / 4)) * 4) = splat4(0.0f);
      }
    return;
  }
  const RowKeys rk = row_keys(a, p.m, r, s, p.max_keys);
  const int64_t n_tiles = (rk.n_keys + kKeyTile - 1) / kKeyTile;
  const int64_t t_begin = static_cast<int64_t>(split) * p.tiles_per_split;
  const int64_t t_end = t_begin + p.tiles_per_split < n_tiles ? t_begin + p.tiles_per_split : n_tiles;

  const auto load_tile = [&](int64_t tile, int buf) {
    const int per_key = blockDim.x / kKeyTile;
    const int j = tid / per_key, sub = tid % per_key;
    int kind;
    const float* src = key_row(a, p.m, r, rk, tile * kKeyTile + j, &kind);
    float* dst = ks + (buf * kKeyTile + j) * KS;
    if (kind == kKeyValid) {
      for (int c4 = sub; c4 < D / 4; c4 += per_key) cp_async16(dst + c4 * 4, src + c4 * 4);
    } else {  // masked keys are zeros (p = 0 must not meet garbage); bad keys NaN
      const float4 v = splat4(kind == kKeyMasked ? 0.0f : NAN);
      for (int c4 = sub; c4 < D / 4; c4 += per_key) *reinterpret_cast<float4*>(dst + c4 * 4) = v;
    }
    if (sub == 0) kinds[buf * kKeyTile + j] = kind;
  };

  const int hw = warp * 8;                 // first block-local head of this warp
  const int kj = lane & 15, half = lane >> 4;
  float m_run[4], l_run[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) m_run[i] = kNegInf, l_run[i] = 0.0f;
  float4 o[8][D4];
#pragma unroll
  for (int h = 0; h < 8; ++h)
#pragma unroll
    for (int dd = 0; dd < D4; ++dd) o[h][dd] = splat4(0.0f);

  if (t_begin < t_end) {
    for (int i = tid; i < HB * (D / 4); i += blockDim.x) {
      const int hl = i / (D / 4), c4 = i % (D / 4), h = h0 + hl;
      float* dst = qs + hl * D + c4 * 4;
      if (h < a.heads)
        cp_async16(dst, a.q + static_cast<int64_t>(r) * a.q_ld + static_cast<int64_t>(h) * D + c4 * 4);
      else
        *reinterpret_cast<float4*>(dst) = splat4(0.0f);
    }
    load_tile(t_begin, 0);
    cp_async_commit();
  }
  for (int64_t tt = t_begin; tt < t_end; ++tt) {
    const int buf = static_cast<int>((tt - t_begin) & 1);
    if (tt + 1 < t_end) {
      load_tile(tt + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    // logits of key kj for heads hw + 4*half + i
    const float* krow = ks + (buf * kKeyTile + kj) * KS;
    const float* q0 = qs + (hw + 4 * half) * D;
    float dot[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
    for (int c = 0; c < D; c += 4) {
      const float4 k4 = *reinterpret_cast<const float4*>(krow + c);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 q4 = *reinterpret_cast<const float4*>(q0 + i * D + c);
        dot[i] = fmaf(q4.x, k4.x, dot[i]);
        dot[i] = fmaf(q4.y, k4.y, dot[i]);
        dot[i] = fmaf(q4.z, k4.z, dot[i]);
        dot[i] = fmaf(q4.w, k4.w, dot[i]);
      }
    }
    const bool masked = kinds[buf * kKeyTile + kj] == kKeyMasked;
    float prob[4], alpha[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float logit = masked ? kNegInf : dot[i] * a.scale;
      float mx = logit;
#pragma unroll
      for (int off = 8; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, off));
      const float m_new = fmaxf(m_run[i], mx);
      if (m_new == kNegInf) {  // nothing but masked keys so far
        alpha[i] = 1.0f;
        prob[i] = 0.0f;
      } else {
        alpha[i] = expf(m_run[i] - m_new);
        prob[i] = expf(logit - m_new);
      }
      float ps = prob[i];
#pragma unroll
      for (int off = 8; off > 0; off >>= 1) ps += __shfl_xor_sync(kFullMask, ps, off);
      l_run[i] = l_run[i] * alpha[i] + ps;
      m_run[i] = m_new;
    }
#pragma unroll
    for (int h = 0; h < 8; ++h) {
      const float al = __shfl_sync(kFullMask, alpha[h & 3], (h >> 2) * 16);
#pragma unroll
      for (int dd = 0; dd < D4; ++dd) {
        o[h][dd].x *= al;
        o[h][dd].y *= al;
        o[h][dd].z *= al;
        o[h][dd].w *= al;
      }
    }
#pragma unroll
    for (int j = 0; j < kKeyTile; ++j) {
      const float* vrow = ks + (buf * kKeyTile + j) * KS + lane * 4;
      float4 v[D4];
#pragma unroll
      for (int dd = 0; dd < D4; ++dd) v[dd] = *reinterpret_cast<const float4*>(vrow + 128 * dd);
#pragma unroll
      for (int h = 0; h < 8; ++h) {
        const float ph = __shfl_sync(kFullMask, prob[h & 3], j + 16 * (h >> 2));
#pragma unroll
        for (int dd = 0; dd < D4; ++dd) {
          o[h][dd].x = fmaf(ph, v[dd].x, o[h][dd].x);
          o[h][dd].y = fmaf(ph, v[dd].y, o[h][dd].y);
          o[h][dd].z = fmaf(ph, v[dd].z, o[h][dd].z);
          o[h][dd].w = fmaf(ph, v[dd].w, o[h][dd].w);
        }
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int h = 0; h < 8; ++h) {
    const float mh = __shfl_sync(kFullMask, m_run[h & 3], (h >> 2) * 16);
    const float lh = __shfl_sync(kFullMask, l_run[h & 3], (h >> 2) * 16);
    const int gh = h0 + hw + h;
    if (hw + h >= HB || gh >= a.heads) continue;
    if (p.splits == 1) {
      // m = -inf (no key) gives exp(sink - m) = inf and a zero output, as the CPU's.
      const float den = lh + expf(a.sink[gh] - mh);
      float* dst = a.out + static_cast<int64_t>(r) * a.out_ld + static_cast<int64_t>(gh) * D + lane * 4;
#pragma unroll
      for (int dd = 0; dd < D4; ++dd)
        *reinterpret_cast<float4*>(dst + 128 * dd) =
            make_float4(o[h][dd].x / den, o[h][dd].y / den, o[h][dd].z / den, o[h][dd].w / den);
    } else {
      const int64_t at = (static_cast<int64_t>(r) * p.splits + split) * a.heads + gh;
      float* dst = p.part_o + at * D + lane * 4;
#pragma unroll
      for (int dd = 0; dd < D4; ++dd) *reinterpret_cast<float4*>(dst + 128 * dd) = o[h][dd];
      if (lane == 0) *reinterpret_cast<float2*>(p.part_ml + 2 * at) = make_float2(mh, lh);
    }
  }
}

// Merges the splits of one (row, head): M = max m_s, out = sum_s e^(m_s-M) O_s /
// (sum_s e^(m_s-M) l_s + e^(sink-M)). Block: d/4 threads, one float4 of the output each. The
// splits' (m, l) are loaded in parallel into shared memory and their weights computed once,
// so the partial rows are independent loads rather than a chain of dependent ones.
constexpr int kCombineMaxSplits = 1024;

__global__ void attention_combine_kernel(const AttentionKernelArgs p) {
  ::dsv4::cuda::dependent_kernel_prologue();
  __shared__ float weight[kCombineMaxSplits];
  __shared__ float2 ml_s[kCombineMaxSplits];
  __shared__ float den_s;
  const AttentionArgs& a = p.a;
  const int r = blockIdx.x, h = blockIdx.y, c = threadIdx.x * 4;
  float* dst = a.out + static_cast<int64_t>(r) * a.out_ld + static_cast<int64_t>(h) * a.d + c;
  if (p.m.row_seq[r] < 0) {
    *reinterpret_cast<float4*>(dst) = splat4(0.0f);
    return;
  }
  const int64_t at0 = static_cast<int64_t>(r) * p.splits * a.heads + h;
  for (int sp = threadIdx.x; sp < p.splits; sp += blockDim.x)
    ml_s[sp] = *reinterpret_cast<const float2*>(p.part_ml + 2 * (at0 + static_cast<int64_t>(sp) * a.heads));
  __syncthreads();
  if (threadIdx.x < 32) {
    float mx = kNegInf;
    for (int sp = threadIdx.x; sp < p.splits; sp += 32) mx = fmaxf(mx, ml_s[sp].x);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, off));
    float l = 0.0f;
    for (int sp = threadIdx.x; sp < p.splits; sp += 32) {
      const float w = ml_s[sp].x == kNegInf ? 0.0f : expf(ml_s[sp].x - mx);  // an empty split weighs nothing
      weight[sp] = w;
      l += ml_s[sp].y * w;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(kFullMask, l, off);
    if (threadIdx.x == 0) den_s = l + expf(a.sink[h] - mx);
  }
  __syncthreads();
  float4 acc = splat4(0.0f);
#pragma unroll 8
  for (int sp = 0; sp < p.splits; ++sp) {
    const float4 po = *reinterpret_cast<const float4*>(p.part_o + (at0 + static_cast<int64_t>(sp) * a.heads) * a.d + c);
    const float w = weight[sp];
    acc.x += po.x * w;
    acc.y += po.y * w;
    acc.z += po.z * w;
    acc.w += po.w * w;
  }
  const float den = den_s;
  *reinterpret_cast<float4*>(dst) = make_float4(acc.x / den, acc.y / den, acc.z / den, acc.w / den);
}

// ---- window ring ---------------------------------------------------------------------------

// Block (bx, s): sequence s's row rows-1-bx, when it is among the last `window` rows.
// Ring rows per slot: ring_rows (>= window).
__global__ void store_window_kernel(const DeviceRows kv, const StepMeta m, int64_t ring_rows, const DeviceRows ring) {
  ::dsv4::cuda::dependent_kernel_prologue();
  const Seq sq = load_seq(m.seqs, blockIdx.y);
  const int64_t i = int64_t{sq.rows} - 1 - blockIdx.x;
  if (i < 0 || sq.slot < 0 || (int64_t{sq.slot} + 1) * ring_rows > ring.rows) return;
  const int64_t src_row = sq.first_row + i;
  if (src_row < 0 || src_row >= kv.rows) return;
  const float* src = row_ptr(kv, src_row);
  float* dst = row_ptr(ring, int64_t{sq.slot} * ring_rows + (sq.first_pos + i) % ring_rows);
  for (int64_t c = threadIdx.x; c < ring.cols; c += blockDim.x) dst[c] = src[c];
}

// ---- compressor (spec §3.3) ----------------------------------------------------------------
//
// The CPU feeds a sequence's rows one by one into its state (a ring of positions) and pools
// when a block closes. Here every closing row pools at once from where its positions' values
// are at that moment: positions of this step come from the chunk (score + APE computed
// exactly as the CPU stores it), earlier positions from the state as the step found it. A
// second kernel then leaves the state as the sequential loop would.

struct CompressKernelArgs {
  CompressArgs a;  // state_rows set (compress() resolves 0)
  StepMeta m;
};

// The pooled value of column c (of w) for the row at position pos of sequence sq, which closes
// a block: sum_j softmax_j(z_j[c]) v_j[c] over positions pos + 1 - o*R + j, in the CPU's order
// (max, then the sum of exponentials, then the weighted sum). base: the slot's first state row.
__device__ inline float pool_column(const CompressArgs& a, const Seq& sq, int64_t pos, int64_t base, int64_t w,
                                    int64_t c) {
  const int R = a.ratio, o = a.overlap ? 2 : 1;
  const int64_t M = a.state_rows;
  const int64_t first = pos + 1 - int64_t{o} * R;
  const int slots = o * R;
  // Slot j's (score, value): with overlap, slots 0..R-1 are the previous block's first
  // halves, R..2R-1 this block's second halves; plain slots are this block's R tokens.
  const auto slot_value = [&](int j, float* z, float* v) {
    const int64_t q = first + j;
    const int res = static_cast<int>(((q % R) + R) % R);
    const int64_t col = a.overlap && j >= R ? w + c : c;
    if (q >= sq.first_pos) {
      const int64_t row = sq.first_row + (q - sq.first_pos);
      if (row >= a.kv.rows || row >= a.score.rows) {
        *z = NAN;
        *v = NAN;
        return;
      }
      *z = row_ptr(a.score, row)[col] + row_ptr(a.ape, res)[col];
      *v = row_ptr(a.kv, row)[col];
    } else {
      const int64_t state_row = base + ((q % M) + M) % M;
      *z = row_ptr(a.state_score, state_row)[col];
      *v = row_ptr(a.state_kv, state_row)[col];
    }
  };
  // The slots' loads go out kBatch at a time before their values are used: one slot per load
  // round trip made a closing row cost ~38 us (three passes x 8 slots x 4 columns a thread,
  // each waiting on L2; 2026-12-07 verify profile). A block of at most kBatch slots (CSA's
  // 2 x 4) is loaded once for all three passes. The operations and their order are the CPU's.
  constexpr int kBatch = 8;
  float z[kBatch], v[kBatch];
  const auto load_batch = [&](int j0) {
#pragma unroll
    for (int i = 0; i < kBatch; ++i)
      if (j0 + i < slots) slot_value(j0 + i, &z[i], &v[i]);
  };
  float mx = 0.0f;
  for (int j0 = 0; j0 < slots; j0 += kBatch) {
    load_batch(j0);
#pragma unroll
    for (int i = 0; i < kBatch; ++i)
      if (j0 + i < slots) mx = j0 + i == 0 ? z[i] : (mx < z[i] ? z[i] : mx);  // std::max's rule
  }
  const bool one_batch = slots <= kBatch;  // z, v still hold every slot
  float sum = 0.0f;
  for (int j0 = 0; j0 < slots; j0 += kBatch) {
    if (!one_batch) load_batch(j0);
#pragma unroll
    for (int i = 0; i < kBatch; ++i)
      if (j0 + i < slots) sum += expf(z[i] - mx);
  }
  float acc = 0.0f;
  for (int j0 = 0; j0 < slots; j0 += kBatch) {
    if (!one_batch) load_batch(j0);
#pragma unroll
    for (int i = 0; i < kBatch; ++i)
      if (j0 + i < slots) acc += v[i] * (expf(z[i] - mx) / sum);
  }
  return acc;
}

// The closing row r's sequence and position, or false for a row that closes no block (or a
// padding row).
__device__ inline bool closing_row(const CompressKernelArgs& p, int r, Seq* sq, int64_t* pos) {
  const int s = p.m.row_seq[r];
  if (s < 0) return false;
  *sq = load_seq(p.m.seqs, s);
  const int64_t i = int64_t{r} - sq->first_row;
  if (i < 0 || i >= sq->rows) return false;
  *pos = sq->first_pos + i;
  return *pos % p.a.ratio == p.a.ratio - 1;
}

// Whether the slot's state rows exist (a row of an absent slot pools to NaN).
__device__ inline bool state_present(const CompressArgs& a, const Seq& sq) {
  const int64_t base = int64_t{sq.slot} * a.state_rows;
  return sq.slot >= 0 && base + a.state_rows <= a.state_kv.rows && base + a.state_rows <= a.state_score.rows;
}

// Block per row; a row that closes a block (position % ratio == ratio - 1) writes its pooled
// entry to pooled[row].
__global__ void compress_pool_kernel(const CompressKernelArgs p) {
  ::dsv4::cuda::dependent_kernel_prologue();
  const CompressArgs& a = p.a;
  const int r = blockIdx.x;
  Seq sq;
  int64_t pos = 0;
  if (!closing_row(p, r, &sq, &pos)) return;
  const int64_t w = a.pooled.cols;
  float* out = row_ptr(a.pooled, r);
  const bool present = state_present(a, sq);
  for (int64_t c = threadIdx.x; c < w; c += blockDim.x)
    out[c] = present ? pool_column(a, sq, pos, int64_t{sq.slot} * a.state_rows, w, c) : NAN;
}

// compress_pool_kernel, finish_rows and store_entries in one block per row
// (Backend::compress_entries): a closing row's entry is pooled into shared memory, finished
// there (row_finish.cuh, RoPE at the block's first position) and written to its page. The block
// has finish::threads_for(w) threads; pooling is per column, so the same bits as the three
// launches.
struct CompressEntriesArgs {
  CompressKernelArgs k;  // k.a.pooled unused
  finish::Spec finish;   // finish.group: the entry's width
  DevicePaged dst;
};

__global__ void compress_entries_kernel(const CompressEntriesArgs p) {
  ::dsv4::cuda::dependent_kernel_prologue();
  extern __shared__ float v[];
  const CompressArgs& a = p.k.a;
  const int r = blockIdx.x;
  Seq sq;
  int64_t pos = 0;
  if (!closing_row(p.k, r, &sq, &pos)) return;
  float* dst = paged_row(p.dst, sq.slot, pos / a.ratio);
  if (!dst) return;  // store_entries's rule: no page, nothing stored
  const int64_t w = p.finish.group;
  const bool present = state_present(a, sq);
  for (int64_t c = threadIdx.x; c < w; c += blockDim.x)
    v[c] = present ? pool_column(a, sq, pos, int64_t{sq.slot} * a.state_rows, w, c) : NAN;
  finish::finish_group(v, p.finish, static_cast<int32_t>(pos - pos % a.ratio));
  for (int64_t c = threadIdx.x; c < w; c += blockDim.x) dst[c] = v[c];
}

// Block (j, s): ring row j of sequence s's state takes the step's last position q with
// q mod state_rows == j, if the step has one (score with APE, as the CPU stores it).
__global__ void compress_state_kernel(const CompressKernelArgs p) {
  ::dsv4::cuda::dependent_kernel_prologue();
  const CompressArgs& a = p.a;
  const Seq sq = load_seq(p.m.seqs, blockIdx.y);
  const int R = a.ratio;
  const int64_t M = a.state_rows, j = blockIdx.x;
  const int64_t base = int64_t{sq.slot} * M;
  if (sq.rows <= 0 || sq.slot < 0 || base + M > a.state_kv.rows || base + M > a.state_score.rows) return;
  const int64_t last = int64_t{sq.first_pos} + sq.rows - 1;
  const int64_t q = last - (((last - j) % M) + M) % M;  // max q <= last, q mod M == j
  if (q < sq.first_pos) return;
  const int64_t row = sq.first_row + (q - sq.first_pos);
  if (row >= a.kv.rows || row >= a.score.rows) return;
  float* kv = row_ptr(a.state_kv, base + j);
  float* sc = row_ptr(a.state_score, base + j);
  const float* ape = row_ptr(a.ape, q % R);
  for (int64_t c = threadIdx.x; c < a.kv.cols; c += blockDim.x) {
    kv[c] = row_ptr(a.kv, row)[c];
    sc[c] = row_ptr(a.score, row)[c] + ape[c];
  }
}

// ---- block positions, entries ------------------------------------------------------------

__global__ void block_positions_kernel(const int32_t* positions, int64_t n, int ratio, int32_t* out) {
  ::dsv4::cuda::dependent_kernel_prologue();
  for (int64_t r = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; r < n; r += int64_t{gridDim.x} * blockDim.x)
    out[r] = positions[r] - positions[r] % ratio;
}

__global__ void store_entries_kernel(const DeviceRows pooled, int ratio, const StepMeta m, const DevicePaged dst) {
  ::dsv4::cuda::dependent_kernel_prologue();
  const int r = blockIdx.x;
  const int s = m.row_seq[r];
  if (s < 0) return;
  const int32_t pos = m.positions[r];
  if ((pos + 1) % ratio) return;
  float* row = paged_row(dst, load_seq(m.seqs, s).slot, pos / ratio);
  if (!row) return;
  const float* src = row_ptr(pooled, r);
  for (int64_t c = threadIdx.x; c < pooled.cols; c += blockDim.x) row[c] = src[c];
}

// ---- exact indexer scores --------------------------------------------------------------------

constexpr int kIndexTile = 64;  // keys per tile
constexpr int kIndexThreads = 256;

struct IndexerKernelArgs {
  IndexerArgs a;
  StepMeta m;
  int tiles_per_block = 1;
  int heads_padded = 0;  // heads rounded up to 64 (zero query rows)
};

__host__ __device__ constexpr size_t exact_indexer_smem(int heads_padded, int dk) {
  return sizeof(float) * (static_cast<size_t>(heads_padded) * dk + heads_padded + 2 * kIndexTile * (dk + 4) +
                          8 * kIndexTile);
}

// Indexer score b of a row whose slot's entries start at `first` (grafts: entries below it do
// not exist and score -inf, backend.h), stored with the score itself instead of a second pass.
__device__ __forceinline__ float absent_or(int64_t b, int64_t first, float score) {
  return b < first ? kNegInf : score;
}

// ReLU with std::max's NaN rule (a NaN dot stays NaN, as the CPU's).
__device__ __forceinline__ float relu(float x) { return x < 0.0f ? 0.0f : x; }

// One block: row blockIdx.x, keys [blockIdx.y * tiles * 64, +tiles * 64) of its columns.
// Q (all heads) and the head weights stay in shared memory, key tiles of 64 stream through
// two buffers. Warp w computes heads 8w..8w+7 (+64 per head group) for keys lane and
// lane+32, applies ReLU and the weights; the 8 warps' partial sums are added in warp order.
__global__ void __launch_bounds__(kIndexThreads) indexer_exact_kernel(const IndexerKernelArgs p) {
  ::dsv4::cuda::dependent_kernel_prologue();
  extern __shared__ __align__(16) float smem[];
  const IndexerArgs& a = p.a;
  const int dk = a.dk, HP = p.heads_padded, KS = dk + 4;
  float* qs = smem;                            // [HP][dk]
  float* ws = qs + HP * dk;                    // [HP]
  float* ks = ws + HP;                         // [2][64][KS]
  float* red = ks + 2 * kIndexTile * KS;       // [8][64]
  const int r = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t cols = a.scores.cols;
  float* out = row_ptr(a.scores, r);
  const int s = p.m.row_seq[r];
  Seq sq{};
  int64_t visible = 0, first = 0;
  if (s >= 0) {
    sq = load_seq(p.m.seqs, s);
    visible = (p.m.positions[r] + 1) / a.ratio;
    first = first_row_of(a.keys, sq.slot);
  }
  const int64_t span = int64_t{p.tiles_per_block} * kIndexTile;
  const int64_t k_begin = blockIdx.y * span;
  const int64_t k_end = k_begin + span < cols ? k_begin + span : cols;
  if (visible > cols) {  // more keys than columns: the CPU's error, NaN here (absent entries -inf)
    for (int64_t b = k_begin + tid; b < k_end; b += blockDim.x) out[b] = absent_or(b, first, NAN);
    return;
  }
  for (int64_t b = (k_begin > visible ? k_begin : visible) + tid; b < k_end; b += blockDim.x) out[b] = kNegInf;
  if (k_begin >= visible) return;
  const int64_t vis_end = k_end < visible ? k_end : visible;

  for (int i = tid; i < HP * (dk / 4); i += blockDim.x) {
    const int h = i / (dk / 4), c4 = i % (dk / 4);
    if (h < a.heads)
      cp_async16(qs + h * dk + c4 * 4, a.q + static_cast<int64_t>(r) * a.q_ld + static_cast<int64_t>(h) * dk + c4 * 4);
    else
      *reinterpret_cast<float4*>(qs + h * dk + c4 * 4) = splat4(0.0f);
  }
  for (int h = tid; h < HP; h += blockDim.x) ws[h] = h < a.heads ? a.w[static_cast<int64_t>(r) * a.w_ld + h] : 0.0f;
  const auto load_tile = [&](int64_t base, int buf) {
    constexpr int per_key = kIndexThreads / kIndexTile;
    const int j = tid / per_key, sub = tid % per_key;
    const int64_t b = base + j;
    float* dst = ks + (buf * kIndexTile + j) * KS;
    const float* src = b < vis_end ? paged_row(a.keys, sq.slot, b) : nullptr;
    if (src) {
      for (int c4 = sub; c4 < dk / 4; c4 += per_key) cp_async16(dst + c4 * 4, src + c4 * 4);
    } else {  // past the visible keys: zeros (not written out); a missing page: NaN
      const float4 v = splat4(b < vis_end ? NAN : 0.0f);
      for (int c4 = sub; c4 < dk / 4; c4 += per_key) *reinterpret_cast<float4*>(dst + c4 * 4) = v;
    }
  };
  load_tile(k_begin, 0);
  cp_async_commit();
  int buf = 0;
  for (int64_t base = k_begin; base < vis_end; base += kIndexTile, buf ^= 1) {
    if (base + kIndexTile < vis_end) {
      load_tile(base + kIndexTile, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const float* k0 = ks + (buf * kIndexTile + lane) * KS;
    const float* k1 = k0 + 32 * KS;
    float part0 = 0.0f, part1 = 0.0f;
    for (int hg = 0; hg < HP; hg += 64) {
      const int hb = hg + warp * 8;
      float d0[8], d1[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) d0[i] = d1[i] = 0.0f;
#pragma unroll 2
      for (int c = 0; c < dk; c += 4) {
        const float4 x0 = *reinterpret_cast<const float4*>(k0 + c);
        const float4 x1 = *reinterpret_cast<const float4*>(k1 + c);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float4 q4 = *reinterpret_cast<const float4*>(qs + (hb + i) * dk + c);
          d0[i] = fmaf(q4.x, x0.x, d0[i]);
          d0[i] = fmaf(q4.y, x0.y, d0[i]);
          d0[i] = fmaf(q4.z, x0.z, d0[i]);
          d0[i] = fmaf(q4.w, x0.w, d0[i]);
          d1[i] = fmaf(q4.x, x1.x, d1[i]);
          d1[i] = fmaf(q4.y, x1.y, d1[i]);
          d1[i] = fmaf(q4.z, x1.z, d1[i]);
          d1[i] = fmaf(q4.w, x1.w, d1[i]);
        }
      }
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (hb + i < a.heads) {
          part0 += ws[hb + i] * relu(d0[i]);
          part1 += ws[hb + i] * relu(d1[i]);
        }
    }
    red[warp * kIndexTile + lane] = part0;
    red[warp * kIndexTile + lane + 32] = part1;
    __syncthreads();
    if (tid < kIndexTile && base + tid < vis_end) {
      float total = 0.0f;
#pragma unroll
      for (int w8 = 0; w8 < 8; ++w8) total += red[w8 * kIndexTile + tid];
      out[base + tid] = absent_or(base + tid, first, total);
    }
    __syncthreads();
  }
}

}  // namespace dsv4::cuda::attn
