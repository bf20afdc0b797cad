// Scalar kernels of the CPU backend, one function per piece of spec arithmetic, written
// as plain loops over fp32 in the order the official reference computes them. The
// Backend operations in cpu_backend.cpp apply them to rows, in parallel.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "backend/backend.h"

namespace dsv4::backend::cpu {

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// torch's softplus (threshold 20) followed by sqrt: the router's score (spec §4.1).
inline float sqrt_softplus(float x) { return std::sqrt(x > 20.0f ? x : std::log1p(std::exp(x))); }

// 1 / sqrt(mean(x^2) + eps), the mean accumulated in double.
inline float inverse_rms(const float* x, int64_t n, float eps) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  return 1.0f / std::sqrt(static_cast<float>(ss / n) + eps);
}

// y = x * rsqrt(mean(x^2) + eps) * w (w may be null); y may alias x.
inline void rms_norm(const float* x, const float* w, float eps, int64_t n, float* y) {
  const float r = inverse_rms(x, n, eps);
  for (int64_t i = 0; i < n; ++i) y[i] = w ? x[i] * r * w[i] : x[i] * r;
}

// sum(x[i]^2) in fp32 in torch's CPU order for a contiguous row (at::native SumKernel's
// vectorized_inner_sum on AVX2: 8-lane vectors, row_sum's 4 interleaved accumulators, each
// a multi_row_sum cascade of 4 levels, then the lanes left to right after the tail). The
// squares are rounded before they are added, as x.square() materialises them.
float torch_sum_squares(const float* x, int64_t n);

// rms_norm with the statistic as torch computes it: sum / n in fp32, then 1 / sqrt.
inline void rms_norm_torch_order(const float* x, const float* w, float eps, int64_t n, float* y) {
  const float r = 1.0f / std::sqrt(torch_sum_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = w ? x[i] * r * w[i] : x[i] * r;
}

// omega_i for i < dims/2 (spec §2.1), in fp32 as the reference's precompute_freqs_cis.
std::vector<float> rope_frequencies(const RopeParams& p);

// Rotates adjacent pairs (v[2i], v[2i+1]) by pos * omega_i (or its negative).
inline void rope_rotate(float* v, const std::vector<float>& omega, int64_t pos, bool inverse) {
  const float t = static_cast<float>(pos);
  for (size_t i = 0; i < omega.size(); ++i) {
    const float angle = t * omega[i];
    const float c = std::cos(angle), s = inverse ? -std::sin(angle) : std::sin(angle);
    const float a = v[2 * i], b = v[2 * i + 1];
    v[2 * i] = a * c - b * s;
    v[2 * i + 1] = a * s + b * c;
  }
}

// mHC split (spec §2.3 steps 3-6): pre, post and the Sinkhorn-normalised comb from the raw
// mix logits scaled by rho.
void hc_split_sinkhorn(const float* mixes, float rho, const float* scale, const float* base,
                       int n_hc, int iters, float eps, float* pre, float* post, float* comb);

// out = sum_j w[j] * X[j] over the n_hc streams of one token.
inline void hc_collapse(const float* X, const float* w, int n_hc, int64_t width, float* out) {
  for (int64_t i = 0; i < width; ++i) {
    float acc = 0;
    for (int j = 0; j < n_hc; ++j) acc += w[j] * X[j * width + i];
    out[i] = acc;
  }
}

// One query head over n_keys keys (K = V) with a sink in the denominator (spec §3.1).
void attend_with_sink(const float* q, const float* const* keys, int64_t n_keys, int64_t d,
                      float scale, float sink, float* logits, float* out);

// Pools one compressor block (spec §3.3): per channel, a softmax over the block's slots.
// kv_row(r) / score_row(r) give state row r; overlap reads the previous block's first half
// (rows 0..ratio-1) and the current block's second half (rows ratio..2*ratio-1).
template <typename RowFn, typename ScoreFn>
void pool_block(RowFn kv_row, ScoreFn score_row, int ratio, bool overlap, int64_t w, float* out) {
  const int slots = overlap ? 2 * ratio : ratio;
  std::vector<float> z(slots), v(slots);
  for (int64_t c = 0; c < w; ++c) {
    for (int j = 0; j < slots; ++j) {
      const int64_t col = overlap && j >= ratio ? w + c : c;
      z[j] = score_row(j)[col];
      v[j] = kv_row(j)[col];
    }
    float m = z[0];
    for (int j = 1; j < slots; ++j) m = std::max(m, z[j]);
    float sum = 0;
    for (int j = 0; j < slots; ++j) sum += (z[j] = std::exp(z[j] - m));
    float acc = 0;
    for (int j = 0; j < slots; ++j) acc += v[j] * (z[j] / sum);
    out[c] = acc;
  }
}

// sum_h w[h] * relu(q[h] . key), the lightning indexer's score (spec §3.6).
inline float indexer_score(const float* q, const float* w, const float* key, int64_t n_heads,
                           int64_t dk) {
  float total = 0;
  for (int64_t h = 0; h < n_heads; ++h) {
    float dot = 0;
    for (int64_t i = 0; i < dk; ++i) dot += q[h * dk + i] * key[i];
    total += w[h] * std::max(dot, 0.0f);
  }
  return total;
}

// In-place Sylvester-ordered Walsh-Hadamard transform scaled by n^-1/2.
void hadamard(float* x, int64_t n);

// QAT simulations (spec §3.7, fixture README "QAT rules"), in place on one block.
void round_fp8_block(float* x, int64_t n);
void round_fp4_block(float* x, int64_t n);
void round_fp4_e4m3_block(float* x, int64_t n);  // scale e4m3(amax/6), not a power of two

// Indices of the k largest (score + bias); equal values keep the lower index.
void biased_top_k(const float* score, const float* bias, int64_t n, int k, int32_t* out);

// out = weight * silu(min(g, L)) * clamp(u, -L, L) (spec §4.3); out may alias g.
inline void swiglu(const float* g, const float* u, int64_t n, float limit, float weight, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    float gate = g[i], up = u[i];
    if (limit > 0) {
      up = std::min(std::max(up, -limit), limit);
      gate = std::min(gate, limit);
    }
    out[i] = weight * (gate * sigmoid(gate) * up);
  }
}

}  // namespace dsv4::backend::cpu
