// CudaBackend's timing points (backend.h): CUDA events recorded on the backend's stream.
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_backend_impl.cuh"
#include "backend/cuda/cuda_check.h"

namespace dsv4::backend {

Result<Backend::TimePoint> CudaBackend::time_point() {
  cudaEvent_t event = nullptr;
  DSV4_CUDA_TRY(cudaEventCreate(&event));
  std::shared_ptr<void> owner(event, [](void* e) { cudaEventDestroy(static_cast<cudaEvent_t>(e)); });
  DSV4_TRY(impl_->join_all());  // the point follows every lane's work
  DSV4_CUDA_TRY(cudaEventRecord(event, stream()));
  return TimePoint{host_clock_ms(), std::move(owner)};
}

Result<double> CudaBackend::elapsed_ms(const TimePoint& begin, const TimePoint& end) {
  if (!begin.event || !end.event)
    return Status::error(StatusCode::kInvalidArgument, "cuda: elapsed_ms needs two points of this backend");
  const auto b = static_cast<cudaEvent_t>(begin.event.get());
  const auto e = static_cast<cudaEvent_t>(end.event.get());
  DSV4_CUDA_TRY(cudaEventSynchronize(e));
  float ms = 0;
  DSV4_CUDA_TRY(cudaEventElapsedTime(&ms, b, e));
  return static_cast<double>(ms);
}

}  // namespace dsv4::backend
