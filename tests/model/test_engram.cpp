// Engram front end against the official constants (shared/fixtures/engram-token-map):
// multipliers, bucket primes and offsets of V4.1-Flash, the hash ids of the test vector in
// one call and across a prefill/decode split, the sticky blocking at dead positions
// against a direct transcription of the official NgramHashState, and the row format.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "model/engram.h"
#include "model/engram_table.h"
#include "support/test_support.h"
#include "synth/presets.h"
#include "text/builtin_tokenizer.h"
#include "text/engram_vocab.h"
#include "util/float_formats.h"

namespace dsv4 {
namespace {

nlohmann::json official_constants() {
  std::ifstream in(test::shared_dir() / "fixtures/engram-token-map/engram_hash_constants.json");
  return nlohmann::json::parse(in);
}

EngramHasher make_flash_hasher() {
  const ModelConfig c = flash41_config();
  auto vocab = text::parse_tokenizer_json(text::builtin_tokenizer_json(), "built-in");
  EXPECT_TRUE(vocab.is_ok());
  auto map = text::compressed_token_map(*vocab);
  EXPECT_TRUE(map.is_ok());
  auto k = compute_engram_hash_constants(*c.engram);
  EXPECT_TRUE(k.is_ok()) << k.status().message();
  auto h = EngramHasher::create(*c.engram, std::move(*k), std::move(map->token_map));
  EXPECT_TRUE(h.is_ok()) << h.status().message();
  return std::move(*h);
}

// The compressed map of the 129,280-token vocabulary is built once per process.
const EngramHasher& flash_hasher() {
  static const EngramHasher h = make_flash_hasher();
  return h;
}

TEST(EngramConstantsTest, FlashConstantsEqualTheOfficialOnes) {
  const nlohmann::json want = official_constants();
  const ModelConfig c = flash41_config();
  ASSERT_TRUE(c.engram);
  auto k = compute_engram_hash_constants(*c.engram);
  ASSERT_TRUE(k.is_ok()) << k.status().message();
  ASSERT_EQ(k->primes.size(), want["layers"].size());
  for (size_t l = 0; l < k->primes.size(); ++l) {
    const auto& wl = want["layers"][l];
    EXPECT_EQ(c.engram->layers[l], wl["layer_id"].get<uint32_t>());
    EXPECT_EQ(k->multipliers[l], wl["multipliers"].get<std::vector<int64_t>>()) << "layer " << l;
    EXPECT_EQ(k->primes[l], wl["primes"].get<std::vector<uint64_t>>()) << "layer " << l;
    EXPECT_EQ(k->offsets[l], wl["offsets"].get<std::vector<uint64_t>>()) << "layer " << l;
    EXPECT_EQ(c.engram->table_rows[l], wl["num_embeddings"].get<uint64_t>());
  }
}

TEST(EngramConstantsTest, PrimeSumMustMatchTheTable) {
  EngramConfig e = *flash41_config().engram;
  e.table_rows[1] += 1;
  auto k = compute_engram_hash_constants(e);
  ASSERT_FALSE(k.is_ok());
  EXPECT_NE(k.status().message().find("384016683"), std::string::npos) << k.status().message();
}

TEST(EngramConstantsTest, MillerRabinAgreesWithTrialDivision) {
  std::mt19937_64 rng(test::test_seed());
  auto trial = [](uint64_t n) {
    if (n < 2) return false;
    for (uint64_t d = 2; d * d <= n; ++d)
      if (n % d == 0) return false;
    return true;
  };
  for (uint64_t n = 0; n < 2000; ++n) ASSERT_EQ(is_prime_u64(n), trial(n)) << n;
  for (int i = 0; i < 2000; ++i) {
    const uint64_t n = rng() % 4'000'000'000ULL;
    ASSERT_EQ(is_prime_u64(n), trial(n)) << n;
  }
  EXPECT_TRUE(is_prime_u64(18446744073709551557ULL));  // the largest 64-bit prime
  EXPECT_FALSE(is_prime_u64(3215031751ULL));           // strong pseudoprime to 2, 3, 5, 7
}

TEST(EngramHashTest, TestVectorInOneCallAndSplit) {
  const nlohmann::json tv = official_constants()["test_vector"];
  const EngramHasher& h = flash_hasher();
  const auto tokens = tv["token_ids"].get<std::vector<int32_t>>();
  const auto compressed = tv["compressed_ids"].get<std::vector<int32_t>>();
  for (size_t i = 0; i < tokens.size(); ++i) EXPECT_EQ(h.token_map()[tokens[i]], compressed[i]) << i;
  EXPECT_EQ(h.pad_id(), 2);
  std::vector<uint32_t> want;
  for (const auto& pos : tv["hash_ids"])
    for (const auto& layer : pos)
      for (const auto& id : layer) want.push_back(id.get<uint32_t>());
  ASSERT_EQ(want.size(), tokens.size() * h.rows_per_token());

  std::vector<uint32_t> rows(want.size(), 0xFFFFFFFFu);
  EngramHasher::History hist = h.start();
  ASSERT_TRUE(h.hash(hist, tokens, {}, rows).is_ok());
  EXPECT_EQ(rows, want);

  // 5 tokens, then one token per call: the history carries the look-back.
  std::fill(rows.begin(), rows.end(), 0xFFFFFFFFu);
  hist = h.start();
  const size_t per = h.rows_per_token();
  ASSERT_TRUE(h.hash(hist, std::span(tokens).first(5), {}, std::span(rows).first(5 * per)).is_ok());
  for (size_t t = 5; t < tokens.size(); ++t)
    ASSERT_TRUE(h.hash(hist, std::span(tokens).subspan(t, 1), {}, std::span(rows).subspan(t * per, per)).is_ok());
  EXPECT_EQ(rows, want);
}

// The official NgramHashState.forward, transcribed literally over a whole sequence.
std::vector<uint32_t> official_hash(const EngramHasher& h, const std::vector<int32_t>& tokens,
                                    const std::vector<uint8_t>& live) {
  const auto& k = h.constants();
  std::vector<int64_t> cache(tokens.size());
  for (size_t t = 0; t < tokens.size(); ++t) cache[t] = live[t] ? h.token_map()[tokens[t]] : -1;
  std::vector<uint32_t> out;
  for (size_t t = 0; t < tokens.size(); ++t) {
    std::vector<int64_t> c;
    bool blocked = false;
    for (uint32_t shift = 0; shift < k.ngram; ++shift) {
      const int64_t src = cache[t >= shift ? t - shift : 0];
      blocked = blocked || t < shift || src == -1;
      c.push_back(blocked ? h.pad_id() : src);
    }
    for (size_t l = 0; l < k.primes.size(); ++l) {
      __int128 rolling = static_cast<int64_t>(static_cast<uint64_t>(c[0]) * static_cast<uint64_t>(k.multipliers[l][0]));
      for (uint32_t i = 1; i < k.ngram; ++i) {
        const int64_t prod = static_cast<int64_t>(static_cast<uint64_t>(c[i]) * static_cast<uint64_t>(k.multipliers[l][i]));
        rolling = static_cast<int64_t>(rolling) ^ prod;
        for (uint32_t hd = 0; hd < k.heads; ++hd) {
          const size_t col = (i - 1) * k.heads + hd;
          const __int128 p = static_cast<__int128>(k.primes[l][col]);
          __int128 r = rolling % p;
          if (r < 0) r += p;
          out.push_back(static_cast<uint32_t>(r + static_cast<__int128>(k.offsets[l][col])));
        }
      }
    }
  }
  return out;
}

TEST(EngramHashTest, DeadSpansBlockStickilyAcrossRandomSplits) {
  const EngramHasher& h = flash_hasher();
  std::mt19937_64 rng(test::test_seed());
  for (int trial = 0; trial < 20; ++trial) {
    const size_t n = 1 + rng() % 60;
    std::vector<int32_t> tokens(n);
    std::vector<uint8_t> live(n);
    for (size_t i = 0; i < n; ++i) {
      tokens[i] = static_cast<int32_t>(rng() % 129280);
      live[i] = rng() % 5 != 0;
    }
    const std::vector<uint32_t> want = official_hash(h, tokens, live);
    std::vector<uint32_t> rows(want.size(), 0xFFFFFFFFu);
    EngramHasher::History hist = h.start();
    const size_t per = h.rows_per_token();
    for (size_t t = 0; t < n;) {
      const size_t chunk = std::min(n - t, 1 + rng() % 7);
      ASSERT_TRUE(h.hash(hist, std::span(tokens).subspan(t, chunk), std::span(live).subspan(t, chunk),
                         std::span(rows).subspan(t * per, chunk * per)).is_ok());
      t += chunk;
    }
    ASSERT_EQ(rows, want) << "trial " << trial << " seed " << test::test_seed();
  }
}

TEST(EngramHashTest, BadInputIsAnError) {
  const EngramHasher& h = flash_hasher();
  EngramHasher::History hist = h.start();
  std::vector<uint32_t> rows(h.rows_per_token());
  const std::vector<int32_t> bad = {129280};
  auto s = h.hash(hist, bad, {}, rows);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("129280"), std::string::npos);
  const std::vector<int32_t> ok = {5};
  std::vector<uint32_t> small(3);
  EXPECT_FALSE(h.hash(hist, ok, {}, small).is_ok());
  EXPECT_EQ(hist, h.start());  // nothing consumed by failed calls
}

TEST(EngramRowTest, Fp8RowDecodesCodesTimesScale) {
  std::mt19937_64 rng(test::test_seed());
  constexpr uint32_t kDim = 64;
  uint8_t codes[kDim], scales[kDim / 32], row[engram_row_bytes(kDim)];
  for (auto& c : codes) c = static_cast<uint8_t>(rng() % 256);
  codes[3] = 0x7F;  // NaN code
  scales[0] = 120;
  scales[1] = 131;
  encode_engram_fp8_row(codes, scales, kDim, row);
  float out[kDim];
  std::fill(std::begin(out), std::end(out), 12345.0f);
  decode_engram_fp8_row(row, kDim, out);
  for (uint32_t c = 0; c < kDim; ++c) {
    const double want = static_cast<double>(e4m3_to_f32(codes[c])) * std::ldexp(1.0, scales[c / 32] - 127);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(out[c])) << c;
    } else {
      EXPECT_EQ(out[c], static_cast<float>(want)) << c;  // e4m3 x 2^k is exact in BF16
    }
  }
  EXPECT_EQ(engram_row_encoding(256), "e4m3_e8m0_32_row264");
}

}  // namespace
}  // namespace dsv4
