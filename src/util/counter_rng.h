// Counter-based random numbers: the n-th value is a pure function of (key, n), so data drawn
// in parallel pieces is the same whatever the thread count or the piece boundaries (the
// synthetic models, the benchmark caches). SplitMix64's output function (Steele, Lea and
// Flood 2014), which passes BigCrush on consecutive counters.
#pragma once

#include <cstdint>
#include <string_view>

namespace dsv4 {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// A key for a pair (e.g. a tensor key and a row).
inline uint64_t mix_keys(uint64_t a, uint64_t b) { return splitmix64(a ^ splitmix64(b)); }

// FNV-1a of a name (tensor names as keys).
inline uint64_t hash_name(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

// A uniform double in [0, 1) from 53 bits of x.
inline double unit_double(uint64_t x) { return static_cast<double>(x >> 11) * 0x1.0p-53; }

}  // namespace dsv4
