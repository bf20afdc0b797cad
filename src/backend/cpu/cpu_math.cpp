#include "backend/cpu/cpu_math.h"

#include <algorithm>
#include <numeric>

#include "util/float_formats.h"

namespace dsv4::backend::cpu {

float torch_sum_squares(const float* x, int64_t n) {
  constexpr int kLanes = 8, kIlp = 4, kLevels = 4;
  // Squared first, into memory: the sums below must add rounded squares (no fma).
  std::vector<float> sq(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) sq[i] = x[i] * x[i];
  const int64_t vecs = n / kLanes, rows = vecs / kIlp;
  int64_t ceil_log2 = 1;  // torch's CeilLog2 (1 for sizes up to 2)
  while ((int64_t{1} << ceil_log2) < rows) ++ceil_log2;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2 / kLevels), level_step = int64_t{1} << level_power;
  const int64_t level_mask = level_step - 1;
  float acc[kLevels][kIlp][kLanes] = {};
  const auto add_row = [&](int64_t row) {
    for (int k = 0; k < kIlp; ++k)
      for (int l = 0; l < kLanes; ++l) acc[0][k][l] += sq[(row * kIlp + k) * kLanes + l];
  };
  int64_t i = 0;
  while (i + level_step <= rows) {  // multi_row_sum: full level steps climb the cascade
    for (int64_t j = 0; j < level_step; ++j, ++i) add_row(i);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k)
        for (int l = 0; l < kLanes; ++l) {
          acc[j][k][l] += acc[j - 1][k][l];
          acc[j - 1][k][l] = 0;
        }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < rows; ++i) add_row(i);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k)
      for (int l = 0; l < kLanes; ++l) acc[0][k][l] += acc[j][k][l];
  float (&part)[kIlp][kLanes] = acc[0];
  for (int64_t v = rows * kIlp; v < vecs; ++v)  // row_sum: vectors left over
    for (int l = 0; l < kLanes; ++l) part[0][l] += sq[v * kLanes + l];
  for (int k = 1; k < kIlp; ++k)
    for (int l = 0; l < kLanes; ++l) part[0][l] += part[k][l];
  float sum = 0;  // vectorized_inner_sum: the scalar tail, then the lanes
  for (int64_t e = vecs * kLanes; e < n; ++e) sum += sq[e];
  for (int l = 0; l < kLanes; ++l) sum += part[0][l];
  return sum;
}

std::vector<float> rope_frequencies(const RopeParams& p) {
  const int half = p.dims / 2;
  std::vector<float> omega(half);
  for (int i = 0; i < half; ++i)
    omega[i] = 1.0f / std::pow(p.freq_base, static_cast<float>(2 * i) / static_cast<float>(p.dims));
  if (!p.yarn) return omega;
  // YaRN correction range, computed in double as the reference does with math.log.
  const auto correction_dim = [&](double rotations) {
    return p.dims * std::log(p.yarn_original_context / (rotations * 2 * M_PI)) /
           (2 * std::log(static_cast<double>(p.freq_base)));
  };
  const double low = std::max(std::floor(correction_dim(p.yarn_beta_fast)), 0.0);
  double high = std::min(std::ceil(correction_dim(p.yarn_beta_slow)), static_cast<double>(p.dims - 1));
  if (low == high) high += 0.001;
  const float lo = static_cast<float>(low), span = static_cast<float>(high - low);
  for (int i = 0; i < half; ++i) {
    const float ramp = std::clamp((static_cast<float>(i) - lo) / span, 0.0f, 1.0f);
    const float smooth = 1.0f - ramp;
    omega[i] = omega[i] / p.yarn_factor * (1.0f - smooth) + omega[i] * smooth;
  }
  return omega;
}

void hc_split_sinkhorn(const float* mixes, float rho, const float* scale, const float* base,
                       int n_hc, int iters, float eps, float* pre, float* post, float* comb) {
  const int n = n_hc;
  for (int j = 0; j < n; ++j) {
    pre[j] = sigmoid(mixes[j] * rho * scale[0] + base[j]) + eps;
    post[j] = 2.0f * sigmoid(mixes[n + j] * rho * scale[1] + base[n + j]);
  }
  float* c = comb;  // c[j * n + k]: row j (source stream), column k (destination)
  for (int i = 0; i < n * n; ++i) c[i] = mixes[2 * n + i] * rho * scale[2] + base[2 * n + i];
  for (int j = 0; j < n; ++j) {  // row softmax, then + eps
    float m = c[j * n];
    for (int k = 1; k < n; ++k) m = std::max(m, c[j * n + k]);
    float sum = 0;
    for (int k = 0; k < n; ++k) sum += (c[j * n + k] = std::exp(c[j * n + k] - m));
    for (int k = 0; k < n; ++k) c[j * n + k] = c[j * n + k] / sum + eps;
  }
  const auto normalise_columns = [&] {
    for (int k = 0; k < n; ++k) {
      float sum = 0;
      for (int j = 0; j < n; ++j) sum += c[j * n + k];
      for (int j = 0; j < n; ++j) c[j * n + k] /= sum + eps;
    }
  };
  const auto normalise_rows = [&] {
    for (int j = 0; j < n; ++j) {
      float sum = 0;
      for (int k = 0; k < n; ++k) sum += c[j * n + k];
      for (int k = 0; k < n; ++k) c[j * n + k] /= sum + eps;
    }
  };
  normalise_columns();
  for (int it = 1; it < iters; ++it) {
    normalise_rows();
    normalise_columns();
  }
}

void attend_with_sink(const float* q, const float* const* keys, int64_t n_keys, int64_t d,
                      float scale, float sink, float* logits, float* out) {
  std::fill(out, out + d, 0.0f);
  if (n_keys == 0) return;
  float m = -INFINITY;
  for (int64_t j = 0; j < n_keys; ++j) {
    float dot = 0;
    for (int64_t i = 0; i < d; ++i) dot += q[i] * keys[j][i];
    logits[j] = dot * scale;
    m = std::max(m, logits[j]);
  }
  float denom = 0;
  for (int64_t j = 0; j < n_keys; ++j) {
    const float p = std::exp(logits[j] - m);
    denom += p;
    for (int64_t i = 0; i < d; ++i) out[i] += p * keys[j][i];
  }
  denom += std::exp(sink - m);
  for (int64_t i = 0; i < d; ++i) out[i] /= denom;
}

void hadamard(float* x, int64_t n) {
  for (int64_t h = 1; h < n; h *= 2)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const float s = 1.0f / std::sqrt(static_cast<float>(n));
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

namespace {
// 2^ceil(log2(v)) for v > 0, exact: frexp gives v = m * 2^e with m in [0.5, 1).
float pow2_ceil(float v) {
  int e = 0;
  const float m = std::frexp(v, &e);
  return std::ldexp(1.0f, m == 0.5f ? e - 1 : e);
}

float block_amax(const float* x, int64_t n) {
  float amax = 0;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax;
}
}  // namespace

void round_fp8_block(float* x, int64_t n) {
  const float amax = std::max(block_amax(x, n), 1e-4f);
  const float s = pow2_ceil(amax * (1.0f / kE4M3Max));
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::clamp(x[i] / s, -kE4M3Max, kE4M3Max);
    x[i] = e4m3_to_f32(f32_to_e4m3(v)) * s;
  }
}

void round_fp4_block(float* x, int64_t n) {
  const float amax = std::max(block_amax(x, n), 6.0f * std::ldexp(1.0f, -126));
  const float s = pow2_ceil(amax * (1.0f / 6.0f));
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::clamp(x[i] / s, -6.0f, 6.0f);
    x[i] = e2m1_to_f32(f32_to_e2m1(v)) * s;
  }
}

void round_fp4_e4m3_block(float* x, int64_t n) {
  const float amax = std::max(block_amax(x, n), 6.0f * std::ldexp(1.0f, -9));
  const float s = e4m3_to_f32(f32_to_e4m3(amax / 6.0f));
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::clamp(x[i] / s, -6.0f, 6.0f);
    x[i] = e2m1_to_f32(f32_to_e2m1(v)) * s;
  }
}

void biased_top_k(const float* score, const float* bias, int64_t n, int k, int32_t* out) {
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  const auto key = [&](int32_t e) { return bias ? score[e] + bias[e] : score[e]; };
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
    const float ka = key(a), kb = key(b);
    return ka > kb || (ka == kb && a < b);
  });
  std::copy(order.begin(), order.begin() + k, out);
}

}  // namespace dsv4::backend::cpu
