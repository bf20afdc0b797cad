// The tiny-v41 fixture (DeepSeek's official V4.1 release format and reference outputs,
// shared/fixtures/tiny-v41/README.md): config.json parses to the release's settings; the
// checkpoint converts to a deepseek41 GGUF that passes the catalog; FP8 / FP4 / Engram
// tensors de-quantise to exactly the reference's dequant.* samples; the file's token map
// and hash constants equal the reference's; the hash ids of both prompts (in one prefill
// and across a prefill/decode split) equal layers.L.engram_hash_ids; the gathered table
// rows through engram.wkv give layers.L.engram_kv; the vision tower is kept or dropped by
// recipe; the weights load with the V4.1 fields set.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "backend/cpu/cpu_backend.h"
#include "convert/checkpoint_config.h"
#include "convert/converter.h"
#include "convert/safetensors.h"
#include "gguf/gguf_file.h"
#include "gguf/quant.h"
#include "model/engram.h"
#include "model/engram_table.h"
#include "model/tensor_catalog.h"
#include "model/model_files.h"
#include "model/weights.h"
#include "support/test_support.h"
#include "util/float_formats.h"

namespace dsv4::convert {
namespace {

std::filesystem::path v41_dir() { return test::shared_dir() / "fixtures/tiny-v41"; }

const SafetensorsFile& reference() {
  static const SafetensorsFile ref = SafetensorsFile::open(v41_dir() / "reference.safetensors").value();
  return ref;
}

template <typename T>
std::vector<T> ref_values(const std::string& name) {
  const StTensor* t = reference().find(name);
  EXPECT_NE(t, nullptr) << name;
  if (!t) return {};
  std::vector<T> out(t->n_elements());
  if (t->dtype == StDtype::BF16) {
    for (size_t i = 0; i < out.size(); ++i) {
      uint16_t b;
      std::memcpy(&b, t->data + 2 * i, 2);
      out[i] = static_cast<T>(bf16_to_f32(b));
    }
  } else {
    EXPECT_EQ(t->nbytes, out.size() * sizeof(T)) << name;
    std::memcpy(out.data(), t->data, std::min<size_t>(t->nbytes, out.size() * sizeof(T)));
  }
  return out;
}

struct Converted {
  test::TempDir dir;
  ConvertSummary summary;
  std::optional<gguf::GgufFile> file;
  std::optional<ModelConfig> config;
};

std::unique_ptr<Converted> convert_v41(const std::string& recipe_name, bool keep_vision) {
  auto c = std::make_unique<Converted>();
  ConvertOptions opts;
  opts.checkpoint_dir = v41_dir() / "checkpoint";
  opts.output = c->dir / "tiny41.gguf";
  auto recipe = recipe_by_name(recipe_name);
  EXPECT_TRUE(recipe.is_ok());
  opts.recipe = *recipe;
  opts.recipe.keep_vision = keep_vision;
  opts.threads = 2;
  opts.chunk_bytes = 4096;  // many chunks per tensor
  auto summary = convert_checkpoint(opts);
  EXPECT_TRUE(summary.is_ok()) << summary.status().message();
  if (!summary) return c;
  c->summary = std::move(*summary);
  auto file = gguf::GgufFile::open(opts.output.string());
  EXPECT_TRUE(file.is_ok()) << file.status().message();
  if (!file) return c;
  c->file = std::move(*file);
  auto config = ModelConfig::from_gguf(*c->file);
  EXPECT_TRUE(config.is_ok()) << config.status().message();
  if (config) c->config = std::move(*config);
  return c;
}

const Converted& lossless() {
  static const auto c = convert_v41("f32", false);
  return *c;
}

std::vector<float> decode(const gguf::TensorInfo& t) {
  std::vector<float> out(t.n_elements());
  const uint64_t row_bytes = *ggml_row_bytes(t.type, t.ne[0]);
  for (uint64_t r = 0; r < t.n_rows(); ++r)
    dequantize_row(t.type, t.data + r * row_bytes, out.data() + r * t.ne[0], static_cast<int64_t>(t.ne[0]));
  return out;
}

TEST(ConvertV41Test, ConfigHasTheReleaseSettings) {
  auto cfg = read_checkpoint_config(v41_dir() / "checkpoint");
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().message();
  const ModelConfig& c = cfg->model;
  EXPECT_TRUE(c.is_v41());
  EXPECT_EQ(cfg->format.fp8_block_rows, 32u);
  EXPECT_EQ(cfg->format.fp8_block_cols, 32u);
  EXPECT_TRUE(cfg->has_vision_tower);
  EXPECT_EQ(c.n_layers, 7u);
  EXPECT_EQ(c.n_mtp, 3u);
  EXPECT_EQ(c.rms_eps, 1e-20f);
  EXPECT_EQ(c.n_hash_layers, 0u);
  EXPECT_EQ(c.kv_source_layers, (std::vector<uint32_t>{2, 4}));
  EXPECT_EQ(c.index_source_layers, (std::vector<uint32_t>{2, 4, 6}));
  ASSERT_TRUE(c.candidate);
  EXPECT_EQ(c.candidate->source_layer, 4u);
  EXPECT_EQ(c.candidate->block_size, 4u);
  EXPECT_EQ(c.candidate->topk_blocks, 3u);
  ASSERT_TRUE(c.engram);
  EXPECT_EQ(c.engram->layers, (std::vector<uint32_t>{1, 2}));
  EXPECT_EQ(c.engram->table_rows, (std::vector<uint64_t>{5142, 8550}));
  EXPECT_EQ(c.engram->dim, 64u);
  EXPECT_EQ(c.engram->hash_vocab_size, 150u);
  EXPECT_EQ(c.engram->compressed_vocab_size, 261u);
  ASSERT_TRUE(c.dspark);
  EXPECT_EQ(c.dspark->n_experts, 4u);
  EXPECT_EQ(c.dspark->n_experts_used, 2u);
  EXPECT_EQ(c.dspark->markov_rank, 32u);
  EXPECT_EQ(c.dspark->target_layers, (std::vector<uint32_t>{4, 5, 6}));
  ASSERT_TRUE(c.vision);
  EXPECT_EQ(c.vision->image_token_id, 511u);
  EXPECT_EQ(c.vision->n_layers, 1u);
  EXPECT_EQ(c.rope.yarn_factor, 4);
  EXPECT_EQ(c.experts_of(7), 4u);
}

TEST(ConvertV41Test, CatalogAndExactDequantSamples) {
  const Converted& c = lossless();
  ASSERT_TRUE(c.file && c.config);
  EXPECT_TRUE(check_tensors(build_tensor_catalog(*c.config), c.file->tensors(), "tiny41.gguf").is_ok());
  const std::vector<std::pair<std::string, std::string>> samples = {
      {"dequant.layers.0.attn.wq_a.weight", "blk.0.attn_q_a.weight"},
      {"dequant.layers.0.attn.wo_a.weight", "blk.0.attn_output_a.weight"},
      {"dequant.layers.2.attn.indexer.wq_b.weight", "blk.2.indexer.attn_q_b.weight"},
      {"dequant.mtp.0.main_proj.weight", "blk.7.dspark_main_proj.weight"},
  };
  for (const auto& [ref, name] : samples) {
    const gguf::TensorInfo* t = c.file->find_tensor(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(decode(*t), ref_values<float>(ref)) << name;
  }
  // engram.wkv: a 64 x 512 corner.
  const gguf::TensorInfo* wkv = c.file->find_tensor("blk.1.engram_kv.weight");
  ASSERT_NE(wkv, nullptr);
  const std::vector<float> all = decode(*wkv), corner = ref_values<float>("dequant.layers.1.engram.wkv.weight.rows_0_64.cols_0_512");
  for (size_t r = 0; r < 64; ++r)
    for (size_t col = 0; col < 512; ++col) ASSERT_EQ(all[r * wkv->ne[0] + col], corner[r * 512 + col]) << r << "," << col;
  // FP4 experts as MXFP4 (the expert stack holds expert e's rows at e * rows).
  auto expert = [&](const std::string& name, size_t e, size_t rows) {
    const std::vector<float> v = decode(*c.file->find_tensor(name));
    const size_t cols = c.file->find_tensor(name)->ne[0];
    return std::vector<float>(v.begin() + e * rows * cols, v.begin() + (e + 1) * rows * cols);
  };
  EXPECT_EQ(expert("blk.6.ffn_gate_exps.weight", 7, 64), ref_values<float>("dequant.layers.6.ffn.experts.7.w1.weight"));
  EXPECT_EQ(expert("blk.0.ffn_down_exps.weight", 0, 128), ref_values<float>("dequant.layers.0.ffn.experts.0.w2.weight"));
  // BF16 payloads unchanged (f32 recipe widens exactly).
  auto ckpt = Checkpoint::open(v41_dir() / "checkpoint");
  ASSERT_TRUE(ckpt.is_ok());
  const StTensor* embed = ckpt->find("embed.weight");
  ASSERT_NE(embed, nullptr);
  const std::vector<float> emb = decode(*c.file->find_tensor("token_embd.weight"));
  for (size_t i = 0; i < emb.size(); ++i) {
    uint16_t b;
    std::memcpy(&b, embed->data + 2 * i, 2);
    ASSERT_EQ(emb[i], bf16_to_f32(b)) << i;
  }
}

TEST(ConvertV41Test, EngramTableRowsAreTheOfficialFp8Rows) {
  const Converted& c = lossless();
  ASSERT_TRUE(c.file && c.config);
  auto enc = c.file->get_string("deepseek41.engram.encoding");
  ASSERT_TRUE(enc.is_ok());
  EXPECT_EQ(*enc, "e4m3_e8m0_32_row66");
  const auto rows32 = ref_values<int32_t>("dequant.layers.1.engram.embed.weight.rows");
  const std::vector<uint32_t> ids(rows32.begin(), rows32.end());
  const std::vector<float> want = ref_values<float>("dequant.layers.1.engram.embed.weight");
  for (auto access : {EngramTable::Access::Mapped, EngramTable::Access::Pread}) {
    auto tables = open_engram_tables(*c.file, *c.config, access);
    ASSERT_TRUE(tables.is_ok()) << tables.status().message();
    ASSERT_EQ(tables->size(), 2u);
    EXPECT_EQ((*tables)[0].rows(), 5142u);
    std::vector<float> got(ids.size() * 64, std::nanf(""));
    ASSERT_TRUE((*tables)[0].read(ids, got).is_ok());
    EXPECT_EQ(got, want);
    std::vector<uint32_t> bad = {5142};
    std::vector<float> one(64);
    EXPECT_FALSE((*tables)[0].read(bad, one).is_ok());
  }
}

TEST(ConvertV41Test, TokenMapAndHashConstantsEqualTheReference) {
  const Converted& c = lossless();
  ASSERT_TRUE(c.file && c.config);
  auto h = EngramHasher::from_gguf(*c.file, *c.config);
  ASSERT_TRUE(h.is_ok()) << h.status().message();
  EXPECT_EQ(h->token_map(), ref_values<int32_t>("engram_token_map"));
  const auto mult = ref_values<int64_t>("engram_multipliers");
  const auto primes = ref_values<int64_t>("engram_primes");
  const auto offsets = ref_values<int64_t>("engram_offsets");
  for (size_t l = 0; l < 2; ++l) {
    EXPECT_EQ(h->constants().multipliers[l], std::vector<int64_t>(mult.begin() + 4 * l, mult.begin() + 4 * l + 4));
    for (size_t k = 0; k < 24; ++k) {
      EXPECT_EQ(h->constants().primes[l][k], static_cast<uint64_t>(primes[24 * l + k]));
      EXPECT_EQ(h->constants().offsets[l][k], static_cast<uint64_t>(offsets[24 * l + k]));
    }
  }
}

// Hash ids [t][layer][col] -> the reference's per-layer [t][col].
std::vector<int32_t> layer_ids(const std::vector<uint32_t>& rows, size_t layer, size_t n_tokens) {
  std::vector<int32_t> out;
  for (size_t t = 0; t < n_tokens; ++t)
    for (size_t k = 0; k < 24; ++k) out.push_back(static_cast<int32_t>(rows[(t * 2 + layer) * 24 + k]));
  return out;
}

TEST(ConvertV41Test, HashIdsOfBothPromptsInOnePrefillAndSplit) {
  const Converted& c = lossless();
  ASSERT_TRUE(c.file && c.config);
  auto h = EngramHasher::from_gguf(*c.file, *c.config);
  ASSERT_TRUE(h.is_ok());
  struct Prompt {
    std::string tokens, prefix;
    bool image;
  };
  for (const Prompt& p : {Prompt{"tokens", "", false}, Prompt{"vl_tokens", "vl.", true}}) {
    const std::vector<int32_t> tokens = ref_values<int32_t>(p.tokens);
    std::vector<uint8_t> live(tokens.size(), 1);
    if (p.image) {
      const auto types = ref_values<int32_t>("vl_token_types");
      for (size_t i = 0; i < types.size(); ++i) live[i] = types[i] == -1;  // image spans are dead
    }
    for (size_t split : {tokens.size(), size_t{41}, size_t{3}}) {
      std::vector<uint32_t> rows(tokens.size() * h->rows_per_token(), 0xFFFFFFFFu);
      EngramHasher::History hist = h->start();
      const size_t per = h->rows_per_token();
      ASSERT_TRUE(h->hash(hist, std::span(tokens).first(split), std::span(live).first(split),
                          std::span(rows).first(split * per)).is_ok());
      for (size_t t = split; t < tokens.size(); ++t)  // decode: one token per call
        ASSERT_TRUE(h->hash(hist, std::span(tokens).subspan(t, 1), std::span(live).subspan(t, 1),
                            std::span(rows).subspan(t * per, per)).is_ok());
      for (size_t l = 0; l < 2; ++l)
        EXPECT_EQ(layer_ids(rows, l, tokens.size()),
                  ref_values<int32_t>(p.prefix + "layers." + std::to_string(l + 1) + ".engram_hash_ids"))
            << p.tokens << " layer " << l + 1 << " split " << split;
    }
  }
}

TEST(ConvertV41Test, GatheredRowsThroughWkvGiveEngramKv) {
  const Converted& c = lossless();
  ASSERT_TRUE(c.file && c.config);
  auto h = EngramHasher::from_gguf(*c.file, *c.config);
  ASSERT_TRUE(h.is_ok());
  auto tables = open_engram_tables(*c.file, *c.config, EngramTable::Access::Pread);
  ASSERT_TRUE(tables.is_ok());
  const std::vector<int32_t> tokens = ref_values<int32_t>("tokens");
  EngramGather gather(*h, *tables);
  EngramHasher::History hist = h->start();
  ASSERT_TRUE(gather.start(hist, tokens).is_ok());
  ASSERT_TRUE(gather.wait().is_ok());
  for (size_t l = 0; l < 2; ++l) {
    const uint32_t layer = c.config->engram->layers[l];
    const gguf::TensorInfo* wkv = c.file->find_tensor(block_tensor_name(layer, BlockTensor::EngramKv));
    ASSERT_NE(wkv, nullptr);
    const std::vector<float> w = decode(*wkv);  // [640, 1536]
    const std::vector<float> want = ref_values<float>("layers." + std::to_string(layer) + ".engram_kv");
    const std::span<const float> rows = gather.rows(l);  // [t][24][64]
    const size_t in = wkv->ne[0], out = wkv->ne[1];
    ASSERT_EQ(rows.size(), tokens.size() * in);
    double worst = 0;
    for (size_t t = 0; t < tokens.size(); ++t) {
      double num = 0, den = 0;
      for (size_t o = 0; o < out; ++o) {
        double acc = 0;
        for (size_t i = 0; i < in; ++i) acc += static_cast<double>(w[o * in + i]) * rows[t * in + i];
        const double ref = want[t * out + o];
        num += (acc - ref) * (acc - ref);
        den += ref * ref;
      }
      worst = std::max(worst, std::sqrt(num / den));
    }
    EXPECT_LT(worst, 1e-5) << "layer " << layer;  // fp32 reference vs fp64 product
  }
}

TEST(ConvertV41Test, VisionKeptOrDroppedByRecipe) {
  const Converted& dropped = lossless();
  ASSERT_TRUE(dropped.file);
  for (const auto& t : dropped.file->tensors()) {
    EXPECT_FALSE(t.name.starts_with("vision.")) << t.name;
    EXPECT_EQ(t.name.find("exp_probs_b_vl"), std::string::npos) << t.name;
  }
  const auto kept = convert_v41("bf16", true);
  ASSERT_TRUE(kept->file && kept->config);
  ASSERT_TRUE(kept->config->vision && kept->config->vision->in_file);
  EXPECT_TRUE(check_tensors(build_tensor_catalog(*kept->config), kept->file->tensors(), "kept.gguf").is_ok());
  EXPECT_NE(kept->file->find_tensor("vision.blocks.0.attn.wqkv.weight"), nullptr);
  EXPECT_NE(kept->file->find_tensor("vision.aligner.w1.weight"), nullptr);
  EXPECT_NE(kept->file->find_tensor("vision.image_newline"), nullptr);
  for (uint32_t b = 0; b < kept->config->n_blocks(); ++b)
    EXPECT_NE(kept->file->find_tensor(block_tensor_name(b, BlockTensor::FfnExpProbsBVl)), nullptr) << b;
  // The tower's values are the checkpoint's.
  auto ckpt = Checkpoint::open(v41_dir() / "checkpoint");
  ASSERT_TRUE(ckpt.is_ok());
  const StTensor* src = ckpt->find("aligner.w1.weight");
  ASSERT_NE(src, nullptr);
  const std::vector<float> got = decode(*kept->file->find_tensor("vision.aligner.w1.weight"));
  ASSERT_EQ(got.size(), src->n_elements());
  for (size_t i = 0; i < got.size(); ++i) {
    uint16_t b;
    std::memcpy(&b, src->data + 2 * i, 2);
    ASSERT_EQ(got[i], bf16_to_f32(b)) << i;
  }
}

TEST(ConvertV41Test, WeightsLoadWithTheV41Fields) {
  const Converted& c = lossless();
  ASSERT_TRUE(c.file && c.config);
  backend::CpuBackend be;
  auto files = ModelFiles::open(c.file->path());
  ASSERT_TRUE(files.is_ok()) << files.status().message();
  auto w = ModelWeights::load(*files, be);
  ASSERT_TRUE(w.is_ok()) << w.status().message();
  ASSERT_EQ(w->blocks.size(), 10u);
  EXPECT_TRUE(w->blocks[2].compressor.gate.valid());   // ratio 2 pools with a gate
  EXPECT_FALSE(w->blocks[4].compressor.gate.valid());  // ratio 1 does not
  EXPECT_TRUE(w->blocks[4].index_k.valid() && w->blocks[4].index_k_norm.valid());
  EXPECT_FALSE(w->blocks[5].compressor.kv.valid());     // a consumer
  EXPECT_TRUE(w->blocks[6].index_q_b.valid() && !w->blocks[6].index_k.valid());
  EXPECT_NE(w->blocks[1].engram.table, nullptr);
  EXPECT_TRUE(w->blocks[1].engram.kv.valid() && w->blocks[1].engram.q.valid());
  EXPECT_EQ(w->blocks[3].engram.table, nullptr);
  EXPECT_TRUE(w->blocks[7].dspark_main_proj.valid());
  EXPECT_TRUE(w->blocks[9].head_norm.valid());
  EXPECT_TRUE(w->dspark.markov_embd.valid() && w->dspark.conf_proj.valid());
  EXPECT_FALSE(w->hc_head.fn.valid());  // no output_hc_* in V4.1
}

}  // namespace
}  // namespace dsv4::convert
