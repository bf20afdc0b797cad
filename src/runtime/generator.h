// The generation loop for one conversation: prefill the prompt, then sample and decode
// one token at a time until EOS, a stop token, a stop string, the token limit, the
// context end, or a cancel request. Text is handed out as it becomes certain: whole UTF-8
// characters only, and never the start of a possible stop string.
//
// The sequence's cache is kept between calls: when a new prompt begins with exactly the
// tokens already in the cache (a chat's next turn), only the rest is prefilled.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/model.h"
#include "runtime/sampler.h"
#include "runtime/speculative.h"
#include "text/tokenizer.h"
#include "util/status.h"

namespace dsv4::runtime {

struct GenerateOptions {
  SamplingParams sampling;
  int64_t max_tokens = 2048;               // generated tokens, EOS not counted
  std::vector<std::string> stop_strings;   // cut from the output when matched
  std::vector<int32_t> stop_tokens;        // besides EOS, which always stops
  // MTP speculative decoding (speculative.h): at most this many drafts per step, adaptive;
  // 0 = off. Needs a model with an MTP block. The cache is not kept between calls then.
  int spec = 0;
};

enum class FinishReason { kEos, kStopToken, kStopString, kLength, kContextFull, kCancelled };
std::string_view finish_reason_name(FinishReason r);  // "eos", "stop_token", ...

struct GenerateStats {
  int64_t prompt_tokens = 0;     // the whole prompt
  int64_t prefilled_tokens = 0;  // the part not already in the cache
  int64_t generated_tokens = 0;  // sampled tokens, the final stop token included
  double prefill_seconds = 0;
  double decode_seconds = 0;
  FinishReason finish = FinishReason::kEos;
  int32_t stop_token = -1;          // the token that stopped it (EOS or a stop token)
  std::vector<int32_t> tokens;      // the generated tokens, the stop token excluded
  SpecStats spec;                   // speculative decoding's counters (spec > 0)

  double prefill_tokens_per_second() const { return prefill_seconds > 0 ? prefilled_tokens / prefill_seconds : 0; }
  double decode_tokens_per_second() const { return decode_seconds > 0 ? generated_tokens / decode_seconds : 0; }
};

class Generator {
 public:
  // `max_context` = 0: the smaller of the model's context and 16,384 tokens.
  Generator(const Model& model, const text::Tokenizer& tokenizer, uint64_t max_context = 0);
  ~Generator();

  // `on_text` receives each piece of output text (may be called zero or many times).
  // `cancel`, when set to true from another thread or a signal handler, stops generation
  // at the next token.
  Result<GenerateStats> generate(std::span<const int32_t> prompt, const GenerateOptions& options,
                                 const std::function<void(std::string_view)>& on_text,
                                 const std::atomic<bool>* cancel = nullptr);

  void reset();  // forget the cache
  // A KV graft (kv_graft.h) planted in every sequence this generator starts: prompts then
  // follow the graft's footprint, which counts against max_context. Forgets the cache.
  void set_graft(std::shared_ptr<const KvGraft> graft);
  uint64_t max_context() const { return max_context_; }
  const std::vector<int32_t>& cached_tokens() const { return cached_; }

 private:
  Result<GenerateStats> generate_speculative(std::span<const int32_t> prompt, const GenerateOptions& options,
                                             const std::function<void(std::string_view)>& on_text,
                                             const std::atomic<bool>* cancel);
  const Model& model_;
  const text::Tokenizer& tokenizer_;
  uint64_t max_context_;
  std::unique_ptr<Sequence> seq_;
  std::shared_ptr<const KvGraft> graft_;
  uint64_t footprint_ = 0;  // the graft's, else 0
  std::vector<int32_t> cached_;  // tokens whose KV is in seq_
};

// Text held back by stop-string matching: push() returns what is certain, and reports a
// match (the text before it is returned, the rest dropped).
class StopStringMatcher {
 public:
  explicit StopStringMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}
  std::string push(std::string_view text, bool& matched);
  std::string flush();  // the held-back tail, when generation ends for another reason

 private:
  std::vector<std::string> stops_;
  std::string held_;
};

}  // namespace dsv4::runtime
