// Backend::sample on the GPU: the arithmetic of backend/sampling.h, one block per row.
// Truncations are key thresholds found by radix selection over the 64-bit candidate keys
// (8 passes of one byte, histograms in shared memory with integer atomics, so the result
// does not depend on the order threads add in); the draw is a block-wide Gumbel-max. The
// CPU backend computes the same function (tests/cuda compare them token for token).
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "backend/cuda/cuda_backend_impl.cuh"
#include "backend/cuda/dependent_launch.cuh"
#include "backend/sampling.h"

namespace dsv4::backend {
namespace {

constexpr int kThreads = 1024;

__global__ void adjust_kernel(float* logits, int64_t ld, const int32_t* adj, int64_t m, int64_t rows, int64_t vocab) {
  ::dsv4::cuda::dependent_kernel_prologue();
  const int64_t a = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (a >= m) return;
  const int32_t* f = adj + a * kAdjustFields;
  // The host checks the rows and tokens (the CPU backend reports bad ones); stay in bounds.
  if (f[kAdjustRow] < 0 || f[kAdjustRow] >= rows || f[kAdjustToken] < 0 || f[kAdjustToken] >= vocab) return;
  float& x = logits[f[kAdjustRow] * ld + f[kAdjustToken]];
  const float rep = f32_field(f, kAdjustRepetition);
  if (rep != 1.0f) x = x > 0 ? x / rep : x * rep;
  x -= f32_field(f, kAdjustSubtract);
}

struct Best {
  double score;
  int32_t id;
};

__device__ inline Best better(Best a, Best b) {  // higher score, then lower id
  if (b.score > a.score || (b.score == a.score && b.id < a.id)) return b;
  return a;
}

// Block-wide: every thread gets the best of all threads' candidates.
__device__ Best block_best(Best mine, Best* shared) {
  for (int o = 16; o > 0; o >>= 1) {
    Best other{__shfl_xor_sync(0xFFFFFFFFu, mine.score, o), __shfl_xor_sync(0xFFFFFFFFu, mine.id, o)};
    mine = better(mine, other);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = mine;
  __syncthreads();
  if (warp == 0) {
    mine = lane < blockDim.x / 32 ? shared[lane] : Best{-INFINITY, INT32_MAX};
    for (int o = 16; o > 0; o >>= 1) {
      Best other{__shfl_xor_sync(0xFFFFFFFFu, mine.score, o), __shfl_xor_sync(0xFFFFFFFFu, mine.id, o)};
      mine = better(mine, other);
    }
    if (lane == 0) shared[0] = mine;
  }
  __syncthreads();
  const Best all = shared[0];
  __syncthreads();
  return all;
}

// This thread's best of x[0..vocab) (highest value, lowest id on ties; NaN never wins), with
// kArgmaxInFlight 16-byte loads in flight: the plain strided loop issued a 129K vocabulary's
// ~126 loads a thread one after another (sample_kernel 58 us a decode step in ncu,
// 2026-12-04). `better` is a total order, so the order of the visits changes no result.
constexpr int kArgmaxInFlight = 8;
__device__ Best thread_argmax(const float* x, int64_t vocab) {
  Best mine{-INFINITY, INT32_MAX};
  const auto visit = [&mine](float v, int64_t i) {
    if (!isnan(v)) mine = better(mine, Best{double(v), static_cast<int32_t>(i)});
  };
  int64_t tail = 0;
  if ((reinterpret_cast<uintptr_t>(x) & 15) == 0) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const int64_t n4 = vocab / 4, step = static_cast<int64_t>(blockDim.x);
    for (int64_t base = threadIdx.x; base < n4; base += kArgmaxInFlight * step) {
      float4 v[kArgmaxInFlight];
#pragma unroll
      for (int u = 0; u < kArgmaxInFlight; ++u) {
        const int64_t j = base + u * step;
        v[u] = j < n4 ? x4[j] : make_float4(NAN, NAN, NAN, NAN);
      }
#pragma unroll
      for (int u = 0; u < kArgmaxInFlight; ++u) {
        const int64_t i = 4 * (base + u * step);
        visit(v[u].x, i);
        visit(v[u].y, i + 1);
        visit(v[u].z, i + 2);
        visit(v[u].w, i + 3);
      }
    }
    tail = 4 * n4;
  }
  for (int64_t i = tail + threadIdx.x; i < vocab; i += blockDim.x) visit(x[i], i);
  return mine;
}

// The key threshold at rank `rank` (1-based, from the top) of the candidates with
// key >= floor, counted (by_weight false) or weighted by fixed_weight (by_weight true): the
// key of the first candidate, in descending key order, at which the running count/weight
// reaches `rank`.
__device__ uint64_t radix_select(const float* x, int64_t vocab, float temperature, double z_max, uint64_t floor,
                                 uint64_t rank, bool by_weight, unsigned long long* hist, unsigned int* counts,
                                 uint64_t* result) {
  uint64_t prefix = 0, mask = 0;
  for (int pass = 0; pass < 8; ++pass) {
    const int shift = 56 - 8 * pass;
    for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0, counts[i] = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
      if (!isfinite(x[i])) continue;
      const float z = x[i] / temperature;
      const uint64_t key = candidate_key(z, static_cast<uint32_t>(i));
      if (key < floor || (key & mask) != prefix) continue;
      const int d = static_cast<int>((key >> shift) & 255);
      atomicAdd(&hist[d], by_weight ? static_cast<unsigned long long>(fixed_weight(double(z) - z_max)) : 1ull);
      atomicAdd(&counts[d], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int chosen = -1;
      for (int d = 255; d >= 0; --d) {
        if (counts[d] == 0) continue;
        if (hist[d] >= rank) {
          chosen = d;
          break;
        }
        rank -= hist[d];
      }
      if (chosen < 0) chosen = 0;  // unreachable when rank <= the total
      *result = static_cast<uint64_t>(chosen);
    }
    __syncthreads();
    prefix |= *result << shift;
    mask |= uint64_t{255} << shift;
    __syncthreads();
  }
  return prefix;
}

__global__ void __launch_bounds__(kThreads) sample_kernel(const float* logits, int64_t ld, int64_t vocab,
                                                          const int32_t* params, int32_t* out) {
  ::dsv4::cuda::dependent_kernel_prologue();
  __shared__ Best best_shared[kThreads / 32];
  __shared__ unsigned long long hist[256];
  __shared__ unsigned int counts[256];
  __shared__ uint64_t result;
  __shared__ unsigned long long total;
  const int64_t row = blockIdx.x;
  const float* x = logits + row * ld;
  const int32_t* p = params + row * kSampleFields;

  // The arg-max, lowest id on ties; NaN never wins.
  Best mine = thread_argmax(x, vocab);
  const Best arg = block_best(mine, best_shared);
  const int32_t argmax = arg.id == INT32_MAX ? 0 : arg.id;
  const float temperature = f32_field(p, kSampleTemperature);
  if (temperature == 0.0f || !isfinite(arg.score)) {
    if (threadIdx.x == 0) out[row] = argmax;
    return;
  }
  const double z_max = double(x[argmax] / temperature);

  // top-k: the k-th largest key.
  uint64_t floor = 0;
  const int32_t top_k = p[kSampleTopK];
  if (top_k > 0) {
    if (threadIdx.x == 0) total = 0;
    __syncthreads();
    unsigned long long n = 0;
    for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) n += isfinite(x[i]) ? 1 : 0;
    atomicAdd(&total, n);
    __syncthreads();
    const unsigned long long count = total;
    __syncthreads();
    if (static_cast<unsigned long long>(top_k) < count)
      floor = radix_select(x, vocab, temperature, z_max, 0, static_cast<uint64_t>(top_k), false, hist, counts, &result);
  }
  // top-p: the shortest prefix (of what top-k kept) whose weight reaches top_p of the total.
  const float top_p = f32_field(p, kSampleTopP);
  if (top_p < 1.0f) {
    if (threadIdx.x == 0) total = 0;
    __syncthreads();
    unsigned long long w = 0;
    for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
      if (!isfinite(x[i])) continue;
      const float z = x[i] / temperature;
      if (candidate_key(z, static_cast<uint32_t>(i)) >= floor) w += fixed_weight(double(z) - z_max);
    }
    atomicAdd(&total, w);
    __syncthreads();
    const uint64_t target = top_p_target(top_p, total);
    __syncthreads();
    const uint64_t cut = radix_select(x, vocab, temperature, z_max, floor, target, true, hist, counts, &result);
    floor = cut > floor ? cut : floor;
  }
  const double min_p = f32_field(p, kSampleMinP);

  // The draw: Gumbel-max over what is kept.
  const uint64_t seed = u64_fields(p, kSampleSeedLo), counter = u64_fields(p, kSampleCounterLo);
  mine = Best{-INFINITY, INT32_MAX};
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    if (!isfinite(x[i])) continue;
    const float z = x[i] / temperature;
    if (candidate_key(z, static_cast<uint32_t>(i)) < floor) continue;
    if (min_p > 0 && !(exp(double(z) - z_max) >= min_p)) continue;
    mine = better(mine, Best{double(z) + gumbel(seed, counter, static_cast<uint32_t>(i)), static_cast<int32_t>(i)});
  }
  const Best drawn = block_best(mine, best_shared);
  if (threadIdx.x == 0) out[row] = drawn.id == INT32_MAX ? argmax : drawn.id;
}

}  // namespace

Status CudaBackend::sample(const Tensor& logits, const Tensor& params, const Tensor* adjust, const Tensor& out) {
  const int64_t n = logits.rows(), vocab = logits.cols();
  if (logits.type != GgmlType::F32 || logits.rank != 2 || params.type != GgmlType::I32 ||
      params.cols() != kSampleFields || params.rows() < n || !params.contiguous() || out.type != GgmlType::I32 ||
      out.n_elements() < n || !out.contiguous())
    return Status::errorf("cuda sample: logits {}, params {}, out {}", logits.describe(), params.describe(),
                          out.describe());
  if (n == 0) return Status::ok();
  const int64_t ld = logits.row_stride() / static_cast<int64_t>(sizeof(float));
  cudaStream_t s = impl_->stream;
  if (adjust && adjust->rows() > 0) {
    if (adjust->type != GgmlType::I32 || adjust->cols() != kAdjustFields || !adjust->contiguous())
      return Status::errorf("cuda sample: adjust {}", adjust->describe());
    const int64_t m = adjust->rows();
    cuda::launch_dependent(adjust_kernel, static_cast<unsigned>((m + 255) / 256), 256, 0, s,
                           static_cast<float*>(logits.data), ld, static_cast<const int32_t*>(adjust->data), m, n,
                           vocab);
    DSV4_CUDA_TRY_LAUNCH();
  }
  cuda::launch_dependent(sample_kernel, static_cast<unsigned>(n), kThreads, 0, s,
                         static_cast<const float*>(logits.data), ld, vocab, static_cast<const int32_t*>(params.data),
                         static_cast<int32_t*>(out.data));
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

}  // namespace dsv4::backend
