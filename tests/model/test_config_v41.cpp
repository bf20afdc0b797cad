// V4.1 (deepseek41) config: the presets round-trip through the GGUF keys, the published
// key spellings read the same, source layers and candidate settings fall back to tensor
// presence, and every V4.1 rule is enforced with the field and the values in the message.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "gguf/gguf_file.h"
#include "gguf/gguf_writer.h"
#include "backend/cpu/cpu_backend.h"
#include "model/config.h"
#include "model/model.h"
#include "model/tensor_catalog.h"
#include "support/test_support.h"
#include "synth/presets.h"

namespace dsv4 {
namespace {

using gguf::Value;

// Metadata of `c` with keys renamed (old -> new; new "" drops it), plus tensors given by
// name only (one f32 each: presence is what the fallbacks look at).
std::string write_file(const test::TempDir& dir, const std::string& name, const ModelConfig& c,
                       const std::map<std::string, std::string>& rename = {},
                       const std::vector<std::string>& tensors = {}, const std::string& arch = "") {
  const std::string first = (dir / (name + ".tmp.gguf")).string();
  {
    gguf::GgufWriter w(first);
    c.write_gguf_metadata(w);
    EXPECT_TRUE(w.begin().is_ok());
    EXPECT_TRUE(w.finish().is_ok());
  }
  auto f = gguf::GgufFile::open(first);
  EXPECT_TRUE(f.is_ok());
  const std::string path = (dir / name).string();
  gguf::GgufWriter w(path);
  for (const auto& [k, v] : f->metadata()) {
    std::string key = k;
    if (auto it = rename.find(k); it != rename.end()) key = it->second;
    if (key.empty()) continue;
    if (!arch.empty() && key.starts_with("deepseek41.")) key = arch + key.substr(10);
    w.set(key, key == "general.architecture" && !arch.empty() ? Value::string(arch) : v);
  }
  for (const auto& t : tensors) EXPECT_TRUE(w.add_tensor(t, GgmlType::F32, {1}).is_ok());
  EXPECT_TRUE(w.begin().is_ok());
  const float zero = 0;
  for (size_t i = 0; i < tensors.size(); ++i)
    EXPECT_TRUE(w.write_tensor_data({reinterpret_cast<const uint8_t*>(&zero), 4}).is_ok());
  EXPECT_TRUE(w.finish().is_ok());
  return path;
}

Result<ModelConfig> load(const std::string& path) {
  auto f = gguf::GgufFile::open(path);
  if (!f.is_ok()) return f.status();
  return ModelConfig::from_gguf(*f);
}

void expect_same_v41(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.variant, b.variant);
  EXPECT_EQ(a.n_layers, b.n_layers);
  EXPECT_EQ(a.n_mtp, b.n_mtp);
  EXPECT_EQ(a.compress_ratios, b.compress_ratios);
  EXPECT_EQ(a.rms_eps, b.rms_eps);
  EXPECT_EQ(a.n_hash_layers, 0u);
  EXPECT_EQ(a.kv_source_layers, b.kv_source_layers);
  EXPECT_EQ(a.index_source_layers, b.index_source_layers);
  ASSERT_EQ(a.candidate.has_value(), b.candidate.has_value());
  if (a.candidate) {
    EXPECT_EQ(a.candidate->source_layer, b.candidate->source_layer);
    EXPECT_EQ(a.candidate->block_size, b.candidate->block_size);
    EXPECT_EQ(a.candidate->topk_blocks, b.candidate->topk_blocks);
  }
  ASSERT_EQ(a.engram.has_value(), b.engram.has_value());
  if (a.engram) {
    EXPECT_EQ(a.engram->layers, b.engram->layers);
    EXPECT_EQ(a.engram->table_rows, b.engram->table_rows);
    EXPECT_EQ(a.engram->dim, b.engram->dim);
    EXPECT_EQ(a.engram->ngram, b.engram->ngram);
    EXPECT_EQ(a.engram->heads, b.engram->heads);
    EXPECT_EQ(a.engram->hash_vocab_size, b.engram->hash_vocab_size);
    EXPECT_EQ(a.engram->compressed_vocab_size, b.engram->compressed_vocab_size);
    EXPECT_EQ(a.engram->pad_token_id, b.engram->pad_token_id);
  }
  ASSERT_EQ(a.dspark.has_value(), b.dspark.has_value());
  if (a.dspark) {
    EXPECT_EQ(a.dspark->block_size, b.dspark->block_size);
    EXPECT_EQ(a.dspark->markov_rank, b.dspark->markov_rank);
    EXPECT_EQ(a.dspark->n_experts, b.dspark->n_experts);
    EXPECT_EQ(a.dspark->n_experts_used, b.dspark->n_experts_used);
    EXPECT_EQ(a.dspark->noise_token_id, b.dspark->noise_token_id);
    EXPECT_EQ(a.dspark->target_layers, b.dspark->target_layers);
  }
  ASSERT_EQ(a.vision.has_value(), b.vision.has_value());
  if (a.vision) {
    EXPECT_EQ(a.vision->image_token_id, b.vision->image_token_id);
  }
}

TEST(ConfigV41Test, PresetsRoundTrip) {
  test::TempDir dir;
  int i = 0;
  for (const ModelConfig& c : {tiny41_config(), small41_config(), flash41_config()}) {
    ASSERT_TRUE(c.validate().is_ok()) << c.name << ": " << c.validate().message();
    auto back = load(write_file(dir, "a" + std::to_string(i++) + ".gguf", c));
    ASSERT_TRUE(back.is_ok()) << back.status().message();
    EXPECT_EQ(back->architecture(), "deepseek41");
    expect_same_v41(*back, c);
  }
}

TEST(ConfigV41Test, FlashRoles) {
  const ModelConfig c = flash41_config();
  EXPECT_EQ(c.rms_eps, 1e-20f);
  for (uint32_t b = 0; b < c.n_blocks(); ++b) {
    const LayerRoles r = c.layer_roles(b);
    if (b < 2 || c.is_mtp(b)) {
      EXPECT_FALSE(r.kv_source || r.index_source);
      EXPECT_EQ(r.kv_source_layer, -1);
      continue;
    }
    const int32_t kv = b < 8 ? 2 : b < 14 ? 8 : b < 20 ? 14 : 20;
    const int32_t idx = b < 20 ? kv : static_cast<int32_t>(20 + (b - 20) / 4 * 4);
    EXPECT_EQ(r.kv_source_layer, kv) << b;
    EXPECT_EQ(r.index_source_layer, idx) << b;
    EXPECT_EQ(r.kv_source, static_cast<int32_t>(b) == kv) << b;
    EXPECT_EQ(r.index_source, static_cast<int32_t>(b) == idx) << b;
    EXPECT_EQ(r.candidate_source, b == 20) << b;
    EXPECT_EQ(r.uses_candidates, b > 20 && static_cast<int32_t>(b) == idx) << b;
  }
  EXPECT_TRUE(c.is_engram_layer(1));
  EXPECT_TRUE(c.is_engram_layer(14));
  EXPECT_FALSE(c.is_engram_layer(2));
  EXPECT_EQ(c.experts_of(39), 384u);
  EXPECT_EQ(c.experts_of(40), 128u);
  EXPECT_EQ(c.experts_used_of(42), 3u);
  EXPECT_EQ(c.engram->columns(), 24u);
}

TEST(ConfigV41Test, PublishedKeySpellingsReadTheSame) {
  test::TempDir dir;
  const ModelConfig c = tiny41_config();
  // Another converter's spellings under deepseek41.
  auto a = load(write_file(dir, "a.gguf", c,
                           {{"deepseek41.kv_source_layer_ids", "deepseek41.attention.kv_source_layer_ids"},
                            {"deepseek41.index_source_layer_ids", "deepseek41.attention.index_source_layer_ids"},
                            {"deepseek41.attention.candidate_source_layer_id", "deepseek41.candidate_source_layer_id"},
                            {"deepseek41.attention.candidate_topk_blocks", "deepseek41.candidate_topk_blocks"},
                            {"deepseek41.attention.candidate_block_size", "deepseek41.candidate_block_size"},
                            {"deepseek41.engram.key_length", ""},
                            {"deepseek41.engram.num_embeddings", ""},
                            {"deepseek41.engram.head_count", "deepseek41.engram.n_heads"}}));
  ASSERT_TRUE(a.is_ok()) << a.status().message();
  expect_same_v41(*a, c);
  // The deepseek4 architecture with V4.1 keys appended.
  auto b = load(write_file(dir, "b.gguf", c,
                           {{"deepseek41.kv_source_layer_ids", "deepseek41.attention.kv_source_layers"},
                            {"deepseek41.index_source_layer_ids", "deepseek41.attention.index_source_layers"},
                            {"deepseek41.attention.candidate_source_layer_id", "deepseek41.attention.candidate.source_layer"},
                            {"deepseek41.attention.candidate_topk_blocks", "deepseek41.attention.candidate.topk_blocks"},
                            {"deepseek41.attention.candidate_block_size", "deepseek41.attention.candidate.block_size"},
                            {"deepseek41.dspark.block_size", "deepseek41.mtp.block_size"},
                            {"deepseek41.dspark.expert_count", "deepseek41.mtp.expert_count"}},
                           {}, "deepseek4"));
  ASSERT_TRUE(b.is_ok()) << b.status().message();
  EXPECT_TRUE(b->is_v41());
  expect_same_v41(*b, c);
}

TEST(ConfigV41Test, SourcesAndCandidatesFromTensorPresence) {
  test::TempDir dir;
  const ModelConfig c = tiny41_config();
  std::vector<std::string> tensors;
  for (uint32_t s : c.kv_source_layers) tensors.push_back(block_tensor_name(s, BlockTensor::CompressorKv));
  for (uint32_t s : c.index_source_layers) tensors.push_back(block_tensor_name(s, BlockTensor::IndexerQB));
  auto a = load(write_file(dir, "a.gguf", c,
                           {{"deepseek41.kv_source_layer_ids", ""},
                            {"deepseek41.index_source_layer_ids", ""},
                            {"deepseek41.attention.candidate_source_layer_id", ""},
                            {"deepseek41.attention.candidate_topk_blocks", ""},
                            {"deepseek41.attention.candidate_block_size", ""}},
                           tensors));
  ASSERT_TRUE(a.is_ok()) << a.status().message();
  EXPECT_EQ(a->kv_source_layers, c.kv_source_layers);
  EXPECT_EQ(a->index_source_layers, c.index_source_layers);
  // The first ratio-1 KV source, with the release's block settings.
  ASSERT_TRUE(a->candidate);
  EXPECT_EQ(a->candidate->source_layer, 4u);
  EXPECT_EQ(a->candidate->block_size, 8u);
  EXPECT_EQ(a->candidate->topk_blocks, 2048u);
}

void expect_invalid(const ModelConfig& c, std::initializer_list<std::string> parts) {
  const Status s = c.validate();
  ASSERT_FALSE(s.is_ok());
  for (const auto& p : parts) EXPECT_NE(s.message().find(p), std::string::npos) << s.message() << " / " << p;
}

TEST(ConfigV41Test, ValidationNamesFieldAndValues) {
  ModelConfig c = flash41_config();
  c.index_source_layers = {2, 14, 20, 24, 28, 32, 36};
  expect_invalid(c, {"KV source layer 8", "index source"});
  c = flash41_config();
  c.compress_ratios[5] = 1;
  expect_invalid(c, {"layer 5", "ratio 1", "KV source 2", "ratio 2"});
  c = flash41_config();
  c.candidate->source_layer = 14;
  expect_invalid(c, {"candidate source layer 14", "ratio-1 KV source", "ratio is 2"});
  c = flash41_config();
  c.kv_source_layers = {8, 14, 20};
  c.index_source_layers = {8, 14, 20, 24, 28, 32, 36};
  expect_invalid(c, {"layer 2", "no KV source"});
  c = flash41_config();
  c.index_source_layers = {2, 8, 14, 20, 22, 24, 28, 32, 36};
  c.kv_source_layers = {2, 8, 14, 20, 22};
  c.index_source_layers = {2, 8, 14, 20, 22, 24, 28, 32, 36};
  ASSERT_TRUE(c.validate().is_ok()) << c.validate().message();  // a consistent variation
  c = flash41_config();
  c.n_hash_layers = 3;
  expect_invalid(c, {"n_hash_layers is 3"});
  c = flash41_config();
  c.engram->dim = 48;
  expect_invalid(c, {"engram head_dim 48"});
  c = flash41_config();
  c.engram->layers = {14, 1};
  expect_invalid(c, {"engram layers [14, 1]"});
  c = flash41_config();
  c.dspark->n_experts_used = 200;
  expect_invalid(c, {"DSpark experts 128 top-200"});
  c = flash41_config();
  c.dspark.reset();
  expect_invalid(c, {"3 MTP blocks", "DSpark"});
  c = flash41_config();
  c.kv_source_layers = {2, 8, 8, 20};
  expect_invalid(c, {"kv_source_layers [2, 8, 8, 20]", "ascending"});
  ModelConfig v4 = flash_config();
  v4.kv_source_layers = {2};
  expect_invalid(v4, {"deepseek41"});
}

TEST(ConfigV41Test, MissingKeysNameFileAndKey) {
  test::TempDir dir;
  auto a = load(write_file(dir, "a.gguf", tiny41_config(), {{"deepseek41.engram.max_ngram_size", ""}}));
  ASSERT_FALSE(a.is_ok());
  EXPECT_NE(a.status().message().find("a.gguf"), std::string::npos);
  EXPECT_NE(a.status().message().find("deepseek41.engram.max_ngram_size"), std::string::npos) << a.status().message();
  auto b = load(write_file(dir, "b.gguf", tiny41_config(), {{"deepseek41.attention.candidate_block_size", ""}}));
  ASSERT_FALSE(b.is_ok());
  EXPECT_NE(b.status().message().find("candidate_block_size"), std::string::npos) << b.status().message();
}

TEST(ConfigV41Test, ImageTokensAreRefused) {
  const ModelConfig c = flash41_config();
  const std::vector<int32_t> text = {0, 19923, 223, 129263, 129265};
  EXPECT_TRUE(refuse_image_tokens(c, text).is_ok());
  const std::vector<int32_t> image = {0, 19923, 129264, 5};
  const Status s = refuse_image_tokens(c, image);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("position 2"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("129264"), std::string::npos) << s.message();
  EXPECT_TRUE(refuse_image_tokens(flash_config(), image).is_ok());  // V4 has no image token
}

}  // namespace
}  // namespace dsv4
