// V4.1 Engram front end (shared/spec/deepseek-v41.md §3.2; DeepSeek's inference/engram.py):
// the hash constants of each Engram layer and the per-sequence n-gram hash that turns a
// token stream into table row ids. Pure CPU, no backend: the rows depend on token ids
// only, so a step's rows are known (and can be read, model/engram_table.h) before its
// first layer runs.
//
// Constants, per Engram layer L (layers in EngramConfig order):
//   multipliers  ngram odd 64-bit values 2v+1, v = numpy.random.default_rng(10007*L)
//                .integers(0, bound), bound = (INT64_MAX / compressed_vocab) / 2
//   primes       (ngram-1)*heads bucket sizes, column order "n-gram size 2 heads 0..h-1,
//                size 3 heads ..., ...": for each (layer, size) the search restarts at
//                hash_vocab_size - 1 and takes the next `heads` primes not handed out
//                before (to any layer or size)
//   offsets      exclusive prefix sums of the layer's primes; table rows = their sum
// Hash of position t: c_j = compressed id at t-j (j = 0..ngram-1), the pad id once the
// look-back passes the sequence start or a dead position (sticky toward the past);
// r_1 = m0*c0 ^ m1*c1, r_j = r_{j-1} ^ m_j*c_j (int64 wrapping); column (size j+1, head h)
// = (r_j mod p) + offset, with the non-negative remainder.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "model/config.h"
#include "util/status.h"

namespace dsv4 {
namespace gguf { class GgufFile; class GgufWriter; }

struct EngramHashConstants {
  uint32_t ngram = 0, heads = 0;
  std::vector<std::vector<int64_t>> multipliers;  // [layer][ngram]
  std::vector<std::vector<uint64_t>> primes;      // [layer][columns]
  std::vector<std::vector<uint64_t>> offsets;     // [layer][columns]

  uint32_t columns() const { return (ngram - 1) * heads; }
  bool operator==(const EngramHashConstants&) const = default;
};

// The official constants of `engram` (needs hash_vocab_size and compressed_vocab_size);
// an error when a prime sum differs from the configured table rows.
Result<EngramHashConstants> compute_engram_hash_constants(const EngramConfig& engram);

// Deterministic Miller-Rabin for 64-bit values (exported for tests).
bool is_prime_u64(uint64_t n);

class EngramHasher {
 public:
  static constexpr int64_t kDead = -1;

  // The compressed ids of a sequence's last ngram-1 positions, newest first (kDead where
  // the look-back is blocked). A plain value: copying it snapshots the hash state.
  struct History {
    std::array<int64_t, kMaxEngramNgram - 1> tail{};
    bool operator==(const History&) const = default;
  };

  // `token_map` has one compressed id per vocabulary entry; validated against `engram`.
  static Result<EngramHasher> create(const EngramConfig& engram, EngramHashConstants constants,
                                     std::vector<int32_t> token_map);
  // From a deepseek41 file's engram.token_map / multipliers / primes / offsets; constants
  // the file lacks are computed, and stored ones must equal the official derivation when
  // the file gives engram.vocab_size. Errors name the file and the key.
  static Result<EngramHasher> from_gguf(const gguf::GgufFile& file, const ModelConfig& config);

  History start() const;  // a new sequence: everything before position 0 is blocked

  uint32_t n_layers() const { return static_cast<uint32_t>(constants_.primes.size()); }
  uint32_t columns() const { return constants_.columns(); }
  uint32_t rows_per_token() const { return n_layers() * columns(); }  // 48 for V4.1-Flash
  const EngramHashConstants& constants() const { return constants_; }
  const std::vector<int32_t>& token_map() const { return token_map_; }
  int64_t pad_id() const { return pad_; }

  // Row ids of `tokens`, which follow `history` in their sequence; advances `history`.
  // `live` (empty: all live) marks with 0 the dead positions (an image span): they hash as
  // pad and block every n-gram across them. `rows` holds tokens.size() * rows_per_token()
  // ids, laid out [token][layer][column]. Fails on a token outside the vocabulary.
  Status hash(History& history, std::span<const int32_t> tokens, std::span<const uint8_t> live,
              std::span<uint32_t> rows) const;

 private:
  EngramHasher() = default;
  EngramHashConstants constants_;
  std::vector<int32_t> token_map_;
  int64_t pad_ = 0;
};

// Writes engram.token_map (i32), engram.multipliers (i64, [layers * ngram]),
// engram.primes and engram.offsets (u32, [layers * columns]) under `<arch>.`.
void write_engram_hash_metadata(gguf::GgufWriter& writer, const ModelConfig& config,
                                const EngramHasher& hasher);

}  // namespace dsv4
