// Quantisers for the K-quants (Q2_K .. Q6_K) from f32: the same searches as ggml's
// reference quantisers (quantize_row_q*_K_ref in ggml-quants.c), written anew here. Each
// super-block of 256 is split into sub-blocks; every sub-block gets a scale (and for
// Q2/Q4/Q5 a min) from a small search minimising a weighted squared (Q2_K: absolute) error;
// the scales themselves are then quantised against the block's largest one, and the
// elements are re-rounded against the stored (fp16 x integer) scales.
//
// The f32 operations follow ggml's order exactly, and multiply-adds are never fused here, so
// with ggml built without contraction the bytes come out identical (docs/QUANT.md).
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <cmath>
#include <cstring>

#include "gguf/quant_decode.h"
#include "gguf/quant_internal.h"
#include "util/float_formats.h"

namespace dsv4::quant {
namespace {

// Groups whose largest magnitude is below this are treated as all zero (ggml: GROUP_MAX_EPS).
constexpr float kGroupMaxEps = 1e-15f;

// Round to nearest, ties to even, for |v| < 2^22: adding 1.5*2^23 leaves the integer in the
// low mantissa bits (the f32 addition does the rounding).
inline int round_to_int(float v) {
  const float shifted = v + 12582912.0f;
  uint32_t bits;
  std::memcpy(&bits, &shifted, sizeof bits);
  return static_cast<int>(bits & 0x007FFFFFu) - 0x00400000;
}

inline int clamp_int(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

// Symmetric signed levels in [-nmax, nmax-1] with weights x^2: scale from the least-squares
// fit of the rounding at -nmax/max, then 18 nearby trial scales (nmax +- 0.1k); keeps the
// trial that maximises (sum w x l)^2 / (sum w l^2). L receives l + nmax. (ggml's
// make_qx_quants with rmse_type 1 and no importance weights.)
float fit_symmetric_scale(int n, int nmax, const float* x, int8_t* L) {
  float max = 0, amax = 0;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) {
      amax = ax;
      max = x[i];
    }
  }
  if (amax < kGroupMaxEps) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    return 0.0f;
  }
  auto sums_at = [&](float iscale, float& sumlx, float& suml2) {
    sumlx = suml2 = 0;
    for (int i = 0; i < n; ++i) {
      const int l = clamp_int(round_to_int(iscale * x[i]), -nmax, nmax - 1);
      const float w = x[i] * x[i];
      sumlx += w * x[i] * static_cast<float>(l);
      suml2 += w * static_cast<float>(l) * static_cast<float>(l);
    }
  };
  auto set_levels = [&](float iscale) {
    for (int i = 0; i < n; ++i) L[i] = static_cast<int8_t>(nmax + clamp_int(round_to_int(iscale * x[i]), -nmax, nmax - 1));
  };
  float iscale = static_cast<float>(-nmax) / max;
  float sumlx, suml2;
  sums_at(iscale, sumlx, suml2);
  set_levels(iscale);
  float scale = suml2 != 0.0f ? sumlx / suml2 : 0.0f;
  float best = scale * sumlx;
  for (int step = -9; step <= 9; ++step) {
    if (step == 0) continue;
    iscale = -(static_cast<float>(nmax) + 0.1f * static_cast<float>(step)) / max;
    sums_at(iscale, sumlx, suml2);
    if (suml2 > 0 && sumlx * sumlx > best * suml2) {
      set_levels(iscale);
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

// Q3_K's sub-block fit: round at -nmax/max, then up to 5 passes of coordinate descent that
// move single levels while that raises (sum w x l)^2 / (sum w l^2), weights x^2. L receives
// l + nmax. (ggml's make_q3_quants with do_rmse.)
float fit_q3_scale(int n, int nmax, const float* x, int8_t* L) {
  float max = 0, amax = 0;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) {
      amax = ax;
      max = x[i];
    }
  }
  if (amax < kGroupMaxEps) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    return 0.0f;
  }
  const float iscale = static_cast<float>(-nmax) / max;
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) {
    const int l = clamp_int(round_to_int(iscale * x[i]), -nmax, nmax - 1);
    L[i] = static_cast<int8_t>(l);
    const float w = x[i] * x[i];
    sumlx += w * x[i] * static_cast<float>(l);
    suml2 += w * static_cast<float>(l) * static_cast<float>(l);
  }
  for (int pass = 0; pass < 5; ++pass) {
    int changed = 0;
    for (int i = 0; i < n; ++i) {
      const float w = x[i] * x[i];
      const float li = static_cast<float>(L[i]);
      float slx = sumlx - w * x[i] * li;
      if (!(slx > 0)) continue;
      float sl2 = suml2 - w * li * li;
      const int new_l = clamp_int(round_to_int(x[i] * sl2 / slx), -nmax, nmax - 1);
      if (new_l == L[i]) continue;
      slx += w * x[i] * static_cast<float>(new_l);
      sl2 += w * static_cast<float>(new_l) * static_cast<float>(new_l);
      if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
        L[i] = static_cast<int8_t>(new_l);
        sumlx = slx;
        suml2 = sl2;
        ++changed;
      }
    }
    if (changed == 0) break;
  }
  for (int i = 0; i < n; ++i) L[i] = static_cast<int8_t>(L[i] + nmax);
  return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

// Affine levels x ~ scale*l - min_out with l in [0, nmax] and min <= 0: start from the
// range, then try nstep+1 scales (nmax + rmin + rdelta*k over the range), each refined by a
// weighted least-squares fit of scale and min, keeping the lowest weighted error (absolute
// if use_mad, else squared). Returns the scale; *min_out is the (non-negative) offset.
// (ggml's make_qkx2_quants.)
float fit_affine_scale(int n, int nmax, const float* x, const float* weights, uint8_t* L, float* min_out,
                       float rmin, float rdelta, int nstep, bool use_mad) {
  float min = x[0], max = x[0];
  float sum_w = weights[0];
  float sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    sum_w += weights[i];
    sum_x += weights[i] * x[i];
  }
  if (min > 0) min = 0;
  if (max == min) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    *min_out = -min;
    return 0.0f;
  }
  auto error_of = [&](float scale, float offset, const uint8_t* levels) {
    float err = 0;
    for (int i = 0; i < n; ++i) {
      float diff = scale * static_cast<float>(levels[i]) + offset - x[i];
      diff = use_mad ? std::fabs(diff) : diff * diff;
      err += weights[i] * diff;
    }
    return err;
  };
  float iscale = static_cast<float>(nmax) / (max - min);
  float scale = 1 / iscale;
  for (int i = 0; i < n; ++i) L[i] = static_cast<uint8_t>(clamp_int(round_to_int(iscale * (x[i] - min)), 0, nmax));
  float best_error = error_of(scale, min, L);
  uint8_t trial[32];
  for (int step = 0; step <= nstep; ++step) {
    iscale = (rmin + rdelta * static_cast<float>(step) + static_cast<float>(nmax)) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      const int l = clamp_int(round_to_int(iscale * (x[i] - min)), 0, nmax);
      trial[i] = static_cast<uint8_t>(l);
      const float w = weights[i];
      const float lf = static_cast<float>(l);
      sum_l += w * lf;
      sum_l2 += w * lf * lf;
      sum_xl += w * lf * x[i];
    }
    const float det = sum_w * sum_l2 - sum_l * sum_l;
    if (!(det > 0)) continue;  // written so that NaN skips, as in ggml
    float this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
    float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
    if (this_min > 0) {
      this_min = 0;
      this_scale = sum_xl / sum_l2;
    }
    const float err = error_of(this_scale, this_min, trial);
    if (err < best_error) {
      std::memcpy(L, trial, static_cast<size_t>(n));
      best_error = err;
      scale = this_scale;
      min = this_min;
    }
  }
  *min_out = -min;
  return scale;
}

// Packs 2-bit levels: byte n*32 + l holds elements n*128 + s*32 + l in bits 2s (Q2_K, Q3_K).
void pack_2bit(const uint8_t* L, uint8_t* qs) {
  for (int n = 0; n < QK_K / 128; ++n)
    for (int l = 0; l < 32; ++l) {
      const uint8_t* g = L + n * 128 + l;
      qs[n * 32 + l] = static_cast<uint8_t>(g[0] | (g[32] << 2) | (g[64] << 4) | (g[96] << 6));
    }
}

// Packs the eight 6-bit (scale, min) pairs of Q4_K / Q5_K (inverse of k4_scale_min).
void pack_k4_scales(const uint8_t* ls, const uint8_t* lm, uint8_t* scales) {
  std::memset(scales, 0, K_SCALE_SIZE);
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      scales[j] = ls[j];
      scales[j + 4] = lm[j];
    } else {
      scales[j + 4] = static_cast<uint8_t>((ls[j] & 0xF) | ((lm[j] & 0xF) << 4));
      scales[j - 4] |= static_cast<uint8_t>((ls[j] >> 4) << 6);
      scales[j] |= static_cast<uint8_t>((lm[j] >> 4) << 6);
    }
  }
}

// Q4_K and Q5_K share everything but the level count and the search's trial range.
template <int kLevels>
void quantize_k4_block(const float* x, uint8_t* scales_out, fp16_bits& d_out, fp16_bits& dmin_out,
                       uint8_t* L, float rmin, int nstep) {
  float scales[8], mins[8], weights[32];
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < 8; ++j) {
    const float* xs = x + 32 * j;
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += xs[l] * xs[l];
    const float av_x = std::sqrt(sum_x2 / 32);
    for (int l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(xs[l]);
    scales[j] = fit_affine_scale(32, kLevels, xs, weights, L + 32 * j, &mins[j], rmin, 0.1f, nstep, false);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
  const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
  uint8_t ls[8], lm[8];
  for (int j = 0; j < 8; ++j) {
    const uint8_t s = static_cast<uint8_t>(round_to_int(inv_scale * scales[j]));
    const uint8_t m = static_cast<uint8_t>(round_to_int(inv_min * mins[j]));
    ls[j] = s < 63 ? s : 63;
    lm[j] = m < 63 ? m : 63;
  }
  pack_k4_scales(ls, lm, scales_out);
  d_out = f32_to_fp16(max_scale / 63.f);
  dmin_out = f32_to_fp16(max_min / 63.f);
  // Re-round every element against the scales as stored.
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, m;
    k4_scale_min(scales_out, j, sc, m);
    const float d = fp16_to_f32(d_out) * static_cast<float>(sc);
    if (d == 0.0f) continue;
    const float dm = fp16_to_f32(dmin_out) * static_cast<float>(m);
    for (int l = 0; l < 32; ++l)
      L[32 * j + l] = static_cast<uint8_t>(clamp_int(round_to_int((x[32 * j + l] + dm) / d), 0, kLevels));
  }
}

}  // namespace

void quantize_blocks_q2_K(const float* x, block_q2_K* y, int64_t nb) {
  constexpr float kScaleLevels = 15.f;
  for (int64_t b = 0; b < nb; ++b, x += QK_K) {
    uint8_t L[QK_K];
    float weights[16], scales[16], mins[16];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 16; ++j) {
      for (int l = 0; l < 16; ++l) weights[l] = std::fabs(x[16 * j + l]);
      scales[j] = fit_affine_scale(16, 3, x + 16 * j, weights, L + 16 * j, &mins[j], -0.5f, 0.1f, 15, true);
      if (scales[j] > max_scale) max_scale = scales[j];
      if (mins[j] > max_min) max_min = mins[j];
    }
    block_q2_K& out = y[b];
    std::memset(out.scales, 0, sizeof out.scales);
    out.d = f32_to_fp16(0.f);
    out.dmin = f32_to_fp16(0.f);
    if (max_scale > 0) {
      const float iscale = kScaleLevels / max_scale;
      for (int j = 0; j < 16; ++j) out.scales[j] = static_cast<uint8_t>(round_to_int(iscale * scales[j]));
      out.d = f32_to_fp16(max_scale / kScaleLevels);
    }
    if (max_min > 0) {
      const float iscale = kScaleLevels / max_min;
      for (int j = 0; j < 16; ++j) out.scales[j] |= static_cast<uint8_t>(round_to_int(iscale * mins[j]) << 4);
      out.dmin = f32_to_fp16(max_min / kScaleLevels);
    }
    for (int j = 0; j < 16; ++j) {
      const float d = fp16_to_f32(out.d) * static_cast<float>(out.scales[j] & 0xF);
      if (d == 0.0f) continue;
      const float dm = fp16_to_f32(out.dmin) * static_cast<float>(out.scales[j] >> 4);
      for (int l = 0; l < 16; ++l)
        L[16 * j + l] = static_cast<uint8_t>(clamp_int(round_to_int((x[16 * j + l] + dm) / d), 0, 3));
    }
    pack_2bit(L, out.qs);
  }
}

void quantize_blocks_q3_K(const float* x, block_q3_K* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += QK_K) {
    int8_t L[QK_K];
    float scales[16];
    float max_scale = 0, amax = 0;
    for (int j = 0; j < 16; ++j) {
      scales[j] = fit_q3_scale(16, 4, x + 16 * j, L + 16 * j);
      if (std::fabs(scales[j]) > amax) {
        amax = std::fabs(scales[j]);
        max_scale = scales[j];
      }
    }
    block_q3_K& out = y[b];
    std::memset(out.scales, 0, sizeof out.scales);
    out.d = f32_to_fp16(0.f);
    if (max_scale != 0.0f) {
      // Signed 6-bit scales: low nibbles in bytes 0..7, top two bits in bytes 8..11.
      const float iscale = -32.f / max_scale;
      for (int j = 0; j < 16; ++j) {
        const int l = clamp_int(static_cast<int8_t>(round_to_int(iscale * scales[j])), -32, 31) + 32;
        if (j < 8) out.scales[j] = static_cast<uint8_t>(l & 0xF);
        else out.scales[j - 8] |= static_cast<uint8_t>((l & 0xF) << 4);
        out.scales[8 + j % 4] |= static_cast<uint8_t>((l >> 4) << (2 * (j / 4)));
      }
      out.d = f32_to_fp16(1 / iscale);
    }
    for (int j = 0; j < 16; ++j) {
      const float d = fp16_to_f32(out.d) * static_cast<float>(q3_k_scale(out.scales, j));
      if (d == 0.0f) continue;
      for (int l = 0; l < 16; ++l) L[16 * j + l] = static_cast<int8_t>(clamp_int(round_to_int(x[16 * j + l] / d), -4, 3) + 4);
    }
    // Level bit 2 goes to hmask (bit i/32 of byte i%32), the low two bits to qs.
    uint8_t low[QK_K];
    std::memset(out.hmask, 0, sizeof out.hmask);
    for (int i = 0; i < QK_K; ++i) {
      if (L[i] > 3) out.hmask[i % 32] |= static_cast<uint8_t>(1u << (i / 32));
      low[i] = static_cast<uint8_t>(L[i] > 3 ? L[i] - 4 : L[i]);
    }
    pack_2bit(low, out.qs);
  }
}

void quantize_blocks_q4_K(const float* x, block_q4_K* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += QK_K) {
    uint8_t L[QK_K];
    quantize_k4_block<15>(x, y[b].scales, y[b].d, y[b].dmin, L, -1.f, 20);
    for (int n = 0; n < QK_K / 64; ++n)
      for (int l = 0; l < 32; ++l)
        y[b].qs[n * 32 + l] = static_cast<uint8_t>(L[n * 64 + l] | (L[n * 64 + l + 32] << 4));
  }
}

void quantize_blocks_q5_K(const float* x, block_q5_K* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += QK_K) {
    uint8_t L[QK_K];
    quantize_k4_block<31>(x, y[b].scales, y[b].d, y[b].dmin, L, -0.5f, 15);
    std::memset(y[b].qh, 0, sizeof y[b].qh);
    for (int n = 0; n < QK_K / 64; ++n)
      for (int l = 0; l < 32; ++l) {
        const uint8_t lo = L[n * 64 + l], hi = L[n * 64 + l + 32];
        y[b].qs[n * 32 + l] = static_cast<uint8_t>((lo & 0xF) | ((hi & 0xF) << 4));
        y[b].qh[l] |= static_cast<uint8_t>(((lo >> 4) << (2 * n)) | ((hi >> 4) << (2 * n + 1)));
      }
  }
}

void quantize_blocks_q6_K(const float* x, block_q6_K* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += QK_K) {
    int8_t L[QK_K];
    float scales[16];
    float max_scale = 0, max_abs_scale = 0;
    for (int j = 0; j < 16; ++j) {
      scales[j] = fit_symmetric_scale(16, 32, x + 16 * j, L + 16 * j);
      if (std::fabs(scales[j]) > max_abs_scale) {
        max_abs_scale = std::fabs(scales[j]);
        max_scale = scales[j];
      }
    }
    block_q6_K& out = y[b];
    if (max_abs_scale < kGroupMaxEps) {
      std::memset(&out, 0, sizeof out);
      continue;
    }
    const float iscale = -128.f / max_scale;
    out.d = f32_to_fp16(1 / iscale);
    for (int j = 0; j < 16; ++j) {
      const int s = round_to_int(iscale * scales[j]);
      out.scales[j] = static_cast<int8_t>(s < 127 ? s : 127);
    }
    for (int j = 0; j < 16; ++j) {
      const float d = fp16_to_f32(out.d) * static_cast<float>(out.scales[j]);
      if (d == 0.0f) continue;
      for (int l = 0; l < 16; ++l) L[16 * j + l] = static_cast<int8_t>(clamp_int(round_to_int(x[16 * j + l] / d), -32, 31) + 32);
    }
    // Element n*128 + r: low nibble in ql[n*64 + r%64] (high half for r >= 64), top two bits
    // in qh[n*32 + r%32] at bit 2*(r/32).
    for (int n = 0; n < QK_K / 128; ++n)
      for (int l = 0; l < 32; ++l) {
        const int8_t* g = L + n * 128 + l;
        out.ql[n * 64 + l] = static_cast<uint8_t>((g[0] & 0xF) | ((g[64] & 0xF) << 4));
        out.ql[n * 64 + l + 32] = static_cast<uint8_t>((g[32] & 0xF) | ((g[96] & 0xF) << 4));
        out.qh[n * 32 + l] = static_cast<uint8_t>((g[0] >> 4) | ((g[32] >> 4) << 2) | ((g[64] >> 4) << 4) | ((g[96] >> 4) << 6));
      }
  }
}

}  // namespace dsv4::quant
