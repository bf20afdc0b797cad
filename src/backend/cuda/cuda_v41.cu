// CudaBackend's DeepSeek-V4.1 operations (backend.h): the delayed hyper-connection mix
// and collapse, the Engram gate, candidate blocks and their mask. Straight ports of the
// CpuBackend loops, one thread per row (these are small next to the GEMMs; the
// candidate selection rescans the row's scores once per kept block).
#include <cmath>

#include "backend/cuda/cuda_backend_impl.cuh"
#include "backend/cuda/reference_math.cuh"

namespace dsv4::backend {
namespace {

namespace ref = cuda::ref;
constexpr int kThreads = 128;
constexpr int kMaxStreams = 8;

unsigned grid_of(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

bool f32_rows(const Tensor& t, int64_t rows, int64_t cols) {
  return t.valid() && t.type == GgmlType::F32 && t.stride[t.rank - 1] == 4 && t.rows() >= rows &&
         (cols < 0 || t.cols() == cols);
}
int64_t ld_of(const Tensor& t) { return t.rank >= 2 ? t.row_stride() / 4 : t.cols(); }

__global__ void hc_mix_kernel(const float* streams, int64_t ld_s, const float* mixes, int64_t ld_m,
                              const float* scale, const float* base, int n_hc, int iters, float hc_eps,
                              float norm_eps, int64_t width, float* pre, int64_t ld_p, float* post,
                              int64_t ld_q, float* comb, int64_t ld_c, int64_t n) {
  const int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (s >= n) return;
  const float* X = streams + s * ld_s;
  double ss = 0.0;
  for (int64_t i = 0; i < n_hc * width; ++i) ss += static_cast<double>(X[i]) * X[i];
  const float rho = ref::inverse_rms(ss, n_hc * width, norm_eps);
  ref::hc_split_sinkhorn(mixes + s * ld_m, rho, scale, base, n_hc, iters, hc_eps, pre + s * ld_p, post + s * ld_q,
                         comb + s * ld_c);
}

__global__ void hc_collapse_kernel(const float* streams, int64_t ld_s, const float* pre, int64_t ld_p, int n_hc,
                                   int64_t width, float* x, int64_t ld_x, int64_t n) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= n * width) return;
  const int64_t s = idx / width, i = idx % width;
  x[s * ld_x + i] = ref::hc_collapse(streams + s * ld_s + i, width, pre + s * ld_p, n_hc);
}

__global__ void engram_gate_kernel(float* streams, int64_t ld_s, const float* kv, int64_t ld_kv, const float* qw,
                                   const float* kw, int n_hc, int64_t d, float eps, float* gate, int64_t ld_g,
                                   int64_t n) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= n) return;
  float* X = streams + r * ld_s;
  const float* row = kv + r * ld_kv;
  const float* value = row + n_hc * d;
  const float inv_sqrt_d = 1.0f / sqrtf(static_cast<float>(d));
  for (int s = 0; s < n_hc; ++s) {
    float* x = X + s * d;
    const float* key = row + s * d;
    double sx = 0.0, sk = 0.0;
    for (int64_t i = 0; i < d; ++i) {
      sx += static_cast<double>(x[i]) * x[i];
      sk += static_cast<double>(key[i]) * key[i];
    }
    const float rx = ref::inverse_rms(sx, d, eps), rk = ref::inverse_rms(sk, d, eps);
    float sigma = 0.0f;
    for (int64_t i = 0; i < d; ++i) sigma += (x[i] * rx * qw[s * d + i]) * (key[i] * rk * kw[s * d + i]);
    sigma *= inv_sqrt_d;
    const float g = ref::sigmoid(copysignf(sqrtf(fmaxf(fabsf(sigma), 1e-6f)), sigma));
    gate[r * ld_g + s] = g;
    for (int64_t i = 0; i < d; ++i) x[i] += g * value[i];
  }
}

// The maximum of block j's scores among the first `visible` (+inf for the pinned newest).
__device__ float block_score(const float* sc, int64_t visible, int64_t block, int64_t j, int64_t n_blocks) {
  if (j == n_blocks - 1) return INFINITY;
  float m = -INFINITY;
  for (int64_t i = j * block; i < (j + 1) * block && i < visible; ++i) m = fmaxf(m, sc[i]);
  return m;
}

__global__ void candidate_blocks_kernel(const float* scores, int64_t ld_sc, int64_t cols, const int32_t* positions,
                                        const int32_t* row_seq, int ratio, int64_t block, int k, int32_t* out,
                                        int64_t ld_o, int64_t n) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= n) return;
  const float* sc = scores + r * ld_sc;
  int64_t visible = row_seq[r] >= 0 ? (positions[r] + 1) / ratio : 0;
  if (visible > cols) visible = cols;
  const int64_t n_blocks = (visible + block - 1) / block;
  int32_t* o = out + r * ld_o;
  // Selection in (score desc, index asc) order: each round takes the best block after the last.
  float last_score = INFINITY;
  int64_t last_index = -1, taken = 0;
  for (; taken < k; ++taken) {
    int64_t best = -1;
    float best_score = -INFINITY;
    for (int64_t j = 0; j < n_blocks; ++j) {
      const float v = block_score(sc, visible, block, j, n_blocks);
      if (v == -INFINITY) continue;
      const bool after = v < last_score || (v == last_score && j > last_index);
      if (after && (best < 0 || v > best_score)) best = j, best_score = v;
    }
    if (best < 0) break;
    o[taken] = static_cast<int32_t>(best);
    last_score = best_score;
    last_index = best;
  }
  for (int64_t a = 1; a < taken; ++a)  // ascending
    for (int64_t b = a; b > 0 && o[b - 1] > o[b]; --b) {
      const int32_t t = o[b];
      o[b] = o[b - 1];
      o[b - 1] = t;
    }
  for (int64_t j = taken; j < k; ++j) o[j] = -1;
}

__global__ void mask_candidates_kernel(float* scores, int64_t ld_sc, int64_t cols, const int32_t* cand,
                                       int64_t ld_c, int64_t kc, int64_t block, int64_t n) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= n * cols) return;
  const int64_t r = idx / cols, i = idx % cols;
  bool kept = false;
  for (int64_t j = 0; j < kc; ++j) kept |= cand[r * ld_c + j] >= 0 && cand[r * ld_c + j] == i / block;
  if (!kept) scores[r * ld_sc + i] = -INFINITY;
}

}  // namespace

Status CudaBackend::hc_mix(const Tensor& streams, const Tensor& mixes, const Tensor& scale, const Tensor& base,
                           int n_hc, int sinkhorn_iters, float hc_eps, float norm_eps, const Tensor& pre,
                           const Tensor& post, const Tensor& comb) {
  if (n_hc < 1 || n_hc > kMaxStreams) return Status::errorf("hc_mix: {} streams, supported 1..{}", n_hc, kMaxStreams);
  const int64_t n = streams.rows(), width = streams.cols() / n_hc, n_mix = (2 + n_hc) * n_hc;
  if (!f32_rows(streams, n, n_hc * width) || !f32_rows(mixes, n, n_mix) || !f32_rows(pre, n, n_hc) ||
      !f32_rows(post, n, n_hc) || !f32_rows(comb, n, n_hc * n_hc) || scale.type != GgmlType::F32 ||
      scale.n_elements() != 3 || base.type != GgmlType::F32 || base.n_elements() != n_mix)
    return Status::errorf("hc_mix: streams {}, mixes {}, scale {}, base {}, pre {}, post {}, comb {} for {} streams",
                          streams.describe(), mixes.describe(), scale.describe(), base.describe(), pre.describe(),
                          post.describe(), comb.describe(), n_hc);
  if (n == 0) return Status::ok();
  hc_mix_kernel<<<grid_of(n), kThreads, 0, impl_->stream>>>(
      static_cast<const float*>(streams.data), ld_of(streams), static_cast<const float*>(mixes.data), ld_of(mixes),
      static_cast<const float*>(scale.data), static_cast<const float*>(base.data), n_hc, sinkhorn_iters, hc_eps,
      norm_eps, width, static_cast<float*>(pre.data), ld_of(pre), static_cast<float*>(post.data), ld_of(post),
      static_cast<float*>(comb.data), ld_of(comb), n);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

Status CudaBackend::hc_collapse(const Tensor& streams, const Tensor& pre, int n_hc, const Tensor& x) {
  if (n_hc < 1) return Status::errorf("hc_collapse: {} streams", n_hc);
  const int64_t n = streams.rows(), width = streams.cols() / n_hc;
  if (!f32_rows(streams, n, n_hc * width) || !f32_rows(pre, n, n_hc) || !f32_rows(x, n, width))
    return Status::errorf("hc_collapse: streams {}, pre {}, x {} for {} streams", streams.describe(), pre.describe(),
                          x.describe(), n_hc);
  if (n == 0) return Status::ok();
  hc_collapse_kernel<<<grid_of(n * width), kThreads, 0, impl_->stream>>>(
      static_cast<const float*>(streams.data), ld_of(streams), static_cast<const float*>(pre.data), ld_of(pre), n_hc,
      width, static_cast<float*>(x.data), ld_of(x), n);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

Status CudaBackend::engram_gate(const Tensor& streams, const Tensor& kv, const Tensor& q, const Tensor& k, int n_hc,
                                float eps, const Tensor& gate) {
  if (n_hc < 1) return Status::errorf("engram_gate: {} streams", n_hc);
  const int64_t n = streams.rows(), d = streams.cols() / n_hc;
  if (!f32_rows(streams, n, n_hc * d) || !f32_rows(kv, n, (n_hc + 1) * d) || !f32_rows(gate, n, n_hc) ||
      q.type != GgmlType::F32 || !q.contiguous() || q.n_elements() != n_hc * d || k.type != GgmlType::F32 ||
      !k.contiguous() || k.n_elements() != n_hc * d)
    return Status::errorf("engram_gate: streams {}, kv {}, q {}, k {}, gate {} for {} streams", streams.describe(),
                          kv.describe(), q.describe(), k.describe(), gate.describe(), n_hc);
  if (n == 0) return Status::ok();
  engram_gate_kernel<<<grid_of(n), kThreads, 0, impl_->stream>>>(
      static_cast<float*>(streams.data), ld_of(streams), static_cast<const float*>(kv.data), ld_of(kv),
      static_cast<const float*>(q.data), static_cast<const float*>(k.data), n_hc, d, eps,
      static_cast<float*>(gate.data), ld_of(gate), n);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

Status CudaBackend::candidate_blocks(const Tensor& scores, int ratio, const StepRows& rows, int64_t block, int k,
                                     const Tensor& out) {
  const int64_t n = rows.n;
  if (ratio <= 0 || block <= 0 || k <= 0) return Status::errorf("candidate_blocks: ratio {}, block {}, k {}", ratio, block, k);
  if (!f32_rows(scores, n, -1) || !out.valid() || out.type != GgmlType::I32 || out.rows() < n || out.cols() != k ||
      !rows.positions.valid() || !rows.row_seq.valid())
    return Status::errorf("candidate_blocks: scores {}, out {} for {} rows of {} blocks", scores.describe(),
                          out.describe(), n, k);
  if (n == 0) return Status::ok();
  candidate_blocks_kernel<<<grid_of(n), kThreads, 0, impl_->stream>>>(
      static_cast<const float*>(scores.data), ld_of(scores), scores.cols(),
      static_cast<const int32_t*>(rows.positions.data), static_cast<const int32_t*>(rows.row_seq.data), ratio, block,
      k, static_cast<int32_t*>(out.data), ld_of(out), n);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

Status CudaBackend::mask_candidates(const Tensor& scores, const Tensor& candidates, int64_t block) {
  const int64_t n = scores.rows();
  if (block <= 0 || !f32_rows(scores, n, -1) || !candidates.valid() || candidates.type != GgmlType::I32 ||
      candidates.rows() < n)
    return Status::errorf("mask_candidates: scores {}, candidates {}, block {}", scores.describe(),
                          candidates.describe(), block);
  if (n == 0) return Status::ok();
  mask_candidates_kernel<<<grid_of(n * scores.cols()), kThreads, 0, impl_->stream>>>(
      static_cast<float*>(scores.data), ld_of(scores), scores.cols(), static_cast<const int32_t*>(candidates.data),
      ld_of(candidates), candidates.cols(), block, n);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

}  // namespace dsv4::backend
