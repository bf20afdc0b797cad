// The tensor-core product kernels (mmq_kernel.cuh) for the 32-element block types Q4_0, Q4_1,
// Q5_0, Q5_1 and IQ4_NL, in their own translation unit so the types compile in parallel.
#include "backend/cuda/mmq_launch.cuh"

namespace dsv4::cuda::detail {

Status launch_mmq_small_blocks(GgmlType type, const MmqArgs& a, int nt, MmqMode mode, int64_t tasks,
                               cudaStream_t stream) {
  switch (type) {
    case GgmlType::Q4_0: return launch_mmq_type<GgmlType::Q4_0>(a, nt, mode, tasks, stream);
    case GgmlType::Q4_1: return launch_mmq_type<GgmlType::Q4_1>(a, nt, mode, tasks, stream);
    case GgmlType::Q5_0: return launch_mmq_type<GgmlType::Q5_0>(a, nt, mode, tasks, stream);
    case GgmlType::Q5_1: return launch_mmq_type<GgmlType::Q5_1>(a, nt, mode, tasks, stream);
    case GgmlType::IQ4_NL: return launch_mmq_type<GgmlType::IQ4_NL>(a, nt, mode, tasks, stream);
    default: return Status::error("mmq: weight type " + std::string(ggml_type_name(type)) + " is not a 32-element block type");
  }
}

}  // namespace dsv4::cuda::detail
