// libFuzzer target for the GGUF reader: the input is parsed as a GGUF file through the same
// header parser GgufFile::open uses (from memory, mapped and headers-only), then every
// value, getter and tensor byte is touched so out-of-bounds views show up under ASan.
// Seeds: fuzz/corpus/gguf/ (tests/data/make_malformed_gguf.py writes them).
#include <cstddef>
#include <cstdint>
#include <span>

#include "gguf/gguf_file.h"

namespace {

using dsv4::gguf::GgufFile;
using dsv4::gguf::OpenOptions;

uint64_t touch(const GgufFile& f) {
  uint64_t sum = f.alignment() + f.version() + f.file_bytes();
  for (const auto& [key, value] : f.metadata()) {
    sum += value.to_display_string(4).size();
    sum += f.find(key) == &value;
    // Each getter either converts or returns an error; both must be safe on any value.
    sum += f.get_uint(key).is_ok() + f.get_int(key).is_ok() + f.get_float(key).is_ok();
    sum += f.get_bool(key).is_ok() + f.get_string(key).is_ok();
    sum += f.get_uint_array(key).is_ok() + f.get_float_array(key).is_ok() + f.get_string_array(key).is_ok();
  }
  for (const auto& t : f.tensors()) {
    sum += t.n_elements() + t.n_rows() + t.shape_string().size();
    sum += f.find_tensor(t.name) == &t;
    if (t.data)
      for (uint8_t b : t.bytes()) sum += b;
  }
  return sum;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  for (bool map_data : {true, false}) {
    OpenOptions opts;
    opts.map_data = map_data;
    auto f = GgufFile::open_bytes("fuzz.gguf", bytes, opts);
    if (f.is_ok()) {
      volatile uint64_t sink = touch(*f);
      (void)sink;
    } else {
      volatile size_t sink = f.status().message().size();
      (void)sink;
    }
  }
  return 0;
}
