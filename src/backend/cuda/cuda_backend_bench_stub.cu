// TEMPORARY (branch bench only; drop at merge): CudaBackend's methods that cuda_backend.cu,
// cuda_attention.cu and cuda_moe.cu provide in main, as errors, so that dsv4 and test_cuda
// link in this branch and the CUDA-side code of dsv4 bench compiles. Nothing here runs.
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_backend_impl.cuh"

namespace dsv4::backend {
namespace {
Status missing(const char* op) {
  return Status::error(StatusCode::kInternal, std::string("cuda: ") + op + " is not in this branch's stub");
}
}  // namespace

Result<void*> CudaBackend::Impl::scratch_bytes(size_t) { return missing("scratch_bytes"); }
CudaBackend::CudaBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaBackend::~CudaBackend() = default;
Result<std::unique_ptr<CudaBackend>> CudaBackend::create(const CudaBackendOptions&) { return missing("create"); }
cudaStream_t CudaBackend::stream() const { return impl_ ? impl_->stream : nullptr; }
DeviceMemory CudaBackend::memory() const { return {}; }
Status CudaBackend::synchronize() { return missing("synchronize"); }
Result<Tensor> CudaBackend::alloc(GgmlType, std::span<const int64_t>) { return missing("alloc"); }
Result<Tensor> CudaBackend::reserve(GgmlType, std::span<const int64_t>) { return missing("reserve"); }
Result<Tensor> CudaBackend::weight(const gguf::TensorInfo&) { return missing("weight"); }
Status CudaBackend::upload(const Tensor&, const void*, size_t) { return missing("upload"); }
Status CudaBackend::download(const Tensor&, void*, size_t) { return missing("download"); }
Status CudaBackend::copy_rows(const Tensor&, const Tensor&) { return missing("copy_rows"); }
Status CudaBackend::fill(const Tensor&, float) { return missing("fill"); }
void CudaBackend::begin_step() {}
Result<Tensor> CudaBackend::scratch(GgmlType, std::span<const int64_t>) { return missing("scratch"); }
Backend::ScratchMark CudaBackend::scratch_mark() const { return {}; }
void CudaBackend::scratch_release(ScratchMark) {}
Status CudaBackend::matmul(const Tensor&, const Tensor&, const Tensor&, MatmulMode) { return missing("matmul"); }
Status CudaBackend::get_rows(const Tensor&, const Tensor&, const Tensor&) { return missing("get_rows"); }
Status CudaBackend::rms_norm(const Tensor&, const Tensor*, float, int64_t, const Tensor&) { return missing("rms_norm"); }
Status CudaBackend::rope(const Tensor&, int64_t, const Tensor&, const RopeParams&, bool) { return missing("rope"); }
Status CudaBackend::add(const Tensor&, const Tensor&) { return missing("add"); }
Status CudaBackend::scale(const Tensor&, float) { return missing("scale"); }
Status CudaBackend::hc_pre(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int, int, float, float,
                           const Tensor&, const Tensor&, const Tensor&) {
  return missing("hc_pre");
}
Status CudaBackend::hc_post(const Tensor&, const Tensor&, const Tensor&, int, const Tensor&) { return missing("hc_post"); }
Status CudaBackend::hc_head(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int, float, float,
                            const Tensor&) {
  return missing("hc_head");
}
Status CudaBackend::attention(const Tensor&, const AttentionKeys&, const StepRows&, const Tensor&, float,
                              const Tensor&) {
  return missing("attention");
}
Status CudaBackend::store_window(const Tensor&, const StepRows&, int64_t, const SlotRows&) {
  return missing("store_window");
}
Status CudaBackend::compress(const Tensor&, const Tensor&, const Tensor&, int, bool, const StepRows&, const SlotRows&,
                             const SlotRows&, const Tensor&) {
  return missing("compress");
}
Status CudaBackend::block_positions(const StepRows&, int, const Tensor&) { return missing("block_positions"); }
Status CudaBackend::store_entries(const Tensor&, int, const StepRows&, const PagedRows&) {
  return missing("store_entries");
}
Status CudaBackend::indexer_scores(const Tensor&, const Tensor&, const PagedRows&, int, const StepRows&,
                                   const Tensor&) {
  return missing("indexer_scores");
}
Status CudaBackend::top_k(const Tensor&, int, const StepRows&, int, const Tensor&) { return missing("top_k"); }
Status CudaBackend::hadamard(const Tensor&, int64_t) { return missing("hadamard"); }
Status CudaBackend::round_fp8_blocks(const Tensor&, int64_t, int64_t) { return missing("round_fp8_blocks"); }
Status CudaBackend::round_fp4_blocks(const Tensor&, int64_t) { return missing("round_fp4_blocks"); }
Status CudaBackend::route(const Tensor&, const Tensor*, const Tensor*, const Tensor&, int, float, const Tensor&,
                          const Tensor&) {
  return missing("route");
}
Status CudaBackend::moe_experts(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, float, MatmulMode, const Tensor&) {
  return missing("moe_experts");
}
Status CudaBackend::swiglu_expert(const Tensor&, const Tensor&, const Tensor&, const Tensor&, float, MatmulMode,
                                  const Tensor&) {
  return missing("swiglu_expert");
}

}  // namespace dsv4::backend
