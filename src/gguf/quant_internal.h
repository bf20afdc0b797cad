// Per-type entry points behind quant.h's dispatchers (not part of the public API).
#pragma once

#include <cstdint>

#include "gguf/ggml_types.h"
#include "gguf/quant_blocks.h"
#include "gguf/quant_decode.h"

namespace dsv4::quant {

// The i-quant codebooks of iq_tables.h / iq2xxs_tables.h (quant.cpp).
const IqTables& host_iq_tables();

// quant_kquants.cpp: ggml's reference K-quant quantisers (quantize_row_q*_K_ref), `nb` blocks.
void quantize_blocks_q2_K(const float* x, block_q2_K* y, int64_t nb);
void quantize_blocks_q3_K(const float* x, block_q3_K* y, int64_t nb);
void quantize_blocks_q4_K(const float* x, block_q4_K* y, int64_t nb);
void quantize_blocks_q5_K(const float* x, block_q5_K* y, int64_t nb);
void quantize_blocks_q6_K(const float* x, block_q6_K* y, int64_t nb);

// quant_avx2.cpp: AVX2 block decoders and weight-times-f32 dot products; false when `type`
// has no vector path on this machine (the caller then uses the scalar reference).
// Rows of activations x + r*x_stride (r < n_x) against one weight row, into out[r].
bool dot_rows_f32_vector(GgmlType type, const void* row, const float* x, int64_t x_stride, int64_t n_x, int64_t n,
                         float* out);
bool dequantize_row_vector(GgmlType type, const void* src, float* dst, int64_t n);
// Integer dot products against Q8_0 / Q8_K activations (quant_dot_int.cpp is the fallback).
// Activation rows at act + r*act_stride bytes (r < n_act).
bool dot_rows_quantized_vector(GgmlType type, const void* row, const void* act, size_t act_stride, int64_t n_act,
                               int64_t n, float* out);
// Byte-identical vector versions of quantisers (Q8_0, F16).
bool quantize_row_vector(GgmlType type, const float* src, void* dst, int64_t n);
bool quantize_q8_K_vector(const float* src, block_q8_K* dst, int64_t n);  // same bytes as the portable one

// The scalar reference dot product: decode one block into a stack buffer, f32 FMA.
float dot_row_f32_scalar(GgmlType type, const void* row, const float* x, int64_t n);

// quant_dot_int.cpp: the portable integer dot and Q8_K quantiser (what runs without AVX2;
// the tests hold the vector versions to them).
float dot_row_quantized_scalar(GgmlType weight_type, const void* row, const void* act, int64_t n);
void quantize_q8_K_scalar(const float* x, block_q8_K* y, int64_t n);

}  // namespace dsv4::quant
