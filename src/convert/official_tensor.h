// One weight of the official checkpoint, bound to its storage and decoded row by row:
// plain floats (BF16/F16/F32), FP8 E4M3 with one scale per 128x128 block (E8M0, or F32
// in the -Base releases), packed FP4 E2M1 with one E8M0 scale per 32 inputs of a row, or
// integers (tid2eid). Formats: shared/spec/checkpoint-tokenizer-chat.md §3.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "convert/checkpoint_config.h"
#include "convert/safetensors.h"
#include "gguf/ggml_types.h"
#include "gguf/quant_blocks.h"
#include "util/status.h"

namespace dsv4::convert {

enum class OfficialEncoding { Float, Fp8Blocks, Fp4Blocks, Integer };

// "layers.3.attn.wq_a.weight" -> "layers.3.attn.wq_a.scale"; names without ".weight"
// (attn_sink, ape, hc_*) have no scale.
std::optional<std::string> scale_name_of(std::string_view weight_name);

class OfficialTensor {
 public:
  // Finds `name` (and its scale when quantised) and checks dtypes and shapes against the
  // logical shape (outer-first, 1-D or 2-D; FP4 stores half as many bytes as columns) the
  // GGUF tensor needs; an Integer tensor must be I64 or I32. Errors name the checkpoint
  // file, the tensor, what was found and what was expected.
  static Result<OfficialTensor> bind(const Checkpoint& ckpt, std::string_view name,
                                     std::vector<uint64_t> shape, const CheckpointFormat& format,
                                     bool integer = false);

  // V4.1 engram.embed: FP8 [rows, dim] with E8M0 scales [rows, dim / 32].
  static Result<OfficialTensor> bind_engram_table(const Checkpoint& ckpt, std::string_view name,
                                                  std::vector<uint64_t> shape);

  const std::string& name() const { return weight_->name; }
  OfficialEncoding encoding() const { return encoding_; }
  uint64_t rows() const { return rows_; }
  uint64_t cols() const { return cols_; }

  // Rows [row0, row0 + n) as f32, exactly (every stored value is representable), n * cols.
  void decode_rows(uint64_t row0, uint64_t n, float* out) const;
  // Integer tensors: rows [row0, row0 + n) as int64, n * cols.
  void integer_rows(uint64_t row0, uint64_t n, int64_t* out) const;
  // Float tensors stored in `type` (BF16/F16/F32): the raw bytes of one row; else nullptr.
  const uint8_t* raw_row(uint64_t row, GgmlType type) const;
  // Fp4Blocks only: rows as ggml MXFP4 blocks, bit for bit the same values (cols / 32
  // blocks per row). The E8M0 byte is kept (ggml doubles the E2M1 grid and halves the
  // scale, which cancels); the nibbles move from the official pairs (2k, 2k+1) to ggml's
  // (j, j+16) order.
  void mxfp4_rows(uint64_t row0, uint64_t n, block_mxfp4* out) const;
  bool has_mxfp4_layout() const { return encoding_ == OfficialEncoding::Fp4Blocks; }
  // Fp8Blocks with one scale per (row, 32 columns) (an Engram table): the codes and the
  // scales of one row, as stored.
  const uint8_t* fp8_codes(uint64_t row) const { return weight_->data + row * row_bytes_; }
  const uint8_t* fp8_row_scales(uint64_t row) const { return scale_->data + row * scale_cols_; }

  // Drops the pages of rows [row0, row0 + n) (and, with `scale`, of the scale tensor)
  // from the resident set; see SafetensorsFile::release.
  void release_rows(const Checkpoint& ckpt, uint64_t row0, uint64_t n, bool scale) const;

 private:
  OfficialTensor() = default;
  OfficialEncoding encoding_ = OfficialEncoding::Float;
  const StTensor* weight_ = nullptr;
  const StTensor* scale_ = nullptr;
  uint64_t rows_ = 0, cols_ = 0;
  uint64_t row_bytes_ = 0;       // stored bytes of one row of `weight_`
  uint32_t block_rows_ = 128, block_cols_ = 128;  // Fp8Blocks
  uint64_t scale_cols_ = 0;      // columns of the scale tensor
  bool scale_is_e8m0_ = true;    // else F32 scales (the -Base releases)
};

}  // namespace dsv4::convert
