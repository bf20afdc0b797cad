// What the CUDA backend needs to know about a device before planning work on it.
#pragma once

#include <cstdint>
#include <string>

#include "util/status.h"

namespace dsv4::cuda {

struct DeviceInfo {
  std::string name;
  int compute_capability = 0;  // 90 for Hopper
  int sm_count = 0;
  uint64_t global_memory_bytes = 0;
  uint64_t l2_bytes = 0;
};

Result<DeviceInfo> query_device(int index = 0);

}  // namespace dsv4::cuda
