// Model::export_sequence and import_sequence: a sequence's whole state as bytes (the
// server's disk cache of prefixes), over the cache manager's export_state/import_state.
// fork, snapshot and restore are in model.cpp, over KvCache's.
#include "model/model.h"

#include "model/kv_cache.h"

namespace dsv4 {

Result<std::vector<uint8_t>> Model::export_sequence(const Sequence& seq) const {
  if (seq.cache_ != cache_.get()) return Status::error("export_sequence: the sequence belongs to another model");
  return cache_->export_state(seq);
}

Result<std::unique_ptr<Sequence>> Model::import_sequence(std::span<const uint8_t> bytes,
                                                         const SequenceOptions& options) const {
  if (options.graft) return Status::error("import_sequence: a saved state does not take a KV graft");
  DSV4_ASSIGN_OR_RETURN(std::unique_ptr<Sequence> seq, new_sequence(options));
  DSV4_TRY(cache_->import_state(*seq, bytes).with_context("import_sequence"));
  return seq;
}

}  // namespace dsv4
