#include "util/numpy_random.h"

namespace dsv4 {
namespace {

// SeedSequence constants (bit_generator.pyx).
constexpr uint32_t kInitA = 0x43b0d7e5, kMultA = 0x931e8875;
constexpr uint32_t kInitB = 0x8b51f9dd, kMultB = 0x58f38ded;
constexpr uint32_t kMixMultL = 0xca01f9dd, kMixMultR = 0x4973f715;
constexpr int kXShift = 16;

uint32_t hashmix(uint32_t value, uint32_t& hash_const) {
  value ^= hash_const;
  hash_const *= kMultA;
  value *= hash_const;
  value ^= value >> kXShift;
  return value;
}

uint32_t mix(uint32_t x, uint32_t y) {
  uint32_t result = kMixMultL * x - kMixMultR * y;
  result ^= result >> kXShift;
  return result;
}

// PCG_DEFAULT_MULTIPLIER_128.
constexpr unsigned __int128 kPcgMultiplier =
    (static_cast<unsigned __int128>(0x2360ed051fc65da4ULL) << 64) | 0x4385df649fccf645ULL;

}  // namespace

NumpySeedSequence::NumpySeedSequence(uint64_t entropy) {
  // _coerce_to_uint32_array: the integer's 32-bit words, least significant first.
  uint32_t words[2] = {static_cast<uint32_t>(entropy), static_cast<uint32_t>(entropy >> 32)};
  const size_t n_words = (entropy >> 32) != 0 ? 2 : 1;
  uint32_t hash_const = kInitA;
  for (size_t i = 0; i < 4; ++i) pool_[i] = hashmix(i < n_words ? words[i] : 0, hash_const);
  for (size_t src = 0; src < 4; ++src)
    for (size_t dst = 0; dst < 4; ++dst)
      if (src != dst) pool_[dst] = mix(pool_[dst], hashmix(pool_[src], hash_const));
}

std::vector<uint32_t> NumpySeedSequence::generate_state32(size_t n_words) const {
  std::vector<uint32_t> out(n_words);
  uint32_t hash_const = kInitB;
  for (size_t i = 0; i < n_words; ++i) {
    uint32_t v = pool_[i % 4];
    v ^= hash_const;
    hash_const *= kMultB;
    v *= hash_const;
    v ^= v >> kXShift;
    out[i] = v;
  }
  return out;
}

std::vector<uint64_t> NumpySeedSequence::generate_state64(size_t n_words) const {
  const std::vector<uint32_t> w = generate_state32(2 * n_words);
  std::vector<uint64_t> out(n_words);
  for (size_t i = 0; i < n_words; ++i) out[i] = w[2 * i] | (static_cast<uint64_t>(w[2 * i + 1]) << 32);
  return out;
}

NumpyPcg64::NumpyPcg64(const NumpySeedSequence& seed) {
  const std::vector<uint64_t> s = seed.generate_state64(4);
  const unsigned __int128 initstate = (static_cast<unsigned __int128>(s[0]) << 64) | s[1];
  const unsigned __int128 initseq = (static_cast<unsigned __int128>(s[2]) << 64) | s[3];
  // pcg_setseq_128_srandom_r
  state_ = 0;
  inc_ = (initseq << 1) | 1;
  state_ = state_ * kPcgMultiplier + inc_;
  state_ += initstate;
  state_ = state_ * kPcgMultiplier + inc_;
}

uint64_t NumpyPcg64::next_u64() {
  state_ = state_ * kPcgMultiplier + inc_;
  // XSL-RR: xor the halves, rotate right by the top 6 bits.
  const uint64_t x = static_cast<uint64_t>(state_ >> 64) ^ static_cast<uint64_t>(state_);
  const unsigned rot = static_cast<unsigned>(state_ >> 122);
  return (x >> rot) | (x << ((64 - rot) & 63));
}

uint32_t NumpyPcg64::next_u32() {
  if (has_u32_) {
    has_u32_ = false;
    return u32_;
  }
  const uint64_t next = next_u64();
  has_u32_ = true;
  u32_ = static_cast<uint32_t>(next >> 32);
  return static_cast<uint32_t>(next);
}

std::vector<int64_t> numpy_integers_int64(uint64_t seed, int64_t low, int64_t high, size_t n) {
  NumpyPcg64 gen{NumpySeedSequence(seed)};
  const uint64_t rng = static_cast<uint64_t>(high) - static_cast<uint64_t>(low) - 1;  // inclusive range
  std::vector<int64_t> out(n);
  for (size_t i = 0; i < n; ++i) {
    uint64_t v;
    if (rng == 0) {
      v = 0;
    } else if (rng <= 0xFFFFFFFFULL) {
      if (rng == 0xFFFFFFFFULL) {
        v = gen.next_u32();
      } else {  // buffered_bounded_lemire_uint32
        const uint32_t excl = static_cast<uint32_t>(rng) + 1;
        uint64_t m = static_cast<uint64_t>(gen.next_u32()) * excl;
        uint32_t leftover = static_cast<uint32_t>(m);
        if (leftover < excl) {
          const uint32_t threshold = (UINT32_MAX - static_cast<uint32_t>(rng)) % excl;
          while (leftover < threshold) {
            m = static_cast<uint64_t>(gen.next_u32()) * excl;
            leftover = static_cast<uint32_t>(m);
          }
        }
        v = m >> 32;
      }
    } else if (rng == UINT64_MAX) {
      v = gen.next_u64();
    } else {  // bounded_lemire_uint64
      const uint64_t excl = rng + 1;
      unsigned __int128 m = static_cast<unsigned __int128>(gen.next_u64()) * excl;
      uint64_t leftover = static_cast<uint64_t>(m);
      if (leftover < excl) {
        const uint64_t threshold = (UINT64_MAX - rng) % excl;
        while (leftover < threshold) {
          m = static_cast<unsigned __int128>(gen.next_u64()) * excl;
          leftover = static_cast<uint64_t>(m);
        }
      }
      v = static_cast<uint64_t>(m >> 64);
    }
    out[i] = static_cast<int64_t>(static_cast<uint64_t>(low) + v);
  }
  return out;
}

}  // namespace dsv4
