// Host side of mmq_kernel.cuh: one launch of the tensor-core product for a type, a column-tile
// count and a mode. The kernels are instantiated per type in mmq_<type>.cu (so they compile in
// parallel); mmq.cu and moe_experts.cu call them through launch_mmq.
#pragma once

#include <cuda_runtime.h>

#include <mutex>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/matvec_launch.cuh"
#include "backend/cuda/mmq_kernel.cuh"

namespace dsv4::cuda::detail {

// Byte alignment the blocks of a type keep (what matrix strides must be a multiple of).
int mmq_alignment(GgmlType type);
// Column tiles of 8 for `rows` activation rows: 1, 2, 4 or 8.
int mmq_column_tiles(int rows);

// Whether the stages of type T arrive by bulk copies (MmqArgs::bulk): chosen
// (KernelChoice::mmq_bulk); rows of at least 208 bytes a stage (Q8_0 272, Q6_K 210: shorter
// spans, one bulk copy each, made the Q2_K/Q3_K expert tiles of a 64-sequence step slower);
// at most 2 column tiles (16 rows; with 8 tiles the 192 small activation copies a stage cost
// Q4_K and Q6_K 11%); whole stages (k a multiple of 256: every activation run then starts
// 16-byte aligned); the activation arrays 16-byte aligned. Measurements: docs/PERFORMANCE.md,
// eighteenth run. The weight spans may start anywhere (each copy runs from the 16-byte
// boundary below a row's span to the one past it).
template <GgmlType T>
bool mmq_bulk_copies_apply(const MmqArgs& a, int nt) {
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return MmqType<T>::kStageBytes >= 208 && kernel_choice().mmq_bulk && nt <= 2 && a.k % kMmqStageK == 0 &&
         aligned(a.q) && aligned(a.d) && (a.s16 == nullptr || aligned(a.s16));
}

// `tasks` blocks along y (matrices of a batch, or the maximum number of expert tiles).
Status launch_mmq(GgmlType type, const MmqArgs& a, int nt, MmqMode mode, int64_t tasks, cudaStream_t stream);

// Per-type entry points (mmq_<type>.cu).
Status launch_mmq_q8_0(const MmqArgs& a, int nt, MmqMode mode, int64_t tasks, cudaStream_t stream);
Status launch_mmq_q2_k(const MmqArgs& a, int nt, MmqMode mode, int64_t tasks, cudaStream_t stream);
Status launch_mmq_q3_k(const MmqArgs& a, int nt, MmqMode mode, int64_t tasks, cudaStream_t stream);
Status launch_mmq_q4_k(const MmqArgs& a, int nt, MmqMode mode, int64_t tasks, cudaStream_t stream);
Status launch_mmq_q6_k(const MmqArgs& a, int nt, MmqMode mode, int64_t tasks, cudaStream_t stream);
Status launch_mmq_mxfp4(const MmqArgs& a, int nt, MmqMode mode, int64_t tasks, cudaStream_t stream);
// Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL (mmq_small_blocks.cu); Q5_K, IQ4_XS (mmq_q5_k_iq4_xs.cu);
// IQ3_XXS, IQ3_S, IQ1_S (mmq_iq3_iq1.cu); IQ2_XS, IQ2_S, IQ1_M (mmq_iq2_iq1_m.cu).
Status launch_mmq_small_blocks(GgmlType type, const MmqArgs& a, int nt, MmqMode mode, int64_t tasks,
                               cudaStream_t stream);
Status launch_mmq_q5_k_iq4_xs(GgmlType type, const MmqArgs& a, int nt, MmqMode mode, int64_t tasks,
                              cudaStream_t stream);
Status launch_mmq_iq3_iq1(GgmlType type, const MmqArgs& a, int nt, MmqMode mode, int64_t tasks, cudaStream_t stream);
Status launch_mmq_iq2_iq1_m(GgmlType type, const MmqArgs& a, int nt, MmqMode mode, int64_t tasks,
                            cudaStream_t stream);

template <GgmlType T, int NT, MmqMode M, int Ring = 0>
Status launch_mmq_kernel(const MmqArgs& a, int64_t tasks, cudaStream_t stream) {
  using S = MmqStage<T, NT, Ring>;
  auto kernel = &mmq_kernel<T, NT, M, Ring>;
  static std::once_flag once;
  static cudaError_t attribute = cudaSuccess;
  std::call_once(once, [&] {
    attribute = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmem);
  });
  DSV4_CUDA_TRY(attribute);
  if (tasks <= 0 || a.row_tiles <= 0) return Status::ok();
  if (tasks > 65535)
    return Status::error("mmq: " + std::to_string(tasks) + " tasks (matrices or expert tiles), limit 65535");
  if (a.split < 1 || a.split > kMmqMaxSplit || (M == MmqMode::kGateUp && a.split != 1))
    return Status::error("mmq: split " + std::to_string(a.split) + " not supported for this mode");
  const int64_t blocks_x = a.row_tiles * a.split;
  if (blocks_x >= (int64_t{1} << 31)) return Status::error("mmq: " + std::to_string(blocks_x) + " row tiles");
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(blocks_x), static_cast<unsigned>(tasks));
  config.blockDim = dim3(kMmqThreads);
  config.dynamicSmemBytes = static_cast<size_t>(S::kSmem);
  config.stream = stream;
  cudaLaunchAttribute attrs[2]{};
  unsigned n_attrs = 0;
  if (programmatic_launch_enabled()) {
    attrs[n_attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n_attrs].val.programmaticStreamSerializationAllowed = 1;
    ++n_attrs;
  }
  if (a.split > 1) {
    attrs[n_attrs].id = cudaLaunchAttributeClusterDimension;
    attrs[n_attrs].val.clusterDim.x = static_cast<unsigned>(a.split);
    attrs[n_attrs].val.clusterDim.y = 1;
    attrs[n_attrs].val.clusterDim.z = 1;
    ++n_attrs;
  }
  config.attrs = attrs;
  config.numAttrs = n_attrs;
  DSV4_CUDA_TRY(cudaLaunchKernelEx(&config, kernel, a));
  return Status::ok();
}

// Dense products take 1, 2, 4 or 8 column tiles; expert tiles 1 (kPlain: one tile is always
// live) or 8 (kExpertDown, kGateUp).
template <GgmlType T>
Status launch_mmq_type(const MmqArgs& args, int nt, MmqMode mode, int64_t tasks, cudaStream_t stream) {
  MmqArgs a = args;
  if constexpr (needs_iq_tables(T)) DSV4_TRY(iq_tables(&a.iq));
  a.bulk = mmq_bulk_copies_apply<T>(a, nt);
  if constexpr (MmqType<T>::kStageBytes >= 208) {
    // Bulk-copied stages in a ring of 2 (KernelChoice::mmq_bulk_ring2): 49 KB a block for
    // Q8_0 at 16 columns, so 4 blocks an SM where a ring of 3 allows 3 (a 35.6-MB product's
    // 512 blocks in one wave instead of 1.3).
    if (mode == MmqMode::kPlain && a.bulk && kernel_choice().mmq_bulk_ring2) {
      if (nt == 1) return launch_mmq_kernel<T, 1, MmqMode::kPlain, 2>(a, tasks, stream);
      if (nt == 2) return launch_mmq_kernel<T, 2, MmqMode::kPlain, 2>(a, tasks, stream);
    }
  }
  if (mode == MmqMode::kPlain) {
    switch (nt) {
      case 1: return launch_mmq_kernel<T, 1, MmqMode::kPlain>(a, tasks, stream);
      case 2: return launch_mmq_kernel<T, 2, MmqMode::kPlain>(a, tasks, stream);
      case 4: return launch_mmq_kernel<T, 4, MmqMode::kPlain>(a, tasks, stream);
      case 8: return launch_mmq_kernel<T, 8, MmqMode::kPlain>(a, tasks, stream);
      default: break;
    }
  } else if (mode == MmqMode::kExpertDown) {
    if (nt == 8) return launch_mmq_kernel<T, 8, MmqMode::kExpertDown>(a, tasks, stream);
  } else {
    switch (nt) {
      case 1: return launch_mmq_kernel<T, 1, MmqMode::kGateUp>(a, tasks, stream);
      case 8: return launch_mmq_kernel<T, 8, MmqMode::kGateUp>(a, tasks, stream);
      default: break;
    }
  }
  return Status::error("mmq: " + std::to_string(nt) + " column tiles not built for this mode");
}

}  // namespace dsv4::cuda::detail
