// IQ2_XXS decoding tables on the device, copied from gguf/iq2xxs_tables.h: the same source
// the CPU decoder uses. Allocated once per process (the backend drives one device) and kept.
#include <mutex>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/matvec_launch.cuh"
#include "gguf/iq2xxs_tables.h"

namespace dsv4::cuda::detail {

namespace {

Status upload(uint8_t* device) {
  DSV4_CUDA_TRY(cudaMemcpy(device, quant::kIq2xxsGrid, sizeof(quant::kIq2xxsGrid), cudaMemcpyHostToDevice));
  DSV4_CUDA_TRY(cudaMemcpy(device + sizeof(quant::kIq2xxsGrid), quant::kIq2xxsSigns, sizeof(quant::kIq2xxsSigns),
                           cudaMemcpyHostToDevice));
  return Status::ok();
}

}  // namespace

Status iq2_tables(const uint64_t** grid, const uint8_t** signs) {
  static std::mutex mutex;
  static uint8_t* device = nullptr;
  std::lock_guard<std::mutex> lock(mutex);
  if (device == nullptr) {
    void* p = nullptr;
    DSV4_CUDA_TRY(cudaMalloc(&p, sizeof(quant::kIq2xxsGrid) + sizeof(quant::kIq2xxsSigns)));
    const Status copied = upload(static_cast<uint8_t*>(p));
    if (!copied.is_ok()) {
      cudaFree(p);
      return copied;
    }
    device = static_cast<uint8_t*>(p);
  }
  *grid = reinterpret_cast<const uint64_t*>(device);
  *signs = device + sizeof(quant::kIq2xxsGrid);
  return Status::ok();
}

}  // namespace dsv4::cuda::detail
