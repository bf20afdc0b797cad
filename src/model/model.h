// A DeepSeek-V4 model on a backend: load a GGUF file, create sequences, run batched
// forward passes (prefill chunks of any size, single-token decode), read logits.
//
//   backend::CpuBackend cpu(threads);
//   auto model = Model::load("model.gguf", cpu, {});           // Result<unique_ptr<Model>>
//   auto seq = (*model)->new_sequence({.max_context = 4096});  // Result<unique_ptr<Sequence>>
//   auto logits = (*model)->prefill(**seq, prompt_ids);        // logits of the last token
//   logits = (*model)->decode(**seq, next_id);                 // one token
//
// Prefix reuse and preemption: fork() copies a sequence, snapshot() keeps the small mutable
// part of its state at its position, restore() rewinds it there; export_sequence() and
// import_sequence() write and read a whole state as bytes (the server's disk cache).
//
// forward() runs several independent sequences in one step; each item appends its
// tokens at its sequence's next positions. Results are bit-identical whatever the
// chunking and batching (backend.h explains why). The model's cache manager (kv_cache.h)
// holds every sequence's state; a Sequence is a handle into it. One call at a time per
// model (the cache manager and the backend's step scratch are not reentrant); a failed
// call leaves its sequences unusable except when it was refused before computing (bad
// input, context, budget).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/cache.h"
#include "model/config.h"
#include "model/device_plan.h"
#include "model/engram.h"
#include "model/engram_table.h"
#include "model/kv_cache.h"
#include "model/layer_plan.h"
#include "model/kv_graft.h"
#include "model/steering.h"
#include "util/status.h"

namespace dsv4 {
class ModelFiles;
struct ModelWeights;
class ForwardTrace;

struct ModelOptions {
  // The official QAT roundings (spec §9.1-2): FP8 window/compressed KV, Hadamard + FP4
  // indexer queries and keys. On by default, as the checkpoint was trained.
  bool qat = true;
  // Exact: fp32 reference numerics (CI, fixtures). Quantized: a backend's fast path.
  backend::MatmulMode matmul = backend::MatmulMode::Exact;
  // An MTP sidecar to load with a trunk-only file (--mtp); empty: the one found by name
  // next to the trunk, if any (model_files.h).
  std::string mtp_path;
  // The cache manager: sequence slots, page size, physical bytes for pages.
  KvCacheOptions cache;
  // Steps whose items each add one token and sample it on the backend run padded to a
  // bucket of 1, 2, 4, ... 64 rows, recorded once per bucket as a graph and replayed where
  // the backend records graphs (a decode step is then one launch); `graphs` false runs
  // them directly. `decode_buckets` forces the padded path on backends without graphs
  // (tests: the padding must not change any token).
  bool graphs = true;
  bool decode_buckets = false;
  // Device memory the weights, caches and scratch must fit in (model/device_plan.h),
  // checked before anything is allocated; 0: the backend's free device memory, and
  // nothing to check on the CPU. Set, it is checked on any backend (tests, --device-memory).
  uint64_t device_memory = 0;
};

// A token adjustment before sampling (penalties, logit bias): x = x > 0 ? x / repetition :
// x * repetition, then x -= subtract.
struct LogitAdjustment {
  int32_t token = 0;
  float repetition = 1.0f;
  float subtract = 0.0f;
};

// Sampling on the backend (Backend::sample): temperature 0 is greedy; the draw is a pure
// function of the logits, the seed and the counter (e.g. the token's position).
struct SampleSpec {
  float temperature = 1.0f;
  float top_p = 1.0f;
  float min_p = 0.0f;
  int32_t top_k = 0;
  uint64_t seed = 0;
  uint64_t counter = 0;
  std::vector<LogitAdjustment> adjust;  // distinct tokens
};

struct BatchItem {
  Sequence* sequence = nullptr;
  std::span<const int32_t> tokens;  // appended at sequence->position()
  bool all_logits = false;          // logits for every token; else only for the last
  bool keep_streams = false;        // return the final hyper-connection streams (for MTP)
  // Sample the token after the item's last one on the backend; its logits are then not
  // returned (unless all_logits).
  const SampleSpec* sample = nullptr;
  // Speculative verification: the greedy (arg-max) token after every one of the item's
  // tokens, chosen on the backend, into ForwardOutput::row_tokens (excludes `sample`). A
  // batch whose items all ask for it with the same number of tokens (<= 5) runs as one
  // graph-replayed step per (sequence bucket, tokens), as decoding does.
  bool greedy_rows = false;
};

struct ForwardOutput {
  // Rows in batch order: every token of an all_logits item, else its last token unless
  // the item samples.
  std::vector<float> logits;  // [rows, vocab]
  int64_t rows = 0;
  // One per batch item: the sampled token, or -1 for an item without a SampleSpec.
  std::vector<int32_t> tokens;
  // For greedy_rows items, one per token, in batch order: the arg-max token after it.
  std::vector<int32_t> row_tokens;
  // For keep_streams items, every token, in batch order: [tokens, hc_mult * hidden]; on a
  // V4.1 model with DSpark stages, the DSpark main hidden instead (DsparkItem):
  // [tokens, targets * hidden].
  std::vector<float> streams;
};

// One MTP draft input: the main model's final streams at positions mtp_position()...,
// each paired with the token that follows it (spec §5).
struct MtpItem {
  Sequence* sequence = nullptr;
  std::span<const float> streams;        // [n, hc_mult * hidden]
  std::span<const int32_t> next_tokens;  // [n]
};

// One DSpark call (V4.1, shared/spec/deepseek-v41.md §3.7): the main hidden of trunk
// rows at positions mtp_position()... (ForwardOutput::streams of a keep_streams item),
// which seeds every stage's window; with an anchor (the token after the last row), a
// block of drafts follows that row.
struct DsparkItem {
  Sequence* sequence = nullptr;
  std::span<const float> main_hidden;  // [n, targets * hidden]
  int32_t anchor = -1;                 // -1: seed only (the prefill call)
};
// A drafted block after position p (the last seeded row; the anchor sits at p + 1).
struct DsparkDraft {
  std::vector<int32_t> tokens;    // [block]: greedy drafts for positions p + 2 ...
  std::vector<float> logits;      // [block, vocab]: shared head + Markov bias of the slot's previous token
  std::vector<float> confidence;  // [block]: the confidence head per slot
};

// The mutable parts of a sequence's state at one position (Model::snapshot): window
// rings, compressor states, the position and entry counts. Compressed entries and indexer
// keys before the position are append-only, so they are not copied. Snapshots are values:
// copies share one immutable state.
class SequenceSnapshot {
 public:
  bool valid() const { return state_ != nullptr; }
  int64_t position() const { return state_ ? state_->position : 0; }  // trunk tokens processed when taken
  uint64_t bytes() const;  // memory the snapshot holds

 private:
  friend class Model;
  std::shared_ptr<const SlotSnapshot> state_;
};

struct StepItem;  // forward.h

class Model {
 public:
  static Result<std::unique_ptr<Model>> load(const std::string& path, backend::Backend& backend,
                                             ModelOptions options = {});
  ~Model();

  const ModelConfig& config() const { return config_; }
  const ModelFiles& files() const { return *files_; }  // layout, notes, the files
  const ModelOptions& options() const { return options_; }
  backend::Backend& backend() const { return *backend_; }
  bool has_mtp() const { return config_.n_mtp > 0; }

  // A fresh, empty cache. Fails (allocating nothing) when max_context exceeds the
  // model's context length or the plan exceeds memory_budget.
  Result<std::unique_ptr<Sequence>> new_sequence(const SequenceOptions& options = {}) const;

  // With a trace, every named intermediate is recorded into it (trace.h); without one,
  // nothing is recorded and nothing is spent.
  Status forward(std::span<const BatchItem> batch, ForwardOutput& out,
                 ForwardTrace* trace = nullptr) const;

  // Draft logits of the MTP block, one row per input position: [n, vocab]. With
  // `streams_out`, also the block's output streams per row ([n, hc_mult * hidden]), the
  // input of a chained draft (speculative decoding, runtime/speculative.h).
  Result<std::vector<float>> mtp(std::span<const MtpItem> batch, ForwardTrace* trace = nullptr,
                                 std::vector<float>* streams_out = nullptr) const;

  // V4.1's DSpark stages: seeds each item's rows, then drafts a block for every item with
  // an anchor (one result per item, empty without). The sequence needs with_mtp.
  Result<std::vector<DsparkDraft>> dspark(std::span<const DsparkItem> batch, ForwardTrace* trace = nullptr) const;

  // An independent copy of seq's whole state (same position; later forwards on either do
  // not affect the other), charged to the same budget; compressed rows are shared until
  // one of them writes (copy on write).
  Result<std::unique_ptr<Sequence>> fork(const Sequence& seq) const;
  // The mutable parts at seq's current position; entries before it are append-only and
  // are not copied.
  Result<SequenceSnapshot> snapshot(const Sequence& seq) const;
  // Rewinds seq (which must have reached at least the snapshot's position without being
  // rewound past it since) to the snapshot's state exactly: the continuation is
  // bit-identical to a sequence that never went further.
  Status restore(Sequence& seq, const SequenceSnapshot& snap) const;
  // Rewinds only the MTP blocks' part of seq (their window rings and the MTP position) to
  // the snapshot, which must be at or below seq's MTP position; the trunk is untouched
  // (speculative decoding drops its chained drafts' MTP rows this way).
  Status restore_mtp(Sequence& seq, const SequenceSnapshot& snap) const;
  // Takes seq back to `position` (trunk) and `mtp_position` (MTP blocks), each at most
  // kRewindTokens (cache.h) back, without copies: speculative decoding's rollback of
  // rejected drafts (KvCache::rewind). The continuation and the exported state are
  // bit-identical to a sequence that never went further. Not for V4.1 (an n-gram history).
  Status rewind(Sequence& seq, int64_t position, int64_t mtp_position) const;
  bool can_rewind() const { return !plan_.v41; }

  // Benchmarks only: moves an empty sequence to `position` without computing anything, so
  // later steps cost what they cost at that context depth: its cache pages through
  // `position` are committed and its window rings, compressor states and compressed rows
  // hold random finite values (a function of `seed`), not what any tokens would leave.
  // Decoding on from there is well defined and finite, and meaningless as text.
  Status fill_for_benchmark(Sequence& seq, int64_t position, uint64_t seed) const;

  const ModelPlan& plan() const { return plan_; }
  KvCache& cache() const { return *cache_; }
  // Device memory at load, by part (capacity 0 on the CPU without ModelOptions::device_memory).
  const DeviceMemoryPlan& memory_plan() const { return memory_plan_; }

  // Activation steering (steering.h): binds the file's directions (all, or those of
  // `layers`), each normalised once in double for project mode, at strength `alpha` (the
  // file's glp.alpha when absent); sequences created afterwards start with that strength
  // (Sequence::set_steering_alpha changes one). Replaces an earlier binding; not while a
  // step runs.
  Status bind_steering(const SteeringFile& file, std::optional<float> alpha = std::nullopt,
                       const std::vector<uint32_t>& layers = {});
  void unbind_steering();
  struct Steering {
    SteerMode mode = SteerMode::Project;
    SteerHook hook = SteerHook::FfnOut;
    float alpha = 0.0f;
    std::vector<backend::Tensor> directions;  // per trunk block; empty: not steered
  };
  const Steering* steering() const { return steering_ ? &*steering_ : nullptr; }

  // A KV graft bank of seq's own compressed rows (every compressed layer; `dsv4 graft
  // make`): seq's position must be a multiple of the largest compress ratio, and becomes
  // the bank's footprint.
  Result<KvGraft> extract_graft(const Sequence& seq) const;

  // The whole state of seq as bytes (a header naming the cache shape, then every row in
  // use), and a fresh sequence in such a state, charged to the model's cache budget. Bytes
  // of another cache shape, or damaged ones, are refused with the field that differs.
  Result<std::vector<uint8_t>> export_sequence(const Sequence& seq) const;
  Result<std::unique_ptr<Sequence>> import_sequence(std::span<const uint8_t> bytes,
                                                    const SequenceOptions& options) const;

  // Conveniences over forward() for one sequence.
  Result<std::vector<float>> prefill(Sequence& seq, std::span<const int32_t> tokens,
                                     bool all_logits = false) const;
  Result<std::vector<float>> decode(Sequence& seq, int32_t token) const;

 private:
  Model() = default;
  std::unique_ptr<ModelFiles> files_;
  ModelConfig config_;
  ModelPlan plan_;
  ModelOptions options_;
  backend::Backend* backend_ = nullptr;
  std::unique_ptr<ModelWeights> weights_;
  std::unique_ptr<KvCache> cache_;
  DeviceMemoryPlan memory_plan_;
  std::unique_ptr<EngramHasher> engram_hasher_;  // V4.1
  std::vector<EngramTable> engram_tables_;      // V4.1: read on demand, never resident
  std::optional<Steering> steering_;
  struct DecodeBucket;  // persistent inputs and graph state of one bucket size
  mutable std::vector<std::unique_ptr<DecodeBucket>> buckets_;
  Status decode_step(std::span<const BatchItem> batch, ForwardOutput& out) const;
  // V4.1: hashes the step's tokens (advancing each sequence's n-gram history) and reads
  // their Engram rows, per Engram layer [step row][columns][dim].
  Result<std::vector<std::vector<float>>> gather_engram(const std::vector<StepItem>& items,
                                                        const std::vector<int32_t>& tokens) const;
};

}  // namespace dsv4
