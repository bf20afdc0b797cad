// Routing and experts of the CUDA backend (spec §4): the router's selection exactly as the
// CPU's (same scores in f32, same tie rule), the routed experts in both modes and the shared
// expert. CPU references: CpuBackend::route / moe_experts / swiglu_expert, cpu::swiglu.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_backend_impl.cuh"
#include "backend/cuda/cuda_ops.cuh"
#include "backend/cuda/dependent_launch.cuh"
#include "backend/cuda/exact_gemm.h"
#include "backend/cuda/matvec.h"
#include "backend/cuda/moe_experts.h"
#include "backend/cuda/reference_math.cuh"

namespace dsv4::backend {

using cudaops::Mat;
namespace ref = cuda::ref;

namespace {

constexpr int kMaxTopK = 32;
constexpr int64_t kMaxExperts = 4096;

// One block per token: scores, the selection (hash row or k rounds of a block arg-max of
// score + bias with equal keys going to the lower index), ascending order, weights.
__global__ void route_kernel(Mat<float> logits, const float* __restrict__ bias, Mat<int32_t> tid2eid,
                             const int32_t* __restrict__ tokens, int k, float route_scale, Mat<int32_t> experts,
                             Mat<float> weights, uint32_t* errors) {
  ::dsv4::cuda::dependent_kernel_prologue();
  extern __shared__ float smem[];
  const int64_t n_experts = logits.cols;
  float* score = smem;              // [E]
  float* key = smem + n_experts;    // [E]: score + bias, -inf once taken
  __shared__ int sel[kMaxTopK];
  __shared__ float best_key[32];
  __shared__ int best_idx[32];
  const int64_t s = blockIdx.x;
  for (int64_t e = threadIdx.x; e < n_experts; e += blockDim.x) {
    score[e] = ref::sqrt_softplus(logits.row(s)[e]);
    key[e] = bias != nullptr ? ref::add(score[e], bias[e]) : score[e];
  }
  __syncthreads();
  if (tid2eid.p != nullptr) {
    if (threadIdx.x == 0) {
      const int32_t token = tokens[s];
      const bool token_ok = token >= 0 && token < tid2eid.rows;
      if (!token_ok) atomicOr(errors, kDeviceErrorRouteToken);
      for (int j = 0; j < k; ++j) {
        int32_t e = token_ok ? tid2eid.row(token)[j] : j;
        if (e < 0 || e >= n_experts) {
          atomicOr(errors, kDeviceErrorRouteExpert);
          e = j;
        }
        sel[j] = e;
      }
    }
  } else {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int j = 0; j < k; ++j) {
      // Arg-max with the CPU's order: larger key first, equal keys by lower index.
      float bk = -INFINITY;
      int bi = INT32_MAX;
      for (int64_t e = threadIdx.x; e < n_experts; e += blockDim.x) {
        const float v = key[e];
        if (bi == INT32_MAX || v > bk || (v == bk && e < bi)) {
          bk = v;
          bi = static_cast<int>(e);
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float ok = __shfl_xor_sync(0xFFFFFFFFu, bk, o);
        const int oi = __shfl_xor_sync(0xFFFFFFFFu, bi, o);
        if (oi != INT32_MAX && (bi == INT32_MAX || ok > bk || (ok == bk && oi < bi))) {
          bk = ok;
          bi = oi;
        }
      }
      if (lane == 0) {
        best_key[warp] = bk;
        best_idx[warp] = bi;
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        float tk = best_key[0];
        int ti = best_idx[0];
        for (int w = 1; w < warps; ++w) {
          const int oi = best_idx[w];
          const float ok = best_key[w];
          if (oi != INT32_MAX && (ti == INT32_MAX || ok > tk || (ok == tk && oi < ti))) {
            tk = ok;
            ti = oi;
          }
        }
        sel[j] = ti;
        key[ti] = -INFINITY;  // taken (keys are finite: a later round cannot pick it again first)
      }
      __syncthreads();
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int a = 1; a < k; ++a)  // insertion sort: ascending experts
      for (int b = a; b > 0 && sel[b - 1] > sel[b]; --b) {
        const int t = sel[b];
        sel[b] = sel[b - 1];
        sel[b - 1] = t;
      }
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) sum = ref::add(sum, score[sel[j]]);
    for (int j = 0; j < k; ++j) {
      experts.row(s)[j] = sel[j];
      weights.row(s)[j] = ref::mul(ref::div(score[sel[j]], sum), route_scale);
    }
  }
}

// cpu::swiglu: out = weight * ((gate * sigmoid(gate)) * up), gate = min(g, L),
// up = clamp(u, -L, L) when L > 0. One weight per row (or 1), out may alias g.
__global__ void swiglu_kernel(Mat<float> g, Mat<float> u, float limit, const float* __restrict__ row_weight,
                              Mat<float> out) {
  ::dsv4::cuda::dependent_kernel_prologue();
  DSV4_ROW_TILE(r, i, g.rows, g.cols) {
    const float weight = row_weight != nullptr ? row_weight[r] : 1.0f;
    out.row(r)[i] = ref::swiglu(g.row(r)[i], u.row(r)[i], limit, weight);
  }
}

// y[s] = +0 + outs[s*k + j] for j in slot order (slots naming no valid expert add nothing).
__global__ void sum_slots_kernel(const float* __restrict__ outs, const int32_t* __restrict__ ids, int64_t ld_ids,
                                 int64_t n_experts, int k, Mat<float> y) {
  ::dsv4::cuda::dependent_kernel_prologue();
  DSV4_ROW_TILE(s, i, y.rows, y.cols) {
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int32_t e = ids[s * ld_ids + j];
      if (e >= 0 && e < n_experts) acc = __fadd_rn(acc, outs[(s * k + j) * y.cols + i]);
    }
    y.row(s)[i] = acc;
  }
}

Status expect_stack(const Tensor& t, const Backend* self, const char* arg, int64_t rows, int64_t cols) {
  if (!t.valid() || t.backend != self || t.rank != 3 || t.dim(1) != rows || t.dim(2) != cols)
    return Status::errorf("moe_experts: {} is {}, expected [experts, {}, {}] of this backend", arg, t.describe(), rows,
                          cols);
  const auto row_bytes = ggml_row_bytes(t.type, static_cast<uint64_t>(cols));
  if (!row_bytes || t.stride[1] != static_cast<int64_t>(*row_bytes) || t.stride[0] != rows * t.stride[1])
    return Status::errorf("moe_experts: {} {} is not a contiguous stack of whole-block rows", arg, t.describe());
  return Status::ok();
}

cuda::ExactWeights exact_stack(const Tensor& t, const CudaBackend::Impl& m) {
  cuda::ExactWeights w;
  w.type = t.type;
  w.data = t.data;
  w.n = t.dim(1);
  w.k = t.dim(2);
  w.row_bytes = t.stride[1];
  w.matrix_bytes = t.stride[0];
  w.tables = {m.iq2_grid, m.iq2_signs, m.iq_tables};
  return w;
}

}  // namespace

Status CudaBackend::route(const Tensor& logits, const Tensor* bias, const Tensor* tid2eid, const Tensor& tokens, int k,
                          float route_scale, const Tensor& experts, const Tensor& weights) {
  DSV4_ASSIGN_OR_RETURN(const Mat<float> lv, cudaops::f32(logits, this, "route", "logits", -1, -1));
  const int64_t n = lv.rows, n_experts = lv.cols;
  if (k < 1 || k > kMaxTopK || k > n_experts || n_experts > kMaxExperts)
    return Status::errorf("route: top {} of {} experts (supported: k 1..{}, up to {} experts)", k, n_experts, kMaxTopK,
                          kMaxExperts);
  DSV4_ASSIGN_OR_RETURN(const Mat<int32_t> ev, cudaops::i32(experts, this, "route", "experts", n, k));
  DSV4_ASSIGN_OR_RETURN(const Mat<float> wv, cudaops::f32(weights, this, "route", "weights", n, k));
  Mat<int32_t> table;
  const float* bias_p = nullptr;
  const int32_t* token_p = nullptr;
  if (tid2eid) {
    DSV4_ASSIGN_OR_RETURN(table, cudaops::i32(*tid2eid, this, "route", "tid2eid", -1, k));
    if (!tokens.valid() || tokens.backend != this || tokens.type != GgmlType::I32 || !tokens.contiguous() ||
        tokens.n_elements() < n)
      return Status::errorf("route: tokens {} for {} rows", tokens.describe(), n);
    token_p = static_cast<const int32_t*>(tokens.data);
  } else if (bias) {
    DSV4_ASSIGN_OR_RETURN(const Mat<float> bv, cudaops::f32(*bias, this, "route", "bias", -1, n_experts));
    bias_p = bv.p;
  }
  if (n == 0) return Status::ok();
  const size_t smem = static_cast<size_t>(2 * n_experts) * sizeof(float);
  cuda::launch_dependent(route_kernel, static_cast<unsigned>(n), 256, smem, impl_->stream, lv, bias_p, table, token_p,
                         k, route_scale, ev, wv, impl_->device_errors);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

Status CudaBackend::moe_experts(const Tensor& x, const Tensor& gate, const Tensor& up, const Tensor& down,
                                const Tensor& experts, const Tensor& weights, float limit, MatmulMode mode,
                                const Tensor& y) {
  DSV4_ASSIGN_OR_RETURN(const Mat<float> xv, cudaops::f32(x, this, "moe_experts", "x", -1, -1));
  const int64_t n = xv.rows, d = xv.cols;
  if (!gate.valid() || gate.rank != 3) return Status::errorf("moe_experts: gate {}", gate.describe());
  const int64_t n_experts = gate.dim(0), inter = gate.dim(1);
  DSV4_TRY(expect_stack(gate, this, "gate", inter, d));
  DSV4_TRY(expect_stack(up, this, "up", inter, d));
  DSV4_TRY(expect_stack(down, this, "down", d, inter));
  if (up.dim(0) != n_experts || down.dim(0) != n_experts || up.type != gate.type)
    return Status::errorf("moe_experts: gate {} up {} down {} disagree", gate.describe(), up.describe(),
                          down.describe());
  DSV4_ASSIGN_OR_RETURN(const Mat<int32_t> ev, cudaops::i32(experts, this, "moe_experts", "experts", n, -1));
  const int64_t k = ev.cols;
  DSV4_ASSIGN_OR_RETURN(const Mat<float> wv, cudaops::f32(weights, this, "moe_experts", "weights", n, k));
  DSV4_ASSIGN_OR_RETURN(Mat<float> yv, cudaops::f32(y, this, "moe_experts", "y", n, d));
  yv.rows = n;
  if (k < 1 || k > n_experts || n_experts > kMaxExperts)
    return Status::errorf("moe_experts: {} slots of {} experts", k, n_experts);
  if (n == 0) return Status::ok();
  Impl& m = *impl_;
  const int64_t pairs = n * k;

  // The ids and weights as contiguous [n][k] (route writes them so; views are copied).
  const int32_t* ids = ev.p;
  const float* pair_w = wv.p;
  if (ev.ld != k) {
    DSV4_ASSIGN_OR_RETURN(void* tmp, m.scratch_bytes(static_cast<size_t>(pairs) * 4));
    DSV4_CUDA_TRY(cudaMemcpy2DAsync(tmp, k * 4, ev.p, ev.ld * 4, k * 4, n, cudaMemcpyDeviceToDevice, m.stream));
    ids = static_cast<const int32_t*>(tmp);
  }
  if (wv.ld != k) {
    DSV4_ASSIGN_OR_RETURN(void* tmp, m.scratch_bytes(static_cast<size_t>(pairs) * 4));
    DSV4_CUDA_TRY(cudaMemcpy2DAsync(tmp, k * 4, wv.p, wv.ld * 4, k * 4, n, cudaMemcpyDeviceToDevice, m.stream));
    pair_w = static_cast<const float*>(tmp);
  }

  const bool quantized = mode == MatmulMode::Quantized && cuda::matvec_supported(gate.type) &&
                         cuda::matvec_supported(down.type) && d % 32 == 0 && inter % 32 == 0 &&
                         d % ggml_traits(gate.type).block_elems == 0 && inter % ggml_traits(down.type).block_elems == 0;
  if (quantized) {
    // The fused kernels write their output (each token's slot sum from +0, as the op's
    // contract): straight into y when its rows are contiguous. They read ids unchecked, so
    // they must come from route (always in range).
    const float* xp = xv.p;
    if (xv.ld != d) {
      DSV4_ASSIGN_OR_RETURN(void* tmp, m.scratch_bytes(static_cast<size_t>(n * d) * 4));
      DSV4_CUDA_TRY(cudaMemcpy2DAsync(tmp, d * 4, xv.p, xv.ld * 4, d * 4, n, cudaMemcpyDeviceToDevice, m.stream));
      xp = static_cast<const float*>(tmp);
    }
    const cuda::ExpertWeights ew{gate.type, gate.data, up.data, down.type, down.data, n_experts, d, inter};
    const cuda::ExpertRouting routing{ids, pair_w, n, static_cast<int>(k)};
    void* out = yv.p;
    if (yv.ld != d) {
      DSV4_ASSIGN_OR_RETURN(out, m.scratch_bytes(static_cast<size_t>(n * d) * 4));
    }
    const size_t ws_bytes = cuda::moe_experts_workspace_bytes(ew, n, static_cast<int>(k));
    DSV4_ASSIGN_OR_RETURN(void* ws, m.scratch_bytes(ws_bytes));
    // The kernels clamp with `limit` unconditionally; the reference clamps only when L > 0.
    const float clamp = limit > 0 ? limit : INFINITY;
    DSV4_TRY(cuda::moe_experts(ew, xp, routing, clamp, static_cast<float*>(out), ws, ws_bytes, m.stream));
    if (out != yv.p)
      DSV4_CUDA_TRY(cudaMemcpy2DAsync(yv.p, yv.ld * 4, out, d * 4, d * 4, n, cudaMemcpyDeviceToDevice, m.stream));
    return Status::ok();
  }

  // Exact: each (token, slot) pair's expert output in its own row, then the per-token sums in
  // slot order (as the CPU), so nothing depends on who else is in the batch.
  const int64_t max_tiles = cuda::exact_max_tiles(pairs, n_experts);
  DSV4_ASSIGN_OR_RETURN(void* tile_buf, m.scratch_bytes(cuda::expert_tiles_bytes(pairs, max_tiles)));
  cuda::ExpertTiles tiles;
  DSV4_TRY(cuda::build_expert_tiles(ids, pairs, n_experts, tile_buf, max_tiles, tiles, m.device_errors,
                                    kDeviceErrorMoeExpert, m.stream));
  DSV4_ASSIGN_OR_RETURN(void* g_raw, m.scratch_bytes(static_cast<size_t>(pairs * inter) * 4));
  DSV4_ASSIGN_OR_RETURN(void* u_raw, m.scratch_bytes(static_cast<size_t>(pairs * inter) * 4));
  DSV4_ASSIGN_OR_RETURN(void* o_raw, m.scratch_bytes(static_cast<size_t>(pairs * d) * 4));
  auto* g = static_cast<float*>(g_raw);
  auto* u = static_cast<float*>(u_raw);
  auto* o = static_cast<float*>(o_raw);
  DSV4_TRY(cuda::exact_matmul_grouped(exact_stack(gate, m), xv.p, xv.ld, static_cast<int>(k), g, inter, tiles,
                                      m.stream));
  DSV4_TRY(cuda::exact_matmul_grouped(exact_stack(up, m), xv.p, xv.ld, static_cast<int>(k), u, inter, tiles,
                                      m.stream));
  // Rows of pairs without a valid expert hold garbage here; nothing below reads them.
  const Mat<float> gm{g, pairs, inter, inter}, um{u, pairs, inter, inter};
  cuda::launch_dependent(swiglu_kernel, cudaops::row_tile_grid(pairs, inter), cudaops::kRowTileThreads, 0, m.stream, gm,
                         um, limit, pair_w, gm);
  DSV4_CUDA_TRY_LAUNCH();
  DSV4_TRY(cuda::exact_matmul_grouped(exact_stack(down, m), g, inter, 1, o, d, tiles, m.stream));
  cuda::launch_dependent(sum_slots_kernel, cudaops::row_tile_grid(n, d), cudaops::kRowTileThreads, 0, m.stream, o, ids,
                         k, n_experts, static_cast<int>(k), yv);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

Status CudaBackend::swiglu_expert(const Tensor& x, const Tensor& gate, const Tensor& up, const Tensor& down,
                                  float limit, MatmulMode mode, const Tensor& y) {
  DSV4_ASSIGN_OR_RETURN(const Mat<float> xv, cudaops::f32(x, this, "swiglu_expert", "x", -1, -1));
  if (!gate.valid() || !up.valid() || gate.rows() != up.rows())
    return Status::errorf("swiglu_expert: gate {} and up {}", gate.describe(), up.describe());
  const int64_t n = xv.rows, inter = gate.rows();
  DSV4_ASSIGN_OR_RETURN(const Mat<float> yv, cudaops::f32(y, this, "swiglu_expert", "y", n, xv.cols));
  if (n == 0) return Status::ok();
  DSV4_ASSIGN_OR_RETURN(const Tensor gu, scratch(GgmlType::F32, std::vector<int64_t>{2, n, inter}));
  const Tensor g = gu.at(0), u = gu.at(1);
  DSV4_ASSIGN_OR_RETURN(Tensor o, scratch(GgmlType::F32, std::vector<int64_t>{n, xv.cols}));
  // A few rows (decode, an MTP verify): gate and up as one launch of the row kernels over
  // both matrices (matvec.h shared_x), each output the bits of its own product.
  const auto row_bytes = ggml_row_bytes(gate.type, static_cast<uint64_t>(xv.cols));
  const bool few = n == 1 || (n <= cuda::kRowKernelMaxRows && cuda::kernel_choice().matvec_rows && xv.ld == xv.cols);
  const bool paired = few && mode == MatmulMode::Quantized && gate.type == up.type && gate.rank == 2 &&
                      up.rank == 2 && gate.cols() == xv.cols && up.cols() == xv.cols && gate.backend == this &&
                      up.backend == this && cuda::matvec_supported(gate.type) && xv.cols % 32 == 0 && row_bytes &&
                      gate.row_stride() == static_cast<int64_t>(*row_bytes) &&
                      up.row_stride() == static_cast<int64_t>(*row_bytes) &&
                      reinterpret_cast<uintptr_t>(gate.data) % 16 == 0 && reinterpret_cast<uintptr_t>(up.data) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(xv.p) % 16 == 0 && !cuda::kernel_choice().batch_invariant;
  if (paired) {
    const cuda::MatvecWeights mw{gate.type, gate.data, inter, xv.cols, 2,
                                 static_cast<const uint8_t*>(up.data) - static_cast<const uint8_t*>(gate.data), true};
    const size_t ws_bytes = cuda::matvec_workspace_bytes(mw, static_cast<int>(n));
    void* ws = nullptr;
    if (ws_bytes) {
      DSV4_ASSIGN_OR_RETURN(ws, impl_->scratch_bytes(ws_bytes));
    }
    DSV4_TRY(cuda::matvec(mw, xv.p, static_cast<int>(n), static_cast<float*>(gu.data), ws, ws_bytes, impl_->stream));
  } else {
    DSV4_TRY(matmul(gate, x, g, mode));
    DSV4_TRY(matmul(up, x, u, mode));
  }
  const Mat<float> gm{static_cast<float*>(g.data), n, inter, inter}, um{static_cast<float*>(u.data), n, inter, inter};
  cuda::launch_dependent(swiglu_kernel, cudaops::row_tile_grid(n, inter), cudaops::kRowTileThreads, 0, impl_->stream,
                         gm, um, limit, nullptr, gm);
  DSV4_CUDA_TRY_LAUNCH();
  DSV4_TRY(matmul(down, g, o, mode));
  return add(o, y);
}

}  // namespace dsv4::backend
