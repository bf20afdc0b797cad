// Shared by the CUDA benchmarks: device buffers, random valid weights made on the device,
// event timing (median of repeats), the device's copy and read bandwidth, and the result
// lines scripts/gpu.sh collects ("TABLE|bench|case|value|unit|ratio|note").
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "gguf/ggml_types.h"
#include "util/float_formats.h"

namespace dsv4::cuda::bench {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "CUDA error in %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
#define BENCH_CUDA(call) ::dsv4::cuda::bench::check((call), #call)

template <class S>
void check_status(const S& s, const char* what) {
  if (!s.is_ok()) {
    std::fprintf(stderr, "%s failed: %s\n", what, s.message().c_str());
    std::exit(1);
  }
}

struct Buffer {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Buffer(size_t n) : bytes(n) { BENCH_CUDA(cudaMalloc(&p, (n + 15) / 16 * 16 + 16)); }
  ~Buffer() { cudaFree(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  template <class T = void>
  T* get() const { return static_cast<T*>(p); }
};

__device__ inline uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__global__ inline void fill_random_kernel(uint64_t* p, size_t words, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < words; i += size_t{gridDim.x} * blockDim.x)
    p[i] = splitmix(seed ^ (i * 0x2545F4914F6CDD1Dull));
}

// Sets the scale fields of every block (or, for BF16, every element) to sane values.
__global__ inline void fix_scales_kernel(uint8_t* p, size_t blocks, int type, int block_bytes) {
  for (size_t b = blockIdx.x * size_t{blockDim.x} + threadIdx.x; b < blocks; b += size_t{gridDim.x} * blockDim.x) {
    uint8_t* blk = p + b * block_bytes;
    const uint16_t h = f32_to_fp16(0.01f * (0.5f + static_cast<float>(splitmix(b) & 1023) / 1024.0f));
    auto put = [&](int at) {
      blk[at] = static_cast<uint8_t>(h);
      blk[at + 1] = static_cast<uint8_t>(h >> 8);
    };
    switch (static_cast<GgmlType>(type)) {
      case GgmlType::Q8_0: case GgmlType::Q4_K: case GgmlType::IQ2_XXS: put(0); if (type == int(GgmlType::Q4_K)) put(2); break;
      case GgmlType::Q2_K: put(80); put(82); break;
      case GgmlType::Q3_K: put(108); break;
      case GgmlType::Q6_K: put(208); break;
      case GgmlType::MXFP4: blk[0] = static_cast<uint8_t>(118 + (splitmix(b) & 7)); break;
      case GgmlType::Q5_K: case GgmlType::Q4_1: case GgmlType::Q5_1: put(0); put(2); break;
      case GgmlType::Q4_0: case GgmlType::Q5_0: case GgmlType::IQ4_NL: case GgmlType::IQ4_XS: case GgmlType::IQ2_XS:
      case GgmlType::IQ2_S: case GgmlType::IQ3_XXS: case GgmlType::IQ3_S: case GgmlType::IQ1_S: put(0); break;
      case GgmlType::IQ1_M:  // the fp16 scale in the top nibbles of the four scale words (byte 48)
        for (int w = 0; w < 4; ++w)
          blk[49 + 2 * w] = static_cast<uint8_t>((blk[49 + 2 * w] & 0x0F) | (((h >> (4 * w)) & 0xF) << 4));
        break;
      case GgmlType::BF16: {  // block = one element: a small value
        const uint16_t v = f32_to_bf16(static_cast<float>(static_cast<int>(splitmix(b) & 255) - 128) / 2048.0f);
        blk[0] = static_cast<uint8_t>(v);
        blk[1] = static_cast<uint8_t>(v >> 8);
        break;
      }
      default: break;
    }
  }
}

inline void fill_random(void* p, size_t bytes, uint64_t seed) {
  fill_random_kernel<<<1024, 256>>>(static_cast<uint64_t*>(p), (bytes + 7) / 8, seed);
  BENCH_CUDA(cudaGetLastError());
}

// Random valid blocks of `type` over `bytes` (a whole number of blocks).
inline void fill_weights(GgmlType type, void* p, size_t bytes, uint64_t seed) {
  fill_random(p, bytes, seed);
  const auto& t = ggml_traits(type);
  fix_scales_kernel<<<1024, 256>>>(static_cast<uint8_t*>(p), bytes / t.block_bytes, static_cast<int>(type),
                                   static_cast<int>(t.block_bytes));
  BENCH_CUDA(cudaGetLastError());
}

__global__ inline void fill_normalish_kernel(float* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x)
    p[i] = static_cast<float>(static_cast<int>(splitmix(seed + i) & 0xFFFF) - 32768) / 16384.0f;
}
inline void fill_floats(float* p, size_t n, uint64_t seed) {
  fill_normalish_kernel<<<1024, 256>>>(p, n, seed);
  BENCH_CUDA(cudaGetLastError());
}

// Median over `repeats` of the per-iteration time (microseconds) of `iters` calls of fn, which
// must launch its work on `stream` (the events are recorded there).
inline double time_us(cudaStream_t stream, const std::function<void()>& fn, int iters, int repeats = 7) {
  cudaEvent_t a, b;
  BENCH_CUDA(cudaEventCreate(&a));
  BENCH_CUDA(cudaEventCreate(&b));
  BENCH_CUDA(cudaDeviceSynchronize());  // data set-up on other streams is done
  fn();                                 // warm-up
  BENCH_CUDA(cudaDeviceSynchronize());
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) {
    BENCH_CUDA(cudaEventRecord(a, stream));
    for (int i = 0; i < iters; ++i) fn();
    BENCH_CUDA(cudaEventRecord(b, stream));
    BENCH_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, a, b));
    t.push_back(1000.0 * ms / iters);
  }
  BENCH_CUDA(cudaGetLastError());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Captures fn (stream launches on `stream`) into a graph; returns its executable.
inline cudaGraphExec_t capture(cudaStream_t stream, const std::function<void()>& fn) {
  cudaGraph_t g;
  BENCH_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  fn();
  BENCH_CUDA(cudaStreamEndCapture(stream, &g));
  cudaGraphExec_t e;
  BENCH_CUDA(cudaGraphInstantiate(&e, g, 0));
  cudaGraphDestroy(g);
  return e;
}

__global__ inline void read_kernel(const uint4* __restrict__ p, size_t n, unsigned* out) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) out[0] = acc;  // keeps the loads; practically never taken
}

struct Bandwidth {
  double copy_gbs;  // device-to-device copy, bytes read + written
  double read_gbs;  // a streaming read kernel
};

inline Bandwidth measure_bandwidth() {
  const size_t bytes = size_t{2} << 30;
  Buffer a(bytes), b(bytes), sink(64);
  fill_random(a.p, bytes, 1);
  const double copy_us = time_us(nullptr, [&] { BENCH_CUDA(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice)); }, 5);
  int sms = 0;
  BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const double read_us = time_us(nullptr, [&] { read_kernel<<<sms * 8, 512>>>(a.get<uint4>(), bytes / 16, sink.get<unsigned>()); }, 5);
  return {2.0 * bytes / copy_us / 1e3, bytes / read_us / 1e3};
}

// One result line for the table scripts/gpu.sh prints.
inline void report(const char* bench, const std::string& name, double value, const char* unit, double ratio,
                   const std::string& note) {
  std::printf("TABLE|%s|%s|%.2f|%s|%.3f|%s\n", bench, name.c_str(), value, unit, ratio, note.c_str());
  std::fflush(stdout);
}

}  // namespace dsv4::cuda::bench
