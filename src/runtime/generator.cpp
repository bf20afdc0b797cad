#include "runtime/generator.h"

#include <algorithm>
#include <chrono>

namespace dsv4::runtime {

std::string_view finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kEos: return "eos";
    case FinishReason::kStopToken: return "stop_token";
    case FinishReason::kStopString: return "stop_string";
    case FinishReason::kLength: return "length";
    case FinishReason::kContextFull: return "context_full";
    case FinishReason::kCancelled: return "cancelled";
  }
  return "?";
}

std::string StopStringMatcher::push(std::string_view text, bool& matched) {
  held_.append(text);
  matched = false;
  size_t first = std::string::npos;
  for (const std::string& s : stops_)
    if (!s.empty()) first = std::min(first, held_.find(s));
  if (first != std::string::npos) {
    matched = true;
    std::string out = held_.substr(0, first);
    held_.clear();
    return out;
  }
  // Hold back the longest tail that could still grow into a stop string.
  size_t hold = 0;
  for (const std::string& s : stops_)
    for (size_t k = std::min(held_.size(), s.size() - (s.empty() ? 0 : 1)); k > hold; --k)
      if (std::string_view(held_).substr(held_.size() - k) == std::string_view(s).substr(0, k)) {
        hold = k;
        break;
      }
  std::string out = held_.substr(0, held_.size() - hold);
  held_.erase(0, held_.size() - hold);
  return out;
}

std::string StopStringMatcher::flush() {
  std::string out = std::move(held_);
  held_.clear();
  return out;
}

Generator::Generator(const Model& model, const text::Tokenizer& tokenizer, uint64_t max_context)
    : model_(model),
      tokenizer_(tokenizer),
      max_context_(max_context ? max_context : std::min<uint64_t>(model.config().context_length, 16384)) {}

Generator::~Generator() = default;

void Generator::reset() {
  seq_.reset();
  cached_.clear();
}

void Generator::set_graft(std::shared_ptr<const KvGraft> graft) {
  reset();
  graft_ = std::move(graft);
  footprint_ = graft_ ? static_cast<uint64_t>(graft_->footprint) : 0;
}

Result<GenerateStats> Generator::generate(std::span<const int32_t> prompt, const GenerateOptions& o,
                                          const std::function<void(std::string_view)>& on_text,
                                          const std::atomic<bool>* cancel) {
  using Clock = std::chrono::steady_clock;
  auto seconds_since = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  const size_t vocab = model_.config().vocab_size;
  DSV4_TRY(o.sampling.validate(vocab));
  if (o.max_tokens < 0) return Status::errorf("generate: max_tokens = {} must be >= 0", o.max_tokens);
  if (prompt.empty()) return Status::error("generate: the prompt is empty");
  for (int32_t t : prompt)
    if (t < 0 || static_cast<size_t>(t) >= vocab)
      return Status::errorf("generate: prompt token {} is outside the vocabulary [0, {})", t, vocab);
  if (footprint_ + prompt.size() >= max_context_)
    return Status::errorf("generate: the prompt has {} tokens{}; the context holds {} (--ctx)", prompt.size(),
                          footprint_ ? fmt::format(" after the KV graft's {}", footprint_) : "", max_context_);
  if (o.spec < 0 || o.spec > 4) return Status::errorf("generate: spec = {} drafts per step must be 0..4", o.spec);
  if (o.spec > 0 && footprint_)
    return Status::error("generate: speculative decoding does not take a KV graft in this build");
  if (o.spec > 0) return generate_speculative(prompt, o, on_text, cancel);

  GenerateStats stats;
  stats.prompt_tokens = static_cast<int64_t>(prompt.size());
  // Reuse the cache when it holds a prefix of the prompt (at least one token must be
  // prefilled to get logits).
  const bool reuse = seq_ && cached_.size() < prompt.size() && std::equal(cached_.begin(), cached_.end(), prompt.begin());
  if (!reuse) {
    reset();
    SequenceOptions so;
    so.max_context = max_context_;
    so.graft = graft_;
    DSV4_ASSIGN_OR_RETURN(seq_, model_.new_sequence(so));
  }
  const auto fresh = prompt.subspan(cached_.size());
  const auto t0 = Clock::now();
  auto logits = model_.prefill(*seq_, fresh);
  if (!logits.is_ok()) {
    reset();
    return logits.status();
  }
  cached_.assign(prompt.begin(), prompt.end());
  stats.prefilled_tokens = static_cast<int64_t>(fresh.size());
  stats.prefill_seconds = seconds_since(t0);

  Sampler sampler(o.sampling);
  text::StreamDecoder decoder(tokenizer_);
  StopStringMatcher stops(o.stop_strings);
  std::vector<float> row = std::move(*logits);
  const auto t1 = Clock::now();
  auto emit = [&](std::string_view text) {
    if (!text.empty() && on_text) on_text(text);
  };
  for (;;) {
    if (cancel && cancel->load()) {
      stats.finish = FinishReason::kCancelled;
      break;
    }
    if (stats.generated_tokens >= o.max_tokens) {  // only for max_tokens = 0
      stats.finish = FinishReason::kLength;
      break;
    }
    const int32_t token = sampler.sample(row);
    ++stats.generated_tokens;
    if (token == tokenizer_.eos_id() ||
        std::find(o.stop_tokens.begin(), o.stop_tokens.end(), token) != o.stop_tokens.end()) {
      stats.finish = token == tokenizer_.eos_id() ? FinishReason::kEos : FinishReason::kStopToken;
      stats.stop_token = token;
      break;
    }
    sampler.accept(token);
    stats.tokens.push_back(token);
    bool matched = false;
    emit(stops.push(decoder.push(token), matched));
    if (matched) {
      stats.finish = FinishReason::kStopString;
      break;
    }
    // Stop before decoding a token whose logits nobody will read.
    if (stats.generated_tokens >= o.max_tokens) {
      stats.finish = FinishReason::kLength;
      break;
    }
    if (footprint_ + cached_.size() + 1 >= max_context_) {
      stats.finish = FinishReason::kContextFull;
      break;
    }
    auto next = model_.decode(*seq_, token);
    if (!next.is_ok()) {
      reset();
      return next.status();
    }
    cached_.push_back(token);
    row = std::move(*next);
  }
  if (stats.finish != FinishReason::kStopString) {
    bool matched = false;
    emit(stops.push(decoder.flush(), matched));
    if (!matched) emit(stops.flush());
  }
  stats.decode_seconds = seconds_since(t1);
  return stats;
}

// The same loop over the tokens of speculative steps (1 .. k + 1 each); every stop rule
// applies per token, and tokens after a stop are dropped.
Result<GenerateStats> Generator::generate_speculative(std::span<const int32_t> prompt, const GenerateOptions& o,
                                                      const std::function<void(std::string_view)>& on_text,
                                                      const std::atomic<bool>* cancel) {
  using Clock = std::chrono::steady_clock;
  auto seconds_since = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  if (!model_.has_mtp())
    return Status::error("generate: speculative decoding (--spec) needs a model with an MTP block (--mtp FILE "
                         "for a trunk-only model)");
  reset();  // the MTP block needs the streams of every prompt token: no reuse
  SequenceOptions so;
  so.max_context = max_context_;
  so.with_mtp = true;
  DSV4_ASSIGN_OR_RETURN(seq_, model_.new_sequence(so));
  SpecOptions spec_options;
  spec_options.max_k = o.spec;
  spec_options.measured_costs = true;  // adaptive k by this device's measured step times
  SpeculativeDecoder decoder(model_, spec_options);
  SpecSequence s;
  s.sequence = seq_.get();
  s.sampler = Sampler(o.sampling);

  GenerateStats stats;
  stats.prompt_tokens = stats.prefilled_tokens = static_cast<int64_t>(prompt.size());
  const auto t0 = Clock::now();
  auto first = decoder.start(s, prompt);
  if (!first.is_ok()) {
    reset();
    return first.status();
  }
  stats.prefill_seconds = seconds_since(t0);

  text::StreamDecoder text_decoder(tokenizer_);
  StopStringMatcher stops(o.stop_strings);
  auto emit = [&](std::string_view text) {
    if (!text.empty() && on_text) on_text(text);
  };
  const auto t1 = Clock::now();
  std::vector<int32_t> chunk{*first};
  std::vector<std::vector<int32_t>> emitted;
  bool done = o.max_tokens == 0;
  if (done) stats.finish = FinishReason::kLength;
  while (!done) {
    for (int32_t token : chunk) {
      if (cancel && cancel->load()) {
        stats.finish = FinishReason::kCancelled;
        done = true;
        break;
      }
      ++stats.generated_tokens;
      if (token == tokenizer_.eos_id() ||
          std::find(o.stop_tokens.begin(), o.stop_tokens.end(), token) != o.stop_tokens.end()) {
        stats.finish = token == tokenizer_.eos_id() ? FinishReason::kEos : FinishReason::kStopToken;
        stats.stop_token = token;
        done = true;
        break;
      }
      stats.tokens.push_back(token);
      bool matched = false;
      emit(stops.push(text_decoder.push(token), matched));
      if (matched) {
        stats.finish = FinishReason::kStopString;
        done = true;
        break;
      }
      if (stats.generated_tokens >= o.max_tokens) {
        stats.finish = FinishReason::kLength;
        done = true;
        break;
      }
      if (prompt.size() + stats.tokens.size() >= max_context_) {  // as the plain loop
        stats.finish = FinishReason::kContextFull;
        done = true;
        break;
      }
    }
    if (done) break;
    SpecSequence* one = &s;
    if (Status st = decoder.step(std::span<SpecSequence* const>(&one, 1), emitted); !st) {
      reset();
      return st;
    }
    chunk = emitted[0];
  }
  if (stats.finish != FinishReason::kStopString) {
    bool matched = false;
    emit(stops.push(text_decoder.flush(), matched));
    if (!matched) emit(stops.flush());
  }
  stats.decode_seconds = seconds_since(t1);
  stats.spec = s.stats;
  reset();  // the cache may hold tokens past a stop
  return stats;
}

}  // namespace dsv4::runtime
