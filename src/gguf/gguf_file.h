// Reading GGUF v3 files: memory-mapped, zero-copy tensor views, split files.
//
// GgufFile::open validates the whole header (magic, version, every length, offset and
// size, alignment, duplicate names, tensor types) before returning; every malformed input
// is a Status naming the file, the field and the offending value. Tensor data is never
// copied: TensorInfo::data points into the mapping, which lives as long as the GgufFile.
// A GgufFile does not change after open(), so threads may share one. docs/GGUF.md lists
// what is validated.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gguf/ggml_types.h"
#include "gguf/gguf_value.h"
#include "util/status.h"

namespace dsv4 {
class MappedFile;
}

namespace dsv4::gguf {

inline constexpr uint32_t kMagic = 0x46554747;  // "GGUF" little-endian
inline constexpr uint32_t kVersion = 3;
inline constexpr uint64_t kDefaultAlignment = 32;

// What the reader accepts, and the writer refuses to exceed (docs/GGUF.md, "Limits"). Every
// count and length in a header is also bounded by the bytes left in the file before
// anything is allocated; these caps bound memory when the file itself is huge (a 150 GB
// model read with map_data = false) and are far above what real models use.
//
// general.alignment: llama.cpp accepts any power of two that fits its u32, but real files
// use 32 (llama.cpp's and gguf-py's default), sometimes 64; the largest with a purpose is
// a memory page (4 KiB, 64 KiB on arm64 and ppc64 kernels). Padding, which the writer
// allocates and writes for the header and after every tensor, stays below the alignment,
// so 64 KiB keeps any file's padding small whatever its header says.
inline constexpr uint64_t kMaxAlignment = uint64_t{64} << 10;
inline constexpr uint64_t kMaxHeaderBytes = uint64_t{1} << 30;    // metadata + tensor infos
inline constexpr uint64_t kMaxStringBytes = uint64_t{64} << 20;   // one key, value or name
inline constexpr uint64_t kMaxMetadataValues = uint64_t{1} << 22;  // key-value pairs + array elements, all keys
inline constexpr uint64_t kMaxTensors = uint64_t{1} << 20;
inline constexpr int kMaxArrayNesting = 8;
inline constexpr uint32_t kMaxDims = 4;

// Empty when `a` is a valid general.alignment, else why not ("48 is not a power of two").
std::string alignment_problem(uint64_t a);

struct TensorInfo {
  std::string name;
  GgmlType type = GgmlType::F32;
  std::vector<uint64_t> ne;     // ggml order: ne[0] is the row length (innermost)
  uint64_t offset = 0;          // within its part's data section
  uint64_t file_offset = 0;     // of the data within its part's file (for pread)
  uint64_t nbytes = 0;
  uint32_t part = 0;            // index of the split part holding the data
  const uint8_t* data = nullptr;  // into the memory mapping

  uint64_t n_elements() const;
  uint64_t n_rows() const { return ne.empty() ? 1 : n_elements() / ne[0]; }
  std::span<const uint8_t> bytes() const { return {data, nbytes}; }
  std::string shape_string() const;  // outer-first, e.g. "[512, 4096]"
};

struct OpenOptions {
  bool map_data = true;        // false: parse headers only (`dsv4 info` on huge files)
  bool load_split_parts = true;  // follow split.count to the sibling parts
};

class GgufFile {
 public:
  // `path` may name a single file or any part "*-0000K-of-0000N.gguf" of a split set;
  // all N parts are then opened and their tensors merged.
  static Result<GgufFile> open(const std::string& path, OpenOptions opts = {});
  // Parses a GGUF image held in memory (a copy is kept); `name` stands in for the path in
  // messages. Split sets cannot be followed from memory: only this part's tensors are seen.
  static Result<GgufFile> open_bytes(std::string name, std::span<const uint8_t> bytes, OpenOptions opts = {});

  GgufFile(GgufFile&&) noexcept;
  GgufFile& operator=(GgufFile&&) noexcept;
  ~GgufFile();

  const std::string& path() const;                 // as given to open()
  const std::vector<std::string>& part_paths() const;
  uint32_t version() const;
  uint64_t alignment() const;
  uint64_t file_bytes() const;                     // all parts together

  // Metadata, in file order (from the first part; split.* keys included).
  const std::vector<std::pair<std::string, Value>>& metadata() const;
  const Value* find(std::string_view key) const;

  // Typed getters: the error names the file, the key, and the type found.
  // Integer getters accept any integer type whose value fits.
  Result<std::string> get_string(std::string_view key) const;
  Result<uint64_t> get_uint(std::string_view key) const;
  Result<int64_t> get_int(std::string_view key) const;
  Result<double> get_float(std::string_view key) const;  // accepts integer values too
  Result<bool> get_bool(std::string_view key) const;
  Result<std::vector<uint64_t>> get_uint_array(std::string_view key) const;
  Result<std::vector<double>> get_float_array(std::string_view key) const;
  Result<std::vector<std::string>> get_string_array(std::string_view key) const;

  // Tensors of all parts, in file order.
  const std::vector<TensorInfo>& tensors() const;
  const TensorInfo* find_tensor(std::string_view name) const;

 private:
  struct Impl;
  explicit GgufFile(std::unique_ptr<Impl> impl);
  static Result<GgufFile> open_parts(MappedFile file, OpenOptions opts);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsv4::gguf
