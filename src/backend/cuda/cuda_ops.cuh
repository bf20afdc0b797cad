// Shared by the CUDA backend's operation files: argument checks that turn a Tensor into a
// device matrix view (pointer, rows, columns, row stride in elements) with an error that
// names the operation and the argument, and a grid size for grid-stride kernels.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "backend/backend.h"
#include "util/status.h"

namespace dsv4::backend::cudaops {

template <class T>
struct Mat {
  T* p = nullptr;
  int64_t rows = 0, cols = 0;
  int64_t ld = 0;  // elements between rows
  __host__ __device__ T* row(int64_t r) const { return p + r * ld; }
};

// `t` as a matrix of `type` (F32 or I32) owned by `self`: at least `min_rows` rows (-1: any)
// and exactly `cols` columns (-1: any), elements contiguous within a row, the outer
// dimensions stacked evenly (rows() rows `row_stride()` bytes apart, as the CPU reads them).
template <class T>
Result<Mat<T>> matrix(const Tensor& t, const Backend* self, GgmlType type, const char* op, const char* arg,
                      int64_t min_rows, int64_t cols) {
  if (!t.valid()) return Status::errorf("{}: argument {} is empty", op, arg);
  if (t.backend != self)
    return Status::errorf(StatusCode::kInternal, "{}: argument {} ({}) belongs to another backend", op, arg,
                          t.describe());
  if (t.type != type)
    return Status::errorf("{}: argument {} is {}, expected type {}", op, arg, t.describe(), ggml_type_name(type));
  if (t.rank < 1 || (min_rows >= 0 && t.rows() < min_rows) || (cols >= 0 && t.cols() != cols))
    return Status::errorf("{}: argument {} is {}, expected [{}, {}]", op, arg, t.describe(), min_rows, cols);
  const int64_t elem = static_cast<int64_t>(sizeof(T));
  bool ok = t.stride[t.rank - 1] == elem && reinterpret_cast<uintptr_t>(t.data) % sizeof(T) == 0;
  if (t.rank >= 2) ok = ok && t.row_stride() % elem == 0 && t.row_stride() >= t.cols() * elem;
  for (int i = 0; i + 2 < t.rank; ++i) ok = ok && t.stride[i] == t.shape[i + 1] * t.stride[i + 1];
  if (!ok)
    return Status::errorf(StatusCode::kInternal, "{}: argument {} ({}) has a layout the CUDA backend cannot read", op,
                          arg, t.describe());
  Mat<T> m;
  m.p = static_cast<T*>(t.data);
  m.rows = t.rows();
  m.cols = t.cols();
  m.ld = t.rank >= 2 ? t.row_stride() / elem : m.cols;
  return m;
}

inline Result<Mat<float>> f32(const Tensor& t, const Backend* self, const char* op, const char* arg,
                              int64_t min_rows, int64_t cols) {
  return matrix<float>(t, self, GgmlType::F32, op, arg, min_rows, cols);
}
inline Result<Mat<int32_t>> i32(const Tensor& t, const Backend* self, const char* op, const char* arg,
                                int64_t min_rows, int64_t cols) {
  return matrix<int32_t>(t, self, GgmlType::I32, op, arg, min_rows, cols);
}

// Blocks for a grid-stride loop over `count` items.
inline unsigned grid_for(int64_t count, int threads = 256) {
  const int64_t blocks = (count + threads - 1) / threads;
  return static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, 65536));
}

#define DSV4_GRID_STRIDE(i, count)                                                        \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (count); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// Row-tiled element-wise kernels: blockIdx.x walks the rows, blockIdx.y tiles of columns,
// kRowTileThreads threads a tile. A flat grid-stride index needed a 64-bit division and modulo
// per element to find its row, and those divisions, not memory, set the time of a prefill
// chunk's conversions, additions and mHC expansions (issue 10's profile). A tile is one column
// per thread for a few rows (a decode row of 4096 columns spreads over 16 blocks; four columns
// a thread took hc_post from 4.1 to 10.5 us there, its in-place stores keeping one thread's
// steps apart), four from kRowTileWideFrom rows on (prefill: a quarter of the blocks). The
// kernel derives the tile's width from gridDim.y, one division per thread.
constexpr int kRowTileThreads = 256;
constexpr int64_t kRowTileWideFrom = 64;
inline dim3 row_tile_grid(int64_t rows, int64_t cols) {
  const int64_t width = (rows >= kRowTileWideFrom ? 4 : 1) * kRowTileThreads;
  const int64_t tiles = (cols + width - 1) / width;
  return dim3(static_cast<unsigned>(std::clamp<int64_t>(rows, 1, INT32_MAX)),
              static_cast<unsigned>(std::clamp<int64_t>(tiles, 1, 65535)), 1);
}

// Columns of the tile blockIdx.y of gridDim.y tiles over `cols` (a multiple of blockDim.x wide).
__device__ __forceinline__ int64_t row_tile_width(int64_t cols) {
  const int64_t per_tile = (cols + gridDim.y - 1) / gridDim.y;
  return (per_tile + blockDim.x - 1) / blockDim.x * blockDim.x;
}

#define DSV4_ROW_TILE(r, c, rows, cols)                                                                     \
  for (int64_t c##_width = ::dsv4::backend::cudaops::row_tile_width(cols),                                 \
               c##_end = ::std::min<int64_t>((cols), (blockIdx.y + 1) * c##_width),                        \
               r = blockIdx.x;                                                                              \
       r < (rows); r += gridDim.x)                                                                          \
    for (int64_t c = blockIdx.y * c##_width + threadIdx.x; c < c##_end; c += blockDim.x)

}  // namespace dsv4::backend::cudaops
