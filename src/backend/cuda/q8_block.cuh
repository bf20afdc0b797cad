// The one definition of the Q8 activation blocks (activation_quant.h): 32 values x share
// d = amax / 127 and are stored as q = round-half-even(x * (127 / amax)), amax = max |x|
// (q = 0 and d = 0 for an all-zero block). One IEEE division per block, a multiplication per
// value; |x * (127 / amax)| <= 127 * (1 + 2^-23) rounds to at most 127, so q fits an int8.
// Every kernel that quantises activations (activation_quant.cu, the fused routed-expert
// kernels, the tensor-core products) uses these functions, so the same activations give the
// same bits on every path. tests/cuda/cuda_test_util.h's q8_round_trip is the host mirror.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dsv4::cuda::detail {

// 127 / amax, or 0 for an all-zero block.
__device__ __forceinline__ float q8_inverse_scale(float amax) { return amax > 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f; }
__device__ __forceinline__ float q8_scale(float amax) { return __fdiv_rn(amax, 127.0f); }
__device__ __forceinline__ int q8_value(float x, float inverse_scale) { return __float2int_rn(__fmul_rn(x, inverse_scale)); }

// A block held one value per lane of a full warp. Returns this lane's q; d for every lane.
__device__ __forceinline__ int q8_quantize_warp(float x, float& d) {
  float amax = fabsf(x);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
  d = q8_scale(amax);
  return q8_value(x, q8_inverse_scale(amax));
}

// A block held whole by one thread: the 32 values to 8 packed words (value 4i + j in byte j
// of word i) and d.
__device__ __forceinline__ void q8_quantize_thread(const float (&x)[32], uint32_t (&q)[8], float& d) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(x[i]));
  d = q8_scale(amax);
  const float inv = q8_inverse_scale(amax);
#pragma unroll
  for (int w = 0; w < 8; ++w) {
    uint32_t packed = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) packed |= (static_cast<uint32_t>(q8_value(x[4 * w + j], inv)) & 0xFFu) << (8 * j);
    q[w] = packed;
  }
}

}  // namespace dsv4::cuda::detail
