// Products of quantised weights with 1-64 activation rows on the int8 tensor cores:
// y[b][r] = W[b] . x[b][r], the weights decoded from their GGUF blocks inside the kernel
// (mmq_kernel.cuh), the activations quantised to Q8 blocks of 32 (activation_quant.h, row-major
// layout {32, 1}), int32 products of each 32 exact, f32 accumulation. matvec() (matvec.h)
// takes this path for 2-64 rows by default; the function is public for direct use and for
// measurements beside the dp4a kernels. Design, bounds and error analysis: docs/CUDA.md.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "backend/cuda/activation_quant.h"
#include "backend/cuda/matvec.h"
#include "util/status.h"

namespace dsv4::cuda {

inline constexpr int kMmaMaxRows = 64;

// Q8_0, Q2_K, Q3_K, Q4_K, Q6_K, MXFP4.
bool mma_matmul_supported(GgmlType type);

// Whether mma_matmul takes these weights: a supported type, rows in 1..64, k a multiple of the
// type's block, data 16-byte aligned, matrices of a batch starting at the alignment the
// type's blocks keep (Q2_K, Q4_K: 4 bytes; Q8_0, Q3_K, Q6_K: 2; MXFP4: 1), batch <= 65535.
bool mma_matmul_applies(const MatvecWeights& w, int rows);

// The activation layout of these kernels ({32 weights per unit, 1 lane}: row-major).
inline ActivationLayout mma_activation_layout() { return {32, 1}; }

// Scratch for the quantised activations of batch * rows rows.
size_t mma_matmul_workspace_bytes(const MatvecWeights& w, int rows);

// x: [batch][rows][k] f32, y: [batch][rows][n] f32, device memory. Same weight buffer rule as
// matvec (16-byte aligned start, readable to the next 16-byte boundary past the end).
Status mma_matmul(const MatvecWeights& w, const float* x, int rows, float* y, void* workspace, size_t workspace_bytes,
                  cudaStream_t stream);

// The same with activations already quantised (quantize_activations_q8 with
// mma_activation_layout(), batch * rows rows of w.k values).
Status mma_matmul_quantized(const MatvecWeights& w, const QuantizedActivations& x, int rows, float* y,
                            cudaStream_t stream);

}  // namespace dsv4::cuda
