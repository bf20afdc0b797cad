// Choosing the next token from logits. The steps, in order (as llama.cpp and vLLM do):
//   logit bias -> repetition / presence / frequency penalties over the accepted tokens
//   -> greedy (temperature 0: the arg-max, lowest id on ties) or
//      temperature -> top-k -> softmax -> top-p -> min-p -> renormalise -> draw.
// Defaults follow DeepSeek-V4's model card: temperature 1.0, top-p 1.0, nothing else.
// A Sampler is deterministic given its seed: its own 64-bit generator, no global state.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "util/status.h"

namespace dsv4::runtime {

struct SamplingParams {
  float temperature = 1.0f;         // 0 = greedy
  int32_t top_k = 0;                // 0 = off
  float top_p = 1.0f;               // 1 = off
  float min_p = 0.0f;               // 0 = off; keep p >= min_p * max p
  float repetition_penalty = 1.0f;  // 1 = off; > 1 divides positive logits of seen tokens
  float presence_penalty = 0.0f;    // subtracted once from each seen token's logit
  float frequency_penalty = 0.0f;   // subtracted per occurrence
  std::vector<std::pair<int32_t, float>> logit_bias;  // added to the token's logit
  uint64_t seed = 0;

  // Every field in range (temperature >= 0, top_p in (0, 1], ...); the message names the
  // field, its value and the allowed range.
  Status validate(size_t vocab_size) const;
};

// One candidate of the final distribution.
struct TokenProb {
  int32_t id;
  float p;
};

class Sampler {
 public:
  explicit Sampler(SamplingParams params);

  // Picks a token from `logits` (one row of vocab size); does not record it.
  int32_t sample(std::span<const float> logits);
  // Records a token (generated or prompt) for the penalties.
  void accept(int32_t token);
  void reset();  // forgets the accepted tokens and re-seeds

  // The distribution sample() draws from, by decreasing probability (for greedy: the
  // arg-max with p = 1). Exposed for tests and for --verbose output.
  std::vector<TokenProb> distribution(std::span<const float> logits) const;

  const SamplingParams& params() const { return params_; }

 private:
  std::vector<float> adjusted_logits(std::span<const float> logits) const;
  double uniform();  // [0, 1) from the generator's top 53 bits

  SamplingParams params_;
  std::mt19937_64 rng_;
  std::unordered_map<int32_t, int32_t> counts_;  // accepted token -> occurrences
};

}  // namespace dsv4::runtime
