// Backend::finish_rows on the device (backend.h RowFinish): one block takes one group of a
// row (a head, a compressed entry) into shared memory and runs RMSNorm, RoPE, the Hadamard
// rotation and the QAT rounding on it there, one pass over global memory instead of one per
// step. Each step is the arithmetic of its standalone kernel (cuda_backend.cu: rms_norm_kernel,
// rope_kernel, round_fp4_kernel; hadamard_kernel and round_fp8_kernel call the functions
// below), and the block has the
// thread count rms_norm_kernel gives the group's width, so the norm's sum runs in the same
// order: the fused pipeline gives the bits of the separate launches (tests/cuda, RowFinish).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "backend/cuda/block_reduce.cuh"
#include "backend/cuda/reference_math.cuh"
#include "util/float_formats.h"

namespace dsv4::cuda::finish {

enum Round : int { kRoundNone = 0, kRoundFp8 = 1, kRoundFp4 = 2 };
inline constexpr int64_t kMaxGroup = 8192;  // one group in 32 KB of shared memory

// The device side of a RowFinish.
struct Spec {
  int64_t group = 0;
  bool norm = false;
  const float* norm_weight = nullptr;  // or unweighted
  float eps = 0.0f;
  int rope_dims = 0;                   // 0: no RoPE
  const float* omega = nullptr;        // [rope_dims / 2]
  bool hadamard = false;
  int round = kRoundNone;
  int64_t round_cols = 0, round_block = 0;
};

// Threads rms_norm_kernel's launch gives a group of `width` values (about four a thread).
inline int threads_for(int64_t width) {
  return static_cast<int>(std::clamp<int64_t>((width / 4 + 31) / 32 * 32, 64, 1024));
}

// cpu::hadamard's butterflies stage by stage on v (shared memory, `width` values, a power of
// two) by the whole block, then the scale width^-1/2. Starts with v complete; ends with the
// block synchronised.
__device__ inline void hadamard_in_shared(float* v, int64_t width) {
  for (int64_t h = 1; h < width; h *= 2) {
    for (int64_t t = threadIdx.x; t < width / 2; t += blockDim.x) {
      const int64_t j = (t / h) * 2 * h + t % h;  // the butterfly (j, j + h) of pair t
      const float a = v[j], b = v[j + h];
      v[j] = __fadd_rn(a, b);
      v[j + h] = __fsub_rn(a, b);
    }
    __syncthreads();
  }
  const float sc = __fdiv_rn(1.0f, __fsqrt_rn(static_cast<float>(width)));
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) v[i] = __fmul_rn(v[i], sc);
  __syncthreads();
}

// cpu::round_fp8_block on the `block` values at p by one warp (every lane calls it). The same
// values as the one-thread reference: amax starts at 0 and std_max never takes a NaN in (so
// the lanes' partial maxima combine in any order), and each element's rounding depends only
// on it and the scale.
__device__ inline void round_fp8_warp(float* p, int64_t block, int lane) {
  float amax = 0.0f;
  for (int64_t i = lane; i < block; i += 32) amax = ref::std_max(amax, ref::abs(p[i]));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = ref::std_max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
  amax = ref::std_max(amax, 1e-4f);
  const float sc = ref::pow2_ceil(ref::mul(amax, 1.0f / kE4M3Max));
  for (int64_t i = lane; i < block; i += 32) {
    const float r = ref::std_clamp(ref::div(p[i], sc), -kE4M3Max, kE4M3Max);
    p[i] = ref::mul(e4m3_to_f32(f32_to_e4m3(r)), sc);
  }
}

// cpu::round_fp4_block on the `block` values at p by one warp, as round_fp8_warp: the same
// values as the one-thread reference (ref::round_fp4_block), whose ~1000-instruction chain per
// 32 values (one thread a block) was most of the indexer queries' finish at one row.
__device__ inline void round_fp4_warp(float* p, int64_t block, int lane) {
  float amax = 0.0f;
  for (int64_t i = lane; i < block; i += 32) amax = ref::std_max(amax, ref::abs(p[i]));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = ref::std_max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
  amax = ref::std_max(amax, 6.0f * 0x1p-126f);
  const float sc = ref::pow2_ceil(ref::mul(amax, 1.0f / 6.0f));
  for (int64_t i = lane; i < block; i += 32) {
    const float r = ref::std_clamp(ref::div(p[i], sc), -6.0f, 6.0f);
    p[i] = ref::mul(e2m1_to_f32(f32_to_e2m1(r)), sc);
  }
}

// In place on the group v (shared memory, s.group floats) by the whole block; the RoPE at
// `position`. Begins and ends with the block synchronised.
__device__ inline void finish_group(float* v, const Spec& s, int32_t position) {
  const int64_t width = s.group;
  __syncthreads();  // v complete
  if (s.norm) {
    double ss = 0.0;
#pragma unroll 4
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) ss += static_cast<double>(v[i]) * v[i];
    const float r = ref::inverse_rms(block_sum(ss), width, s.eps);  // block_sum synchronises
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
      const float t = __fmul_rn(v[i], r);
      v[i] = s.norm_weight != nullptr ? __fmul_rn(t, s.norm_weight[i]) : t;
    }
    __syncthreads();
  }
  if (s.rope_dims > 0) {
    const int half = s.rope_dims / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x)
      ref::rope_pair(v + width - s.rope_dims + 2 * i, position, s.omega[i], false);
    __syncthreads();
  }
  if (s.hadamard) hadamard_in_shared(v, width);
  if (s.round != kRoundNone) {
    // A warp per block of columns, as round_fp8_kernel and round_fp4_kernel.
    const int lane = static_cast<int>(threadIdx.x & 31), warps = static_cast<int>(blockDim.x / 32);
    const int64_t blocks = (s.round == kRoundFp8 ? s.round_cols : width) / s.round_block;
    for (int64_t b = threadIdx.x / 32; b < blocks; b += warps) {
      if (s.round == kRoundFp8) round_fp8_warp(v + b * s.round_block, s.round_block, lane);
      else round_fp4_warp(v + b * s.round_block, s.round_block, lane);
    }
    __syncthreads();
  }
}

}  // namespace dsv4::cuda::finish
