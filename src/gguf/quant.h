// CPU arithmetic on the GGUF element types: dequantise, quantise, dot products.
// One implementation per type, shared by the converter, the loader and the CPU backend
// (and used as the reference the CUDA kernels are checked against).
// `n` is always a number of elements and a multiple of the type's block size.
// What each block's bytes mean is defined once in quant_decode.h (also compiled by nvcc);
// scalar float formats (fp16, bf16, e4m3, e8m0, e2m1) are in util/float_formats.h.
// Layouts, numerics and the comparison with ggml: docs/QUANT.md.
#pragma once

#include <cstdint>

#include "gguf/ggml_types.h"

namespace dsv4 {

// Every type with GgmlTypeTraits::supported (F32, F16, BF16, Q8_0, Q2_K..Q6_K, IQ2_XXS,
// MXFP4, I32 as integers converted to float). Bit-identical to gguf.quants.dequantize.
// A type that is not supported decodes to NaN.
void dequantize_row(GgmlType type, const void* src, float* dst, int64_t n);

// Types we can produce from f32: F32, F16, BF16, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4.
// Bit-compatible with ggml's reference quantisers (quantize_row_*_ref) where ggml has one.
// For a type without can_quantize, dst is left untouched.
bool can_quantize(GgmlType type);
void quantize_row(GgmlType type, const float* src, void* dst, int64_t n);

// Dot product of one stored row with f32 activations, accumulated in f32 with the weights
// decoded exactly: the reference numerics (the "fp32 test mode" of the fixtures).
float dot_row_f32(GgmlType type, const void* row, const float* x, int64_t n);
// The same for n_x activation rows x + r*x_stride (floats) against one weight row, decoding
// each weight block once: out[r] equals dot_row_f32(type, row, x + r*x_stride, n) bit for bit.
void dot_rows_f32(GgmlType type, const void* row, const float* x, int64_t x_stride, int64_t n_x, int64_t n,
                  float* out);

// Fast path: the activations are first quantised once per row-set (ggml's Q8_0 / Q8_K
// activation blocks) and the products run in integers. Slightly different numerics;
// used by the CPU backend's fast mode and the benchmarks. The difference to dot_row_f32 is
// bounded by the activation rounding (docs/QUANT.md). `act` holds ggml_row_bytes(act_type, n)
// bytes (n floats for F32, which quantize_activations copies and dot_row_f32 then uses).
GgmlType dot_activation_type(GgmlType weight_type);  // Q8_0, Q8_K, or F32 (no quantised path)
void quantize_activations(GgmlType act_type, const float* x, void* dst, int64_t n);
float dot_row_quantized(GgmlType weight_type, const void* row, const void* act, int64_t n);
// n_act activation rows at act + r*act_stride bytes: out[r] equals dot_row_quantized of that
// row bit for bit (the weight block is decoded once for all of them).
void dot_rows_quantized(GgmlType weight_type, const void* row, const void* act, size_t act_stride, int64_t n_act,
                        int64_t n, float* out);

}  // namespace dsv4
