#include "synth/random_blocks.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "gguf/quant_blocks.h"
#include "util/counter_rng.h"
#include "util/float_formats.h"

namespace dsv4 {
namespace {

// Moments of a value uniform over the integers lo..hi.
struct Uniform {
  double lo, hi;
  double mean() const { return (lo + hi) / 2; }
  double second_moment() const {  // E[x^2] = Var + mean^2, Var = ((hi-lo+1)^2 - 1) / 12
    const double n = hi - lo + 1;
    return (n * n - 1) / 12 + mean() * mean();
  }
};

// x = d * s * q - dmin * m with s, q, m independent and uniform; dmin = r * d with
// r = E[s] E[q] / E[m] (mean zero). Returns sqrt(E[x^2]) for d = 1, and r.
struct AffineBlock {
  Uniform scale, quant, min;
  double ratio() const { return scale.mean() * quant.mean() / min.mean(); }
  double unit_std() const {
    const double r = ratio();
    return std::sqrt(scale.second_moment() * quant.second_moment() -
                     2 * r * scale.mean() * quant.mean() * min.mean() + r * r * min.second_moment());
  }
};
// x = d * s * q (signed s and q).
double signed_unit_std(Uniform scale, Uniform quant) {
  return std::sqrt(scale.second_moment() * quant.second_moment());
}

constexpr AffineBlock kQ2K{{0, 15}, {0, 3}, {0, 15}};
constexpr AffineBlock kQ4K{{0, 63}, {0, 15}, {0, 63}};
constexpr AffineBlock kQ5K{{0, 63}, {0, 31}, {0, 63}};

// E2M1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}, each sign equally likely.
double mxfp4_unit_std() { return std::sqrt((0 + 0.25 + 1 + 2.25 + 4 + 9 + 16 + 36) / 8.0); }

// The per-block jitter 2^U(-1/2, 1/2) on 256 levels, scaled to unit second moment (the
// continuous law has E[x^2] = (2 - 1/2) / ln 4); a table, since one exp2 per block would
// cost as much as the block's random bytes.
struct JitterTable {
  double level[256];
  JitterTable() {
    double second = 0;
    for (int k = 0; k < 256; ++k) {
      level[k] = std::exp2((k + 0.5) / 256 - 0.5);
      second += level[k] * level[k] / 256;
    }
    for (double& l : level) l /= std::sqrt(second);
  }
};
const JitterTable kJitter;

void put_fp16(uint8_t* at, float value) {
  const uint16_t h = f32_to_fp16(value);
  std::memcpy(at, &h, sizeof h);
}

}  // namespace

bool random_blocks_supported(GgmlType type) {
  switch (type) {
    case GgmlType::Q8_0:
    case GgmlType::Q2_K:
    case GgmlType::Q3_K:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
    case GgmlType::Q6_K:
    case GgmlType::MXFP4: return true;
    default: return false;
  }
}

double random_block_unit_std(GgmlType type) {
  switch (type) {
    case GgmlType::Q8_0: return signed_unit_std({1, 1}, {-128, 127});
    case GgmlType::Q2_K: return kQ2K.unit_std();
    case GgmlType::Q3_K: return signed_unit_std({-32, 31}, {-4, 3});
    case GgmlType::Q4_K: return kQ4K.unit_std();
    case GgmlType::Q5_K: return kQ5K.unit_std();
    case GgmlType::Q6_K: return signed_unit_std({-128, 127}, {-32, 31});
    case GgmlType::MXFP4: return mxfp4_unit_std();
    default: return 0;
  }
}

void fill_random_blocks(GgmlType type, uint64_t key, uint64_t first_block, uint64_t blocks_per_row,
                        std::span<const float> row_std, uint8_t* out) {
  const uint32_t block_bytes = ggml_traits(type).block_bytes;
  const double unit = random_block_unit_std(type);
  const double min_ratio = type == GgmlType::Q2_K   ? kQ2K.ratio()
                           : type == GgmlType::Q4_K ? kQ4K.ratio()
                           : type == GgmlType::Q5_K ? kQ5K.ratio()
                                                    : 0;
  uint64_t words[32];  // the largest supported block (Q6_K, 210 bytes) is 27 words
  uint64_t block = first_block;
  uint8_t* dst = out;
  for (float target : row_std) {
    const double d_row = target / unit;
    for (uint64_t i = 0; i < blocks_per_row; ++i, ++block, dst += block_bytes) {
      const uint64_t base = mix_keys(key, block);
      for (uint32_t w = 0; w * 8 < block_bytes; ++w) words[w] = splitmix64(base + w);
      std::memcpy(dst, words, block_bytes);
      // The jitter from bits the block's bytes do not use (the top byte of the base).
      const float d = static_cast<float>(d_row * kJitter.level[base >> 56]);
      switch (type) {
        case GgmlType::Q8_0: put_fp16(dst + offsetof(block_q8_0, d), d); break;
        case GgmlType::Q2_K:
          put_fp16(dst + offsetof(block_q2_K, d), d);
          put_fp16(dst + offsetof(block_q2_K, dmin), static_cast<float>(d * min_ratio));
          break;
        case GgmlType::Q3_K: put_fp16(dst + offsetof(block_q3_K, d), d); break;
        case GgmlType::Q4_K:
          put_fp16(dst + offsetof(block_q4_K, d), d);
          put_fp16(dst + offsetof(block_q4_K, dmin), static_cast<float>(d * min_ratio));
          break;
        case GgmlType::Q5_K:
          put_fp16(dst + offsetof(block_q5_K, d), d);
          put_fp16(dst + offsetof(block_q5_K, dmin), static_cast<float>(d * min_ratio));
          break;
        case GgmlType::Q6_K: put_fp16(dst + offsetof(block_q6_K, d), d); break;
        case GgmlType::MXFP4: {
          // Power-of-two scales only: the nearest exponent (the jitter spreads the rest).
          const int e = 127 + static_cast<int>(std::lround(std::log2(std::max(d, 1e-30f))));
          dst[offsetof(block_mxfp4, e)] = static_cast<uint8_t>(std::clamp(e, 1, 254));
          break;
        }
        default: break;
      }
    }
  }
}

}  // namespace dsv4
