// A DeepSeek-V4 model on a backend: load a GGUF file, create sequences, run batched
// forward passes (prefill chunks of any size, single-token decode), read logits.
//
//   backend::CpuBackend cpu(threads);
//   auto model = Model::load("model.gguf", cpu, {});           // Result<unique_ptr<Model>>
//   auto seq = (*model)->new_sequence({.max_context = 4096});  // Result<unique_ptr<Sequence>>
//   auto logits = (*model)->prefill(**seq, prompt_ids);        // logits of the last token
//   logits = (*model)->decode(**seq, next_id);                 // one token
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

  // Draft logits of the MTP block, one row per input position: [n, vocab].
  Result<std::vector<float>> mtp(std::span<const MtpItem> batch, ForwardTrace* trace = nullptr) const;

  // Conveniences over forward() for one sequence.
  Result<std::vector<float>> prefill(Sequence& seq, std::span<const int32_t> tokens,
                                     bool all_logits = false) const;
  Result<std::vector<float>> decode(Sequence& seq, int32_t token) const;

 private:
  Model() = default;
  std::unique_ptr<ModelFiles> files_;
  ModelConfig config_;
  ModelOptions options_;
  backend::Backend* backend_ = nullptr;
  std::unique_ptr<ModelWeights> weights_;
};

}  // namespace dsv4
