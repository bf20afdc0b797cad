// Matrix-vector and skinny matrix products (1-16 activation rows) straight from quantised
// weights, for decode: y[b][r] = W[b] · x[b][r] for every batch matrix b and row r.
// Integer types quantise the activations to Q8 (per 32 values, activation_quant.h) and use
// __dp4a; BF16 weights multiply f32 activations. Design and error bounds: docs/CUDA.md.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "gguf/ggml_types.h"
#include "util/status.h"

namespace dsv4::cuda {

// Q8_0, Q2_K, Q3_K, Q4_K, Q6_K, MXFP4, IQ2_XXS, BF16.
bool matvec_supported(GgmlType type);

// Uploads the constant tables the kernels use (IQ2_XXS's grid). Done on first use otherwise;
// call it before capturing CUDA graphs, where the upload is not allowed.
Status prepare_matvec_tables();

// Row-major weights [batch][n][k] in GGUF's block layout. The data must start 16-byte
// aligned and stay readable up to the next multiple of 16 bytes past its end (the kernel
// copies whole 16-byte chunks); matrices of a batch may start anywhere.
struct MatvecWeights {
  GgmlType type = GgmlType::Q8_0;
  const void* data = nullptr;
  int64_t n = 0;  // output features (rows)
  int64_t k = 0;  // input features, a multiple of the type's block size
  int64_t batch = 1;
  int64_t batch_stride_bytes = 0;  // 0: the matrices are contiguous
};

inline constexpr int kMatvecMaxRows = 16;

// Programmatic dependent launch for the matvec-family kernels (matvec, moe_experts,
// activation quantisation): each may start while the previous kernel in its stream finishes,
// streaming constant weights before waiting for its inputs. On by default; the environment
// variable DSV4_CUDA_PDL=0 turns it off at start. Process-wide; set it before capturing graphs.
void set_programmatic_launch(bool enabled);
bool programmatic_launch();

// Scratch for the quantised activations of batch * rows rows (0 for BF16).
size_t matvec_workspace_bytes(const MatvecWeights& w, int rows);

// x: [batch][rows][k] f32, y: [batch][rows][n] f32, device memory; 1 <= rows <= 16.
Status matvec(const MatvecWeights& w, const float* x, int rows, float* y, void* workspace, size_t workspace_bytes,
              cudaStream_t stream);

}  // namespace dsv4::cuda
