// The scalar arithmetic of the CUDA backend's token-wise kernels, written once for the device
// and the host: the CPU backend's functions (cpu_math.h, cpu_math.cpp) in the same f32
// operations, with every product and sum rounded on its own except where GCC fuses them on
// the CPU side (checked in its assembly: `a*b*c + d` becomes fma(a*b, c, d), `acc += w*x`
// fma(w, x, acc)), so nvcc's own contractions cannot change a bit. exp, log1p, sin and cos
// are the double functions rounded once to f32: the correctly rounded value, which glibc's
// f32 functions return in nearly every case. Without CUDA (tests/backend/
// test_cuda_reference_math.cpp) the same code runs on the host against cpu_math.
#pragma once

#include <cmath>
#include <cstdint>

#include "util/float_formats.h"

namespace dsv4::cuda::ref {

// Each operation rounded on its own: __f*_rn on the device; on the host an empty asm keeps the
// result in a register as rounded, so no fused operation forms.
// Loops of a compile-time count unrolled by nvcc (the host compiler has no such pragma).
#if defined(__CUDACC__)
#define DSV4_REF_UNROLL _Pragma("unroll")
#else
#define DSV4_REF_UNROLL
#endif

#if defined(__CUDA_ARCH__)
#define DSV4_REF_OP(device, host) return device
#else
#define DSV4_REF_OP(device, host) return host
#endif
inline float keep(float v) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+x"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#endif
  return v;
}
DSV4_HOST_DEVICE inline float mul(float a, float b) { DSV4_REF_OP(__fmul_rn(a, b), keep(a * b)); }
DSV4_HOST_DEVICE inline float add(float a, float b) { DSV4_REF_OP(__fadd_rn(a, b), keep(a + b)); }
DSV4_HOST_DEVICE inline float sub(float a, float b) { DSV4_REF_OP(__fsub_rn(a, b), keep(a - b)); }
DSV4_HOST_DEVICE inline float div(float a, float b) { DSV4_REF_OP(__fdiv_rn(a, b), keep(a / b)); }
DSV4_HOST_DEVICE inline float sqrt(float a) { DSV4_REF_OP(__fsqrt_rn(a), std::sqrt(a)); }
DSV4_HOST_DEVICE inline float fma(float a, float b, float c) { DSV4_REF_OP(fmaf(a, b, c), std::fma(a, b, c)); }
DSV4_HOST_DEVICE inline float abs(float a) { DSV4_REF_OP(fabsf(a), std::fabs(a)); }
DSV4_HOST_DEVICE inline float exp(float x) {
  DSV4_REF_OP(static_cast<float>(::exp(static_cast<double>(x))), static_cast<float>(std::exp(static_cast<double>(x))));
}
DSV4_HOST_DEVICE inline float log1p(float x) {
  DSV4_REF_OP(static_cast<float>(::log1p(static_cast<double>(x))),
              static_cast<float>(std::log1p(static_cast<double>(x))));
}
DSV4_HOST_DEVICE inline float sin(float x) {
  DSV4_REF_OP(static_cast<float>(::sin(static_cast<double>(x))), static_cast<float>(std::sin(static_cast<double>(x))));
}
DSV4_HOST_DEVICE inline float cos(float x) {
  DSV4_REF_OP(static_cast<float>(::cos(static_cast<double>(x))), static_cast<float>(std::cos(static_cast<double>(x))));
}
DSV4_HOST_DEVICE inline float frexp(float v, int* e) { DSV4_REF_OP(frexpf(v, e), std::frexp(v, e)); }
DSV4_HOST_DEVICE inline float ldexp(float v, int e) { DSV4_REF_OP(ldexpf(v, e), std::ldexp(v, e)); }
#undef DSV4_REF_OP

// std::max / std::min / std::clamp exactly, NaN included (fmaxf would drop a NaN).
DSV4_HOST_DEVICE inline float std_max(float a, float b) { return (a < b) ? b : a; }
DSV4_HOST_DEVICE inline float std_min(float a, float b) { return (b < a) ? b : a; }
DSV4_HOST_DEVICE inline float std_clamp(float v, float lo, float hi) { return (v < lo) ? lo : (hi < v) ? hi : v; }

// cpu::sigmoid.
DSV4_HOST_DEVICE inline float sigmoid(float x) { return div(1.0f, add(1.0f, exp(-x))); }

// cpu::sqrt_softplus.
DSV4_HOST_DEVICE inline float sqrt_softplus(float x) { return sqrt(x > 20.0f ? x : log1p(exp(x))); }

// cpu::inverse_rms from the double sum of squares of n values.
DSV4_HOST_DEVICE inline float inverse_rms(double sum_squares, int64_t n, float eps) {
  const float mean = static_cast<float>(sum_squares / static_cast<double>(n));
  return div(1.0f, sqrt(add(mean, eps)));
}

// cpu::swiglu for one element: weight * (gate * sigmoid(gate) * up) after the clamps.
DSV4_HOST_DEVICE inline float swiglu(float gate, float up, float limit, float weight) {
  if (limit > 0) {
    up = std_clamp(up, -limit, limit);
    gate = std_min(gate, limit);
  }
  return mul(weight, mul(mul(gate, sigmoid(gate)), up));
}

// cpu::rope_rotate for one pair (GCC keeps these four products unfused).
DSV4_HOST_DEVICE inline void rope_pair(float* v, int32_t position, float omega, bool inverse) {
  const float angle = mul(static_cast<float>(position), omega);
  const float c = cos(angle);
  float s = sin(angle);
  if (inverse) s = -s;
  const float a = v[0], b = v[1];
  v[0] = sub(mul(a, c), mul(b, s));
  v[1] = add(mul(a, s), mul(b, c));
}

// One Sinkhorn half-step of cpu::hc_split_sinkhorn on c[j * n + k]: each column (row)
// divided by its sum + eps.
inline constexpr int kMaxHc = 8;
DSV4_HOST_DEVICE inline void normalise_columns(float* c, int n, float eps) {
  for (int k = 0; k < n; ++k) {
    float sum = 0.0f;
    for (int j = 0; j < n; ++j) sum = add(sum, c[j * n + k]);
    for (int j = 0; j < n; ++j) c[j * n + k] = div(c[j * n + k], add(sum, eps));
  }
}
DSV4_HOST_DEVICE inline void normalise_rows(float* c, int n, float eps) {
  for (int j = 0; j < n; ++j) {
    float sum = 0.0f;
    for (int k = 0; k < n; ++k) sum = add(sum, c[j * n + k]);
    for (int k = 0; k < n; ++k) c[j * n + k] = div(c[j * n + k], add(sum, eps));
  }
}

// cpu::hc_split_sinkhorn for n <= kMaxHc streams.
DSV4_HOST_DEVICE inline void hc_split_sinkhorn(const float* mixes, float rho, const float* scale, const float* base,
                                               int n, int iters, float eps, float* pre, float* post, float* comb) {
  for (int j = 0; j < n; ++j) {
    pre[j] = add(sigmoid(fma(mul(mixes[j], rho), scale[0], base[j])), eps);
    post[j] = mul(2.0f, sigmoid(fma(mul(mixes[n + j], rho), scale[1], base[n + j])));
  }
  float c[kMaxHc * kMaxHc];  // c[j * n + k]: row j (source stream), column k (destination)
  for (int i = 0; i < n * n; ++i) c[i] = fma(mul(mixes[2 * n + i], rho), scale[2], base[2 * n + i]);
  for (int j = 0; j < n; ++j) {  // row softmax, then + eps
    float m = c[j * n];
    for (int k = 1; k < n; ++k) m = std_max(m, c[j * n + k]);
    float sum = 0.0f;
    for (int k = 0; k < n; ++k) {
      c[j * n + k] = exp(sub(c[j * n + k], m));
      sum = add(sum, c[j * n + k]);
    }
    for (int k = 0; k < n; ++k) c[j * n + k] = add(div(c[j * n + k], sum), eps);
  }
  normalise_columns(c, n, eps);
  for (int it = 1; it < iters; ++it) {
    normalise_rows(c, n, eps);
    normalise_columns(c, n, eps);
  }
  for (int i = 0; i < n * n; ++i) comb[i] = c[i];
}

// cpu::hc_collapse for one column: sum_j w[j] * X[j * stride] (n <= kMaxHc), each product
// rounded before its addition (GCC 12 does not fuse this loop in CpuBackend::hc_pre /
// hc_head). The n loads go first: under the runtime bound in the loop, nvcc issued them one
// after another (hc_pre's SASS, 2026-12-04); the products and additions are the loop's.
DSV4_HOST_DEVICE inline float hc_collapse(const float* X, int64_t stride, const float* w, int n) {
  float x[kMaxHc];
  DSV4_REF_UNROLL
  for (int j = 0; j < kMaxHc; ++j) x[j] = j < n ? X[j * stride] : 0.0f;
  float acc = 0.0f;
  DSV4_REF_UNROLL
  for (int j = 0; j < kMaxHc; ++j)
    if (j < n) acc = add(acc, mul(w[j], x[j]));
  return acc;
}

// CpuBackend::hc_post for one output: post * y + sum_j comb[j * comb_stride] * old[j], the
// sum fused (GCC does fuse this one).
DSV4_HOST_DEVICE inline float hc_expand(float post, float y, const float* comb, int comb_stride, const float* old,
                                        int n) {
  float acc = mul(post, y);
  for (int j = 0; j < n; ++j) acc = fma(comb[j * comb_stride], old[j], acc);
  return acc;
}

// CpuBackend::hc_head's gate: sigmoid(mix * rho * scale + base) + eps, the last product fused.
DSV4_HOST_DEVICE inline float hc_head_weight(float mix, float rho, float scale, float base, float eps) {
  return add(sigmoid(fma(mul(mix, rho), scale, base)), eps);
}

// 2^ceil(log2(v)) for v > 0 (cpu_math.cpp's pow2_ceil).
DSV4_HOST_DEVICE inline float pow2_ceil(float v) {
  int e = 0;
  const float m = frexp(v, &e);
  return ldexp(1.0f, m == 0.5f ? e - 1 : e);
}

// cpu::round_fp8_block / round_fp4_block.
DSV4_HOST_DEVICE inline void round_fp8_block(float* x, int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std_max(amax, abs(x[i]));
  amax = std_max(amax, 1e-4f);
  const float s = pow2_ceil(mul(amax, 1.0f / kE4M3Max));
  for (int64_t i = 0; i < n; ++i) {
    const float v = std_clamp(div(x[i], s), -kE4M3Max, kE4M3Max);
    x[i] = mul(e4m3_to_f32(f32_to_e4m3(v)), s);
  }
}

DSV4_HOST_DEVICE inline void round_fp4_block(float* x, int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std_max(amax, abs(x[i]));
  amax = std_max(amax, 6.0f * 0x1p-126f);
  const float s = pow2_ceil(mul(amax, 1.0f / 6.0f));
  for (int64_t i = 0; i < n; ++i) {
    const float v = std_clamp(div(x[i], s), -6.0f, 6.0f);
    x[i] = mul(e2m1_to_f32(f32_to_e2m1(v)), s);
  }
}

// cpu::round_fp4_e4m3_block.
DSV4_HOST_DEVICE inline void round_fp4_e4m3_block(float* x, int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std_max(amax, abs(x[i]));
  amax = std_max(amax, 6.0f * 0x1p-9f);
  const float s = e4m3_to_f32(f32_to_e4m3(div(amax, 6.0f)));
  for (int64_t i = 0; i < n; ++i) {
    const float v = std_clamp(div(x[i], s), -6.0f, 6.0f);
    x[i] = mul(e2m1_to_f32(f32_to_e2m1(v)), s);
  }
}

}  // namespace dsv4::cuda::ref
