// ModelConfig: the deepseek4 keys round-trip through a GGUF file, and every malformed or
// inconsistent file gives an error naming the file, the key and the values.
#include <gtest/gtest.h>

#include <string>

#include "gguf/gguf_file.h"
#include "gguf/gguf_writer.h"
#include "model/config.h"
#include "synth/presets.h"
#include "support/test_support.h"

namespace dsv4 {
namespace {

using gguf::Value;

std::string write_config(const test::TempDir& dir, const ModelConfig& c, const std::string& name) {
  const std::string path = (dir / name).string();
  gguf::GgufWriter w(path);
  c.write_gguf_metadata(w);
  EXPECT_TRUE(w.begin().is_ok());
  EXPECT_TRUE(w.finish().is_ok());
  return path;
}

// Copies a file's metadata, dropping `drop` and then setting `extra`.
std::string rewrite(const test::TempDir& dir, const std::string& src, const std::string& name,
                    const std::string& drop, std::vector<std::pair<std::string, Value>> extra = {}) {
  auto f = gguf::GgufFile::open(src);
  EXPECT_TRUE(f.is_ok()) << f.status().message();
  const std::string path = (dir / name).string();
  gguf::GgufWriter w(path);
  for (const auto& [k, v] : f->metadata())
    if (k != drop) w.set(k, v);
  for (auto& [k, v] : extra) w.set(k, v);
  EXPECT_TRUE(w.begin().is_ok());
  EXPECT_TRUE(w.finish().is_ok());
  return path;
}

Result<ModelConfig> load(const std::string& path) {
  auto f = gguf::GgufFile::open(path);
  if (!f.is_ok()) return f.status();
  return ModelConfig::from_gguf(*f);
}

void expect_same(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.hidden, b.hidden);
  EXPECT_EQ(a.n_layers, b.n_layers);
  EXPECT_EQ(a.n_mtp, b.n_mtp);
  EXPECT_EQ(a.context_length, b.context_length);
  EXPECT_EQ(a.n_heads, b.n_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.q_lora_rank, b.q_lora_rank);
  EXPECT_EQ(a.o_lora_rank, b.o_lora_rank);
  EXPECT_EQ(a.o_groups, b.o_groups);
  EXPECT_EQ(a.sliding_window, b.sliding_window);
  EXPECT_EQ(a.compress_ratios, b.compress_ratios);
  EXPECT_EQ(a.rope.freq_base, b.rope.freq_base);
  EXPECT_EQ(a.rope.compress_freq_base, b.rope.compress_freq_base);
  EXPECT_EQ(a.rope.dims, b.rope.dims);
  EXPECT_EQ(a.rope.yarn_factor, b.rope.yarn_factor);
  EXPECT_EQ(a.rope.yarn_original_context, b.rope.yarn_original_context);
  EXPECT_EQ(a.rope.yarn_beta_fast, b.rope.yarn_beta_fast);
  EXPECT_EQ(a.rope.yarn_beta_slow, b.rope.yarn_beta_slow);
  EXPECT_EQ(a.rms_eps, b.rms_eps);
  EXPECT_EQ(a.index_heads, b.index_heads);
  EXPECT_EQ(a.index_head_dim, b.index_head_dim);
  EXPECT_EQ(a.index_topk, b.index_topk);
  EXPECT_EQ(a.n_experts, b.n_experts);
  EXPECT_EQ(a.n_experts_used, b.n_experts_used);
  EXPECT_EQ(a.n_shared_experts, b.n_shared_experts);
  EXPECT_EQ(a.expert_ffn, b.expert_ffn);
  EXPECT_EQ(a.routed_scale, b.routed_scale);
  EXPECT_EQ(a.norm_topk, b.norm_topk);
  EXPECT_EQ(a.n_hash_layers, b.n_hash_layers);
  EXPECT_EQ(a.swiglu_limit, b.swiglu_limit);
  EXPECT_EQ(a.swiglu_limit_shared, b.swiglu_limit_shared);
  EXPECT_EQ(a.hc_mult, b.hc_mult);
  EXPECT_EQ(a.hc_sinkhorn_iters, b.hc_sinkhorn_iters);
  EXPECT_EQ(a.hc_eps, b.hc_eps);
}

TEST(ConfigTest, PresetsAreValid) {
  for (std::string_view name : preset_names()) {
    auto p = find_preset(name);
    ASSERT_TRUE(p.is_ok()) << p.status().message();
    EXPECT_TRUE(p->config.validate().is_ok()) << name << ": " << p->config.validate().message();
  }
  EXPECT_FALSE(find_preset("huge").is_ok());
  EXPECT_NE(find_preset("huge").status().message().find("tiny, interop, small, flash"), std::string::npos);
}

TEST(ConfigTest, FlashPresetMatchesTheOfficialSchedule) {
  const ModelConfig c = flash_config();
  ASSERT_EQ(c.n_blocks(), 44u);
  EXPECT_EQ(c.attention_kind(0), AttentionKind::Window);
  EXPECT_EQ(c.attention_kind(1), AttentionKind::Window);
  EXPECT_EQ(c.attention_kind(2), AttentionKind::CSA);
  EXPECT_EQ(c.attention_kind(3), AttentionKind::HCA);
  EXPECT_EQ(c.ratio(3), 128u);
  EXPECT_EQ(c.attention_kind(42), AttentionKind::CSA);  // the last trunk layer is CSA
  EXPECT_EQ(c.attention_kind(43), AttentionKind::Window);
  EXPECT_TRUE(c.is_mtp(43));
  EXPECT_TRUE(c.is_hash_layer(2));
  EXPECT_FALSE(c.is_hash_layer(3));
  EXPECT_EQ(c.hc_dim(), 24u);
}

TEST(ConfigTest, RoundTripsThroughGguf) {
  test::TempDir dir;
  for (std::string_view name : preset_names()) {
    const ModelConfig c = find_preset(name)->config;
    auto back = load(write_config(dir, c, std::string(name) + ".gguf"));
    ASSERT_TRUE(back.is_ok()) << back.status().message();
    expect_same(c, *back);
  }
}

TEST(ConfigTest, KeepFirstLayers) {
  auto c = keep_first_layers(flash_config(), 4);
  ASSERT_TRUE(c.is_ok());
  EXPECT_EQ(c->n_layers, 4u);
  EXPECT_EQ(c->compress_ratios, (std::vector<uint32_t>{0, 0, 4, 128, 0}));
  EXPECT_EQ(c->swiglu_limit.size(), 5u);
  EXPECT_TRUE(c->validate().is_ok()) << c->validate().message();
  auto two = keep_first_layers(flash_config(), 2);
  ASSERT_TRUE(two.is_ok());
  EXPECT_EQ(two->n_hash_layers, 2u);
  EXPECT_FALSE(keep_first_layers(flash_config(), 0).is_ok());
  EXPECT_FALSE(keep_first_layers(flash_config(), 44).is_ok());
}

class ConfigErrorTest : public ::testing::Test {
 protected:
  void SetUp() override { good_ = write_config(dir_, tiny_config(), "good.gguf"); }

  // Expects loading to fail with a message containing every one of `parts`.
  void expect_error(const std::string& path, std::vector<std::string> parts) {
    auto c = load(path);
    ASSERT_FALSE(c.is_ok()) << path << " loaded";
    for (const auto& p : parts)
      EXPECT_NE(c.status().message().find(p), std::string::npos)
          << "message \"" << c.status().message() << "\" lacks \"" << p << "\"";
  }

  test::TempDir dir_;
  std::string good_;
};

TEST_F(ConfigErrorTest, MissingKeyIsNamed) {
  const std::string p = rewrite(dir_, good_, "a.gguf", "deepseek4.attention.q_lora_rank");
  expect_error(p, {"a.gguf", "deepseek4.attention.q_lora_rank"});
}

TEST_F(ConfigErrorTest, WrongTypeIsNamed) {
  const std::string p = rewrite(dir_, good_, "a.gguf", "", {{"deepseek4.embedding_length", Value::string("256")}});
  expect_error(p, {"a.gguf", "deepseek4.embedding_length"});
}

TEST_F(ConfigErrorTest, ShortCompressRatios) {
  const std::string p = rewrite(dir_, good_, "a.gguf", "",
                                {{"deepseek4.attention.compress_ratios", Value::array_u32({0, 4, 16, 4})}});
  expect_error(p, {"a.gguf", "compress_ratios", "4 entries", "block_count 7"});
}

TEST_F(ConfigErrorTest, LongerCompressRatiosAreCut) {
  const std::string p = rewrite(dir_, good_, "a.gguf", "",
                                {{"deepseek4.attention.compress_ratios", Value::array_u32({0, 4, 16, 4, 16, 0, 0, 0, 0})}});
  auto c = load(p);
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c->compress_ratios, tiny_config().compress_ratios);
}

TEST_F(ConfigErrorTest, AnyPositiveRatioIsHca) {
  const std::string p = rewrite(dir_, good_, "a.gguf", "",
                                {{"deepseek4.attention.compress_ratios", Value::array_u32({0, 4, 32, 4, 128, 0, 0})}});
  auto c = load(p);
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c->attention_kind(2), AttentionKind::HCA);
  EXPECT_EQ(c->ratio(2), 32u);
  EXPECT_EQ(c->attention_kind(4), AttentionKind::HCA);
}

TEST_F(ConfigErrorTest, MtpBlockMustBeWindowOnly) {
  const std::string p = rewrite(dir_, good_, "a.gguf", "",
                                {{"deepseek4.attention.compress_ratios", Value::array_u32({0, 4, 16, 4, 16, 0, 4})}});
  expect_error(p, {"a.gguf", "compress_ratios[6]", "MTP"});
}

TEST_F(ConfigErrorTest, OtherArchitectures) {
  expect_error(rewrite(dir_, good_, "a.gguf", "", {{"general.architecture", Value::string("llama")}}),
               {"a.gguf", "llama", "deepseek4"});
  // deepseek41 is read, from its own keys.
  expect_error(rewrite(dir_, good_, "b.gguf", "", {{"general.architecture", Value::string("deepseek41")}}),
               {"b.gguf", "deepseek41.block_count"});
}

TEST_F(ConfigErrorTest, InconsistentValues) {
  expect_error(rewrite(dir_, good_, "a.gguf", "", {{"deepseek4.attention.head_count_kv", Value::u32(4)}}),
               {"deepseek4.attention.head_count_kv", "4"});
  expect_error(rewrite(dir_, good_, "b.gguf", "", {{"deepseek4.attention.value_length", Value::u32(128)}}),
               {"deepseek4.attention.value_length", "128", "256"});
  expect_error(rewrite(dir_, good_, "c.gguf", "", {{"deepseek4.expert_gating_func", Value::u32(1)}}),
               {"deepseek4.expert_gating_func"});
  expect_error(rewrite(dir_, good_, "d.gguf", "", {{"deepseek4.expert_used_count", Value::u32(9)}}),
               {"d.gguf", "n_experts_used 9", "n_experts 8"});
  expect_error(rewrite(dir_, good_, "e.gguf", "", {{"deepseek4.rope.scaling.type", Value::string("linear")}}),
               {"deepseek4.rope.scaling.type", "linear"});
  expect_error(rewrite(dir_, good_, "f.gguf", "", {{"deepseek4.swiglu_clamp_exp", Value::array_f32({10, 10})}}),
               {"deepseek4.swiglu_clamp_exp", "2 entries"});
  expect_error(rewrite(dir_, good_, "g.gguf", "", {{"deepseek4.nextn_predict_layers", Value::u32(7)}}),
               {"deepseek4.nextn_predict_layers"});
  expect_error(rewrite(dir_, good_, "h.gguf", "", {{"deepseek4.embedding_length_out", Value::u32(256)}}),
               {"deepseek4.embedding_length_out", "1024"});
}

TEST_F(ConfigErrorTest, ScalarSwigluIsBroadcastAndSharedDefaultsToRouted) {
  const std::string p1 = rewrite(dir_, good_, "a.gguf", "deepseek4.swiglu_clamp_shexp",
                                 {{"deepseek4.swiglu_clamp_exp", Value::f32(7.5f)}});
  auto c = load(p1);
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c->swiglu_limit, std::vector<float>(7, 7.5f));
  EXPECT_EQ(c->swiglu_limit_shared, c->swiglu_limit);
}

TEST_F(ConfigErrorTest, VocabSizeNeedsKeyOrEmbedding) {
  expect_error(rewrite(dir_, good_, "a.gguf", "deepseek4.vocab_size"), {"deepseek4.vocab_size", "token_embd"});
}

TEST(ConfigValidateTest, NamesFieldAndValues) {
  ModelConfig c = tiny_config();
  c.head_dim = 200;
  EXPECT_NE(c.validate().message().find("head_dim 200"), std::string::npos) << c.validate().message();
  c = tiny_config();
  c.o_groups = 3;
  EXPECT_NE(c.validate().message().find("o_groups 3"), std::string::npos);
  c = tiny_config();
  c.index_head_dim = 96;
  EXPECT_NE(c.validate().message().find("index_head_dim 96"), std::string::npos);
  c = tiny_config();
  c.compress_ratios.pop_back();
  EXPECT_NE(c.validate().message().find("compress_ratios has 6 entries"), std::string::npos);
  c = tiny_config();
  c.n_hash_layers = 9;
  EXPECT_FALSE(c.validate().is_ok());
  c = tiny_config();
  c.engram = EngramConfig{};
  EXPECT_FALSE(c.validate().is_ok());
}

}  // namespace
}  // namespace dsv4
