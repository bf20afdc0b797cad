#include "backend/cuda/exact_gemm.h"

#include <algorithm>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/dependent_launch.cuh"
#include "backend/cuda/matvec_launch.cuh"  // sm_count

namespace dsv4::cuda {

namespace {

constexpr int kWarps = 8;   // output features per block, one per warp
constexpr int kBK = 128;    // k per shared-memory tile of activations (a multiple of 32)
constexpr int kThreads = 32 * kWarps;

size_t align256(size_t n) { return (n + 255) & ~size_t{255}; }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

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
  ::dsv4::cuda::dependent_kernel_prologue();
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

// Few activation rows (decode: the hyper-connection mixes, compressors, index projections
// and routers of 1-64 sequences): the same sums as exact_gemm_kernel, from shared memory. The
// tile kernel's k loop puts a barrier and a round trip to memory on every 128 values of k, and
// its grid is ceil(m / 16) x ceil(n / 8) blocks: the mixes ([m, 16384] x [16384, 24]) got three
// blocks on the whole GPU and were a third of a decode step, 0.58 ms each at 16 rows (issue
// 10's profiles). Here a block stages `rows` activation rows and the weight rows of its
// `outputs` outputs in shared memory with every load in flight (16-byte loads where both sides
// are aligned), then warp w runs output w's chains for every staged row: one memory latency per
// block instead of one per 128 values of k. `outputs` shrinks until the grid covers the GPU
// twice (a compressor of 1024 outputs at one row: 3 per block, 342 blocks); one block per output
// was 49 us for such a compressor, 7 ms of a 43-layer decode step (issue 10's third profile).
constexpr int64_t kStagePreferBytes = 112 * 1024;  // two blocks per SM
constexpr int64_t kStageMaxBytes = 160 * 1024;     // one 16384-wide F32 row of x and of w
constexpr int kStageMaxRows = 8;          // activation rows per block
constexpr int64_t kStageMaxProductRows = 64;  // beyond (prefill), the tile kernel reuses weights over 16 rows
constexpr int kStageMaxOutputs = 32;
constexpr int kStageUnroll = 8;  // 16-byte loads in flight per thread

// stage_two copies two sets of rows (`count` rows of `len` bytes, `src_stride` apart, to `dst`,
// `dst_stride` apart, a multiple of 16: the x rows and the weight rows) as one list of
// 16-byte vectors: every thread issues kStageUnroll loads before it stores any, so a stage of a
// few x rows and several weight rows costs about one memory latency (row by row it was one per
// row; a plain copy loop, one per 32 values of a 16384-wide F32 row).
struct StageRows {
  const uint8_t* src;
  int64_t src_stride, len;
  uint8_t* dst;
  int64_t dst_stride;
  int count;
};

__device__ __forceinline__ bool vector_rows(const StageRows& s) {
  return ((reinterpret_cast<uintptr_t>(s.src) | static_cast<uintptr_t>(s.src_stride)) & 15) == 0;
}

// What the vectors leave: unaligned rows whole, aligned rows' last len % 16 bytes.
__device__ void stage_tail(const StageRows& s) {
  const int64_t from = vector_rows(s) ? s.len / 16 * 16 : 0, tail = s.len - from;
  for (int64_t e = threadIdx.x; e < tail * s.count; e += blockDim.x) {
    const int64_t row = e / tail, at = from + e - row * tail;
    s.dst[row * s.dst_stride + at] = s.src[row * s.src_stride + at];
  }
}

__device__ void stage_two(const StageRows& a, const StageRows& b) {
  const int av = vector_rows(a) ? static_cast<int>(a.len / 16) : 0;
  const int bv = vector_rows(b) ? static_cast<int>(b.len / 16) : 0;
  const int a_total = av * a.count, total = a_total + bv * b.count;
  const int stride = static_cast<int>(blockDim.x);
  for (int v0 = static_cast<int>(threadIdx.x); v0 < total; v0 += kStageUnroll * stride) {
    uint4 r[kStageUnroll];
    uint4* to[kStageUnroll];
#pragma unroll
    for (int u = 0; u < kStageUnroll; ++u) {
      const int v = v0 + u * stride;
      to[u] = nullptr;
      if (v < total) {
        const StageRows& s = v < a_total ? a : b;
        const int per_row = v < a_total ? av : bv, w = v < a_total ? v : v - a_total;
        const int row = w / per_row, col = w - row * per_row;
        r[u] = *reinterpret_cast<const uint4*>(s.src + row * s.src_stride + 16 * col);
        to[u] = reinterpret_cast<uint4*>(s.dst + row * s.dst_stride + 16 * col);
      }
    }
#pragma unroll
    for (int u = 0; u < kStageUnroll; ++u)
      if (to[u] != nullptr) *to[u] = r[u];
  }
  stage_tail(a);
  stage_tail(b);
}

int64_t align16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

// How a staged launch splits the product: rows x outputs per block, its threads and bytes.
struct StagePlan {
  int rows = 0;  // 0: the product does not fit; the tile kernel runs it
  int outputs = 0;
  int threads = 0;
  int64_t smem = 0;
  int64_t x_bytes = 0, w_bytes = 0;  // per staged row
};

// rows: a power of two up to kStageMaxRows (multi_row: the kernel has those instantiations),
// its x rows at most half the block's bytes (the rest for weight rows: each staged x row is
// read again by every block of outputs, each weight row by every block of rows); outputs: what
// the rest holds, fewer while the grid would cover the GPU less than twice.
StagePlan stage_plan(int64_t m, int64_t n, int64_t k, int64_t row_data_bytes, bool multi_row, int sms) {
  StagePlan p;
  p.x_bytes = align16(k * 4);
  p.w_bytes = align16(row_data_bytes);
  if (m < 1 || m > kStageMaxProductRows || p.x_bytes + p.w_bytes > kStageMaxBytes) return p;
  const int64_t budget = p.x_bytes + p.w_bytes <= kStagePreferBytes ? kStagePreferBytes : kStageMaxBytes;
  int64_t rows = 1;
  while (multi_row && 2 * rows <= std::min<int64_t>(m, kStageMaxRows) && 2 * rows * p.x_bytes <= budget / 2) rows *= 2;
  const int64_t groups = ceil_div(m, rows);
  int64_t outputs = std::clamp<int64_t>((budget - rows * p.x_bytes) / p.w_bytes, 1, kStageMaxOutputs);
  outputs = std::min(outputs, std::max<int64_t>(1, n * groups / (2 * int64_t{sms})));
  outputs = std::min(outputs, n);
  p.rows = static_cast<int>(rows);
  p.outputs = static_cast<int>(outputs);
  p.smem = rows * p.x_bytes + outputs * p.w_bytes;
  // Enough threads to have the whole stage in flight at once (kStageUnroll x 16 bytes each).
  p.threads = static_cast<int>(std::clamp<int64_t>(ceil_div(p.smem, 16 * kStageUnroll) / 32 * 32, 256, 1024));
  p.threads = std::max(p.threads, 32 * p.outputs);
  return p;
}

template <GgmlType T, int R>
__global__ void __launch_bounds__(1024) exact_staged_kernel(const GemmArgs a, const int outputs, const int64_t x_bytes,
                                                            const int64_t w_bytes) {
  ::dsv4::cuda::dependent_kernel_prologue();
  constexpr int rows = R;  // per block; the last block of rows may have fewer
  constexpr bool kPlain = T == GgmlType::F32 || T == GgmlType::F16 || T == GgmlType::BF16;
  extern __shared__ __align__(16) uint8_t staged[];
  const int64_t o0 = static_cast<int64_t>(blockIdx.x) * outputs;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows;
  const int n_out = static_cast<int>(min(static_cast<int64_t>(outputs), a.n - o0));
  const int n_rows = static_cast<int>(min(static_cast<int64_t>(rows), a.m - r0));
  uint8_t* wstage = staged + rows * x_bytes;
  stage_two(StageRows{reinterpret_cast<const uint8_t*>(a.x + r0 * a.ldx), a.ldx * 4, a.k * 4, staged, x_bytes, n_rows},
            StageRows{a.w + o0 * a.row_bytes, a.row_bytes, a.row_data_bytes, wstage, w_bytes, n_out});
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (warp >= n_out) return;
  const uint8_t* wrow = wstage + warp * w_bytes;
  const int64_t k32 = a.k / 32 * 32;
  // R is a template parameter so that the one-row loop is as tight as a plain dot product (a
  // runtime row count cost the one-row mixes 2.4x on the H200). Rows past n_rows read staged
  // values of the block's last row and are never written.
  const float* xs[R];
#pragma unroll
  for (int r = 0; r < R; ++r) xs[r] = reinterpret_cast<const float*>(staged + (r < n_rows ? r : n_rows - 1) * x_bytes);
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
#pragma unroll 8
  for (int64_t i = lane; i < k32; i += 32) {
    const float wv = exact::element<T>(wrow, i, a.tables);
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = fmaf(wv, xs[r][i], acc[r]);
  }
  if constexpr (kPlain) {  // dot_plain: 8-wide chunks past the last 32 into a_0..a_7
    for (int64_t c = k32; c + 8 <= a.k; c += 8) {
      if (lane < 8) {
        const float wv = exact::element<T>(wrow, c + lane, a.tables);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = fmaf(wv, xs[r][c + lane], acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (r >= n_rows) break;  // uniform over the warp
    const float* x = xs[r];
    float sum = cpu_order_sum(acc[r]);
    if (lane == 0) {
      if constexpr (kPlain)
        for (int64_t c = a.k / 8 * 8; c < a.k; ++c) sum = fmaf(exact::element<T>(wrow, c, a.tables), x[c], sum);
      a.y[(r0 + r) * a.ldy + o0 + warp] = sum;
    }
  }
}

// The types decode products use with several rows (hyper-connection mixes, routers, the
// recipes' compressors) get 2, 4 and 8 rows per block; the others one (a block per row).
template <GgmlType T>
constexpr bool kMultiRow = T == GgmlType::F32 || T == GgmlType::F16 || T == GgmlType::BF16 || T == GgmlType::Q8_0;

template <GgmlType T, int R>
Status launch_staged(const GemmArgs& a, const StagePlan& plan, cudaStream_t stream) {
  static bool attribute_set = false;  // per instantiation, before any graph capture uses it
  if (!attribute_set) {
    DSV4_CUDA_TRY(cudaFuncSetAttribute(exact_staged_kernel<T, R>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(kStageMaxBytes)));
    attribute_set = true;
  }
  const dim3 blocks(static_cast<unsigned>(ceil_div(a.n, plan.outputs)), static_cast<unsigned>(ceil_div(a.m, R)), 1);
  cuda::launch_dependent(exact_staged_kernel<T, R>, blocks, plan.threads, static_cast<size_t>(plan.smem), stream, a,
                         plan.outputs, plan.x_bytes, plan.w_bytes);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

template <GgmlType T>
Status launch(const GemmArgs& a, int tm, dim3 grid, cudaStream_t stream) {
  DSV4_ASSIGN_OR_RETURN(const int sms, detail::sm_count());
  const StagePlan plan =
      a.tile_count == nullptr ? stage_plan(a.m, a.n, a.k, a.row_data_bytes, kMultiRow<T>, sms) : StagePlan{};
  if (plan.rows > 0) {
    if constexpr (kMultiRow<T>) {
      if (plan.rows == 8) return launch_staged<T, 8>(a, plan, stream);
      if (plan.rows == 4) return launch_staged<T, 4>(a, plan, stream);
      if (plan.rows == 2) return launch_staged<T, 2>(a, plan, stream);
    }
    return launch_staged<T, 1>(a, plan, stream);
  } else if (tm == 1)
    cuda::launch_dependent(exact_gemm_kernel<T, 1>, grid, kThreads, 0, stream, a);
  else if (tm == 4)
    cuda::launch_dependent(exact_gemm_kernel<T, 4>, grid, kThreads, 0, stream, a);
  else
    cuda::launch_dependent(exact_gemm_kernel<T, kExactTileRows>, grid, kThreads, 0, stream, a);
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

__global__ void build_tiles_kernel(const int32_t* __restrict__ ids, int pairs, int n_experts, int tile_rows,
                                   int* __restrict__ sorted_pairs, int* __restrict__ tile_expert,
                                   int* __restrict__ tile_first, int* __restrict__ tile_count,
                                   int* __restrict__ n_tiles, uint32_t* errors, uint32_t error_bit) {
  ::dsv4::cuda::dependent_kernel_prologue();
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
  cuda::launch_dependent(build_tiles_kernel, 1, 1024, smem, stream, ids, static_cast<int>(pairs),
                         static_cast<int>(n_experts), kExactTileRows, sorted, tile_expert, tile_first, tile_count,
                         n_tiles, errors, error_bit);
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
