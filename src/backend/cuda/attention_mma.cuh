// Tensor-core (mma.sync m16n8k16 BF16, fp32 accumulation) attention and indexer scores:
// the Fast path of attention_ops.h. The rounding is the reference kernel's (spec §3.1): q
// and k/v rounded to bf16, logits and the online softmax in fp32, the probabilities rounded
// to bf16 for P.V while the denominator sums them in fp32. The caches stay fp32; each key
// tile is staged in fp32 (cp.async) and converted to bf16 in shared memory. Included by
// attention_ops.cu. Bounds: docs/CUDA.md, "Attention".
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/attention_kernels.cuh"
#include "backend/cuda/dependent_launch.cuh"

namespace dsv4::cuda::attn {

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s)
               : "memory");
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo: the lower address
  return *reinterpret_cast<const uint32_t*>(&v);
}

// fp32 rows [rows][cols] (row stride src_ld floats) -> bf16 rows (row stride dst_ld), by
// the whole block, 8 values per step.
__device__ __forceinline__ void convert_rows_bf16(const float* src, int src_ld, __nv_bfloat16* dst, int dst_ld,
                                                  int rows, int cols) {
  const int per_row = cols / 8;
  for (int i = threadIdx.x; i < rows * per_row; i += blockDim.x) {
    const int rr = i / per_row, c = (i % per_row) * 8;
    const float4 x = *reinterpret_cast<const float4*>(src + rr * src_ld + c);
    const float4 y = *reinterpret_cast<const float4*>(src + rr * src_ld + c + 4);
    *reinterpret_cast<uint4*>(dst + rr * dst_ld + c) =
        make_uint4(pack_bf16(x.x, x.y), pack_bf16(x.z, x.w), pack_bf16(y.x, y.y), pack_bf16(y.z, y.w));
  }
}

// ---- attention ------------------------------------------------------------------------------

constexpr int kMmaKeyTile = 32;
constexpr int kMmaThreads = 256;

__host__ __device__ constexpr size_t mma_attention_smem(int heads16, int d) {
  return sizeof(__nv_bfloat16) * (static_cast<size_t>(heads16) + kMmaKeyTile) * (d + 8) +  // Q, K (bf16)
         sizeof(float) * kMmaKeyTile * d +                                                  // staged fp32 tile
         sizeof(float) * 8 * 16 * 40 +                                                      // logit halves
         2 * kMmaKeyTile * sizeof(int);                                                     // key kinds
}

// One block: row blockIdx.x, up to 64 heads, key tiles of split blockIdx.z (as the exact
// kernel, same partial layout). Warp (slab, half): heads slab*16..+15, output dims
// half*D/2..+D/2. Each warp computes the logits of its 16 heads over its half of the dims;
// the two halves are added through shared memory (the same sum in both warps, so both run
// the same softmax), then P (bf16, from registers) times its half of V.
template <int D>
__global__ void __launch_bounds__(kMmaThreads, 1) attention_mma_kernel(const AttentionKernelArgs p) {
  ::dsv4::cuda::dependent_kernel_prologue();
  constexpr int LD = D + 8;          // bf16 row stride: ldmatrix rows land in different banks
  constexpr int HALF = D / 2;
  constexpr int NT = HALF / 8;       // output n-tiles per warp
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const AttentionArgs& a = p.a;
  const int HB = p.heads_per_block;  // multiple of 16, <= 64
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(smem_raw);    // [HB][LD]
  __nv_bfloat16* kb = qs + HB * LD;                                   // [32][LD]
  float* stage = reinterpret_cast<float*>(kb + kMmaKeyTile * LD);     // [32][D]
  float* xch = stage + kMmaKeyTile * D;                               // [8][16][40]
  int* kinds = reinterpret_cast<int*>(xch + 8 * 16 * 40);            // [2][32]

  const int r = blockIdx.x, split = blockIdx.z, h0 = blockIdx.y * HB;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int slab = warp >> 1, half = warp & 1;
  const bool active = slab * 16 < HB;  // warps past the block's heads only help load
  const int g = lane >> 2, tig = lane & 3;
  const int s = p.m.row_seq[r];
  if (s < 0) {
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
  const int64_t n_tiles = (rk.n_keys + kMmaKeyTile - 1) / kMmaKeyTile;
  const int64_t t_begin = static_cast<int64_t>(split) * p.tiles_per_split;
  const int64_t t_end = t_begin + p.tiles_per_split < n_tiles ? t_begin + p.tiles_per_split : n_tiles;

  const auto load_tile = [&](int64_t tile, int kbuf) {
    constexpr int per_key = kMmaThreads / kMmaKeyTile;
    const int j = tid / per_key, sub = tid % per_key;
    int kind;
    const float* src = key_row(a, p.m, r, rk, tile * kMmaKeyTile + j, &kind);
    float* dst = stage + j * D;
    if (kind == kKeyValid) {
      for (int c4 = sub; c4 < D / 4; c4 += per_key) cp_async16(dst + c4 * 4, src + c4 * 4);
    } else {
      const float4 v = splat4(kind == kKeyMasked ? 0.0f : NAN);
      for (int c4 = sub; c4 < D / 4; c4 += per_key) *reinterpret_cast<float4*>(dst + c4 * 4) = v;
    }
    if (sub == 0) kinds[kbuf * kMmaKeyTile + j] = kind;
  };

  float o[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  float m_run[2] = {kNegInf, kNegInf}, l_run[2] = {0.0f, 0.0f};

  if (t_begin < t_end) {
    load_tile(t_begin, 0);
    cp_async_commit();
    // Q once: fp32 rows -> bf16 (zero rows past the heads).
    for (int i = tid; i < HB * (D / 8); i += blockDim.x) {
      const int hl = i / (D / 8), c = (i % (D / 8)) * 8, h = h0 + hl;
      uint4 packed = make_uint4(0, 0, 0, 0);
      if (h < a.heads) {
        const float* src = a.q + static_cast<int64_t>(r) * a.q_ld + static_cast<int64_t>(h) * D + c;
        const float4 x = *reinterpret_cast<const float4*>(src);
        const float4 y = *reinterpret_cast<const float4*>(src + 4);
        packed = make_uint4(pack_bf16(x.x, x.y), pack_bf16(x.z, x.w), pack_bf16(y.x, y.y), pack_bf16(y.z, y.w));
      }
      *reinterpret_cast<uint4*>(qs + hl * LD + c) = packed;
    }
    cp_async_wait<0>();
    __syncthreads();
    convert_rows_bf16(stage, D, kb, LD, kMmaKeyTile, D);
    __syncthreads();
  }
  for (int64_t tt = t_begin; tt < t_end; ++tt) {
    const int kbuf = static_cast<int>((tt - t_begin) & 1);
    const bool more = tt + 1 < t_end;
    if (more) {  // the next tile lands in the fp32 stage while this one is used
      load_tile(tt + 1, kbuf ^ 1);
      cp_async_commit();
    }
    float sc[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
    if (active) {
      // Partial logits over this warp's half of the dims: 16 heads x 32 keys.
#pragma unroll 4
      for (int kk = 0; kk < HALF / 16; ++kk) {
        const int c = half * HALF + kk * 16;
        uint32_t af[4];
        ldmatrix_x4(af, qs + (slab * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + c + (lane >> 4) * 8);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t bf[4];
          ldmatrix_x4(bf, kb + (np * 16 + (lane & 7) + (lane >> 4) * 8) * LD + c + ((lane >> 3) & 1) * 8);
          mma_bf16(sc[2 * np], af, bf[0], bf[1]);
          mma_bf16(sc[2 * np + 1], af, bf[2], bf[3]);
        }
      }
      float* mine = xch + warp * 16 * 40;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        *reinterpret_cast<float2*>(mine + g * 40 + nt * 8 + 2 * tig) = make_float2(sc[nt][0], sc[nt][1]);
        *reinterpret_cast<float2*>(mine + (g + 8) * 40 + nt * 8 + 2 * tig) = make_float2(sc[nt][2], sc[nt][3]);
      }
    }
    __syncthreads();
    if (active) {
      const float* other = xch + (warp ^ 1) * 16 * 40;
      float mx[2] = {kNegInf, kNegInf};
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const float2 lo = *reinterpret_cast<const float2*>(other + g * 40 + nt * 8 + 2 * tig);
        const float2 hi = *reinterpret_cast<const float2*>(other + (g + 8) * 40 + nt * 8 + 2 * tig);
        const float add[4] = {lo.x, lo.y, hi.x, hi.y};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = nt * 8 + 2 * tig + (e & 1);
          const float logit = kinds[kbuf * kMmaKeyTile + key] == kKeyMasked ? kNegInf : (sc[nt][e] + add[e]) * a.scale;
          sc[nt][e] = logit;
          mx[e >> 1] = fmaxf(mx[e >> 1], logit);
        }
      }
      float alpha[2];
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(kFullMask, mx[hr], 1));
        mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(kFullMask, mx[hr], 2));
        const float m_new = fmaxf(m_run[hr], mx[hr]);
        alpha[hr] = m_new == kNegInf ? 1.0f : expf(m_run[hr] - m_new);
        m_run[hr] = m_new;
      }
      float rs[2] = {0.0f, 0.0f};
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float mr = m_run[e >> 1];
          const float pe = mr == kNegInf ? 0.0f : expf(sc[nt][e] - mr);
          sc[nt][e] = pe;
          rs[e >> 1] += pe;
        }
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        rs[hr] += __shfl_xor_sync(kFullMask, rs[hr], 1);
        rs[hr] += __shfl_xor_sync(kFullMask, rs[hr], 2);
        l_run[hr] = l_run[hr] * alpha[hr] + rs[hr];
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        o[nt][0] *= alpha[0];
        o[nt][1] *= alpha[0];
        o[nt][2] *= alpha[1];
        o[nt][3] *= alpha[1];
      }
      // P (bf16 A fragments straight from the logit accumulators) times V.
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        const uint32_t pa[4] = {pack_bf16(sc[2 * kk][0], sc[2 * kk][1]), pack_bf16(sc[2 * kk][2], sc[2 * kk][3]),
                                pack_bf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                                pack_bf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          uint32_t bf[4];
          ldmatrix_x4_trans(bf, kb + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + half * HALF + np * 16 +
                                    (lane >> 4) * 8);
          mma_bf16(o[2 * np], pa, bf[0], bf[1]);
          mma_bf16(o[2 * np + 1], pa, bf[2], bf[3]);
        }
      }
    }
    if (more) {
      cp_async_wait<0>();
      __syncthreads();  // every warp is done with kb and the staged tile has landed
      convert_rows_bf16(stage, D, kb, LD, kMmaKeyTile, D);
      __syncthreads();
    }
  }

  if (!active) return;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int hl = slab * 16 + g + 8 * hr, gh = h0 + hl;
    if (hl >= HB || gh >= a.heads) continue;
    if (p.splits == 1) {
      const float den = l_run[hr] + expf(a.sink[gh] - m_run[hr]);
      float* dst = a.out + static_cast<int64_t>(r) * a.out_ld + static_cast<int64_t>(gh) * D + half * HALF + 2 * tig;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        *reinterpret_cast<float2*>(dst + nt * 8) = make_float2(o[nt][2 * hr] / den, o[nt][2 * hr + 1] / den);
    } else {
      const int64_t at = (static_cast<int64_t>(r) * p.splits + split) * a.heads + gh;
      float* dst = p.part_o + at * D + half * HALF + 2 * tig;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        *reinterpret_cast<float2*>(dst + nt * 8) = make_float2(o[nt][2 * hr], o[nt][2 * hr + 1]);
      if (half == 0 && tig == 0) *reinterpret_cast<float2*>(p.part_ml + 2 * at) = make_float2(m_run[hr], l_run[hr]);
    }
  }
}

// ---- indexer scores ---------------------------------------------------------------------------

constexpr int kMmaIndexTile = 64;
constexpr int kMmaIndexThreads = 256;

__host__ __device__ constexpr size_t mma_indexer_smem(int heads16, int dk) {
  return sizeof(__nv_bfloat16) * (static_cast<size_t>(heads16) + kMmaIndexTile) * (dk + 8) +
         sizeof(float) * (kMmaIndexTile * dk + heads16 + 4 * kMmaIndexTile);
}

// One block: row blockIdx.x, keys [blockIdx.y * tiles * 64, ...). Warp (slab, half): heads
// slab*16..+15 (up to 64) for keys half*32..+31 of each tile; ReLU, head weights and the
// sum over the warp's 16 heads in registers, the four slabs added through shared memory.
template <int DK>
__global__ void __launch_bounds__(kMmaIndexThreads) indexer_mma_kernel(const IndexerKernelArgs p) {
  ::dsv4::cuda::dependent_kernel_prologue();
  constexpr int LD = DK + 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const IndexerArgs& a = p.a;
  const int HB = p.heads_padded;  // multiple of 16, <= 64
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(smem_raw);   // [HB][LD]
  __nv_bfloat16* kb = qs + HB * LD;                                  // [64][LD]
  float* stage = reinterpret_cast<float*>(kb + kMmaIndexTile * LD);  // [64][DK]
  float* ws = stage + kMmaIndexTile * DK;                            // [HB]
  float* red = ws + HB;                                              // [4][64]
  const int r = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int slab = warp >> 1, half = warp & 1, g = lane >> 2, tig = lane & 3;
  const bool active = slab * 16 < HB;
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
  const int64_t span = int64_t{p.tiles_per_block} * kMmaIndexTile;
  const int64_t k_begin = blockIdx.y * span;
  const int64_t k_end = k_begin + span < cols ? k_begin + span : cols;
  if (visible > cols) {
    for (int64_t b = k_begin + tid; b < k_end; b += blockDim.x) out[b] = absent_or(b, first, NAN);
    return;
  }
  for (int64_t b = (k_begin > visible ? k_begin : visible) + tid; b < k_end; b += blockDim.x) out[b] = kNegInf;
  if (k_begin >= visible) return;
  const int64_t vis_end = k_end < visible ? k_end : visible;

  const auto load_tile = [&](int64_t base) {
    constexpr int per_key = kMmaIndexThreads / kMmaIndexTile;
    const int j = tid / per_key, sub = tid % per_key;
    const int64_t b = base + j;
    float* dst = stage + j * DK;
    const float* src = b < vis_end ? paged_row(a.keys, sq.slot, b) : nullptr;
    if (src) {
      for (int c4 = sub; c4 < DK / 4; c4 += per_key) cp_async16(dst + c4 * 4, src + c4 * 4);
    } else {
      const float4 v = splat4(b < vis_end ? NAN : 0.0f);
      for (int c4 = sub; c4 < DK / 4; c4 += per_key) *reinterpret_cast<float4*>(dst + c4 * 4) = v;
    }
  };
  load_tile(k_begin);
  cp_async_commit();
  for (int i = tid; i < HB * (DK / 8); i += blockDim.x) {
    const int h = i / (DK / 8), c = (i % (DK / 8)) * 8;
    uint4 packed = make_uint4(0, 0, 0, 0);
    if (h < a.heads) {
      const float* src = a.q + static_cast<int64_t>(r) * a.q_ld + static_cast<int64_t>(h) * DK + c;
      const float4 x = *reinterpret_cast<const float4*>(src);
      const float4 y = *reinterpret_cast<const float4*>(src + 4);
      packed = make_uint4(pack_bf16(x.x, x.y), pack_bf16(x.z, x.w), pack_bf16(y.x, y.y), pack_bf16(y.z, y.w));
    }
    *reinterpret_cast<uint4*>(qs + h * LD + c) = packed;
  }
  for (int h = tid; h < HB; h += blockDim.x) ws[h] = h < a.heads ? a.w[static_cast<int64_t>(r) * a.w_ld + h] : 0.0f;
  cp_async_wait<0>();
  __syncthreads();
  convert_rows_bf16(stage, DK, kb, LD, kMmaIndexTile, DK);
  __syncthreads();
  const float w_lo = active ? ws[slab * 16 + g] : 0.0f, w_hi = active ? ws[slab * 16 + g + 8] : 0.0f;

  for (int64_t base = k_begin; base < vis_end; base += kMmaIndexTile) {
    const bool more = base + kMmaIndexTile < vis_end;
    if (more) {
      load_tile(base + kMmaIndexTile);
      cp_async_commit();
    }
    if (active) {
      float sc[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < DK / 16; ++kk) {
        uint32_t af[4];
        ldmatrix_x4(af, qs + (slab * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + kk * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t bf[4];
          ldmatrix_x4(bf, kb + (half * 32 + np * 16 + (lane & 7) + (lane >> 4) * 8) * LD + kk * 16 +
                              ((lane >> 3) & 1) * 8);
          mma_bf16(sc[2 * np], af, bf[0], bf[1]);
          mma_bf16(sc[2 * np + 1], af, bf[2], bf[3]);
        }
      }
      // Weighted ReLU summed over the slab's 16 heads: rows g and g+8 here, then across g.
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float v = w_lo * relu(sc[nt][e]) + w_hi * relu(sc[nt][2 + e]);
          v += __shfl_xor_sync(kFullMask, v, 4);
          v += __shfl_xor_sync(kFullMask, v, 8);
          v += __shfl_xor_sync(kFullMask, v, 16);
          if (g == 0) red[slab * kMmaIndexTile + half * 32 + nt * 8 + 2 * tig + e] = v;
        }
    }
    __syncthreads();
    if (tid < kMmaIndexTile && base + tid < vis_end) {
      float total = 0.0f;
      for (int sl = 0; sl * 16 < HB; ++sl) total += red[sl * kMmaIndexTile + tid];
      out[base + tid] = absent_or(base + tid, first, total);
    }
    if (more) {
      cp_async_wait<0>();
      __syncthreads();
      convert_rows_bf16(stage, DK, kb, LD, kMmaIndexTile, DK);
    }
    __syncthreads();
  }
}

}  // namespace dsv4::cuda::attn
