#include "model/engram.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <set>
#include <string>

#include "gguf/gguf_file.h"
#include "gguf/gguf_writer.h"
#include "util/numpy_random.h"

namespace dsv4 {
namespace {

// The seed of a layer's multiplier generator in the official engram.py.
constexpr uint64_t kMultiplierSeedFactor = 10007;

uint64_t mul_mod(uint64_t a, uint64_t b, uint64_t m) {
  return static_cast<uint64_t>(static_cast<unsigned __int128>(a) * b % m);
}

uint64_t pow_mod(uint64_t a, uint64_t e, uint64_t m) {
  uint64_t r = 1;
  a %= m;
  for (; e; e >>= 1, a = mul_mod(a, a, m))
    if (e & 1) r = mul_mod(r, a, m);
  return r;
}

// The smallest prime above `after` not in `taken` (engram.py find_next_prime).
uint64_t next_prime(uint64_t after, const std::set<uint64_t>& taken) {
  uint64_t c = after + 1;
  while (!is_prime_u64(c) || taken.contains(c)) ++c;
  return c;
}

std::string arch_key(const ModelConfig& c, std::string_view k) { return fmt::format("{}.{}", c.architecture(), k); }

// A flat per-layer array key as [layers][width].
Result<std::vector<std::vector<uint64_t>>> read_layer_table(const gguf::GgufFile& file, const std::string& key,
                                                            size_t layers, size_t width) {
  DSV4_ASSIGN_OR_RETURN(std::vector<uint64_t> flat, file.get_uint_array(key));
  if (flat.size() != layers * width)
    return Status::errorf("{}: key {}: {} entries, expected {} layers x {}", file.path(), key, flat.size(), layers,
                          width);
  std::vector<std::vector<uint64_t>> out(layers);
  for (size_t l = 0; l < layers; ++l) out[l].assign(flat.begin() + l * width, flat.begin() + (l + 1) * width);
  return out;
}

}  // namespace

bool is_prime_u64(uint64_t n) {
  if (n < 2) return false;
  for (uint64_t p : {2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37})
    if (n % p == 0) return n == p;
  uint64_t d = n - 1;
  int s = 0;
  for (; d % 2 == 0; d /= 2) ++s;
  // These witnesses decide every n < 2^64.
  for (uint64_t a : {2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37}) {
    uint64_t x = pow_mod(a, d, n);
    if (x == 1 || x == n - 1) continue;
    bool composite = true;
    for (int r = 1; r < s && composite; ++r) {
      x = mul_mod(x, x, n);
      composite = x != n - 1;
    }
    if (composite) return false;
  }
  return true;
}

Result<EngramHashConstants> compute_engram_hash_constants(const EngramConfig& e) {
  if (e.ngram < 2 || e.ngram > kMaxEngramNgram || e.heads == 0 || e.heads > kMaxEngramHeads)
    return Status::errorf("engram: max n-gram size {} (2 ... {}) and heads {} (1 ... {})", e.ngram, kMaxEngramNgram,
                          e.heads, kMaxEngramHeads);
  if (e.hash_vocab_size > std::numeric_limits<uint32_t>::max())
    return Status::errorf("engram: engram_vocab_size {} exceeds 2^32 - 1", e.hash_vocab_size);
  if (e.hash_vocab_size == 0)
    return Status::error("engram: engram_vocab_size is unknown (0); the bucket primes start above it");
  if (e.compressed_vocab_size == 0) return Status::error("engram: the compressed vocabulary size is 0");
  EngramHashConstants k;
  k.ngram = e.ngram;
  k.heads = e.heads;
  const int64_t bound = std::max<int64_t>(1, std::numeric_limits<int64_t>::max() / e.compressed_vocab_size / 2);
  std::set<uint64_t> taken;
  for (size_t li = 0; li < e.layers.size(); ++li) {
    std::vector<int64_t> mult = numpy_integers_int64(kMultiplierSeedFactor * e.layers[li], 0, bound, e.ngram);
    for (int64_t& m : mult) m = 2 * m + 1;
    k.multipliers.push_back(std::move(mult));
    std::vector<uint64_t> primes, offsets;
    uint64_t sum = 0;
    for (uint32_t n = 2; n <= e.ngram; ++n) {
      uint64_t current = e.hash_vocab_size - 1;
      for (uint32_t h = 0; h < e.heads; ++h) {
        current = next_prime(current, taken);
        taken.insert(current);
        primes.push_back(current);
        offsets.push_back(sum);
        sum += current;
      }
    }
    if (li < e.table_rows.size() && e.table_rows[li] != sum)
      return Status::errorf("engram: layer {}: its {} bucket primes sum to {} rows, the config says {} "
                            "(engram_num_embeddings)", e.layers[li], primes.size(), sum, e.table_rows[li]);
    k.primes.push_back(std::move(primes));
    k.offsets.push_back(std::move(offsets));
  }
  return k;
}

Result<EngramHasher> EngramHasher::create(const EngramConfig& e, EngramHashConstants k, std::vector<int32_t> map) {
  if (k.ngram != e.ngram || k.heads != e.heads || k.primes.size() != e.layers.size() ||
      k.offsets.size() != e.layers.size() || k.multipliers.size() != e.layers.size())
    return Status::errorf("engram: hash constants for {} layers of n-gram {} x {} heads, the config has {} layers "
                          "of {} x {}", k.primes.size(), k.ngram, k.heads, e.layers.size(), e.ngram, e.heads);
  if (k.ngram < 2 || k.ngram > kMaxEngramNgram)
    return Status::errorf("engram: max n-gram size {} outside 2 ... {}", k.ngram, kMaxEngramNgram);
  for (size_t l = 0; l < e.layers.size(); ++l) {
    if (k.multipliers[l].size() != k.ngram || k.primes[l].size() != k.columns() || k.offsets[l].size() != k.columns())
      return Status::errorf("engram: layer {}: {} multipliers, {} primes, {} offsets; expected {}, {}, {}",
                            e.layers[l], k.multipliers[l].size(), k.primes[l].size(), k.offsets[l].size(), k.ngram,
                            k.columns(), k.columns());
    uint64_t sum = 0;
    for (size_t c = 0; c < k.columns(); ++c) {
      if (k.primes[l][c] == 0 || k.primes[l][c] > std::numeric_limits<uint32_t>::max())
        return Status::errorf("engram: layer {} column {}: bucket size {} outside 1 ... 2^32-1", e.layers[l], c,
                              k.primes[l][c]);
      if (k.offsets[l][c] != sum)
        return Status::errorf("engram: layer {} column {}: offset {}, expected the prefix sum {}", e.layers[l], c,
                              k.offsets[l][c], sum);
      sum += k.primes[l][c];
    }
    if (l < e.table_rows.size() && sum != e.table_rows[l])
      return Status::errorf("engram: layer {}: buckets cover {} rows, the table has {}", e.layers[l], sum,
                            e.table_rows[l]);
  }
  if (map.empty()) return Status::error("engram: the compressed token map is empty");
  for (size_t i = 0; i < map.size(); ++i)
    if (map[i] < 0 || static_cast<uint32_t>(map[i]) >= e.compressed_vocab_size)
      return Status::errorf("engram: token {} maps to compressed id {}, outside [0, {})", i, map[i],
                            e.compressed_vocab_size);
  if (e.pad_token_id >= map.size())
    return Status::errorf("engram: pad token {} is outside the token map of {} entries", e.pad_token_id, map.size());
  EngramHasher h;
  h.pad_ = map[e.pad_token_id];
  h.constants_ = std::move(k);
  h.token_map_ = std::move(map);
  return h;
}

Result<EngramHasher> EngramHasher::from_gguf(const gguf::GgufFile& file, const ModelConfig& c) {
  if (!c.engram) return Status::errorf("{}: the model has no Engram layers", file.path());
  const EngramConfig& e = *c.engram;
  const std::string map_key = arch_key(c, "engram.token_map");
  if (!file.find(map_key)) return Status::errorf("{}: key {} is missing (the compressed token map)", file.path(), map_key);
  DSV4_ASSIGN_OR_RETURN(std::vector<uint64_t> map64, file.get_uint_array(map_key));
  if (map64.size() != c.vocab_size)
    return Status::errorf("{}: key {}: {} entries, the vocabulary has {}", file.path(), map_key, map64.size(),
                          c.vocab_size);
  std::vector<int32_t> map(map64.size());
  for (size_t i = 0; i < map.size(); ++i) {
    if (map64[i] >= e.compressed_vocab_size)
      return Status::errorf("{}: key {}: token {} maps to {}, outside the compressed vocabulary of {}", file.path(),
                            map_key, i, map64[i], e.compressed_vocab_size);
    map[i] = static_cast<int32_t>(map64[i]);
  }

  const std::string mult_key = arch_key(c, "engram.multipliers"), prime_key = arch_key(c, "engram.primes"),
                    offset_key = arch_key(c, "engram.offsets");
  std::optional<EngramHashConstants> computed;
  if (e.hash_vocab_size != 0) {
    auto k = compute_engram_hash_constants(e);
    if (!k) return k.status().with_context(file.path());
    computed = std::move(*k);
  }
  EngramHashConstants k;
  k.ngram = e.ngram;
  k.heads = e.heads;
  const size_t layers = e.layers.size();
  if (file.find(prime_key)) {
    DSV4_ASSIGN_OR_RETURN(k.primes, read_layer_table(file, prime_key, layers, e.columns()));
    if (file.find(offset_key)) {
      DSV4_ASSIGN_OR_RETURN(k.offsets, read_layer_table(file, offset_key, layers, e.columns()));
    } else {
      for (const auto& primes : k.primes) {
        std::vector<uint64_t> off;
        uint64_t sum = 0;
        for (uint64_t p : primes) off.push_back(std::exchange(sum, sum + p));
        k.offsets.push_back(std::move(off));
      }
    }
  } else if (computed) {
    k.primes = computed->primes;
    k.offsets = computed->offsets;
  } else {
    return Status::errorf("{}: neither key {} nor {} (to derive it) is present", file.path(), prime_key,
                          arch_key(c, "engram.vocab_size"));
  }
  if (file.find(mult_key)) {
    const gguf::Value* v = file.find(mult_key);
    if (!v->is_array() || v->as_array().size() != layers * e.ngram)
      return Status::errorf("{}: key {}: expected an array of {} layers x {} integers", file.path(), mult_key, layers,
                            e.ngram);
    k.multipliers.assign(layers, {});
    for (size_t i = 0; i < layers * e.ngram; ++i) {
      const gguf::Value& x = v->as_array()[i];
      if (!x.is_integer())
        return Status::errorf("{}: key {}: entry {} is not an integer", file.path(), mult_key, i);
      const bool is_signed = x.type() == gguf::ValueType::INT8 || x.type() == gguf::ValueType::INT16 ||
                             x.type() == gguf::ValueType::INT32 || x.type() == gguf::ValueType::INT64;
      k.multipliers[i / e.ngram].push_back(is_signed ? x.as_i64() : static_cast<int64_t>(x.as_u64()));
    }
  } else {
    // The multipliers depend on the layer ids and the compressed vocabulary only.
    EngramConfig seeds = e;
    if (seeds.hash_vocab_size == 0) seeds.hash_vocab_size = 2;  // primes unused here
    seeds.table_rows.clear();
    DSV4_ASSIGN_OR_RETURN(EngramHashConstants m, compute_engram_hash_constants(seeds));
    k.multipliers = std::move(m.multipliers);
  }
  if (computed) {
    if (k.primes != computed->primes || k.offsets != computed->offsets)
      return Status::errorf("{}: key {} / {}: the stored buckets differ from the official derivation for "
                            "engram.vocab_size {}", file.path(), prime_key, offset_key, e.hash_vocab_size);
    if (k.multipliers != computed->multipliers)
      return Status::errorf("{}: key {}: the stored multipliers differ from numpy default_rng(10007 * layer) for "
                            "a compressed vocabulary of {}", file.path(), mult_key, e.compressed_vocab_size);
  }
  auto hasher = create(e, std::move(k), std::move(map));
  if (!hasher) return hasher.status().with_context(file.path());
  return hasher;
}

EngramHasher::History EngramHasher::start() const {
  History h;
  h.tail.fill(kDead);
  return h;
}

Status EngramHasher::hash(History& history, std::span<const int32_t> tokens, std::span<const uint8_t> live,
                          std::span<uint32_t> rows) const {
  const uint32_t ngram = constants_.ngram, heads = constants_.heads, cols = columns();
  if (rows.size() != tokens.size() * rows_per_token())
    return Status::errorf("engram hash: {} row slots for {} tokens, expected {}", rows.size(), tokens.size(),
                          tokens.size() * rows_per_token());
  if (!live.empty() && live.size() != tokens.size())
    return Status::errorf("engram hash: {} live flags for {} tokens", live.size(), tokens.size());
  for (size_t t = 0; t < tokens.size(); ++t) {
    const int32_t token = tokens[t];
    if (token < 0 || static_cast<size_t>(token) >= token_map_.size())
      return Status::errorf("engram hash: token {} at position {} is outside the vocabulary of {}", token, t,
                            token_map_.size());
    const int64_t current = live.empty() || live[t] ? token_map_[token] : kDead;
    // c[0] is this position, c[j] the one j back; blocked slots (and all older) are pad.
    std::array<int64_t, kMaxEngramNgram> c{};
    bool blocked = false;
    for (uint32_t j = 0; j < ngram; ++j) {
      const int64_t id = j == 0 ? current : history.tail[j - 1];
      blocked = blocked || id == kDead;
      c[j] = blocked ? pad_ : id;
    }
    uint32_t* out = rows.data() + t * rows_per_token();
    for (size_t l = 0; l < constants_.primes.size(); ++l) {
      const auto& m = constants_.multipliers[l];
      // int64 products wrap as the reference's torch int64 arithmetic does.
      auto product = [&](uint32_t j) { return static_cast<int64_t>(static_cast<uint64_t>(m[j]) * static_cast<uint64_t>(c[j])); };
      int64_t rolling = product(0);
      for (uint32_t j = 1; j < ngram; ++j) {
        rolling ^= product(j);
        for (uint32_t h = 0; h < heads; ++h) {
          const size_t col = (j - 1) * heads + h;
          const int64_t p = static_cast<int64_t>(constants_.primes[l][col]);
          const int64_t r = ((rolling % p) + p) % p;  // non-negative remainder
          out[l * cols + col] = static_cast<uint32_t>(static_cast<uint64_t>(r) + constants_.offsets[l][col]);
        }
      }
    }
    for (uint32_t j = ngram - 1; j-- > 1;) history.tail[j] = history.tail[j - 1];
    history.tail[0] = current;
  }
  return Status::ok();
}

void write_engram_hash_metadata(gguf::GgufWriter& w, const ModelConfig& c, const EngramHasher& hasher) {
  using gguf::Value;
  w.set(arch_key(c, "engram.token_map"), Value::array_i32(hasher.token_map()));
  const EngramHashConstants& k = hasher.constants();
  Value::Array mult, primes, offsets;
  for (size_t l = 0; l < k.primes.size(); ++l) {
    for (int64_t m : k.multipliers[l]) mult.push_back(Value::i64(m));
    for (uint64_t p : k.primes[l]) primes.push_back(Value::u32(static_cast<uint32_t>(p)));
    for (uint64_t o : k.offsets[l]) offsets.push_back(Value::u32(static_cast<uint32_t>(o)));
  }
  w.set(arch_key(c, "engram.multipliers"), Value::array(gguf::ValueType::INT64, std::move(mult)));
  w.set(arch_key(c, "engram.primes"), Value::array(gguf::ValueType::UINT32, std::move(primes)));
  w.set(arch_key(c, "engram.offsets"), Value::array(gguf::ValueType::UINT32, std::move(offsets)));
}

}  // namespace dsv4
