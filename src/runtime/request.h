// One generation request as the scheduler sees it: what to generate (RequestSpec), what
// comes back (RequestEvent, in order, through a RequestHandle that another thread waits
// on), and how it ended. The scheduler (scheduler.h) owns the per-request state.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "runtime/generator.h"
#include "runtime/grammar.h"
#include "runtime/sampler.h"
#include "text/chat.h"
#include "text/output_parser.h"
#include "util/status.h"

namespace dsv4::runtime {

// The largest |steering strength| a request may ask for (docs/SERVER.md).
inline constexpr float kMaxSteeringAlpha = 64.0f;

struct RequestSpec {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  int64_t max_tokens = -1;  // -1: up to the context's end
  std::vector<std::string> stop_strings;
  std::vector<int32_t> stop_tokens;  // besides EOS
  int priority = 0;                  // higher runs first and is preempted last
  // Output parsing (reasoning, content, DSML calls); off for raw completions.
  bool parse_output = true;
  text::ThinkingMode thinking = text::ThinkingMode::kChat;  // the prompt ended in <think>
  text::OrderedJson tools = text::OrderedJson::array();     // for the calls' checks
  std::shared_ptr<const Grammar> grammar;                    // constrain sampling (optional)
  int top_logprobs = -1;  // -1: no log-probabilities; else the chosen token's and this many others
  // GLP steering strength for this request (the model must have a binding); absent: the
  // bound default.
  std::optional<float> steering_alpha;
};

struct TokenLogprob {
  int32_t id = 0;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;  // most likely first
};

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;      // of the prompt, reused from the prefix cache
  int64_t completion_tokens = 0;  // sampled tokens, a final EOS or stop token included
  int64_t reasoning_tokens = 0;   // of those, before </think>
};

struct RequestEvent {
  std::string text;             // output text made certain (stop strings cut)
  text::OutputDelta parsed;     // the same text, split (parse_output)
  std::vector<TokenLogprob> logprobs;  // for the tokens sampled since the last event
  Usage usage;                  // so far (prompt and cached tokens are known from the first event)
  bool done = false;
  // With done:
  FinishReason finish = FinishReason::kEos;
  Status error;                  // not ok when the request failed
  text::ParsedOutput result;     // the whole parsed output
  std::vector<int32_t> tokens;   // the generated tokens (a final EOS or stop token excluded)
  std::string generated_text;    // their decoded text
  double time_to_first_token = 0;  // seconds from submission
};

// The link between a request's submitter and the scheduler. wait() returns the events
// that arrived (possibly none after the timeout); the last one has done set.
class RequestHandle {
 public:
  explicit RequestHandle(uint64_t id) : id_(id) {}
  uint64_t id() const { return id_; }

  std::vector<RequestEvent> wait(std::chrono::milliseconds timeout);
  void cancel() { cancelled_.store(true); }  // the scheduler frees the sequence at its next step
  bool cancelled() const { return cancelled_.load(); }
  bool finished() const;

  void push(RequestEvent e);  // scheduler side

 private:
  const uint64_t id_;
  std::atomic<bool> cancelled_{false};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<RequestEvent> events_;
  bool done_ = false;
};

}  // namespace dsv4::runtime
