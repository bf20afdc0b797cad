// wgmma BF16 product (gemm_wgmma.h). Block: 256 threads = two warpgroups; block tile
// 128(m) x 128(n); warpgroup g owns rows 64g..64g+63 and all 128 columns (one
// m64n128k16 wgmma per 16 of k, 64 f32 accumulators per thread). A and W tiles are 128
// rows x 64 bf16 = 128 bytes per row, stored in the 128-byte swizzle (16-byte chunk c of
// row r at chunk c ^ (r % 8)), which is the layout the K-major descriptors below name.
#include "backend/cuda/gemm_wgmma.h"

#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/wgmma.cuh"

namespace dsv4::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kStages = 3;
constexpr int kTileBytes = kWgmmaTileM * kWgmmaTileK * 2;  // 16 KiB, same for A and W
constexpr int kStageBytes = 2 * kTileBytes;
// Swizzled tiles must start on 1024 bytes; the dynamic shared base is rounded up in-kernel.
// Three stages (97 KiB) let two blocks share a multiprocessor, so one block's loads and
// epilogue overlap the other's wgmma (each block waits for its own wgmma every k-tile).
constexpr int kSmemBytes = kStages * kStageBytes + 1024;

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

using detail::wgmma_commit;
using detail::wgmma_fence;
using detail::wgmma_fence_accumulators;
using detail::wgmma_swizzle128_descriptor;
using detail::wgmma_wait;

__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, 1, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b));
}

// One k-tile (128 rows x 64 bf16) of a row-major matrix with row length k into a swizzled
// shared tile; 1024 chunks of 16 bytes, four per thread, eight threads per 128-byte row.
__device__ __forceinline__ void load_tile(uint32_t smem_tile, const __nv_bfloat16* src, int64_t k) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int q = static_cast<int>(threadIdx.x) + i * kThreads;
    const int row = q >> 3, chunk = q & 7;
    cp_async16(smem_tile + row * 128 + ((chunk ^ (row & 7)) << 4), src + row * k + chunk * 8);
  }
}

__device__ __forceinline__ void store_pair(float* c, float x, float y) { *reinterpret_cast<float2*>(c) = {x, y}; }
__device__ __forceinline__ void store_pair(__nv_bfloat16* c, float x, float y) {
  *reinterpret_cast<__nv_bfloat162*>(c) = __floats2bfloat162_rn(x, y);
}

template <class Out>
__global__ void __launch_bounds__(kThreads, 2)
    gemm_wgmma_kernel(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ w, Out* __restrict__ c,
                      int64_t n, int64_t k) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t smem = (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) + 1023u) & ~1023u;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kWgmmaTileM;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kWgmmaTileN;
  const __nv_bfloat16* a_tile = a + m0 * k;
  const __nv_bfloat16* w_tile = w + n0 * k;
  const int k_tiles = static_cast<int>(k / kWgmmaTileK);
  const int group = static_cast<int>(threadIdx.x) / 128;

  // Prologue: stages 0..kStages-2 in flight (an empty commit keeps the group count fixed).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) {
      load_tile(smem + s * kStageBytes, a_tile + s * kWgmmaTileK, k);
      load_tile(smem + s * kStageBytes + kTileBytes, w_tile + s * kWgmmaTileK, k);
    }
    cp_async_commit();
  }

  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.0f;

  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();
    // cp.async wrote through the generic proxy; wgmma reads through the async proxy.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    // Stage (kt-1) % kStages is free: every warpgroup waited for its wgmma of tile kt-1
    // before the barrier above.
    const int next = kt + kStages - 1;
    if (next < k_tiles) {
      const uint32_t s = smem + (next % kStages) * kStageBytes;
      load_tile(s, a_tile + static_cast<int64_t>(next) * kWgmmaTileK, k);
      load_tile(s + kTileBytes, w_tile + static_cast<int64_t>(next) * kWgmmaTileK, k);
    }
    cp_async_commit();

    const uint32_t stage = smem + (kt % kStages) * kStageBytes;
    const uint32_t a_base = stage + group * 64 * 128;
    const uint32_t w_base = stage + kTileBytes;
    wgmma_fence_accumulators<64>(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kWgmmaTileK / 16; ++kk)  // 16 bf16 = 32 bytes along the swizzled row
      wgmma_m64n128k16(acc, wgmma_swizzle128_descriptor(a_base + kk * 32), wgmma_swizzle128_descriptor(w_base + kk * 32));
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_accumulators<64>(acc);
  }

  // Accumulator layout of m64nNk16: warp w of the group holds rows 16w + lane/4 (+8);
  // register 4j + 2h + e is column 8j + 2(lane%4) + e of row (+8 if h).
  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  const int64_t row = m0 + group * 64 + warp * 16 + lane / 4;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int64_t col = n0 + j * 8 + (lane % 4) * 2;
    store_pair(c + row * n + col, acc[4 * j], acc[4 * j + 1]);
    store_pair(c + (row + 8) * n + col, acc[4 * j + 2], acc[4 * j + 3]);
  }
}

template <class Out>
Status launch(const __nv_bfloat16* a, const __nv_bfloat16* w, Out* c, int64_t m, int64_t n, int64_t k,
              cudaStream_t stream) {
  if (m <= 0 || n <= 0 || k <= 0 || m % kWgmmaTileM != 0 || n % kWgmmaTileN != 0 || k % kWgmmaTileK != 0)
    return Status::error("gemm_wgmma_bf16: shape m " + std::to_string(m) + " n " + std::to_string(n) + " k " +
                         std::to_string(k) + " must be positive with m, n multiples of " +
                         std::to_string(kWgmmaTileM) + " and k a multiple of " + std::to_string(kWgmmaTileK));
  if (m / kWgmmaTileM > 65535)
    return Status::error("gemm_wgmma_bf16: m " + std::to_string(m) + " over the grid limit " +
                         std::to_string(65535 * kWgmmaTileM));
  if ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(w) | reinterpret_cast<uintptr_t>(c)) % 16 != 0)
    return Status::error("gemm_wgmma_bf16: a, w and c must be 16-byte aligned");
  DSV4_CUDA_TRY(cudaFuncSetAttribute(gemm_wgmma_kernel<Out>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const dim3 grid(static_cast<unsigned>(n / kWgmmaTileN), static_cast<unsigned>(m / kWgmmaTileM));
  gemm_wgmma_kernel<Out><<<grid, kThreads, kSmemBytes, stream>>>(a, w, c, n, k);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

}  // namespace

Status gemm_wgmma_bf16(const __nv_bfloat16* a, const __nv_bfloat16* w, float* c, int64_t m, int64_t n, int64_t k,
                       cudaStream_t stream) {
  return launch(a, w, c, m, n, k, stream);
}

Status gemm_wgmma_bf16(const __nv_bfloat16* a, const __nv_bfloat16* w, __nv_bfloat16* c, int64_t m, int64_t n,
                       int64_t k, cudaStream_t stream) {
  return launch(a, w, c, m, n, k, stream);
}

}  // namespace dsv4::cuda
