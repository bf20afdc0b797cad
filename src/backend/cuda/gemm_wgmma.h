// Hand-written Hopper BF16 product on the tensor cores (wgmma, sm_90a), measured beside
// cuBLASLt's (gemm_prefill.h) for prefill-size products: C[m][n] = A[m][k] · W[n][k]^T,
// A (activations) and W (weights) bf16 row-major, f32 accumulation, f32 or bf16 output.
// Tiles of 128x128x64, two warpgroups per block, operands staged in shared memory in the
// 128-byte swizzle by cp.async, three stages deep, two blocks per multiprocessor.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "util/status.h"

namespace dsv4::cuda {

inline constexpr int64_t kWgmmaTileM = 128;
inline constexpr int64_t kWgmmaTileN = 128;
inline constexpr int64_t kWgmmaTileK = 64;

// m and n multiples of 128, k a multiple of 64, pointers 16-byte aligned; otherwise
// an error Status naming the shape or the alignment.
Status gemm_wgmma_bf16(const __nv_bfloat16* a, const __nv_bfloat16* w, float* c, int64_t m, int64_t n, int64_t k,
                       cudaStream_t stream);
Status gemm_wgmma_bf16(const __nv_bfloat16* a, const __nv_bfloat16* w, __nv_bfloat16* c, int64_t m, int64_t n,
                       int64_t k, cudaStream_t stream);

}  // namespace dsv4::cuda
