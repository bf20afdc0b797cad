// Programmatic dependent launch (PDL) for the step's small kernels: norms, RoPE, the
// hyper-connection kernels, attention's and the compressors' kernels, the exact products,
// routing and sampling. A decode step is ~55 launches a layer, most of a few microseconds, and
// without PDL each waits for the previous kernel to drain and its memory to flush before its
// own blocks are even scheduled. Launched with launch_dependent, a kernel's blocks become
// resident while the previous kernel finishes; they run dependent_kernel_prologue() first,
// which lets the next kernel do the same and then blocks until the previous kernel has
// completed with its writes visible. Every kernel launched this way must call the prologue
// before it touches memory (the matvec family's kernels, which prefetch their constant
// weights first, have their own: matvec_kernel.cuh). The switch is the matvec family's
// (DSV4_CUDA_PDL=0, set_programmatic_launch in matvec.h).
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "backend/cuda/matvec.h"

namespace dsv4::cuda {

__device__ __forceinline__ void dependent_kernel_prologue() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...) with the PDL attribute (when enabled) and,
// with cluster_x > 1, thread-block clusters of cluster_x blocks along x (the kernel must allow
// that size: cudaFuncAttributeNonPortableClusterSizeAllowed above 8). A failed launch is left
// for cudaGetLastError (DSV4_CUDA_TRY_LAUNCH), as with <<<>>>.
template <class... Params, class... Args>
void launch_dependent_clusters(void (*kernel)(Params...), dim3 grid, dim3 block, unsigned cluster_x, size_t smem,
                               cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attrs[2]{};
  unsigned count = 0;
  if (cluster_x > 1) {
    attrs[count].id = cudaLaunchAttributeClusterDimension;
    attrs[count].val.clusterDim.x = cluster_x;
    attrs[count].val.clusterDim.y = 1;
    attrs[count].val.clusterDim.z = 1;
    ++count;
  }
  if (programmatic_launch()) {
    attrs[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  config.attrs = count > 0 ? attrs : nullptr;
  config.numAttrs = count;
  (void)cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

template <class... Params, class... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                      Args&&... args) {
  launch_dependent_clusters(kernel, grid, block, 1, smem, stream, std::forward<Args>(args)...);
}

}  // namespace dsv4::cuda
