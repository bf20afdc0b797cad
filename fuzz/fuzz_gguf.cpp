// libFuzzer target for the GGUF reader: the input is parsed as a GGUF file through the same
// header parser GgufFile::open uses (from memory, mapped and headers-only), then every
// value, getter and tensor byte is touched so out-of-bounds views show up under ASan.
// Inputs that parse are rewritten with GgufWriter and read back, which must give the same
// metadata and tensor bytes (reader and writer agree on every file the reader accepts).
// Seeds: fuzz/corpus/gguf/ (tests/data/make_malformed_gguf.py writes them); past findings:
// fuzz/regressions/gguf/. docs/FUZZING.md.
#include <unistd.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>

#include "gguf/gguf_file.h"
#include "gguf/gguf_split.h"
#include "gguf/gguf_writer.h"

namespace {

using dsv4::gguf::GgufFile;
using dsv4::gguf::OpenOptions;
using dsv4::gguf::Value;
using dsv4::gguf::ValueType;

bool same(const Value& a, const Value& b) {
  if (a.type() != b.type()) return false;
  switch (a.type()) {
    case ValueType::STRING: return a.as_string() == b.as_string();
    case ValueType::BOOL: return a.as_bool() == b.as_bool();
    case ValueType::FLOAT32:
    case ValueType::FLOAT64: return std::bit_cast<uint64_t>(a.as_f64()) == std::bit_cast<uint64_t>(b.as_f64());
    case ValueType::ARRAY:
      if (a.elem_type() != b.elem_type() || a.as_array().size() != b.as_array().size()) return false;
      for (size_t i = 0; i < a.as_array().size(); ++i)
        if (!same(a.as_array()[i], b.as_array()[i])) return false;
      return true;
    default: return a.is_integer() && (a.type() == ValueType::INT8 || a.type() == ValueType::INT16 ||
                                       a.type() == ValueType::INT32 || a.type() == ValueType::INT64
                                           ? a.as_i64() == b.as_i64()
                                           : a.as_u64() == b.as_u64());
  }
}

bool writer_owned(const std::string& key) {
  return key == "general.alignment" || key == dsv4::gguf::kSplitNoKey || key == dsv4::gguf::kSplitCountKey ||
         key == dsv4::gguf::kSplitTensorsCountKey;
}

// The copy's path: one per process (fuzzers may run side by side), always of the same
// length, so no input's path through the code depends on the process id.
std::string rewrite_path() {
  char name[32];
  std::snprintf(name, sizeof(name), "fuzz_gguf_%010d.gguf", static_cast<int>(getpid()));
  return (std::filesystem::temp_directory_path() / name).string();
}

// Rewrites a parsed file and checks the copy reads back the same; traps on a mismatch.
void check_rewrite(const GgufFile& f) {
  static const std::string path = rewrite_path();
  {
    dsv4::gguf::GgufWriter w(path, {.alignment = f.alignment(), .overwrite = true});
    for (const auto& [key, value] : f.metadata())
      if (!writer_owned(key)) w.set(key, value);
    for (const auto& t : f.tensors())
      if (!w.add_tensor(t.name, t.type, t.ne)) __builtin_trap();
    if (!w.begin()) __builtin_trap();
    for (const auto& t : f.tensors())
      if (!w.write_tensor_data(t.bytes())) __builtin_trap();
    if (!w.finish()) __builtin_trap();
  }
  auto copy = GgufFile::open(path, {.load_split_parts = false});
  if (!copy || copy->alignment() != f.alignment() || copy->tensors().size() != f.tensors().size())
    __builtin_trap();
  for (const auto& [key, value] : f.metadata()) {
    if (writer_owned(key)) continue;
    const Value* v = copy->find(key);
    if (!v || !same(*v, value)) __builtin_trap();
  }
  for (size_t i = 0; i < f.tensors().size(); ++i) {
    const auto& a = f.tensors()[i];
    const auto& b = copy->tensors()[i];
    if (a.name != b.name || a.type != b.type || a.ne != b.ne || a.nbytes != b.nbytes ||
        std::memcmp(a.data, b.data, a.nbytes) != 0)
      __builtin_trap();
  }
  std::filesystem::remove(path);
}

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
      if (map_data) check_rewrite(*f);
    } else {
      volatile size_t sink = f.status().message().size();
      (void)sink;
    }
  }
  return 0;
}
