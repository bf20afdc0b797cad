// Runs a fuzz target's LLVMFuzzerTestOneInput on files, without libFuzzer: the regression
// replay of the committed corpus and past findings in the ordinary builds (ctest
// fuzz_replay_*, under ASan + UBSan in build-asan). A finding fails the test the way it
// failed the fuzzer: a trap, an abort, an escaped exception or a sanitizer report.
// Usage: fuzz_replay_<name> FOLDER...  (every file inside, in name order; a folder that
// does not exist is skipped). No input at all is an error, so a moved corpus cannot pass.
//
// An input that makes the target allocate absurdly (issue 9: a 64-byte GGUF made the writer
// pad a header to 1 GiB) fails as it did under libFuzzer's memory limit: no single
// allocation may exceed kMaxAllocation. Inputs are at most 64 KiB and the parsers' memory
// follows the bytes present, so only a size taken from a header can come near it.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <new>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {
constexpr size_t kMaxAllocationMiB = 256;
}

#if defined(__SANITIZE_ADDRESS__)
#define DSV4_REPLAY_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DSV4_REPLAY_ASAN 1
#endif
#endif

#ifdef DSV4_REPLAY_ASAN
// ASan owns operator new; its own limit reports the allocation with a stack trace.
extern "C" const char* __asan_default_options() { return "max_allocation_size_mb=256"; }
static_assert(kMaxAllocationMiB == 256, "keep __asan_default_options in step");
#else
// The replaceable global allocation function: the array, nothrow and sized forms and the
// default deletes (free) build on it and on malloc.
void* operator new(size_t size) {
  if (size > kMaxAllocationMiB << 20) {
    std::fprintf(stderr, "fuzz replay: an allocation of %zu bytes exceeds the limit of %zu MiB\n", size,
                 kMaxAllocationMiB);
    std::abort();
  }
  if (void* p = std::malloc(size ? size : 1)) return p;
  throw std::bad_alloc();
}
#endif

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  std::vector<fs::path> inputs;
  for (int i = 1; i < argc; ++i) {
    std::error_code ec;
    if (!fs::is_directory(argv[i], ec)) continue;
    for (const auto& entry : fs::recursive_directory_iterator(argv[i]))
      if (entry.is_regular_file()) inputs.push_back(entry.path());
  }
  std::sort(inputs.begin(), inputs.end());
  if (inputs.empty()) {
    std::fprintf(stderr, "%s: no input files in the folders given\n", argv[0]);
    return 2;
  }
  for (const fs::path& path : inputs) {
    std::ifstream in(path, std::ios::binary);
    const std::vector<uint8_t> bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    if (!in.good() && !in.eof()) {
      std::fprintf(stderr, "%s: cannot read\n", path.c_str());
      return 2;
    }
    // Announced first, so the input of a crash is the last line printed.
    std::printf("%s (%zu bytes)\n", path.c_str(), bytes.size());
    std::fflush(stdout);
    // A copy of exactly the input's size: reads past it show up under ASan as in libFuzzer.
    const std::unique_ptr<uint8_t[]> copy(new uint8_t[std::max<size_t>(bytes.size(), 1)]);
    std::copy(bytes.begin(), bytes.end(), copy.get());
    LLVMFuzzerTestOneInput(copy.get(), bytes.size());
  }
  std::printf("%zu inputs replayed\n", inputs.size());
  return 0;
}
