#include "convert/official_tensor.h"

#include <cstring>

#include "gguf/quant.h"
#include "util/float_formats.h"

namespace dsv4::convert {
namespace {

std::string shape_str(const std::vector<uint64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

std::string where(const Checkpoint& ckpt, const StTensor& t) {
  return fmt::format("{}: tensor {}", ckpt.files().at(t.file_index).path().string(), t.name);
}

Status expect_shape(const Checkpoint& ckpt, const StTensor& t, const std::vector<uint64_t>& want) {
  if (t.shape == want) return Status::ok();
  return Status::errorf("{}: shape {}, expected {}", where(ckpt, t), t.shape_string(), shape_str(want));
}

Status expect_dtype(const Checkpoint& ckpt, const StTensor& t, std::initializer_list<StDtype> allowed,
                    std::string_view what) {
  for (StDtype d : allowed)
    if (t.dtype == d) return Status::ok();
  std::string names;
  for (StDtype d : allowed) names += (names.empty() ? "" : " or ") + std::string(st_dtype_name(d));
  return Status::errorf("{}: dtype {}, expected {} ({})", where(ckpt, t), st_dtype_name(t.dtype), names, what);
}

float load_f32(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}
uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

}  // namespace

std::optional<std::string> scale_name_of(std::string_view weight_name) {
  constexpr std::string_view kSuffix = ".weight";
  if (weight_name.size() <= kSuffix.size() || !weight_name.ends_with(kSuffix)) return std::nullopt;
  return std::string(weight_name.substr(0, weight_name.size() - kSuffix.size())) + ".scale";
}

Result<OfficialTensor> OfficialTensor::bind(const Checkpoint& ckpt, std::string_view name,
                                            std::vector<uint64_t> shape, const CheckpointFormat& format,
                                            bool integer) {
  const StTensor* w = ckpt.find(name);
  if (!w)
    return Status::errorf("{}: tensor {} is missing (expected shape {})", ckpt.dir().string(), name,
                          shape_str(shape));
  OfficialTensor t;
  t.weight_ = w;
  t.cols_ = shape.empty() ? 1 : shape.back();
  t.rows_ = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) t.rows_ *= shape[i];

  if (integer) {
    DSV4_TRY(expect_dtype(ckpt, *w, {StDtype::I64, StDtype::I32}, "expert ids"));
    DSV4_TRY(expect_shape(ckpt, *w, shape));
    t.encoding_ = OfficialEncoding::Integer;
  } else if (w->dtype == StDtype::F8_E4M3 || w->dtype == StDtype::I8 || w->dtype == StDtype::U8) {
    const auto scale_name = scale_name_of(name);
    const StTensor* s = scale_name ? ckpt.find(*scale_name) : nullptr;
    if (!s)
      return Status::errorf("{}: {} weight without its scale tensor {}", where(ckpt, *w),
                            st_dtype_name(w->dtype), scale_name.value_or("(none)"));
    t.scale_ = s;
    t.scale_is_e8m0_ = s->dtype == StDtype::F8_E8M0;
    DSV4_TRY(expect_dtype(ckpt, *s, {StDtype::F8_E8M0, StDtype::F32}, "scales"));
    if (shape.size() != 2)
      return Status::errorf("{}: a quantised weight where a {}-D tensor {} is expected", where(ckpt, *w),
                            shape.size(), shape_str(shape));
    if (w->dtype == StDtype::F8_E4M3) {
      t.encoding_ = OfficialEncoding::Fp8Blocks;
      t.block_rows_ = format.fp8_block_rows;
      t.block_cols_ = format.fp8_block_cols;
      DSV4_TRY(expect_shape(ckpt, *w, shape));
      DSV4_TRY(expect_shape(ckpt, *s, {ceil_div(shape[0], t.block_rows_), ceil_div(shape[1], t.block_cols_)}));
    } else {
      t.encoding_ = OfficialEncoding::Fp4Blocks;
      if (!t.scale_is_e8m0_)
        return Status::errorf("{}: FP4 weight with {} scales; FP4 blocks take E8M0 scales", where(ckpt, *w),
                              st_dtype_name(s->dtype));
      if (shape[1] % 32 != 0)
        return Status::errorf("{}: FP4 weight of {} columns; FP4 blocks need a multiple of 32",
                              where(ckpt, *w), shape[1]);
      DSV4_TRY(expect_shape(ckpt, *w, {shape[0], shape[1] / 2}));
      DSV4_TRY(expect_shape(ckpt, *s, {shape[0], shape[1] / 32}));
    }
    t.scale_cols_ = s->shape[1];
  } else {
    DSV4_TRY(expect_dtype(ckpt, *w, {StDtype::BF16, StDtype::F16, StDtype::F32}, "a float weight"));
    DSV4_TRY(expect_shape(ckpt, *w, shape));
    t.encoding_ = OfficialEncoding::Float;
  }
  t.row_bytes_ = t.rows_ == 0 ? 0 : w->nbytes / t.rows_;
  return t;
}

Result<OfficialTensor> OfficialTensor::bind_engram_table(const Checkpoint& ckpt, std::string_view name,
                                                        std::vector<uint64_t> shape) {
  const StTensor* w = ckpt.find(name);
  if (!w)
    return Status::errorf("{}: tensor {} is missing (expected shape {})", ckpt.dir().string(), name, shape_str(shape));
  const auto scale_name = scale_name_of(name);
  const StTensor* s = scale_name ? ckpt.find(*scale_name) : nullptr;
  if (!s) return Status::errorf("{}: Engram table without its scale tensor {}", where(ckpt, *w), scale_name.value_or("(none)"));
  if (shape.size() != 2 || shape[1] % 32 != 0)
    return Status::errorf("{}: an Engram table of shape {}; rows must hold a multiple of 32 values", where(ckpt, *w),
                          shape_str(shape));
  DSV4_TRY(expect_dtype(ckpt, *w, {StDtype::F8_E4M3}, "FP8 Engram rows"));
  DSV4_TRY(expect_dtype(ckpt, *s, {StDtype::F8_E8M0}, "one scale per 32 values of a row"));
  DSV4_TRY(expect_shape(ckpt, *w, shape));
  DSV4_TRY(expect_shape(ckpt, *s, {shape[0], shape[1] / 32}));
  OfficialTensor t;
  t.weight_ = w;
  t.scale_ = s;
  t.encoding_ = OfficialEncoding::Fp8Blocks;
  t.rows_ = shape[0];
  t.cols_ = shape[1];
  t.block_rows_ = 1;
  t.block_cols_ = 32;
  t.scale_cols_ = s->shape[1];
  t.row_bytes_ = t.cols_;
  return t;
}

void OfficialTensor::decode_rows(uint64_t row0, uint64_t n, float* out) const {
  const uint8_t* base = weight_->data;
  for (uint64_t r = row0; r < row0 + n; ++r, out += cols_) {
    const uint8_t* row = base + r * row_bytes_;
    switch (encoding_) {
      case OfficialEncoding::Float:
        if (weight_->dtype == StDtype::BF16)
          for (uint64_t c = 0; c < cols_; ++c) out[c] = bf16_to_f32(load_u16(row + 2 * c));
        else if (weight_->dtype == StDtype::F16)
          for (uint64_t c = 0; c < cols_; ++c) out[c] = fp16_to_f32(load_u16(row + 2 * c));
        else
          std::memcpy(out, row, cols_ * 4);
        break;
      case OfficialEncoding::Fp8Blocks: {
        const uint64_t srow = r / block_rows_;
        for (uint64_t c = 0; c < cols_; ++c) {
          const uint64_t si = srow * scale_cols_ + c / block_cols_;
          const float scale = scale_is_e8m0_ ? e8m0_to_f32(scale_->data[si]) : load_f32(scale_->data + 4 * si);
          out[c] = e4m3_to_f32(row[c]) * scale;
        }
        break;
      }
      case OfficialEncoding::Fp4Blocks: {
        // Through ggml's MXFP4 decoder: the one E2M1 decoder, and the values the lossless
        // MXFP4 output decodes to.
        std::vector<block_mxfp4> blocks(cols_ / QK_MXFP4);
        mxfp4_rows(r, 1, blocks.data());
        dequantize_row(GgmlType::MXFP4, blocks.data(), out, static_cast<int64_t>(cols_));
        break;
      }
      case OfficialEncoding::Integer: {
        for (uint64_t c = 0; c < cols_; ++c) {
          int64_t v;
          if (weight_->dtype == StDtype::I64) {
            std::memcpy(&v, row + 8 * c, 8);
          } else {
            int32_t v32;
            std::memcpy(&v32, row + 4 * c, 4);
            v = v32;
          }
          out[c] = static_cast<float>(v);
        }
        break;
      }
    }
  }
}

void OfficialTensor::integer_rows(uint64_t row0, uint64_t n, int64_t* out) const {
  for (uint64_t r = row0; r < row0 + n; ++r) {
    const uint8_t* row = weight_->data + r * row_bytes_;
    for (uint64_t c = 0; c < cols_; ++c, ++out) {
      if (weight_->dtype == StDtype::I64) {
        std::memcpy(out, row + 8 * c, 8);
      } else {
        int32_t v32;
        std::memcpy(&v32, row + 4 * c, 4);
        *out = v32;
      }
    }
  }
}

const uint8_t* OfficialTensor::raw_row(uint64_t row, GgmlType type) const {
  if (encoding_ != OfficialEncoding::Float) return nullptr;
  const bool same = (type == GgmlType::BF16 && weight_->dtype == StDtype::BF16) ||
                    (type == GgmlType::F16 && weight_->dtype == StDtype::F16) ||
                    (type == GgmlType::F32 && weight_->dtype == StDtype::F32);
  return same ? weight_->data + row * row_bytes_ : nullptr;
}

void OfficialTensor::mxfp4_rows(uint64_t row0, uint64_t n, block_mxfp4* out) const {
  const uint64_t blocks = cols_ / QK_MXFP4;
  for (uint64_t r = row0; r < row0 + n; ++r) {
    const uint8_t* row = weight_->data + r * row_bytes_;
    const uint8_t* scales = scale_->data + r * scale_cols_;
    for (uint64_t b = 0; b < blocks; ++b, ++out) {
      uint8_t codes[QK_MXFP4];
      const uint8_t* packed = row + b * (QK_MXFP4 / 2);
      for (int k = 0; k < QK_MXFP4 / 2; ++k) {
        codes[2 * k] = packed[k] & 0x0F;
        codes[2 * k + 1] = packed[k] >> 4;
      }
      out->e = scales[b];
      for (int j = 0; j < QK_MXFP4 / 2; ++j)
        out->qs[j] = static_cast<uint8_t>(codes[j] | (codes[j + QK_MXFP4 / 2] << 4));
    }
  }
}

void OfficialTensor::release_rows(const Checkpoint& ckpt, uint64_t row0, uint64_t n, bool scale) const {
  ckpt.files().at(weight_->file_index).release({weight_->data + row0 * row_bytes_, n * row_bytes_});
  if (scale && scale_) ckpt.release(*scale_);
}

}  // namespace dsv4::convert
