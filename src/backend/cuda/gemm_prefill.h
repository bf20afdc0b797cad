// Prefill-size products (hundreds to thousands of activation rows) on the tensor cores:
// the quantised weights are dequantised to a BF16 copy, then cuBLASLt multiplies in BF16
// with f32 accumulation and f32 output. C[m][n] = A[m][k] · W[n][k]^T.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "backend/cuda/bf16_split.h"
#include "gguf/ggml_types.h"
#include "util/status.h"

namespace dsv4::cuda {

// W [n][k] in any matvec_supported type except BF16 -> out [n][k] bf16 (the value of each
// weight as quant_decode.h defines it, rounded to bf16). Same alignment rule as matvec.
Status dequantize_to_bf16(GgmlType type, const void* w, int64_t n, int64_t k, __nv_bfloat16* out, cudaStream_t stream);

// x [rows][k] f32 -> bf16 (round to nearest even).
Status convert_f32_to_bf16(const float* x, int64_t count, __nv_bfloat16* out, cudaStream_t stream);

// cuBLASLt workspace recommended for Hopper.
inline constexpr size_t kCublasLtWorkspaceBytes = size_t{32} << 20;

// C [m][n] f32 = A [m][k] bf16 · W [n][k]^T bf16.
Status gemm_bf16(cublasLtHandle_t handle, const __nv_bfloat16* a, const __nv_bfloat16* w, float* c, int64_t m,
                 int64_t n, int64_t k, void* workspace, size_t workspace_bytes, cudaStream_t stream);

// C [m][n] f32 = A [m][k] f32 · W [n][k]^T f32 in fp32 (CUBLAS_COMPUTE_32F, no TF32), rows
// lda, ldw, ldc floats apart: MatmulMode::Float32's many-row products.
Status gemm_f32(cublasLtHandle_t handle, const float* a, int64_t lda, const float* w, int64_t ldw, float* c,
                int64_t ldc, int64_t m, int64_t n, int64_t k, void* workspace, size_t workspace_bytes,
                cudaStream_t stream);

// Float32 products on the BF16 tensor cores (bf16_split.h): x and W split into BF16 parts and
// one BF16 GEMM over `terms` * k, the part products exact and summed in f32.

// x [rows][k] f32 (rows ldx floats apart) -> out [rows][terms * k] bf16: the parts of `side`
// in the order of the terms (k a multiple of 8; out 16-byte aligned).
Status split_to_bf16(const float* x, int64_t ldx, int64_t rows, int64_t k, int terms, Bf16SplitSide side,
                     __nv_bfloat16* out, cudaStream_t stream);

// C [m][n] f32 (rows ldc apart) = the split product of A [m][terms*k] and W [n][terms*k]
// (split_to_bf16's layouts): one cuBLASLt BF16 GEMM over terms * k.
Status gemm_bf16_split(cublasLtHandle_t handle, const __nv_bfloat16* a, const __nv_bfloat16* w, float* c,
                       int64_t ldc, int64_t m, int64_t n, int64_t k, int terms, void* workspace,
                       size_t workspace_bytes, cudaStream_t stream);

// Dequantise W into `w_bf16` (n*k elements of scratch), then gemm_bf16. BF16 weights are
// used in place.
Status gemm_prefill(cublasLtHandle_t handle, GgmlType type, const void* w, int64_t n, int64_t k,
                    const __nv_bfloat16* a, int64_t m, float* c, __nv_bfloat16* w_bf16, void* workspace,
                    size_t workspace_bytes, cudaStream_t stream);

}  // namespace dsv4::cuda
