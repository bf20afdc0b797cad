// Writing GGUF v3 files, streaming: tensor data is never held in memory as a whole.
//
// Usage: set metadata, declare every tensor (name, type, shape) in the order it will be
// written, then begin(), then write_tensor_data() the bytes of each tensor in that order
// (in as many pieces as you like), then finish(). Output goes to "<path>.tmp" (one per
// part) and is renamed into place only by a successful finish(); a writer destroyed
// without finish() removes its temporary files. The bytes are a pure function of the
// inputs (deterministic). With split_max_bytes or split_max_tensors set, the output is
// "<stem>-0000K-of-0000N.gguf" parts with llama.cpp gguf-split's split.* keys (only when
// the limits produce more than one part; all metadata goes in the first part). The writer
// owns general.alignment (written from WriterOptions::alignment, replacing any set value)
// and the split.* keys (setting them is an error). See docs/GGUF.md.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gguf/ggml_types.h"
#include "gguf/gguf_value.h"
#include "util/status.h"

namespace dsv4 { class ThreadPool; }

namespace dsv4::gguf {

struct WriterOptions {
  uint64_t alignment = 32;          // written as general.alignment when not 32
  uint64_t split_max_bytes = 0;     // 0 = no limit; counts padded tensor data, not headers
  uint64_t split_max_tensors = 0;   // 0 = no limit
  bool overwrite = false;           // refuse to replace an existing output otherwise
};

class GgufWriter {
 public:
  GgufWriter(std::string path, WriterOptions opts = {});
  ~GgufWriter();  // removes temporaries unless finish() succeeded
  GgufWriter(const GgufWriter&) = delete;
  GgufWriter& operator=(const GgufWriter&) = delete;

  void set(std::string key, Value value);  // replaces an earlier value of the key
  Status add_tensor(std::string name, GgmlType type, std::vector<uint64_t> ne);

  Status begin();
  Status write_tensor_data(std::span<const uint8_t> bytes);
  // The next `bytes` of the due tensor (at most what remains of it), made by
  // produce(offset, piece) for consecutive pieces of `piece_bytes` (the last may be shorter;
  // offset counts from the first of these bytes), on the pool's threads, each piece written
  // at its place with pwrite: the file is the same as with write_tensor_data of the pieces
  // in order, written by every thread at once (random benchmark weights at memory speed).
  // `produce` must be safe to call from several threads.
  Status write_tensor_data_parallel(uint64_t bytes, uint64_t piece_bytes,
                                    const std::function<void(uint64_t, std::span<uint8_t>)>& produce,
                                    ThreadPool& pool);
  Status finish();

  // Paths of the files finish() produced (one, or the split parts).
  const std::vector<std::string>& output_paths() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsv4::gguf
