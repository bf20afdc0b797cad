// Float32-mode products (MatmulMode::Float32: the production numerics' fp32 products) of a
// few activation rows with F32, BF16 or Q8_0 weights: a decode step's hyper-connection mixes
// (F32 [24, 16384], the head's [4, 16384]), router (BF16 [256, 4096]) and compressors (Q8_0
// [512..1024, 4096] in the q2k recipe), about five launches a layer. The staged exact kernel
// computes them in the CPU's order, one warp per output with one long fmaf chain per lane
// after staging x and the weight rows in shared memory (10.7 us a mix, 14.2 a compressor,
// tenth run's profile); here a block takes one output of one row, each thread a few units of
// k (4 F32 values, 8 BF16, one Q8_0 block of 32) with its loads all in flight, then a fixed
// shuffle tree (Q8_0 with k <= 4096 and 2-64 rows: blocks of 16 outputs x 8 rows with x staged
// in shared memory, the same sums). Weights decoded exactly, fp32 products and sums in this kernel's own order
// (within 1e-5 of the exact product per row, as cuBLASLt's fp32 GEMM from 65 rows); a row's
// sums depend on k only, not on the rows beside it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <span>

#include "gguf/ggml_types.h"
#include "util/status.h"

namespace dsv4::cuda {

// Rows it takes (more: cuBLASLt's fp32 GEMM, CudaBackend::matmul), in both kernel choices: a
// decode step and an MTP verify step of up to 64 rows get the same bits per row, as they did
// from the staged exact kernel (SpeculativeGreedyMatchesPlainGreedy in the quantised mode).
inline constexpr int64_t kFloat32RowsMax = 64;

// F32, BF16 or Q8_0 weights, k a multiple of the unit (4, 8, 32), rows of x 16-byte aligned
// (ldx a multiple of 4), weight rows aligned to their unit's loads (16 bytes for F32 and
// BF16, 2 for Q8_0).
bool float32_rows_applies(GgmlType type, const void* w, int64_t row_bytes, int64_t k, const float* x, int64_t ldx);

// The kernel's threads per output for k values of `type`: about four units a thread, a power
// of two from 32 to 1024, fixed by k (so a row's sums never depend on m or the other matrices).
// Thread t sums units t, t + threads, ... of its output in order, then an xor shuffle tree per
// warp and one over the warps' sums in warp order (hc_pre_norm_cluster_kernel repeats this
// order for the mixes: cuda_backend.cu).
int float32_rows_threads(GgmlType type, int64_t k);

// y[r][o] = sum_i w[o][i] x[r][i] for r < m <= kFloat32RowsMax, o < n (x, y strides in floats).
Status float32_rows_matmul(GgmlType type, const void* w, int64_t row_bytes, int64_t n, int64_t k, const float* x,
                           int64_t ldx, int64_t m, float* y, int64_t ldy, cudaStream_t stream);

// Several matrices of one type and k multiplying the same x in one launch (a layer's
// compressors and index weights, Backend::matmul_many): each output the bits of
// float32_rows_matmul with its matrix alone.
inline constexpr int kFloat32RowsMaxMatrices = 8;
struct Float32Matrix {
  const void* w = nullptr;
  int64_t row_bytes = 0, n = 0;
  float* y = nullptr;
  int64_t ldy = 0;
};
Status float32_rows_matmul_many(GgmlType type, std::span<const Float32Matrix> ms, int64_t k, const float* x,
                                int64_t ldx, int64_t m, cudaStream_t stream);

}  // namespace dsv4::cuda
