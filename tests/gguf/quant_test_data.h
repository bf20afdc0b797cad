// Random rows of every quantised type for the quant tests: random bytes everywhere except
// the scale fields, which get sane values (fp16 scales of either sign around 1e-2..1, MXFP4
// exponents near 127) so the decoded values are finite and every other field is exercised.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gguf/ggml_types.h"
#include "gguf/quant_blocks.h"
#include "util/float_formats.h"

namespace dsv4::test {

inline uint16_t random_scale_fp16(std::mt19937_64& rng) {
  std::uniform_real_distribution<float> mag(-7.0f, 0.0f);  // log2 of the magnitude
  const float v = std::exp2(mag(rng));
  return f32_to_fp16((rng() & 1) ? -v : v);
}

template <typename Block, typename Fix>
void fix_blocks(std::vector<uint8_t>& bytes, Fix&& fix) {
  for (size_t off = 0; off + sizeof(Block) <= bytes.size(); off += sizeof(Block)) {
    Block b;
    std::memcpy(&b, bytes.data() + off, sizeof b);
    fix(b);
    std::memcpy(bytes.data() + off, &b, sizeof b);
  }
}

// Puts an fp16 scale into an IQ1_M block: nibble k of `d` is the top nibble of scale word k.
inline void set_iq1_m_scale(block_iq1_m& b, uint16_t d) {
  for (int k = 0; k < 4; ++k) b.scales[2 * k + 1] = static_cast<uint8_t>((b.scales[2 * k + 1] & 0x0F) | (((d >> (4 * k)) & 0xF) << 4));
}

// Bytes of one row of `n` elements of `type` (n a multiple of the block size).
inline std::vector<uint8_t> random_row_bytes(GgmlType type, int64_t n, std::mt19937_64& rng) {
  std::vector<uint8_t> bytes(*ggml_row_bytes(type, static_cast<uint64_t>(n)));
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  switch (type) {
    case GgmlType::F32:
      for (int64_t i = 0; i < n; ++i) {
        const float v = normal(rng);
        std::memcpy(bytes.data() + 4 * i, &v, 4);
      }
      break;
    case GgmlType::F16:
    case GgmlType::BF16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = type == GgmlType::F16 ? f32_to_fp16(normal(rng)) : f32_to_bf16(normal(rng));
        std::memcpy(bytes.data() + 2 * i, &h, 2);
      }
      break;
    case GgmlType::I32:
      for (int64_t i = 0; i < n; ++i) {
        const int32_t v = static_cast<int32_t>(rng() % 2000001) - 1000000;
        std::memcpy(bytes.data() + 4 * i, &v, 4);
      }
      break;
    case GgmlType::Q8_0: fix_blocks<block_q8_0>(bytes, [&](block_q8_0& b) { b.d = random_scale_fp16(rng); }); break;
    case GgmlType::Q2_K:
      fix_blocks<block_q2_K>(bytes, [&](block_q2_K& b) {
        b.d = random_scale_fp16(rng);
        b.dmin = random_scale_fp16(rng);
      });
      break;
    case GgmlType::Q3_K: fix_blocks<block_q3_K>(bytes, [&](block_q3_K& b) { b.d = random_scale_fp16(rng); }); break;
    case GgmlType::Q4_K:
      fix_blocks<block_q4_K>(bytes, [&](block_q4_K& b) {
        b.d = random_scale_fp16(rng);
        b.dmin = random_scale_fp16(rng);
      });
      break;
    case GgmlType::Q5_K:
      fix_blocks<block_q5_K>(bytes, [&](block_q5_K& b) {
        b.d = random_scale_fp16(rng);
        b.dmin = random_scale_fp16(rng);
      });
      break;
    case GgmlType::Q6_K: fix_blocks<block_q6_K>(bytes, [&](block_q6_K& b) { b.d = random_scale_fp16(rng); }); break;
    case GgmlType::IQ2_XXS:
      fix_blocks<block_iq2_xxs>(bytes, [&](block_iq2_xxs& b) { b.d = random_scale_fp16(rng); });
      break;
    case GgmlType::Q4_0: fix_blocks<block_q4_0>(bytes, [&](block_q4_0& b) { b.d = random_scale_fp16(rng); }); break;
    case GgmlType::Q5_0: fix_blocks<block_q5_0>(bytes, [&](block_q5_0& b) { b.d = random_scale_fp16(rng); }); break;
    case GgmlType::Q4_1:
      fix_blocks<block_q4_1>(bytes, [&](block_q4_1& b) {
        b.d = random_scale_fp16(rng);
        b.m = random_scale_fp16(rng);
      });
      break;
    case GgmlType::Q5_1:
      fix_blocks<block_q5_1>(bytes, [&](block_q5_1& b) {
        b.d = random_scale_fp16(rng);
        b.m = random_scale_fp16(rng);
      });
      break;
    case GgmlType::IQ4_NL:
      fix_blocks<block_iq4_nl>(bytes, [&](block_iq4_nl& b) { b.d = random_scale_fp16(rng); });
      break;
    case GgmlType::IQ4_XS:
      fix_blocks<block_iq4_xs>(bytes, [&](block_iq4_xs& b) { b.d = random_scale_fp16(rng); });
      break;
    case GgmlType::IQ2_XS:
      fix_blocks<block_iq2_xs>(bytes, [&](block_iq2_xs& b) { b.d = random_scale_fp16(rng); });
      break;
    case GgmlType::IQ2_S: fix_blocks<block_iq2_s>(bytes, [&](block_iq2_s& b) { b.d = random_scale_fp16(rng); }); break;
    case GgmlType::IQ3_XXS:
      fix_blocks<block_iq3_xxs>(bytes, [&](block_iq3_xxs& b) { b.d = random_scale_fp16(rng); });
      break;
    case GgmlType::IQ3_S: fix_blocks<block_iq3_s>(bytes, [&](block_iq3_s& b) { b.d = random_scale_fp16(rng); }); break;
    case GgmlType::IQ1_S: fix_blocks<block_iq1_s>(bytes, [&](block_iq1_s& b) { b.d = random_scale_fp16(rng); }); break;
    case GgmlType::IQ1_M:
      // The fp16 scale lives in the top nibbles of the four scale words.
      fix_blocks<block_iq1_m>(bytes, [&](block_iq1_m& b) { set_iq1_m_scale(b, random_scale_fp16(rng)); });
      break;
    case GgmlType::MXFP4:
      fix_blocks<block_mxfp4>(bytes, [&](block_mxfp4& b) { b.e = static_cast<uint8_t>(112 + rng() % 30); });
      break;
    default: break;
  }
  return bytes;
}

// Every type dsv4 decodes.
inline const std::vector<GgmlType>& decodable_types() {
  static const std::vector<GgmlType> types = {
      GgmlType::F32,    GgmlType::F16,    GgmlType::BF16,   GgmlType::I32,   GgmlType::Q8_0,   GgmlType::Q2_K,
      GgmlType::Q3_K,   GgmlType::Q4_K,   GgmlType::Q5_K,   GgmlType::Q6_K,  GgmlType::IQ2_XXS, GgmlType::MXFP4,
      GgmlType::Q4_0,   GgmlType::Q4_1,   GgmlType::Q5_0,   GgmlType::Q5_1,  GgmlType::IQ4_NL, GgmlType::IQ4_XS,
      GgmlType::IQ2_XS, GgmlType::IQ2_S,  GgmlType::IQ3_XXS, GgmlType::IQ3_S, GgmlType::IQ1_S,  GgmlType::IQ1_M};
  return types;
}

}  // namespace dsv4::test
