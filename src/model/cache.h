// Per-sequence decode state (spec §6.1): its exact size before allocation (CachePlan), the
// byte budget many sequences share (CacheBudget), and the handle a caller holds for one
// sequence (Sequence). The memory itself belongs to the model's cache manager
// (model/kv_cache.h): window rings and compressor states in a fixed slot per sequence,
// compressed KV entries and indexer keys in pages handed out as rows arrive.
//
// The reference numerics keep every vector in fp32, cache_layout.h's F32 format (the QAT
// roundings, when on, put the values on the FP8/FP4 grids, but they stay fp32 here).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/cache_layout.h"
#include "model/config.h"
#include "model/engram.h"
#include "util/status.h"

namespace dsv4 {

class KvCache;

// Tokens a sequence can be taken back without copies (KvCache::rewind; speculative
// decoding's rejected drafts, at most 4 a step): every window ring and compressor state
// is a ring of positions with this many rows more than the model reads, so the rows the
// rewound positions still need are never overwritten by the tokens taken back.
inline constexpr int64_t kRewindTokens = 4;

// Bytes of each part of one sequence's cache after `context` tokens: the F32 cache
// layout's totals (windows and compressor states fixed, each with its kRewindTokens rows;
// CSA entries, indexer keys and HCA entries growing with the tokens, in whole pages of
// `page_rows` rows).
struct CachePlan : CacheTotals {
  uint64_t context = 0;
  uint64_t page_rows = 1;

  std::string describe() const;  // every part on one line

  // Fails (out of range) when `context` exceeds the model's context length. `with_mtp`
  // includes the MTP blocks' windows.
  static Result<CachePlan> compute(const ModelConfig& config, uint64_t context, bool with_mtp,
                                   uint64_t page_rows = 1);
};

// A byte budget shared by the sequences that commit cache memory against it.
class CacheBudget {
 public:
  explicit CacheBudget(uint64_t limit_bytes) : limit_(limit_bytes) {}
  // Fails (resource exhausted), changing nothing, past the limit.
  Status commit(uint64_t bytes, const std::string& what);
  void release(uint64_t bytes) { used_ -= bytes; }
  uint64_t used() const { return used_; }
  uint64_t limit() const { return limit_; }

 private:
  const uint64_t limit_;
  std::atomic<uint64_t> used_{0};
};

struct KvGraft;

struct SequenceOptions {
  uint64_t max_context = 0;     // 0: the model's context length
  uint64_t memory_budget = 0;   // 0: unlimited; else the plan's total must fit
  bool with_mtp = false;        // keep the MTP blocks' windows too
  std::shared_ptr<CacheBudget> shared_budget;  // optional: charged as memory is committed
  // Optional: rows planted in the compressed caches before the first token (kv_graft.h);
  // the sequence then starts at the graft's footprint.
  std::shared_ptr<const KvGraft> graft;
};

// One sequence's place in the cache manager. Created by Model::new_sequence (or fork),
// destroyed by its owner; destruction returns its slot and pages.
class Sequence {
 public:
  ~Sequence();
  Sequence(const Sequence&) = delete;
  Sequence& operator=(const Sequence&) = delete;

  int64_t position() const { return position_; }          // trunk tokens processed
  int64_t mtp_position() const { return mtp_position_; }  // MTP tokens processed
  uint64_t max_context() const { return plan_.context; }
  const CachePlan& plan() const { return plan_; }
  bool with_mtp() const { return with_mtp_; }
  // Memory this sequence holds: its slot's fixed parts and the pages it references.
  uint64_t committed_bytes() const;
  uint32_t slot() const { return slot_; }
  // The first position with KV: 0, or a graft's footprint.
  int64_t window_start() const { return window_start_; }
  const std::shared_ptr<const KvGraft>& graft() const { return graft_; }
  // Steering strength for this sequence (Model::bind_steering sets the default).
  float steering_alpha() const { return steering_alpha_; }
  void set_steering_alpha(float alpha) { steering_alpha_ = alpha; }

 private:
  friend class Model;
  friend class KvCache;
  friend struct ForwardPass;
  Sequence() = default;

  KvCache* cache_ = nullptr;
  uint32_t slot_ = 0;
  CachePlan plan_;
  bool with_mtp_ = false;
  int64_t position_ = 0;
  int64_t mtp_position_ = 0;
  int64_t window_start_ = 0;
  float steering_alpha_ = 0.0f;
  std::shared_ptr<const KvGraft> graft_;
  std::vector<std::vector<int32_t>> pages_;  // per cache list: page ids in row order
  std::shared_ptr<CacheBudget> budget_;
  EngramHasher::History engram_history_;  // V4.1: the n-gram look-back across steps
};

}  // namespace dsv4
