// 16-byte cp.async copies global -> shared and their group fences, for the kernels outside the
// matvec family (attention, the compressor tiles of float32_rows.cu). The "memory" clobbers
// keep the compiler from moving shared-memory accesses across a commit or wait. The matvec
// family (matvec_kernel.cuh) and gemm_wgmma.cu keep their own copies without them, as the
// kernels measured with them were compiled.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dsv4::cuda {

// Both addresses 16-byte aligned.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Until at most N of this thread's committed groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace dsv4::cuda
