// The cache manager: owns every sequence's decode state for one model on one backend and
// hands the forward pass views of it (backend.h's SlotRows, PagedRows).
//
//   rings    one per block: [slots * ring_rows, head_dim], slot s's ring at rows
//            s*ring_rows..; position p at row p mod ring_rows (ring_rows = window +
//            kRewindTokens, cache.h)
//   states   one per compressor (ModelPlan::states): kv and score [slots * rows, cols],
//            rows = overlap * ratio + kRewindTokens, also one row per position
//   lists    one per growing list (ModelPlan::lists): rows in pages of `page_rows` rows
//            from a pool shared by every list of the same width; per list a page table
//            I32 [slots, max_pages] (-1 = no page) mirrored on the host.
//
// Pages are committed when a step is about to write their first row (prepare()), charged to
// the budget of the sequence that allocates them, and freed when the last sequence that
// references them lets go. fork() shares pages; a step that would write into a shared page
// copies it first (copy on write), so forks and snapshots never see each other's rows.
// All bookkeeping is on the host, before a step; the step itself only reads the page tables
// on the device. Not thread-safe: one caller (the model's step) at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "model/cache.h"
#include "model/layer_plan.h"
#include "util/status.h"

namespace dsv4 {

struct KvCacheOptions {
  uint32_t max_sequences = 64;  // slots
  uint32_t page_rows = 64;      // rows per page
  // Physical bytes for pages; 0: every slot at the full context (reserved, so the CPU
  // backend commits pages only when written; a device backend should be given a budget).
  uint64_t pool_bytes = 0;
  uint64_t max_context = 0;     // longest sequence (sizes the page tables); 0: the model's
};

// The mutable parts of one sequence at one position (SequenceSnapshot in model.h).
struct SlotSnapshot {
  int64_t position = 0;
  int64_t mtp_position = 0;
  uint64_t context = 0;                    // the sequence's context: a snapshot fits only its like
  std::vector<std::vector<float>> rings;   // per ring: window * head_dim
  std::vector<std::vector<float>> states;  // per state: kv then score
  EngramHasher::History engram_history;    // V4.1: the n-gram look-back
};

// What create() allocates, by part (device memory planning, model/device_plan.h).
struct KvCacheBytes {
  uint64_t slots = 0;   // window rings and compressor states of every slot
  uint64_t tables = 0;  // page tables
  uint64_t pages = 0;   // the page pools
  uint64_t total() const { return slots + tables + pages; }
};

class KvCache {
 public:
  // The bytes create() would allocate with these options, without allocating.
  static KvCacheBytes plan_bytes(const ModelConfig& config, const ModelPlan& plan, const KvCacheOptions& options);
  // The bytes this cache allocated (equal to plan_bytes of its options).
  KvCacheBytes allocated_bytes() const;
  static Result<std::unique_ptr<KvCache>> create(const ModelConfig& config, const ModelPlan& plan,
                                                 backend::Backend& backend, const KvCacheOptions& options);
  ~KvCache();

  const KvCacheOptions& options() const { return options_; }
  uint64_t max_context() const { return max_context_; }
  uint32_t free_slots() const { return static_cast<uint32_t>(free_slots_.size()); }
  uint64_t free_pages(uint32_t width) const;
  uint64_t fixed_bytes_per_slot() const { return fixed_bytes_; }

  // Views for a step (valid for the cache's lifetime).
  backend::SlotRows ring(int32_t id) const { return {rings_.at(id), ring_rows_}; }
  backend::SlotRows state_kv(int32_t id) const { return {states_kv_.at(id), state_rows_.at(id)}; }
  backend::SlotRows state_score(int32_t id) const { return {states_score_.at(id), state_rows_.at(id)}; }
  backend::PagedRows list(int32_t id) const;

  // A fresh slot for `seq` (empty compressor states, no pages).
  Status attach(Sequence& seq);
  // Pages for every row `seq` will have written at position `end` (exclusive), private
  // copies of shared pages those rows land in, charged to seq's budget; on failure nothing
  // changes. The page tables reach the device with sync().
  Status prepare(Sequence& seq, int64_t end);
  Status sync();
  // Releases seq's pages and slot (the destructor of Sequence calls this).
  void detach(Sequence& seq);

  // Plants a graft's rows in a freshly attached seq (position 0): pages for its rows, each
  // covered list's first row, the position and window start set to the footprint.
  Status plant(Sequence& seq, const KvGraft& graft);

  // Rows [begin, begin + count) of seq's list `list`, on the host (graft banks, tests).
  Result<std::vector<float>> read_rows(const Sequence& seq, int32_t list, int64_t begin, int64_t count);

  // `copy` gets its own slot with seq's rings and states and shares seq's pages.
  Status fork(const Sequence& seq, Sequence& copy);
  Result<SlotSnapshot> snapshot(const Sequence& seq);
  // Rewinds seq to the snapshot: rings and states restored, rows past it released.
  Status restore(Sequence& seq, const SlotSnapshot& snap);
  // Restores only the MTP blocks' rings and the MTP position (snap at or below it).
  Status restore_mtp(Sequence& seq, const SlotSnapshot& snap);
  // Takes seq back to `position` and its MTP blocks to `mtp_position`, each at most
  // kRewindTokens back and not before the sequence's first position, without copying
  // anything: the rings keep every row the kept positions read (cache.h), rows past the
  // new positions are never read again, and pages past them are released. The
  // continuation is bit-identical to a sequence that never went further, and so is its
  // exported state. V4.1 sequences (an n-gram history on the host) are refused.
  Status rewind(Sequence& seq, int64_t position, int64_t mtp_position);

  // seq's whole state as bytes: a header naming the cache's shape and the position, then
  // every ring and compressor state of its slot and every row its lists hold. A grafted
  // sequence is refused (its rows below the footprint belong to the bank). The bytes are
  // canonical: ring and state rows that no later step reads (older positions, positions
  // taken back by rewind) are written as a fresh slot has them (V4: window rows zero,
  // state rows kv 0 and score -inf), so two sequences that continue alike export alike.
  Result<std::vector<uint8_t>> export_state(const Sequence& seq);
  // Loads such bytes into a freshly attached seq (position 0): the header is checked
  // against this cache before anything is committed, pages are committed as prepare()
  // would, and the positions set. On failure seq keeps position 0 and no rows.
  Status import_state(Sequence& seq, std::span<const uint8_t> bytes);

  // Benchmarks only (Model::fill_for_benchmark): an empty `seq` as if it had processed
  // `position` tokens: pages through `position` committed, every ring, state and row of it
  // random finite values (counter-based, keyed by `seed`), positions set. On failure the
  // sequence keeps position 0.
  Status fill_random(Sequence& seq, int64_t position, uint64_t seed);

  uint64_t page_bytes(int32_t list) const;
  uint64_t referenced_bytes(const Sequence& seq) const;

 private:
  KvCache(const ModelPlan& plan, backend::Backend& be);
  struct Pool;
  Result<int32_t> take_page(int32_t list, const std::shared_ptr<CacheBudget>& budget);
  void drop_page(int32_t list, int32_t page);
  int64_t rows_at(int32_t list, int64_t position) const;
  void set_page(int32_t list, uint32_t slot, size_t index, int32_t page);
  Status reset_states(uint32_t slot);
  void drop_pages_past(Sequence& seq, int64_t position);
  Status write_rows(const Sequence& seq, int32_t list, int64_t begin, int64_t count, const float* rows);

  const ModelPlan& plan_;
  backend::Backend& be_;
  KvCacheOptions options_;
  uint64_t max_context_ = 0;
  int64_t ring_rows_ = 0;  // window + kRewindTokens rows per slot (a ring of positions)
  uint64_t fixed_bytes_ = 0;
  std::vector<backend::Tensor> rings_;
  std::vector<backend::Tensor> states_kv_, states_score_;
  std::vector<int64_t> state_rows_;
  std::vector<uint32_t> free_slots_;

  struct ListTable {
    int32_t pool = 0;
    int64_t max_pages = 0;
    backend::Tensor device;       // I32 [slots, max_pages]
    std::vector<int32_t> host;    // the same, on the host
    std::vector<bool> dirty;      // per slot
    backend::Tensor first_row;    // I32 [slots]: rows below it do not exist (grafts)
    std::vector<int32_t> first_row_host;
    bool first_row_dirty = true;
  };
  std::vector<ListTable> tables_;
  std::vector<std::unique_ptr<Pool>> pools_;
};

}  // namespace dsv4
