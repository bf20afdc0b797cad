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

// Row-tiled element-wise kernels: blockIdx.x walks the rows, blockIdx.y tiles of
// kRowTileCols columns, one column per thread. A flat grid-stride index needed a 64-bit
// division and modulo per element to find its row, and those divisions, not memory, set the
// time of a prefill chunk's conversions, additions and mHC expansions (issue 10's profile).
// One column per thread, not several: a decode row (4096 columns) then still spreads over 16
// blocks, and kernels that update in place (hc_post, RoPE, add) cannot overlap the steps of
// one thread, whose stores may alias its next loads (four per thread took hc_post from 4.1
// to 10.5 us a decode row, tenth run).
constexpr int kRowTileThreads = 256, kRowTileCols = kRowTileThreads;
inline dim3 row_tile_grid(int64_t rows, int64_t cols) {
  const int64_t tiles = (cols + kRowTileCols - 1) / kRowTileCols;
  return dim3(static_cast<unsigned>(std::clamp<int64_t>(rows, 1, INT32_MAX)),
              static_cast<unsigned>(std::clamp<int64_t>(tiles, 1, 65535)), 1);
}

#define DSV4_ROW_TILE(r, c, rows, cols)                                                                   \
  for (int64_t r = blockIdx.x; r < (rows); r += gridDim.x)                                               \
    for (int64_t c = static_cast<int64_t>(blockIdx.y) * ::dsv4::backend::cudaops::kRowTileCols + threadIdx.x; \
         c < (cols); c += static_cast<int64_t>(gridDim.y) * ::dsv4::backend::cudaops::kRowTileCols)

}  // namespace dsv4::backend::cudaops
