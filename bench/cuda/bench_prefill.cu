// Prefill-size products: dequantise-to-BF16 + cuBLASLt, and the hand-written wgmma BF16
// kernel (gemm_wgmma.h), against cuBLASLt BF16 on weights already in BF16 (the same shapes,
// the same run), in TFLOP/s. Then the Float32 products (f32 x and weights: the compressors,
// index weights and router of a prefill chunk): cuBLASLt's fp32 GEMM against the split
// products of 3 and 6 BF16 terms (bf16_split.h; the splits of x and W included), in the f32
// product's TFLOP/s. DSV4_BENCH_ONLY=<regular expression>: run only the blocks whose label
// ("bf16 m=4096 4096->1024", "float32 m=512 4096->256 (router)", ...) it matches.
#include <cublasLt.h>

#include <cstdio>
#include <cstdlib>
#include <regex>
#include <string>

#include "backend/cuda/gemm_prefill.h"
#include "backend/cuda/gemm_wgmma.h"
#include "bench_util.cuh"

using namespace dsv4;
using namespace dsv4::cuda;
using namespace dsv4::cuda::bench;

int main() {
  const char* only = std::getenv("DSV4_BENCH_ONLY");
  const auto wanted = [&](const std::string& label) {
    return only == nullptr || std::regex_search(label, std::regex(only));
  };
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
      if (!wanted("bf16 m=" + std::to_string(m) + " " + s.name)) continue;
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
  const Shape f32_shapes[] = {{"4096->1024 (compressor)", 1024, 4096},
                              {"4096->256 (router)", 256, 4096},
                              {"4096->64 (index weights)", 64, 4096}};
  for (int64_t m : {512, 4096}) {
    for (const Shape& s : f32_shapes) {
      if (!wanted("float32 m=" + std::to_string(m) + " " + s.name)) continue;
      Buffer x(m * s.k * 4), w(s.n * s.k * 4), c(m * s.n * 4);
      Buffer xp(m * s.k * 2 * kBf16SplitMaxTerms), wp(s.n * s.k * 2 * kBf16SplitMaxTerms);
      fill_floats(x.get<float>(), m * s.k, 6);
      fill_floats(w.get<float>(), s.n * s.k, 7);
      const double flops = 2.0 * m * s.n * s.k;
      const std::string shape = " m=" + std::to_string(m) + " " + s.name;
      const double f32_us = time_us(stream,
          [&] {
            check_status(gemm_f32(handle, x.get<float>(), s.k, w.get<float>(), s.k, c.get<float>(), s.n, m, s.n, s.k,
                                  ws.p, ws.bytes, stream),
                         "gemm_f32");
          },
          10);
      const double f32_tf = flops / f32_us / 1e6;
      report("prefill", "float32 f32 GEMM" + shape, f32_tf, "TFLOP/s", 1.0, std::to_string(f32_us) + " us");
      for (int terms : {3, 6}) {
        const auto split_x = [&] {
          check_status(split_to_bf16(x.get<float>(), s.k, m, s.k, terms, Bf16SplitSide::activations,
                                     xp.get<__nv_bfloat16>(), stream),
                       "split_to_bf16");
        };
        const double split_us = time_us(stream, split_x, 10);
        const double us = time_us(stream,
            [&] {
              split_x();
              check_status(split_to_bf16(w.get<float>(), s.k, s.n, s.k, terms, Bf16SplitSide::weights,
                                         wp.get<__nv_bfloat16>(), stream),
                           "split_to_bf16");
              check_status(gemm_bf16_split(handle, xp.get<__nv_bfloat16>(), wp.get<__nv_bfloat16>(), c.get<float>(),
                                           s.n, m, s.n, s.k, terms, ws.p, ws.bytes, stream),
                           "gemm_bf16_split");
            },
            10);
        const double tf = flops / us / 1e6;
        char note[160];
        std::snprintf(note, sizeof note, "%.1f us total, x split %.1f us (%.0f GB/s read+written)", us, split_us,
                      (m * s.k * (4.0 + 2.0 * terms)) / split_us / 1e3);
        report("prefill", "float32 split " + std::to_string(terms) + " terms" + shape, tf, "TFLOP/s", tf / f32_tf,
               note);
      }
    }
  }
  cublasLtDestroy(handle);
  BENCH_CUDA(cudaStreamDestroy(stream));
  return 0;
}
