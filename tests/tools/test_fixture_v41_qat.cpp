// The V4.1 reference's QAT rules on its own recorded inputs (shared/fixtures/tiny-v41/
// README.md, "Recommended tests" 3: exact, 0 mismatches): the FP8 rule on the window KV
// (all head_dim dims, blocks of 32), FP4 with E4M3 scales per 16 on the compressed KV,
// FP4 with E8M0 scales per 32 on the index keys.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "convert/safetensors.h"
#include "support/test_support.h"

namespace dsv4 {
namespace {

const convert::SafetensorsFile& reference() {
  static const convert::SafetensorsFile ref =
      convert::SafetensorsFile::open(test::shared_dir() / "fixtures/tiny-v41/reference.safetensors").value();
  return ref;
}

std::vector<float> ref_f32(const std::string& name, int64_t& rows, int64_t& cols) {
  const convert::StTensor* t = reference().find(name);
  EXPECT_NE(t, nullptr) << name;
  if (!t || t->dtype != convert::StDtype::F32 || t->shape.size() != 2) return {};
  rows = static_cast<int64_t>(t->shape[0]);
  cols = static_cast<int64_t>(t->shape[1]);
  std::vector<float> v(t->n_elements());
  std::memcpy(v.data(), t->data, t->nbytes);
  return v;
}

enum class Rule { Fp8Blocks32, Fp4E4m3Blocks16, Fp4E8m0Blocks32 };

void check_rule(const std::string& prequant, const std::string& expected, Rule rule) {
  SCOPED_TRACE(prequant);
  int64_t rows = 0, cols = 0, rows2 = 0, cols2 = 0;
  const std::vector<float> in = ref_f32(prequant, rows, cols), want = ref_f32(expected, rows2, cols2);
  ASSERT_FALSE(in.empty());
  ASSERT_EQ(rows, rows2);
  ASSERT_EQ(cols, cols2);
  backend::CpuBackend be;
  backend::Tensor t = be.alloc(GgmlType::F32, std::vector<int64_t>{rows, cols}).value();
  ASSERT_TRUE(be.upload(t, in.data(), in.size() * sizeof(float)).is_ok());
  Status s = rule == Rule::Fp8Blocks32       ? be.round_fp8_blocks(t, cols, 32)
             : rule == Rule::Fp4E4m3Blocks16 ? be.round_fp4_e4m3_blocks(t, 16)
                                             : be.round_fp4_blocks(t, 32);
  ASSERT_TRUE(s.is_ok()) << s.message();
  std::vector<float> got(in.size(), std::nanf(""));
  ASSERT_TRUE(be.download(t, got.data(), got.size() * sizeof(float)).is_ok());
  int64_t mismatches = 0, changed = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    mismatches += std::memcmp(&got[i], &want[i], sizeof(float)) != 0;
    changed += got[i] != in[i];
  }
  EXPECT_EQ(mismatches, 0) << "of " << got.size();
  EXPECT_GT(changed, static_cast<int64_t>(got.size() / 2));  // the rule really rounds
}

std::string qat_name(int layer, const char* what) { return "qat.layers." + std::to_string(layer) + "." + what; }

TEST(FixtureV41Qat, WindowKvFp8AllDimsBlocksOf32) {
  for (int layer : {0, 2}) check_rule(qat_name(layer, "window_kv_prequant"), qat_name(layer, "window_kv"), Rule::Fp8Blocks32);
}

TEST(FixtureV41Qat, CompressedKvFp4E4m3ScalesPer16) {
  for (int layer : {2, 4})
    check_rule(qat_name(layer, "compressed_kv_prequant"), qat_name(layer, "compressed_kv"), Rule::Fp4E4m3Blocks16);
}

TEST(FixtureV41Qat, IndexKeysFp4E8m0ScalesPer32) {
  for (int layer : {2, 4}) check_rule(qat_name(layer, "index_k_prequant"), qat_name(layer, "index_k"), Rule::Fp4E8m0Blocks32);
}

}  // namespace
}  // namespace dsv4
