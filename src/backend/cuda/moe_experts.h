// The routed-expert feed-forward of one MoE layer on quantised weights: for each token its
// top_k selected experts, gate and up products with the clamped SwiGLU fused
// (h = w_e * silu(min(g, L)) * clamp(u, -L, L), the routing weight applied before the down
// product as the reference does), then the down products, summed over the top_k experts.
//
// 1-16 tokens (decode, kMoeDecodeMaxTokens), and up to 64 with at most 4 pairs an expert
// (moe_experts_fused_decode): moe_decode.cu's two kernels (gate/up with the activation and h
// quantisation fused in; down summing a token's experts in one block, no partial outputs) for
// Q8_0, Q2_K, Q3_K, Q4_K, Q6_K and MXFP4; up to 16, the matvec kernels' per-pair path otherwise
// (KernelChoice::moe_decode = false, or other types). More tokens (prefill, many sequences):
// pairs are sorted by expert on the device and each expert's rows are read once per tile of
// tokens: up to 8 or 64 tokens on the int8 tensor cores (mmq_kernel.cuh, the types of
// mma_matmul_supported), up to 8 through the dp4a kernel otherwise; partial outputs per pair
// are then summed in a fixed order, so results do not depend on the sort's order. Design and
// bounds: docs/CUDA.md.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "gguf/ggml_types.h"
#include "util/status.h"

namespace dsv4::cuda {

struct ExpertWeights {
  GgmlType gate_up_type = GgmlType::Q2_K;  // any matvec_supported type
  const void* gate = nullptr;              // [n_experts][ffn][hidden]
  const void* up = nullptr;                // [n_experts][ffn][hidden]
  GgmlType down_type = GgmlType::Q2_K;
  const void* down = nullptr;              // [n_experts][hidden][ffn]
  int64_t n_experts = 0;
  int64_t hidden = 0;
  int64_t ffn = 0;
};

// ids and weights: [tokens][top_k] on the device; every id must lie in [0, n_experts).
struct ExpertRouting {
  const int32_t* ids = nullptr;
  const float* weights = nullptr;
  int64_t tokens = 0;
  int top_k = 0;
};

// Tokens up to this count take the per-token path (moe_decode.cu: every pair streams its
// expert). At 16 tokens (96 pairs over ~81 distinct experts of V4-Flash) re-reading the few
// shared experts costs less than the tensor-core tiles of one or two pairs each did (2026-12-02
// profile of a 16-sequence step: 0.66 ms per layer, about 0.27 of the copy rate).
inline constexpr int64_t kMoeDecodeMaxTokens = 16;

// Up to this many tokens moe_decode.cu also runs where the pairs are spread thin (at most 4 an
// expert, where the tensor-core tiles take 8 columns for one or two pairs): 64 sequences of
// V4-Flash are 384 pairs over ~200 of 256 experts. Its gate/up blocks go row block first, so
// the pairs of one expert read the same rows at the same time and memory serves them once
// (KernelChoice::moe_decode_wide, moe_decode_rows_first).
inline constexpr int64_t kMoeDecodeWideMaxTokens = 64;

// Whether moe_experts runs these tokens through moe_decode.cu's fused kernels (the kernel
// choice, the token count and pairs per expert, the types and shapes).
bool moe_experts_fused_decode(const ExpertWeights& w, int64_t tokens, int top_k);

size_t moe_experts_workspace_bytes(const ExpertWeights& w, int64_t tokens, int top_k);

// x: [tokens][hidden] f32 (16-byte aligned); y: [tokens][hidden] f32 (overwritten). Weight
// buffers follow MatvecWeights' alignment rule.
Status moe_experts(const ExpertWeights& w, const float* x, const ExpertRouting& routing, float swiglu_limit,
                   float* y, void* workspace, size_t workspace_bytes, cudaStream_t stream);

namespace detail {
// The fused decode path (moe_decode.cu) on its own: 1-64 tokens, top_k <= 8, gate/up and down
// types among Q8_0, Q2_K, Q3_K, Q4_K, Q6_K, MXFP4 with whole one-row units per row.
bool moe_decode_applies(const ExpertWeights& w, int64_t tokens, int top_k);
size_t moe_decode_workspace_bytes(const ExpertWeights& w, int64_t tokens, int top_k);
Status moe_decode(const ExpertWeights& w, const float* x, const ExpertRouting& routing, float swiglu_limit, float* y,
                  void* workspace, size_t workspace_bytes, cudaStream_t stream);
// Kernel variants of moe_decode (moe_decode.cu's header), all with variant 0's bits: 0 the first
// kernels, 1 two rows a pass, 2 gate/up blocks of 8 warps (the default: the same speed at one
// token, +2% at 16 sequences on an H100, docs/PERFORMANCE.md's fifteenth run). Process-wide, read
// when kernels launch (set it before graphs are recorded); DSV4_MOE_DECODE_VARIANT gives the
// first value.
inline constexpr int kMoeDecodeVariants = 3;
inline constexpr int kMoeDecodeDefaultVariant = 2;
int moe_decode_variant();
void set_moe_decode_variant(int variant);
}  // namespace detail

}  // namespace dsv4::cuda
