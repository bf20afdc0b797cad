// Backend::steer on the GPU (model/steering.h): one block per (row, group); the projection's
// dot product in double, as the CPU backend computes it.
#include "backend/cuda/cuda_backend_impl.cuh"

namespace dsv4::backend {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) steer_kernel(float* x, int64_t ld, const float* dir, bool shared_dir,
                                                         int64_t group, bool project, const float* alpha) {
  const int64_t r = blockIdx.x, g = blockIdx.y;
  const float a = alpha[r];
  if (a == 0.0f) return;  // exactly unchanged
  float* v = x + r * ld + g * group;
  const float* d = shared_dir ? dir : dir + g * group;
  if (!project) {
    for (int64_t i = threadIdx.x; i < group; i += blockDim.x) v[i] += a * d[i];
    return;
  }
  __shared__ double partial[kThreads / 32];
  double dot = 0;
  for (int64_t i = threadIdx.x; i < group; i += blockDim.x) dot += double(v[i]) * d[i];
  for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xFFFFFFFFu, dot, o);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = dot;
  __syncthreads();
  double total = 0;
  for (int w = 0; w < kThreads / 32; ++w) total += partial[w];  // every thread, in warp order
  const float c = static_cast<float>(total) * a;
  for (int64_t i = threadIdx.x; i < group; i += blockDim.x) v[i] -= c * d[i];
}

}  // namespace

Status CudaBackend::steer(const Tensor& x, const Tensor& dir, int64_t group, bool project, const Tensor& alpha) {
  const int64_t n = x.rows(), width = x.cols();
  if (x.type != GgmlType::F32 || x.stride[x.rank - 1] != 4 || alpha.type != GgmlType::F32 || !alpha.contiguous() ||
      alpha.n_elements() < n || dir.type != GgmlType::F32 || !dir.contiguous() || group <= 0 || width % group ||
      (dir.n_elements() != group && dir.n_elements() != width))
    return Status::errorf("cuda steer: x {} in groups of {} with direction {} and alpha {}", x.describe(), group,
                          dir.describe(), alpha.describe());
  if (n == 0) return Status::ok();
  const int64_t ld = x.rank >= 2 ? x.row_stride() / 4 : width;
  steer_kernel<<<dim3(static_cast<unsigned>(n), static_cast<unsigned>(width / group)), kThreads, 0, impl_->stream>>>(
      static_cast<float*>(x.data), ld, static_cast<const float*>(dir.data), dir.n_elements() == group, group, project,
      static_cast<const float*>(alpha.data));
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

}  // namespace dsv4::backend
