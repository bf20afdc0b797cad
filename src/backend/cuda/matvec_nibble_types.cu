// The general matvec kernel (matvec_kernel.cuh) for Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q5_K and
// IQ4_XS:
// plain products of 1-16 rows and the routed-expert passes (matvec_launch.cuh's MatvecCall).
#include <string>

#include "backend/cuda/matvec_launch.cuh"

namespace dsv4::cuda::detail {

Status matvec_nibble_types(GgmlType type, const MatvecArgs& a, const MatvecCall& c, cudaStream_t stream) {
  switch (type) {
    case GgmlType::Q4_0: return run_matvec_call<QuantPolicy<GgmlType::Q4_0>>(a, c, stream);
    case GgmlType::Q4_1: return run_matvec_call<QuantPolicy<GgmlType::Q4_1>>(a, c, stream);
    case GgmlType::Q5_0: return run_matvec_call<QuantPolicy<GgmlType::Q5_0>>(a, c, stream);
    case GgmlType::Q5_1: return run_matvec_call<QuantPolicy<GgmlType::Q5_1>>(a, c, stream);
    case GgmlType::IQ4_NL: return run_matvec_call<QuantPolicy<GgmlType::IQ4_NL>>(a, c, stream);
    case GgmlType::Q5_K: return run_matvec_call<QuantPolicy<GgmlType::Q5_K>>(a, c, stream);
    case GgmlType::IQ4_XS: return run_matvec_call<QuantPolicy<GgmlType::IQ4_XS>>(a, c, stream);
    default: return Status::error("matvec: weight type " + std::string(ggml_type_name(type)) + " is not a nibble type");
  }
}

}  // namespace dsv4::cuda::detail
