// The synthetic model most model and runtime tests run on: the `tiny` preset's geometry
// (synth/presets.h) with a 512-token vocabulary and a 256-token training context, seeded
// random weights, no tokenizer. The tests differ in seed and weight types only; the
// suites that also need a tokenizer use the built-in model (synth/builtin_model.h).
#pragma once

#include <cstdint>

#include "gguf/ggml_types.h"
#include "synth/presets.h"
#include "synth/synth.h"

namespace dsv4::test {

inline constexpr int32_t kTinyVocab = 512;

inline SynthOptions tiny_synth_options(uint64_t seed, GgmlType experts, GgmlType dense) {
  ModelConfig c = tiny_config();
  c.vocab_size = kTinyVocab;
  c.context_length = 256;
  SynthOptions so;
  so.config = c;
  so.seed = seed;
  so.write_tokenizer = false;
  so.expert_type = experts;
  so.dense_type = dense;
  return so;
}

}  // namespace dsv4::test
