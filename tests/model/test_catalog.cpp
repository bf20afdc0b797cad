// The tensor catalog: V4-Flash's tensor set (count, names, shapes in ggml order, per layer
// kind), and check_tensors reporting every missing, unexpected, mis-shaped and mis-typed
// tensor of a file at once.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "gguf/gguf_file.h"
#include "synth/presets.h"
#include "model/tensor_catalog.h"

namespace dsv4 {
namespace {

using V = std::vector<uint64_t>;

const TensorSpec& get(const TensorCatalog& cat, const std::string& name) {
  const TensorSpec* s = cat.find(name);
  EXPECT_NE(s, nullptr) << name;
  static const TensorSpec kEmpty;
  return s ? *s : kEmpty;
}

TEST(CatalogTest, FlashWithoutMtpHasTheKnown1328Tensors) {
  // hf2q's weights.rs counts exactly 1,328 tensors for the 43-layer file without MTP.
  ModelConfig c = flash_config();
  c.n_mtp = 0;
  c.compress_ratios.pop_back();
  c.swiglu_limit.pop_back();
  c.swiglu_limit_shared.pop_back();
  ASSERT_TRUE(c.validate().is_ok());
  const TensorCatalog cat = build_tensor_catalog(c);
  EXPECT_EQ(cat.tensors.size(), 1328u);
  EXPECT_EQ(cat.n_required(), 1328u);
  std::set<std::string> names;
  for (const auto& t : cat.tensors) EXPECT_TRUE(names.insert(t.name).second) << "duplicate " << t.name;
}

TEST(CatalogTest, FlashShapesInGgmlOrder) {
  const TensorCatalog cat = build_tensor_catalog(flash_config());
  EXPECT_EQ(get(cat, "token_embd.weight").ne, (V{4096, 129280}));
  EXPECT_EQ(get(cat, "output.weight").ne, (V{4096, 129280}));
  EXPECT_EQ(get(cat, "output_hc_fn.weight").ne, (V{16384, 4}));
  EXPECT_EQ(get(cat, "output_hc_scale.weight").ne, (V{1}));
  EXPECT_EQ(get(cat, "blk.0.attn_q_a.weight").ne, (V{4096, 1024}));
  EXPECT_EQ(get(cat, "blk.0.attn_q_b.weight").ne, (V{1024, 32768}));
  EXPECT_EQ(get(cat, "blk.0.attn_kv.weight").ne, (V{4096, 512}));
  EXPECT_EQ(get(cat, "blk.0.attn_output_a.weight").ne, (V{4096, 8192}));
  EXPECT_EQ(get(cat, "blk.0.attn_output_b.weight").ne, (V{8192, 4096}));
  EXPECT_EQ(get(cat, "blk.0.attn_sinks.weight").ne, (V{64}));
  EXPECT_EQ(get(cat, "blk.0.hc_attn_fn.weight").ne, (V{16384, 24}));
  EXPECT_EQ(get(cat, "blk.0.hc_ffn_scale.weight").ne, (V{3}));
  EXPECT_EQ(get(cat, "blk.0.ffn_gate_tid2eid.weight").ne, (V{6, 129280}));
  EXPECT_EQ(get(cat, "blk.0.ffn_gate_tid2eid.weight").type_class, TypeClass::Index);
  EXPECT_EQ(cat.find("blk.0.exp_probs_b.bias"), nullptr);
  EXPECT_EQ(cat.find("blk.3.ffn_gate_tid2eid.weight"), nullptr);
  EXPECT_EQ(get(cat, "blk.3.exp_probs_b.bias").ne, (V{256}));
  EXPECT_EQ(get(cat, "blk.5.ffn_gate_exps.weight").ne, (V{4096, 2048, 256}));
  EXPECT_EQ(get(cat, "blk.5.ffn_down_exps.weight").ne, (V{2048, 4096, 256}));
  EXPECT_EQ(get(cat, "blk.5.ffn_down_exps.weight").role, TensorRole::RoutedExperts);
  EXPECT_EQ(get(cat, "blk.5.ffn_up_shexp.weight").ne, (V{4096, 2048}));
  // Window-only layer 0: no compressor; CSA layer 2: overlapping compressor + indexer;
  // HCA layer 3: plain compressor.
  EXPECT_EQ(cat.find("blk.0.attn_compressor_kv.weight"), nullptr);
  EXPECT_EQ(get(cat, "blk.2.attn_compressor_kv.weight").ne, (V{4096, 1024}));
  EXPECT_EQ(get(cat, "blk.2.attn_compressor_ape.weight").ne, (V{1024, 4}));
  EXPECT_EQ(get(cat, "blk.2.indexer.attn_q_b.weight").ne, (V{1024, 8192}));
  EXPECT_EQ(get(cat, "blk.2.indexer.proj.weight").ne, (V{4096, 64}));
  EXPECT_EQ(get(cat, "blk.2.indexer_compressor_gate.weight").ne, (V{4096, 256}));
  EXPECT_EQ(get(cat, "blk.2.indexer_compressor_ape.weight").ne, (V{256, 4}));
  EXPECT_EQ(get(cat, "blk.2.indexer_compressor_norm.weight").ne, (V{128}));
  EXPECT_EQ(get(cat, "blk.3.attn_compressor_gate.weight").ne, (V{4096, 512}));
  EXPECT_EQ(get(cat, "blk.3.attn_compressor_ape.weight").ne, (V{512, 128}));
  EXPECT_EQ(cat.find("blk.3.indexer.proj.weight"), nullptr);
  // The MTP block: a window-only block plus the NextN tensors.
  EXPECT_EQ(get(cat, "blk.43.nextn.eh_proj.weight").ne, (V{8192, 4096}));
  EXPECT_EQ(get(cat, "blk.43.nextn.hc_head_fn.weight").ne, (V{16384, 4}));
  EXPECT_FALSE(get(cat, "blk.43.nextn.embed_tokens.weight").required);
  EXPECT_EQ(get(cat, "blk.43.exp_probs_b.bias").ne, (V{256}));
  EXPECT_EQ(cat.find("blk.43.attn_compressor_kv.weight"), nullptr);
  EXPECT_EQ(cat.find("blk.42.nextn.eh_proj.weight"), nullptr);
}

// V4-Pro (spec §1.4): the catalog follows from the config. Its parameter count is the
// published 1.6 T (1,598.8 B with the MTP block), of which the routed experts are
// blocks x experts x 3 matrices x width x hidden.
TEST(CatalogTest, ProCatalogFollowsFromItsConfig) {
  const ModelConfig c = pro_config();
  ASSERT_TRUE(c.validate().is_ok()) << c.validate().message();
  const TensorCatalog cat = build_tensor_catalog(c);
  uint64_t total = 0, experts = 0;
  for (const auto& t : cat.tensors) {
    if (!t.required) continue;
    total += t.n_elements();
    if (t.role == TensorRole::RoutedExperts) experts += t.n_elements();
  }
  EXPECT_EQ(experts, uint64_t{62} * 384 * 3 * 3072 * 7168);
  EXPECT_GT(total, 1'550'000'000'000u);
  EXPECT_LT(total, 1'650'000'000'000u);
  EXPECT_EQ(get(cat, "blk.0.attn_q_b.weight").ne, (V{1536, 65536}));
  EXPECT_EQ(get(cat, "blk.0.attn_output_a.weight").ne, (V{4096, 16384}));
  EXPECT_EQ(get(cat, "blk.0.attn_output_b.weight").ne, (V{16384, 7168}));
  EXPECT_EQ(get(cat, "blk.7.ffn_gate_exps.weight").ne, (V{7168, 3072, 384}));
  EXPECT_EQ(get(cat, "blk.0.ffn_gate_tid2eid.weight").ne, (V{6, 129280}));
  // Layers 0 and 1 are HCA (no window-only trunk layer), layer 2 CSA, the MTP block window-only.
  EXPECT_EQ(get(cat, "blk.0.attn_compressor_ape.weight").ne, (V{512, 128}));
  EXPECT_EQ(cat.find("blk.0.indexer.proj.weight"), nullptr);
  EXPECT_EQ(get(cat, "blk.2.indexer.attn_q_b.weight").ne, (V{1536, 8192}));
  EXPECT_EQ(get(cat, "blk.60.attn_compressor_ape.weight").ne, (V{1024, 4}));
  EXPECT_EQ(cat.find("blk.61.attn_compressor_kv.weight"), nullptr);
  EXPECT_EQ(get(cat, "blk.61.nextn.eh_proj.weight").ne, (V{14336, 7168}));
}

TEST(CatalogTest, NameHelpersAgreeWithTheCatalog) {
  const TensorCatalog cat = build_tensor_catalog(tiny_config());
  for (const auto& t : cat.tensors) {
    if (t.global_kind) EXPECT_EQ(t.name, global_tensor_name(*t.global_kind));
    if (t.block_kind) EXPECT_EQ(t.name, block_tensor_name(*t.block, *t.block_kind));
    EXPECT_NE(t.global_kind.has_value(), t.block_kind.has_value()) << t.name;
  }
  EXPECT_EQ(block_tensor_name(3, BlockTensor::AttnKv), "blk.3.attn_kv.weight");
  EXPECT_EQ(block_tensor_name(6, BlockTensor::NextnSharedHeadNorm), "blk.6.nextn.shared_head_norm.weight");
}

TEST(CatalogTest, TypeClasses) {
  EXPECT_TRUE(type_allowed(TypeClass::Matrix, GgmlType::Q2_K));
  EXPECT_TRUE(type_allowed(TypeClass::Matrix, GgmlType::IQ2_XXS));
  EXPECT_TRUE(type_allowed(TypeClass::Matrix, GgmlType::MXFP4));
  EXPECT_TRUE(type_allowed(TypeClass::Matrix, GgmlType::BF16));
  for (GgmlType t : {GgmlType::Q4_0, GgmlType::Q5_1, GgmlType::IQ1_S, GgmlType::IQ1_M, GgmlType::IQ2_XS,
                     GgmlType::IQ2_S, GgmlType::IQ3_XXS, GgmlType::IQ3_S, GgmlType::IQ4_NL, GgmlType::IQ4_XS})
    EXPECT_TRUE(type_allowed(TypeClass::Matrix, t)) << ggml_type_name(t);  // published files use them
  EXPECT_FALSE(type_allowed(TypeClass::Matrix, GgmlType::TQ1_0));  // not decoded by dsv4
  EXPECT_FALSE(type_allowed(TypeClass::Matrix, GgmlType::I32));
  EXPECT_TRUE(type_allowed(TypeClass::Vector, GgmlType::F16));
  EXPECT_FALSE(type_allowed(TypeClass::Vector, GgmlType::Q8_0));
  EXPECT_TRUE(type_allowed(TypeClass::Index, GgmlType::I32));
  EXPECT_FALSE(type_allowed(TypeClass::Index, GgmlType::F32));
}

std::vector<gguf::TensorInfo> infos_from(const TensorCatalog& cat) {
  std::vector<gguf::TensorInfo> out;
  for (const auto& s : cat.tensors) {
    if (!s.required) continue;
    gguf::TensorInfo t;
    t.name = s.name;
    t.ne = s.ne;
    t.type = s.type_class == TypeClass::Index ? GgmlType::I32
             : s.type_class == TypeClass::Vector ? GgmlType::F32 : GgmlType::Q8_0;
    out.push_back(t);
  }
  return out;
}

TEST(CatalogCheckTest, AcceptsACompleteFile) {
  const TensorCatalog cat = build_tensor_catalog(tiny_config());
  auto infos = infos_from(cat);
  // Trailing 1s (ggml pads to 4 dims) and optional tensors do not matter.
  for (auto& t : infos)
    if (t.name == "blk.0.attn_norm.weight") t.ne.push_back(1);
  gguf::TensorInfo optional;
  optional.name = "blk.6.nextn.embed_tokens.weight";
  optional.ne = {256, 129280};
  optional.type = GgmlType::BF16;
  infos.push_back(optional);
  const Status s = check_tensors(cat, infos, "m.gguf");
  EXPECT_TRUE(s.is_ok()) << s.message();
}

TEST(CatalogCheckTest, ReportsEveryProblemAtOnce) {
  const TensorCatalog cat = build_tensor_catalog(tiny_config());
  auto infos = infos_from(cat);
  std::erase_if(infos, [](const gguf::TensorInfo& t) { return t.name == "blk.1.indexer.proj.weight"; });
  for (auto& t : infos) {
    if (t.name == "blk.3.attn_kv.weight") t.ne = {4096, 512};
    if (t.name == "blk.2.attn_norm.weight") t.type = GgmlType::Q8_0;
    if (t.name == "blk.0.ffn_down_exps.weight") t.type = GgmlType::Q2_K;  // rows of 128
    if (t.name == "blk.0.ffn_gate_tid2eid.weight") t.type = GgmlType::F32;
  }
  gguf::TensorInfo extra;
  extra.name = "blk.0.attn_compressor_kv.weight";  // layer 0 is window-only
  extra.ne = {256, 256};
  infos.push_back(extra);

  const Status s = check_tensors(cat, infos, "m.gguf");
  ASSERT_FALSE(s.is_ok());
  const std::string& m = s.message();
  EXPECT_NE(m.find("6 tensor problems"), std::string::npos) << m;
  EXPECT_NE(m.find("m.gguf: tensor blk.3.attn_kv.weight: shape [512, 4096], expected [256, 256]"),
            std::string::npos) << m;
  EXPECT_NE(m.find("m.gguf: tensor blk.1.indexer.proj.weight: missing"), std::string::npos) << m;
  EXPECT_NE(m.find("m.gguf: tensor blk.0.attn_compressor_kv.weight: unexpected"), std::string::npos) << m;
  EXPECT_NE(m.find("m.gguf: tensor blk.2.attn_norm.weight: type q8_0 not allowed"), std::string::npos) << m;
  EXPECT_NE(m.find("m.gguf: tensor blk.0.ffn_down_exps.weight: row length 128"), std::string::npos) << m;
  EXPECT_NE(m.find("m.gguf: tensor blk.0.ffn_gate_tid2eid.weight: type f32 not allowed"), std::string::npos) << m;
}

TEST(CatalogTest, ShapeOuterFirst) {
  const std::vector<uint64_t> ne{4096, 512};
  EXPECT_EQ(shape_outer_first(ne), "[512, 4096]");
  const std::vector<uint64_t> three{4096, 2048, 256};
  EXPECT_EQ(shape_outer_first(three), "[256, 2048, 4096]");
}

}  // namespace
}  // namespace dsv4
