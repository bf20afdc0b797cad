// Routed experts for prefill-size batches on Hopper's warpgroup tensor cores (wgmma, BF16):
// the expert-sorted tiles of moe_experts.cu, up to 128 pairs of one expert per tile, each
// block multiplying 256 weight rows of that expert (Q8_0: 128; gate/up: half gate rows and
// the same rows of up) by the tile's activation rows. The weights are decoded from their
// GGUF blocks straight into the wgmma A fragments in registers (no dequantised copy in
// memory), the activations are BF16 rows gathered into shared memory by cp.async, the
// products accumulate in f32. Gate/up fuse the clamped SwiGLU and the routing weight and
// write h in BF16, the down product's operand; down writes one partial row per pair, which
// moe_experts.cu sums over a token's slots in a fixed order. Design and error bound:
// docs/CUDA.md, "Routed experts on wgmma".
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/moe_experts.h"
#include "util/status.h"

namespace dsv4::cuda::detail {

inline constexpr int kMoeWgmmaTileTokens = 128;  // pairs per expert tile
// A tile costs about the same whatever its pairs (the decode of the expert's weights): one
// V4-Flash layer took 4.0 / 4.2 / 4.3 ms on wgmma at 512 / 1024 / 2048 tokens (12 / 24 / 48
// pairs per expert) against 6.0 / 7.7 / 10.6 ms on the int8 tiles (docs/PERFORMANCE.md, ninth
// run; with the pair decoders of the twentieth run 2.8 ms at 512 tokens on an H100, against 2.1 ms
// for the int8 tiles at 128 tokens). Below about 8 pairs per expert the int8 tiles of 8 pairs
// read less.
inline constexpr int64_t kMoeWgmmaMinPairsPerExpert = 8;

// Q2_K, Q3_K, Q8_0.
bool moe_wgmma_supported(GgmlType type);

// Both types supported, hidden and ffn multiples of 256 (one K-quant super-block per stage;
// the row tiles then divide them), and at least kMoeWgmmaMinPairsPerExpert pairs per expert
// on average (fewer: the int8 tiles of mmq_kernel.cuh).
bool moe_wgmma_applies(const ExpertWeights& w, int64_t pairs);

// Expert tiles: the pairs counting-sorted by expert (moe_experts.cu's sort_into_tiles), cut
// into tiles of at most tile_rows pairs of one expert (here kMoeWgmmaTileTokens).
struct ExpertTiles {
  const int* sorted_pairs = nullptr;
  const int* tile_expert = nullptr;
  const int* tile_first = nullptr;
  const int* tile_count = nullptr;
  const int* n_tiles = nullptr;  // device count; the grid covers max_tiles
  int64_t max_tiles = 0;
};

// h[pair][i] = w_pair * silu(min(gate_i . x, L)) * clamp(up_i . x, -L, L), in BF16, for the
// pairs of every tile; x: [tokens][hidden] BF16, pair p reads row p / top_k.
Status moe_wgmma_gate_up(const ExpertWeights& w, const __nv_bfloat16* x, const float* pair_weight, int top_k,
                         float limit, const ExpertTiles& tiles, __nv_bfloat16* h, cudaStream_t stream);

// partial[pair][i] = down_i . h[pair], f32.
Status moe_wgmma_down(const ExpertWeights& w, const __nv_bfloat16* h, const ExpertTiles& tiles, float* partial,
                      cudaStream_t stream);

}  // namespace dsv4::cuda::detail
