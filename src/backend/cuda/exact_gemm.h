// The Exact-mode matrix product of the CUDA backend: y[r][o] = sum_k w[o][k] * x[r][k] with
// the weights decoded exactly (exact_decode.cuh) and every product and sum in fp32, in the
// CPU backend's order, so the result is bit-identical to CpuBackend::matmul (Exact) on an
// AVX2 host (gguf/quant_avx2.cpp, dot_blocks / dot_levels / dot_plain):
//
//   32 partial sums a_l, l = k mod 32, each an fmaf chain over its k in increasing order
//   (plain types: the 8-wide tail chunks past the last 32 go into a_0..a_7), then
//   v_j = (a_j + a_{8+j}) + (a_{16+j} + a_{24+j}), s_j = v_j + v_{j+4},
//   y = (s_0 + s_2) + (s_1 + s_3), then the last k mod 8 products (plain types) by fmaf.
//
// A warp computes one output feature for up to TM activation rows: lane l holds a_l of every
// row, so each weight is decoded once per TM rows. Nothing depends on the number of rows,
// the tile or the batch (the backend's batch invariance, backend.h).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "backend/cuda/exact_decode.cuh"
#include "gguf/ggml_types.h"
#include "util/status.h"

namespace dsv4::cuda {

struct ExactWeights {
  GgmlType type = GgmlType::F32;  // exact::supported() except I32
  const void* data = nullptr;     // [batch][n][k]: rows row_bytes apart, matrices matrix_bytes apart
  int64_t n = 0;
  int64_t k = 0;
  int64_t row_bytes = 0;
  int64_t matrix_bytes = 0;       // grouped products only
  exact::Tables tables;
};

// Dense: rows r < m of x (row stride ldx floats) to rows of y (ldy).
Status exact_matmul(const ExactWeights& w, const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy,
                    cudaStream_t stream);

// Grouped (routed experts): tiles of at most kExactTileRows (token, slot) pairs of one expert,
// built on the device by build_expert_tiles. Pair p of a tile reads x row p / x_row_div and
// writes y row p; the weights are matrix tile_expert[t].
inline constexpr int kExactTileRows = 16;

struct ExpertTiles {
  const int* n_tiles = nullptr;  // device scalar
  const int* tile_expert = nullptr;
  const int* tile_first = nullptr;
  const int* tile_count = nullptr;
  const int* sorted_pairs = nullptr;
  int64_t max_tiles = 0;
};

// Upper bound on the tiles build_expert_tiles makes for `pairs` pairs.
int64_t exact_max_tiles(int64_t pairs, int64_t n_experts);
// Bytes of the tables (256-byte aligned pieces).
size_t expert_tiles_bytes(int64_t pairs, int64_t max_tiles);
// Counting sort of the pairs by expert (ids [pairs]; ids outside [0, n_experts) are left
// out and flagged in *errors with error_bit), tiles of at most kExactTileRows pairs.
Status build_expert_tiles(const int32_t* ids, int64_t pairs, int64_t n_experts, void* buffer, int64_t max_tiles,
                          ExpertTiles& out, uint32_t* errors, uint32_t error_bit, cudaStream_t stream);

Status exact_matmul_grouped(const ExactWeights& w, const float* x, int64_t ldx, int x_row_div, float* y,
                            int64_t ldy, const ExpertTiles& tiles, cudaStream_t stream);

}  // namespace dsv4::cuda
