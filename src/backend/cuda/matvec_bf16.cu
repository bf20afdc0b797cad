// BF16 matrix-vector products for 1-16 activation rows (matvec.h, chosen by default for BF16
// weights; MatvecKernels::bf16_streaming = false returns to the general kernel).
//
// BF16 weights need no decoding, so the kernel is a plain stream: each warp owns M
// consecutive output rows and its lanes read the rows' 16-byte chunks c = lane, lane + 32, ...
// straight into registers (one coalesced 512-byte request per warp and row, several in flight
// per lane, no shared-memory staging, not kept in L1), while the f32 activations of the same
// eight columns come through L1 (every warp of a multiprocessor reads the same ones) with two
// 16-byte loads per row and chunk. Products and sums are f32 fused multiply-adds; the 32
// lanes' partial sums are added by shuffles at the end. Activation traffic through L1 is
// 2 * rows / M bytes per weight byte, hence M = 4 output rows per warp beyond two activation
// rows.
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/matvec.h"
#include "backend/cuda/matvec_launch.cuh"

namespace dsv4::cuda::detail {

namespace {

constexpr int kBf16WarpsPerBlock = 8;

struct Bf16Args {
  const uint8_t* w = nullptr;
  int64_t matrix_stride = 0;  // bytes between batch matrices (a multiple of 16)
  int64_t n = 0;              // rows per matrix
  int64_t k = 0;              // a multiple of 8
  int64_t batch = 0;
  int64_t row_groups = 0;     // ceil(n / M) per matrix
  int act_rows = 0;           // activation rows per matrix, at most the kernel's R
  const float* x = nullptr;   // [batch][act_rows][k]
  float* y = nullptr;         // [batch][act_rows][n]
};

__device__ __forceinline__ uint4 load_streaming(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

// acc[r] += dot(8 weights, x[r][8 values]) for the first `act_rows` (warp-uniform) of R rows.
template <int R>
__device__ __forceinline__ void fma_chunk(const uint4& w, const float* x, int64_t k, int64_t at, int act_rows,
                                          float (&acc)[R]) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (r >= act_rows) break;
    const float4 a = __ldg(reinterpret_cast<const float4*>(x + r * k + at));
    const float4 b = __ldg(reinterpret_cast<const float4*>(x + r * k + at + 4));
    float s = acc[r];
    s = fmaf(bf16_lo(w.x), a.x, s);
    s = fmaf(bf16_hi(w.x), a.y, s);
    s = fmaf(bf16_lo(w.y), a.z, s);
    s = fmaf(bf16_hi(w.y), a.w, s);
    s = fmaf(bf16_lo(w.z), b.x, s);
    s = fmaf(bf16_hi(w.z), b.y, s);
    s = fmaf(bf16_lo(w.w), b.z, s);
    s = fmaf(bf16_hi(w.w), b.w, s);
    acc[r] = s;
  }
}

// Up to R activation rows, M output rows per warp, U chunks per lane loaded ahead of their use.
template <int R, int M, int U>
__global__ void __launch_bounds__(kBf16WarpsPerBlock * 32) matvec_bf16_kernel(const Bf16Args a) {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  const int lane = threadIdx.x & 31;
  const int64_t group = static_cast<int64_t>(blockIdx.x) * kBf16WarpsPerBlock + (threadIdx.x >> 5);
  const bool live = group < a.batch * a.row_groups;
  const int64_t b = live ? group / a.row_groups : 0;
  const int64_t i0 = live ? (group % a.row_groups) * M : 0;
  const int rows = live ? static_cast<int>(min(static_cast<int64_t>(M), a.n - i0)) : 0;
  const int64_t chunks = a.k / 8;
  const uint8_t* base = a.w + b * a.matrix_stride + i0 * a.k * 2;
  float acc[M][R];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;

  // The weights are constant: the first U chunks of every row are requested before waiting
  // for the kernel that writes the activations.
  uint4 w[U][M];
  auto load = [&](int64_t c0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = c0 + u * 32 + lane;
#pragma unroll
      for (int m = 0; m < M; ++m)
        w[u][m] = (c < chunks && m < rows) ? load_streaming(base + (m * a.k + c * 8) * 2) : make_uint4(0, 0, 0, 0);
    }
  };
  load(0);
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  const float* x = a.x + b * a.act_rows * a.k;
  for (int64_t c0 = 0; c0 < chunks; c0 += U * 32) {
    uint4 cur[U][M];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int m = 0; m < M; ++m) cur[u][m] = w[u][m];
    if (c0 + U * 32 < chunks) load(c0 + U * 32);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = c0 + u * 32 + lane;
      if (c < chunks) {
#pragma unroll
        for (int m = 0; m < M; ++m) fma_chunk<R>(cur[u][m], x, a.k, c * 8, a.act_rows, acc[m]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float v = acc[m][r];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
      if (lane == 0 && m < rows && r < a.act_rows) a.y[(b * a.act_rows + r) * a.n + i0 + m] = v;
    }
}

template <int R, int M, int U>
Status launch(const Bf16Args& args, cudaStream_t stream) {
  const int64_t warps = args.batch * args.row_groups;
  const int64_t blocks = (warps + kBf16WarpsPerBlock - 1) / kBf16WarpsPerBlock;
  if (blocks >= (int64_t{1} << 31)) return Status::error("matvec (bf16): " + std::to_string(blocks) + " blocks");
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(kBf16WarpsPerBlock * 32);
  config.stream = stream;
  cudaLaunchAttribute pdl{};
  pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl.val.programmaticStreamSerializationAllowed = 1;
  if (programmatic_launch_enabled()) {
    config.attrs = &pdl;
    config.numAttrs = 1;
  }
  DSV4_CUDA_TRY(cudaLaunchKernelEx(&config, matvec_bf16_kernel<R, M, U>, args));
  return Status::ok();
}

template <int R>
Status launch_rows(Bf16Args args, cudaStream_t stream) {
  // M output rows per warp: 1 for one activation row (many warps, many requests in flight),
  // 2 for two, 4 beyond (activation bytes through L1 per weight byte stay at 2R/M).
  constexpr int M = R == 1 ? 1 : (R == 2 ? 2 : 4);
  constexpr int U = R == 1 ? 8 : (R <= 4 ? 2 : 1);
  args.row_groups = (args.n + M - 1) / M;
  return launch<R, M, U>(args, stream);
}

}  // namespace

bool bf16_streaming_applies(const MatvecWeights& w) {
  const int64_t stride = w.batch_stride_bytes != 0 ? w.batch_stride_bytes : w.n * w.k * 2;
  return w.k % 8 == 0 && stride % 16 == 0 && reinterpret_cast<uintptr_t>(w.data) % 16 == 0;
}

Status matvec_bf16(const MatvecWeights& w, const float* x, int rows, float* y, cudaStream_t stream) {
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0)
    return Status::error("matvec (bf16): activations must be 16-byte aligned");
  Bf16Args a;
  a.w = static_cast<const uint8_t*>(w.data);
  a.matrix_stride = w.batch_stride_bytes != 0 ? w.batch_stride_bytes : w.n * w.k * 2;
  a.n = w.n;
  a.k = w.k;
  a.batch = w.batch;
  a.x = x;
  a.y = y;
  a.act_rows = rows;
  if (rows == 1) return launch_rows<1>(a, stream);
  if (rows == 2) return launch_rows<2>(a, stream);
  if (rows <= 4) return launch_rows<4>(a, stream);
  if (rows <= 8) return launch_rows<8>(a, stream);
  if (rows <= 16) return launch_rows<16>(a, stream);
  return Status::error("matvec (bf16): " + std::to_string(rows) + " activation rows, supported 1..16");
}

}  // namespace dsv4::cuda::detail
