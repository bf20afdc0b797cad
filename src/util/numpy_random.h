// NumPy's default random generator, bit for bit: `numpy.random.default_rng(seed)` is a
// PCG64 (XSL-RR 128/64) bit generator seeded through SeedSequence, and
// `Generator.integers(low, high, dtype=int64)` draws with Lemire's bounded method. V4.1's
// Engram hash multipliers are drawn this way (`default_rng(10007 * layer)`), so an engine
// must reproduce them exactly. Sources: numpy/random/bit_generator.pyx (SeedSequence),
// _pcg64.pyx + pcg64.h (seeding, output), distributions.c (random_bounded_uint64_fill).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace dsv4 {

// SeedSequence(entropy) with no spawn key: the 4-word pool, and generate_state().
class NumpySeedSequence {
 public:
  explicit NumpySeedSequence(uint64_t entropy);
  std::vector<uint32_t> generate_state32(size_t n_words) const;
  std::vector<uint64_t> generate_state64(size_t n_words) const;  // little-endian word pairs

 private:
  uint32_t pool_[4];
};

// PCG64 as numpy seeds it from a SeedSequence, with numpy's 32-bit output buffering.
class NumpyPcg64 {
 public:
  explicit NumpyPcg64(const NumpySeedSequence& seed);
  uint64_t next_u64();
  uint32_t next_u32();

 private:
  unsigned __int128 state_ = 0, inc_ = 0;
  bool has_u32_ = false;
  uint32_t u32_ = 0;
};

// numpy.random.default_rng(seed).integers(low, high, size=n, dtype=np.int64), high > low.
std::vector<int64_t> numpy_integers_int64(uint64_t seed, int64_t low, int64_t high, size_t n);

}  // namespace dsv4
