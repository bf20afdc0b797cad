// The tensor-core product kernels for Q3_K weights (mmq_kernel.cuh), in their own
// translation unit so the types compile in parallel.
#include "backend/cuda/mmq_launch.cuh"

namespace dsv4::cuda::detail {

Status launch_mmq_q3_k(const MmqArgs& a, int nt, MmqMode mode, int64_t tasks, cudaStream_t stream) {
  return launch_mmq_type<GgmlType::Q3_K>(a, nt, mode, tasks, stream);
}

}  // namespace dsv4::cuda::detail
