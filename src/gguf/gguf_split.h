// llama.cpp gguf-split's convention for GGUF files split into parts, shared by the reader
// and the writer: parts are named "<prefix>-%05d-of-%05d.gguf" (numbered from 1), each
// carries split.no (u16, from 0), split.count (u16) and split.tensors.count (i32, tensors
// of the whole set); only the first part carries the model's metadata.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace dsv4::gguf {

inline constexpr std::string_view kSplitNoKey = "split.no";
inline constexpr std::string_view kSplitCountKey = "split.count";
inline constexpr std::string_view kSplitTensorsCountKey = "split.tensors.count";
inline constexpr uint64_t kMaxSplitCount = 65535;  // split.count is a u16

// "-00002-of-00005.gguf" for split_no 1 of 5.
inline std::string split_suffix(uint32_t split_no, uint32_t count) {
  return fmt::format("-{:05d}-of-{:05d}.gguf", split_no + 1, count);
}

inline std::string split_path(std::string_view prefix, uint32_t split_no, uint32_t count) {
  return std::string(prefix) + split_suffix(split_no, count);
}

}  // namespace dsv4::gguf
