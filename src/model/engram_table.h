// V4.1 Engram tables: the row format and a reader that never makes a table resident.
//
// A table (blk.L.engram_embd.weight) has `rows` rows of `dim` values. Lossless storage is
// the official FP8 row with its scales, as antirez's deepseek41 GGUF stores it: a GGML I8
// tensor [dim + dim/32, rows] whose row is dim E4M3 codes followed by dim/32 E8M0 scales
// (one per 32 values), with `<arch>.engram.encoding` = "e4m3_e8m0_32_row264" for dim 256
// (engram_row_encoding()). value[c] = e4m3(code[c]) * 2^(scale[c/32] - 127), then rounded
// to BF16 as DeepSeek's EngramEmbedding does (exact except for out-of-range products).
// A table may also be stored as any ggml type dsv4 decodes (Metrale's files use Q2_K).
//
// EngramTable reads rows from the file mapping or with pread on its own descriptor, so
// only the rows a step needs are touched (~12.7 KB per token in FP8 at full geometry).
// EngramGather hashes a step's tokens and reads their rows on a worker thread: start it
// as soon as the tokens are known and wait at the Engram layer, so the read overlaps the
// first layers. A GPU backend gathers on the host the same way and uploads
// rows_per_token() (48) rows per token, raw (row_bytes each) or as floats.
#pragma once

#include <cstdint>
#include <future>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gguf/ggml_types.h"
#include "model/engram.h"
#include "util/status.h"

namespace dsv4 {
namespace gguf { class GgufFile; struct TensorInfo; }

// Bytes of one lossless FP8 row of `dim` values: dim codes + dim/32 scales.
inline constexpr uint64_t engram_row_bytes(uint64_t dim) { return dim + dim / 32; }
// The `engram.encoding` value of that layout: "e4m3_e8m0_32_row264" for dim 256.
std::string engram_row_encoding(uint64_t dim);

// One row: dim codes then dim/32 scales, from the official weight row and scale row.
void encode_engram_fp8_row(const uint8_t* codes, const uint8_t* scales, uint32_t dim, uint8_t* row);
// The row's values as the reference uses them (BF16-rounded, held in f32). A NaN code
// or scale (0x7f/0xff, 0xff) stays NaN.
void decode_engram_fp8_row(const uint8_t* row, uint32_t dim, float* out);

class EngramTable {
 public:
  enum class Access {
    Mapped,  // read through the GgufFile's mapping (page cache; madvise for prefetch)
    Pread,   // pread on a descriptor of the part file (no mapping; fadvise for prefetch)
  };

  // `table` is engram_embd of `file` with `dim` values per row. Pread works on a file
  // opened without mapping (map_data = false) too; Mapped needs the mapping.
  static Result<EngramTable> open(const gguf::GgufFile& file, const gguf::TensorInfo& table, uint32_t dim,
                                  Access access);

  EngramTable(EngramTable&&) noexcept;
  EngramTable& operator=(EngramTable&&) noexcept;
  ~EngramTable();

  uint64_t rows() const { return rows_; }
  uint32_t dim() const { return dim_; }
  uint64_t row_bytes() const { return row_bytes_; }
  GgmlType type() const { return type_; }  // I8: the lossless FP8 rows
  Access access() const { return access_; }

  // The stored bytes of rows `ids`, row_bytes() each, in order (what a GPU uploads).
  Status read_raw(std::span<const uint32_t> ids, std::span<uint8_t> out) const;
  // The rows as floats, dim() each, in order.
  Status read(std::span<const uint32_t> ids, std::span<float> out) const;
  // Asks the kernel to bring these rows in (madvise / posix_fadvise WILLNEED, one call
  // per row): worth it ahead of a cold read, a waste of ~5 us per row on a warm table,
  // so EngramGather does not call it (its worker thread's read is the overlap).
  void prefetch(std::span<const uint32_t> ids) const;

 private:
  EngramTable() = default;
  Status check_ids(std::span<const uint32_t> ids) const;
  std::string name_;
  GgmlType type_ = GgmlType::I8;
  uint64_t rows_ = 0, row_bytes_ = 0;
  uint32_t dim_ = 0;
  Access access_ = Access::Mapped;
  const uint8_t* data_ = nullptr;  // Mapped
  int fd_ = -1;                    // Pread
  uint64_t offset_ = 0;            // of row 0 in the part file (Pread)
};

// The tables of every Engram layer (EngramConfig order), opened with one access mode.
Result<std::vector<EngramTable>> open_engram_tables(const gguf::GgufFile& file, const ModelConfig& config,
                                                    EngramTable::Access access);

// One step's rows: hash the step's tokens, read their rows in the background.
class EngramGather {
 public:
  EngramGather(const EngramHasher& hasher, std::span<const EngramTable> tables);
  ~EngramGather();

  // Hashes `tokens` after `history` (advancing it; `live` as EngramHasher::hash) and
  // starts reading their rows on a worker thread. A previous step must have been waited.
  Status start(EngramHasher::History& history, std::span<const int32_t> tokens, std::span<const uint8_t> live = {});
  // Waits for the read; then rows(layer) is [tokens][columns][dim] floats of that layer.
  Status wait();

  size_t n_tokens() const { return n_tokens_; }
  std::span<const uint32_t> row_ids() const { return ids_; }  // [token][layer][column]
  std::span<const float> rows(size_t engram_layer) const;

 private:
  Status read_all();
  const EngramHasher& hasher_;
  std::span<const EngramTable> tables_;
  size_t n_tokens_ = 0;
  std::vector<uint32_t> ids_;
  std::vector<std::vector<uint32_t>> layer_ids_;  // [layer][token * columns]
  std::vector<std::vector<float>> rows_;          // [layer][token * columns * dim]
  std::future<Status> pending_;
};

}  // namespace dsv4
