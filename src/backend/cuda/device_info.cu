#include "backend/cuda/device_info.h"

#include "backend/cuda/cuda_check.h"

namespace dsv4::cuda {

Result<DeviceInfo> query_device(int index) {
  int count = 0;
  DSV4_CUDA_TRY(cudaGetDeviceCount(&count));
  if (index < 0 || index >= count)
    return Status::error("CUDA device " + std::to_string(index) + " requested, " +
                         std::to_string(count) + " present");
  cudaDeviceProp p{};
  DSV4_CUDA_TRY(cudaGetDeviceProperties(&p, index));
  DeviceInfo info;
  info.name = p.name;
  info.compute_capability = p.major * 10 + p.minor;
  info.sm_count = p.multiProcessorCount;
  info.global_memory_bytes = p.totalGlobalMem;
  info.l2_bytes = static_cast<uint64_t>(p.l2CacheSize);
  return info;
}

}  // namespace dsv4::cuda
