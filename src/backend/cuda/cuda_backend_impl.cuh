// The CUDA backend's shared state, seen by its translation units (cuda_backend.cu,
// cuda_attention.cu, cuda_moe.cu) and nothing else.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"

namespace dsv4::backend {

struct CudaBackend::Impl {
  CudaBackendOptions options;
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  cublasLtHandle_t cublas_lt = nullptr;
  void* cublas_lt_workspace = nullptr;  // cuda::kCublasLtWorkspaceBytes

  // Step scratch: bump allocation (256-byte aligned) in device chunks. begin_step() rewinds
  // and, when a step spilled into several chunks, replaces them by one of their total
  // size, so addresses repeat from step to step (what graph replay relies on).
  struct Chunk {
    void* ptr = nullptr;
    size_t bytes = 0;
  };
  std::vector<Chunk> chunks;
  size_t chunk_used = 0;

  // Pinned host staging for uploads (grown on demand, between steps).
  void* pinned = nullptr;
  size_t pinned_bytes = 0;

  uint64_t weights_bytes = 0;
  uint64_t cache_bytes = 0;

  // Recorded steps by id (cuda_graph.cu); destroyed with the backend.
  std::map<int64_t, cudaGraphExec_t> graphs;
  bool capturing = false;

  // Raw scratch bytes for an op's internal workspace, valid until the next begin_step().
  Result<void*> scratch_bytes(size_t bytes);
};

}  // namespace dsv4::backend
