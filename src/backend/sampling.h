// The arithmetic of Backend::sample shared by the CPU and CUDA backends (host and device
// code): the per-row parameter layout, Philox4x32-10 noise keyed by (seed, counter, token),
// and the total order on candidates (higher logit first, lower id on ties).
//
// The draw uses the Gumbel-max rule: argmax_i (z_i + g_i) with g_i = -log(-log(u_i)) and
// independent uniforms u_i is distributed exactly as softmax(z) over the candidates, needs
// no sort, and runs in parallel; truncations (top-k, top-p, min-p) only decide which
// candidates take part. Keying the noise by (seed, counter, token) makes a draw a pure
// function of the logits and its key, whichever backend computes it.
#pragma once

#include <cmath>
#include <cstdint>

#include "util/float_formats.h"

namespace dsv4::backend {

// Columns of the I32 [rows, kSampleFields] parameter tensor (floats stored as their bits).
enum SampleField : int {
  kSampleTemperature = 0,  // f32; 0 = greedy
  kSampleTopP = 1,         // f32 in (0, 1]; 1 = off
  kSampleMinP = 2,         // f32 in [0, 1]; 0 = off
  kSampleTopK = 3,         // i32; 0 = off
  kSampleSeedLo = 4,
  kSampleSeedHi = 5,
  kSampleCounterLo = 6,    // which draw of the sequence (e.g. its position)
  kSampleCounterHi = 7,
  kSampleFields = 8,
};

// Columns of the I32 [m, kAdjustFields] logit-adjustment tensor.
enum AdjustField : int {
  kAdjustRow = 0,
  kAdjustToken = 1,
  kAdjustRepetition = 2,  // f32: x > 0 ? x / r : x * r (1 = off)
  kAdjustSubtract = 3,    // f32: then x -= s (presence/frequency penalties, minus a logit bias)
  kAdjustFields = 4,
};

struct Philox4x32 {
  uint32_t v[4];
};

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011).
DSV4_HOST_DEVICE inline Philox4x32 philox4x32(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                              uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t{kM0} * c0, p1 = uint64_t{kM1} * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return {{c0, c1, c2, c3}};
}

// A uniform double in (0, 1) for (seed, counter, token): 53 random bits, never 0 or 1.
DSV4_HOST_DEVICE inline double sample_uniform(uint64_t seed, uint64_t counter, uint32_t token) {
  const Philox4x32 r = philox4x32(token, static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), 0x5A17u,
                                  static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  const uint64_t bits = (uint64_t{r.v[0]} << 21) ^ (uint64_t{r.v[1]} >> 11);  // 53 bits
  return (static_cast<double>(bits & ((uint64_t{1} << 53) - 1)) + 0.5) * 0x1.0p-53;
}

// Gumbel noise for the draw.
DSV4_HOST_DEVICE inline double gumbel(uint64_t seed, uint64_t counter, uint32_t token) {
  return -log(-log(sample_uniform(seed, counter, token)));
}

// A key that orders candidates: larger key = higher logit, lower id on equal logits.
// Distinct for distinct ids, so "the k largest keys" is exactly k candidates.
DSV4_HOST_DEVICE inline uint64_t candidate_key(float z, uint32_t id) {
  uint32_t b = f32_to_bits(z);
  b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);  // monotonic in z
  return (uint64_t{b} << 32) | (0xFFFFFFFFu - id);
}

// A candidate's softmax weight exp(z - z_max) in fixed point (2^-40 units): top-p sums
// these integers, so the sum, and the cut, do not depend on the order of addition.
DSV4_HOST_DEVICE inline uint64_t fixed_weight(double z_minus_max) {
  return static_cast<uint64_t>(exp(z_minus_max) * 0x1.0p40 + 0.5);
}
// top-p keeps the shortest prefix whose fixed weight reaches this target.
DSV4_HOST_DEVICE inline uint64_t top_p_target(float top_p, uint64_t total) {
  return static_cast<uint64_t>(static_cast<double>(top_p) * static_cast<double>(total));
}

DSV4_HOST_DEVICE inline float f32_field(const int32_t* row, int field) {
  return f32_from_bits(static_cast<uint32_t>(row[field]));
}
DSV4_HOST_DEVICE inline uint64_t u64_fields(const int32_t* row, int lo) {
  return uint64_t{static_cast<uint32_t>(row[lo])} | (uint64_t{static_cast<uint32_t>(row[lo + 1])} << 32);
}

}  // namespace dsv4::backend
