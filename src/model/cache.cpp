#include "model/cache.h"

#include <fmt/format.h>

namespace dsv4 {

Result<CachePlan> CachePlan::compute(const ModelConfig& config, uint64_t context, bool with_mtp) {
  if (context == 0 || context > config.context_length)
    return Status::errorf(StatusCode::kOutOfRange, "cache plan: context {} outside [1, {}] (the model's context length)",
                          context, config.context_length);
  CacheLayout layout = plan_cache_layout(config, CacheFormat::F32);
  if (!with_mtp) layout.blocks.resize(config.n_layers);  // trunk blocks come first
  return CachePlan{layout.totals_at(context), context};
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
  if (budget_) budget_->release(committed_);
}

Status Sequence::commit_through(int64_t end) {
  uint64_t bytes = 0;
  for (const Block& b : blocks_)
    if (b.ratio)
      bytes += static_cast<uint64_t>(end / b.ratio - b.committed_entries) *
               (entry_row_bytes_ + (b.index_keys.valid() ? key_row_bytes_ : 0));
  if (bytes == 0) return Status::ok();
  if (budget_)
    DSV4_TRY(budget_->commit(bytes, fmt::format("sequence at position {}: compressed entries through "
                                                "position {}", position_, end)));
  for (Block& b : blocks_)
    if (b.ratio) b.committed_entries = end / b.ratio;
  committed_ += bytes;
  return Status::ok();
}

}  // namespace dsv4
