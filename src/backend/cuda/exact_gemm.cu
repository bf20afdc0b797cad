#include "backend/cuda/exact_gemm.h"

#include <algorithm>
#include <string>

#include "backend/cuda/cuda_check.h"

namespace dsv4::cuda {

namespace {

constexpr int kWarps = 8;   // output features per block, one per warp
constexpr int kBK = 128;    // k per shared-memory tile of activations (a multiple of 32)
constexpr int kThreads = 32 * kWarps;

size_t align256(size_t n) { return (n + 255) & ~size_t{255}; }

struct GemmArgs {
  const uint8_t* w = nullptr;
  int64_t row_bytes = 0;       // stride between rows
  int64_t row_data_bytes = 0;  // bytes of one row's k values (<= row_bytes)
  int64_t matrix_bytes = 0;
  int64_t n = 0, k = 0;
  const float* x = nullptr;
  int64_t ldx = 0;
  float* y = nullptr;
  int64_t ldy = 0;
  int64_t m = 0;  // dense rows
  // grouped
  const int* n_tiles = nullptr;
  const int* tile_expert = nullptr;
  const int* tile_first = nullptr;
  const int* tile_count = nullptr;
  const int* sorted_pairs = nullptr;
  int x_row_div = 1;
  exact::Tables tables;
};

// quant_avx2.cpp's reduce4 + hsum of the 32 partial sums (lane l holds a_l); lane 0 gets it.
__device__ __forceinline__ float cpu_order_sum(float a) {
  a = __fadd_rn(a, __shfl_down_sync(0xFFFFFFFFu, a, 8));   // lanes 0-7: a_j + a_{8+j}; 16-23: a_{16+j} + a_{24+j}
  a = __fadd_rn(a, __shfl_down_sync(0xFFFFFFFFu, a, 16));  // v_j
  a = __fadd_rn(a, __shfl_down_sync(0xFFFFFFFFu, a, 4));   // s_j = v_j + v_{j+4}
  a = __fadd_rn(a, __shfl_down_sync(0xFFFFFFFFu, a, 2));   // s_0 + s_2, s_1 + s_3
  return __fadd_rn(a, __shfl_down_sync(0xFFFFFFFFu, a, 1));
}

// One block: TM activation rows x kWarps output features (exact_gemm.h).
template <GgmlType T, int TM>
__global__ void __launch_bounds__(kThreads) exact_gemm_kernel(const GemmArgs a) {
  constexpr bool kPlain = T == GgmlType::F32 || T == GgmlType::F16 || T == GgmlType::BF16;
  __shared__ float xs[TM][kBK];
  __shared__ int64_t x_row[TM];
  __shared__ int64_t y_row[TM];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t o = static_cast<int64_t>(blockIdx.y) * kWarps + warp;
  const bool active = o < a.n;  // uniform over the warp
  const uint8_t* w = a.w;
  if (a.tile_count != nullptr) {
    const int tile = static_cast<int>(blockIdx.x);
    if (tile >= *a.n_tiles) return;  // uniform over the block
    w += static_cast<int64_t>(a.tile_expert[tile]) * a.matrix_bytes;
    const int count = a.tile_count[tile], first = a.tile_first[tile];
    for (int r = tid; r < TM; r += kThreads) {
      const int pair = r < count ? a.sorted_pairs[first + r] : -1;
      x_row[r] = pair >= 0 ? pair / a.x_row_div : -1;
      y_row[r] = pair;
    }
  } else {
    const int64_t r0 = static_cast<int64_t>(blockIdx.x) * TM;
    for (int r = tid; r < TM; r += kThreads) {
      x_row[r] = r0 + r < a.m ? r0 + r : -1;
      y_row[r] = x_row[r];
    }
  }
  __syncthreads();
  const uint8_t* wrow = w + (active ? o : 0) * a.row_bytes;

  float acc[TM];
#pragma unroll
  for (int r = 0; r < TM; ++r) acc[r] = 0.0f;
  const int64_t k32 = a.k / 32 * 32;
  for (int64_t k0 = 0; k0 < k32; k0 += kBK) {
    const int kb = static_cast<int>(min(static_cast<int64_t>(kBK), k32 - k0));
    for (int e = tid; e < TM * kBK; e += kThreads) {
      const int r = e / kBK, kk = e % kBK;
      xs[r][kk] = (x_row[r] >= 0 && kk < kb) ? a.x[x_row[r] * a.ldx + k0 + kk] : 0.0f;
    }
    __syncthreads();
    if (active) {
      for (int s = 0; s < kb; s += 32) {
        const float wv = exact::element<T>(wrow, k0 + s + lane, a.tables);
#pragma unroll
        for (int r = 0; r < TM; ++r) acc[r] = fmaf(wv, xs[r][s + lane], acc[r]);
      }
    }
    __syncthreads();
  }
  if (!active) return;
  if constexpr (kPlain) {  // dot_plain: 8-wide chunks past the last 32 into a_0..a_7
    for (int64_t i = k32; i + 8 <= a.k; i += 8) {
      if (lane < 8) {
        const float wv = exact::element<T>(wrow, i + lane, a.tables);
#pragma unroll
        for (int r = 0; r < TM; ++r)
          if (x_row[r] >= 0) acc[r] = fmaf(wv, a.x[x_row[r] * a.ldx + i + lane], acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < TM; ++r) {
    float sum = cpu_order_sum(acc[r]);
    if (lane == 0 && y_row[r] >= 0) {
      if constexpr (kPlain)
        for (int64_t i = a.k / 8 * 8; i < a.k; ++i)
          sum = fmaf(exact::element<T>(wrow, i, a.tables), a.x[x_row[r] * a.ldx + i], sum);
      a.y[y_row[r] * a.ldy + o] = sum;
    }
  }
}

// One activation row (dense decode): the same sums as exact_gemm_kernel<T, 1>, lane l of one
// warp running a_l's fmaf chain over k = l, l + 32, ... in order. The general kernel's
// shared-memory tile put a barrier and a round trip to memory on every 128 values of k, which
// made the hyper-connection mixes ([1, 16384] x [16384, 24]: 24 outputs, three blocks on the
// whole GPU) a third of a decode step (issue 10's profile). Here one block per output stages
// its whole weight row and the activations in shared memory with every load in flight (1024
// threads, 16-byte loads where both sides are aligned), then warp 0 runs the chains from
// shared memory: one memory latency per output instead of one per 128 values of k.
constexpr int kStageThreads = 1024;
constexpr int64_t kStageMaxBytes = 160 * 1024;  // x (k floats) + one weight row
constexpr int kStageUnroll = 8;                 // 16-byte loads in flight per thread

// Every thread issues kStageUnroll loads before it stores any (a plain copy loop waits for each
// load before the next: 32 rounds of memory latency for a 16384-wide F32 row).
__device__ __forceinline__ void stage_bytes(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src,
                                            int64_t bytes) {
  int64_t done = 0;
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) == 0) {
    const int64_t vectors = bytes / 16;
    const uint4* in = reinterpret_cast<const uint4*>(src);
    uint4* out = reinterpret_cast<uint4*>(dst);
    const int64_t stride = blockDim.x;
    for (int64_t v0 = threadIdx.x; v0 < vectors; v0 += kStageUnroll * stride) {
      uint4 r[kStageUnroll];
#pragma unroll
      for (int u = 0; u < kStageUnroll; ++u)
        if (v0 + u * stride < vectors) r[u] = in[v0 + u * stride];
#pragma unroll
      for (int u = 0; u < kStageUnroll; ++u)
        if (v0 + u * stride < vectors) out[v0 + u * stride] = r[u];
    }
    done = vectors * 16;
  }
  for (int64_t b = done + threadIdx.x; b < bytes; b += blockDim.x) dst[b] = src[b];
}

int64_t staged_x_bytes(int64_t k) { return (k * 4 + 15) / 16 * 16; }

template <GgmlType T>
__global__ void __launch_bounds__(kStageThreads) exact_row_kernel(const GemmArgs a) {
  constexpr bool kPlain = T == GgmlType::F32 || T == GgmlType::F16 || T == GgmlType::BF16;
  extern __shared__ __align__(16) uint8_t staged[];
  const int64_t o = blockIdx.x;  // grid.x: as many outputs as a vocabulary-wide head has
  float* x = reinterpret_cast<float*>(staged);
  uint8_t* wrow = staged + (a.k * 4 + 15) / 16 * 16;
  stage_bytes(staged, reinterpret_cast<const uint8_t*>(a.x), a.k * 4);
  stage_bytes(wrow, a.w + o * a.row_bytes, a.row_data_bytes);
  __syncthreads();
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  const int64_t k32 = a.k / 32 * 32;
  float acc = 0.0f;
#pragma unroll 8
  for (int64_t i = lane; i < k32; i += 32) acc = fmaf(exact::element<T>(wrow, i, a.tables), x[i], acc);
  if constexpr (kPlain) {  // dot_plain: 8-wide chunks past the last 32 into a_0..a_7
    for (int64_t c = k32; c + 8 <= a.k; c += 8)
      if (lane < 8) acc = fmaf(exact::element<T>(wrow, c + lane, a.tables), x[c + lane], acc);
  }
  float sum = cpu_order_sum(acc);
  if (lane == 0) {
    if constexpr (kPlain)
      for (int64_t c = a.k / 8 * 8; c < a.k; ++c) sum = fmaf(exact::element<T>(wrow, c, a.tables), x[c], sum);
    a.y[o] = sum;
  }
}

template <GgmlType T>
Status launch(const GemmArgs& a, int tm, dim3 grid, cudaStream_t stream) {
  const int64_t staged = staged_x_bytes(a.k) + a.row_data_bytes;
  if (tm == 1 && a.tile_count == nullptr && a.m == 1 && staged <= kStageMaxBytes) {
    static bool attribute_set = false;  // per instantiation, before any graph capture uses it
    if (!attribute_set) {
      DSV4_CUDA_TRY(cudaFuncSetAttribute(exact_row_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(kStageMaxBytes)));
      attribute_set = true;
    }
    exact_row_kernel<T><<<dim3(static_cast<unsigned>(a.n), 1, 1), kStageThreads, static_cast<size_t>(staged), stream>>>(a);
  } else if (tm == 1) exact_gemm_kernel<T, 1><<<grid, kThreads, 0, stream>>>(a);
  else if (tm == 4) exact_gemm_kernel<T, 4><<<grid, kThreads, 0, stream>>>(a);
  else exact_gemm_kernel<T, kExactTileRows><<<grid, kThreads, 0, stream>>>(a);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

Status run(const ExactWeights& w, const GemmArgs& a, int tm, dim3 grid, cudaStream_t stream) {
  return exact::dispatch(w.type, [&](auto tag) -> Status {
    constexpr GgmlType T = decltype(tag)::value;
    if constexpr (T == GgmlType::I32) {
      return Status::error("exact_matmul: i32 is not a weight type");
    } else {
      return launch<T>(a, tm, grid, stream);
    }
  });
}

Status check(const ExactWeights& w, const char* op) {
  if (!exact::supported(w.type) || w.type == GgmlType::I32)
    return Status::error(std::string(op) + ": weight type " + std::string(ggml_type_name(w.type)) +
                         " has no exact decoder");
  const auto& t = ggml_traits(w.type);
  if (w.n <= 0 || w.k <= 0 || w.k % t.block_elems != 0)
    return Status::error(std::string(op) + ": weights [" + std::to_string(w.n) + ", " + std::to_string(w.k) +
                         "] of " + std::string(t.name) + " (k must be a positive multiple of " +
                         std::to_string(t.block_elems) + ")");
  if (t.block_elems > 1 && w.k % 32 != 0)
    return Status::error(std::string(op) + ": rows of " + std::to_string(w.k) + " " + std::string(t.name) +
                         " values are not whole 32-value groups");
  const uintptr_t align = w.type == GgmlType::F32 ? 4 : (w.type == GgmlType::MXFP4 ? 1 : 2);
  if (reinterpret_cast<uintptr_t>(w.data) % align != 0 || w.row_bytes % align != 0 || w.matrix_bytes % align != 0)
    return Status::error(std::string(op) + ": " + std::string(t.name) + " rows must be " + std::to_string(align) +
                         "-byte aligned");
  if (!exact::tables_ready(w.type, w.tables))
    return Status::error(std::string(op) + ": " + std::string(t.name) + " without its device codebooks");
  return Status::ok();
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

__global__ void build_tiles_kernel(const int32_t* __restrict__ ids, int pairs, int n_experts, int tile_rows,
                                   int* __restrict__ sorted_pairs, int* __restrict__ tile_expert,
                                   int* __restrict__ tile_first, int* __restrict__ tile_count,
                                   int* __restrict__ n_tiles, uint32_t* errors, uint32_t error_bit) {
  extern __shared__ int counts[];  // [n_experts] counts, [n_experts] offsets, [n_experts] first tile
  int* offsets = counts + n_experts;
  int* first_tile = offsets + n_experts;
  for (int e = threadIdx.x; e < n_experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int e = ids[p];
    if (e >= 0 && e < n_experts) atomicAdd(&counts[e], 1);
    else if (errors != nullptr) atomicOr(errors, error_bit);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int offset = 0, tiles = 0;
    for (int e = 0; e < n_experts; ++e) {
      offsets[e] = offset;
      first_tile[e] = tiles;
      offset += counts[e];
      tiles += (counts[e] + tile_rows - 1) / tile_rows;
    }
    *n_tiles = tiles;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < n_experts; e += blockDim.x) {
    for (int t = 0; t * tile_rows < counts[e]; ++t) {
      const int tile = first_tile[e] + t;
      tile_expert[tile] = e;
      tile_first[tile] = offsets[e] + t * tile_rows;
      tile_count[tile] = min(tile_rows, counts[e] - t * tile_rows);
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < n_experts; e += blockDim.x) counts[e] = 0;  // scatter cursors
  __syncthreads();
  // Pair order inside an expert follows the atomics; no result depends on it (every pair's
  // outputs are computed on their own).
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int e = ids[p];
    if (e >= 0 && e < n_experts) sorted_pairs[offsets[e] + atomicAdd(&counts[e], 1)] = p;
  }
}

}  // namespace

Status exact_matmul(const ExactWeights& w, const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy,
                    cudaStream_t stream) {
  DSV4_TRY(check(w, "exact_matmul"));
  if (m <= 0) return Status::ok();
  const int tm = m <= 1 ? 1 : m <= 4 ? 4 : kExactTileRows;
  const int64_t m_tiles = ceil_div(m, tm), n_blocks = ceil_div(w.n, kWarps);
  if (m_tiles > INT32_MAX || n_blocks > 65535)
    return Status::error("exact_matmul: " + std::to_string(m) + " rows x " + std::to_string(w.n) +
                         " outputs exceed the grid");
  GemmArgs a;
  a.w = static_cast<const uint8_t*>(w.data);
  a.row_bytes = w.row_bytes;
  const auto& traits = ggml_traits(w.type);
  a.row_data_bytes = w.k / traits.block_elems * traits.block_bytes;
  a.n = w.n;
  a.k = w.k;
  a.x = x;
  a.ldx = ldx;
  a.y = y;
  a.ldy = ldy;
  a.m = m;
  a.tables = w.tables;
  return run(w, a, tm, dim3(static_cast<unsigned>(m_tiles), static_cast<unsigned>(n_blocks), 1), stream);
}

int64_t exact_max_tiles(int64_t pairs, int64_t n_experts) {
  return std::min(pairs, pairs / kExactTileRows + n_experts) + 1;
}

size_t expert_tiles_bytes(int64_t pairs, int64_t max_tiles) {
  return align256(static_cast<size_t>(pairs) * sizeof(int)) + align256(static_cast<size_t>(3 * max_tiles + 1) * sizeof(int));
}

Status build_expert_tiles(const int32_t* ids, int64_t pairs, int64_t n_experts, void* buffer, int64_t max_tiles,
                          ExpertTiles& out, uint32_t* errors, uint32_t error_bit, cudaStream_t stream) {
  if (n_experts <= 0 || n_experts > 4096 || pairs <= 0 || pairs > (int64_t{1} << 24))
    return Status::error("build_expert_tiles: " + std::to_string(pairs) + " pairs over " + std::to_string(n_experts) +
                         " experts (supported: 1..4096 experts, up to 2^24 pairs)");
  auto* base = static_cast<uint8_t*>(buffer);
  int* sorted = reinterpret_cast<int*>(base);
  int* tile_expert = reinterpret_cast<int*>(base + align256(static_cast<size_t>(pairs) * sizeof(int)));
  int* tile_first = tile_expert + max_tiles;
  int* tile_count = tile_first + max_tiles;
  int* n_tiles = tile_count + max_tiles;
  const size_t smem = static_cast<size_t>(3 * n_experts) * sizeof(int);
  build_tiles_kernel<<<1, 1024, smem, stream>>>(ids, static_cast<int>(pairs), static_cast<int>(n_experts),
                                                kExactTileRows, sorted, tile_expert, tile_first, tile_count, n_tiles,
                                                errors, error_bit);
  DSV4_CUDA_TRY_LAUNCH();
  out.n_tiles = n_tiles;
  out.tile_expert = tile_expert;
  out.tile_first = tile_first;
  out.tile_count = tile_count;
  out.sorted_pairs = sorted;
  out.max_tiles = max_tiles;
  return Status::ok();
}

Status exact_matmul_grouped(const ExactWeights& w, const float* x, int64_t ldx, int x_row_div, float* y,
                            int64_t ldy, const ExpertTiles& tiles, cudaStream_t stream) {
  DSV4_TRY(check(w, "exact_matmul_grouped"));
  const int64_t n_blocks = ceil_div(w.n, kWarps);
  if (tiles.max_tiles <= 0 || tiles.max_tiles > INT32_MAX || n_blocks > 65535)
    return Status::error("exact_matmul_grouped: " + std::to_string(tiles.max_tiles) + " tiles x " +
                         std::to_string(w.n) + " outputs exceed the grid");
  GemmArgs a;
  a.w = static_cast<const uint8_t*>(w.data);
  a.row_bytes = w.row_bytes;
  a.matrix_bytes = w.matrix_bytes;
  a.n = w.n;
  a.k = w.k;
  a.x = x;
  a.ldx = ldx;
  a.y = y;
  a.ldy = ldy;
  a.n_tiles = tiles.n_tiles;
  a.tile_expert = tiles.tile_expert;
  a.tile_first = tiles.tile_first;
  a.tile_count = tiles.tile_count;
  a.sorted_pairs = tiles.sorted_pairs;
  a.x_row_div = x_row_div;
  a.tables = w.tables;
  return run(w, a, kExactTileRows, dim3(static_cast<unsigned>(tiles.max_tiles), static_cast<unsigned>(n_blocks), 1),
             stream);
}

}  // namespace dsv4::cuda
