// Synthetic official checkpoints through the converter: the values survive (within the
// FP8/FP4 storage error of the drawn weights), shards and the index are followed, and every
// malformed checkpoint (missing shard, missing tensor, wrong shape, wrong dtype, truncated
// shard, bad tid2eid, stray tensor) is a clear error that leaves no output file behind.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "convert/checkpoint_config.h"
#include "convert/converter.h"
#include "convert/safetensors.h"
#include "convert/safetensors_writer.h"
#include "convert/synthetic_checkpoint.h"
#include "gguf/gguf_file.h"
#include "gguf/quant.h"
#include "synth/synth.h"
#include "support/test_support.h"

namespace dsv4::convert {
namespace {

CheckpointConfig fixture_config() {
  auto c = read_checkpoint_config(test::fixture_dir() / "checkpoint");
  EXPECT_TRUE(c.is_ok()) << c.status().message();
  return *c;
}

std::filesystem::path make_checkpoint(const test::TempDir& dir, uint64_t seed) {
  SyntheticCheckpointOptions opts;
  opts.config = fixture_config();
  opts.seed = seed;
  opts.shard_max_bytes = 3'000'000;  // several shards
  opts.threads = 2;
  const auto path = dir / "ckpt";
  auto report = write_synthetic_checkpoint(path, opts);
  EXPECT_TRUE(report.is_ok()) << report.status().message();
  if (report) EXPECT_GT(report->shards.size(), 1u);
  return path;
}

Result<ConvertSummary> convert(const std::filesystem::path& ckpt, const std::filesystem::path& out,
                               const std::string& recipe = "bf16", bool force = false) {
  ConvertOptions opts;
  opts.checkpoint_dir = ckpt;
  opts.output = out;
  opts.recipe = *recipe_by_name(recipe);
  opts.threads = 2;
  opts.force = force;
  opts.layout = WriteLayout::Bundled;  // the tests read every tensor from one file
  return convert_checkpoint(opts);
}

using Edit = std::function<bool(StDtype&, std::vector<uint64_t>&, std::vector<uint8_t>&)>;

std::string shard_of(const std::filesystem::path& ckpt, const std::string& name) {
  nlohmann::json index;
  std::ifstream(ckpt / "model.safetensors.index.json") >> index;
  return index["weight_map"][name];
}

// Rewrites the shard holding `name` through `edit`, which may change the dtype label, the
// shape or the bytes, or drop the tensor (returns false); the index follows.
void rewrite_tensor(const std::filesystem::path& ckpt, const std::string& name, const Edit& edit) {
  const auto index_path = ckpt / "model.safetensors.index.json";
  nlohmann::json index;
  std::ifstream(index_path) >> index;
  const std::string shard = index["weight_map"][name];
  const auto path = ckpt / shard;
  const auto copy = ckpt / (shard + ".orig");
  std::filesystem::rename(path, copy);
  {
    auto in = SafetensorsFile::open(copy);
    ASSERT_TRUE(in.is_ok()) << in.status().message();
    SafetensorsWriter out(path);
    std::vector<std::vector<uint8_t>> data;
    for (const StTensor& t : in->tensors()) {
      StDtype dtype = t.dtype;
      std::vector<uint64_t> shape = t.shape;
      std::vector<uint8_t> bytes(t.data, t.data + t.nbytes);
      if (t.name == name && !edit(dtype, shape, bytes)) continue;
      out.add_tensor(t.name, dtype, shape);
      data.push_back(std::move(bytes));
    }
    ASSERT_TRUE(out.begin().is_ok());
    for (const auto& bytes : data) ASSERT_TRUE(out.write(bytes).is_ok());
    ASSERT_TRUE(out.finish().is_ok());
  }
  std::filesystem::remove(copy);
  bool still_there = false;
  auto in = SafetensorsFile::open(path);
  ASSERT_TRUE(in.is_ok());
  still_there = in->find(name) != nullptr;
  if (!still_there) {
    index["weight_map"].erase(name);
    std::ofstream(index_path) << index.dump(2);
  }
}

// The conversion fails, the message holds every fragment, and the folder has no output.
void expect_failure(const std::filesystem::path& ckpt, const test::TempDir& dir,
                    std::vector<std::string> fragments) {
  const auto out = dir / "out.gguf";
  auto r = convert(ckpt, out);
  ASSERT_FALSE(r.is_ok());
  for (const auto& f : fragments)
    EXPECT_NE(r.status().message().find(f), std::string::npos) << "\"" << f << "\" not in: " << r.status().message();
  EXPECT_FALSE(std::filesystem::exists(out));
  EXPECT_FALSE(std::filesystem::exists(dir / "out.gguf.tmp"));
}

TEST(ConvertCheckpoints, SyntheticCheckpointConvertsToDrawnValues) {
  test::TempDir dir;
  const uint64_t seed = test::test_seed();
  const auto ckpt = make_checkpoint(dir, seed);
  auto summary = convert(ckpt, dir / "out.gguf", "f32");
  ASSERT_TRUE(summary.is_ok()) << summary.status().message();
  auto file = gguf::GgufFile::open((dir / "out.gguf").string());
  ASSERT_TRUE(file.is_ok()) << file.status().message();
  auto config = ModelConfig::from_gguf(*file);
  ASSERT_TRUE(config.is_ok()) << config.status().message();
  const TensorCatalog catalog = build_tensor_catalog(*config);
  EXPECT_TRUE(check_tensors(catalog, file->tensors(), "out.gguf").is_ok());

  // FP8 keeps 3 mantissa bits (relative error <= 2^-4 of the value, plus the subnormal
  // step of its block), FP4 E2M1 is coarser (<= 1/4 of a 32-group's scale).
  for (const PlannedTensor& t : summary->plan.tensors) {
    SCOPED_TRACE(t.spec.name + " (seed " + std::to_string(seed) + ")");
    const gguf::TensorInfo* info = file->find_tensor(t.spec.name);
    ASSERT_NE(info, nullptr);
    const uint64_t row = t.spec.ne[0];
    std::vector<float> drawn(row), got(row);
    double worst = 0, scale = 0;
    for (uint64_t r = 0; r < info->n_rows(); ++r) {
      synth_rows(fixture_config().model, t.spec, seed, r, 1, drawn.data());
      const uint8_t* src = info->data + r * *ggml_row_bytes(info->type, row);
      if (info->type == GgmlType::I32) {
        for (uint64_t k = 0; k < row; ++k) {
          int32_t v;
          std::memcpy(&v, src + 4 * k, 4);
          got[k] = static_cast<float>(v);
        }
      } else {
        dequantize_row(info->type, src, got.data(), static_cast<int64_t>(row));
      }
      for (uint64_t k = 0; k < row; ++k) {
        ASSERT_FALSE(std::isnan(got[k]));
        worst = std::max(worst, std::fabs(double(got[k]) - drawn[k]));
        scale = std::max(scale, std::fabs(double(drawn[k])));
      }
    }
    const bool fp4 = t.source.layout == SourceLayout::ExpertStack;
    const bool exact = t.spec.type_class != TypeClass::Matrix || t.spec.name.find("hc_") != std::string::npos;
    const double bound = exact ? (t.spec.type_class == TypeClass::Index ? 0 : scale * 0x1p-8)  // BF16 norms
                               : scale * (fp4 ? 0.25 : 0x1p-4);
    EXPECT_LE(worst, bound) << "largest drawn magnitude " << scale;
  }
}

TEST(ConvertCheckpoints, OutputIsReplacedOnlyWithForce) {
  test::TempDir dir;
  const auto ckpt = make_checkpoint(dir, 7);
  const auto out = dir / "out.gguf";
  { std::ofstream(out) << "precious"; }
  auto r = convert(ckpt, out);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("--force"), std::string::npos) << r.status().message();
  std::string text;
  std::ifstream(out) >> text;
  EXPECT_EQ(text, "precious");
  auto forced = convert(ckpt, out, "bf16", true);
  ASSERT_TRUE(forced.is_ok()) << forced.status().message();
  EXPECT_TRUE(gguf::GgufFile::open(out.string()).is_ok());
}

TEST(ConvertCheckpoints, MissingShard) {
  test::TempDir dir;
  const auto ckpt = make_checkpoint(dir, 1);
  const std::string shard = shard_of(ckpt, "layers.2.attn.wq_b.weight");
  std::filesystem::remove(ckpt / shard);
  expect_failure(ckpt, dir, {shard, "missing shard"});
}

TEST(ConvertCheckpoints, MissingTensor) {
  test::TempDir dir;
  const auto ckpt = make_checkpoint(dir, 2);
  rewrite_tensor(ckpt, "layers.3.attn.wkv.weight", [](StDtype&, std::vector<uint64_t>&, std::vector<uint8_t>&) { return false; });
  expect_failure(ckpt, dir, {"1 problem", "layers.3.attn.wkv.weight is missing (expected shape [256, 256])"});
}

TEST(ConvertCheckpoints, MissingExpert) {
  test::TempDir dir;
  const auto ckpt = make_checkpoint(dir, 3);
  rewrite_tensor(ckpt, "mtp.0.ffn.experts.5.w2.weight", [](StDtype&, std::vector<uint64_t>&, std::vector<uint8_t>&) { return false; });
  expect_failure(ckpt, dir, {"mtp.0.ffn.experts.5.w2.weight is missing"});
}

TEST(ConvertCheckpoints, WrongShape) {
  test::TempDir dir;
  const auto ckpt = make_checkpoint(dir, 4);
  rewrite_tensor(ckpt, "layers.1.attn.wq_a.weight", [](StDtype&, std::vector<uint64_t>& shape, std::vector<uint8_t>&) {
    shape = {shape[1], shape[0]};
    return true;
  });
  expect_failure(ckpt, dir, {"layers.1.attn.wq_a.weight", "shape [256, 64], expected [64, 256]"});
}

TEST(ConvertCheckpoints, WrongDtype) {
  test::TempDir dir;
  const auto ckpt = make_checkpoint(dir, 5);
  rewrite_tensor(ckpt, "layers.2.attn_norm.weight", [](StDtype& dtype, std::vector<uint64_t>&, std::vector<uint8_t>&) {
    dtype = StDtype::I16;
    return true;
  });
  rewrite_tensor(ckpt, "layers.2.ffn.experts.1.w1.scale", [](StDtype& dtype, std::vector<uint64_t>&, std::vector<uint8_t>&) {
    dtype = StDtype::U8;
    return true;
  });
  expect_failure(ckpt, dir, {"layers.2.attn_norm.weight: dtype I16, expected BF16 or F16 or F32",
                             "layers.2.ffn.experts.1.w1.scale: dtype U8, expected F8_E8M0 or F32"});
}

TEST(ConvertCheckpoints, TruncatedShard) {
  test::TempDir dir;
  const auto ckpt = make_checkpoint(dir, 6);
  const std::string shard = shard_of(ckpt, "layers.4.attn.wq_b.weight");
  std::filesystem::resize_file(ckpt / shard, std::filesystem::file_size(ckpt / shard) - 1000);
  expect_failure(ckpt, dir, {shard, "file truncated?"});
}

TEST(ConvertCheckpoints, RepeatedExpertInTid2eid) {
  test::TempDir dir;
  const auto ckpt = make_checkpoint(dir, 8);
  rewrite_tensor(ckpt, "layers.1.ffn.gate.tid2eid", [](StDtype&, std::vector<uint64_t>& shape, std::vector<uint8_t>& bytes) {
    // Row 9 gets its first expert twice.
    std::memcpy(bytes.data() + (9 * shape[1] + 1) * 8, bytes.data() + 9 * shape[1] * 8, 8);
    return true;
  });
  expect_failure(ckpt, dir, {"layers.1.ffn.gate.tid2eid", "row 9 lists expert", "twice"});
}

TEST(ConvertCheckpoints, ExpertIdOutOfRange) {
  test::TempDir dir;
  const auto ckpt = make_checkpoint(dir, 11);
  rewrite_tensor(ckpt, "layers.0.ffn.gate.tid2eid", [](StDtype&, std::vector<uint64_t>&, std::vector<uint8_t>& bytes) {
    const int64_t bad = 8;  // the fixture has 8 experts
    std::memcpy(bytes.data() + 3 * 8, &bad, 8);
    return true;
  });
  expect_failure(ckpt, dir, {"layers.0.ffn.gate.tid2eid", "row 1 holds expert 8, outside [0, 8)"});
}

TEST(ConvertCheckpoints, StrayTensor) {
  test::TempDir dir;
  const auto ckpt = make_checkpoint(dir, 9);
  const std::string shard = shard_of(ckpt, "layers.0.attn.attn_sink");
  {
    auto in = SafetensorsFile::open(ckpt / shard);
    ASSERT_TRUE(in.is_ok());
    SafetensorsWriter out(ckpt / (shard + ".new"));
    for (const StTensor& t : in->tensors()) out.add_tensor(t.name, t.dtype, t.shape);
    out.add_tensor("layers.0.attn.extra_bias", StDtype::F32, {4});
    ASSERT_TRUE(out.begin().is_ok());
    for (const StTensor& t : in->tensors()) ASSERT_TRUE(out.write(t.bytes()).is_ok());
    const float extra[4] = {1, 2, 3, 4};
    ASSERT_TRUE(out.write({reinterpret_cast<const uint8_t*>(extra), 16}).is_ok());
    ASSERT_TRUE(out.finish().is_ok());
  }
  std::filesystem::rename(ckpt / (shard + ".new"), ckpt / shard);
  expect_failure(ckpt, dir, {"layers.0.attn.extra_bias (F32 [4]) is not part of a DeepSeek-V4 model"});
}

TEST(ConvertCheckpoints, BadConfig) {
  test::TempDir dir;
  const auto ckpt = make_checkpoint(dir, 10);
  nlohmann::json config;
  std::ifstream(ckpt / "config.json") >> config;
  config.erase("q_lora_rank");
  std::ofstream(ckpt / "config.json") << config.dump();
  expect_failure(ckpt, dir, {"config.json: key q_lora_rank is missing"});
}

}  // namespace
}  // namespace dsv4::convert
