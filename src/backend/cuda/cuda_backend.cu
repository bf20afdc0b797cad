// The CUDA backend: device, stream and handles; memory (allocations, weight upload through
// pinned staging, the step arena); the dense and token-wise operations. Routing and experts
// are in cuda_moe.cu, the attention-side step operations in cuda_attention.cu.
//
// Every kernel here computes the CPU backend's function (cpu_backend.cpp, cpu_math.h) in the
// same fp32 operations where that is cheap: reductions of squares in double (the CPU sums in
// double too, so the rounded result agrees to the bit in all but near-tie cases), exp, sin and
// cos in double rounded once to f32, products and sums fused exactly where GCC fuses them on
// the CPU side (reference_math.cuh, checked by tests/backend/test_cuda_reference_math.cpp).
// docs/CUDA.md lists the bound each op's test asserts.
#include "backend/cuda/cuda_backend.h"

#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "backend/cpu/cpu_math.h"
#include "backend/cuda/cuda_backend_impl.cuh"
#include "backend/cuda/cuda_ops.cuh"
#include "backend/cuda/dependent_launch.cuh"
#include "backend/cuda/device_info.h"
#include "backend/cuda/exact_decode.cuh"
#include "backend/cuda/exact_gemm.h"
#include "backend/cuda/float32_rows.h"
#include "backend/cuda/gemm_prefill.h"
#include "backend/cuda/matvec.h"
#include "backend/cuda/mmq.h"
#include "backend/cuda/attention_ops.h"
#include "backend/cuda/block_reduce.cuh"
#include "backend/cuda/reference_math.cuh"
#include "gguf/gguf_file.h"
#include "util/float_formats.h"

namespace dsv4::cuda::detail {
Status iq2_tables(const uint64_t** grid, const uint8_t** signs);  // iq2_tables.cu
Status iq_tables(quant::IqTables* out);                            // iq2_tables.cu
}  // namespace dsv4::cuda::detail

namespace dsv4::backend {

using cudaops::Mat;
namespace ref = cuda::ref;

namespace {

constexpr size_t kAlign = 256;
constexpr size_t kPinnedMax = size_t{64} << 20;  // staging buffer cap
constexpr size_t kPinnedMin = size_t{4} << 20;
constexpr int kMaxHc = cuda::ref::kMaxHc;  // hyper-connection streams the kernels support

size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// Bytes a contiguous tensor of this descriptor spans (the CPU backend's rule).
size_t tensor_bytes(const Tensor& t) {
  if (t.rank == 0) return 0;
  return static_cast<size_t>(t.rank > 1 ? t.shape[0] * t.stride[0] : ggml_row_bytes(t.type, t.shape[0]).value_or(0));
}

Status cublas_status(cublasStatus_t s, const char* what, const char* file, int line) {
  if (s == CUBLAS_STATUS_SUCCESS) return Status::ok();
  return Status::error(StatusCode::kInternal, std::string(file) + ":" + std::to_string(line) + ": " + what +
                                                  " failed: status " + std::to_string(static_cast<int>(s)));
}
#define DSV4_CUBLAS_TRY(call) DSV4_TRY(cublas_status((call), #call, __FILE__, __LINE__))

// Frees a device allocation and takes its bytes off the counter it was charged to.
struct DeviceFree {
  std::shared_ptr<DeviceCounters> counters;
  uint64_t bytes = 0;
  bool weight = false;
  void operator()(void* p) const {
    cudaFree(p);
    (weight ? counters->weights : counters->cache) -= bytes;
  }
};

std::string device_error_text(uint32_t bits) {
  std::string s;
  const auto add = [&](uint32_t bit, const char* what) {
    if (bits & bit) s += std::string(s.empty() ? "" : "; ") + what;
  };
  add(kDeviceErrorGetRowsId, "get_rows: an id outside the table");
  add(kDeviceErrorRouteToken, "route: a token id outside the hash table");
  add(kDeviceErrorRouteExpert, "route: the hash table names an expert outside the layer's experts");
  add(kDeviceErrorMoeExpert, "moe_experts: an expert id outside the layer's experts");
  add(kDeviceErrorAttention, "attention: an index outside the cache");
  return s;
}

using cuda::block_sum;  // block_reduce.cuh

// ---- memory kernels -------------------------------------------------------------------------

template <class T>
__global__ void fill_kernel(Mat<T> t, T value) {
  ::dsv4::cuda::dependent_kernel_prologue();
  DSV4_ROW_TILE(r, c, t.rows, t.cols) t.row(r)[c] = value;
}

// Rows of `groups` consecutive blocks of `width` floats (x: [rows][groups * width], rows ld
// apart) to group-major [groups][rows][width] (to_groups), or back: the layout a batched
// product of grouped weights takes (CudaBackend::matmul_grouped). One block per (row, group),
// float4s (width, ld and both pointers 16-byte aligned).
__global__ void regroup_kernel(const float* __restrict__ src, float* __restrict__ dst, int64_t rows, int64_t groups,
                               int64_t width, int64_t ld, bool to_groups) {
  ::dsv4::cuda::dependent_kernel_prologue();
  const int64_t r = blockIdx.x / groups, g = blockIdx.x % groups;
  const int64_t strided = r * ld + g * width, packed = (g * rows + r) * width;
  const float4* from = reinterpret_cast<const float4*>(src + (to_groups ? strided : packed));
  float4* to = reinterpret_cast<float4*>(dst + (to_groups ? packed : strided));
  for (int64_t i = threadIdx.x; i < width / 4; i += blockDim.x) to[i] = from[i];
}

// ---- dense kernels --------------------------------------------------------------------------

template <GgmlType T>
__global__ void get_rows_kernel(const uint8_t* table, int64_t table_rows, int64_t row_bytes, const int32_t* ids,
                                int64_t n, Mat<float> y, cuda::exact::Tables tables, uint32_t* errors) {
  ::dsv4::cuda::dependent_kernel_prologue();
  DSV4_ROW_TILE(s, i, n, y.cols) {
    const int32_t id = ids[s];
    if (id < 0 || id >= table_rows) {
      if (i == 0) atomicOr(errors, kDeviceErrorGetRowsId);
      y.row(s)[i] = __int_as_float(0x7FC00000);  // NaN: the row is not a row of the table
      continue;
    }
    y.row(s)[i] = cuda::exact::element<T>(table + id * row_bytes, i, tables);
  }
}

// rows [n][k] of a weight matrix decoded exactly to f32 (out rows k apart).
template <GgmlType T>
__global__ void decode_rows_kernel(const uint8_t* w, int64_t row_bytes, int64_t n, int64_t k, float* __restrict__ out,
                                   cuda::exact::Tables tables) {
  ::dsv4::cuda::dependent_kernel_prologue();
  DSV4_GRID_STRIDE(idx, n * k) out[idx] = cuda::exact::element<T>(w + (idx / k) * row_bytes, idx % k, tables);
}

// This thread's part of sum(v[i]^2) over [0, count) for block_sum: i = threadIdx.x, +
// blockDim.x, ... in order, in double. The loads go first, 16 at a time: as a plain loop
// (each load under its own bound check) nvcc issued them one after another into one register,
// 16 L2 round trips of a one-row hc_pre (ncu's SASS, 2026-12-04). Past the end a term is
// 0.0 * 0.0, which leaves a sum of squares unchanged, so the bits are the plain loop's.
// (No __restrict__: hc_pre reads its own x back, which the read-only cache path may not.)
__device__ inline double sum_squares(const float* v, int64_t count) {
  constexpr int kLoads = 16;
  double ss = 0.0;
  for (int64_t i0 = threadIdx.x; i0 < count; i0 += kLoads * static_cast<int64_t>(blockDim.x)) {
    float x[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int64_t i = i0 + u * static_cast<int64_t>(blockDim.x);
      x[u] = i < count ? v[i] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) ss += static_cast<double>(x[u]) * x[u];
  }
  return ss;
}

// One block per group of `width` values of a row.
__global__ void rms_norm_kernel(Mat<float> x, const float* __restrict__ w, float eps, int64_t width, int64_t groups,
                                Mat<float> y) {
  ::dsv4::cuda::dependent_kernel_prologue();
  const int64_t row = blockIdx.x / groups, g = blockIdx.x % groups;
  const float* xr = x.row(row) + g * width;
  float* yr = y.row(row) + g * width;
  const float r = ref::inverse_rms(block_sum(sum_squares(xr, width)), width, eps);
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    const float v = __fmul_rn(xr[i], r);
    yr[i] = w != nullptr ? __fmul_rn(v, w[i]) : v;
  }
}

// One block per (row, group) of cuda::finish::threads_for(group) threads: row_finish.cuh's
// pipeline on the group in shared memory.
__global__ void finish_rows_kernel(Mat<float> x, const int32_t* __restrict__ positions, cuda::finish::Spec s,
                                   int64_t groups) {
  ::dsv4::cuda::dependent_kernel_prologue();
  extern __shared__ float v[];
  const int64_t row = blockIdx.x / groups, g = blockIdx.x % groups;
  float* p = x.row(row) + g * s.group;
  for (int64_t i = threadIdx.x; i < s.group; i += blockDim.x) v[i] = p[i];
  cuda::finish::finish_group(v, s, s.rope_dims > 0 ? positions[row] : 0);
  for (int64_t i = threadIdx.x; i < s.group; i += blockDim.x) p[i] = v[i];
}

// One thread per (row, head, pair).
__global__ void rope_kernel(Mat<float> x, int64_t head_dim, int dims, const int32_t* __restrict__ positions,
                            const float* __restrict__ omega, bool inverse) {
  ::dsv4::cuda::dependent_kernel_prologue();
  const int half = dims / 2;
  const int64_t heads = x.cols / head_dim;
  DSV4_ROW_TILE(s, c, x.rows, heads * half) {
    const int h = static_cast<int>(c) / half, i = static_cast<int>(c) % half;  // 32-bit: heads * half < 2^31
    ref::rope_pair(x.row(s) + (h + 1) * head_dim - dims + 2 * i, positions[s], omega[i], inverse);
  }
}

__global__ void add_kernel(Mat<float> x, Mat<float> y) {
  ::dsv4::cuda::dependent_kernel_prologue();
  DSV4_ROW_TILE(r, c, x.rows, x.cols) {
    float* o = y.row(r) + c;
    *o = __fadd_rn(*o, x.row(r)[c]);
  }
}

__global__ void scale_kernel(Mat<float> x, float factor) {
  ::dsv4::cuda::dependent_kernel_prologue();
  DSV4_ROW_TILE(r, c, x.rows, x.cols) {
    float* o = x.row(r) + c;
    *o = __fmul_rn(*o, factor);
  }
}

// y [rows][k] bf16 (contiguous) from a strided f32 matrix, rounded to nearest even.
__global__ void f32_to_bf16_rows_kernel(Mat<float> x, __nv_bfloat16* __restrict__ out) {
  ::dsv4::cuda::dependent_kernel_prologue();
  DSV4_ROW_TILE(r, c, x.rows, x.cols) out[r * x.cols + c] = __float2bfloat16_rn(x.row(r)[c]);
}

// ---- hyper-connections ----------------------------------------------------------------------

// ref::hc_split_sinkhorn with one thread per entry of the n x n matrix (threads 0..n*n-1 of
// the block; every thread of the block must call it). Each entry goes through the same f32
// operations in the same order as in the one-thread reference (a row or column sum is
// recomputed by each of its entries, in index order), so the results are bit-identical; the
// reference on one thread was a chain of ~20k dependent instructions per row, a fifth of a
// decode step (issue 10's profile).
__device__ void hc_split_sinkhorn_block(const float* mixes, float rho, const float* scale, const float* base, int n,
                                        int iters, float eps, float* pre, float* post, float* comb) {
  __shared__ float c[kMaxHc * kMaxHc];  // c[j * n + k]: row j (source stream), column k
  const int t = static_cast<int>(threadIdx.x);
  const bool mine = t < n * n;
  const int j = mine ? t / n : 0, k = mine ? t % n : 0;
  if (t < n) {
    pre[t] = ref::add(ref::sigmoid(ref::fma(ref::mul(mixes[t], rho), scale[0], base[t])), eps);
    post[t] = ref::mul(2.0f, ref::sigmoid(ref::fma(ref::mul(mixes[n + t], rho), scale[1], base[n + t])));
  }
  float v = mine ? ref::fma(ref::mul(mixes[2 * n + t], rho), scale[2], base[2 * n + t]) : 0.0f;
  const auto publish = [&] {  // every entry's new value visible, after every read of the old ones
    __syncthreads();
    if (mine) c[t] = v;
    __syncthreads();
  };
  publish();
  if (mine) {  // row softmax: the row's max, exp(x - max) ...
    float m = c[j * n];
    for (int q = 1; q < n; ++q) m = ref::std_max(m, c[j * n + q]);
    v = ref::exp(ref::sub(v, m));
  }
  publish();
  if (mine) {  // ... over the row's sum, + eps
    float sum = 0.0f;
    for (int q = 0; q < n; ++q) sum = ref::add(sum, c[j * n + q]);
    v = ref::add(ref::div(v, sum), eps);
  }
  publish();
  const auto normalise_columns = [&] {
    if (mine) {
      float sum = 0.0f;
      for (int q = 0; q < n; ++q) sum = ref::add(sum, c[q * n + k]);
      v = ref::div(v, ref::add(sum, eps));
    }
    publish();
  };
  const auto normalise_rows = [&] {
    if (mine) {
      float sum = 0.0f;
      for (int q = 0; q < n; ++q) sum = ref::add(sum, c[j * n + q]);
      v = ref::div(v, ref::add(sum, eps));
    }
    publish();
  };
  normalise_columns();
  for (int it = 1; it < iters; ++it) {
    normalise_rows();
    normalise_columns();
  }
  if (mine) comb[t] = v;
}

// The comb part of hc_split_sinkhorn_block on one warp alone (n * n <= 32; hc_pre_kernel's warp 0): the same entries, the
// same operations in the same order, so the other warps of the block can do the collapse
// meanwhile. Lane t holds entry t in a register and reads a row's or column's entries by
// shuffles (all loaded before the sum, which then runs in index order): a half-step is one
// shuffle latency, the sum's adds and the division. Through shared memory (store, warp barrier,
// loads, barrier) the 39 half-steps of 20 iterations were the decode step's longest serial
// chain: 21.6 us of the 21.6-us hc_pre at one row, its other 31 warps waiting at the barrier
// (ncu, 2026-12-03).
// kN: n known at compile time (V4's 4 streams: each gather 4 shuffles and each sum 4 adds
// with no bound checks; with kN = 0, kMaxHc of each, guarded by the runtime n).
template <int kN>
__device__ void hc_sinkhorn_comb_warp(const float* mixes, float rho, const float* scale, const float* base,
                                      int n_runtime, int iters, float eps, float* comb) {
  constexpr unsigned kAll = 0xFFFFFFFFu;
  constexpr int kLine = kN > 0 ? kN : kMaxHc;
  const int n = kN > 0 ? kN : n_runtime;
  const int t = static_cast<int>(threadIdx.x) & 31;  // any one warp of the block
  const bool mine = t < n * n;
  const int j = mine ? t / n : 0, k = mine ? t % n : 0;
  float v = mine ? ref::fma(ref::mul(mixes[2 * n + t], rho), scale[2], base[2 * n + t]) : 0.0f;
  // Entries q = 0..n-1 of this lane's row (or column), as c[j * n + q] (c[q * n + k]).
  float line[kLine];
  const auto gather = [&](bool columns) {
#pragma unroll
    for (int q = 0; q < kLine; ++q) line[q] = __shfl_sync(kAll, v, (columns ? q * n + k : j * n + q) & 31);
  };
  const auto line_sum = [&] {
    float sum = 0.0f;
#pragma unroll
    for (int q = 0; q < kLine; ++q)
      if (q < n) sum = ref::add(sum, line[q]);
    return sum;
  };
  gather(false);  // row softmax: the row's max, exp(x - max) ...
  float m = line[0];
#pragma unroll
  for (int q = 1; q < kLine; ++q)
    if (q < n) m = ref::std_max(m, line[q]);
  v = ref::exp(ref::sub(v, m));
  gather(false);  // ... over the row's sum, + eps
  v = ref::add(ref::div(v, line_sum()), eps);
  const auto normalise = [&](bool columns) {
    gather(columns);
    v = ref::div(v, ref::add(line_sum(), eps));
  };
  normalise(true);
  for (int it = 1; it < iters; ++it) {
    normalise(false);
    normalise(true);
  }
  if (mine) comb[t] = v;
}

// One block of kHcThreads per row: the RMS scale of all streams, the split, the collapse. With
// n * n <= 32 (V4: n = 4) warp 0 runs the Sinkhorn iterations while the other warps collapse
// (the collapse needs only pre, which needs only the RMS scale); otherwise the whole block
// runs the split first. A decode step has one row, so the loads are unrolled and the block is
// wide: 256 threads walked the 16384 values in dependent rounds (issue 10's profile: 40 us).
// With norm_w, the block then applies the sublayer's RMSNorm to its x (hc_pre_norm) as
// rms_norm_kernel does (the same double sum where that kernel's block is also kHcThreads
// wide: rows of 4096), saving a launch per block and sublayer.
constexpr int kHcThreads = 1024;
constexpr int64_t kHcPreNormFusedMaxRows = 64;  // decode steps (hc_pre_norm)

__global__ void __launch_bounds__(kHcThreads) hc_pre_kernel(Mat<float> streams, Mat<float> mixes,
                                                            const float* __restrict__ scale,
                                                            const float* __restrict__ base, int n_hc, int iters,
                                                            float hc_eps, float norm_eps, int64_t width, Mat<float> x,
                                                            Mat<float> post, Mat<float> comb,
                                                            const float* __restrict__ norm_w, Mat<float> normed) {
  ::dsv4::cuda::dependent_kernel_prologue();
  __shared__ float pre[kMaxHc];
  const int64_t s = blockIdx.x;
  const float* X = streams.row(s);
  const float rho = ref::inverse_rms(block_sum(sum_squares(X, n_hc * width)), n_hc * width, norm_eps);
  const float* m = mixes.row(s);
  float* xr = x.row(s);
  if (n_hc * n_hc <= 32 && blockDim.x > 32) {
    const int t = static_cast<int>(threadIdx.x);
    if (t < n_hc) {  // as in hc_split_sinkhorn_block
      pre[t] = ref::add(ref::sigmoid(ref::fma(ref::mul(m[t], rho), scale[0], base[t])), hc_eps);
      post.row(s)[t] = ref::mul(2.0f, ref::sigmoid(ref::fma(ref::mul(m[n_hc + t], rho), scale[1], base[n_hc + t])));
    }
    __syncthreads();
    if (t < 32) {
      if (n_hc == 4)
        hc_sinkhorn_comb_warp<4>(m, rho, scale, base, n_hc, iters, hc_eps, comb.row(s));
      else
        hc_sinkhorn_comb_warp<0>(m, rho, scale, base, n_hc, iters, hc_eps, comb.row(s));
    } else {
      for (int64_t i = t - 32; i < width; i += blockDim.x - 32) xr[i] = ref::hc_collapse(X + i, width, pre, n_hc);
    }
  } else {
    hc_split_sinkhorn_block(m, rho, scale, base, n_hc, iters, hc_eps, pre, post.row(s), comb.row(s));
    __syncthreads();
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) xr[i] = ref::hc_collapse(X + i, width, pre, n_hc);
  }
  if (norm_w == nullptr) return;  // uniform over the grid
  __syncthreads();                // every x value written (the block's own global writes)
  const float r = ref::inverse_rms(block_sum(sum_squares(xr, width)), width, norm_eps);
  float* yr = normed.row(s);
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) yr[i] = __fmul_rn(__fmul_rn(xr[i], r), norm_w[i]);
}

// X'[k] = post_k y + sum_j comb[j,k] X[j]; a thread owns column i of every stream (in place).
// kN: n_hc known at compile time (V4's 4 streams: old[] in registers, where a runtime count
// put it in local memory and its loads one after another); 0: any n_hc up to kMaxHc.
template <int kN>
__global__ void hc_post_kernel(Mat<float> y, Mat<float> post, Mat<float> comb, int n_runtime, Mat<float> streams) {
  ::dsv4::cuda::dependent_kernel_prologue();
  constexpr int kCap = kN > 0 ? kN : kMaxHc;
  const int n_hc = kN > 0 ? kN : n_runtime;
  DSV4_ROW_TILE(s, i, y.rows, y.cols) {
    const int64_t width = y.cols;
    float* X = streams.row(s);
    float old[kCap];
#pragma unroll
    for (int j = 0; j < kCap; ++j) old[j] = j < n_hc ? X[j * width + i] : 0.0f;
    const float* p = post.row(s);
    const float* c = comb.row(s);
    const float a = y.row(s)[i];
    for (int k = 0; k < n_hc; ++k) X[k * width + i] = ref::hc_expand(p[k], a, c + k, n_hc, old, n_hc);
  }
}

__global__ void __launch_bounds__(kHcThreads) hc_head_kernel(Mat<float> streams, Mat<float> mixes, const float* __restrict__ scale,
                               const float* __restrict__ base, int n_hc, float hc_eps, float norm_eps, int64_t width,
                               Mat<float> x) {
  ::dsv4::cuda::dependent_kernel_prologue();
  __shared__ float w[kMaxHc];
  const int64_t s = blockIdx.x;
  const float* X = streams.row(s);
  const float rho = ref::inverse_rms(block_sum(sum_squares(X, n_hc * width)), n_hc * width, norm_eps);
  if (threadIdx.x < n_hc) {
    const int j = threadIdx.x;
    w[j] = ref::hc_head_weight(mixes.row(s)[j], rho, scale[0], base[j], hc_eps);
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) x.row(s)[i] = ref::hc_collapse(X + i, width, w, n_hc);
}

// ---- hyper-connections: a site's mixes and hc_pre_norm in one launch (decode rows) -------------

// Cluster barrier halves (PTX barrier.cluster, not .aligned: one warp of
// hc_pre_norm_cluster_kernel takes its own path). arrive releases and wait acquires the
// shared-memory writes of the cluster's blocks; the relaxed arrive orders nothing (it only
// tells that the block has started, before anyone writes into its shared memory).
__device__ __forceinline__ void cluster_barrier_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_barrier_arrive() { asm volatile("barrier.cluster.arrive;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_barrier_wait() { asm volatile("barrier.cluster.wait;\n" ::: "memory"); }

// V4's site (4 streams of 4096, 24 mixes) as one launch: a cluster of 16 blocks of 256 threads
// per row. The arithmetic is laid out on float32_rows' block for the mixes (1024 threads at
// k = 16384) and hc_pre_kernel's (kHcThreads), whose thread vt and warp vt / 32 are called the
// virtual thread and virtual warp here. Each virtual warp has four real warps in one block
// (groups 0..3): group g computes the virtual threads' partial products of mixes 6g..6g+5,
// group 0 also their part of the streams' sum of squares; in the collapse group g computes x
// value vt + 1024 g, and group 0 the virtual thread's part of x's sum of squares from the four.
// The sums over the virtual warps (a shuffle tree for the mixes, block_sum's in-order double sum
// for the RMS scales) run on the 32 warp sums that every block receives in its shared memory:
// each warp pushes its sums into all 16 blocks (DSMEM stores), so what is read after a cluster
// barrier is local. Every value goes through the operations of float32_rows_kernel<F32> and of
// hc_pre_kernel with the norm in their order: the same bits (docs/CUDA.md, "A site's mixes and
// hc_pre in one launch").
namespace hc_cluster {
constexpr int kStreams = 4, kWidth = 4096, kValues = kStreams * kWidth, kMixes = (2 + kStreams) * kStreams;
constexpr int kBlocks = 16, kThreads = 256, kWarps = kThreads / 32;
constexpr int kVirtualThreads = 1024, kVirtualWarps = kVirtualThreads / 32;
constexpr int kGroups = kBlocks * kWarps / kVirtualWarps;     // real warps per virtual warp
constexpr int kBlockVirtualWarps = kWarps / kGroups;          // a block's virtual warps
constexpr int kGroupMixes = kMixes / kGroups;                 // mixes of a group
constexpr int kProductUnits = kValues / 4 / kVirtualThreads;  // float4 units a thread (float32_rows: 4)
constexpr int kSquares = 16;                                  // sum_squares' loads a thread (kLoads)
constexpr int kCollapsed = kWidth / kVirtualThreads;          // x values a virtual thread
// Rank 0's warp of virtual warp 0, group 3 runs the Sinkhorn iterations (as warp 0 of
// hc_pre_kernel does beside the collapse); group 2's warp also collapses its x values.
constexpr int kSinkhornWarp = 3;
static_assert(kVirtualThreads == kHcThreads, "hc_pre_kernel's block");
static_assert(kValues == kSquares * kVirtualThreads, "sum_squares over the streams: one round of 16 loads");
static_assert(kCollapsed == kGroups && kCollapsed < kSquares, "sum_squares over x: one round, one value a group");
static_assert(kVirtualWarps == 32 && kGroupMixes * kGroups == kMixes, "the layout");
static_assert(kSinkhornWarp < kGroups, "the Sinkhorn warp belongs to virtual warp 0");
}  // namespace hc_cluster

// The warp's sum of a float: float32_rows_kernel's xor tree (every lane gets it).
__device__ __forceinline__ float warp_tree_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
  return v;
}

// block_sum's warp tree on a double (every lane gets it).
__device__ __forceinline__ double warp_tree_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

// block_sum's total over the warp sums: in warp order from 0.0.
__device__ __forceinline__ double warp_sums_in_order(const double* part) {
  double total = 0.0;
#pragma unroll
  for (int w = 0; w < hc_cluster::kVirtualWarps; ++w) total += part[w];
  return total;
}

// Grid (16, rows), clusters of 16 along x.
__global__ void __launch_bounds__(hc_cluster::kThreads)
    hc_pre_norm_cluster_kernel(const float* __restrict__ fn, int64_t fn_ld, Mat<float> streams,
                               const float* __restrict__ scale, const float* __restrict__ base, int iters,
                               float hc_eps, float norm_eps, const float* __restrict__ norm_w, Mat<float> x,
                               Mat<float> post, Mat<float> comb, Mat<float> normed) {
  using namespace hc_cluster;
  namespace cg = cooperative_groups;
  // Every virtual warp's sums, pushed here by its warps (the same in every block).
  __shared__ float mix_part[kMixes][kVirtualWarps];
  __shared__ double streams_part[kVirtualWarps];
  __shared__ double x_part[kVirtualWarps];
  __shared__ float collapsed[kBlockVirtualWarps][kCollapsed][32];  // this block's x values
  __shared__ float mixes[kMixes];                                  // the Sinkhorn warp's
  __shared__ float pre_of_warp[kWarps][kStreams];
  ::dsv4::cuda::dependent_kernel_prologue();
  const cg::cluster_group cluster = cg::this_cluster();
  cluster_barrier_arrive_relaxed();  // every block started before the first push (waited below)
  const int rank = static_cast<int>(cluster.block_rank());
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int local_vw = warp / kGroups, group = warp % kGroups;
  const int vw = rank * kBlockVirtualWarps + local_vw, vt = vw * 32 + lane;
  const bool sinkhorn_warp = rank == 0 && warp == kSinkhornWarp;
  const int64_t s = blockIdx.y;
  const float* X = streams.row(s);

  // 1. Group 0: sum_squares over the streams (values vt + 1024 u, in order). Every group:
  // float32_rows' units vt + 1024 q of the streams and of its mixes' weight rows, fmaf in order.
  double ss = 0.0;
  if (group == 0) {
    float sq[kSquares];
#pragma unroll
    for (int u = 0; u < kSquares; ++u) sq[u] = X[vt + u * kVirtualThreads];
#pragma unroll
    for (int u = 0; u < kSquares; ++u) ss += static_cast<double>(sq[u]) * sq[u];
    ss = warp_tree_sum(ss);
  }
  const auto* x4 = reinterpret_cast<const float4*>(X);
  float4 xq[kProductUnits];
#pragma unroll
  for (int q = 0; q < kProductUnits; ++q) xq[q] = __ldg(x4 + vt + q * kVirtualThreads);
  float acc[kGroupMixes];
#pragma unroll
  for (int i = 0; i < kGroupMixes; ++i) {
    const auto* w4 = reinterpret_cast<const float4*>(fn + (group * kGroupMixes + i) * fn_ld);
    float a = 0.0f;
#pragma unroll
    for (int q = 0; q < kProductUnits; ++q) {
      const float4 w = __ldg(w4 + vt + q * kVirtualThreads);
      a = fmaf(w.x, xq[q].x, a);
      a = fmaf(w.y, xq[q].y, a);
      a = fmaf(w.z, xq[q].z, a);
      a = fmaf(w.w, xq[q].w, a);
    }
    acc[i] = warp_tree_sum(a);
  }
  // The warp's sums into every block of the cluster (lane r to rank r).
  cluster_barrier_wait();
  if (lane < kBlocks) {
    float* mp = cluster.map_shared_rank(&mix_part[0][0], lane);
#pragma unroll
    for (int i = 0; i < kGroupMixes; ++i) mp[(group * kGroupMixes + i) * kVirtualWarps + vw] = acc[i];
    if (group == 0) cluster.map_shared_rank(streams_part, lane)[vw] = ss;
  }
  cluster_barrier_arrive();
  cluster_barrier_wait();

  // 2. The RMS scale of the streams (block_sum's order), and mix o as warp 0 of
  // float32_rows_kernel sums it: lane w holds warp w's sum, the xor tree.
  const float rho = ref::inverse_rms(warp_sums_in_order(streams_part), kValues, norm_eps);
  const auto mix = [&](int o) { return warp_tree_sum(mix_part[o][lane]); };
  if (sinkhorn_warp) {  // post and the Sinkhorn split, as warp 0 of hc_pre_kernel
#pragma unroll
    for (int o = 0; o < kMixes; ++o) {
      const float m = mix(o);
      if (lane == 0) mixes[o] = m;
    }
    __syncwarp();
    if (lane < kStreams)
      post.row(s)[lane] = ref::mul(
          2.0f, ref::sigmoid(ref::fma(ref::mul(mixes[kStreams + lane], rho), scale[1], base[kStreams + lane])));
    cluster_barrier_arrive();  // nothing to push: its x value is group 2's
    hc_sinkhorn_comb_warp<kStreams>(mixes, rho, scale, base, kStreams, iters, hc_eps, comb.row(s));
    cluster_barrier_wait();
    return;
  }
  // pre, each warp its own (as hc_pre_kernel's threads 0..3 compute it, into shared memory).
  float* pre = pre_of_warp[warp];
  {
    float m[kStreams];
#pragma unroll
    for (int j = 0; j < kStreams; ++j) m[j] = mix(j);
    if (lane < kStreams) {
#pragma unroll
      for (int j = 0; j < kStreams; ++j)
        if (lane == j) pre[j] = ref::add(ref::sigmoid(ref::fma(ref::mul(m[j], rho), scale[0], base[j])), hc_eps);
    }
    __syncwarp();
  }

  // 3. The collapse of x value vt + 1024 g (the Sinkhorn warp's by group 2; a column's
  // collapse is the same bits on any thread), then group 0's part of x's sum of squares:
  // sum_squares' 16 terms in order, of which those past the row are 0.0 * 0.0, which leave the
  // sum unchanged (it is never -0.0).
  const bool two = rank == 0 && warp == kSinkhornWarp - 1;
  float* xr = x.row(s);
  float xv[2];
  xv[0] = ref::hc_collapse(X + vt + group * kVirtualThreads, kWidth, pre, kStreams);
  xr[vt + group * kVirtualThreads] = xv[0];
  collapsed[local_vw][group][lane] = xv[0];
  if (two) {
    xv[1] = ref::hc_collapse(X + vt + kSinkhornWarp * kVirtualThreads, kWidth, pre, kStreams);
    xr[vt + kSinkhornWarp * kVirtualThreads] = xv[1];
    collapsed[local_vw][kSinkhornWarp][lane] = xv[1];
  }
  // The block's warps but the Sinkhorn warp (named barrier 1).
  asm volatile("bar.sync 1, %0;\n" ::"r"(rank == 0 ? kThreads - 32 : kThreads) : "memory");
  if (group == 0) {
    float v[kCollapsed];
#pragma unroll
    for (int u = 0; u < kCollapsed; ++u) v[u] = collapsed[local_vw][u][lane];
    double xss = 0.0;
#pragma unroll
    for (int u = 0; u < kCollapsed; ++u) xss += static_cast<double>(v[u]) * v[u];
    xss = warp_tree_sum(xss);
    if (lane < kBlocks) cluster.map_shared_rank(x_part, lane)[vw] = xss;
  }
  cluster_barrier_arrive();
  cluster_barrier_wait();

  // 4. The sublayer's RMSNorm (hc_pre_kernel's tail).
  const float r = ref::inverse_rms(warp_sums_in_order(x_part), kWidth, norm_eps);
  float* yr = normed.row(s);
  int i = vt + group * kVirtualThreads;
  yr[i] = __fmul_rn(__fmul_rn(xv[0], r), norm_w[i]);
  if (two) {
    i = vt + kSinkhornWarp * kVirtualThreads;
    yr[i] = __fmul_rn(__fmul_rn(xv[1], r), norm_w[i]);
  }
}

// ---- QAT --------------------------------------------------------------------------------------

// One block per (row, group) in shared memory: cpu::hadamard's butterflies stage by stage
// (row_finish.cuh).
__global__ void hadamard_kernel(Mat<float> x, int64_t width, int64_t groups) {
  ::dsv4::cuda::dependent_kernel_prologue();
  extern __shared__ float v[];
  const int64_t row = blockIdx.x / groups, g = blockIdx.x % groups;
  float* p = x.row(row) + g * width;
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) v[i] = p[i];
  __syncthreads();
  cuda::finish::hadamard_in_shared(v, width);
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) p[i] = v[i];
}

// cpu::round_fp8_block on each block of columns [0, cols); one warp per block
// (row_finish.cuh's round_fp8_warp). One thread per block was 16 us per decode step and layer:
// a 512-wide KV row is 8 threads walking 64 values each.
__global__ void round_fp8_kernel(Mat<float> x, int64_t cols, int64_t block) {
  ::dsv4::cuda::dependent_kernel_prologue();
  const int64_t per_row = cols / block;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t idx = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; idx < x.rows * per_row;
       idx += warps)
    cuda::finish::round_fp8_warp(x.row(idx / per_row) + (idx % per_row) * block, block, lane);
}

// cpu::round_fp4_block on each block of a row; one warp per block (round_fp4_warp).
__global__ void round_fp4_kernel(Mat<float> x, int64_t block) {
  ::dsv4::cuda::dependent_kernel_prologue();
  const int64_t per_row = x.cols / block;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t idx = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; idx < x.rows * per_row;
       idx += warps)
    cuda::finish::round_fp4_warp(x.row(idx / per_row) + (idx % per_row) * block, block, lane);
}

__global__ void round_fp4_e4m3_kernel(Mat<float> x, int64_t block) {
  ::dsv4::cuda::dependent_kernel_prologue();
  const int64_t per_row = x.cols / block;
  DSV4_GRID_STRIDE(idx, x.rows * per_row)
    ref::round_fp4_e4m3_block(x.row(idx / per_row) + (idx % per_row) * block, block);
}

bool same_rope(const RopeParams& a, const RopeParams& b) {
  return a.dims == b.dims && a.freq_base == b.freq_base && a.yarn == b.yarn && a.yarn_factor == b.yarn_factor &&
         a.yarn_original_context == b.yarn_original_context && a.yarn_beta_fast == b.yarn_beta_fast &&
         a.yarn_beta_slow == b.yarn_beta_slow;
}

}  // namespace

// ---- Impl ---------------------------------------------------------------------------------------

CudaBackend::Impl::~Impl() {
  for (const Lane& l : lanes)
    if (l.stream) cudaStreamSynchronize(l.stream);
  for (auto& [id, exec] : graphs) cudaGraphExecDestroy(exec);
  for (const Chunk& c : chunks) cudaFree(c.ptr);
  for (const RopeTable& t : rope_tables) cudaFree(t.omega);
  for (const Lane& l : lanes)
    for (const Reusable* r : l.work.all())
      if (r->ptr) cudaFree(r->ptr);
  if (pinned) cudaFreeHost(pinned);
  if (host_errors) cudaFreeHost(host_errors);
  if (device_errors) cudaFree(device_errors);
  for (cudaEvent_t e : half_done)
    if (e) cudaEventDestroy(e);
  if (cublas_lt) cublasLtDestroy(cublas_lt);
  if (cublas) cublasDestroy(cublas);
  for (const Lane& l : lanes) {
    if (l.fork) cudaEventDestroy(l.fork);
    if (l.join) cudaEventDestroy(l.join);
    if (l.stream) cudaStreamDestroy(l.stream);
  }
}

Status CudaBackend::Impl::main_waits_for(Lane& l) {
  DSV4_CUDA_TRY(cudaEventRecord(l.join, l.stream));
  DSV4_CUDA_TRY(cudaStreamWaitEvent(main_stream(), l.join, 0));
  return Status::ok();
}

Status CudaBackend::Impl::join_all() {
  for (int i = 1; i <= Backend::kMaxLanes; ++i) {
    Lane& l = lanes[i];
    if (!l.pending) continue;
    DSV4_TRY(main_waits_for(l));
    l.pending = false;
  }
  lane = 0;
  stream = main_stream();
  return Status::ok();
}

Status CudaBackend::Impl::wait_all() {
  for (const Lane& l : lanes)
    if (l.stream) DSV4_CUDA_TRY(cudaStreamSynchronize(l.stream));
  return Status::ok();
}

Result<void*> CudaBackend::Impl::scratch_bytes(size_t bytes) {
  const size_t need = align_up(std::max<size_t>(bytes, 1), kAlign);
  // The current chunk, else the next one that holds it, else a new one.
  while (chunk < chunks.size() && chunk_used + need > chunks[chunk].bytes) {
    ++chunk;
    chunk_used = 0;
  }
  if (chunk == chunks.size()) {
    const size_t size = std::max(need, options.scratch_bytes);
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, size);
    if (err != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free error state of a failed allocation
      size_t free_bytes = 0, total_bytes = 0;
      if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) cudaGetLastError();
      return Status::errorf(StatusCode::kResourceExhausted,
                            "cuda scratch: cannot allocate a chunk of {} bytes ({} in {} chunks already; device {} of "
                            "{} bytes free): {}",
                            size, scratch_total, chunks.size(), free_bytes, total_bytes, cudaGetErrorString(err));
    }
    chunks.push_back({p, size});
    scratch_total += size;
    chunk_used = 0;
  }
  void* p = static_cast<uint8_t*>(chunks[chunk].ptr) + chunk_used;
  chunk_used += need;
  return p;
}

Result<void*> CudaBackend::Impl::reusable(Reusable& r, size_t bytes) {
  if (r.bytes >= bytes && r.ptr != nullptr) return r.ptr;
  DSV4_TRY(wait_all());  // nothing queued may still use the old buffer
  if (r.ptr) DSV4_CUDA_TRY(cudaFree(r.ptr));
  r.ptr = nullptr;
  r.bytes = 0;
  const size_t size = align_up(bytes, size_t{1} << 20);
  const cudaError_t err = cudaMalloc(&r.ptr, size);
  if (err != cudaSuccess) {
    cudaGetLastError();
    r.ptr = nullptr;
    return Status::errorf(StatusCode::kResourceExhausted, "cuda: cannot allocate a work buffer of {} bytes: {}", size,
                          cudaGetErrorString(err));
  }
  r.bytes = size;
  return r.ptr;
}

Status CudaBackend::Impl::stage_upload(void* device, const void* host, size_t bytes) {
  if (bytes == 0) return Status::ok();
  const size_t want = std::min(kPinnedMax, std::max(kPinnedMin, align_up(2 * bytes, kAlign)));
  if (pinned_bytes < want) {  // grow: nothing may still read the old buffer
    DSV4_TRY(wait_all());
    if (pinned) DSV4_CUDA_TRY(cudaFreeHost(pinned));
    pinned = nullptr;
    pinned_bytes = 0;
    DSV4_CUDA_TRY(cudaMallocHost(&pinned, want));
    pinned_bytes = want;
    pinned_used = 0;
  }
  const size_t piece_max = pinned_bytes / 2;
  for (size_t done = 0; done < bytes;) {
    const size_t piece = std::min(bytes - done, piece_max);
    if (pinned_used + piece > pinned_bytes) {  // the ring is full: wait for its copies
      DSV4_TRY(wait_all());
      pinned_used = 0;
    }
    uint8_t* at = static_cast<uint8_t*>(pinned) + pinned_used;
    std::memcpy(at, static_cast<const uint8_t*>(host) + done, piece);
    DSV4_CUDA_TRY(cudaMemcpyAsync(static_cast<uint8_t*>(device) + done, at, piece, cudaMemcpyHostToDevice, stream));
    pinned_used += align_up(piece, kAlign);
    done += piece;
  }
  return Status::ok();
}

Result<const float*> CudaBackend::Impl::rope_omega(const RopeParams& p) {
  for (const RopeTable& t : rope_tables)
    if (same_rope(t.params, p)) return static_cast<const float*>(t.omega);
  const std::vector<float> omega = cpu::rope_frequencies(p);
  void* d = nullptr;
  DSV4_CUDA_TRY(cudaMalloc(&d, std::max<size_t>(omega.size(), 1) * sizeof(float)));
  rope_tables.push_back({p, static_cast<float*>(d)});
  // On the backend's stream (a non-blocking stream does not wait for the legacy one); a
  // pageable source is staged before the call returns. Every lane may read the table next:
  // from a side lane, the main lane waits for the copy.
  DSV4_CUDA_TRY(cudaMemcpyAsync(d, omega.data(), omega.size() * sizeof(float), cudaMemcpyHostToDevice, stream));
  if (lane != 0) DSV4_TRY(main_waits_for(lanes[lane]));
  return static_cast<const float*>(d);
}

Result<cuda::finish::Spec> CudaBackend::Impl::finish_spec(const Backend* self, const char* op, const Tensor& x,
                                                           const RowFinish& f) {
  DSV4_TRY(check_row_finish(op, x, f));
  if (f.group > cuda::finish::kMaxGroup)
    return Status::errorf("{}: groups of {} values (at most {}: one group in shared memory)", op, f.group,
                          cuda::finish::kMaxGroup);
  cuda::finish::Spec s;
  s.group = f.group;
  s.norm = f.norm;
  s.eps = f.eps;
  if (f.norm && f.norm_weight) {
    DSV4_ASSIGN_OR_RETURN(const Mat<float> wv, cudaops::f32(*f.norm_weight, self, op, "norm weight", -1, f.group));
    s.norm_weight = wv.p;
  }
  if (f.rope) {
    DSV4_ASSIGN_OR_RETURN(s.omega, rope_omega(*f.rope));
    s.rope_dims = f.rope->dims;
  }
  s.hadamard = f.hadamard;
  s.round = f.round == QatRounding::Fp8   ? cuda::finish::kRoundFp8
            : f.round == QatRounding::Fp4 ? cuda::finish::kRoundFp4
                                          : cuda::finish::kRoundNone;
  s.round_cols = f.round_cols;
  s.round_block = f.round_block;
  return s;
}

// ---- lifetime ---------------------------------------------------------------------------------------

CudaBackend::CudaBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaBackend::~CudaBackend() = default;

Result<std::unique_ptr<CudaBackend>> CudaBackend::create(const CudaBackendOptions& options) {
  DSV4_ASSIGN_OR_RETURN(const cuda::DeviceInfo info, cuda::query_device(options.device));
  if (info.compute_capability != 90)
    return Status::errorf(StatusCode::kInternal,
                          "CUDA device {} ({}) has compute capability {}.{}; this build targets sm_90a (Hopper) only",
                          options.device, info.name, info.compute_capability / 10, info.compute_capability % 10);
  if (options.batch_invariant) {
    cuda::KernelChoice choice = cuda::kernel_choice();
    choice.batch_invariant = true;
    cuda::set_kernel_choice(choice);
  }
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  m.options = options;
  m.device = options.device;
  m.sms = info.sm_count;
  DSV4_CUDA_TRY(cudaSetDevice(options.device));
  for (Impl::Lane& l : m.lanes) {
    DSV4_CUDA_TRY(cudaStreamCreateWithFlags(&l.stream, cudaStreamNonBlocking));
    DSV4_CUDA_TRY(cudaEventCreateWithFlags(&l.fork, cudaEventDisableTiming));
    DSV4_CUDA_TRY(cudaEventCreateWithFlags(&l.join, cudaEventDisableTiming));
  }
  m.stream = m.main_stream();
  DSV4_CUBLAS_TRY(cublasCreate(&m.cublas));
  DSV4_CUBLAS_TRY(cublasSetStream(m.cublas, m.stream));
  DSV4_CUBLAS_TRY(cublasSetMathMode(m.cublas, CUBLAS_PEDANTIC_MATH));  // no TF32
  DSV4_CUBLAS_TRY(cublasLtCreate(&m.cublas_lt));
  DSV4_ASSIGN_OR_RETURN(void* workspace, m.cublas_lt_workspace());
  (void)workspace;
  DSV4_CUDA_TRY(cudaMalloc(&m.device_errors, sizeof(uint32_t)));
  DSV4_CUDA_TRY(cudaMemset(m.device_errors, 0, sizeof(uint32_t)));
  DSV4_CUDA_TRY(cudaMallocHost(&m.host_errors, sizeof(uint32_t)));
  *m.host_errors = 0;
  for (cudaEvent_t& e : m.half_done) DSV4_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  DSV4_TRY(cuda::detail::iq2_tables(&m.iq2_grid, &m.iq2_signs));
  DSV4_TRY(cuda::detail::iq_tables(&m.iq_tables));
  DSV4_TRY(cuda::prepare_matvec_tables());
  DSV4_TRY(cuda::prepare_attention_kernels());  // no function attributes set inside a graph capture
  // hc_pre_norm_from_fn's clusters of 16 blocks (above the portable 8): the device must
  // schedule one, else the two kernels run (no function attributes set inside a graph capture).
  if (options.hc_cluster) {
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(hc_cluster::kBlocks, 1);
    config.blockDim = dim3(hc_cluster::kThreads);
    cudaLaunchAttribute cluster{};
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = hc_cluster::kBlocks;
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = 1;
    int clusters = 0;
    m.hc_cluster = cudaFuncSetAttribute(hc_pre_norm_cluster_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed,
                                        1) == cudaSuccess &&
                   cudaOccupancyMaxActiveClusters(&clusters, hc_pre_norm_cluster_kernel, &config) == cudaSuccess &&
                   clusters > 0;
    if (!m.hc_cluster) (void)cudaGetLastError();
  }
  const char* env = std::getenv("DSV4_POISON_SCRATCH");
  m.poison_scratch = env != nullptr && env[0] == '1';
  if (options.scratch_bytes > 0) {  // the first chunk now, so the first step does not allocate
    DSV4_ASSIGN_OR_RETURN(void* first, m.scratch_bytes(options.scratch_bytes));
    (void)first;
    m.chunk_used = 0;
  }
  // The tables and the error word were written through the legacy stream, which the backend's
  // non-blocking stream does not wait for.
  DSV4_CUDA_TRY(cudaDeviceSynchronize());
  return std::unique_ptr<CudaBackend>(new CudaBackend(std::move(impl)));
}

cudaStream_t CudaBackend::stream() const { return impl_->stream; }

DeviceMemory CudaBackend::memory() const {
  DeviceMemory m;
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) cudaGetLastError();
  m.free_bytes = free_bytes;
  m.total_bytes = total_bytes;
  m.weights_bytes = impl_->counters->weights.load();
  m.cache_bytes = impl_->counters->cache.load();
  m.scratch_bytes = impl_->scratch_total;
  return m;
}

static_assert(cuda::kCublasLtWorkspaceBytes == kDeviceWorkspaceBytes, "backend.h states the workspace");

DeviceMemoryState CudaBackend::device_memory() const {
  const DeviceMemory m = memory();
  uint64_t work = 0;  // every lane's workspace and buffers
  for (const Impl::Lane& l : impl_->lanes)
    for (const Impl::Reusable* r : l.work.all()) work += r->bytes;
  return {m.free_bytes, m.scratch_bytes + work};
}

Status CudaBackend::synchronize() {
  DSV4_TRY(impl_->join_all());
  DSV4_CUDA_TRY(cudaStreamSynchronize(impl_->stream));
  return Status::ok();
}

// ---- lanes ------------------------------------------------------------------------------------------

namespace {

// Spins for `us` microseconds of the device's clock (CudaBackendOptions::lane_delay_us).
__global__ void lane_delay_kernel(uint64_t us) {
  uint64_t start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < us * 1000);
}

}  // namespace

Status CudaBackend::fork_lane(int lane) {
  DSV4_TRY(check_lane("cuda fork_lane", lane));
  Impl& m = *impl_;
  if (!m.options.lanes) return Status::ok();
  Impl::Lane& l = m.lanes[lane];
  DSV4_CUDA_TRY(cudaEventRecord(l.fork, m.main_stream()));
  DSV4_CUDA_TRY(cudaStreamWaitEvent(l.stream, l.fork, 0));
  l.pending = true;
  m.lane = lane;
  m.stream = l.stream;
  if (m.options.lane_delay_us > 0) {
    lane_delay_kernel<<<1, 1, 0, m.options.lane_delay_main ? m.main_stream() : l.stream>>>(
        static_cast<uint64_t>(m.options.lane_delay_us));
    DSV4_CUDA_TRY_LAUNCH();
  }
  return Status::ok();
}

Status CudaBackend::main_lane() {
  Impl& m = *impl_;
  m.lane = 0;
  m.stream = m.main_stream();
  return Status::ok();
}

Status CudaBackend::join_lane(int lane) {
  DSV4_TRY(check_lane("cuda join_lane", lane));
  Impl& m = *impl_;
  Impl::Lane& l = m.lanes[lane];
  if (l.pending) {
    DSV4_TRY(m.main_waits_for(l));
    l.pending = false;
  }
  return main_lane();
}

// ---- memory -----------------------------------------------------------------------------------------

namespace {

Result<Tensor> device_tensor(CudaBackend* self, CudaBackend::Impl& m, GgmlType type, std::span<const int64_t> shape,
                             bool weight, const char* what) {
  Tensor t = make_descriptor(type, shape);
  const size_t n = tensor_bytes(t);
  if (shape.empty() || n == 0) return Status::errorf("cuda {}: empty shape {}", what, t.describe());
  for (int64_t d : shape)
    if (d <= 0) return Status::errorf("cuda {}: shape {} has a dimension below 1", what, t.describe());
  // Whole 256-byte units: the matvec kernels read 16-byte chunks up to the next boundary;
  // and 16 bytes of slack past the last byte: the dequantisers read a block as whole aligned
  // words, which for blocks not 4-byte aligned (Q8_0's 34 bytes) reach past its end.
  const size_t size = align_up(n + 16, kAlign);
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, size);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Status::errorf(StatusCode::kResourceExhausted, "cuda {}: cannot allocate {} bytes for {}: {}", what, size,
                          t.describe(), cudaGetErrorString(err));
  }
  (weight ? m.counters->weights : m.counters->cache) += size;
  t.owner = std::shared_ptr<void>(p, DeviceFree{m.counters, size, weight});
  t.data = p;
  t.backend = self;
  return t;
}

}  // namespace

Result<Tensor> CudaBackend::alloc(GgmlType type, std::span<const int64_t> shape) {
  DSV4_ASSIGN_OR_RETURN(Tensor t, device_tensor(this, *impl_, type, shape, false, "alloc"));
  DSV4_CUDA_TRY(cudaMemsetAsync(t.data, 0, align_up(tensor_bytes(t), kAlign), impl_->stream));
  return t;
}

// A GPU commits memory at allocation: a reservation is an allocation.
Result<Tensor> CudaBackend::reserve(GgmlType type, std::span<const int64_t> shape) { return alloc(type, shape); }

Result<Tensor> CudaBackend::weight(const gguf::TensorInfo& info) {
  if (info.ne.empty() || info.ne.size() > 4)
    return Status::errorf("tensor {}: rank {} unsupported", info.name, info.ne.size());
  std::vector<int64_t> shape(info.ne.rbegin(), info.ne.rend());
  DSV4_ASSIGN_OR_RETURN(Tensor t, device_tensor(this, *impl_, info.type, shape, true, "weight"));
  const size_t n = tensor_bytes(t);
  if (info.nbytes != n || info.data == nullptr)
    return Status::errorf("tensor {}: {} bytes of data for {} ({} expected)", info.name, info.nbytes, t.describe(), n);
  Impl& m = *impl_;
  const size_t size = align_up(n, kAlign);
  if (size > n) DSV4_CUDA_TRY(cudaMemsetAsync(static_cast<uint8_t*>(t.data) + n, 0, size - n, m.stream));
  // The staging buffer's two halves in turn: the host fills one while the other is copied.
  DSV4_TRY(m.wait_all());
  m.pinned_used = 0;
  if (m.pinned_bytes < kPinnedMax) {
    if (m.pinned) DSV4_CUDA_TRY(cudaFreeHost(m.pinned));
    m.pinned = nullptr;
    m.pinned_bytes = 0;
    DSV4_CUDA_TRY(cudaMallocHost(&m.pinned, kPinnedMax));
    m.pinned_bytes = kPinnedMax;
  }
  const size_t half = m.pinned_bytes / 2;
  bool used[2] = {false, false};
  int which = 0;
  for (size_t done = 0; done < n; which ^= 1) {
    const size_t piece = std::min(half, n - done);
    if (used[which]) DSV4_CUDA_TRY(cudaEventSynchronize(m.half_done[which]));
    uint8_t* at = static_cast<uint8_t*>(m.pinned) + which * half;
    std::memcpy(at, info.data + done, piece);
    DSV4_CUDA_TRY(cudaMemcpyAsync(static_cast<uint8_t*>(t.data) + done, at, piece, cudaMemcpyHostToDevice, m.stream));
    DSV4_CUDA_TRY(cudaEventRecord(m.half_done[which], m.stream));
    used[which] = true;
    done += piece;
    if (m.options.on_upload_progress) m.options.on_upload_progress(done, n);
  }
  DSV4_CUDA_TRY(cudaStreamSynchronize(m.stream));
  return t;
}

Status CudaBackend::upload(const Tensor& dst, const void* host, size_t bytes) {
  if (!dst.valid() || dst.backend != this || !dst.contiguous())
    return Status::errorf("cuda upload: {} is not a contiguous tensor of this backend", dst.describe());
  if (bytes > tensor_bytes(dst))
    return Status::errorf("cuda upload: {} bytes into {} ({} bytes)", bytes, dst.describe(), tensor_bytes(dst));
  return impl_->stage_upload(dst.data, host, bytes);
}

Status CudaBackend::download(const Tensor& src, void* host, size_t bytes) {
  if (!src.valid() || src.backend != this || !src.contiguous())
    return Status::errorf("cuda download: {} is not a contiguous tensor of this backend", src.describe());
  if (bytes > tensor_bytes(src))
    return Status::errorf("cuda download: {} bytes from {} ({} bytes)", bytes, src.describe(), tensor_bytes(src));
  Impl& m = *impl_;
  DSV4_TRY(m.join_all());
  if (bytes > 0) DSV4_CUDA_TRY(cudaMemcpyAsync(host, src.data, bytes, cudaMemcpyDeviceToHost, m.stream));
  DSV4_CUDA_TRY(cudaMemcpyAsync(m.host_errors, m.device_errors, sizeof(uint32_t), cudaMemcpyDeviceToHost, m.stream));
  DSV4_CUDA_TRY(cudaMemsetAsync(m.device_errors, 0, sizeof(uint32_t), m.stream));
  DSV4_CUDA_TRY(cudaStreamSynchronize(m.stream));
  m.pinned_used = 0;
  if (*m.host_errors != 0) {
    const uint32_t bits = *m.host_errors;
    *m.host_errors = 0;
    return Status::errorf(StatusCode::kInternal, "cuda: found on the device since the last download: {}",
                          device_error_text(bits));
  }
  return Status::ok();
}

Status CudaBackend::copy_rows(const Tensor& src, const Tensor& dst) {
  if (!src.valid() || !dst.valid() || src.backend != this || dst.backend != this || src.type != dst.type ||
      src.cols() != dst.cols() || dst.rows() < src.rows())
    return Status::errorf("cuda copy_rows: {} into {}", src.describe(), dst.describe());
  const auto row_bytes = ggml_row_bytes(src.type, static_cast<uint64_t>(src.cols()));
  if (!row_bytes) return Status::errorf("cuda copy_rows: rows of {} are not whole blocks", src.describe());
  const int64_t rows = src.rows();
  if (rows == 0) return Status::ok();
  const auto pitch = [&](const Tensor& t) { return t.rank >= 2 ? static_cast<size_t>(t.row_stride()) : *row_bytes; };
  if ((rows > 1 && (pitch(src) < *row_bytes || pitch(dst) < *row_bytes)))
    return Status::errorf("cuda copy_rows: rows of {} overlap", pitch(src) < *row_bytes ? src.describe() : dst.describe());
  DSV4_CUDA_TRY(cudaMemcpy2DAsync(dst.data, pitch(dst), src.data, pitch(src), *row_bytes, static_cast<size_t>(rows),
                                  cudaMemcpyDeviceToDevice, impl_->stream));
  return Status::ok();
}

Status CudaBackend::fill(const Tensor& t, float value) {
  if (t.type == GgmlType::F32) {
    DSV4_ASSIGN_OR_RETURN(const Mat<float> v, cudaops::f32(t, this, "fill", "t", -1, -1));
    cuda::launch_dependent(fill_kernel<float>, cudaops::row_tile_grid(v.rows, v.cols), cudaops::kRowTileThreads, 0,
                           impl_->stream, v, value);
  } else if (t.type == GgmlType::I32) {
    if (!(value >= -2147483648.0f && value < 2147483648.0f) || value != std::trunc(value))
      return Status::errorf("cuda fill: {} is not an int32 value for {}", value, t.describe());
    DSV4_ASSIGN_OR_RETURN(const Mat<int32_t> v, cudaops::i32(t, this, "fill", "t", -1, -1));
    cuda::launch_dependent(fill_kernel<int32_t>, cudaops::row_tile_grid(v.rows, v.cols), cudaops::kRowTileThreads, 0,
                           impl_->stream, v, static_cast<int32_t>(value));
  } else {
    return Status::errorf("cuda fill: {} is neither f32 nor i32", t.describe());
  }
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

void CudaBackend::begin_step() {
  Impl& m = *impl_;
  if (!m.join_all().is_ok()) cudaGetLastError();  // a failed record shows at the next launch check
  // One chunk of the total from now on, but never while a graph is being recorded (no
  // allocation may happen then: the step that needed the chunks ran just before and its
  // recording needs the same) nor once any graph holds the chunks' addresses (freeing them
  // would leave its replays writing to freed memory). A 48-row step of --batch-invariant on the
  // 43-layer file outgrew the first chunk and lost its arena at the recording's begin_step.
  if (m.chunks.size() > 1 && !m.capturing && m.graphs.empty()) {
    if (cudaStreamSynchronize(m.stream) != cudaSuccess) cudaGetLastError();
    std::vector<size_t> sizes;
    for (const Impl::Chunk& c : m.chunks) {
      sizes.push_back(c.bytes);
      cudaFree(c.ptr);
    }
    m.chunks.clear();
    void* p = nullptr;
    if (cudaMalloc(&p, m.scratch_total) == cudaSuccess) {
      m.chunks.push_back({p, m.scratch_total});
    } else {
      // Not in one piece (fragmented or nearly full memory): the chunks the last step held
      // again, which fit a moment ago, so a graph captured next finds its arena grown.
      cudaGetLastError();
      m.scratch_total = 0;
      for (const size_t bytes : sizes) {
        if (cudaMalloc(&p, bytes) != cudaSuccess) {
          cudaGetLastError();  // scratch() allocates again and reports what fails
          break;
        }
        m.chunks.push_back({p, bytes});
        m.scratch_total += bytes;
      }
    }
  }
  m.chunk = 0;
  m.chunk_used = 0;
}

Backend::ScratchMark CudaBackend::scratch_mark() const { return {impl_->chunk, impl_->chunk_used}; }

void CudaBackend::scratch_release(ScratchMark mark) {
  // The released scratch is handed out again: what a side lane was given reads or writes it.
  if (!impl_->join_all().is_ok()) cudaGetLastError();
  impl_->chunk = mark.chunk;
  impl_->chunk_used = mark.offset;
}

Result<Tensor> CudaBackend::scratch(GgmlType type, std::span<const int64_t> shape) {
  Tensor t = make_descriptor(type, shape);
  const size_t n = tensor_bytes(t);
  if (shape.empty() || n == 0) return Status::errorf("cuda scratch: empty shape {}", t.describe());
  DSV4_ASSIGN_OR_RETURN(t.data, impl_->scratch_bytes(n));
  t.backend = this;
  if (impl_->poison_scratch)  // 0xFF bytes are a NaN in f32
    DSV4_CUDA_TRY(cudaMemsetAsync(t.data, type == GgmlType::F32 ? 0xFF : 0xA5, n, impl_->stream));
  return t;
}

// ---- dense operations -------------------------------------------------------------------------------

namespace {

// Raw device bytes `bytes` long at `p` as a 16-byte aligned buffer readable 16 bytes past its
// end: `p` itself when it is, else a scratch copy.
Result<const void*> aligned_bytes(CudaBackend::Impl& m, const void* p, size_t bytes, size_t align) {
  if (reinterpret_cast<uintptr_t>(p) % align == 0) return p;
  DSV4_ASSIGN_OR_RETURN(void* copy, m.scratch_bytes(bytes + 16));
  DSV4_CUDA_TRY(cudaMemcpyAsync(copy, p, bytes, cudaMemcpyDeviceToDevice, m.stream));
  return static_cast<const void*>(copy);
}

Status copy_matrix(CudaBackend::Impl& m, float* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t rows,
                   int64_t cols) {
  DSV4_CUDA_TRY(cudaMemcpy2DAsync(dst, static_cast<size_t>(ld_dst) * 4, src, static_cast<size_t>(ld_src) * 4,
                                  static_cast<size_t>(cols) * 4, static_cast<size_t>(rows), cudaMemcpyDeviceToDevice,
                                  m.stream));
  return Status::ok();
}

struct WeightMatrix {
  GgmlType type;
  const uint8_t* data;
  int64_t n, k, row_bytes;
};

Status exact_product(CudaBackend::Impl& m, const WeightMatrix& w, const Mat<float>& x, const Mat<float>& y) {
  cuda::ExactWeights ew;
  ew.type = w.type;
  ew.data = w.data;
  ew.n = w.n;
  ew.k = w.k;
  ew.row_bytes = w.row_bytes;
  ew.tables = {m.iq2_grid, m.iq2_signs, m.iq_tables};
  return cuda::exact_matmul(ew, x.p, x.ld, x.rows, y.p, y.ld, m.stream);
}

// 1-16 rows: the integer matvec kernels on contiguous activations and outputs.
Status matvec_product(CudaBackend::Impl& m, const WeightMatrix& w, const Mat<float>& x, const Mat<float>& y) {
  const int64_t rows = x.rows, n = w.n, k = w.k;
  DSV4_ASSIGN_OR_RETURN(const void* wd, aligned_bytes(m, w.data, static_cast<size_t>(n * w.row_bytes), 16));
  const float* xp = x.p;
  // One row has no stride to speak of: a column slice (the grouped output projection's
  // heads) goes in and out in place instead of through two copies.
  const bool one_row = rows == 1;
  if ((!one_row && x.ld != k) || reinterpret_cast<uintptr_t>(x.p) % 16 != 0) {
    DSV4_ASSIGN_OR_RETURN(void* tmp, m.scratch_bytes(static_cast<size_t>(rows * k) * 4));
    DSV4_TRY(copy_matrix(m, static_cast<float*>(tmp), k, x.p, x.ld, rows, k));
    xp = static_cast<const float*>(tmp);
  }
  float* yp = y.p;
  const bool copy_out = !one_row && y.ld != n;
  if (copy_out) {
    DSV4_ASSIGN_OR_RETURN(void* tmp, m.scratch_bytes(static_cast<size_t>(rows * n) * 4));
    yp = static_cast<float*>(tmp);
  }
  const cuda::MatvecWeights mw{w.type, wd, n, k, 1, 0};
  const size_t ws_bytes = cuda::matvec_workspace_bytes(mw, static_cast<int>(rows));
  void* ws = nullptr;
  if (ws_bytes) {
    DSV4_ASSIGN_OR_RETURN(ws, m.scratch_bytes(ws_bytes));
  }
  DSV4_TRY(cuda::matvec(mw, xp, static_cast<int>(rows), yp, ws, ws_bytes, m.stream));
  if (copy_out) DSV4_TRY(copy_matrix(m, y.p, y.ld, yp, n, rows, n));
  return Status::ok();
}

// MatmulMode::Float32 on many rows: the weights decoded exactly to f32 (per chunk of output
// rows; F32 weights in place), then either cuBLASLt's fp32 GEMM straight from x into y, or
// (KernelChoice::float32_split_terms, from kSplitMinOutputs outputs) x and the weights split
// into BF16 parts and one BF16 GEMM over the parts' products (gemm_prefill.h). A prefill
// chunk's mixes, compressors and routers took a quarter of it through the exact kernel's
// tiles (issue 10's prefill profile: 4 ms per Q8_0 compressor at 4096 rows), and the fp32
// GEMM still runs without the tensor cores.
constexpr int64_t kFloat32GemmFromRows = 65;  // fewer: the staged exact kernel (exact_gemm.cu)
// Fewer outputs (the mixes' 24): the product reads x about once either way, and splitting x
// would triple its bytes.
constexpr int64_t kSplitMinOutputs = 64;

// The split's terms for a product of k inputs and n outputs, 0 for the fp32 GEMM.
int float32_split_terms(int64_t n, int64_t k) {
  const int terms = cuda::kernel_choice().float32_split_terms;
  return cuda::bf16_split_terms_valid(terms) && n >= kSplitMinOutputs && k % 8 == 0 ? terms : 0;
}

// Whether f32_gemm_product takes weights of `type` now: it decodes them exactly (a decoder and
// its tables), and not inside graph capture (its chunk buffers may have to grow, a
// synchronisation, which a graph cannot hold).
Result<bool> f32_gemm_takes(CudaBackend::Impl& m, GgmlType type) {
  if (type == GgmlType::I32 || !cuda::exact::supported(type) ||
      !cuda::exact::tables_ready(type, {m.iq2_grid, m.iq2_signs, m.iq_tables}))
    return false;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  DSV4_CUDA_TRY(cudaStreamIsCapturing(m.stream, &capture));
  return capture == cudaStreamCaptureStatusNone;
}

// x's parts for the split products (in the lane's BF16 activation buffer).
Result<const __nv_bfloat16*> split_activations(CudaBackend::Impl& m, const Mat<float>& x, int terms) {
  DSV4_ASSIGN_OR_RETURN(void* raw, m.reusable(m.work().bf16_activations,
                                              static_cast<size_t>(x.rows * terms * x.cols) * sizeof(__nv_bfloat16)));
  auto* parts = static_cast<__nv_bfloat16*>(raw);
  DSV4_TRY(cuda::split_to_bf16(x.p, x.ld, x.rows, x.cols, terms, cuda::Bf16SplitSide::activations, parts, m.stream));
  return parts;
}

// `x_parts`: x already split into `terms` parts (matmul_many's products of one x), else null.
Status f32_gemm_product(CudaBackend::Impl& m, const WeightMatrix& w, const Mat<float>& x, const Mat<float>& y,
                        int terms = 0, const __nv_bfloat16* x_parts = nullptr) {
  const int64_t rows = x.rows, n = w.n, k = w.k;
  const bool in_place = w.type == GgmlType::F32 && w.row_bytes % 4 == 0 && reinterpret_cast<uintptr_t>(w.data) % 16 == 0;
  const int64_t budget = int64_t{128} << 20;  // bytes of f32 (or split BF16) weights a chunk
  const int64_t chunk = terms > 0 ? std::min(n, std::max<int64_t>(1, budget / (k * 2 * terms)))
                        : in_place ? n
                                   : std::min(n, std::max<int64_t>(1, budget / (k * 4)));
  if (terms > 0 && x_parts == nullptr) {
    DSV4_ASSIGN_OR_RETURN(x_parts, split_activations(m, x, terms));
  }
  DSV4_ASSIGN_OR_RETURN(void* workspace, m.cublas_lt_workspace());
  float* decoded = nullptr;
  if (!in_place) {
    DSV4_ASSIGN_OR_RETURN(void* raw, m.reusable(m.work().f32_weights, static_cast<size_t>(chunk * k) * sizeof(float)));
    decoded = static_cast<float*>(raw);
  }
  __nv_bfloat16* w_parts = nullptr;
  if (terms > 0) {
    DSV4_ASSIGN_OR_RETURN(void* raw, m.reusable(m.work().bf16_weights,
                                                static_cast<size_t>(chunk * terms * k) * sizeof(__nv_bfloat16)));
    w_parts = static_cast<__nv_bfloat16*>(raw);
  }
  const cuda::exact::Tables tables{m.iq2_grid, m.iq2_signs, m.iq_tables};
  for (int64_t o0 = 0; o0 < n; o0 += chunk) {
    const int64_t nc = std::min(chunk, n - o0);
    const uint8_t* src = w.data + o0 * w.row_bytes;
    const float* wt = reinterpret_cast<const float*>(src);
    int64_t ldw = w.row_bytes / 4;
    if (!in_place) {
      cuda::exact::dispatch(w.type, [&](auto tag) {
        cuda::launch_dependent(decode_rows_kernel<decltype(tag)::value>, cudaops::grid_for(nc * k), 256, 0, m.stream,
                               src, w.row_bytes, nc, k, decoded, tables);
        return 0;
      });
      DSV4_CUDA_TRY_LAUNCH();
      wt = decoded;
      ldw = k;
    }
    if (terms > 0) {
      DSV4_TRY(cuda::split_to_bf16(wt, ldw, nc, k, terms, cuda::Bf16SplitSide::weights, w_parts, m.stream));
      // Straight into y where its rows are 16-byte aligned (a column slice of a wider y may
      // not be), else through scratch.
      float* c = y.p + o0;
      int64_t ldc = y.ld;
      const bool direct = reinterpret_cast<uintptr_t>(c) % 16 == 0 && ldc % 4 == 0;
      if (!direct) {
        ldc = (nc + 3) / 4 * 4;
        DSV4_ASSIGN_OR_RETURN(void* raw, m.scratch_bytes(static_cast<size_t>(rows * ldc) * sizeof(float)));
        c = static_cast<float*>(raw);
      }
      DSV4_TRY(cuda::gemm_bf16_split(m.cublas_lt, x_parts, w_parts, c, ldc, rows, nc, k, terms, workspace,
                                     cuda::kCublasLtWorkspaceBytes, m.stream));
      if (!direct) DSV4_TRY(copy_matrix(m, y.p + o0, y.ld, c, ldc, rows, nc));
    } else {
      DSV4_TRY(cuda::gemm_f32(m.cublas_lt, x.p, x.ld, wt, ldw, y.p + o0, y.ld, rows, nc, k, workspace,
                              cuda::kCublasLtWorkspaceBytes, m.stream));
    }
  }
  return Status::ok();
}

// More rows: BF16 weights (dequantised per chunk of output rows) times BF16 activations on
// cuBLASLt, f32 out; chunks of at most 256 MB of BF16 weights, rows padded to 8. The BF16
// copies live in the backend's reusable buffers; the product goes straight into y when y is
// a contiguous [rows, n] with n a multiple of 8 and one chunk covers it.
Status gemm_product(CudaBackend::Impl& m, const WeightMatrix& w, const Mat<float>& x, const Mat<float>& y) {
  const int64_t rows = x.rows, n = w.n, k = w.k;
  DSV4_ASSIGN_OR_RETURN(void* workspace, m.cublas_lt_workspace());
  DSV4_ASSIGN_OR_RETURN(void* a_raw, m.reusable(m.work().bf16_activations, static_cast<size_t>(rows * k) * sizeof(__nv_bfloat16)));
  auto* a = static_cast<__nv_bfloat16*>(a_raw);
  cuda::launch_dependent(f32_to_bf16_rows_kernel, cudaops::row_tile_grid(rows, k), cudaops::kRowTileThreads, 0,
                         m.stream, x, a);
  DSV4_CUDA_TRY_LAUNCH();
  const int64_t by_bytes = std::max<int64_t>(64, ((int64_t{256} << 20) / (k * 2)) / 64 * 64);
  const int64_t chunk = std::min(by_bytes, (n + 7) / 8 * 8);
  const bool direct = chunk >= n && n % 8 == 0 && y.ld == n && reinterpret_cast<uintptr_t>(y.p) % kAlign == 0;
  DSV4_ASSIGN_OR_RETURN(void* wb_raw, m.reusable(m.work().bf16_weights, static_cast<size_t>(chunk * k) * sizeof(__nv_bfloat16)));
  float* c = y.p;
  if (!direct) {
    DSV4_ASSIGN_OR_RETURN(void* c_raw, m.scratch_bytes(static_cast<size_t>(rows * chunk) * sizeof(float)));
    c = static_cast<float*>(c_raw);
  }
  auto* wb = static_cast<__nv_bfloat16*>(wb_raw);
  for (int64_t o0 = 0; o0 < n; o0 += chunk) {
    const int64_t nc = std::min(chunk, n - o0), padded = (nc + 7) / 8 * 8;
    const uint8_t* src = w.data + o0 * w.row_bytes;
    const size_t src_bytes = static_cast<size_t>(nc * w.row_bytes);
    const __nv_bfloat16* wt = wb;
    if (w.type == GgmlType::BF16) {
      if (padded == nc && reinterpret_cast<uintptr_t>(src) % kAlign == 0)
        wt = reinterpret_cast<const __nv_bfloat16*>(src);
      else
        DSV4_CUDA_TRY(cudaMemcpyAsync(wb, src, src_bytes, cudaMemcpyDeviceToDevice, m.stream));
    } else {
      DSV4_ASSIGN_OR_RETURN(const void* s, aligned_bytes(m, src, src_bytes, 4));
      DSV4_TRY(cuda::dequantize_to_bf16(w.type, s, nc, k, wb, m.stream));
    }
    if (padded > nc && wt == wb)
      DSV4_CUDA_TRY(cudaMemsetAsync(wb + nc * k, 0, static_cast<size_t>((padded - nc) * k) * sizeof(__nv_bfloat16),
                                    m.stream));
    DSV4_TRY(cuda::gemm_bf16(m.cublas_lt, a, wt, c, rows, padded, k, workspace,
                             cuda::kCublasLtWorkspaceBytes, m.stream));
    if (!direct) DSV4_TRY(copy_matrix(m, y.p + o0, y.ld, c, padded, rows, nc));
  }
  return Status::ok();
}

}  // namespace

Status CudaBackend::matmul(const Tensor& w, const Tensor& x, const Tensor& y, MatmulMode mode) {
  if (!w.valid() || w.backend != this || w.rank != 2)
    return Status::errorf("matmul: weights {} are not a matrix of this backend", w.describe());
  const int64_t n_in = w.cols(), n_out = w.rows();
  DSV4_ASSIGN_OR_RETURN(const Mat<float> xv, cudaops::f32(x, this, "matmul", "x", -1, n_in));
  DSV4_ASSIGN_OR_RETURN(Mat<float> yv, cudaops::f32(y, this, "matmul", "y", xv.rows, n_out));
  yv.rows = xv.rows;
  if (xv.rows == 0) return Status::ok();
  const auto row_bytes = ggml_row_bytes(w.type, static_cast<uint64_t>(n_in));
  if (!row_bytes || w.row_stride() < static_cast<int64_t>(*row_bytes))
    return Status::errorf("matmul: weights {} with rows {} bytes apart", w.describe(), w.row_stride());
  const WeightMatrix wm{w.type, static_cast<const uint8_t*>(w.data), n_out, n_in, w.row_stride()};
  Impl& m = *impl_;
  const bool quantized = mode == MatmulMode::Quantized && cuda::matvec_supported(w.type) && n_in % 32 == 0 &&
                         w.row_stride() == static_cast<int64_t>(*row_bytes);
  if (mode == MatmulMode::Float32 && xv.rows >= kFloat32GemmFromRows) {
    DSV4_ASSIGN_OR_RETURN(const bool takes, f32_gemm_takes(m, w.type));
    if (takes) return f32_gemm_product(m, wm, xv, yv, float32_split_terms(n_out, n_in));
  }
  // Float32 on a few rows of F32, BF16 or Q8_0 weights (decode's mixes, router, compressors):
  // float32_rows.h.
  if (mode == MatmulMode::Float32 && xv.rows <= cuda::kFloat32RowsMax &&
      cuda::float32_rows_applies(w.type, w.data, w.row_stride(), n_in, xv.p, xv.ld))
    return cuda::float32_rows_matmul(w.type, w.data, w.row_stride(), n_out, n_in, xv.p, xv.ld, xv.rows, yv.p, yv.ld,
                                     m.stream);
  if (!quantized) return exact_product(m, wm, xv, yv);
  if (xv.rows <= cuda::kMatvecMaxRows) return matvec_product(m, wm, xv, yv);
  // 17-64 rows: the int8 tensor-core kernels where they take the type (mmq.h); in
  // batch-invariant mode always matvec (else its dp4a kernel in slices of 16 rows, matvec.h).
  const cuda::MatvecWeights mw{w.type, w.data, n_out, n_in, 1, 0};
  if (xv.rows <= cuda::kMmaMaxRows &&
      (cuda::kernel_choice().batch_invariant || cuda::mma_matmul_applies(mw, static_cast<int>(xv.rows))))
    return matvec_product(m, wm, xv, yv);
  return gemm_product(m, wm, xv, yv);
}

// Float32 products of a few rows with weights of one type and width (a layer's compressors
// and index weights): one launch of float32_rows for all of them, each output the bits of its
// own matmul. Of many rows, split into BF16 parts: x split once for all of them, each
// output the bits of its own matmul. Anything else: the separate calls.
Status CudaBackend::matmul_many(std::span<const Tensor* const> ws, const Tensor& x, std::span<const Tensor* const> ys,
                                MatmulMode mode) {
  if (mode != MatmulMode::Float32 || ws.size() < 2 || ws.size() != ys.size() ||
      ws.size() > static_cast<size_t>(cuda::kFloat32RowsMaxMatrices))
    return Backend::matmul_many(ws, x, ys, mode);
  DSV4_ASSIGN_OR_RETURN(const Mat<float> xv, cudaops::f32(x, this, "matmul_many", "x", -1, -1));
  if (xv.rows >= kFloat32GemmFromRows) {
    // Of many rows, split into BF16 parts (f32_gemm_product): x's parts made once for all,
    // each output the bits of its own matmul, where every weight takes the same split.
    Impl& m = *impl_;
    const int terms = cuda::kernel_choice().float32_split_terms;
    std::vector<WeightMatrix> wms;
    std::vector<Mat<float>> yvs;
    bool takes = cuda::bf16_split_terms_valid(terms);
    for (size_t i = 0; takes && i < ws.size(); ++i) {
      const Tensor& w = *ws[i];
      takes = w.valid() && w.backend == this && w.rank == 2 && w.cols() == xv.cols &&
              w.row_stride() >= static_cast<int64_t>(ggml_row_bytes(w.type, w.cols()).value_or(INT64_MAX)) &&
              float32_split_terms(w.rows(), w.cols()) == terms;
      if (takes) {
        DSV4_ASSIGN_OR_RETURN(takes, f32_gemm_takes(m, w.type));
      }
      if (!takes) break;
      DSV4_ASSIGN_OR_RETURN(Mat<float> yv, cudaops::f32(*ys[i], this, "matmul_many", "y", xv.rows, w.rows()));
      yv.rows = xv.rows;
      wms.push_back({w.type, static_cast<const uint8_t*>(w.data), w.rows(), w.cols(), w.row_stride()});
      yvs.push_back(yv);
    }
    if (!takes) return Backend::matmul_many(ws, x, ys, mode);
    DSV4_ASSIGN_OR_RETURN(const __nv_bfloat16* x_parts, split_activations(m, xv, terms));
    for (size_t i = 0; i < wms.size(); ++i) DSV4_TRY(f32_gemm_product(m, wms[i], xv, yvs[i], terms, x_parts));
    return Status::ok();
  }
  if (xv.rows < 1 || xv.rows > cuda::kFloat32RowsMax) return Backend::matmul_many(ws, x, ys, mode);
  std::vector<cuda::Float32Matrix> ms;
  for (size_t i = 0; i < ws.size(); ++i) {
    const Tensor& w = *ws[i];
    const bool takes = w.valid() && w.backend == this && w.rank == 2 && w.type == ws[0]->type && w.cols() == xv.cols &&
                       w.row_stride() >= static_cast<int64_t>(ggml_row_bytes(w.type, w.cols()).value_or(INT64_MAX)) &&
                       cuda::float32_rows_applies(w.type, w.data, w.row_stride(), xv.cols, xv.p, xv.ld);
    if (!takes) return Backend::matmul_many(ws, x, ys, mode);
    DSV4_ASSIGN_OR_RETURN(const Mat<float> yv, cudaops::f32(*ys[i], this, "matmul_many", "y", xv.rows, w.rows()));
    ms.push_back({w.data, w.row_stride(), w.rows(), yv.p, yv.ld});
  }
  return cuda::float32_rows_matmul_many(ws[0]->type, ms, xv.cols, xv.p, xv.ld, xv.rows, impl_->stream);
}

// The groups are a batch of matrices for one matvec call, x's groups its consecutive inputs and y's its consecutive outputs; the same kernel per group
// as separate calls (the row kernels, their activations quantised by one launch for all
// groups instead of inside them: the same Q8 blocks; the tensor-core kernels, whose columns
// do not depend on the batch), so the same bits. One row reads x and writes y in place; 2-64
// rows go through group-major copies (regroup_kernel), one product for every group instead
// of one per group with its own activation quantisation (a verify step's or a batch's wo_a:
// 8 groups). Else the base class's loop.
Status CudaBackend::matmul_grouped(const Tensor& w, const Tensor& x, const Tensor& y, int64_t groups,
                                   MatmulMode mode) {
  const bool batchable = mode == MatmulMode::Quantized && groups > 1 && w.valid() && w.backend == this &&
                         w.rank == 2 && w.rows() % groups == 0 && cuda::matvec_supported(w.type) &&
                         w.cols() % 32 == 0 && !cuda::kernel_choice().batch_invariant;
  if (!batchable) return Backend::matmul_grouped(w, x, y, groups, mode);
  const int64_t n = w.rows() / groups, k = w.cols();
  DSV4_ASSIGN_OR_RETURN(const Mat<float> xv, cudaops::f32(x, this, "matmul_grouped", "x", -1, groups * k));
  DSV4_ASSIGN_OR_RETURN(const Mat<float> yv, cudaops::f32(y, this, "matmul_grouped", "y", xv.rows, groups * n));
  const auto row_bytes = ggml_row_bytes(w.type, static_cast<uint64_t>(k));
  if (xv.rows < 1 || !row_bytes || w.row_stride() != static_cast<int64_t>(*row_bytes) ||
      reinterpret_cast<uintptr_t>(w.data) % 16 != 0 || reinterpret_cast<uintptr_t>(xv.p) % 16 != 0)
    return Backend::matmul_grouped(w, x, y, groups, mode);
  Impl& m = *impl_;
  const int rows = static_cast<int>(std::min<int64_t>(xv.rows, INT32_MAX));
  const cuda::MatvecWeights mw{w.type, w.data, n, k, groups, 0};
  const size_t ws_bytes = cuda::matvec_workspace_bytes(mw, rows);
  if (rows == 1) {
    void* ws = nullptr;
    if (ws_bytes) {
      DSV4_ASSIGN_OR_RETURN(ws, m.scratch_bytes(ws_bytes));
    }
    return cuda::matvec(mw, xv.p, 1, yv.p, ws, ws_bytes, m.stream);
  }
  const cuda::KernelChoice choice = cuda::kernel_choice();
  const bool takes = choice.grouped_batch &&
                     (rows <= cuda::kMatvecMaxRows ||
                      (rows <= cuda::kMmaMaxRows && choice.matvec_mma && cuda::mma_matmul_applies(mw, rows)));
  if (!takes || k % 4 != 0 || n % 4 != 0 || xv.ld % 4 != 0 || yv.ld % 4 != 0 ||
      reinterpret_cast<uintptr_t>(yv.p) % 16 != 0)
    return Backend::matmul_grouped(w, x, y, groups, mode);
  DSV4_ASSIGN_OR_RETURN(void* xg_raw, m.scratch_bytes(static_cast<size_t>(groups * rows * k) * sizeof(float)));
  DSV4_ASSIGN_OR_RETURN(void* yg_raw, m.scratch_bytes(static_cast<size_t>(groups * rows * n) * sizeof(float)));
  void* ws = nullptr;
  if (ws_bytes) {
    DSV4_ASSIGN_OR_RETURN(ws, m.scratch_bytes(ws_bytes));
  }
  auto* xg = static_cast<float*>(xg_raw);
  auto* yg = static_cast<float*>(yg_raw);
  const unsigned blocks = static_cast<unsigned>(groups * rows);
  cuda::launch_dependent(regroup_kernel, blocks, 256, 0, m.stream, xv.p, xg, xv.rows, groups, k, xv.ld, true);
  DSV4_CUDA_TRY_LAUNCH();
  DSV4_TRY(cuda::matvec(mw, xg, rows, yg, ws, ws_bytes, m.stream));
  cuda::launch_dependent(regroup_kernel, blocks, 256, 0, m.stream, yg, yv.p, xv.rows, groups, n, yv.ld, false);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

Status CudaBackend::get_rows(const Tensor& table, const Tensor& ids, const Tensor& y) {
  if (!table.valid() || table.backend != this || !cuda::exact::supported(table.type))
    return Status::errorf("get_rows: table {} is not a table of this backend with a decoder", table.describe());
  if (!ids.valid() || ids.backend != this || ids.type != GgmlType::I32 || !ids.contiguous())
    return Status::errorf("get_rows: ids {} must be contiguous i32", ids.describe());
  const int64_t n = ids.n_elements();
  DSV4_ASSIGN_OR_RETURN(Mat<float> yv, cudaops::f32(y, this, "get_rows", "y", n, table.cols()));
  if (n == 0) return Status::ok();
  const int64_t row_bytes = table.rank >= 2 ? table.row_stride() : static_cast<int64_t>(tensor_bytes(table));
  Impl& m = *impl_;
  const cuda::exact::Tables tables{m.iq2_grid, m.iq2_signs, m.iq_tables};
  const auto* data = static_cast<const uint8_t*>(table.data);
  const auto* id = static_cast<const int32_t*>(ids.data);
  const dim3 grid = cudaops::row_tile_grid(n, yv.cols);
  cuda::exact::dispatch(table.type, [&](auto tag) {
    cuda::launch_dependent(get_rows_kernel<decltype(tag)::value>, grid, cudaops::kRowTileThreads, 0, m.stream, data,
                           table.rows(), row_bytes, id, n, yv, tables, m.device_errors);
    return 0;
  });
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

Status CudaBackend::rms_norm(const Tensor& x, const Tensor* weight, float eps, int64_t width, const Tensor& y) {
  DSV4_ASSIGN_OR_RETURN(const Mat<float> xv, cudaops::f32(x, this, "rms_norm", "x", -1, -1));
  DSV4_ASSIGN_OR_RETURN(const Mat<float> yv, cudaops::f32(y, this, "rms_norm", "y", xv.rows, xv.cols));
  if (width <= 0 || xv.cols % width)
    return Status::errorf("rms_norm: width {} does not divide row {}", width, xv.cols);
  const float* w = nullptr;
  if (weight) {
    DSV4_ASSIGN_OR_RETURN(const Mat<float> wv, cudaops::f32(*weight, this, "rms_norm", "weight", -1, width));
    w = wv.p;
  }
  const int64_t groups = xv.cols / width, blocks = xv.rows * groups;
  if (blocks == 0) return Status::ok();
  if (blocks > INT32_MAX) return Status::errorf("rms_norm: {} groups exceed the grid", blocks);
  // About four values per thread: a decode step normalises one row per launch, and one block
  // of 256 threads walked a 4096-wide row in 16 dependent rounds of loads (issue 10's profile).
  const int threads = static_cast<int>(std::clamp<int64_t>((width / 4 + 31) / 32 * 32, 64, 1024));
  cuda::launch_dependent(rms_norm_kernel, static_cast<unsigned>(blocks), threads, 0, impl_->stream, xv, w, eps, width,
                         groups, yv);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

Status CudaBackend::rope(const Tensor& x, int64_t head_dim, const Tensor& positions, const RopeParams& p,
                         bool inverse) {
  DSV4_ASSIGN_OR_RETURN(const Mat<float> xv, cudaops::f32(x, this, "rope", "x", -1, -1));
  if (!positions.valid() || positions.backend != this || positions.type != GgmlType::I32 ||
      !positions.contiguous() || positions.n_elements() < xv.rows || head_dim < p.dims || head_dim <= 0 ||
      xv.cols % head_dim || p.dims % 2 || p.dims <= 0)
    return Status::errorf("rope: x {} head_dim {} rope dims {} positions {}", x.describe(), head_dim, p.dims,
                          positions.describe());
  DSV4_ASSIGN_OR_RETURN(const float* omega, impl_->rope_omega(p));
  const int64_t count = xv.rows * (xv.cols / head_dim) * (p.dims / 2);
  if (count == 0) return Status::ok();
  cuda::launch_dependent(rope_kernel, cudaops::row_tile_grid(xv.rows, count / xv.rows), cudaops::kRowTileThreads, 0,
                         impl_->stream, xv, head_dim, p.dims, static_cast<const int32_t*>(positions.data), omega,
                         inverse);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

Status CudaBackend::finish_rows(const Tensor& x, const Tensor& positions, const RowFinish& f) {
  DSV4_ASSIGN_OR_RETURN(const Mat<float> xv, cudaops::f32(x, this, "finish_rows", "x", -1, -1));
  DSV4_ASSIGN_OR_RETURN(const cuda::finish::Spec s, impl_->finish_spec(this, "finish_rows", x, f));
  if (f.rope && (!positions.valid() || positions.backend != this || positions.type != GgmlType::I32 ||
                 !positions.contiguous() || positions.n_elements() < xv.rows))
    return Status::errorf("finish_rows: positions {} for x {}", positions.describe(), x.describe());
  const int64_t groups = xv.cols / f.group, blocks = xv.rows * groups;
  if (blocks == 0) return Status::ok();
  if (blocks > INT32_MAX) return Status::errorf("finish_rows: {} groups exceed the grid", blocks);
  cuda::launch_dependent(finish_rows_kernel, static_cast<unsigned>(blocks), cuda::finish::threads_for(f.group),
                         static_cast<size_t>(f.group) * sizeof(float), impl_->stream, xv,
                         f.rope ? static_cast<const int32_t*>(positions.data) : nullptr, s, groups);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

Status CudaBackend::add(const Tensor& x, const Tensor& y) {
  DSV4_ASSIGN_OR_RETURN(const Mat<float> xv, cudaops::f32(x, this, "add", "x", -1, -1));
  DSV4_ASSIGN_OR_RETURN(const Mat<float> yv, cudaops::f32(y, this, "add", "y", xv.rows, xv.cols));
  if (xv.rows * xv.cols == 0) return Status::ok();
  cuda::launch_dependent(add_kernel, cudaops::row_tile_grid(xv.rows, xv.cols), cudaops::kRowTileThreads, 0,
                         impl_->stream, xv, yv);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

Status CudaBackend::scale(const Tensor& x, float factor) {
  DSV4_ASSIGN_OR_RETURN(const Mat<float> xv, cudaops::f32(x, this, "scale", "x", -1, -1));
  if (xv.rows * xv.cols == 0) return Status::ok();
  cuda::launch_dependent(scale_kernel, cudaops::row_tile_grid(xv.rows, xv.cols), cudaops::kRowTileThreads, 0,
                         impl_->stream, xv, factor);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

// ---- hyper-connections --------------------------------------------------------------------------------

Status CudaBackend::hc_pre(const Tensor& streams, const Tensor& mixes, const Tensor& scale, const Tensor& base,
                           int n_hc, int sinkhorn_iters, float hc_eps, float norm_eps, const Tensor& x,
                           const Tensor& post, const Tensor& comb) {
  return hc_pre_launch(streams, mixes, scale, base, n_hc, sinkhorn_iters, hc_eps, norm_eps, nullptr, x, post, comb,
                       nullptr);
}

Status CudaBackend::hc_pre_norm(const Tensor& streams, const Tensor& mixes, const Tensor& scale, const Tensor& base,
                                int n_hc, int sinkhorn_iters, float hc_eps, float norm_eps, const Tensor& norm_weight,
                                const Tensor& x, const Tensor& post, const Tensor& comb, const Tensor& normed) {
  // Prefill: two kernels. Fused, the 1024-thread block of each row holds its SM through the
  // norm's extra reduction (a 4096-token chunk's hc_pre went from 297 to 615 us, tenth run),
  // while rms_norm_kernel's blocks share the SMs. The same bits either way at width 4096.
  if (streams.rows() > kHcPreNormFusedMaxRows)
    return Backend::hc_pre_norm(streams, mixes, scale, base, n_hc, sinkhorn_iters, hc_eps, norm_eps, norm_weight, x,
                                post, comb, normed);
  return hc_pre_launch(streams, mixes, scale, base, n_hc, sinkhorn_iters, hc_eps, norm_eps, &norm_weight, x, post,
                       comb, &normed);
}

Status CudaBackend::hc_pre_launch(const Tensor& streams, const Tensor& mixes, const Tensor& scale, const Tensor& base,
                                  int n_hc, int sinkhorn_iters, float hc_eps, float norm_eps,
                                  const Tensor* norm_weight, const Tensor& x, const Tensor& post, const Tensor& comb,
                                  const Tensor* normed) {
  if (n_hc < 1 || n_hc > kMaxHc) return Status::errorf("hc_pre: {} streams, supported 1..{}", n_hc, kMaxHc);
  DSV4_ASSIGN_OR_RETURN(const Mat<float> sv, cudaops::f32(streams, this, "hc_pre", "streams", -1, -1));
  const int64_t n = sv.rows, width = sv.cols / n_hc, n_mix = (2 + n_hc) * n_hc;
  if (sv.cols % n_hc) return Status::errorf("hc_pre: streams {} for {} streams", streams.describe(), n_hc);
  DSV4_ASSIGN_OR_RETURN(const Mat<float> mv, cudaops::f32(mixes, this, "hc_pre", "mixes", n, n_mix));
  DSV4_ASSIGN_OR_RETURN(const Mat<float> scv, cudaops::f32(scale, this, "hc_pre", "scale", -1, 3));
  DSV4_ASSIGN_OR_RETURN(const Mat<float> bv, cudaops::f32(base, this, "hc_pre", "base", -1, n_mix));
  DSV4_ASSIGN_OR_RETURN(const Mat<float> xv, cudaops::f32(x, this, "hc_pre", "x", n, width));
  DSV4_ASSIGN_OR_RETURN(const Mat<float> pv, cudaops::f32(post, this, "hc_pre", "post", n, n_hc));
  DSV4_ASSIGN_OR_RETURN(const Mat<float> cv, cudaops::f32(comb, this, "hc_pre", "comb", n, n_hc * n_hc));
  const float* nw = nullptr;
  Mat<float> yv{};
  if (norm_weight != nullptr) {
    DSV4_ASSIGN_OR_RETURN(const Mat<float> wv, cudaops::f32(*norm_weight, this, "hc_pre_norm", "norm_weight", -1, width));
    DSV4_ASSIGN_OR_RETURN(yv, cudaops::f32(*normed, this, "hc_pre_norm", "normed", n, width));
    nw = wv.p;
  }
  if (n == 0) return Status::ok();
  cuda::launch_dependent(hc_pre_kernel, static_cast<unsigned>(n), kHcThreads, 0, impl_->stream, sv, mv, scv.p, bv.p,
                         n_hc, sinkhorn_iters, hc_eps, norm_eps, width, xv, pv, cv, nw, yv);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

bool CudaBackend::hc_cluster_active() const { return impl_->hc_cluster; }

Status CudaBackend::hc_pre_norm_from_fn(const Tensor& fn, const Tensor& streams, MatmulMode mode, const Tensor& scale,
                                        const Tensor& base, int n_hc, int sinkhorn_iters, float hc_eps, float norm_eps,
                                        const Tensor& norm_weight, const Tensor& x, const Tensor& post,
                                        const Tensor& comb, const Tensor& normed) {
  using namespace hc_cluster;
  const auto two_kernels = [&] {
    return Backend::hc_pre_norm_from_fn(fn, streams, mode, scale, base, n_hc, sinkhorn_iters, hc_eps, norm_eps,
                                        norm_weight, x, post, comb, normed);
  };
  // Where the two calls are float32_rows (Float32, 1-64 rows, F32 weights, 1024 threads an
  // output at k = 16384) and hc_pre_kernel with the norm (1-64 rows): the kernel repeats them.
  static_assert(CudaBackend::hc_cluster_max_rows() <= cuda::kFloat32RowsMax &&
                CudaBackend::hc_cluster_max_rows() <= kHcPreNormFusedMaxRows);
  const int64_t n = streams.rows();
  if (!impl_->hc_cluster || mode != MatmulMode::Float32 || n_hc != kStreams || n < 1 || n > hc_cluster_max_rows() ||
      fn.type != GgmlType::F32 || fn.rows() != kMixes || fn.cols() != kValues || streams.type != GgmlType::F32 ||
      streams.cols() != kValues || cuda::float32_rows_threads(GgmlType::F32, kValues) != kVirtualThreads)
    return two_kernels();
  DSV4_ASSIGN_OR_RETURN(const Mat<float> fv, cudaops::f32(fn, this, "hc_pre_norm_from_fn", "fn", kMixes, kValues));
  DSV4_ASSIGN_OR_RETURN(const Mat<float> sv, cudaops::f32(streams, this, "hc_pre_norm_from_fn", "streams", n, kValues));
  if (!cuda::float32_rows_applies(GgmlType::F32, fv.p, fv.ld * 4, kValues, sv.p, sv.ld)) return two_kernels();
  const char* op = "hc_pre_norm_from_fn";
  DSV4_ASSIGN_OR_RETURN(const Mat<float> scv, cudaops::f32(scale, this, op, "scale", -1, 3));
  DSV4_ASSIGN_OR_RETURN(const Mat<float> bv, cudaops::f32(base, this, op, "base", -1, kMixes));
  DSV4_ASSIGN_OR_RETURN(const Mat<float> wv, cudaops::f32(norm_weight, this, op, "norm_weight", -1, kWidth));
  DSV4_ASSIGN_OR_RETURN(const Mat<float> xv, cudaops::f32(x, this, op, "x", n, kWidth));
  DSV4_ASSIGN_OR_RETURN(const Mat<float> pv, cudaops::f32(post, this, op, "post", n, kStreams));
  DSV4_ASSIGN_OR_RETURN(const Mat<float> cv, cudaops::f32(comb, this, op, "comb", n, kStreams * kStreams));
  DSV4_ASSIGN_OR_RETURN(const Mat<float> yv, cudaops::f32(normed, this, op, "normed", n, kWidth));
  cuda::launch_dependent_clusters(hc_pre_norm_cluster_kernel, dim3(kBlocks, static_cast<unsigned>(n)), kThreads,
                                  kBlocks, 0, impl_->stream, fv.p, fv.ld, sv, scv.p, bv.p, sinkhorn_iters, hc_eps,
                                  norm_eps, wv.p, xv, pv, cv, yv);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

Status CudaBackend::hc_post(const Tensor& y, const Tensor& post, const Tensor& comb, int n_hc, const Tensor& streams) {
  if (n_hc < 1 || n_hc > kMaxHc) return Status::errorf("hc_post: {} streams, supported 1..{}", n_hc, kMaxHc);
  DSV4_ASSIGN_OR_RETURN(const Mat<float> yv, cudaops::f32(y, this, "hc_post", "y", -1, -1));
  const int64_t n = yv.rows, width = yv.cols;
  DSV4_ASSIGN_OR_RETURN(const Mat<float> pv, cudaops::f32(post, this, "hc_post", "post", n, n_hc));
  DSV4_ASSIGN_OR_RETURN(const Mat<float> cv, cudaops::f32(comb, this, "hc_post", "comb", n, n_hc * n_hc));
  DSV4_ASSIGN_OR_RETURN(const Mat<float> sv, cudaops::f32(streams, this, "hc_post", "streams", n, n_hc * width));
  if (n * width == 0) return Status::ok();
  cuda::launch_dependent(n_hc == 4 ? hc_post_kernel<4> : hc_post_kernel<0>, cudaops::row_tile_grid(n, width),
                         cudaops::kRowTileThreads, 0, impl_->stream,
                         yv, pv, cv, n_hc, sv);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

Status CudaBackend::hc_head(const Tensor& streams, const Tensor& mixes, const Tensor& scale, const Tensor& base,
                            int n_hc, float hc_eps, float norm_eps, const Tensor& x) {
  if (n_hc < 1 || n_hc > kMaxHc) return Status::errorf("hc_head: {} streams, supported 1..{}", n_hc, kMaxHc);
  DSV4_ASSIGN_OR_RETURN(const Mat<float> sv, cudaops::f32(streams, this, "hc_head", "streams", -1, -1));
  const int64_t n = sv.rows, width = sv.cols / n_hc;
  if (sv.cols % n_hc) return Status::errorf("hc_head: streams {} for {} streams", streams.describe(), n_hc);
  DSV4_ASSIGN_OR_RETURN(const Mat<float> mv, cudaops::f32(mixes, this, "hc_head", "mixes", n, n_hc));
  DSV4_ASSIGN_OR_RETURN(const Mat<float> scv, cudaops::f32(scale, this, "hc_head", "scale", -1, -1));
  DSV4_ASSIGN_OR_RETURN(const Mat<float> bv, cudaops::f32(base, this, "hc_head", "base", -1, n_hc));
  DSV4_ASSIGN_OR_RETURN(const Mat<float> xv, cudaops::f32(x, this, "hc_head", "x", n, width));
  if (n == 0) return Status::ok();
  cuda::launch_dependent(hc_head_kernel, static_cast<unsigned>(n), kHcThreads, 0, impl_->stream, sv, mv, scv.p, bv.p,
                         n_hc, hc_eps, norm_eps, width, xv);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

// ---- QAT roundings -------------------------------------------------------------------------------------

Status CudaBackend::hadamard(const Tensor& x, int64_t width) {
  DSV4_ASSIGN_OR_RETURN(const Mat<float> xv, cudaops::f32(x, this, "hadamard", "x", -1, -1));
  constexpr int64_t kMaxWidth = 8192;  // one group in 32 KB of shared memory
  if (width <= 0 || (width & (width - 1)) || xv.cols % width || width > kMaxWidth)
    return Status::errorf("hadamard: width {} must be a power of two up to {} dividing {}", width, kMaxWidth, xv.cols);
  const int64_t groups = xv.cols / width, blocks = xv.rows * groups;
  if (blocks == 0) return Status::ok();
  if (blocks > INT32_MAX) return Status::errorf("hadamard: {} groups exceed the grid", blocks);
  cuda::launch_dependent(hadamard_kernel, static_cast<unsigned>(blocks), 256,
                         static_cast<size_t>(width) * sizeof(float), impl_->stream, xv, width, groups);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

Status CudaBackend::round_fp8_blocks(const Tensor& x, int64_t cols, int64_t block) {
  DSV4_ASSIGN_OR_RETURN(const Mat<float> xv, cudaops::f32(x, this, "round_fp8_blocks", "x", -1, -1));
  if (block <= 0 || cols < 0 || cols % block || cols > xv.cols)
    return Status::errorf("round_fp8_blocks: {} columns in blocks of {} of {}", cols, block, x.describe());
  const int64_t count = xv.rows * (cols / block);
  if (count == 0) return Status::ok();
  cuda::launch_dependent(round_fp8_kernel, cudaops::grid_for(count * 32, 128), 128, 0, impl_->stream, xv, cols, block);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

Status CudaBackend::round_fp4_blocks(const Tensor& x, int64_t block) {
  DSV4_ASSIGN_OR_RETURN(const Mat<float> xv, cudaops::f32(x, this, "round_fp4_blocks", "x", -1, -1));
  if (block <= 0 || xv.cols % block)
    return Status::errorf("round_fp4_blocks: blocks of {} of {}", block, x.describe());
  const int64_t count = xv.rows * (xv.cols / block);
  if (count == 0) return Status::ok();
  cuda::launch_dependent(round_fp4_kernel, cudaops::grid_for(count * 32, 128), 128, 0, impl_->stream, xv, block);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

Status CudaBackend::round_fp4_e4m3_blocks(const Tensor& x, int64_t block) {
  DSV4_ASSIGN_OR_RETURN(const Mat<float> xv, cudaops::f32(x, this, "round_fp4_e4m3_blocks", "x", -1, -1));
  if (block <= 0 || xv.cols % block)
    return Status::errorf("round_fp4_e4m3_blocks: blocks of {} of {}", block, x.describe());
  const int64_t count = xv.rows * (xv.cols / block);
  if (count == 0) return Status::ok();
  cuda::launch_dependent(round_fp4_e4m3_kernel, cudaops::grid_for(count, 128), 128, 0, impl_->stream, xv, block);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

}  // namespace dsv4::backend
