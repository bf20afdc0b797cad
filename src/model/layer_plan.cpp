#include "model/layer_plan.h"

#include <algorithm>

namespace dsv4 {
namespace {

backend::RopeParams rope_for(const ModelConfig& c, uint32_t ratio) {
  backend::RopeParams p;
  p.dims = static_cast<int>(c.rope.dims);
  if (ratio == 0) {  // "main" table: window-only blocks and MTP (spec §2.1)
    p.freq_base = static_cast<float>(c.rope.freq_base);
    return p;
  }
  p.freq_base = static_cast<float>(c.rope.compress_freq_base);  // "compress" table, YaRN
  p.yarn = true;
  p.yarn_factor = static_cast<float>(c.rope.yarn_factor);
  p.yarn_original_context = static_cast<int>(c.rope.yarn_original_context);
  p.yarn_beta_fast = static_cast<float>(c.rope.yarn_beta_fast);
  p.yarn_beta_slow = static_cast<float>(c.rope.yarn_beta_slow);
  return p;
}

// V4.1 (spec §3.3-3.4): a KV source owns its lists and its compressor state (ratio rows
// of the compressed latent, no overlap); a consumer (a later block up to the next source)
// names its source's lists. Blocks are planned in order, so the source's ids exist.
void plan_v41_block(const ModelConfig& c, ModelPlan& plan, LayerPlan& l) {
  const uint32_t b = l.block;
  l.engram = c.engram ? c.engram->index_of(b) : -1;
  l.overlap = false;
  if (!l.ratio) return;
  const LayerRoles roles = c.layer_roles(b);
  l.kv_source = roles.kv_source;
  l.indexer = roles.index_source;
  l.candidate_source = roles.candidate_source;
  l.uses_candidates = roles.uses_candidates;
  l.kv_source_block = roles.kv_source_layer;
  l.selection_block = roles.index_source_layer;
  if (l.kv_source) {
    l.kv_list = static_cast<int32_t>(plan.lists.size());
    plan.lists.push_back({b, c.head_dim, l.ratio, false});
    l.key_list = static_cast<int32_t>(plan.lists.size());
    plan.lists.push_back({b, c.index_head_dim, l.ratio, true});
    l.kv_state = static_cast<int32_t>(plan.states.size());
    plan.states.push_back({b, c.ratio(b), c.head_dim});
  } else {
    const LayerPlan& src = plan.layers.at(static_cast<size_t>(l.kv_source_block));
    l.kv_list = src.kv_list;
    l.key_list = src.key_list;
  }
}

}  // namespace

ModelPlan ModelPlan::build(const ModelConfig& c) {
  ModelPlan plan;
  plan.v41 = c.is_v41();
  plan.window = c.sliding_window;
  plan.ring_width = c.head_dim;
  for (uint32_t b = 0; b < c.n_blocks(); ++b) {
    LayerPlan l;
    l.block = b;
    l.mtp = c.is_mtp(b);
    l.attention = c.attention_kind(b);
    l.ratio = static_cast<int>(c.ratio(b));
    l.overlap = c.compressor_overlap(b) == 2;
    l.indexer = l.attention == AttentionKind::CSA;
    l.rope = rope_for(c, c.ratio(b));
    l.hash_routing = c.is_hash_layer(b);
    l.swiglu_limit = c.swiglu_limit.at(b);
    l.swiglu_limit_shared = c.swiglu_limit_shared.at(b);
    l.ring = static_cast<int32_t>(plan.n_rings++);
    if (c.is_v41()) {
      plan_v41_block(c, plan, l);
    } else if (l.ratio) {
      const uint32_t o = l.overlap ? 2 : 1;
      l.kv_list = static_cast<int32_t>(plan.lists.size());
      plan.lists.push_back({b, c.head_dim, l.ratio, false});
      l.kv_state = static_cast<int32_t>(plan.states.size());
      plan.states.push_back({b, o * c.ratio(b), o * c.head_dim});
      if (l.indexer) {
        l.key_list = static_cast<int32_t>(plan.lists.size());
        plan.lists.push_back({b, c.index_head_dim, l.ratio, true});
        l.key_state = static_cast<int32_t>(plan.states.size());
        plan.states.push_back({b, o * c.ratio(b), o * c.index_head_dim});
      }
    }
    plan.layers.push_back(l);
  }
  return plan;
}

int ModelPlan::max_ratio() const {
  int r = 1;
  for (const LayerPlan& l : layers) r = std::max(r, l.ratio);
  return r;
}

}  // namespace dsv4
