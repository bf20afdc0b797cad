// Activations quantised for the integer matrix-vector kernels: per 32 consecutive values one
// f32 scale d = max|x| / 127 and int8 q = round-half-even(x * (127 / max|x|)) (q8_block.cuh),
// plus per 16 values s16 = d * sum(q) (the sums that carry the K-quant minimums and offsets,
// quant_units.cuh).
//
// Layout: the kernels give lane l of a row's lane group the wide units l, l + L, l + 2L, ...
// (L lanes per row, W weights per unit). The values are stored interleaved so that those
// lanes read consecutive 16-byte chunks: chunk c (16 values) of unit u = t*L + l sits at
// ((t * W/16 + c) * L + l) * 16 in the row, and the d / s16 of its 32-value part s at
// (t * W/32 + s) * L + l. Rows are padded to whole groups of L units (`padded_k` values).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "util/status.h"

namespace dsv4::cuda {

struct ActivationLayout {
  int unit_weights = 32;  // W: a multiple of 32
  int lanes = 1;          // L: a power of two up to 32 (1: plain row-major order)
};

// Values per stored row: k rounded up to whole groups of `lanes` units.
int64_t padded_row_values(int64_t k, const ActivationLayout& layout);

struct QuantizedActivations {
  int8_t* q = nullptr;    // [rows][padded_k]
  float* d = nullptr;     // [rows][padded_k / 32]
  float* s16 = nullptr;   // [rows][padded_k / 32][2]
  int64_t rows = 0;
  int64_t k = 0;
  int64_t padded_k = 0;
  ActivationLayout layout;
};

size_t quantized_activations_bytes(int64_t rows, int64_t k, const ActivationLayout& layout);
// Lays the views out in `buffer` (256-byte aligned, at least quantized_activations_bytes).
QuantizedActivations quantized_activations_view(void* buffer, int64_t rows, int64_t k, const ActivationLayout& layout);

// x: [rows][k] f32 on the device, k a multiple of 32.
Status quantize_activations_q8(const float* x, const QuantizedActivations& out, cudaStream_t stream);

}  // namespace dsv4::cuda
