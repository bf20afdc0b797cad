// Synthetic models: a valid file (config + catalog), bytes that depend only on the seed
// (not on the thread count), stored values equal to the recipe's draws, and the recipe's
// statistics (norms near 1, distinct hash experts, paired indexer heads, ...).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <set>

#include "gguf/gguf_file.h"
#include "gguf/quant.h"
#include "synth/presets.h"
#include "synth/synth.h"
#include "support/test_support.h"
#include "util/thread_pool.h"

namespace dsv4 {
namespace {

// The fixture's geometry with its 512-token vocabulary: cheap to write.
ModelConfig fixture_config() {
  ModelConfig c = tiny_config();
  c.vocab_size = 512;
  return c;
}

// A small config with the real vocabulary, so the tokenizer metadata fits.
ModelConfig mini_real_vocab_config() {
  ModelConfig c = tiny_config();
  c.hidden = 64;
  c.n_heads = 2;
  c.head_dim = 128;
  c.q_lora_rank = 32;
  c.o_groups = 1;
  c.index_heads = 2;
  c.index_head_dim = 64;
  c.n_experts = 4;
  c.expert_ffn = 32;
  c.n_layers = 3;
  c.n_hash_layers = 1;
  c.compress_ratios = {0, 4, 8, 0};
  c.swiglu_limit.assign(4, 10.0f);
  c.swiglu_limit_shared.assign(4, 10.0f);
  return c;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

SynthOptions options(const ModelConfig& c, uint64_t seed) {
  SynthOptions o;
  o.config = c;
  o.seed = seed;
  o.write_tokenizer = false;
  o.layout = WriteLayout::Bundled;  // one file, so the generator's output is checked whole
  return o;
}

TEST(SynthTest, WritesAValidFile) {
  test::TempDir dir;
  const std::string path = (dir / "m.gguf").string();
  const uint64_t seed = test::test_seed();
  auto report = write_synthetic_model(path, options(fixture_config(), seed));
  ASSERT_TRUE(report.is_ok()) << report.status().message() << " (seed " << seed << ")";
  auto f = gguf::GgufFile::open(path);
  ASSERT_TRUE(f.is_ok()) << f.status().message();
  auto c = ModelConfig::from_gguf(*f);
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c->compress_ratios, fixture_config().compress_ratios);
  const TensorCatalog cat = build_tensor_catalog(*c);
  const Status check = check_tensors(cat, f->tensors(), path);
  EXPECT_TRUE(check.is_ok()) << check.message();
  EXPECT_EQ(report->n_tensors, f->tensors().size());
  EXPECT_EQ(f->tensors().size(), synth_tensor_list(cat).size());
  EXPECT_EQ(*f->get_uint(kSynthSeedKey), seed);
  EXPECT_EQ(*f->get_uint(kSynthVersionKey), kSynthVersion);
  EXPECT_EQ(f->find_tensor("blk.6.nextn.hc_head_fn.weight")->type, GgmlType::F32);
  EXPECT_EQ(f->find_tensor("blk.0.ffn_gate_tid2eid.weight")->type, GgmlType::I32);
  EXPECT_EQ(f->find_tensor("blk.1.attn_q_b.weight")->type, GgmlType::Q8_0);
}

TEST(SynthTest, BytesDependOnTheSeedOnly) {
  test::TempDir dir;
  const uint64_t seed = test::test_seed();
  ThreadPool one(1), three(3);
  SynthOptions a = options(fixture_config(), seed);
  a.pool = &one;
  SynthOptions b = options(fixture_config(), seed);
  b.pool = &three;
  SynthOptions other = options(fixture_config(), seed + 1);
  ASSERT_TRUE(write_synthetic_model((dir / "a.gguf").string(), a).is_ok());
  ASSERT_TRUE(write_synthetic_model((dir / "b.gguf").string(), b).is_ok());
  ASSERT_TRUE(write_synthetic_model((dir / "c.gguf").string(), other).is_ok());
  const std::string fa = read_all((dir / "a.gguf").string());
  EXPECT_GT(fa.size(), 1000000u);
  EXPECT_TRUE(fa == read_all((dir / "b.gguf").string())) << "seed " << seed;
  EXPECT_FALSE(fa == read_all((dir / "c.gguf").string()));
}

TEST(SynthTest, StoredValuesAreTheRecipesDraws) {
  test::TempDir dir;
  const std::string path = (dir / "m.gguf").string();
  const uint64_t seed = test::test_seed();
  const ModelConfig c = fixture_config();
  ASSERT_TRUE(write_synthetic_model(path, options(c, seed)).is_ok());
  auto f = gguf::GgufFile::open(path);
  ASSERT_TRUE(f.is_ok());
  const TensorCatalog cat = build_tensor_catalog(c);
  for (const char* name : {"blk.1.attn_q_b.weight", "blk.2.ffn_down_exps.weight", "blk.0.attn_norm.weight",
                           "output_hc_fn.weight", "blk.1.attn_compressor_ape.weight"}) {
    const gguf::TensorInfo* t = f->find_tensor(name);
    ASSERT_NE(t, nullptr) << name;
    const TensorSpec& spec = *cat.find(name);
    const uint64_t n = spec.ne[0], rows = spec.n_elements() / n;
    std::vector<float> want(n * rows), got(n * rows, std::nanf(""));
    synth_rows(c, spec, seed, 0, rows, want.data());
    const uint64_t row_bytes = *ggml_row_bytes(t->type, n);
    for (uint64_t r = 0; r < rows; ++r)
      dequantize_row(t->type, t->data + r * row_bytes, got.data() + r * n, static_cast<int64_t>(n));
    double err = 0, norm = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_FALSE(std::isnan(got[i])) << name << " element " << i;
      err += (got[i] - want[i]) * double(got[i] - want[i]);
      norm += double(want[i]) * want[i];
    }
    const double rel = std::sqrt(err / norm);
    if (t->type == GgmlType::F32)
      EXPECT_EQ(rel, 0.0) << name;
    else
      EXPECT_LT(rel, 0.01) << name << " (" << ggml_type_name(t->type) << ", seed " << seed << ")";
    EXPECT_GT(norm, 0.0) << name;
  }
}

TEST(SynthTest, RecipeStatistics) {
  const ModelConfig c = fixture_config();
  const TensorCatalog cat = build_tensor_catalog(c);
  const uint64_t seed = test::test_seed();
  auto draw = [&](const std::string& name) {
    const TensorSpec& s = *cat.find(name);
    std::vector<float> v(s.n_elements());
    synth_rows(c, s, seed, 0, s.n_elements() / s.ne[0], v.data());
    return v;
  };
  auto mean_std = [](const std::vector<float>& v) {
    double m = 0, q = 0;
    for (float x : v) m += x;
    m /= v.size();
    for (float x : v) q += (x - m) * (x - m);
    return std::pair{m, std::sqrt(q / v.size())};
  };
  auto [em, es] = mean_std(draw("token_embd.weight"));
  EXPECT_NEAR(em, 0, 0.01);
  EXPECT_NEAR(es, 1, 0.01);
  auto [nm, ns] = mean_std(draw("blk.3.ffn_norm.weight"));
  EXPECT_NEAR(nm, 1, 0.03);
  EXPECT_NEAR(ns, 0.1, 0.03);
  auto [qm, qs] = mean_std(draw("blk.0.attn_q_a.weight"));  // 1/sqrt(256) times 2^U(-1,1)
  EXPECT_NEAR(qm, 0, 0.02);
  EXPECT_GT(qs, 0.5 / 16);
  EXPECT_LT(qs, 2.0 / 16);

  const std::vector<float> tid = draw("blk.1.ffn_gate_tid2eid.weight");
  std::set<std::pair<int, int>> rows;
  for (size_t t = 0; t < tid.size(); t += 2) {
    EXPECT_NE(tid[t], tid[t + 1]) << "token " << t / 2;
    for (size_t k = 0; k < 2; ++k) {
      EXPECT_GE(tid[t + k], 0);
      EXPECT_LT(tid[t + k], 8);
      EXPECT_EQ(tid[t + k], std::floor(tid[t + k]));
    }
    rows.insert({int(tid[t]), int(tid[t + 1])});
  }
  EXPECT_GT(rows.size(), 40u);  // 56 ordered pairs exist; 512 draws hit most of them

  // Indexer query heads come in anti-correlated pairs.
  const std::vector<float> q = draw("blk.1.indexer.attn_q_b.weight");
  const size_t row = 64, head = 128 * row;  // 128 rows per head, 64 values per row
  double dot = 0, n0 = 0, n1 = 0;
  for (size_t i = 0; i < head; ++i) {
    dot += double(q[i]) * q[head + i];
    n0 += double(q[i]) * q[i];
    n1 += double(q[head + i]) * q[head + i];
  }
  EXPECT_LT(dot / std::sqrt(n0 * n1), -0.7);  // -0.96 without the per-block scales

  // Experts 3 and 7 carry gains (gate x 3.5 / x 5).
  const TensorSpec& gate = *cat.find("blk.2.ffn_gate_exps.weight");
  const std::vector<float> g = draw(gate.name);
  const size_t per_expert = gate.ne[0] * gate.ne[1];
  auto expert_rms = [&](size_t e) {
    double s = 0;
    for (size_t i = e * per_expert; i < (e + 1) * per_expert; ++i) s += double(g[i]) * g[i];
    return std::sqrt(s / per_expert);
  };
  EXPECT_NEAR(expert_rms(7) / expert_rms(0), 5.0, 0.5);
  EXPECT_NEAR(expert_rms(3) / expert_rms(1), 3.5, 0.4);
}

TEST(SynthTest, FallsBackWhereRowsDoNotFitTheBlock) {
  test::TempDir dir;
  const std::string path = (dir / "m.gguf").string();
  SynthOptions o = options(fixture_config(), 7);
  o.expert_type = GgmlType::Q2_K;
  o.dense_type = GgmlType::Q4_K;
  auto report = write_synthetic_model(path, o);
  ASSERT_TRUE(report.is_ok()) << report.status().message();
  auto f = gguf::GgufFile::open(path);
  ASSERT_TRUE(f.is_ok());
  EXPECT_EQ(f->find_tensor("blk.0.ffn_gate_exps.weight")->type, GgmlType::Q2_K);  // rows of 256
  EXPECT_EQ(f->find_tensor("blk.0.ffn_down_exps.weight")->type, GgmlType::Q8_0);  // rows of 128
  EXPECT_EQ(f->find_tensor("blk.0.attn_q_b.weight")->type, GgmlType::Q8_0);       // rows of 64
  EXPECT_EQ(f->find_tensor("blk.0.attn_q_a.weight")->type, GgmlType::Q4_K);
  bool noted = false;
  for (const auto& n : report->notes)
    noted |= n.find("blk.0.ffn_down_exps.weight: row length 128") != std::string::npos;
  EXPECT_TRUE(noted);
  EXPECT_TRUE(check_tensors(build_tensor_catalog(fixture_config()), f->tensors(), path).is_ok());
}

TEST(SynthTest, RefusesTypesItCannotProduce) {
  test::TempDir dir;
  SynthOptions o = options(fixture_config(), 1);
  o.expert_type = GgmlType::IQ2_XXS;
  auto r = write_synthetic_model((dir / "m.gguf").string(), o);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("iq2_xxs"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(dir / "m.gguf"));
}

TEST(SynthTest, WritesTheTokenizer) {
  test::TempDir dir;
  const std::string path = (dir / "m.gguf").string();
  SynthOptions o = options(mini_real_vocab_config(), 3);
  o.write_tokenizer = true;
  auto report = write_synthetic_model(path, o);
  ASSERT_TRUE(report.is_ok()) << report.status().message();
  auto f = gguf::GgufFile::open(path);
  ASSERT_TRUE(f.is_ok());
  EXPECT_EQ(*f->get_string("tokenizer.ggml.model"), "gpt2");
  auto tokens = f->get_string_array("tokenizer.ggml.tokens");
  ASSERT_TRUE(tokens.is_ok());
  EXPECT_EQ(tokens->size(), 129280u);
  EXPECT_TRUE(check_tensors(build_tensor_catalog(mini_real_vocab_config()), f->tensors(), path).is_ok());
}

}  // namespace
}  // namespace dsv4
