// Host side of matvec_kernel.cuh: sizes the shared-memory stages for a shape and launches a
// persistent grid. Included by the .cu files that own an operation (matvec.cu, moe_experts.cu).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "backend/cuda/activation_quant.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/matvec.h"
#include "backend/cuda/matvec_kernel.cuh"

namespace dsv4::cuda::detail {

// ggml's IQ2_XXS grid and sign tables in device memory (iq2_tables.cu).
Status iq2_tables(const uint64_t** grid, const uint8_t** signs);
// The other i-quants' codebooks (iq_tables.h) in device memory (iq2_tables.cu).
Status iq_tables(quant::IqTables* out);

// Whether matvec-family kernels launch with programmatic dependent launch (default on;
// environment DSV4_CUDA_PDL=0 or set_programmatic_launch(false) turns it off).
bool programmatic_launch_enabled();

// Weights per wide unit of a type's kernels (the policies' kUnitWeights; matvec.cu).
int unit_weights(GgmlType type);

// BF16 products through matvec_bf16.cu: k a multiple of 8 and 16-byte aligned matrices.
bool bf16_streaming_applies(const MatvecWeights& w);
// x 16-byte aligned; 1 <= rows <= 16.
Status matvec_bf16(const MatvecWeights& w, const float* x, int rows, float* y, cudaStream_t stream);

// Lanes that share one row of k values: enough for one unit each, at most a warp.
inline int lanes_per_row(int64_t k, int unit_weights) {
  const int64_t units = (k + unit_weights - 1) / unit_weights;
  int lanes = 1;
  while (lanes < 32 && lanes < units) lanes *= 2;
  return lanes;
}

// How the kernels for `type` want rows of k quantised activations laid out.
inline ActivationLayout activation_layout(GgmlType type, int64_t k) {
  return {unit_weights(type), lanes_per_row(k, unit_weights(type))};
}

inline Result<int> sm_count() {
  static int count = 0;
  if (count == 0) {
    int dev = 0;
    DSV4_CUDA_TRY(cudaGetDevice(&dev));
    DSV4_CUDA_TRY(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev));
  }
  return count;
}

// Bytes of weights one warp stages per group: enough to keep ~2 groups in flight per warp
// at ~16 warps per multiprocessor, well over the bandwidth-latency product.
inline constexpr int64_t kGroupTargetBytes = 4096;
inline constexpr int kMaxSharedBytes = 227 * 1024;

// `sources`: matrices read per group (1, 2 for gate+up, top_k for the summed down product);
// `max_tasks`: an upper bound on the tasks (the exact count may live on the device).
// `Kernel`: the general kernel, or one with the same arguments and stages (matvec_row_kernel.cuh).
// `min_rows`: rows per group the kernel wants at least (shared memory and n permitting).
using MatvecKernelFn = void (*)(MatvecArgs);
template <class Policy, int NR, MatvecMode M, MatvecKernelFn Kernel>
Status launch_matvec_kernel(MatvecArgs a, int sources, int64_t max_tasks, cudaStream_t stream, int64_t min_rows = 1) {
  if (a.n <= 0 || max_tasks <= 0) return Status::ok();
  a.units_per_row = static_cast<int>((a.act.k + Policy::kUnitWeights - 1) / Policy::kUnitWeights);
  a.lanes_per_row = lanes_per_row(a.act.k, Policy::kUnitWeights);
  if (a.act.q != nullptr && (a.act.unit_weights != Policy::kUnitWeights || a.act.lanes != a.lanes_per_row))
    return Status::error("matvec: activations laid out for units of " + std::to_string(a.act.unit_weights) + " x " +
                         std::to_string(a.act.lanes) + " lanes, kernel wants " + std::to_string(Policy::kUnitWeights) +
                         " x " + std::to_string(a.lanes_per_row));
  a.act.lanes = a.lanes_per_row;  // f32 activations are row-major: any lane split reads them
  a.act.subunits_per_row = static_cast<int>(a.act.k / 32);
  int64_t rows = std::max<int64_t>(1, kGroupTargetBytes / (sources * a.row_bytes));
  rows = std::max<int64_t>({rows, 32 / a.lanes_per_row, min_rows});  // a pass of the warp fills every lane
  const int64_t per_stage = (kMaxSharedBytes - kIq2TableBytes - a.act_smem_bytes) / (kWarpsPerBlock * kStages);
  rows = std::min({rows, std::max<int64_t>(1, (per_stage / sources - 48) / a.row_bytes), a.n});
  a.rows_per_group = static_cast<int>(rows);
  a.row_blocks = (a.n + rows - 1) / rows;
  a.segment_stride = static_cast<int>((rows * a.row_bytes + 15 + 15) / 16 * 16 + 16);
  a.stage_bytes = sources * a.segment_stride;
  const int64_t smem =
      (Policy::kIq2 ? kIq2TableBytes : 0) + int64_t{kWarpsPerBlock} * kStages * a.stage_bytes + a.act_smem_bytes;
  if (smem > kMaxSharedBytes)
    return Status::error("matvec: rows of " + std::to_string(a.row_bytes) + " bytes x " + std::to_string(sources) +
                         " sources need " + std::to_string(smem) + " bytes of shared memory, limit " +
                         std::to_string(kMaxSharedBytes));
  if constexpr (Policy::kIq2) DSV4_TRY(iq2_tables(&a.iq2_grid, &a.iq2_signs));
  if constexpr (Policy::kIqTables) DSV4_TRY(iq_tables(&a.iq));

  auto kernel = Kernel;
  static int64_t attribute_bytes = -1;  // per instantiation
  static int64_t occupancy_bytes = -1;
  static int blocks_per_sm = 0;
  if (smem > attribute_bytes) {
    DSV4_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    attribute_bytes = smem;
  }
  if (smem != occupancy_bytes) {
    DSV4_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, kWarpsPerBlock * 32,
                                                                static_cast<size_t>(smem)));
    occupancy_bytes = smem;
  }
  DSV4_ASSIGN_OR_RETURN(const int sms, sm_count());
  const int64_t groups = max_tasks * a.row_blocks;
  if (groups >= (int64_t{1} << 31))
    return Status::error("matvec: " + std::to_string(groups) + " row groups, limit 2^31");
  const int64_t wanted = (groups + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(wanted, int64_t{sms} * std::max(blocks_per_sm, 1)));
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(grid));
  config.blockDim = dim3(kWarpsPerBlock * 32);
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  cudaLaunchAttribute pdl{};
  pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl.val.programmaticStreamSerializationAllowed = 1;
  if (programmatic_launch_enabled()) {
    config.attrs = &pdl;
    config.numAttrs = 1;
  }
  DSV4_CUDA_TRY(cudaLaunchKernelEx(&config, kernel, a));
  return Status::ok();
}

template <class Policy, int NR, MatvecMode M>
Status launch_matvec(MatvecArgs a, int sources, int64_t max_tasks, cudaStream_t stream) {
  return launch_matvec_kernel<Policy, NR, M, &matvec_kernel<Policy, NR, M>>(a, sources, max_tasks, stream);
}

// Rows of an expert tile on the batched routed-expert path (moe_experts.cu).
inline constexpr int kExpertTileRows = 8;

// One product of the general kernel: a plain matvec of `rows` activation rows, or a
// routed-expert gate/up or down pass (decode: one pair or token per task; else tiles).
enum class MatvecOp { kPlain, kGateUp, kDown };
struct MatvecCall {
  MatvecOp op = MatvecOp::kPlain;
  int rows = 1;          // kPlain
  bool decode = false;   // expert ops
  int64_t tasks = 0;     // expert ops: pairs, tokens or the tile bound
};

template <class Policy>
Status run_matvec_call(const MatvecArgs& a, const MatvecCall& c, cudaStream_t stream) {
  if (c.op == MatvecOp::kPlain) {
    const int64_t tasks = a.n_tasks;
    if (c.rows <= 1) return launch_matvec<Policy, 1, MatvecMode::kPlain>(a, 1, tasks, stream);
    if (c.rows <= 2) return launch_matvec<Policy, 2, MatvecMode::kPlain>(a, 1, tasks, stream);
    if (c.rows <= 4) return launch_matvec<Policy, 4, MatvecMode::kPlain>(a, 1, tasks, stream);
    if (c.rows <= 8) return launch_matvec<Policy, 8, MatvecMode::kPlain>(a, 1, tasks, stream);
    return launch_matvec<Policy, 16, MatvecMode::kPlain>(a, 1, tasks, stream);
  }
  if (c.op == MatvecOp::kGateUp) {
    if (c.decode) return launch_matvec<Policy, 1, MatvecMode::kGateUp>(a, 2, c.tasks, stream);
    return launch_matvec<Policy, kExpertTileRows, MatvecMode::kGateUp>(a, 2, c.tasks, stream);
  }
  if (c.decode) return launch_matvec<Policy, 1, MatvecMode::kDownSum>(a, a.top_k, c.tasks, stream);
  return launch_matvec<Policy, kExpertTileRows, MatvecMode::kDownTiled>(a, 1, c.tasks, stream);
}

// The types added for published files, compiled apart so that no one file holds every
// kernel: Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q5_K, IQ4_XS (matvec_nibble_types.cu) and IQ2_XS, IQ2_S,
// IQ3_XXS, IQ3_S, IQ1_S, IQ1_M (matvec_codebook_types.cu). run_added_types picks the file.
Status matvec_nibble_types(GgmlType type, const MatvecArgs& a, const MatvecCall& c, cudaStream_t stream);
Status matvec_codebook_types(GgmlType type, const MatvecArgs& a, const MatvecCall& c, cudaStream_t stream);
bool is_added_type(GgmlType type);
Status run_added_types(GgmlType type, const MatvecArgs& a, const MatvecCall& c, cudaStream_t stream);

}  // namespace dsv4::cuda::detail
