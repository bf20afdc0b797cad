// TEMPORARY (branch cuda-attn only; drop at merge): the smallest working version of the
// CudaBackend half that cuda_backend.cu / cuda_moe.cu will provide, so that test_cuda links
// and the attention tests through CudaBackend can run on the GPU before the merge: memory,
// uploads, downloads, fill, scratch. Every other operation reports that it is missing.
#include <cstring>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_backend_impl.cuh"

namespace dsv4::backend {

namespace {
Status missing(const char* op) { return Status::error(StatusCode::kInternal, std::string(op) + ": not in the temporary stub"); }

__global__ void fill_f32_kernel(float* p, int64_t n, float v) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) p[i] = v;
}
__global__ void fill_i32_kernel(int32_t* p, int64_t n, int32_t v) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) p[i] = v;
}
size_t bytes_of(const Tensor& t) { return static_cast<size_t>(t.shape[0] * t.stride[0]); }
}  // namespace

Result<void*> CudaBackend::Impl::scratch_bytes(size_t bytes) {
  const size_t at = (chunk_used + 255) & ~size_t{255};
  if (chunks.empty() || at + bytes > chunks[0].bytes)
    return Status::error(StatusCode::kResourceExhausted, "stub scratch exhausted");
  chunk_used = at + bytes;
  return static_cast<char*>(chunks[0].ptr) + at;
}

CudaBackend::CudaBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaBackend::~CudaBackend() {
  if (!impl_) return;
  for (auto& c : impl_->chunks) cudaFree(c.ptr);
  if (impl_->stream) cudaStreamDestroy(impl_->stream);
}

Result<std::unique_ptr<CudaBackend>> CudaBackend::create(const CudaBackendOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  DSV4_CUDA_TRY(cudaSetDevice(options.device));
  DSV4_CUDA_TRY(cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking));
  Impl::Chunk c;
  c.bytes = options.scratch_bytes;
  DSV4_CUDA_TRY(cudaMalloc(&c.ptr, c.bytes));
  impl->chunks.push_back(c);
  return std::unique_ptr<CudaBackend>(new CudaBackend(std::move(impl)));
}

cudaStream_t CudaBackend::stream() const { return impl_->stream; }
DeviceMemory CudaBackend::memory() const { return {}; }
Status CudaBackend::synchronize() {
  DSV4_CUDA_TRY(cudaStreamSynchronize(impl_->stream));
  return Status::ok();
}

Result<Tensor> CudaBackend::alloc(GgmlType type, std::span<const int64_t> shape) {
  Tensor t = make_descriptor(type, shape);
  const size_t n = bytes_of(t);
  if (shape.empty() || n == 0) return Status::error("stub alloc: empty shape");
  void* p = nullptr;
  DSV4_CUDA_TRY(cudaMalloc(&p, n));
  DSV4_CUDA_TRY(cudaMemset(p, 0, n));
  t.data = p;
  t.owner = std::shared_ptr<void>(p, [](void* q) { cudaFree(q); });
  t.backend = this;
  return t;
}
Result<Tensor> CudaBackend::reserve(GgmlType type, std::span<const int64_t> shape) { return alloc(type, shape); }
Result<Tensor> CudaBackend::weight(const gguf::TensorInfo&) { return missing("weight"); }
Status CudaBackend::upload(const Tensor& dst, const void* host, size_t bytes) {
  DSV4_CUDA_TRY(cudaStreamSynchronize(impl_->stream));
  DSV4_CUDA_TRY(cudaMemcpy(dst.data, host, bytes, cudaMemcpyHostToDevice));
  return Status::ok();
}
Status CudaBackend::download(const Tensor& src, void* host, size_t bytes) {
  DSV4_CUDA_TRY(cudaStreamSynchronize(impl_->stream));
  DSV4_CUDA_TRY(cudaMemcpy(host, src.data, bytes, cudaMemcpyDeviceToHost));
  return Status::ok();
}
Status CudaBackend::copy_rows(const Tensor&, const Tensor&) { return missing("copy_rows"); }
Status CudaBackend::fill(const Tensor& t, float value) {
  const int64_t n = t.n_elements();
  if (t.type == GgmlType::F32) fill_f32_kernel<<<256, 256, 0, impl_->stream>>>(static_cast<float*>(t.data), n, value);
  else fill_i32_kernel<<<256, 256, 0, impl_->stream>>>(static_cast<int32_t*>(t.data), n, static_cast<int32_t>(value));
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}
void CudaBackend::begin_step() { impl_->chunk_used = 0; }
Result<Tensor> CudaBackend::scratch(GgmlType type, std::span<const int64_t> shape) {
  Tensor t = make_descriptor(type, shape);
  DSV4_ASSIGN_OR_RETURN(t.data, impl_->scratch_bytes(bytes_of(t)));
  t.backend = this;
  return t;
}

Status CudaBackend::matmul(const Tensor&, const Tensor&, const Tensor&, MatmulMode) { return missing("matmul"); }
Status CudaBackend::get_rows(const Tensor&, const Tensor&, const Tensor&) { return missing("get_rows"); }
Status CudaBackend::rms_norm(const Tensor&, const Tensor*, float, int64_t, const Tensor&) { return missing("rms_norm"); }
Status CudaBackend::rope(const Tensor&, int64_t, const Tensor&, const RopeParams&, bool) { return missing("rope"); }
Status CudaBackend::add(const Tensor&, const Tensor&) { return missing("add"); }
Status CudaBackend::scale(const Tensor&, float) { return missing("scale"); }
Status CudaBackend::hc_pre(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int, int, float, float,
                           const Tensor&, const Tensor&, const Tensor&) { return missing("hc_pre"); }
Status CudaBackend::hc_post(const Tensor&, const Tensor&, const Tensor&, int, const Tensor&) { return missing("hc_post"); }
Status CudaBackend::hc_head(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int, float, float,
                            const Tensor&) { return missing("hc_head"); }
Status CudaBackend::hadamard(const Tensor&, int64_t) { return missing("hadamard"); }
Status CudaBackend::round_fp8_blocks(const Tensor&, int64_t, int64_t) { return missing("round_fp8_blocks"); }
Status CudaBackend::round_fp4_blocks(const Tensor&, int64_t) { return missing("round_fp4_blocks"); }
Status CudaBackend::route(const Tensor&, const Tensor*, const Tensor*, const Tensor&, int, float, const Tensor&,
                          const Tensor&) { return missing("route"); }
Status CudaBackend::moe_experts(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, float, MatmulMode, const Tensor&) { return missing("moe_experts"); }
Status CudaBackend::swiglu_expert(const Tensor&, const Tensor&, const Tensor&, const Tensor&, float, MatmulMode,
                                  const Tensor&) { return missing("swiglu_expert"); }

}  // namespace dsv4::backend
