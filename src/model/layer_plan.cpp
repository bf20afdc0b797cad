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

}  // namespace

ModelPlan ModelPlan::build(const ModelConfig& c) {
  ModelPlan plan;
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
    if (l.ratio) {
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
