// The tensor-core product kernels for MXFP4 weights (mmq_kernel.cuh), in their own
// translation unit so the types compile in parallel.
#include "backend/cuda/mmq_launch.cuh"

namespace dsv4::cuda::detail {

Status launch_mmq_mxfp4(const MmqArgs& a, int nt, MmqMode mode, int64_t tasks, cudaStream_t stream) {
  return launch_mmq_type<GgmlType::MXFP4>(a, nt, mode, tasks, stream);
}

}  // namespace dsv4::cuda::detail
