// libFuzzer target for the safetensors reader: the input is parsed through
// SafetensorsFile::open_bytes, which shares its one parser with SafetensorsFile::open (the
// path dsv4 convert uses), then every accepted tensor's bytes, shape and lookup are touched
// so an out-of-bounds view or an inconsistent header shows up under ASan or as a trap.
// Seeds: fuzz/corpus/safetensors/ (fuzz/corpus/make_safetensors_seeds.py writes them).
#include <cstddef>
#include <cstdint>
#include <span>

#include "convert/safetensors.h"

namespace {

using dsv4::convert::SafetensorsFile;
using dsv4::convert::st_dtype_size;

uint64_t touch(const SafetensorsFile& f) {
  uint64_t sum = f.file_bytes() + f.path().string().size();
  for (const auto& [key, value] : f.metadata()) sum += key.size() + value.size();
  const uint8_t* prev_end = nullptr;
  for (const auto& t : f.tensors()) {
    // What open() promised: sizes agree with shapes, tensors are in data order and disjoint.
    if (t.nbytes != t.n_elements() * st_dtype_size(t.dtype)) __builtin_trap();
    if (prev_end && t.data < prev_end) __builtin_trap();
    if (f.find(t.name) != &t) __builtin_trap();
    prev_end = t.data + t.nbytes;
    sum += t.shape_string().size();
    for (uint8_t b : t.bytes()) sum += b;
  }
  return sum;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto f = SafetensorsFile::open_bytes("fuzz.safetensors", std::span<const uint8_t>(data, size));
  if (f.is_ok()) {
    volatile uint64_t sink = touch(*f);
    (void)sink;
  } else {
    volatile size_t sink = f.status().message().size();
    (void)sink;
  }
  return 0;
}
