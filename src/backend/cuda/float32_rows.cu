#include "backend/cuda/float32_rows.h"

#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/dependent_launch.cuh"
#include "util/float_formats.h"

namespace dsv4::cuda {
namespace {

template <GgmlType T>
constexpr int kUnit = T == GgmlType::F32 ? 4 : T == GgmlType::BF16 ? 8 : 32;

// acc += w . x over unit j of a row (its values in order), the weights decoded exactly
// (exact_decode.cuh's arithmetic).
template <GgmlType T>
__device__ __forceinline__ float unit_dot(const uint8_t* __restrict__ wrow, const float* __restrict__ xrow, int64_t j,
                                          float acc) {
  const auto* x4 = reinterpret_cast<const float4*>(xrow + j * kUnit<T>);
  if constexpr (T == GgmlType::F32) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(wrow) + j), b = __ldg(x4);
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
    acc = fmaf(a.z, b.z, acc);
    return fmaf(a.w, b.w, acc);
  } else if constexpr (T == GgmlType::BF16) {
    const uint4 a = __ldg(reinterpret_cast<const uint4*>(wrow) + j);
    const float4 b0 = __ldg(x4), b1 = __ldg(x4 + 1);
    const uint32_t words[4] = {a.x, a.y, a.z, a.w};
    const float xs[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc = fmaf(bf16_to_f32(static_cast<uint16_t>(words[i] & 0xFFFFu)), xs[2 * i], acc);
      acc = fmaf(bf16_to_f32(static_cast<uint16_t>(words[i] >> 16)), xs[2 * i + 1], acc);
    }
    return acc;
  } else {  // Q8_0: d (fp16), then 32 int8, 34 bytes a block (2-byte aligned)
    const auto* h = reinterpret_cast<const uint16_t*>(wrow + j * 34);
    uint16_t q[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) q[i] = __ldg(h + 1 + i);
    const float d = fp16_to_f32(__ldg(h));
    float4 b[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) b[i] = __ldg(x4 + i);
    const float* xs = reinterpret_cast<const float*>(b);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const auto lo = static_cast<int8_t>(q[i] & 0xFFu), hi = static_cast<int8_t>(q[i] >> 8);
      acc = fmaf(__fmul_rn(static_cast<float>(lo), d), xs[2 * i], acc);
      acc = fmaf(__fmul_rn(static_cast<float>(hi), d), xs[2 * i + 1], acc);
    }
    return acc;
  }
}

// The matrices of one launch (products of one x): outputs first[i] .. first[i + 1] - 1 of the
// grid are matrix i's.
struct Products {
  int count = 0;
  const uint8_t* w[kFloat32RowsMaxMatrices] = {};
  int64_t row_bytes[kFloat32RowsMaxMatrices] = {};
  float* y[kFloat32RowsMaxMatrices] = {};
  int64_t ldy[kFloat32RowsMaxMatrices] = {};
  int64_t first[kFloat32RowsMaxMatrices + 1] = {};
};

// Block (o, r) of `threads` (a power of two, 32..1024): thread t sums units t, t + threads, ...
// in order; the warps' sums by an xor tree, then warp 0 over the warp sums. o runs over the
// outputs of every matrix, so each output's sums are those of its matrix alone.
template <GgmlType T>
__global__ void __launch_bounds__(1024) float32_rows_kernel(const Products p, int64_t units,
                                                            const float* __restrict__ x, int64_t ldx) {
  ::dsv4::cuda::dependent_kernel_prologue();
  __shared__ float warp_sums[32];
  int i = 0;
  while (i + 1 < p.count && static_cast<int64_t>(blockIdx.x) >= p.first[i + 1]) ++i;
  const int64_t o = blockIdx.x - p.first[i], r = blockIdx.y;
  const uint8_t* wrow = p.w[i] + o * p.row_bytes[i];
  float* y = p.y[i] + r * p.ldy[i] + o;
  const float* xrow = x + r * ldx;
  float acc = 0.0f;
#pragma unroll 4
  for (int64_t j = threadIdx.x; j < units; j += blockDim.x) acc = unit_dot<T>(wrow, xrow, j, acc);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xFFFFFFFFu, acc, off));
  if (blockDim.x == 32) {
    if (threadIdx.x == 0) *y = acc;
    return;
  }
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  if (lane == 0) warp_sums[warp] = acc;
  __syncthreads();
  if (warp != 0) return;
  float v = lane < static_cast<int>(blockDim.x >> 5) ? warp_sums[lane] : 0.0f;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
  if (lane == 0) *y = v;
}

int unit_of(GgmlType type) {
  return type == GgmlType::F32 ? 4 : type == GgmlType::BF16 ? 8 : type == GgmlType::Q8_0 ? 32 : 0;
}

}  // namespace

bool float32_rows_applies(GgmlType type, const void* w, int64_t row_bytes, int64_t k, const float* x, int64_t ldx) {
  const int unit = unit_of(type);
  if (unit == 0 || k <= 0 || k % unit != 0 || ldx % 4 != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0) return false;
  const int64_t align = type == GgmlType::Q8_0 ? 2 : 16;
  return reinterpret_cast<uintptr_t>(w) % align == 0 && row_bytes % align == 0;
}

int float32_rows_threads(GgmlType type, int64_t k) {
  // About four units a thread: a power of two from one warp to 1024 threads.
  const int unit = unit_of(type);
  const int64_t units = unit > 0 ? k / unit : 0;
  int threads = 32;
  while (threads < 1024 && int64_t{threads} * 4 < units) threads *= 2;
  return threads;
}

Status float32_rows_matmul_many(GgmlType type, std::span<const Float32Matrix> ms, int64_t k, const float* x,
                                int64_t ldx, int64_t m, cudaStream_t stream) {
  const auto refuse = [&](const std::string& why) {
    return Status::error("float32_rows_matmul: " + std::string(ggml_type_name(type)) + " " + std::to_string(m) +
                         " rows x " + std::to_string(ms.size()) + " matrices of " + std::to_string(k) +
                         " columns: " + why + " (rows 1.." + std::to_string(kFloat32RowsMax) + ", 1.." +
                         std::to_string(kFloat32RowsMaxMatrices) +
                         " matrices, F32/BF16/Q8_0, whole units of k, aligned rows)");
  };
  if (ms.empty() || ms.size() > static_cast<size_t>(kFloat32RowsMaxMatrices) || m < 1 || m > kFloat32RowsMax)
    return refuse("out of range");
  Products p;
  p.count = static_cast<int>(ms.size());
  for (int i = 0; i < p.count; ++i) {
    const Float32Matrix& mat = ms[i];
    if (!float32_rows_applies(type, mat.w, mat.row_bytes, k, x, ldx) || mat.n < 1) return refuse("matrix " + std::to_string(i));
    p.w[i] = static_cast<const uint8_t*>(mat.w);
    p.row_bytes[i] = mat.row_bytes;
    p.y[i] = mat.y;
    p.ldy[i] = mat.ldy;
    p.first[i + 1] = p.first[i] + mat.n;
  }
  if (p.first[p.count] > INT32_MAX) return refuse("too many outputs");
  const int64_t units = k / unit_of(type);
  const int threads = float32_rows_threads(type, k);
  const dim3 grid(static_cast<unsigned>(p.first[p.count]), static_cast<unsigned>(m), 1);
  if (type == GgmlType::F32)
    launch_dependent(float32_rows_kernel<GgmlType::F32>, grid, threads, 0, stream, p, units, x, ldx);
  else if (type == GgmlType::BF16)
    launch_dependent(float32_rows_kernel<GgmlType::BF16>, grid, threads, 0, stream, p, units, x, ldx);
  else
    launch_dependent(float32_rows_kernel<GgmlType::Q8_0>, grid, threads, 0, stream, p, units, x, ldx);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

Status float32_rows_matmul(GgmlType type, const void* w, int64_t row_bytes, int64_t n, int64_t k, const float* x,
                           int64_t ldx, int64_t m, float* y, int64_t ldy, cudaStream_t stream) {
  const Float32Matrix one{w, row_bytes, n, y, ldy};
  return float32_rows_matmul_many(type, std::span<const Float32Matrix>(&one, 1), k, x, ldx, m, stream);
}

}  // namespace dsv4::cuda
