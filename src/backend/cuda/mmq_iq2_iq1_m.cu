// The tensor-core product kernels (mmq_kernel.cuh) for IQ2_XS, IQ2_S and IQ1_M (a scale per
// 16 weights; grids from iq2_tables.cu), in their own translation unit so the types compile in
// parallel.
#include "backend/cuda/mmq_launch.cuh"

namespace dsv4::cuda::detail {

Status launch_mmq_iq2_iq1_m(GgmlType type, const MmqArgs& a, int nt, MmqMode mode, int64_t tasks,
                            cudaStream_t stream) {
  switch (type) {
    case GgmlType::IQ2_XS: return launch_mmq_type<GgmlType::IQ2_XS>(a, nt, mode, tasks, stream);
    case GgmlType::IQ2_S: return launch_mmq_type<GgmlType::IQ2_S>(a, nt, mode, tasks, stream);
    case GgmlType::IQ1_M: return launch_mmq_type<GgmlType::IQ1_M>(a, nt, mode, tasks, stream);
    default: return Status::error("mmq: weight type " + std::string(ggml_type_name(type)) + " is not IQ2_XS, IQ2_S or IQ1_M");
  }
}

}  // namespace dsv4::cuda::detail
