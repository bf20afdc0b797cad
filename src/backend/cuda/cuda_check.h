// Error checking for every CUDA runtime and cuBLAS call: a failed call becomes a Status
// that names the call, the file and line, and CUDA's own message.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "util/status.h"

namespace dsv4::cuda {

inline Status cuda_status(cudaError_t err, const char* what, const char* file, int line) {
  if (err == cudaSuccess) return Status::ok();
  return Status::error(std::string(file) + ":" + std::to_string(line) + ": " + what +
                       " failed: " + cudaGetErrorString(err));
}

}  // namespace dsv4::cuda

// Returns the error Status from the enclosing function when the call fails.
#define DSV4_CUDA_TRY(call) DSV4_TRY(::dsv4::cuda::cuda_status((call), #call, __FILE__, __LINE__))
// After a kernel launch: the launch error, if any.
#define DSV4_CUDA_TRY_LAUNCH() \
  DSV4_TRY(::dsv4::cuda::cuda_status(cudaGetLastError(), "kernel launch", __FILE__, __LINE__))
