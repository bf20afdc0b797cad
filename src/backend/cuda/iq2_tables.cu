// The i-quant decoding tables on the device, copied from gguf/iq2xxs_tables.h and
// gguf/iq_tables.h: the same sources the CPU decoder uses. Each set is allocated once per
// process (the backend drives one device) and kept.
#include <mutex>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/matvec_launch.cuh"
#include "gguf/iq2xxs_tables.h"
#include "gguf/iq_tables.h"

namespace dsv4::cuda::detail {

namespace {

Status upload(uint8_t* device) {
  DSV4_CUDA_TRY(cudaMemcpy(device, quant::kIq2xxsGrid, sizeof(quant::kIq2xxsGrid), cudaMemcpyHostToDevice));
  DSV4_CUDA_TRY(cudaMemcpy(device + sizeof(quant::kIq2xxsGrid), quant::kIq2xxsSigns, sizeof(quant::kIq2xxsSigns),
                           cudaMemcpyHostToDevice));
  return Status::ok();
}

// The other codebooks, one after the other in one allocation (each offset a multiple of 8,
// so the 64-bit grids stay aligned).
struct IqLayout {
  static constexpr size_t kIq2xs = 0;
  static constexpr size_t kIq2s = kIq2xs + sizeof(quant::kIq2xsGrid);
  static constexpr size_t kIq3xxs = kIq2s + sizeof(quant::kIq2sGrid);
  static constexpr size_t kIq3s = kIq3xxs + sizeof(quant::kIq3xxsGrid);
  static constexpr size_t kIq1s = kIq3s + sizeof(quant::kIq3sGrid);
  static constexpr size_t kIq4nl = kIq1s + sizeof(quant::kIq1sGrid);
  static constexpr size_t kSigns = kIq4nl + 16;
  static constexpr size_t kTotal = kSigns + sizeof(quant::kIq2xxsSigns);
};
static_assert(IqLayout::kIq3s % 8 == 0 && IqLayout::kIq1s % 8 == 0 && sizeof(quant::kIq4nlValues) == 16);

Status upload_iq(uint8_t* device) {
  auto put = [&](size_t at, const void* src, size_t bytes) -> Status {
    DSV4_CUDA_TRY(cudaMemcpy(device + at, src, bytes, cudaMemcpyHostToDevice));
    return Status::ok();
  };
  DSV4_TRY(put(IqLayout::kIq2xs, quant::kIq2xsGrid, sizeof(quant::kIq2xsGrid)));
  DSV4_TRY(put(IqLayout::kIq2s, quant::kIq2sGrid, sizeof(quant::kIq2sGrid)));
  DSV4_TRY(put(IqLayout::kIq3xxs, quant::kIq3xxsGrid, sizeof(quant::kIq3xxsGrid)));
  DSV4_TRY(put(IqLayout::kIq3s, quant::kIq3sGrid, sizeof(quant::kIq3sGrid)));
  DSV4_TRY(put(IqLayout::kIq1s, quant::kIq1sGrid, sizeof(quant::kIq1sGrid)));
  DSV4_TRY(put(IqLayout::kIq4nl, quant::kIq4nlValues, sizeof(quant::kIq4nlValues)));
  DSV4_TRY(put(IqLayout::kSigns, quant::kIq2xxsSigns, sizeof(quant::kIq2xxsSigns)));
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

Status iq_tables(quant::IqTables* out) {
  static std::mutex mutex;
  static uint8_t* device = nullptr;
  std::lock_guard<std::mutex> lock(mutex);
  if (device == nullptr) {
    void* p = nullptr;
    DSV4_CUDA_TRY(cudaMalloc(&p, IqLayout::kTotal));
    const Status copied = upload_iq(static_cast<uint8_t*>(p));
    if (!copied.is_ok()) {
      cudaFree(p);
      return copied;
    }
    device = static_cast<uint8_t*>(p);
  }
  out->iq2xs_grid = reinterpret_cast<const uint64_t*>(device + IqLayout::kIq2xs);
  out->iq2s_grid = reinterpret_cast<const uint64_t*>(device + IqLayout::kIq2s);
  out->iq3xxs_grid = reinterpret_cast<const uint32_t*>(device + IqLayout::kIq3xxs);
  out->iq3s_grid = reinterpret_cast<const uint32_t*>(device + IqLayout::kIq3s);
  out->iq1s_grid = reinterpret_cast<const uint64_t*>(device + IqLayout::kIq1s);
  out->iq4nl_values = reinterpret_cast<const int8_t*>(device + IqLayout::kIq4nl);
  out->ksigns = device + IqLayout::kSigns;
  return Status::ok();
}

}  // namespace dsv4::cuda::detail
