#include "backend/cuda/device_bench.h"

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/gemm_prefill.h"

namespace dsv4::cuda {
namespace {

__device__ uint64_t bench_hash(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

__global__ void fill_words_kernel(uint64_t* p, size_t words, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < words; i += size_t{gridDim.x} * blockDim.x)
    p[i] = bench_hash(seed + i);
}

// Values in [-1, 1): finite bf16 whatever the bits would have been.
__global__ void fill_bf16_kernel(__nv_bfloat16* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x)
    p[i] = __float2bfloat16(static_cast<float>(static_cast<int>(bench_hash(seed + i) & 0xFFFF) - 32768) / 32768.0f);
}

// One device allocation, freed on every path.
struct DeviceBuffer {
  void* p = nullptr;
  ~DeviceBuffer() {
    if (p) cudaFree(p);
  }
};

// Median over `repeats` of the time of one call of `enqueue` (milliseconds), after one
// warm-up call, with events on `stream`.
Result<double> median_ms(cudaStream_t stream, int repeats, const std::function<Status()>& enqueue) {
  cudaEvent_t a = nullptr, b = nullptr;
  DSV4_CUDA_TRY(cudaEventCreate(&a));
  if (cudaError_t e = cudaEventCreate(&b); e != cudaSuccess) {
    cudaEventDestroy(a);
    DSV4_CUDA_TRY(e);
  }
  std::vector<double> times;
  Status st = [&]() -> Status {
    DSV4_TRY(enqueue());
    DSV4_CUDA_TRY(cudaStreamSynchronize(stream));
    for (int r = 0; r < std::max(1, repeats); ++r) {
      DSV4_CUDA_TRY(cudaEventRecord(a, stream));
      DSV4_TRY(enqueue());
      DSV4_CUDA_TRY(cudaEventRecord(b, stream));
      DSV4_CUDA_TRY(cudaEventSynchronize(b));
      float ms = 0;
      DSV4_CUDA_TRY(cudaEventElapsedTime(&ms, a, b));
      times.push_back(ms);
    }
    return Status::ok();
  }();
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  DSV4_TRY(st);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

struct Stream {
  cudaStream_t s = nullptr;
  ~Stream() {
    if (s) cudaStreamDestroy(s);
  }
};

}  // namespace

Result<double> measure_copy_bandwidth(uint64_t bytes, int repeats) {
  bytes = std::max<uint64_t>(8, bytes / 8 * 8);
  Stream stream;
  DSV4_CUDA_TRY(cudaStreamCreateWithFlags(&stream.s, cudaStreamNonBlocking));
  DeviceBuffer src, dst;
  DSV4_CUDA_TRY(cudaMalloc(&src.p, bytes));
  DSV4_CUDA_TRY(cudaMalloc(&dst.p, bytes));
  fill_words_kernel<<<1024, 256, 0, stream.s>>>(static_cast<uint64_t*>(src.p), bytes / 8, 1);
  DSV4_CUDA_TRY_LAUNCH();
  const auto copy = [&]() -> Status {
    DSV4_CUDA_TRY(cudaMemcpyAsync(dst.p, src.p, bytes, cudaMemcpyDeviceToDevice, stream.s));
    return Status::ok();
  };
  DSV4_ASSIGN_OR_RETURN(double ms, median_ms(stream.s, repeats, copy));
  return 2.0 * static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
}

Result<double> measure_bf16_gemm_tflops(int64_t m, int64_t n, int64_t k, int repeats) {
  if (m <= 0 || n <= 0 || k <= 0) return Status::error("measure_bf16_gemm_tflops: empty shape");
  Stream stream;
  DSV4_CUDA_TRY(cudaStreamCreateWithFlags(&stream.s, cudaStreamNonBlocking));
  DeviceBuffer a, w, c, workspace;
  DSV4_CUDA_TRY(cudaMalloc(&a.p, static_cast<size_t>(m * k) * sizeof(__nv_bfloat16)));
  DSV4_CUDA_TRY(cudaMalloc(&w.p, static_cast<size_t>(n * k) * sizeof(__nv_bfloat16)));
  DSV4_CUDA_TRY(cudaMalloc(&c.p, static_cast<size_t>(m * n) * sizeof(float)));
  DSV4_CUDA_TRY(cudaMalloc(&workspace.p, kCublasLtWorkspaceBytes));
  fill_bf16_kernel<<<1024, 256, 0, stream.s>>>(static_cast<__nv_bfloat16*>(a.p), static_cast<size_t>(m * k), 2);
  DSV4_CUDA_TRY_LAUNCH();
  fill_bf16_kernel<<<1024, 256, 0, stream.s>>>(static_cast<__nv_bfloat16*>(w.p), static_cast<size_t>(n * k), 3);
  DSV4_CUDA_TRY_LAUNCH();
  cublasLtHandle_t handle = nullptr;
  if (cublasLtCreate(&handle) != CUBLAS_STATUS_SUCCESS) return Status::error(StatusCode::kInternal, "cublasLtCreate failed");
  auto ms = median_ms(stream.s, repeats, [&]() -> Status {
    return gemm_bf16(handle, static_cast<const __nv_bfloat16*>(a.p), static_cast<const __nv_bfloat16*>(w.p),
                     static_cast<float*>(c.p), m, n, k, workspace.p, kCublasLtWorkspaceBytes, stream.s);
  });
  cublasLtDestroy(handle);
  DSV4_TRY(ms.status());
  return 2.0 * static_cast<double>(m) * n * k / (*ms * 1e-3) / 1e12;
}

}  // namespace dsv4::cuda
