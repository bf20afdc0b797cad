// The tensor-core product kernels (mmq_kernel.cuh) for Q5_K and IQ4_XS, in their own
// translation unit so the types compile in parallel.
#include "backend/cuda/mmq_launch.cuh"

namespace dsv4::cuda::detail {

Status launch_mmq_q5_k_iq4_xs(GgmlType type, const MmqArgs& a, int nt, MmqMode mode, int64_t tasks,
                              cudaStream_t stream) {
  switch (type) {
    case GgmlType::Q5_K: return launch_mmq_type<GgmlType::Q5_K>(a, nt, mode, tasks, stream);
    case GgmlType::IQ4_XS: return launch_mmq_type<GgmlType::IQ4_XS>(a, nt, mode, tasks, stream);
    default: return Status::error("mmq: weight type " + std::string(ggml_type_name(type)) + " is not Q5_K or IQ4_XS");
  }
}

}  // namespace dsv4::cuda::detail
