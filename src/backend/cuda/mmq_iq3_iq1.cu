// The tensor-core product kernels (mmq_kernel.cuh) for IQ3_XXS, IQ3_S and IQ1_S (one scale per
// 32 weights; grids from iq2_tables.cu), in their own translation unit so the types compile in
// parallel (IQ2_XS, IQ2_S, IQ1_M: mmq_iq2_iq1_m.cu).
#include "backend/cuda/mmq_launch.cuh"

namespace dsv4::cuda::detail {

Status launch_mmq_iq3_iq1(GgmlType type, const MmqArgs& a, int nt, MmqMode mode, int64_t tasks, cudaStream_t stream) {
  switch (type) {
    case GgmlType::IQ3_XXS: return launch_mmq_type<GgmlType::IQ3_XXS>(a, nt, mode, tasks, stream);
    case GgmlType::IQ3_S: return launch_mmq_type<GgmlType::IQ3_S>(a, nt, mode, tasks, stream);
    case GgmlType::IQ1_S: return launch_mmq_type<GgmlType::IQ1_S>(a, nt, mode, tasks, stream);
    default: return Status::error("mmq: weight type " + std::string(ggml_type_name(type)) + " is not IQ3_XXS, IQ3_S or IQ1_S");
  }
}

}  // namespace dsv4::cuda::detail
