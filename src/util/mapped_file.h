// A read-only file: memory-mapped for zero-copy access, or opened for bounded reads only.
//
// Opening with map = false never maps (nor reads) the contents: read_at() fetches just the
// bytes asked for with pread, which is how a 150 GB model's header is parsed instantly.
// A MappedFile may also wrap bytes already in memory (parsers' fuzz targets, tests), so
// one code path serves files and buffers. The mapping lives as long as the object.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "util/status.h"

namespace dsv4 {

class MappedFile {
 public:
  // Opens `path` read-only; with `map` the whole file is mapped (lazily paged in).
  static Result<MappedFile> open(const std::string& path, bool map = true);
  // Wraps a copy of `bytes`; `name` stands in for the path in messages.
  static MappedFile from_bytes(std::string name, std::span<const uint8_t> bytes);

  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }
  bool is_mapped() const { return data_ != nullptr || size_ == 0; }
  // The whole contents; nullptr when opened with map = false.
  const uint8_t* data() const { return data_; }
  std::span<const uint8_t> bytes() const { return {data_, data_ ? size_ : 0}; }

  // Copies bytes [offset, offset + n) into `out`; an error (naming the file, the offset
  // and the size) when the range is not inside the file or the read fails.
  Status read_at(uint64_t offset, void* out, size_t n) const;

 private:
  MappedFile() = default;
  void release();

  std::string path_;
  uint64_t size_ = 0;
  const uint8_t* data_ = nullptr;
  int fd_ = -1;
  bool owns_mapping_ = false;       // data_ is an mmap to munmap
  std::vector<uint8_t> memory_;     // contents of a from_bytes() file
};

}  // namespace dsv4
