// Prefill-size products: dequantise-to-BF16 + cuBLASLt, and the hand-written wgmma BF16
// kernel (gemm_wgmma.h), against cuBLASLt BF16 on weights already in BF16 (the same shapes,
// the same run), in TFLOP/s.
#include <cublasLt.h>

#include <cstdio>
#include <string>

#include "backend/cuda/gemm_prefill.h"
#include "backend/cuda/gemm_wgmma.h"
#include "bench_util.cuh"

using namespace dsv4;
using namespace dsv4::cuda;
using namespace dsv4::cuda::bench;

int main() {
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasLtHandle_t handle;
  if (cublasLtCreate(&handle) != CUBLAS_STATUS_SUCCESS) return 1;
  Buffer ws(kCublasLtWorkspaceBytes);
  struct Shape {
    const char* name;
    int64_t n, k;
  };
  const Shape shapes[] = {{"4096->1024", 1024, 4096}, {"1024->32768", 32768, 1024}, {"8192->4096", 4096, 8192},
                          {"4096->2048 (expert)", 2048, 4096}};
  for (int64_t m : {512, 4096}) {
    for (const Shape& s : shapes) {
      Buffer a(m * s.k * 2), c(m * s.n * 4), wb(s.n * s.k * 2);
      fill_weights(GgmlType::BF16, a.p, a.bytes, 3);
      fill_weights(GgmlType::BF16, wb.p, wb.bytes, 4);
      const double flops = 2.0 * m * s.n * s.k;
      const double base_us = time_us(stream, 
          [&] {
            check_status(gemm_bf16(handle, a.get<__nv_bfloat16>(), wb.get<__nv_bfloat16>(), c.get<float>(), m, s.n, s.k,
                                   ws.p, ws.bytes, stream),
                         "gemm_bf16");
          },
          10);
      const double base_tf = flops / base_us / 1e6;
      report("prefill", std::string("cuBLAS bf16 m=") + std::to_string(m) + " " + s.name, base_tf, "TFLOP/s", 1.0,
             std::to_string(base_us) + " us");
      const double wgmma_us = time_us(stream, 
          [&] {
            check_status(gemm_wgmma_bf16(a.get<__nv_bfloat16>(), wb.get<__nv_bfloat16>(), c.get<float>(), m, s.n, s.k,
                                         stream),
                         "gemm_wgmma_bf16");
          },
          10);
      const double wgmma_tf = flops / wgmma_us / 1e6;
      report("prefill", std::string("wgmma bf16 m=") + std::to_string(m) + " " + s.name, wgmma_tf, "TFLOP/s",
             wgmma_tf / base_tf, std::to_string(wgmma_us) + " us");
      for (GgmlType type : {GgmlType::Q8_0, GgmlType::Q2_K, GgmlType::MXFP4, GgmlType::IQ2_XXS}) {
        Buffer w(*ggml_row_bytes(type, s.k) * s.n);
        fill_weights(type, w.p, w.bytes, 5);
        const double deq_us = time_us(stream, 
            [&] { check_status(dequantize_to_bf16(type, w.p, s.n, s.k, wb.get<__nv_bfloat16>(), stream), "dequantize"); },
            10);
        const double us = time_us(stream, 
            [&] {
              check_status(gemm_prefill(handle, type, w.p, s.n, s.k, a.get<__nv_bfloat16>(), m, c.get<float>(),
                                        wb.get<__nv_bfloat16>(), ws.p, ws.bytes, stream),
                           "gemm_prefill");
            },
            10);
        const double tf = flops / us / 1e6;
        char note[160];
        std::snprintf(note, sizeof note, "%.1f us total, dequantise %.1f us (%.0f GB/s written+read)", us, deq_us,
                      (w.bytes + s.n * s.k * 2.0) / deq_us / 1e3);
        report("prefill", std::string(ggml_type_name(type)) + " dequant+cuBLAS m=" + std::to_string(m) + " " + s.name,
               tf, "TFLOP/s", tf / base_tf, note);
      }
    }
  }
  cublasLtDestroy(handle);
  BENCH_CUDA(cudaStreamDestroy(stream));
  return 0;
}
