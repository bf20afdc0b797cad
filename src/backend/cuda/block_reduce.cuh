// Block-wide reductions shared by the CUDA backend's kernels.
#pragma once

#include <cuda_runtime.h>

namespace dsv4::cuda {

// Sum over a block of blockDim.x (a multiple of 32, at most 1024) threads; every thread gets
// it. The order is fixed by the block size: each warp's shuffle tree, then the warps' sums in
// warp order (so warps that contribute 0.0 at the end leave the sum's bits unchanged).
__device__ inline double block_sum(double v) {
  __shared__ double warp_sums[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    // In groups of 8: one loop of dependent shared loads was 32 load latencies (~1000 cycles)
    // of a one-row hc_pre (ncu, 2026-12-04). The same additions in the same order.
    const int warps = static_cast<int>(blockDim.x >> 5);
    double total = 0.0;
    for (int w0 = 0; w0 < warps; w0 += 8) {
      double part[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) part[u] = w0 + u < warps ? warp_sums[w0 + u] : 0.0;
#pragma unroll
      for (int u = 0; u < 8; ++u)
        if (w0 + u < warps) total += part[u];
    }
    warp_sums[0] = total;
  }
  __syncthreads();
  const double total = warp_sums[0];
  __syncthreads();  // the buffer may be reused by the next call
  return total;
}

}  // namespace dsv4::cuda
