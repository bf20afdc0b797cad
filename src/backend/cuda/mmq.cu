#include "backend/cuda/mmq.h"

#include <string>

#include "backend/cuda/mmq_launch.cuh"

namespace dsv4::cuda {

namespace detail {

Status launch_mmq(GgmlType type, const MmqArgs& a, int nt, MmqMode mode, int64_t tasks, cudaStream_t stream) {
  switch (type) {
    case GgmlType::Q8_0: return launch_mmq_q8_0(a, nt, mode, tasks, stream);
    case GgmlType::Q2_K: return launch_mmq_q2_k(a, nt, mode, tasks, stream);
    case GgmlType::Q3_K: return launch_mmq_q3_k(a, nt, mode, tasks, stream);
    case GgmlType::Q4_K: return launch_mmq_q4_k(a, nt, mode, tasks, stream);
    case GgmlType::Q6_K: return launch_mmq_q6_k(a, nt, mode, tasks, stream);
    case GgmlType::MXFP4: return launch_mmq_mxfp4(a, nt, mode, tasks, stream);
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::Q5_0:
    case GgmlType::Q5_1:
    case GgmlType::IQ4_NL: return launch_mmq_small_blocks(type, a, nt, mode, tasks, stream);
    case GgmlType::Q5_K:
    case GgmlType::IQ4_XS: return launch_mmq_q5_k_iq4_xs(type, a, nt, mode, tasks, stream);
    case GgmlType::IQ3_XXS:
    case GgmlType::IQ3_S:
    case GgmlType::IQ1_S: return launch_mmq_iq3_iq1(type, a, nt, mode, tasks, stream);
    case GgmlType::IQ2_XS:
    case GgmlType::IQ2_S:
    case GgmlType::IQ1_M: return launch_mmq_iq2_iq1_m(type, a, nt, mode, tasks, stream);
    default: return Status::error("mmq: weight type " + std::string(ggml_type_name(type)) + " not supported");
  }
}

int mmq_alignment(GgmlType type) {
  switch (type) {
    case GgmlType::Q8_0: return MmqType<GgmlType::Q8_0>::kAlign;
    case GgmlType::Q2_K: return MmqType<GgmlType::Q2_K>::kAlign;
    case GgmlType::Q3_K: return MmqType<GgmlType::Q3_K>::kAlign;
    case GgmlType::Q4_K: return MmqType<GgmlType::Q4_K>::kAlign;
    case GgmlType::Q6_K: return MmqType<GgmlType::Q6_K>::kAlign;
    case GgmlType::MXFP4: return MmqType<GgmlType::MXFP4>::kAlign;
    case GgmlType::Q4_0: return MmqType<GgmlType::Q4_0>::kAlign;
    case GgmlType::Q4_1: return MmqType<GgmlType::Q4_1>::kAlign;
    case GgmlType::Q5_0: return MmqType<GgmlType::Q5_0>::kAlign;
    case GgmlType::Q5_1: return MmqType<GgmlType::Q5_1>::kAlign;
    case GgmlType::IQ4_NL: return MmqType<GgmlType::IQ4_NL>::kAlign;
    case GgmlType::Q5_K: return MmqType<GgmlType::Q5_K>::kAlign;
    case GgmlType::IQ4_XS: return MmqType<GgmlType::IQ4_XS>::kAlign;
    case GgmlType::IQ3_XXS: return MmqType<GgmlType::IQ3_XXS>::kAlign;
    case GgmlType::IQ3_S: return MmqType<GgmlType::IQ3_S>::kAlign;
    case GgmlType::IQ1_S: return MmqType<GgmlType::IQ1_S>::kAlign;
    case GgmlType::IQ2_XS: return MmqType<GgmlType::IQ2_XS>::kAlign;
    case GgmlType::IQ2_S: return MmqType<GgmlType::IQ2_S>::kAlign;
    case GgmlType::IQ1_M: return MmqType<GgmlType::IQ1_M>::kAlign;
    default: return 16;
  }
}

int mmq_column_tiles(int rows) { return rows <= 8 ? 1 : (rows <= 16 ? 2 : (rows <= 32 ? 4 : 8)); }

}  // namespace detail

bool mma_matmul_supported(GgmlType type) {
  switch (type) {
    case GgmlType::Q8_0:
    case GgmlType::Q2_K:
    case GgmlType::Q3_K:
    case GgmlType::Q4_K:
    case GgmlType::Q6_K:
    case GgmlType::MXFP4:
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::Q5_0:
    case GgmlType::Q5_1:
    case GgmlType::IQ4_NL:
    case GgmlType::Q5_K:
    case GgmlType::IQ4_XS:
    case GgmlType::IQ3_XXS:
    case GgmlType::IQ3_S:
    case GgmlType::IQ1_S:
    case GgmlType::IQ2_XS:
    case GgmlType::IQ2_S:
    case GgmlType::IQ1_M:
      return true;
    default:
      return false;
  }
}

bool mma_matmul_applies(const MatvecWeights& w, int rows) {
  if (!mma_matmul_supported(w.type) || rows < 1 || rows > kMmaMaxRows) return false;
  const auto& traits = ggml_traits(w.type);
  if (w.n <= 0 || w.k <= 0 || w.batch <= 0 || w.batch > 65535 || w.k % traits.block_elems != 0 || w.k % 32 != 0)
    return false;
  if (reinterpret_cast<uintptr_t>(w.data) % 16 != 0) return false;
  const int64_t row_bytes = w.k / traits.block_elems * traits.block_bytes;
  const int64_t stride = w.batch_stride_bytes != 0 ? w.batch_stride_bytes : row_bytes * w.n;
  return stride % detail::mmq_alignment(w.type) == 0;
}

size_t mma_matmul_workspace_bytes(const MatvecWeights& w, int rows) {
  return quantized_activations_bytes(w.batch * rows, w.k, mma_activation_layout());
}

Status mma_matmul_quantized(const MatvecWeights& w, const QuantizedActivations& x, int rows, float* y,
                            cudaStream_t stream) {
  if (!mma_matmul_applies(w, rows))
    return Status::error("mma_matmul: " + std::string(ggml_type_name(w.type)) + " batch " + std::to_string(w.batch) +
                         " x n " + std::to_string(w.n) + " x k " + std::to_string(w.k) + " with " +
                         std::to_string(rows) + " rows is not supported (mma_matmul_applies)");
  if (x.layout.unit_weights != 32 || x.layout.lanes != 1 || x.k != w.k || x.rows < w.batch * rows)
    return Status::error("mma_matmul: activations of " + std::to_string(x.rows) + " rows x " + std::to_string(x.k) +
                         " in layout {" + std::to_string(x.layout.unit_weights) + ", " +
                         std::to_string(x.layout.lanes) + "}, need " + std::to_string(w.batch * rows) + " x " +
                         std::to_string(w.k) + " in {32, 1}");
  const auto& traits = ggml_traits(w.type);
  detail::MmqArgs a;
  a.w[0] = static_cast<const uint8_t*>(w.data);
  a.row_bytes = w.k / traits.block_elems * traits.block_bytes;
  a.matrix_stride = w.batch_stride_bytes != 0 ? w.batch_stride_bytes : a.row_bytes * w.n;
  a.n = w.n;
  a.k = w.k;
  a.k_stages = static_cast<int>((w.k + detail::kMmqStageK - 1) / detail::kMmqStageK);
  a.row_tiles = (w.n + detail::kMmqTileRows - 1) / detail::kMmqTileRows;
  a.q = x.q;
  a.d = x.d;
  a.s16 = x.s16;
  a.cols_per_task = rows;
  a.out = y;
  // Enough blocks for every multiprocessor twice over: split k across a cluster when the row
  // tiles alone are fewer (each rank at least one stage).
  DSV4_ASSIGN_OR_RETURN(const int sms, detail::sm_count());
  int split = 1;
  while (split < detail::kMmqMaxSplit && a.row_tiles * w.batch * split < 2 * sms && 2 * split <= a.k_stages) split *= 2;
  a.stages_per_split = (a.k_stages + split - 1) / split;
  a.split = (a.k_stages + a.stages_per_split - 1) / a.stages_per_split;
  return detail::launch_mmq(w.type, a, detail::mmq_column_tiles(rows), detail::MmqMode::kPlain, w.batch, stream);
}

Status mma_matmul(const MatvecWeights& w, const float* x, int rows, float* y, void* workspace, size_t workspace_bytes,
                  cudaStream_t stream) {
  if (!mma_matmul_applies(w, rows))
    return Status::error("mma_matmul: " + std::string(ggml_type_name(w.type)) + " batch " + std::to_string(w.batch) +
                         " x n " + std::to_string(w.n) + " x k " + std::to_string(w.k) + " with " +
                         std::to_string(rows) + " rows is not supported (mma_matmul_applies)");
  const size_t need = mma_matmul_workspace_bytes(w, rows);
  if (workspace_bytes < need)
    return Status::error("mma_matmul: workspace of " + std::to_string(workspace_bytes) + " bytes, need " +
                         std::to_string(need));
  const QuantizedActivations q = quantized_activations_view(workspace, w.batch * rows, w.k, mma_activation_layout());
  DSV4_TRY(quantize_activations_q8(x, q, stream));
  return mma_matmul_quantized(w, q, rows, y, stream);
}

}  // namespace dsv4::cuda
