// Writing safetensors files, streaming: declare every tensor (name, dtype, shape) in data
// order, begin(), write the bytes in that order in as many pieces as convenient, finish().
// The header is a JSON object ("__metadata__" first, then the tensors in declaration
// order) padded with spaces to a multiple of 8 bytes, like the Python library writes it.
// Output goes to "<path>.tmp" and is renamed into place by finish(); a writer destroyed
// before that removes the temporary file.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "convert/safetensors.h"
#include "util/status.h"

namespace dsv4::convert {

class SafetensorsWriter {
 public:
  explicit SafetensorsWriter(std::filesystem::path path,
                             std::map<std::string, std::string> metadata = {{"format", "pt"}});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  void add_tensor(std::string name, StDtype dtype, std::vector<uint64_t> shape);
  uint64_t data_bytes() const { return data_bytes_; }  // of the tensors added so far

  Status begin();
  Status write(std::span<const uint8_t> bytes);
  Status finish();

 private:
  struct Entry {
    std::string name;
    StDtype dtype;
    std::vector<uint64_t> shape;
    uint64_t nbytes;
  };
  std::filesystem::path path_, temp_path_;
  std::map<std::string, std::string> metadata_;
  std::vector<Entry> entries_;
  uint64_t data_bytes_ = 0, written_ = 0;
  std::FILE* file_ = nullptr;
  bool finished_ = false;
};

}  // namespace dsv4::convert
