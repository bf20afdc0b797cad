// config.json -> ModelConfig (the fixture's and V4-Flash's), the writer's round trip,
// errors naming the key, and the conversion plan of the full V4-Flash geometry.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "convert/checkpoint_config.h"
#include "convert/converter.h"
#include "synth/presets.h"
#include "support/test_support.h"

namespace dsv4::convert {
namespace {

std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::filesystem::path flash_dir() { return test::source_dir() / "tests" / "data" / "deepseek-v4-flash"; }
std::filesystem::path pro_dir() { return test::source_dir() / "tests" / "data" / "deepseek-v4-pro"; }

TEST(CheckpointConfig, FixtureValues) {
  auto c = read_checkpoint_config(test::fixture_dir() / "checkpoint");
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  const ModelConfig& m = c->model;
  EXPECT_EQ(m.vocab_size, 512u);
  EXPECT_EQ(m.hidden, 256u);
  EXPECT_EQ(m.n_layers, 6u);
  EXPECT_EQ(m.n_mtp, 1u);
  EXPECT_EQ(m.context_length, 256u);
  EXPECT_EQ(m.n_heads, 4u);
  EXPECT_EQ(m.head_dim, 256u);
  EXPECT_EQ(m.rope.dims, 64u);
  EXPECT_EQ(m.q_lora_rank, 64u);
  EXPECT_EQ(m.o_groups, 2u);
  EXPECT_EQ(m.o_lora_rank, 32u);
  EXPECT_EQ(m.sliding_window, 8u);
  EXPECT_EQ(m.compress_ratios, (std::vector<uint32_t>{0, 4, 16, 4, 16, 0, 0}));
  EXPECT_EQ(m.index_heads, 4u);
  EXPECT_EQ(m.index_head_dim, 128u);
  EXPECT_EQ(m.index_topk, 3u);
  EXPECT_EQ(m.n_experts, 8u);
  EXPECT_EQ(m.n_experts_used, 2u);
  EXPECT_EQ(m.n_shared_experts, 1u);
  EXPECT_EQ(m.expert_ffn, 128u);
  EXPECT_EQ(m.n_hash_layers, 2u);
  EXPECT_FLOAT_EQ(m.routed_scale, 1.5f);
  EXPECT_TRUE(m.norm_topk);
  EXPECT_EQ(m.swiglu_limit, std::vector<float>(7, 10.0f));
  EXPECT_EQ(m.swiglu_limit_shared, std::vector<float>(7, 10.0f));
  EXPECT_EQ(m.hc_mult, 4u);
  EXPECT_EQ(m.hc_sinkhorn_iters, 20u);
  EXPECT_FLOAT_EQ(m.hc_eps, 1e-6f);
  EXPECT_FLOAT_EQ(m.rms_eps, 1e-6f);
  EXPECT_DOUBLE_EQ(m.rope.freq_base, 10000);
  EXPECT_DOUBLE_EQ(m.rope.compress_freq_base, 160000);
  EXPECT_DOUBLE_EQ(m.rope.yarn_factor, 4);
  EXPECT_EQ(m.rope.yarn_original_context, 64u);
  EXPECT_DOUBLE_EQ(m.rope.yarn_beta_fast, 32);
  EXPECT_DOUBLE_EQ(m.rope.yarn_beta_slow, 1);
  EXPECT_EQ(c->format.fp8_block_rows, 128u);
  EXPECT_EQ(c->format.fp8_block_cols, 128u);
  EXPECT_TRUE(c->format.experts_fp4);
}

TEST(CheckpointConfig, WriterRoundTrips) {
  for (const auto& dir : {test::fixture_dir() / "checkpoint", flash_dir(), pro_dir()}) {
    SCOPED_TRACE(dir.string());
    auto c = read_checkpoint_config(dir);
    ASSERT_TRUE(c.is_ok()) << c.status().message();
    const std::string json = checkpoint_config_json(*c);
    auto again = parse_checkpoint_config(json, "written");
    ASSERT_TRUE(again.is_ok()) << again.status().message();
    EXPECT_EQ(checkpoint_config_json(*again), json);
    // Same keys as the official file.
    const auto official = nlohmann::json::parse(read_text(dir / "config.json"));
    const auto ours = nlohmann::json::parse(json);
    for (const auto& [key, value] : official.items())
      if (key != "transformers_version") EXPECT_TRUE(ours.contains(key)) << key;
  }
}

TEST(CheckpointConfig, ErrorsNameTheKey) {
  const auto base = nlohmann::ordered_json::parse(read_text(test::fixture_dir() / "checkpoint" / "config.json"));
  struct Case {
    std::function<void(nlohmann::ordered_json&)> edit;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {[](auto& j) { j.erase("hidden_size"); }, "key hidden_size is missing"},
      {[](auto& j) { j["hidden_size"] = "wide"; }, "key hidden_size: expected an integer"},
      {[](auto& j) { j["num_attention_heads"] = -4; }, "key num_attention_heads: expected an integer"},
      {[](auto& j) { j["architectures"] = {"DeepseekV3ForCausalLM"}; }, "DeepseekV3ForCausalLM"},
      {[](auto& j) { j["num_key_value_heads"] = 2; }, "num_key_value_heads is 2"},
      {[](auto& j) { j["compress_ratios"] = {0, 4}; }, "compress_ratios has 2 entries, expected 7"},
      {[](auto& j) { j["rope_scaling"]["type"] = "linear"; }, "rope_scaling: type is \"linear\""},
      {[](auto& j) { j["scoring_func"] = "softmax"; }, "scoring_func"},
      {[](auto& j) { j["quantization_config"]["weight_block_size"] = {128}; }, "weight_block_size"},
      {[](auto& j) { j["expert_dtype"] = "int4"; }, "expert_dtype"},
  };
  for (const Case& c : cases) {
    nlohmann::ordered_json j = base;
    c.edit(j);
    auto r = parse_checkpoint_config(j.dump(), "ckpt/config.json");
    ASSERT_FALSE(r.is_ok()) << c.expect;
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find("ckpt/config.json"), std::string::npos) << r.status().message();
  }
  auto bad = parse_checkpoint_config("{\"hidden_size\": ", "ckpt/config.json");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("not valid JSON"), std::string::npos);
}

// The V4-Flash plan: the trunk has llama.cpp's 1,328 tensors, plus the MTP block; the
// routed experts of the mxfp4 recipe take exactly the official FP4 payload (values and
// scales); no V4-Flash row needs a fallback; q2k fits one H200 (141 GB) with room to spare.
TEST(CheckpointConfig, FlashPlan) {
  auto config = read_checkpoint_config(flash_dir());
  ASSERT_TRUE(config.is_ok()) << config.status().message();
  const ModelConfig& m = config->model;
  EXPECT_EQ(m.n_blocks(), 44u);
  for (const char* name : {"q2k", "q4k", "q8", "mxfp4", "bf16", "f32"}) {
    SCOPED_TRACE(name);
    auto plan = plan_conversion(*config, *recipe_by_name(name));
    ASSERT_TRUE(plan.is_ok()) << plan.status().message();
    uint64_t trunk = 0, expert_bytes = 0;
    for (const auto& t : plan->tensors) {
      if (!t.spec.block || *t.spec.block < m.n_layers) ++trunk;
      EXPECT_EQ(t.type, t.requested) << t.spec.name;
      if (t.source.layout == SourceLayout::ExpertStack) expert_bytes += t.nbytes;
    }
    EXPECT_EQ(trunk, 1328u);
    if (std::string(name) == "mxfp4") {
      const uint64_t per_matrix = uint64_t{m.expert_ffn} * m.hidden;
      EXPECT_EQ(expert_bytes, uint64_t{m.n_blocks()} * m.n_experts * 3 * (per_matrix / 2 + per_matrix / 32));
    }
    if (std::string(name) == "q2k") EXPECT_LT(plan->total_bytes(), 120'000'000'000u);
  }
}

// V4-Pro's config.json (tests/data/deepseek-v4-pro, spec §1.4) reads as the `pro` preset,
// and its plan: the mxfp4 recipe keeps exactly the FP4 payload; q2k (2-3 bit experts)
// fits 8 H200s (8 x 139 GiB) and the lossless 4-bit one does too, 8-bit experts do not.
TEST(CheckpointConfig, ProPlan) {
  auto config = read_checkpoint_config(pro_dir());
  ASSERT_TRUE(config.is_ok()) << config.status().message();
  const ModelConfig& m = config->model;
  EXPECT_EQ(m.identity(), pro_config().identity());
  EXPECT_EQ(m.n_blocks(), 62u);
  EXPECT_FLOAT_EQ(m.routed_scale, 2.5f);
  const uint64_t eight_h200 = 8 * (139ull << 30);
  for (const char* name : {"q2k", "q4k", "q8", "mxfp4"}) {
    SCOPED_TRACE(name);
    auto plan = plan_conversion(*config, *recipe_by_name(name));
    ASSERT_TRUE(plan.is_ok()) << plan.status().message();
    uint64_t trunk = 0, expert_bytes = 0;
    for (const auto& t : plan->tensors) {
      if (!t.spec.block || *t.spec.block < m.n_layers) ++trunk;
      EXPECT_EQ(t.type, t.requested) << t.spec.name;
      if (t.source.layout == SourceLayout::ExpertStack) expert_bytes += t.nbytes;
    }
    uint64_t catalog_trunk = 0;
    for (const auto& t : build_tensor_catalog(m).tensors) catalog_trunk += !t.block || *t.block < m.n_layers;
    EXPECT_EQ(trunk, catalog_trunk);
    const uint64_t per_matrix = uint64_t{m.expert_ffn} * m.hidden;
    if (std::string(name) == "mxfp4") {
      EXPECT_EQ(expert_bytes, uint64_t{m.n_blocks()} * m.n_experts * 3 * (per_matrix / 2 + per_matrix / 32));
    }
    if (std::string(name) == "q8") {
      EXPECT_GT(plan->total_bytes(), eight_h200);
    } else {
      EXPECT_LT(plan->total_bytes(), eight_h200);
    }
  }
}

}  // namespace
}  // namespace dsv4::convert
