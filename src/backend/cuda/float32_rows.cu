#include "backend/cuda/float32_rows.h"

#include <string>

#include "backend/cuda/cp_async.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/dependent_launch.cuh"
#include "util/float_formats.h"

namespace dsv4::cuda {
namespace {

template <GgmlType T>
constexpr int kUnit = T == GgmlType::F32 ? 4 : T == GgmlType::BF16 ? 8 : 32;

// acc += w . x over unit j of a row (its values in order), the weights decoded exactly
// (exact_decode.cuh's arithmetic).
template <GgmlType T>
__device__ __forceinline__ float unit_dot(const uint8_t* __restrict__ wrow, const float* __restrict__ xrow, int64_t j,
                                          float acc) {
  const auto* x4 = reinterpret_cast<const float4*>(xrow + j * kUnit<T>);
  if constexpr (T == GgmlType::F32) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(wrow) + j), b = __ldg(x4);
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
    acc = fmaf(a.z, b.z, acc);
    return fmaf(a.w, b.w, acc);
  } else if constexpr (T == GgmlType::BF16) {
    const uint4 a = __ldg(reinterpret_cast<const uint4*>(wrow) + j);
    const float4 b0 = __ldg(x4), b1 = __ldg(x4 + 1);
    const uint32_t words[4] = {a.x, a.y, a.z, a.w};
    const float xs[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc = fmaf(bf16_to_f32(static_cast<uint16_t>(words[i] & 0xFFFFu)), xs[2 * i], acc);
      acc = fmaf(bf16_to_f32(static_cast<uint16_t>(words[i] >> 16)), xs[2 * i + 1], acc);
    }
    return acc;
  } else {  // Q8_0: d (fp16), then 32 int8, 34 bytes a block (2-byte aligned)
    const auto* h = reinterpret_cast<const uint16_t*>(wrow + j * 34);
    uint16_t q[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) q[i] = __ldg(h + 1 + i);
    const float d = fp16_to_f32(__ldg(h));
    float4 b[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) b[i] = __ldg(x4 + i);
    const float* xs = reinterpret_cast<const float*>(b);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const auto lo = static_cast<int8_t>(q[i] & 0xFFu), hi = static_cast<int8_t>(q[i] >> 8);
      acc = fmaf(__fmul_rn(static_cast<float>(lo), d), xs[2 * i], acc);
      acc = fmaf(__fmul_rn(static_cast<float>(hi), d), xs[2 * i + 1], acc);
    }
    return acc;
  }
}

// The matrices of one launch (products of one x): outputs first[i] .. first[i + 1] - 1 of the
// grid are matrix i's.
struct Products {
  int count = 0;
  const uint8_t* w[kFloat32RowsMaxMatrices] = {};
  int64_t row_bytes[kFloat32RowsMaxMatrices] = {};
  float* y[kFloat32RowsMaxMatrices] = {};
  int64_t ldy[kFloat32RowsMaxMatrices] = {};
  int64_t first[kFloat32RowsMaxMatrices + 1] = {};
};

// Block (o, r) of `threads` (a power of two, 32..1024): thread t sums units t, t + threads, ...
// in order; the warps' sums by an xor tree, then warp 0 over the warp sums. o runs over the
// outputs of every matrix, so each output's sums are those of its matrix alone.
template <GgmlType T>
__global__ void __launch_bounds__(1024) float32_rows_kernel(const Products p, int64_t units,
                                                            const float* __restrict__ x, int64_t ldx) {
  ::dsv4::cuda::dependent_kernel_prologue();
  __shared__ float warp_sums[32];
  int i = 0;
  while (i + 1 < p.count && static_cast<int64_t>(blockIdx.x) >= p.first[i + 1]) ++i;
  const int64_t o = blockIdx.x - p.first[i], r = blockIdx.y;
  const uint8_t* wrow = p.w[i] + o * p.row_bytes[i];
  float* y = p.y[i] + r * p.ldy[i] + o;
  const float* xrow = x + r * ldx;
  float acc = 0.0f;
#pragma unroll 4
  for (int64_t j = threadIdx.x; j < units; j += blockDim.x) acc = unit_dot<T>(wrow, xrow, j, acc);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xFFFFFFFFu, acc, off));
  if (blockDim.x == 32) {
    if (threadIdx.x == 0) *y = acc;
    return;
  }
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  if (lane == 0) warp_sums[warp] = acc;
  __syncthreads();
  if (warp != 0) return;
  float v = lane < static_cast<int>(blockDim.x >> 5) ? warp_sums[lane] : 0.0f;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
  if (lane == 0) *y = v;
}

// Q8_0 weights with k <= 4096 (one warp an output: at most 128 blocks of 32, lane l sums
// units l, l + 32, ...) and 2-64 rows: the compressors of a batched decode or a verify step.
// The kernel above reads each weight row once per row of x and loads x with a 128-byte stride
// between lanes (one cache line a lane); here a block of 4 warps takes 16 outputs (4 a warp)
// and 8 rows, k in chunks of 32 units through two shared-memory buffers filled by cp.async
// one chunk ahead: the rows' x laid out so that lane l reads its unit's values as float4s
// without bank conflicts, and the 16 outputs' blocks of the chunk (each output's span copied
// whole from the 16-byte boundary below it). Each weight block is decoded once for the 8
// rows. Every (output, row) sum is the same chain as the kernel above (lane l: units l,
// l + 32, ... in order, each block's 32 products in order, the same __fmul_rn and fmaf), then
// the same xor tree: the same bits.
constexpr int kTileWarps = 4;
constexpr int kTileThreads = 32 * kTileWarps;
constexpr int kTileOutputsPerWarp = 4;
constexpr int kTileOutputs = kTileWarps * kTileOutputsPerWarp;
constexpr int kTileRows = 8;
constexpr int kTileUnitStride = 36;  // floats per lane's unit in shared memory (32 + 4: float4 reads spread)
constexpr int kTileXBytes = kTileRows * 32 * kTileUnitStride * 4;
constexpr int kTileSpanBytes = 16 * ((15 + 32 * 34 + 15) / 16);  // an output's 32 blocks from below a 16-byte boundary
constexpr int kTileBufferBytes = kTileXBytes + kTileOutputs * kTileSpanBytes;
constexpr size_t kTileSmemBytes = 2 * size_t{kTileBufferBytes};

__global__ void __launch_bounds__(kTileThreads) float32_rows_q8_tile_kernel(const Products p, int64_t units,
                                                                           const float* __restrict__ x, int64_t ldx,
                                                                           int64_t m) {
  ::dsv4::cuda::dependent_kernel_prologue();
  extern __shared__ __align__(16) uint8_t tile_smem[];  // two buffers: x [row][lane][36] f32, then spans [output]
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t total = p.first[p.count];
  const int64_t first_output = static_cast<int64_t>(blockIdx.x) * kTileOutputs;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTileRows;
  const int rows = static_cast<int>(min(static_cast<int64_t>(kTileRows), m - row0));

  // Output b of the block (past the last output: the last one, not stored): its weight row.
  auto weight_row = [&](int b, int* matrix, int64_t* local) {
    const int64_t o = min(total - 1, first_output + b);
    int i = 0;
    while (i + 1 < p.count && o >= p.first[i + 1]) ++i;
    *matrix = i;
    *local = o - p.first[i];
    return p.w[i] + *local * p.row_bytes[i];
  };

  // Chunk q's copies into buffer q % 2: x values 1024q .. of each row (float4 f of a row goes to
  // lane f / 8's unit, values 4 (f % 8) ..), and each output's blocks 32q .. 32q + 31.
  auto issue = [&](int64_t q) {
    uint8_t* buffer = tile_smem + (q % 2) * kTileBufferBytes;
    auto* xs = reinterpret_cast<float*>(buffer);
    const int chunk_units = static_cast<int>(min(int64_t{32}, units - 32 * q));
    const int per_row = 8 * chunk_units;
    for (int r = 0; r < rows; ++r) {
      const auto* src = reinterpret_cast<const float4*>(x + (row0 + r) * ldx + 1024 * q);
      for (int f = static_cast<int>(threadIdx.x); f < per_row; f += kTileThreads)
        cp_async16(&xs[(r * 32 + f / 8) * kTileUnitStride + 4 * (f % 8)], src + f);
    }
    const int span_chunks = kTileSpanBytes / 16;
    for (int e = static_cast<int>(threadIdx.x); e < kTileOutputs * span_chunks; e += kTileThreads) {
      const int b = e / span_chunks, c = e % span_chunks;
      int matrix;
      int64_t local;
      const uint8_t* begin = weight_row(b, &matrix, &local) + 32 * q * 34;
      const uint8_t* aligned = reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(begin) & ~uintptr_t{15});
      if (aligned + 16 * c < begin + 34 * chunk_units)
        cp_async16(buffer + kTileXBytes + b * kTileSpanBytes + 16 * c, aligned + 16 * c);
    }
    cp_async_commit();
  };

  int matrix[kTileOutputsPerWarp];
  int64_t local[kTileOutputsPerWarp];
  int skew[kTileOutputsPerWarp];  // where output u's span starts in its slot, chunk by chunk (34 * 32 bytes apart: 0 mod 16)
#pragma unroll
  for (int u = 0; u < kTileOutputsPerWarp; ++u)
    skew[u] = static_cast<int>(
        reinterpret_cast<uintptr_t>(weight_row(warp * kTileOutputsPerWarp + u, &matrix[u], &local[u])) & 15);

  float acc[kTileOutputsPerWarp][kTileRows];
#pragma unroll
  for (int u = 0; u < kTileOutputsPerWarp; ++u)
#pragma unroll
    for (int r = 0; r < kTileRows; ++r) acc[u][r] = 0.0f;

  const int64_t chunks = (units + 31) / 32;
  issue(0);
  for (int64_t q = 0; q < chunks; ++q) {
    if (q + 1 < chunks) {
      issue(q + 1);  // into the buffer chunk q - 1 used: every warp left it at the barrier below
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // chunk q's bytes, every thread's copies
    const int chunk_units = static_cast<int>(min(int64_t{32}, units - 32 * q));
    if (lane < chunk_units) {
      const uint8_t* buffer = tile_smem + (q % 2) * kTileBufferBytes;
      const auto* xs = reinterpret_cast<const float*>(buffer);
      const uint8_t* block[kTileOutputsPerWarp];
      float d[kTileOutputsPerWarp];
#pragma unroll
      for (int u = 0; u < kTileOutputsPerWarp; ++u) {
        block[u] = buffer + kTileXBytes + (warp * kTileOutputsPerWarp + u) * kTileSpanBytes + skew[u] + 34 * lane;
        d[u] = fp16_to_f32(*reinterpret_cast<const uint16_t*>(block[u]));
      }
#pragma unroll
      for (int part = 0; part < 4; ++part) {  // 8 values of the block at a time
        float w[kTileOutputsPerWarp][8];
#pragma unroll
        for (int u = 0; u < kTileOutputsPerWarp; ++u)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const uint16_t pair = reinterpret_cast<const uint16_t*>(block[u])[1 + 4 * part + i];
            w[u][2 * i] = __fmul_rn(static_cast<float>(static_cast<int8_t>(pair & 0xFFu)), d[u]);
            w[u][2 * i + 1] = __fmul_rn(static_cast<float>(static_cast<int8_t>(pair >> 8)), d[u]);
          }
#pragma unroll
        for (int r = 0; r < kTileRows; ++r) {
          if (r >= rows) break;
          const float* xv = &xs[(r * 32 + lane) * kTileUnitStride + 8 * part];
          const float4 a = *reinterpret_cast<const float4*>(xv), b = *reinterpret_cast<const float4*>(xv + 4);
          const float xr[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
          for (int u = 0; u < kTileOutputsPerWarp; ++u)
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[u][r] = fmaf(w[u][i], xr[i], acc[u][r]);
        }
      }
    }
    __syncthreads();  // every warp is done with buffer q % 2 before chunk q + 2 is issued into it
  }

  // The kernel above's xor tree for every (output, row); lane 0 stores.
#pragma unroll
  for (int u = 0; u < kTileOutputsPerWarp; ++u)
#pragma unroll
    for (int r = 0; r < kTileRows; ++r) {
      if (r >= rows) break;
      float v = acc[u][r];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
      const int64_t o = first_output + warp * kTileOutputsPerWarp + u;
      if (lane == 0 && o < total) p.y[matrix[u]][(row0 + r) * p.ldy[matrix[u]] + local[u]] = v;
    }
}

int unit_of(GgmlType type) {
  return type == GgmlType::F32 ? 4 : type == GgmlType::BF16 ? 8 : type == GgmlType::Q8_0 ? 32 : 0;
}

}  // namespace

bool float32_rows_applies(GgmlType type, const void* w, int64_t row_bytes, int64_t k, const float* x, int64_t ldx) {
  const int unit = unit_of(type);
  if (unit == 0 || k <= 0 || k % unit != 0 || ldx % 4 != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0) return false;
  const int64_t align = type == GgmlType::Q8_0 ? 2 : 16;
  return reinterpret_cast<uintptr_t>(w) % align == 0 && row_bytes % align == 0;
}

int float32_rows_threads(GgmlType type, int64_t k) {
  // About four units a thread: a power of two from one warp to 1024 threads.
  const int unit = unit_of(type);
  const int64_t units = unit > 0 ? k / unit : 0;
  int threads = 32;
  while (threads < 1024 && int64_t{threads} * 4 < units) threads *= 2;
  return threads;
}

Status float32_rows_matmul_many(GgmlType type, std::span<const Float32Matrix> ms, int64_t k, const float* x,
                                int64_t ldx, int64_t m, cudaStream_t stream) {
  const auto refuse = [&](const std::string& why) {
    return Status::error("float32_rows_matmul: " + std::string(ggml_type_name(type)) + " " + std::to_string(m) +
                         " rows x " + std::to_string(ms.size()) + " matrices of " + std::to_string(k) +
                         " columns: " + why + " (rows 1.." + std::to_string(kFloat32RowsMax) + ", 1.." +
                         std::to_string(kFloat32RowsMaxMatrices) +
                         " matrices, F32/BF16/Q8_0, whole units of k, aligned rows)");
  };
  if (ms.empty() || ms.size() > static_cast<size_t>(kFloat32RowsMaxMatrices) || m < 1 || m > kFloat32RowsMax)
    return refuse("out of range");
  Products p;
  p.count = static_cast<int>(ms.size());
  for (int i = 0; i < p.count; ++i) {
    const Float32Matrix& mat = ms[i];
    if (!float32_rows_applies(type, mat.w, mat.row_bytes, k, x, ldx) || mat.n < 1) return refuse("matrix " + std::to_string(i));
    p.w[i] = static_cast<const uint8_t*>(mat.w);
    p.row_bytes[i] = mat.row_bytes;
    p.y[i] = mat.y;
    p.ldy[i] = mat.ldy;
    p.first[i + 1] = p.first[i] + mat.n;
  }
  if (p.first[p.count] > INT32_MAX) return refuse("too many outputs");
  const int64_t units = k / unit_of(type);
  const int threads = float32_rows_threads(type, k);
  if (type == GgmlType::Q8_0 && threads == 32 && m >= 2 && kernel_choice().float32_tiles) {
    static const cudaError_t attribute = cudaFuncSetAttribute(
        float32_rows_q8_tile_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kTileSmemBytes));
    DSV4_CUDA_TRY(attribute);
    const dim3 tiles(static_cast<unsigned>((p.first[p.count] + kTileOutputs - 1) / kTileOutputs),
                     static_cast<unsigned>((m + kTileRows - 1) / kTileRows), 1);
    launch_dependent(float32_rows_q8_tile_kernel, tiles, 32 * kTileWarps, kTileSmemBytes, stream, p, units, x, ldx, m);
    DSV4_CUDA_TRY_LAUNCH();
    return Status::ok();
  }
  const dim3 grid(static_cast<unsigned>(p.first[p.count]), static_cast<unsigned>(m), 1);
  if (type == GgmlType::F32)
    launch_dependent(float32_rows_kernel<GgmlType::F32>, grid, threads, 0, stream, p, units, x, ldx);
  else if (type == GgmlType::BF16)
    launch_dependent(float32_rows_kernel<GgmlType::BF16>, grid, threads, 0, stream, p, units, x, ldx);
  else
    launch_dependent(float32_rows_kernel<GgmlType::Q8_0>, grid, threads, 0, stream, p, units, x, ldx);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

Status float32_rows_matmul(GgmlType type, const void* w, int64_t row_bytes, int64_t n, int64_t k, const float* x,
                           int64_t ldx, int64_t m, float* y, int64_t ldy, cudaStream_t stream) {
  const Float32Matrix one{w, row_bytes, n, y, ldy};
  return float32_rows_matmul_many(type, std::span<const Float32Matrix>(&one, 1), k, x, ldx, m, stream);
}

}  // namespace dsv4::cuda
