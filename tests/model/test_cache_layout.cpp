// The per-sequence cache plan against spec §6's numbers for V4-Flash (and V4-Pro), and
// entry counting at block boundaries.
#include <gtest/gtest.h>

#include "model/cache_layout.h"
#include "synth/presets.h"

namespace dsv4 {
namespace {

constexpr uint64_t KiB = 1024, MiB = 1024 * KiB;

TEST(CacheLayoutTest, FlashEntrySizes) {
  const ModelConfig c = flash_config();
  EXPECT_EQ(kv_entry_bytes(c, CacheFormat::ReferenceBf16), 1024u);
  EXPECT_EQ(index_key_bytes(c, CacheFormat::ReferenceBf16), 256u);
  // 448 e4m3 + 64 bf16 + 7 scales = 583, padded to 584; 64 B of e2m1 + 4 scales = 68.
  EXPECT_EQ(kv_entry_bytes(c, CacheFormat::Packed), 584u);
  EXPECT_EQ(index_key_bytes(c, CacheFormat::Packed), 68u);
  EXPECT_EQ(kv_entry_bytes(c, CacheFormat::F32), 2048u);
  EXPECT_EQ(index_key_bytes(c, CacheFormat::F32), 512u);
}

// The CPU reference's fp32 vectors: twice the bf16 vectors, the same fp32 compressor states.
TEST(CacheLayoutTest, F32DoublesTheBf16Vectors) {
  const ModelConfig c = flash_config();
  const CacheLayout f32 = plan_cache_layout(c, CacheFormat::F32);
  const CacheLayout bf16 = plan_cache_layout(c, CacheFormat::ReferenceBf16);
  EXPECT_EQ(f32.format, CacheFormat::F32);
  EXPECT_EQ(cache_format_name(CacheFormat::F32), "fp32");
  EXPECT_DOUBLE_EQ(f32.bytes_per_token(), 2 * 6880.0);
  const uint64_t n = 100003;
  const CacheTotals a = f32.totals_at(n), b = bf16.totals_at(n);
  EXPECT_EQ(a.windows, 2 * b.windows);
  EXPECT_EQ(a.compressor_states, b.compressor_states);
  EXPECT_EQ(a.csa_entries, 2 * b.csa_entries);
  EXPECT_EQ(a.index_keys, 2 * b.index_keys);
  EXPECT_EQ(a.hca_entries, 2 * b.hca_entries);
}

TEST(CacheLayoutTest, FlashMatchesSpecSection6) {
  const ModelConfig c = flash_config();
  const CacheLayout ref = plan_cache_layout(c, CacheFormat::ReferenceBf16);
  const CacheLayout packed = plan_cache_layout(c, CacheFormat::Packed);
  ASSERT_EQ(ref.blocks.size(), 44u);
  EXPECT_DOUBLE_EQ(ref.bytes_per_token(), 6880.0);
  EXPECT_DOUBLE_EQ(packed.bytes_per_token(), 3514.25);

  const uint64_t n = uint64_t{1} << 20;
  const CacheTotals rt = ref.totals_at(n);
  EXPECT_EQ(rt.windows, 44 * 128 * 1024u);                       // 5.5 MiB
  EXPECT_EQ(rt.compressor_states, 21 * (64 + 16) * KiB + 20 * 512 * KiB);  // 11.64 MiB
  EXPECT_EQ(rt.csa_entries, 21 * (n / 4) * 1024);                // 5.25 GiB
  EXPECT_EQ(rt.index_keys, 21 * (n / 4) * 256);                  // 1.31 GiB
  EXPECT_EQ(rt.hca_entries, 20 * (n / 128) * 1024);              // 0.16 GiB
  EXPECT_EQ(ref.bytes_at(n), rt.fixed() + 6880 * n);
  EXPECT_EQ(packed.totals_at(n).windows, 44 * 128 * 584u);       // about 3.1 MiB
  EXPECT_GT(packed.totals_at(n).windows, 3 * MiB);
  EXPECT_EQ(packed.totals_at(n).compressor_states, rt.compressor_states);

  const BlockCache& csa = ref.blocks[2];
  EXPECT_EQ(csa.kind, AttentionKind::CSA);
  EXPECT_EQ(csa.compressor_state_bytes, 64 * KiB);
  EXPECT_EQ(csa.indexer_state_bytes, 16 * KiB);
  const BlockCache& hca = ref.blocks[3];
  EXPECT_EQ(hca.compressor_state_bytes, 512 * KiB);
  EXPECT_EQ(hca.indexer_state_bytes, 0u);
  const BlockCache& mtp = ref.blocks[43];
  EXPECT_EQ(mtp.kind, AttentionKind::Window);
  EXPECT_EQ(mtp.fixed_bytes(), 128 * 1024u);
  EXPECT_EQ(mtp.bytes_at(n), mtp.fixed_bytes());
}

TEST(CacheLayoutTest, ProMatchesSpecSection6) {
  // V4-Pro: layers 0,1 HCA, then CSA/HCA alternating, last trunk layer CSA, MTP window.
  ModelConfig c = flash_config();
  c.n_layers = 61;
  c.compress_ratios = {128, 128};
  for (int i = 0; i < 29; ++i) {
    c.compress_ratios.push_back(4);
    c.compress_ratios.push_back(128);
  }
  c.compress_ratios.push_back(4);
  c.compress_ratios.push_back(0);
  c.swiglu_limit.assign(62, 10);
  c.swiglu_limit_shared.assign(62, 10);
  ASSERT_TRUE(c.validate().is_ok()) << c.validate().message();
  EXPECT_DOUBLE_EQ(plan_cache_layout(c, CacheFormat::ReferenceBf16).bytes_per_token(), 9848.0);
  EXPECT_NEAR(plan_cache_layout(c, CacheFormat::Packed).bytes_per_token(), 5030, 2);
}

TEST(CacheLayoutTest, EntriesAppearWhenABlockCompletes) {
  const ModelConfig c = tiny_config();  // ratios 0, 4, 16, 4, 16, 0 + MTP 0
  const CacheLayout ref = plan_cache_layout(c, CacheFormat::ReferenceBf16);
  const BlockCache& csa = ref.blocks[1];
  const BlockCache& hca = ref.blocks[2];
  EXPECT_EQ(csa.entries(3), 0u);
  EXPECT_EQ(csa.entries(4), 1u);
  EXPECT_EQ(csa.entries(72), 18u);
  EXPECT_EQ(hca.entries(15), 0u);
  EXPECT_EQ(hca.entries(16), 1u);
  EXPECT_EQ(hca.entries(72), 4u);
  EXPECT_EQ(ref.blocks[0].entries(72), 0u);
  // Tiny: head 256 (192 nope + 64 rope), window 8, indexer 128.
  EXPECT_EQ(kv_entry_bytes(c, CacheFormat::Packed), 328u);  // 192 + 128 + 3 = 323 -> 328
  EXPECT_EQ(csa.window_bytes, 8 * 512u);
  EXPECT_EQ(csa.compressor_state_bytes, compressor_state_bytes(4, 256, 2));
  EXPECT_EQ(compressor_state_bytes(4, 256, 2), 2 * 8 * 512 * 4u);
  EXPECT_EQ(hca.compressor_state_bytes, 2 * 16 * 256 * 4u);
  const uint64_t total = ref.bytes_at(72);
  EXPECT_EQ(total, ref.fixed_bytes() + 2 * 18 * (512 + 256) + 2 * 4 * 512);
}

}  // namespace
}  // namespace dsv4
