#include "backend/cuda/activation_quant.h"

#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/matvec.h"
#include "backend/cuda/q8_block.cuh"

namespace dsv4::cuda {

namespace {

size_t align256(size_t n) { return (n + 255) & ~size_t{255}; }

// One warp per 32 values: lane i holds element i.
__global__ void quantize_q8_kernel(const float* __restrict__ x, int64_t n_blocks, int64_t blocks_per_row,
                                   int64_t padded_k, int sub_per_unit, int lanes, int8_t* __restrict__ q,
                                   float* __restrict__ d, float* __restrict__ s16) {
  const int64_t block = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  asm volatile("griddepcontrol.wait;\n" ::: "memory");  // x comes from the previous kernel
  if (block >= n_blocks) return;
  const float v = x[block * 32 + lane];
  float scale;
  const int iq = detail::q8_quantize_warp(v, scale);
  int sum = iq;
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, o);  // within each half-warp

  const int64_t row = block / blocks_per_row, b = block % blocks_per_row;
  const int64_t unit = b / sub_per_unit, t = unit / lanes, slot = unit % lanes;
  const int64_t s = b % sub_per_unit;
  const int64_t chunk = (t * sub_per_unit + s) * 2 + (lane >> 4);
  q[row * padded_k + (chunk * lanes + slot) * 16 + (lane & 15)] = static_cast<int8_t>(iq);
  const int64_t at = row * (padded_k / 32) + (t * sub_per_unit + s) * lanes + slot;
  if (lane == 0) d[at] = scale;
  if ((lane & 15) == 0) s16[2 * at + (lane >> 4)] = scale * static_cast<float>(sum);
}

}  // namespace

int64_t padded_row_values(int64_t k, const ActivationLayout& layout) {
  const int64_t units = (k + layout.unit_weights - 1) / layout.unit_weights;
  return (units + layout.lanes - 1) / layout.lanes * layout.lanes * layout.unit_weights;
}

size_t quantized_activations_bytes(int64_t rows, int64_t k, const ActivationLayout& layout) {
  const size_t n = static_cast<size_t>(rows * padded_row_values(k, layout));
  return align256(n) + align256(n / 32 * sizeof(float)) + align256(n / 16 * sizeof(float));
}

QuantizedActivations quantized_activations_view(void* buffer, int64_t rows, int64_t k, const ActivationLayout& layout) {
  QuantizedActivations v;
  v.rows = rows;
  v.k = k;
  v.padded_k = padded_row_values(k, layout);
  v.layout = layout;
  const size_t n = static_cast<size_t>(rows * v.padded_k);
  auto* base = static_cast<uint8_t*>(buffer);
  v.q = reinterpret_cast<int8_t*>(base);
  v.d = reinterpret_cast<float*>(base + align256(n));
  v.s16 = reinterpret_cast<float*>(base + align256(n) + align256(n / 32 * sizeof(float)));
  return v;
}

Status quantize_activations_q8(const float* x, const QuantizedActivations& out, cudaStream_t stream) {
  if (out.k <= 0 || out.k % 32 != 0 || out.layout.unit_weights % 32 != 0 || out.layout.lanes < 1 ||
      out.layout.lanes > 32 || (out.layout.lanes & (out.layout.lanes - 1)) != 0)
    return Status::error("quantize_activations_q8: k = " + std::to_string(out.k) + ", units of " +
                         std::to_string(out.layout.unit_weights) + " over " + std::to_string(out.layout.lanes) +
                         " lanes: k and the unit must be multiples of 32, lanes a power of two up to 32");
  const int64_t n_blocks = out.rows * out.k / 32;
  if (n_blocks == 0) return Status::ok();
  constexpr int kThreads = 256;
  const int64_t grid = (n_blocks * 32 + kThreads - 1) / kThreads;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(grid));
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  cudaLaunchAttribute pdl{};
  pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl.val.programmaticStreamSerializationAllowed = 1;
  if (programmatic_launch()) {
    config.attrs = &pdl;
    config.numAttrs = 1;
  }
  DSV4_CUDA_TRY(cudaLaunchKernelEx(&config, quantize_q8_kernel, x, n_blocks, out.k / 32, out.padded_k,
                                   out.layout.unit_weights / 32, out.layout.lanes, out.q, out.d, out.s16));
  return Status::ok();
}

}  // namespace dsv4::cuda
