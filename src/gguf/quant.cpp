// Dispatch over element types, the plain (non-block) types, Q8_0 and MXFP4 quantisers, and
// the scalar reference paths. Block decoding lives in quant_decode.h (shared with CUDA),
// K-quant quantisers in quant_kquants.cpp, vector paths in quant_dot_*.cpp.
#include "gguf/quant.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "gguf/iq2xxs_tables.h"
#include "gguf/iq_tables.h"
#include "gguf/quant_decode.h"
#include "gguf/quant_internal.h"
#include "util/float_formats.h"

namespace dsv4 {
namespace {

using quant::decode_block;

template <typename Block>
const Block* as_blocks(const void* p) {
  return static_cast<const Block*>(p);
}

// Decodes block `b` of a row of `type` into `out` (block_elems floats). Plain types count
// as blocks of one element.
void decode_one_block(GgmlType type, const void* row, int64_t b, float* out) {
  const quant::IqTables& iq = quant::host_iq_tables();
  switch (type) {
    case GgmlType::F32: std::memcpy(out, static_cast<const float*>(row) + b, sizeof(float)); return;
    case GgmlType::F16: *out = fp16_to_f32(static_cast<const uint16_t*>(row)[b]); return;
    case GgmlType::BF16: *out = bf16_to_f32(static_cast<const uint16_t*>(row)[b]); return;
    case GgmlType::I32: {
      int32_t v;
      std::memcpy(&v, static_cast<const int32_t*>(row) + b, sizeof v);
      *out = static_cast<float>(v);
      return;
    }
    case GgmlType::Q8_0: decode_block(as_blocks<block_q8_0>(row)[b], out); return;
    case GgmlType::MXFP4: decode_block(as_blocks<block_mxfp4>(row)[b], out); return;
    case GgmlType::Q2_K: decode_block(as_blocks<block_q2_K>(row)[b], out); return;
    case GgmlType::Q3_K: decode_block(as_blocks<block_q3_K>(row)[b], out); return;
    case GgmlType::Q4_K: decode_block(as_blocks<block_q4_K>(row)[b], out); return;
    case GgmlType::Q5_K: decode_block(as_blocks<block_q5_K>(row)[b], out); return;
    case GgmlType::Q6_K: decode_block(as_blocks<block_q6_K>(row)[b], out); return;
    case GgmlType::IQ2_XXS:
      decode_block(as_blocks<block_iq2_xxs>(row)[b], out, quant::kIq2xxsGrid, quant::kIq2xxsSigns);
      return;
    case GgmlType::Q4_0: decode_block(as_blocks<block_q4_0>(row)[b], out, iq); return;
    case GgmlType::Q4_1: decode_block(as_blocks<block_q4_1>(row)[b], out, iq); return;
    case GgmlType::Q5_0: decode_block(as_blocks<block_q5_0>(row)[b], out, iq); return;
    case GgmlType::Q5_1: decode_block(as_blocks<block_q5_1>(row)[b], out, iq); return;
    case GgmlType::IQ4_NL: decode_block(as_blocks<block_iq4_nl>(row)[b], out, iq); return;
    case GgmlType::IQ4_XS: decode_block(as_blocks<block_iq4_xs>(row)[b], out, iq); return;
    case GgmlType::IQ2_XS: decode_block(as_blocks<block_iq2_xs>(row)[b], out, iq); return;
    case GgmlType::IQ2_S: decode_block(as_blocks<block_iq2_s>(row)[b], out, iq); return;
    case GgmlType::IQ3_XXS: decode_block(as_blocks<block_iq3_xxs>(row)[b], out, iq); return;
    case GgmlType::IQ3_S: decode_block(as_blocks<block_iq3_s>(row)[b], out, iq); return;
    case GgmlType::IQ1_S: decode_block(as_blocks<block_iq1_s>(row)[b], out, iq); return;
    case GgmlType::IQ1_M: decode_block(as_blocks<block_iq1_m>(row)[b], out, iq); return;
    default: break;
  }
  // Unsupported types decode to NaN so a caller that skipped the `supported` check sees it.
  const uint32_t elems = ggml_traits(type).block_elems;
  for (uint32_t i = 0; i < elems; ++i) out[i] = std::numeric_limits<float>::quiet_NaN();
}

void quantize_q8_0(const float* x, block_q8_0* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += QK8_0) {
    float amax = 0.0f;
    for (int i = 0; i < QK8_0; ++i) amax = amax > std::fabs(x[i]) ? amax : std::fabs(x[i]);
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[b].d = f32_to_fp16(d);
    // Round half away from zero (roundf), as ggml's quantize_row_q8_0_ref.
    for (int i = 0; i < QK8_0; ++i) y[b].qs[i] = static_cast<int8_t>(std::round(x[i] * id));
  }
}

// ggml's quantize_row_mxfp4_ref: the shared exponent puts the block's largest magnitude in
// the grid's top binade (floor(log2(amax)) - 2 on the doubled grid), then each element takes
// the nearest grid value (lowest code on ties).
void quantize_mxfp4(const float* x, block_mxfp4* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += QK_MXFP4) {
    float amax = 0.0f;
    for (int i = 0; i < QK_MXFP4; ++i) amax = std::fabs(x[i]) > amax ? std::fabs(x[i]) : amax;
    int e = 0;
    if (amax > 0.0f) {
      const float exponent = std::floor(std::log2(amax)) - 2.0f + 127.0f;
      e = exponent < 0.0f ? 0 : static_cast<int>(exponent);  // ggml wraps below 2^-125
    }
    y[b].e = static_cast<uint8_t>(e);
    const float d = e8m0_to_f32_half(y[b].e);
    auto nearest = [d](float v) {
      uint8_t best = 0;
      float best_err = std::fabs(0.0f * d - v);
      for (uint8_t c = 1; c < 16; ++c) {
        const float err = std::fabs(static_cast<float>(quant::mxfp4_doubled_value(c)) * d - v);
        if (err < best_err) {
          best = c;
          best_err = err;
        }
      }
      return best;
    };
    for (int j = 0; j < QK_MXFP4 / 2; ++j)
      y[b].qs[j] = static_cast<uint8_t>(nearest(x[j]) | (nearest(x[j + QK_MXFP4 / 2]) << 4));
  }
}

}  // namespace

namespace quant {

const IqTables& host_iq_tables() {
  static constexpr IqTables tables{kIq2xsGrid, kIq2sGrid, kIq3xxsGrid, kIq3sGrid, kIq1sGrid, kIq4nlValues, kIq2xxsSigns};
  return tables;
}

float dot_row_f32_scalar(GgmlType type, const void* row, const float* x, int64_t n) {
  const int64_t elems = ggml_traits(type).block_elems;
  float buf[QK_K];
  float sum = 0.0f;
  for (int64_t b = 0; b < n / elems; ++b) {
    decode_one_block(type, row, b, buf);
    for (int64_t i = 0; i < elems; ++i) sum = std::fma(buf[i], x[b * elems + i], sum);
  }
  return sum;
}

}  // namespace quant

void dequantize_row(GgmlType type, const void* src, float* dst, int64_t n) {
  if (quant::dequantize_row_vector(type, src, dst, n)) return;
  const int64_t elems = ggml_traits(type).block_elems;
  switch (type) {
    case GgmlType::F32: std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float)); return;
    case GgmlType::F16:
      for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_f32(static_cast<const uint16_t*>(src)[i]);
      return;
    case GgmlType::BF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(static_cast<const uint16_t*>(src)[i]);
      return;
    default:
      for (int64_t b = 0; b < n / elems; ++b) decode_one_block(type, src, b, dst + b * elems);
  }
}

bool can_quantize(GgmlType type) {
  switch (type) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16:
    case GgmlType::Q8_0:
    case GgmlType::Q2_K:
    case GgmlType::Q3_K:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
    case GgmlType::Q6_K:
    case GgmlType::MXFP4: return true;
    default: return false;
  }
}

void quantize_row(GgmlType type, const float* src, void* dst, int64_t n) {
  if (quant::quantize_row_vector(type, src, dst, n)) return;
  const int64_t nb = n / ggml_traits(type).block_elems;
  switch (type) {
    case GgmlType::F32: std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float)); return;
    case GgmlType::F16:
      for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = f32_to_fp16(src[i]);
      return;
    case GgmlType::BF16:
      for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = f32_to_bf16(src[i]);
      return;
    case GgmlType::Q8_0: quantize_q8_0(src, static_cast<block_q8_0*>(dst), nb); return;
    case GgmlType::MXFP4: quantize_mxfp4(src, static_cast<block_mxfp4*>(dst), nb); return;
    case GgmlType::Q2_K: quant::quantize_blocks_q2_K(src, static_cast<block_q2_K*>(dst), nb); return;
    case GgmlType::Q3_K: quant::quantize_blocks_q3_K(src, static_cast<block_q3_K*>(dst), nb); return;
    case GgmlType::Q4_K: quant::quantize_blocks_q4_K(src, static_cast<block_q4_K*>(dst), nb); return;
    case GgmlType::Q5_K: quant::quantize_blocks_q5_K(src, static_cast<block_q5_K*>(dst), nb); return;
    case GgmlType::Q6_K: quant::quantize_blocks_q6_K(src, static_cast<block_q6_K*>(dst), nb); return;
    default: return;  // not a can_quantize type: dst is left untouched
  }
}

float dot_row_f32(GgmlType type, const void* row, const float* x, int64_t n) {
  float result;
  if (quant::dot_rows_f32_vector(type, row, x, n, 1, n, &result)) return result;
  return quant::dot_row_f32_scalar(type, row, x, n);
}

void dot_rows_f32(GgmlType type, const void* row, const float* x, int64_t x_stride, int64_t n_x, int64_t n,
                  float* out) {
  if (quant::dot_rows_f32_vector(type, row, x, x_stride, n_x, n, out)) return;
  for (int64_t r = 0; r < n_x; ++r) out[r] = quant::dot_row_f32_scalar(type, row, x + r * x_stride, n);
}

}  // namespace dsv4
