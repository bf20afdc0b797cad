// The tiny-v4 fixture checkpoint converted with every recipe: the GGUF passes the tensor
// catalog check, every lossless tensor decodes to exactly the checkpoint's de-quantised
// values (and those equal the fixture's own dequant.* samples), and requantised tensors
// stay within their type's error bound.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "convert/converter.h"
#include "convert/official_tensor.h"
#include "convert/safetensors.h"
#include "gguf/gguf_file.h"
#include "gguf/quant.h"
#include "support/test_support.h"
#include "util/float_formats.h"

namespace dsv4::convert {
namespace {

std::filesystem::path fixture_checkpoint() { return test::fixture_dir() / "checkpoint"; }

// The values a GGUF tensor decodes to, as f32.
std::vector<float> gguf_values(const gguf::TensorInfo& t) {
  std::vector<float> out(t.n_elements());
  const uint64_t row = t.ne[0];
  const uint64_t row_bytes = *ggml_row_bytes(t.type, row);
  for (uint64_t r = 0; r < t.n_rows(); ++r) {
    if (t.type == GgmlType::I32) {
      for (uint64_t c = 0; c < row; ++c) {
        int32_t v;
        std::memcpy(&v, t.data + r * row_bytes + 4 * c, 4);
        out[r * row + c] = static_cast<float>(v);
      }
    } else {
      dequantize_row(t.type, t.data + r * row_bytes, out.data() + r * row, static_cast<int64_t>(row));
    }
  }
  return out;
}

// The values the official checkpoint holds for a planned tensor, decoded exactly.
std::vector<float> official_values(const Checkpoint& ckpt, const PlannedTensor& t, const CheckpointFormat& fmt) {
  std::vector<float> out(t.spec.n_elements());
  const bool integer = t.source.layout == SourceLayout::Index;
  std::vector<OfficialTensor> parts;
  for (const auto& name : t.source.names)
    parts.push_back(*OfficialTensor::bind(ckpt, name, t.source.part_shape, fmt, integer));
  const uint64_t row = t.spec.ne[0];
  if (t.source.layout == SourceLayout::ColumnConcat) {
    const uint64_t cols = parts[0].cols();
    for (uint64_t r = 0; r < parts[0].rows(); ++r)
      for (size_t p = 0; p < parts.size(); ++p) parts[p].decode_rows(r, 1, out.data() + r * row + p * cols);
    return out;
  }
  float* dst = out.data();
  for (const auto& p : parts) {
    p.decode_rows(0, p.rows(), dst);
    dst += p.rows() * p.cols();
  }
  return out;
}

struct Converted {
  test::TempDir dir;
  ConvertSummary summary;
  std::optional<gguf::GgufFile> file;
};

std::unique_ptr<Converted> convert_fixture(const Recipe& recipe) {
  auto c = std::make_unique<Converted>();
  ConvertOptions opts;
  opts.checkpoint_dir = fixture_checkpoint();
  opts.output = c->dir / "tiny.gguf";
  opts.recipe = recipe;
  opts.threads = 2;
  opts.chunk_bytes = 4096;  // many chunks per tensor: exercises the chunk boundaries
  opts.layout = WriteLayout::Bundled;  // every tensor in one file, read whole below
  auto summary = convert_checkpoint(opts);
  EXPECT_TRUE(summary.is_ok()) << summary.status().message();
  if (!summary) return c;
  c->summary = std::move(*summary);
  auto file = gguf::GgufFile::open(opts.output.string());
  EXPECT_TRUE(file.is_ok()) << file.status().message();
  if (file) c->file.emplace(std::move(*file));
  return c;
}

// Bound on |quantised - exact| for one row, relative to the row's largest magnitude.
double row_error_bound(GgmlType type) {
  switch (type) {
    case GgmlType::Q8_0: return 1.0 / 127;
    case GgmlType::Q6_K: return 1.0 / 24;
    case GgmlType::Q5_K: return 1.0 / 12;
    case GgmlType::Q4_K: return 1.0 / 6;
    case GgmlType::Q3_K: return 1.0 / 3;
    case GgmlType::Q2_K: return 1.0 / 1.2;
    case GgmlType::MXFP4: return 1.0 / 3;
    case GgmlType::BF16: return 1.0 / 128;
    case GgmlType::F16: return 1.0 / 1024;
    default: return 0;
  }
}

void check_recipe(const std::string& name, bool lossless) {
  SCOPED_TRACE("recipe " + name);
  auto recipe = recipe_by_name(name);
  ASSERT_TRUE(recipe.is_ok());
  auto c = convert_fixture(*recipe);
  ASSERT_TRUE(c->file.has_value());
  const gguf::GgufFile& file = *c->file;

  auto model_config = ModelConfig::from_gguf(file);
  ASSERT_TRUE(model_config.is_ok()) << model_config.status().message();
  const TensorCatalog catalog = build_tensor_catalog(*model_config);
  Status check = check_tensors(catalog, file.tensors(), "tiny.gguf");
  EXPECT_TRUE(check.is_ok()) << check.message();
  EXPECT_EQ(file.tensors().size(), c->summary.plan.tensors.size());

  auto ckpt = Checkpoint::open(fixture_checkpoint());
  ASSERT_TRUE(ckpt.is_ok());
  for (const PlannedTensor& t : c->summary.plan.tensors) {
    SCOPED_TRACE(t.spec.name);
    const gguf::TensorInfo* info = file.find_tensor(t.spec.name);
    ASSERT_NE(info, nullptr);
    EXPECT_EQ(info->type, t.type);
    const std::vector<float> got = gguf_values(*info);
    const std::vector<float> want = official_values(*ckpt, t, c->summary.plan.config.format);
    ASSERT_EQ(got.size(), want.size());
    const bool exact = lossless || t.type == GgmlType::F32 || t.type == GgmlType::I32 ||
                       (t.type == GgmlType::MXFP4 && t.source.layout == SourceLayout::ExpertStack);
    const uint64_t row = t.spec.ne[0];
    uint64_t mismatches = 0;
    for (uint64_t r = 0; r < got.size() / row; ++r) {
      double amax = 0;
      for (uint64_t k = 0; k < row; ++k) amax = std::max(amax, std::fabs(double(want[r * row + k])));
      const double bound = exact ? 0 : row_error_bound(t.type) * amax;
      for (uint64_t k = 0; k < row; ++k) {
        const double g = got[r * row + k], w = want[r * row + k];
        if (std::isnan(g) || std::fabs(g - w) > bound) ++mismatches;
      }
    }
    EXPECT_EQ(mismatches, 0u) << ggml_type_name(t.type) << (exact ? " (exact)" : " (bounded)");
  }
}

TEST(ConvertFixture, Bf16RecipeIsLossless) { check_recipe("bf16", true); }
TEST(ConvertFixture, F32RecipeIsLossless) { check_recipe("f32", true); }
TEST(ConvertFixture, Mxfp4RecipeKeepsExpertsExact) { check_recipe("mxfp4", false); }
TEST(ConvertFixture, Q2kRecipeWithinBounds) { check_recipe("q2k", false); }
TEST(ConvertFixture, Q4kRecipeWithinBounds) { check_recipe("q4k", false); }
TEST(ConvertFixture, Q8RecipeWithinBounds) { check_recipe("q8", false); }

// The checkpoint decoder against the fixture's own de-quantised samples (BF16, exact).
TEST(ConvertFixture, DecodedWeightsEqualReferenceDequantSamples) {
  auto ckpt = Checkpoint::open(fixture_checkpoint());
  ASSERT_TRUE(ckpt.is_ok()) << ckpt.status().message();
  auto ref = SafetensorsFile::open(test::fixture_dir() / "reference.safetensors");
  ASSERT_TRUE(ref.is_ok()) << ref.status().message();
  int checked = 0;
  for (const StTensor& sample : ref->tensors()) {
    if (!sample.name.starts_with("dequant.")) continue;
    SCOPED_TRACE(sample.name);
    ASSERT_EQ(sample.dtype, StDtype::BF16);
    const std::string name = sample.name.substr(std::strlen("dequant."));
    auto t = OfficialTensor::bind(*ckpt, name, sample.shape, CheckpointFormat{});
    ASSERT_TRUE(t.is_ok()) << t.status().message();
    std::vector<float> got(sample.n_elements());
    t->decode_rows(0, t->rows(), got.data());
    uint64_t mismatches = 0;
    for (uint64_t i = 0; i < got.size(); ++i) {
      uint16_t b;
      std::memcpy(&b, sample.data + 2 * i, 2);
      if (got[i] != bf16_to_f32(b)) ++mismatches;
    }
    EXPECT_EQ(mismatches, 0u);
    ++checked;
  }
  EXPECT_EQ(checked, 4);
}

// The FP4 -> MXFP4 repack is lossless: ggml's MXFP4 decoder gives the official values.
TEST(ConvertFixture, Mxfp4RepackDecodesToOfficialValues) {
  auto ckpt = Checkpoint::open(fixture_checkpoint());
  ASSERT_TRUE(ckpt.is_ok());
  for (const char* name : {"layers.2.ffn.experts.7.w1.weight", "layers.0.ffn.experts.3.w2.weight"}) {
    SCOPED_TRACE(name);
    const StTensor* w = ckpt->find(name);
    ASSERT_NE(w, nullptr);
    const uint64_t rows = w->shape[0], cols = w->shape[1] * 2;
    auto t = OfficialTensor::bind(*ckpt, name, {rows, cols}, CheckpointFormat{});
    ASSERT_TRUE(t.is_ok()) << t.status().message();
    ASSERT_TRUE(t->has_mxfp4_layout());
    std::vector<block_mxfp4> blocks(cols / QK_MXFP4);
    std::vector<float> want(cols), got(cols);
    for (uint64_t r = 0; r < rows; ++r) {
      t->decode_rows(r, 1, want.data());
      t->mxfp4_rows(r, 1, blocks.data());
      std::fill(got.begin(), got.end(), std::nanf(""));
      dequantize_row(GgmlType::MXFP4, blocks.data(), got.data(), static_cast<int64_t>(cols));
      for (uint64_t k = 0; k < cols; ++k) ASSERT_EQ(got[k], want[k]) << "row " << r << " col " << k;
    }
  }
}

TEST(ConvertFixture, FallbacksAreListed) {
  auto recipe = recipe_by_name("q2k");
  ASSERT_TRUE(recipe.is_ok());
  auto config = read_checkpoint_config(fixture_checkpoint());
  ASSERT_TRUE(config.is_ok()) << config.status().message();
  auto plan = plan_conversion(*config, *recipe);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  // The tiny model's rows are 64..1024 wide: the 256-blocks of K-quants often do not fit.
  const PlannedTensor* down = nullptr;
  for (const auto& t : plan->tensors)
    if (t.spec.name == "blk.2.ffn_down_exps.weight") down = &t;
  ASSERT_NE(down, nullptr);
  EXPECT_EQ(down->requested, GgmlType::Q3_K);
  EXPECT_EQ(down->type, GgmlType::MXFP4);  // row length 128: the smallest type of >= 3.44 bits
  const PlannedTensor* gate = nullptr;
  for (const auto& t : plan->tensors)
    if (t.spec.name == "blk.2.ffn_gate_exps.weight") gate = &t;
  ASSERT_NE(gate, nullptr);
  EXPECT_EQ(gate->type, GgmlType::Q2_K);  // row length 256 fits
}

}  // namespace
}  // namespace dsv4::convert
