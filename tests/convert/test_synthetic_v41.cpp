// A synthetic V4.1 checkpoint (dsv4 synth-checkpoint's writer) in the release format
// converts to a deepseek41 GGUF: the catalog passes, the Engram rows are the checkpoint's
// FP8 rows byte for byte, and the file's token map and constants are DeepSeek's.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "convert/converter.h"
#include "convert/official_tensor.h"
#include "convert/safetensors.h"
#include "convert/synthetic_checkpoint.h"
#include "gguf/gguf_file.h"
#include "model/engram.h"
#include "model/engram_table.h"
#include "model/tensor_catalog.h"
#include "support/test_support.h"
#include "synth/presets.h"

namespace dsv4::convert {
namespace {

TEST(SyntheticV41Test, ReleaseFormatCheckpointConverts) {
  test::TempDir dir;
  SyntheticCheckpointOptions opts;
  opts.config.model = keep_first_layers(tiny41_config(), 3).value();
  opts.config.format.fp8_block_rows = opts.config.format.fp8_block_cols = 32;
  opts.seed = 11;
  opts.threads = 2;
  auto report = write_synthetic_checkpoint(dir / "ckpt", opts);
  ASSERT_TRUE(report.is_ok()) << report.status().message();
  auto back = read_checkpoint_config(dir / "ckpt");
  ASSERT_TRUE(back.is_ok()) << back.status().message();
  EXPECT_TRUE(back->model.is_v41());
  EXPECT_EQ(back->model.kv_source_layers, opts.config.model.kv_source_layers);
  EXPECT_EQ(back->model.engram->table_rows, opts.config.model.engram->table_rows);

  // tokenizer_config.json beside tokenizer.json, as in the official folders (llama.cpp's
  // converter and transformers read it): its BOS/EOS are tokens 0 and 1 of tokenizer.json.
  const auto tokenizer = nlohmann::json::parse(std::ifstream(dir / "ckpt" / "tokenizer.json"), nullptr, false);
  const auto tconfig = nlohmann::json::parse(std::ifstream(dir / "ckpt" / "tokenizer_config.json"), nullptr, false);
  ASSERT_FALSE(tokenizer.is_discarded());
  ASSERT_FALSE(tconfig.is_discarded());
  EXPECT_EQ(tconfig["tokenizer_class"], "PreTrainedTokenizerFast");
  EXPECT_EQ(tconfig["add_bos_token"], false);
  EXPECT_EQ(tokenizer["model"]["vocab"][tconfig["bos_token"]["content"].get<std::string>()], 0);
  EXPECT_EQ(tokenizer["model"]["vocab"][tconfig["eos_token"]["content"].get<std::string>()], 1);

  ConvertOptions c;
  c.checkpoint_dir = dir / "ckpt";
  c.output = dir / "m.gguf";
  c.recipe = recipe_by_name("bf16").value();  // raw copies: the fastest conversion
  c.threads = 2;
  auto summary = convert_checkpoint(c);
  ASSERT_TRUE(summary.is_ok()) << summary.status().message();
  EXPECT_TRUE(summary->tokenizer_written);
  auto file = gguf::GgufFile::open(c.output.string());
  ASSERT_TRUE(file.is_ok());
  auto config = ModelConfig::from_gguf(*file);
  ASSERT_TRUE(config.is_ok()) << config.status().message();
  EXPECT_TRUE(check_tensors(build_tensor_catalog(*config), file->tensors(), "m.gguf").is_ok());
  auto hasher = EngramHasher::from_gguf(*file, *config);
  ASSERT_TRUE(hasher.is_ok()) << hasher.status().message();
  EXPECT_EQ(hasher->token_map().size(), 129280u);

  // Row r of the GGUF table = the checkpoint's codes of row r, then its scales.
  auto ckpt = Checkpoint::open(dir / "ckpt");
  ASSERT_TRUE(ckpt.is_ok());
  const StTensor* codes = ckpt->find("layers.2.engram.embed.weight");
  const StTensor* scales = ckpt->find("layers.2.engram.embed.scale");
  ASSERT_TRUE(codes && scales);
  const gguf::TensorInfo* t = file->find_tensor("blk.2.engram_embd.weight");
  ASSERT_NE(t, nullptr);
  const uint64_t dim = config->engram->dim, row = engram_row_bytes(dim);
  ASSERT_EQ(t->nbytes, codes->n_elements() + scales->n_elements());
  for (uint64_t r = 0; r < t->n_rows(); ++r) {
    ASSERT_EQ(std::memcmp(t->data + r * row, codes->data + r * dim, dim), 0) << r;
    ASSERT_EQ(std::memcmp(t->data + r * row + dim, scales->data + r * (dim / 32), dim / 32), 0) << r;
  }
}

}  // namespace
}  // namespace dsv4::convert
