// Recipes: role assignment, --type overrides and the block-size fallback rule.
#include <gtest/gtest.h>

#include "convert/recipe.h"

namespace dsv4::convert {
namespace {

TensorSpec block_spec(BlockTensor kind, std::vector<uint64_t> ne, TypeClass cls = TypeClass::Matrix) {
  TensorSpec s;
  s.name = block_tensor_name(3, kind);
  s.ne = std::move(ne);
  s.type_class = cls;
  s.block = 3;
  s.block_kind = kind;
  return s;
}

TEST(Recipe, RolesOfTensors) {
  EXPECT_EQ(convert_role_of(block_spec(BlockTensor::FfnGateExps, {4096, 2048, 256})), ConvertRole::Experts);
  EXPECT_EQ(convert_role_of(block_spec(BlockTensor::FfnUpExps, {4096, 2048, 256})), ConvertRole::Experts);
  EXPECT_EQ(convert_role_of(block_spec(BlockTensor::FfnDownExps, {2048, 4096, 256})), ConvertRole::ExpertsDown);
  EXPECT_EQ(convert_role_of(block_spec(BlockTensor::AttnOutputA, {4096, 8192})), ConvertRole::Attention);
  EXPECT_EQ(convert_role_of(block_spec(BlockTensor::FfnDownShexp, {2048, 4096})), ConvertRole::Shared);
  EXPECT_EQ(convert_role_of(block_spec(BlockTensor::IndexerCompressorKv, {4096, 256})), ConvertRole::Indexer);
  EXPECT_EQ(convert_role_of(block_spec(BlockTensor::CompressorGate, {4096, 1024})), ConvertRole::Compressor);
  EXPECT_EQ(convert_role_of(block_spec(BlockTensor::FfnGateInp, {4096, 256})), ConvertRole::Router);
  EXPECT_EQ(convert_role_of(block_spec(BlockTensor::NextnEhProj, {8192, 4096})), ConvertRole::Mtp);
  EXPECT_EQ(convert_role_of(block_spec(BlockTensor::HcAttnFn, {16384, 24})), ConvertRole::Small);
  EXPECT_EQ(convert_role_of(block_spec(BlockTensor::AttnSinks, {64}, TypeClass::Vector)), ConvertRole::Small);
  TensorSpec embd;
  embd.global_kind = GlobalTensor::TokenEmbd;
  EXPECT_EQ(convert_role_of(embd), ConvertRole::Embedding);
  TensorSpec head;
  head.global_kind = GlobalTensor::Output;
  EXPECT_EQ(convert_role_of(head), ConvertRole::Head);
}

TEST(Recipe, Overrides) {
  auto r = recipe_by_name("q2k");
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r->type(ConvertRole::Experts), GgmlType::Q2_K);
  EXPECT_EQ(r->type(ConvertRole::ExpertsDown), GgmlType::Q3_K);
  EXPECT_EQ(r->type(ConvertRole::Head), GgmlType::Q6_K);
  ASSERT_TRUE(apply_type_override(*r, "experts_down=q4_k").is_ok());
  EXPECT_EQ(r->type(ConvertRole::ExpertsDown), GgmlType::Q4_K);
  ASSERT_TRUE(apply_type_override(*r, "all=q8_0").is_ok());
  EXPECT_EQ(r->type(ConvertRole::Experts), GgmlType::Q8_0);
  EXPECT_EQ(r->type(ConvertRole::Small), GgmlType::F32);  // small tensors stay float
  ASSERT_TRUE(apply_type_override(*r, "all=bf16").is_ok());
  EXPECT_EQ(r->type(ConvertRole::Small), GgmlType::BF16);

  for (const char* bad : {"experts", "experts=q9_9", "experts=iq4_nl", "small=q8_0", "heads=q8_0", "=f32"}) {
    Status s = apply_type_override(*r, bad);
    EXPECT_FALSE(s.is_ok()) << bad;
    EXPECT_NE(s.message().find(bad), std::string::npos) << s.message();
  }
  EXPECT_FALSE(recipe_by_name("q3").is_ok());
}

TEST(Recipe, FallbackPicksTheSmallestTypeAtLeastAsPrecise) {
  auto r = recipe_by_name("q2k");
  ASSERT_TRUE(r.is_ok());
  struct Case {
    const char* type;
    uint64_t row;
    GgmlType want;
  };
  const std::vector<Case> cases = {
      {"q2_k", 4096, GgmlType::Q2_K}, {"q2_k", 128, GgmlType::MXFP4}, {"q3_k", 96, GgmlType::MXFP4},
      {"q4_k", 128, GgmlType::Q8_0},  {"q5_k", 64, GgmlType::Q8_0},   {"q6_k", 32, GgmlType::Q8_0},
      {"q8_0", 48, GgmlType::BF16},   {"mxfp4", 40, GgmlType::BF16},  {"f16", 7, GgmlType::F16},
      {"f32", 7, GgmlType::F32},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.type) + " row " + std::to_string(c.row));
    ASSERT_TRUE(apply_type_override(*r, std::string("experts=") + c.type).is_ok());
    auto choice = choose_type(*r, block_spec(BlockTensor::FfnGateExps, {c.row, 64, 8}));
    ASSERT_TRUE(choice.is_ok()) << choice.status().message();
    EXPECT_EQ(choice->type, c.want);
    EXPECT_EQ(choice->fallback(), choice->type != *ggml_type_from_name(c.type));
  }
  auto vec = choose_type(*r, block_spec(BlockTensor::AttnNorm, {256}, TypeClass::Vector));
  ASSERT_TRUE(vec.is_ok());
  EXPECT_EQ(vec->type, GgmlType::F32);
  auto idx = choose_type(*r, block_spec(BlockTensor::FfnTid2Eid, {6, 129280}, TypeClass::Index));
  ASSERT_TRUE(idx.is_ok());
  EXPECT_EQ(idx->type, GgmlType::I32);
}

}  // namespace
}  // namespace dsv4::convert
