// The V4.1 plan (shared/spec/deepseek-v41.md §3.3-3.5): which blocks own the compressed
// caches, which read a source's lists, whose selection each block attends, the candidate
// and Engram roles; V4 blocks keep their own lists.
#include <gtest/gtest.h>

#include <set>

#include "model/layer_plan.h"
#include "synth/presets.h"

namespace dsv4 {
namespace {

TEST(LayerPlanV41Test, FlashSharesEveryCompressedCacheWithItsSource) {
  const ModelConfig c = flash41_config();
  const ModelPlan plan = ModelPlan::build(c);
  ASSERT_TRUE(plan.v41);
  ASSERT_EQ(plan.layers.size(), c.n_blocks());
  // Two lists (KV entries, index keys) and one compressor state per KV source [2, 8, 14, 20].
  EXPECT_EQ(plan.lists.size(), 2 * c.kv_source_layers.size());
  EXPECT_EQ(plan.states.size(), c.kv_source_layers.size());
  for (const LayerPlan& l : plan.layers) {
    SCOPED_TRACE(l.block);
    EXPECT_EQ(l.ring, static_cast<int32_t>(l.block));  // every block its own window ring
    EXPECT_FALSE(l.overlap);
    if (l.ratio == 0) {
      EXPECT_EQ(l.kv_list, -1);
      EXPECT_FALSE(l.indexer);
      continue;
    }
    const LayerRoles roles = c.layer_roles(l.block);
    ASSERT_GE(roles.kv_source_layer, 0);
    const LayerPlan& src = plan.layers[static_cast<size_t>(roles.kv_source_layer)];
    EXPECT_EQ(l.kv_source_block, roles.kv_source_layer);
    EXPECT_EQ(l.selection_block, roles.index_source_layer);
    EXPECT_EQ(l.kv_list, src.kv_list);
    EXPECT_EQ(l.key_list, src.key_list);
    EXPECT_EQ(plan.lists[l.kv_list].block, src.block);
    EXPECT_EQ(plan.lists[l.kv_list].ratio, l.ratio);  // a cache is read at its own ratio
    EXPECT_EQ(plan.lists[l.kv_list].width, c.head_dim);
    EXPECT_TRUE(plan.lists[l.key_list].index_keys);
    EXPECT_EQ(plan.lists[l.key_list].width, c.index_head_dim);
    EXPECT_EQ(l.kv_source, roles.kv_source);
    EXPECT_EQ(l.kv_state >= 0, roles.kv_source);
    if (l.kv_source) {
      EXPECT_EQ(plan.states[l.kv_state].rows, static_cast<uint32_t>(l.ratio));
      EXPECT_EQ(plan.states[l.kv_state].cols, c.head_dim);
    }
    EXPECT_EQ(l.indexer, roles.index_source);
    EXPECT_EQ(l.candidate_source, roles.candidate_source);
    EXPECT_EQ(l.uses_candidates, roles.uses_candidates);
  }
  // Spec §3.3: layers 2-7 read 2's cache, ..., all 20 decoder layers read 20's.
  EXPECT_EQ(plan.layers[7].kv_source_block, 2);
  EXPECT_EQ(plan.layers[13].kv_source_block, 8);
  EXPECT_EQ(plan.layers[39].kv_source_block, 20);
  EXPECT_EQ(plan.layers[27].selection_block, 24);
  EXPECT_TRUE(plan.layers[20].candidate_source);
  EXPECT_TRUE(plan.layers[24].uses_candidates);
  EXPECT_FALSE(plan.layers[14].uses_candidates);
  EXPECT_FALSE(plan.layers[25].uses_candidates);  // not an index source
  EXPECT_EQ(plan.layers[1].engram, 0);
  EXPECT_EQ(plan.layers[14].engram, 1);
  EXPECT_EQ(plan.layers[2].engram, -1);
}

TEST(LayerPlanV41Test, TinyMatchesTheFixtureSchedule) {
  const ModelConfig c = tiny41_config();
  const ModelPlan plan = ModelPlan::build(c);
  std::set<uint32_t> owners;
  for (const CacheListPlan& l : plan.lists) owners.insert(l.block);
  EXPECT_EQ(std::vector<uint32_t>(owners.begin(), owners.end()), c.kv_source_layers);
  for (const LayerPlan& l : plan.layers)
    if (l.ratio && !l.kv_source) {
      EXPECT_EQ(l.kv_state, -1) << l.block;
    }
}

TEST(LayerPlanV41Test, V4KeepsItsOwnListsPerBlock) {
  const ModelConfig c = flash_config();
  const ModelPlan plan = ModelPlan::build(c);
  EXPECT_FALSE(plan.v41);
  std::set<int32_t> lists;
  for (const LayerPlan& l : plan.layers) {
    EXPECT_EQ(l.kv_source_block, -1);
    EXPECT_EQ(l.engram, -1);
    if (l.ratio) {
      EXPECT_TRUE(lists.insert(l.kv_list).second) << l.block;
    }
  }
}

}  // namespace
}  // namespace dsv4
