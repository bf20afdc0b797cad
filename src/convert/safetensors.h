// Reading safetensors files and Hugging Face checkpoints made of them, memory-mapped.
//
// A safetensors file is an 8-byte little-endian header length, a JSON header mapping each
// tensor name to {dtype, shape, data_offsets [begin, end)} (offsets relative to the end of
// the header) plus an optional "__metadata__" object of strings, then the raw row-major
// little-endian data. SafetensorsFile::open validates all of it (lengths, JSON, dtypes,
// shapes against byte ranges, ranges inside the file, no overlaps) before returning; every
// malformed input is a Status naming the file, the tensor and the offending value.
// Tensor data is never copied: StTensor::data points into the mapping.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "util/status.h"

namespace dsv4::convert {

// The dtype strings of the safetensors format.
enum class StDtype : uint8_t {
  BOOL, U8, I8, U16, I16, U32, I32, U64, I64, F16, BF16, F32, F64,
  F8_E4M3, F8_E5M2, F8_E8M0,
};

std::string_view st_dtype_name(StDtype dtype);  // "BF16", "F8_E4M3", ...
std::optional<StDtype> st_dtype_from_name(std::string_view name);
uint32_t st_dtype_size(StDtype dtype);          // bytes per element

struct StTensor {
  std::string name;
  StDtype dtype = StDtype::F32;
  std::vector<uint64_t> shape;     // outer-first, as in the file ([out, in] for a linear)
  uint64_t nbytes = 0;
  const uint8_t* data = nullptr;   // into the memory mapping
  uint32_t file_index = 0;         // which file of a Checkpoint holds it

  uint64_t n_elements() const;
  std::span<const uint8_t> bytes() const { return {data, nbytes}; }
  std::string shape_string() const;  // "[512, 4096]"
};

class SafetensorsFile {
 public:
  // `file_index` is stored in each StTensor (a Checkpoint's position of this file).
  static Result<SafetensorsFile> open(const std::filesystem::path& path, uint32_t file_index = 0);
  // The same validation on a copy of `bytes` (fuzz targets, tests); `name` stands in for
  // the path in messages. release() is a no-op on such a file.
  static Result<SafetensorsFile> open_bytes(std::string name, std::span<const uint8_t> bytes,
                                            uint32_t file_index = 0);

  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::filesystem::path& path() const;
  uint64_t file_bytes() const;
  const std::vector<StTensor>& tensors() const;  // in data order
  const StTensor* find(std::string_view name) const;
  const std::map<std::string, std::string>& metadata() const;  // "__metadata__"

  // Drops the pages of `bytes` (which must lie in this file) from this process's resident
  // set; they stay in the page cache and are read back on the next access. Streaming a
  // checkpoint calls this after each tensor so the resident memory does not grow with the
  // model.
  void release(std::span<const uint8_t> bytes) const;

 private:
  struct Impl;
  explicit SafetensorsFile(std::unique_ptr<Impl> impl);
  // The one parser behind open() and open_bytes(): validates impl->map and fills impl.
  static Result<SafetensorsFile> parse(std::unique_ptr<Impl> impl, uint32_t file_index);
  std::unique_ptr<Impl> impl_;
};

// A checkpoint folder: `model.safetensors.index.json` (HF sharded form: metadata.total_size
// and weight_map name -> shard) and the shards it names, or, without an index, the single
// `model.safetensors`. Every name the index lists must be in the shard it names.
class Checkpoint {
 public:
  static Result<Checkpoint> open(const std::filesystem::path& dir);

  Checkpoint(Checkpoint&&) noexcept;
  Checkpoint& operator=(Checkpoint&&) noexcept;
  ~Checkpoint();

  const std::filesystem::path& dir() const;
  const std::vector<SafetensorsFile>& files() const;
  uint64_t data_bytes() const;  // all tensor bytes of all files

  // All tensors by name (sorted); find() is nullptr for a name not in the checkpoint.
  const std::map<std::string, const StTensor*, std::less<>>& tensors() const;
  const StTensor* find(std::string_view name) const;

  void release(const StTensor& tensor) const;  // see SafetensorsFile::release

 private:
  struct Impl;
  explicit Checkpoint(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsv4::convert
