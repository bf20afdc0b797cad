// Per-sequence decode state (spec §6.1) on a backend, and its exact size before
// allocation.
//
// Each block keeps a window ring (slot = position mod window) of KV vectors; compressed
// blocks (CSA, HCA) add their compressed entries and the fp32 compressor state of the
// open block(s); CSA blocks add the indexer's keys and compressor state. The reference
// numerics keep every vector in fp32, cache_layout.h's F32 format (the QAT roundings, when
// on, put the values on the FP8/FP4 grids, but they stay fp32 here).
//
// Entries and indexer keys are reserved for the whole context but committed only as
// rows are written, each commit charged to an optional CacheBudget shared by many
// sequences: a logical reservation over one physical budget.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/cache_layout.h"
#include "model/config.h"
#include "util/status.h"

namespace dsv4 {

// Bytes of each part of one sequence's cache after `context` tokens: the F32 cache
// layout's totals (windows and compressor states fixed; CSA entries, indexer keys and
// HCA entries growing with the tokens).
struct CachePlan : CacheTotals {
  uint64_t context = 0;

  std::string describe() const;  // every part on one line

  // Fails when `context` exceeds the model's context length. `with_mtp` includes the MTP
  // blocks' windows.
  static Result<CachePlan> compute(const ModelConfig& config, uint64_t context, bool with_mtp);
};

// A byte budget shared by the sequences that commit cache rows against it.
class CacheBudget {
 public:
  explicit CacheBudget(uint64_t limit_bytes) : limit_(limit_bytes) {}
  Status commit(uint64_t bytes, const std::string& what);  // fails, changing nothing, past the limit
  void release(uint64_t bytes) { used_ -= bytes; }
  uint64_t used() const { return used_; }
  uint64_t limit() const { return limit_; }

 private:
  const uint64_t limit_;
  std::atomic<uint64_t> used_{0};
};

struct SequenceOptions {
  uint64_t max_context = 0;     // 0: the model's context length
  uint64_t memory_budget = 0;   // 0: unlimited; else the plan's total must fit
  bool with_mtp = false;        // keep the MTP blocks' windows too
  std::shared_ptr<CacheBudget> shared_budget;  // optional: charged as rows are committed
};

class Sequence {
 public:
  ~Sequence();
  Sequence(const Sequence&) = delete;
  Sequence& operator=(const Sequence&) = delete;

  int64_t position() const { return position_; }          // trunk tokens processed
  int64_t mtp_position() const { return mtp_position_; }  // MTP tokens processed
  uint64_t max_context() const { return plan_.context; }
  const CachePlan& plan() const { return plan_; }
  uint64_t committed_bytes() const { return committed_; }  // fixed parts + rows written

 private:
  friend class Model;
  friend struct ForwardPass;
  Sequence() = default;

  struct Block {
    backend::Tensor window;                   // [window, head_dim]
    backend::Tensor entries;                  // [context / ratio, head_dim], reserved
    backend::Tensor index_keys;               // [context / 4, index_head_dim], reserved
    backend::Tensor comp_kv, comp_score;      // main compressor state
    backend::Tensor index_kv, index_score;    // indexer compressor state
    int64_t n_entries = 0;
    int64_t ratio = 0;              // tokens per entry; 0 for window-only blocks
    int64_t committed_entries = 0;  // rows charged to the budget
  };
  // Charges the entry rows that positions up to `end` (exclusive) will write, before any
  // of them is computed, so a refusal leaves the sequence unchanged.
  Status commit_through(int64_t end);

  CachePlan plan_;
  std::vector<Block> blocks_;  // trunk then MTP
  int64_t position_ = 0;
  int64_t mtp_position_ = 0;
  uint64_t committed_ = 0;
  uint64_t entry_row_bytes_ = 0, key_row_bytes_ = 0;
  std::shared_ptr<CacheBudget> budget_;
};

}  // namespace dsv4
