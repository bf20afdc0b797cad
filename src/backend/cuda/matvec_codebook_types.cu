// The general matvec kernel (matvec_kernel.cuh) for the codebook i-quants IQ2_XS, IQ2_S,
// IQ3_XXS, IQ3_S, IQ1_S and IQ1_M: plain products of 1-16 rows and the routed-expert passes
// (matvec_launch.cuh's MatvecCall). Their grids come from iq2_tables.cu's iq_tables.
#include <string>

#include "backend/cuda/matvec_launch.cuh"

namespace dsv4::cuda::detail {

Status matvec_codebook_types(GgmlType type, const MatvecArgs& a, const MatvecCall& c, cudaStream_t stream) {
  switch (type) {
    case GgmlType::IQ2_XS: return run_matvec_call<QuantPolicy<GgmlType::IQ2_XS>>(a, c, stream);
    case GgmlType::IQ2_S: return run_matvec_call<QuantPolicy<GgmlType::IQ2_S>>(a, c, stream);
    case GgmlType::IQ3_XXS: return run_matvec_call<QuantPolicy<GgmlType::IQ3_XXS>>(a, c, stream);
    case GgmlType::IQ3_S: return run_matvec_call<QuantPolicy<GgmlType::IQ3_S>>(a, c, stream);
    case GgmlType::IQ1_S: return run_matvec_call<QuantPolicy<GgmlType::IQ1_S>>(a, c, stream);
    case GgmlType::IQ1_M: return run_matvec_call<QuantPolicy<GgmlType::IQ1_M>>(a, c, stream);
    default: return Status::error("matvec: weight type " + std::string(ggml_type_name(type)) + " is not a codebook type");
  }
}

}  // namespace dsv4::cuda::detail
