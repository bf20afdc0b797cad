#include "model/cache.h"

#include <fmt/format.h>

#include "model/kv_cache.h"

namespace dsv4 {

Result<CachePlan> CachePlan::compute(const ModelConfig& config, uint64_t context, bool with_mtp,
                                     uint64_t page_rows) {
  if (context == 0 || context > config.context_length)
    return Status::errorf(StatusCode::kOutOfRange, "cache plan: context {} outside [1, {}] (the model's context length)",
                          context, config.context_length);
  CacheLayout layout = plan_cache_layout(config, CacheFormat::F32);
  if (!with_mtp) layout.blocks.resize(config.n_layers);  // trunk blocks come first
  CachePlan plan{layout.totals_at(context, page_rows), context, page_rows ? page_rows : 1};
  // The cache manager's rings of positions keep kRewindTokens rows more than the layout.
  for (const BlockCache& b : layout.blocks) {
    if (b.window_slots) plan.windows += b.window_bytes / b.window_slots * kRewindTokens;
    const uint64_t overlap = config.is_v41() ? 1 : config.compressor_overlap(b.block);
    if (const uint64_t state_rows = overlap * b.ratio; state_rows && (b.compressor_state_bytes || b.indexer_state_bytes))
      plan.compressor_states += (b.compressor_state_bytes + b.indexer_state_bytes) / state_rows * kRewindTokens;
  }
  return plan;
}

std::string CachePlan::describe() const {
  return fmt::format(
      "cache for {} tokens: windows {} B, compressor states {} B, CSA entries {} B, "
      "indexer keys {} B, HCA entries {} B, total {} B",
      context, windows, compressor_states, csa_entries, index_keys, hca_entries, total());
}

Status CacheBudget::commit(uint64_t bytes, const std::string& what) {
  uint64_t used = used_.load();
  do {
    if (used + bytes > limit_)
      return Status::errorf(StatusCode::kResourceExhausted, "cache budget: {} needs {} more bytes, {} of {} already committed",
                            what, bytes, used, limit_);
  } while (!used_.compare_exchange_weak(used, used + bytes));
  return Status::ok();
}

Sequence::~Sequence() {
  if (cache_) cache_->detach(*this);
}

uint64_t Sequence::committed_bytes() const {
  return cache_ ? plan_.fixed() + cache_->referenced_bytes(*this) : 0;
}

}  // namespace dsv4
