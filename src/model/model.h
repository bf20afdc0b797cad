// A DeepSeek-V4 model on a backend: load a GGUF file, create sequences, run batched
// forward passes (prefill chunks of any size, single-token decode), read logits.
//
//   backend::CpuBackend cpu(threads);
//   auto model = Model::load("model.gguf", cpu, {});           // Result<unique_ptr<Model>>
//   auto seq = (*model)->new_sequence({.max_context = 4096});  // Result<unique_ptr<Sequence>>
//   auto logits = (*model)->prefill(**seq, prompt_ids);        // logits of the last token
//   logits = (*model)->decode(**seq, next_id);                 // one token
//
// Prefix reuse and preemption (sequence_snapshot.cpp): fork() copies a sequence,
// snapshot() keeps the small mutable part of its state at its position, restore() rewinds
// it there; export_sequence()/import_sequence() write and read a whole state as bytes (the
// server's disk cache).
//
// forward() runs several independent sequences in one batch; each item appends its
// tokens at its sequence's next positions. Results are bit-identical whatever the
// chunking and batching (backend.h explains why). One call at a time per backend (the
// CPU backend's thread pool is not reentrant); a failed call leaves its sequences
// unusable except when it was refused before computing (bad input, context, budget).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/cache.h"
#include "model/config.h"
#include "util/status.h"

namespace dsv4 {
namespace gguf { class GgufFile; }
struct ModelWeights;
class ForwardTrace;

struct ModelOptions {
  // The official QAT roundings (spec §9.1-2): FP8 window/compressed KV, Hadamard + FP4
  // indexer queries and keys. On by default, as the checkpoint was trained.
  bool qat = true;
  // Exact: fp32 reference numerics (CI, fixtures). Quantized: a backend's fast path.
  backend::MatmulMode matmul = backend::MatmulMode::Exact;
};

struct BatchItem {
  Sequence* sequence = nullptr;
  std::span<const int32_t> tokens;  // appended at sequence->position()
  bool all_logits = false;          // logits for every token; else only for the last
  bool keep_streams = false;        // return the final hyper-connection streams (for MTP)
};

struct ForwardOutput {
  // Rows in batch order: every token of an all_logits item, else its last token.
  std::vector<float> logits;  // [rows, vocab]
  int64_t rows = 0;
  // For keep_streams items, every token, in batch order: [tokens, hc_mult * hidden].
  std::vector<float> streams;
};

// One MTP draft input: the main model's final streams at positions mtp_position()...,
// each paired with the token that follows it (spec §5).
struct MtpItem {
  Sequence* sequence = nullptr;
  std::span<const float> streams;        // [n, hc_mult * hidden]
  std::span<const int32_t> next_tokens;  // [n]
};

// The mutable parts of a sequence's state at one position (Model::snapshot): window
// rings, compressor states, the position and entry counts. Compressed entries and indexer
// keys before the position are append-only, so they are not copied. Snapshots are values:
// copies share one immutable state.
struct SequenceSnapshot {
 public:
  SequenceSnapshot();
  ~SequenceSnapshot();
  SequenceSnapshot(const SequenceSnapshot&);
  SequenceSnapshot& operator=(const SequenceSnapshot&);
  SequenceSnapshot(SequenceSnapshot&&) noexcept;
  SequenceSnapshot& operator=(SequenceSnapshot&&) noexcept;

  bool valid() const { return state_ != nullptr; }
  int64_t position() const;  // trunk tokens processed when it was taken
  uint64_t bytes() const;    // memory the snapshot holds

 private:
  friend class Model;
  struct State;
  std::shared_ptr<const State> state_;
};

class Model {
 public:
  static Result<std::unique_ptr<Model>> load(const std::string& path, backend::Backend& backend,
                                             ModelOptions options = {});
  ~Model();

  const ModelConfig& config() const { return config_; }
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

  // Draft logits of the MTP block, one row per input position: [n, vocab].
  Result<std::vector<float>> mtp(std::span<const MtpItem> batch, ForwardTrace* trace = nullptr) const;

  // An independent copy of seq's whole state at its position: later forwards on either do
  // not affect the other. Charged to seq's shared budget (fails, allocating nothing, when
  // it does not fit).
  Result<std::unique_ptr<Sequence>> fork(const Sequence& seq) const;
  // The mutable parts of seq's state at its current position (small: no entries).
  Result<SequenceSnapshot> snapshot(const Sequence& seq) const;
  // Rewinds seq to the snapshot's state exactly: continuing from it is bit-identical to a
  // fresh run on the same tokens. Precondition (the caller's to keep): the snapshot was
  // taken of seq, or of the sequence seq was forked from, and seq has reached at least the
  // snapshot's position without being rewound past it since. Checked: same model and
  // cache shape, position not beyond seq's. Committed rows stay committed.
  Status restore(Sequence& seq, const SequenceSnapshot& snap) const;

  // The whole state of seq as bytes (a header naming the cache shape, then every row in
  // use), and a fresh sequence in such a state, charged to options.shared_budget. Bytes of
  // another cache shape, or damaged ones, are refused with the field that differs.
  Result<std::vector<uint8_t>> export_sequence(const Sequence& seq) const;
  Result<std::unique_ptr<Sequence>> import_sequence(std::span<const uint8_t> bytes,
                                                    const SequenceOptions& options) const;

  // Conveniences over forward() for one sequence.
  Result<std::vector<float>> prefill(Sequence& seq, std::span<const int32_t> tokens,
                                     bool all_logits = false) const;
  Result<std::vector<float>> decode(Sequence& seq, int32_t token) const;

 private:
  Model() = default;
  std::unique_ptr<gguf::GgufFile> file_;
  ModelConfig config_;
  ModelOptions options_;
  backend::Backend* backend_ = nullptr;
  std::unique_ptr<ModelWeights> weights_;
};

}  // namespace dsv4
