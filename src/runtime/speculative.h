// MTP speculative decoding (spec §5): the MTP block drafts k tokens, chained on its own
// output streams from the trunk's final streams; the trunk verifies the k + 1 positions in
// one batched forward; the step keeps the longest accepted prefix plus one token, and the
// rejected positions leave no trace in the caches. The output is exactly the target's:
//   greedy    a draft is accepted while it equals the trunk's arg-max, so the tokens are
//             those of plain greedy decoding, token for token;
//   sampling  the standard rule (Leviathan et al. 2023, Chen et al. 2023): draft d ~ q is
//             accepted with probability min(1, p(d)/q(d)), else the token is drawn from
//             normalise(max(0, p - q)); after k accepted drafts one more token ~ p. p and q
//             are the distributions of one Sampler's settings (runtime/sampler.h) on the
//             trunk's and the MTP block's logits, so every token is distributed as p.
//
// Rollback without copies (Model::rewind): the caches keep kRewindTokens more rows than
// the model reads (model/cache.h), so after the verify forward the sequence is simply
// taken back to its kept positions (the rejected rows are never read again, compressed
// rows they completed are dropped with their pages) and its MTP blocks to their position
// after the step's true inputs (the chained drafts' rows). No copy, no second forward, no
// device work. V4.1 models (an n-gram history on the host) keep the first version: a
// snapshot after the MTP block has taken the true inputs, restored on a rejection, then
// the kept tokens fed again (bit-identical: results do not depend on chunking), and
// Model::restore_mtp when every draft is accepted. The MTP block takes the kept
// positions' (trunk streams, next token) pairs at the start of the next step, together
// with that step's first draft.
//
// Batched: every sequence of a step has its own k (adaptive: from its running acceptance
// rate, down to 0 = plain decoding, probed again later) and its own acceptance.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "model/model.h"
#include "runtime/sampler.h"
#include "util/status.h"

namespace dsv4::runtime {

struct SpecOptions {
  int max_k = 3;          // drafts per step, 1..4
  bool adaptive = true;   // else every step drafts max_k
  // Adaptive k: the cost of one draft (its MTP pass and its verify row) relative to a plain
  // decode step; k maximises expected tokens per cost, (1 - a^(k+1)) / (1 - a) / (1 + c k).
  double draft_cost = 0.2;
  // A sequence at k = 0 drafts again after this many plain steps, doubled after every probe
  // none of whose drafts was accepted (up to 16x), back to it after one that was.
  int probe_every = 16;
  // Adaptive k prices a step of k drafts by its measured time against a plain step's
  // (speculative steps of the same batch size whose sequences all drafted k, host clock, the
  // first two of each kind left out: they record graphs), instead of 1 + draft_cost k, once
  // both are measured; while no plain step of the batch size has been, three in a row are
  // taken every 32 steps to measure one. Off by default: the k chosen then depends on timings
  // (tests stay deterministic); dsv4 run and chat turn it on.
  bool measured_costs = false;
  // Test and benchmark mode: the draft of position `position` is this function's token
  // instead of the MTP block's (e.g. the target's own greedy tokens: acceptance 100%).
  // Greedy only (a forced draft has no draft distribution).
  std::function<int32_t(int64_t position)> forced_draft;
};

inline SamplingParams greedy_sampling() {
  SamplingParams p;
  p.temperature = 0.0f;
  return p;
}

// Per-sequence counters.
struct SpecStats {
  int64_t steps = 0;       // verify steps (a step at k = 0 counts too)
  int64_t drafted = 0;     // draft tokens proposed
  int64_t accepted = 0;    // draft tokens accepted
  int64_t emitted = 0;     // tokens produced by steps
  double acceptance() const { return drafted ? static_cast<double>(accepted) / drafted : 0.0; }
  double tokens_per_step() const { return steps ? static_cast<double>(emitted) / steps : 0.0; }
};

// One sequence being decoded speculatively. Its Sequence must be created with_mtp and
// be empty when start() is called.
struct SpecSequence {
  Sequence* sequence = nullptr;
  Sampler sampler{greedy_sampling()};  // its settings give p and q
  SpecStats stats;

  // The token generated last and not yet fed to the trunk (start() and every step set it).
  int32_t pending = -1;
  int k = 0;                  // drafts of the next step (adaptive)
  double acceptance_ema = 0;  // running acceptance rate
  int plain_steps = 0;        // consecutive steps at k = 0
  int failed_probes = 0;      // probes in a row with no draft accepted (SpecOptions::probe_every)
  // MTP pairs not yet fed: trunk final streams at positions mtp_position().. and the
  // token after each; the last pair is (streams at position - 1, pending).
  std::vector<float> mtp_streams;
  std::vector<int32_t> mtp_tokens;
};

// The accept/resample rule on distributions, one row per verified position (pure, for
// tests): drafts d[0..k), draft distributions q[j] (empty for a greedy step), target
// distributions p[0..k] (dense over the vocabulary), uniforms u(position index, purpose).
// Returns the emitted tokens: the accepted drafts then one more.
std::vector<int32_t> speculative_accept(std::span<const int32_t> drafts,
                                        std::span<const std::vector<double>> q,
                                        std::span<const std::vector<double>> p,
                                        const std::function<double(int j, int purpose)>& uniform);

class SpeculativeDecoder {
 public:
  SpeculativeDecoder(const Model& model, SpecOptions options);

  // Prefills `prompt` into s.sequence (empty, with_mtp) and samples the first token
  // (s.pending, also returned).
  Result<int32_t> start(SpecSequence& s, std::span<const int32_t> prompt) const;

  // One speculative step for every sequence (distinct sequences): appends each one's new
  // tokens (1 .. k + 1; the last one becomes its pending token) to emitted[i]. A sequence
  // within max_k + 1 tokens of its context drafts fewer.
  Status step(std::span<SpecSequence* const> seqs, std::vector<std::vector<int32_t>>& emitted) const;

  const SpecOptions& options() const { return options_; }

 private:
  int choose_k(const SpecSequence& s, size_t batch) const;
  // The measured time of a step of `batch` sequences at k drafts each over a plain one's,
  // 0 while either is unmeasured (SpecOptions::measured_costs).
  double measured_ratio(size_t batch, int k) const;
  void record_step(size_t batch, int k, double ms) const;
  const Model& model_;
  SpecOptions options_;
  struct StepTime {
    int seen = 0;
    double ms = 0;  // running mean of the steps after the first two
  };
  mutable std::map<std::pair<size_t, int>, StepTime> step_times_;  // (batch, k)
};

}  // namespace dsv4::runtime
