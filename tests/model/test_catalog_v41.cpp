// The V4.1 tensor catalog at V4.1-Flash geometry (shared/spec/deepseek-v41.md §4.2): no
// hash layers and no output_hc_*, compressors and index keys only on the KV sources,
// indexer queries only on the index sources, Engram tensors on the Engram layers, DSpark
// heads; Metrale's Engram spellings accepted; the shared-source cache layout.
#include <gtest/gtest.h>

#include <set>

#include "gguf/gguf_file.h"
#include "model/cache_layout.h"
#include "model/engram_table.h"
#include "model/tensor_catalog.h"
#include "synth/presets.h"

namespace dsv4 {
namespace {

std::set<uint32_t> blocks_with(const TensorCatalog& cat, BlockTensor kind) {
  std::set<uint32_t> out;
  for (const auto& t : cat.tensors)
    if (t.block_kind == kind) out.insert(*t.block);
  return out;
}

TEST(CatalogV41Test, FlashTensorsSitOnTheirLayers) {
  const ModelConfig c = flash41_config();
  const TensorCatalog cat = build_tensor_catalog(c);
  for (const auto& t : cat.tensors) {
    EXPECT_NE(t.block_kind, BlockTensor::FfnTid2Eid) << t.name;
    EXPECT_NE(t.block_kind, BlockTensor::CompressorApe) << t.name;
    EXPECT_NE(t.block_kind, BlockTensor::IndexerCompressorKv) << t.name;
    EXPECT_FALSE(t.global_kind == GlobalTensor::OutputHcFn || t.global_kind == GlobalTensor::OutputHcBase ||
                 t.global_kind == GlobalTensor::OutputHcScale) << t.name;
    EXPECT_FALSE(t.block_kind == BlockTensor::NextnEhProj || t.block_kind == BlockTensor::NextnHcHeadFn) << t.name;
  }
  const std::set<uint32_t> kv = {2, 8, 14, 20}, idx = {2, 8, 14, 20, 24, 28, 32, 36};
  EXPECT_EQ(blocks_with(cat, BlockTensor::CompressorKv), kv);
  EXPECT_EQ(blocks_with(cat, BlockTensor::CompressorNorm), kv);
  EXPECT_EQ(blocks_with(cat, BlockTensor::CompressorGate), (std::set<uint32_t>{2, 8, 14}));  // ratio 2 only
  EXPECT_EQ(blocks_with(cat, BlockTensor::IndexerK), kv);
  EXPECT_EQ(blocks_with(cat, BlockTensor::IndexerKNorm), kv);
  EXPECT_EQ(blocks_with(cat, BlockTensor::IndexerQB), idx);
  EXPECT_EQ(blocks_with(cat, BlockTensor::IndexerProj), idx);
  for (BlockTensor k : {BlockTensor::EngramEmbd, BlockTensor::EngramKv, BlockTensor::EngramQ, BlockTensor::EngramK})
    EXPECT_EQ(blocks_with(cat, k), (std::set<uint32_t>{1, 14}));
  EXPECT_EQ(blocks_with(cat, BlockTensor::FfnExpProbsB).size(), 43u);
  EXPECT_EQ(blocks_with(cat, BlockTensor::FfnExpProbsBVl).size(), 43u);
  EXPECT_EQ(blocks_with(cat, BlockTensor::DsparkMainProj), (std::set<uint32_t>{40}));
  EXPECT_EQ(blocks_with(cat, BlockTensor::NextnSharedHeadNorm), (std::set<uint32_t>{42}));

  const TensorSpec* table = cat.find("blk.14.engram_embd.weight");
  ASSERT_NE(table, nullptr);
  EXPECT_EQ(table->ne, (std::vector<uint64_t>{256, 384016682}));
  EXPECT_EQ(stored_shape(*table, GgmlType::I8), (std::vector<uint64_t>{264, 384016682}));
  EXPECT_EQ(*stored_bytes(*table, GgmlType::I8), 264ull * 384016682);
  EXPECT_EQ(*stored_bytes(*table, GgmlType::Q2_K), 84ull * 384016682);
  EXPECT_EQ(cat.find("blk.1.engram_kv.weight")->ne, (std::vector<uint64_t>{6144, 25600}));
  EXPECT_EQ(cat.find("blk.1.engram_wkv.weight"), cat.find("blk.1.engram_kv.weight"));  // Metrale's name
  EXPECT_EQ(cat.find("blk.41.ffn_gate_exps.weight")->ne, (std::vector<uint64_t>{5120, 2304, 128}));
  EXPECT_EQ(cat.find("blk.39.ffn_gate_exps.weight")->ne, (std::vector<uint64_t>{5120, 2304, 384}));
  EXPECT_EQ(cat.find("blk.40.dspark_main_proj.weight")->ne, (std::vector<uint64_t>{15360, 5120}));
  EXPECT_EQ(cat.find("blk.20.indexer.attn_k.weight")->ne, (std::vector<uint64_t>{512, 128}));
  EXPECT_EQ(cat.find("markov_w1.weight")->ne, (std::vector<uint64_t>{256, 129280}));
  EXPECT_EQ(cat.find("conf_proj.weight")->ne, (std::vector<uint64_t>{5376, 1}));
}

TEST(CatalogV41Test, CheckAcceptsEitherEngramSpellingButNotBoth) {
  const ModelConfig c = tiny41_config();
  const TensorCatalog cat = build_tensor_catalog(c);
  std::vector<gguf::TensorInfo> infos;
  for (const auto& t : cat.tensors) {
    if (!t.required) continue;
    gguf::TensorInfo i;
    i.name = t.name == "blk.1.engram_kv.weight" ? "blk.1.engram_wkv.weight" : t.name;
    i.type = t.type_class == TypeClass::Vector ? GgmlType::F32 : t.type_class == TypeClass::EngramTable ? GgmlType::I8
                                                                                                       : GgmlType::F32;
    i.ne = stored_shape(t, i.type);
    infos.push_back(i);
  }
  EXPECT_TRUE(check_tensors(cat, infos, "a.gguf").is_ok()) << check_tensors(cat, infos, "a.gguf").message();
  gguf::TensorInfo twice = infos.front();
  for (const auto& i : infos)
    if (i.name == "blk.1.engram_wkv.weight") twice = i;
  twice.name = "blk.1.engram_kv.weight";
  infos.push_back(twice);
  const Status s = check_tensors(cat, infos, "a.gguf");
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("second copy"), std::string::npos) << s.message();
  // An I8 table with the logical row length is the wrong shape.
  for (auto& i : infos)
    if (i.name == "blk.2.engram_embd.weight") i.ne[0] = 64;
  infos.pop_back();
  const Status bad = check_tensors(cat, infos, "a.gguf");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.message().find("blk.2.engram_embd.weight: shape [8550, 64], expected [8550, 66]"), std::string::npos)
      << bad.message();
}

TEST(CacheLayoutV41Test, SharedSourcesHoldTheCompressedCache) {
  const ModelConfig c = flash41_config();
  const CacheLayout bf16 = plan_cache_layout(c, CacheFormat::ReferenceBf16);
  // Sources 2, 8, 14 at ratio 2: (512 + 128) * 2 / 2 each; source 20 at ratio 1: 1,280.
  EXPECT_DOUBLE_EQ(bf16.bytes_per_token(), 3 * 640.0 + 1280.0);
  for (const BlockCache& b : bf16.blocks) {
    const bool source = b.block == 2 || b.block == 8 || b.block == 14 || b.block == 20;
    EXPECT_EQ(b.holds_entries(), source) << b.block;
    EXPECT_EQ(b.window_bytes, 128u * 512 * 2) << b.block;  // every block keeps its own window
  }
  EXPECT_EQ(bf16.blocks[5].kv_source_layer, 2);
  EXPECT_EQ(bf16.blocks[33].kv_source_layer, 20);
  const CacheTotals t = bf16.totals_at(1000);
  EXPECT_EQ(t.shared_entries, 500u * 1024 * 3 + 1000u * 1024);
  EXPECT_EQ(t.index_keys, 500u * 256 * 3 + 1000u * 256);
  EXPECT_EQ(t.csa_entries + t.hca_entries, 0u);
  const CacheLayout packed = plan_cache_layout(c, CacheFormat::Packed);
  EXPECT_EQ(v41_window_entry_bytes(c, CacheFormat::Packed), 512u + 16);
  EXPECT_EQ(v41_compressed_entry_bytes(c, CacheFormat::Packed), 256u + 32);
  EXPECT_DOUBLE_EQ(packed.bytes_per_token(), 3 * (288.0 + 68.0) / 2 + (288.0 + 68.0));
}

}  // namespace
}  // namespace dsv4
