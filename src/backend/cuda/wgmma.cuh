// Hopper warpgroup MMA (wgmma) helpers shared by the kernels that issue it (gemm_wgmma.cu,
// moe_wgmma.cu): the shared-memory operand descriptor of their layout and the fences and
// waits around the asynchronous MMA.
#pragma once

#include <cstdint>

namespace dsv4::cuda::detail {

// A K-major operand in the 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8),
// rows of 128 bytes): 8-row groups 1024 bytes apart (field 64), leading offset unused by this
// layout (1 by convention), layout type 1 in bits 62-63. The tile must start on 1024 bytes.
__device__ __forceinline__ uint64_t wgmma_swizzle128_descriptor(uint32_t smem_addr) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{64} << 32) |
         (uint64_t{1} << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// At most N committed groups still in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keeps the compiler from moving reads or writes of the first N accumulators across the
// asynchronous MMA.
template <int N>
__device__ __forceinline__ void wgmma_fence_accumulators(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

}  // namespace dsv4::cuda::detail
