// Activations quantised for the integer matrix-vector kernels: per 32 consecutive values one
// f32 scale d = max|x| / 127 and int8 q = round(x / d), plus per 16 values s16 = d * sum(q)
// (the sums that carry the K-quant minimums and offsets, see quant_units.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "util/status.h"

namespace dsv4::cuda {

// Views into one buffer for `rows` rows of `k` values (k a multiple of 32).
struct QuantizedActivations {
  int8_t* q = nullptr;    // [rows][k]
  float* d = nullptr;     // [rows][k / 32]
  float* s16 = nullptr;   // [rows][k / 16]
  int64_t rows = 0;
  int64_t k = 0;
};

size_t quantized_activations_bytes(int64_t rows, int64_t k);
// Lays the views out in `buffer` (256-byte aligned, at least quantized_activations_bytes).
QuantizedActivations quantized_activations_view(void* buffer, int64_t rows, int64_t k);

// x: [rows][k] f32 on the device.
Status quantize_activations_q8(const float* x, const QuantizedActivations& out, cudaStream_t stream);

}  // namespace dsv4::cuda
