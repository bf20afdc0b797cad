// The two ceilings the benchmarks divide by (docs/PERFORMANCE.md), measured on the device in
// the same run as the figures they bound: the copy bandwidth for memory-bound work (decode)
// and the BF16 tensor-core rate for compute-bound work (prefill). Random data, never zeros
// (a product on zeros runs faster); CUDA events; the median of repeats after a warm-up.
#pragma once

#include <cstdint>

#include "util/status.h"

namespace dsv4::cuda {

// A device-to-device copy of `bytes` of random data: (bytes read + bytes written) per second,
// in GB/s (1e9). Allocates 2 x bytes for the call.
Result<double> measure_copy_bandwidth(uint64_t bytes = uint64_t{2} << 30, int repeats = 7);

// C[m][n] f32 = A[m][k] bf16 . W[n][k]^T bf16 through cuBLASLt (gemm_prefill.h's gemm_bf16)
// on random inputs: 2 m n k per second, in TFLOP/s (1e12).
Result<double> measure_bf16_gemm_tflops(int64_t m = 8192, int64_t n = 8192, int64_t k = 8192, int repeats = 7);

}  // namespace dsv4::cuda
