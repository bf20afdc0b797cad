// Continuous batching of many requests over one model and one KV-cache budget.
//
// Each step() builds one batch under a token budget: first a decode token for every
// running request that has one (by priority, then age), then prefill chunks of the
// others (by priority, round-robin among equals, so long prompts share the rest and
// decoders keep their pace), and runs it as one Model::forward. Then each request whose
// sequence has caught up with its tokens samples its next token.
//
// Admission. submit() refuses, with the numbers, what can never run: a prompt that leaves
// no room in the context (kOutOfRange) and a request whose cache plan (CachePlan of
// prompt + max_tokens) exceeds the whole budget (kInvalidArgument); and, when the queue
// is full, anything (kResourceExhausted, with a retry estimate). A queued request starts
// when a slot is free (max_seqs) and its plan fits next to what the running sequences
// have committed; its sequence comes from the prefix cache (prefix_cache.h).
//
// A KV graft (options.prefix.graft) starts every sequence at its footprint F: prompts and
// outputs get max_context - F tokens, and each request's cache plan covers F + its tokens
// (the graft's rows are committed with the sequence). A request's steering strength
// (RequestSpec::steering_alpha) needs a bound steering file and |alpha| <= kMaxSteeringAlpha.
//
// Memory is committed as rows are written, so running requests may outgrow the budget
// together: a step that cannot get memory evicts idle prefix-cache entries, then drops
// the running entries' snapshots, then preempts the lowest-priority (youngest) request — its sequence is freed and it goes
// back to the queue, to resume later by recomputing its tokens (bit-identical: the
// forward pass does not depend on chunking) with its sampler state intact.
//
// Speculative decoding (options.speculative, speculative.h): a decoding request drafts
// up to k tokens with the MTP block and verifies them in one batched forward with the
// other speculating requests, each with its own k (adaptive) and acceptance; its k + 1
// rows count against batch_tokens, and k never reaches past its max_tokens or context.
// The verified tokens go through the same stop rules one by one (EOS, stop tokens and
// strings, max_tokens), so nothing past a stop is emitted. Requests with a grammar or
// log-probabilities decode without drafts (their tokens need every row's logits), as do
// requests that continue a prefix whose MTP inputs were not kept (a restored snapshot, a
// fork, a file) and, after a step refused for memory, the requests of that step. The MTP
// block takes every prompt and output position as it is computed (prefill chunks
// included), so a fresh or continued sequence can draft from its first decode step.
//
// Cancellation (RequestHandle::cancel) is seen at the start of the next step, which
// frees the sequence (into the prefix cache). Thread-safe: submit(), stats() and the
// handles from any thread; step() from one (start() runs it on its own thread).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "model/model.h"
#include "runtime/metrics.h"
#include "runtime/prefix_cache.h"
#include "runtime/replay.h"
#include "runtime/request.h"
#include "runtime/speculative.h"
#include "text/tokenizer.h"

namespace dsv4::runtime {

struct SchedulerOptions {
  uint64_t max_context = 0;       // tokens per sequence; 0: the model's context length
  size_t max_seqs = 8;            // running sequences
  size_t max_queue = 64;          // waiting requests
  int64_t batch_tokens = 256;     // tokens per forward
  uint64_t kv_budget = 0;         // bytes for every sequence and snapshot; 0: unlimited
  PrefixCacheOptions prefix;      // its graft: planted in every sequence (kv_graft.h)
  // MTP speculative decoding; absent: off. Ignored without an MTP block or with a graft
  // (dsv4 serve refuses those). Its forced_draft (a test mode keyed by position alone) is
  // meaningful with one speculating request at a time.
  std::optional<SpecOptions> speculative;
};

// A rejection from submit(): the status, and for a full queue a retry estimate.
struct Rejection {
  Status status;
  int retry_after_seconds = 0;
};

class Scheduler {
 public:
  Scheduler(const Model& model, const text::Tokenizer& tokenizer, SchedulerOptions options);
  ~Scheduler();  // stops the thread; unfinished requests end with kCancelled

  // The handle, or why not (the status carries the code for the HTTP status).
  std::shared_ptr<RequestHandle> submit(RequestSpec spec, Rejection* rejected);

  bool step();  // one batch; false when there was nothing to do
  void start();  // step() on a background thread until stop()
  void stop();   // ends the thread, cancels what is left, persists the prefix cache

  SchedulerMetrics metrics() const;
  ReplayStore& replay() { return replay_; }
  const SchedulerOptions& options() const { return opt_; }
  uint64_t max_context() const { return opt_.max_context; }
  std::shared_ptr<const VocabTrie> vocab() const { return vocab_; }

 private:
  struct Active;
  bool admit();
  bool fits_now(const Active& r) const;
  void sample(Active& r, std::span<const float> logits);
  void commit(Active& r, int32_t token);  // a chosen token: counted, stop rules, text
  void feed_mtp(std::span<Active* const> rs);  // every MTP input but the last of each
  // One speculative step for `rs` (k[i] drafts at most each); false when it was refused
  // for memory before computing (the requests then decode without drafts).
  bool speculate(std::span<Active* const> rs, std::span<const int> k, uint64_t step_no);
  void emit_text(Active& r, std::string_view text, RequestEvent& ev);
  void finish(Active& r, FinishReason why, Status error = Status::ok());
  void preempt(Active& r);
  void cancel_all(const Status& why);
  void update_metrics();

  const Model& model_;
  const text::Tokenizer& tok_;
  SchedulerOptions opt_;
  int64_t footprint_ = 0;   // the graft's F, else 0
  int64_t token_room_ = 0;  // max_context - F: tokens a request's prompt and output may use
  std::shared_ptr<CacheBudget> budget_;
  std::unique_ptr<PrefixCache> prefix_;
  std::unique_ptr<SpeculativeDecoder> spec_;  // when speculating
  std::shared_ptr<const VocabTrie> vocab_;
  ReplayStore replay_;
  int32_t think_end_ = -1;

  mutable std::mutex mu_;  // guards incoming_, metrics_
  std::condition_variable wake_;
  std::deque<std::unique_ptr<Active>> incoming_;
  SchedulerMetrics metrics_;

  // Scheduler-thread state.
  std::deque<std::unique_ptr<Active>> waiting_;
  std::vector<std::unique_ptr<Active>> running_;
  uint64_t next_id_ = 1;
  double ema_request_seconds_ = 1.0;

  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace dsv4::runtime
