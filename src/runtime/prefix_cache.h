// Prefix reuse across requests: the caches of finished (and running) requests, kept so a
// new request that shares a prefix (same tokens; one model with one set of options per
// server) continues from it instead of recomputing.
//
// DeepSeek-V4's state at position p is more than rows: the window ring and the open
// compressor blocks change with every token, so a cache can only be rewound to a point
// where those mutable parts were saved. Each entry keeps snapshots (model.h) at
// compression-block boundaries (multiples of the model's largest compress ratio): every
// `snapshot_interval` tokens and at the last boundary of each prompt, at most
// `max_snapshots` per entry (thinned evenly). A lookup takes the entry with the longest
// usable match: all of its tokens when they are a prefix of the request (continue as is),
// else its latest snapshot inside the common prefix (restore). An idle entry is taken
// over (or forked, when only a small part of it matches); a busy one is forked.
//
// Every byte lives in the shared CacheBudget: sequences as they commit rows, snapshots
// as they are taken. Idle entries are evicted least recently used first, when memory is
// needed or more than `max_idle` wait. With a persist folder, an evicted entry (and
// every idle one at shutdown) is written to disk, whole, and found again after a
// restart; files carry the model's identity and are ignored when it differs.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "model/model.h"
#include "util/status.h"

namespace dsv4::runtime {

struct PrefixCacheOptions {
  int64_t block = 0;              // snapshot granularity; 0: the model's largest compress ratio
  int64_t snapshot_interval = 0;  // tokens between snapshots (a multiple of block); 0: 8 blocks
  size_t max_snapshots = 8;       // per entry
  size_t max_idle = 16;           // idle entries kept in memory
  std::string persist_dir;        // empty: no disk cache
  uint64_t persist_budget = 0;    // bytes on disk; the oldest files go first
  std::string identity;           // model_identity(): what persisted files must match
  // A KV graft planted in every sequence (kv_graft.h): entries then hold tokens after the
  // graft's footprint; grafted sequences are never persisted (their first rows are the
  // graft's), so no file is written or read.
  std::shared_ptr<const KvGraft> graft;
  // Sequences keep the MTP blocks' windows (speculative decoding, SchedulerOptions).
  bool with_mtp = false;
};

// One cached sequence and the tokens in it.
struct CacheEntry {
  explicit CacheEntry(std::shared_ptr<CacheBudget> budget) : budget_(std::move(budget)) {}
  ~CacheEntry();
  CacheEntry(const CacheEntry&) = delete;
  CacheEntry& operator=(const CacheEntry&) = delete;

  std::unique_ptr<Sequence> seq;
  std::vector<int32_t> tokens;  // the tokens in seq: tokens.size() == tokens_in(*seq)
  std::map<int64_t, SequenceSnapshot> snapshots;
  uint64_t snapshot_bytes = 0;  // charged to the budget
  bool busy = false;            // leased to a running request
  // Speculative decoding: the trunk's final streams at positions seq->mtp_position() ..
  // mtp_streams_end - 1, the MTP block's inputs it has not taken yet (their next tokens are
  // the request's own); valid only while mtp_streams_end == seq->position() (a restore or a
  // fork loses them; a request that continues the entry then decodes without drafts).
  std::vector<float> mtp_streams;
  int64_t mtp_streams_end = -1;
  uint64_t last_use = 0;

 private:
  friend class PrefixCache;
  std::shared_ptr<CacheBudget> budget_;
};

struct PrefixCacheStats {
  uint64_t lookups = 0, hits = 0;      // acquire() calls, and those that reused tokens
  uint64_t reused_tokens = 0;
  uint64_t idle_entries = 0, busy_entries = 0, snapshots = 0, snapshot_bytes = 0;
  uint64_t disk_entries = 0, disk_bytes = 0, disk_loads = 0, disk_writes = 0;
  uint64_t evictions = 0;
};

class PrefixCache {
 public:
  // Sequences get `max_context` and the shared `budget`.
  PrefixCache(const Model& model, std::shared_ptr<CacheBudget> budget, uint64_t max_context,
              PrefixCacheOptions options);
  ~PrefixCache();

  struct Lease {
    std::shared_ptr<CacheEntry> entry;  // busy; its sequence holds tokens[0, reused)
    int64_t reused = 0;
  };
  // A sequence for a request whose tokens are `tokens` (at least one is left to compute),
  // steered at `steering_alpha` (Sequence::steering_alpha): only entries computed at that
  // strength are reused, and only unsteered-by-request ones (the model's default strength)
  // go to or come from disk.
  // Fails with kResourceExhausted when memory is short even after evicting every idle
  // entry it did not reuse; nothing changes then.
  Result<Lease> acquire(std::span<const int32_t> tokens, float steering_alpha);
  void release(const std::shared_ptr<CacheEntry>& entry);  // back to idle (most recent)
  void discard(const std::shared_ptr<CacheEntry>& entry);  // freed now

  // Where a chunk that starts at the entry's position and wants to end at `want_end`
  // should end instead, to stop at the next snapshot point (`prompt_end`: the request's
  // prompt length, whose last boundary is one).
  int64_t chunk_end(const CacheEntry& entry, int64_t want_end, int64_t prompt_end) const;
  // After the entry's sequence advanced: a snapshot when it stands on a snapshot point
  // (skipped when the budget has no room).
  void on_advance(CacheEntry& entry, int64_t prompt_end);

  bool evict_one();      // the least recently used idle entry; false when there is none
  bool drop_snapshots();  // every busy entry's snapshots (memory pressure); false when none
  Status persist_all();  // every idle entry to disk (shutdown)
  PrefixCacheStats stats() const;
  int64_t block() const { return block_; }

 private:
  struct DiskEntry {
    std::string file;
    std::vector<int32_t> tokens;
    uint64_t bytes = 0;
    uint64_t order = 0;  // write order: the lowest goes first
  };
  bool is_snapshot_point(int64_t p, int64_t prompt_end) const;
  Result<std::unique_ptr<Sequence>> make_sequence(float steering_alpha);
  float default_alpha() const;
  template <typename Make>
  Result<std::unique_ptr<Sequence>> with_room(Make make, const CacheEntry* keep);
  std::shared_ptr<CacheEntry> adopt(std::unique_ptr<Sequence> seq, std::span<const int32_t> tokens);
  void copy_snapshots(const CacheEntry& from, CacheEntry& to, int64_t up_to);
  void drop_snapshots_after(CacheEntry& e, int64_t position);
  void remove(const std::shared_ptr<CacheEntry>& e);
  Status persist(const CacheEntry& e);
  void scan_disk();
  Result<std::shared_ptr<CacheEntry>> load(const DiskEntry& d, const CacheEntry* keep);
  void trim_disk();

  const Model& model_;
  std::shared_ptr<CacheBudget> budget_;
  uint64_t max_context_;
  PrefixCacheOptions opt_;
  int64_t block_ = 1, interval_ = 1;
  std::vector<std::shared_ptr<CacheEntry>> entries_;  // idle and busy
  std::vector<DiskEntry> disk_;
  uint64_t clock_ = 0, disk_order_ = 0;
  PrefixCacheStats stats_;
};

// A string that identifies the model file's contents and the options that change its
// numbers: size, a hash of the first 16 MiB (header, metadata, tensor table, first
// weights) and the last 1 MiB, the context and numerics options.
// Tokens a sequence holds after its first position (a graft's footprint, else 0).
inline int64_t tokens_in(const Sequence& seq) { return seq.position() - seq.window_start(); }

Result<std::string> model_identity(const std::string& path, const ModelOptions& options);

}  // namespace dsv4::runtime
