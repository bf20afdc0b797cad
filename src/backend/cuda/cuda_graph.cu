// Graph capture and replay of a step (Backend::begin_capture / end_capture / replay): the
// work enqueued on the backend's stream (and its side lanes', forked from it and joined to
// it) between the two calls becomes one CUDA graph,
// instantiated once and launched with one call per replay. Capture is thread-local, so
// another thread's CUDA calls (e.g. a server's I/O thread) do not invalidate it.
#include "backend/cuda/cuda_backend_impl.cuh"

namespace dsv4::backend {

Status CudaBackend::begin_capture() {
  if (impl_->capturing) return Status::error(StatusCode::kInternal, "cuda: begin_capture while capturing");
  DSV4_TRY(impl_->join_all());
  DSV4_CUDA_TRY(cudaStreamBeginCapture(impl_->stream, cudaStreamCaptureModeThreadLocal));
  impl_->capturing = true;
  return Status::ok();
}

Status CudaBackend::end_capture(int64_t id) {
  if (!impl_->capturing) return Status::error(StatusCode::kInternal, "cuda: end_capture without begin_capture");
  impl_->capturing = false;
  const Status joined = impl_->join_all();  // a capture ends with every lane joined
  cudaGraph_t graph = nullptr;
  DSV4_CUDA_TRY(cudaStreamEndCapture(impl_->stream, &graph));
  if (!joined.is_ok()) {
    cudaGraphDestroy(graph);
    return joined;
  }
  cudaGraphExec_t exec = nullptr;
  const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  DSV4_CUDA_TRY(err);
  if (auto it = impl_->graphs.find(id); it != impl_->graphs.end()) {
    cudaGraphExecDestroy(it->second);
    it->second = exec;
  } else {
    impl_->graphs.emplace(id, exec);
  }
  return Status::ok();
}

Status CudaBackend::replay(int64_t id) {
  const auto it = impl_->graphs.find(id);
  if (it == impl_->graphs.end()) return Status::errorf(StatusCode::kInternal, "cuda: no graph {}", id);
  DSV4_TRY(impl_->join_all());
  DSV4_CUDA_TRY(cudaGraphLaunch(it->second, impl_->stream));
  return Status::ok();
}

}  // namespace dsv4::backend
