// CPU forward pass throughput on the `small` synthetic preset (model/presets.h): prefill
// tokens/s (a 64-token prompt, logits of the last token) and decode tokens/s (one token
// per call after a 64-token prompt), at 1 and 2 threads; second argument 0: the fp32
// reference numerics, 1: MatmulMode::Quantized (Q8 activations, integer dot products).
//
//   DSV4_BENCH_MODEL=small.gguf build/bench_cpu_forward
// Without DSV4_BENCH_MODEL the model is synthesised once into the working directory
// (bench-small.gguf, about 0.5 GB, a few minutes).
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "model/model.h"
#include "synth/presets.h"
#include "synth/synth.h"

namespace dsv4 {
namespace {

constexpr int kPrompt = 64;

SequenceOptions long_context() {
  SequenceOptions o;
  o.max_context = 4096;
  return o;
}

std::string model_path() {
  if (const char* p = std::getenv("DSV4_BENCH_MODEL")) return p;
  const std::string path = "bench-small.gguf";
  if (!std::filesystem::exists(path)) {
    auto preset = find_preset("small");
    SynthOptions so;
    so.config = preset->config;
    so.expert_type = preset->default_expert_type;
    so.dense_type = preset->default_dense_type;
    so.seed = 1;
    so.write_tokenizer = false;
    std::fprintf(stderr, "writing %s (small preset)...\n", path.c_str());
    auto r = write_synthetic_model(path, so);
    if (!r.is_ok()) std::fprintf(stderr, "%s\n", r.status().message().c_str());
  }
  return path;
}

struct Loaded {
  std::unique_ptr<backend::CpuBackend> cpu;
  std::unique_ptr<Model> model;
};

Model* model_for(int threads, bool fast) {
  static std::map<std::pair<int, bool>, Loaded> cache;
  Loaded& l = cache[{threads, fast}];
  if (!l.model) {
    l.cpu = std::make_unique<backend::CpuBackend>(threads);
    ModelOptions mo;
    mo.matmul = fast ? backend::MatmulMode::Quantized : backend::MatmulMode::Exact;
    auto m = Model::load(model_path(), *l.cpu, mo);
    if (!m.is_ok()) {
      std::fprintf(stderr, "%s\n", m.status().message().c_str());
      return nullptr;
    }
    l.model = std::move(m).value();
  }
  return l.model.get();
}

std::vector<int32_t> prompt(const Model& m) {
  std::mt19937 rng(1);
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(m.config().vocab_size) - 1);
  std::vector<int32_t> t(kPrompt);
  for (auto& x : t) x = id(rng);
  return t;
}

void BM_Prefill(benchmark::State& state) {
  Model* m = model_for(static_cast<int>(state.range(0)), state.range(1) != 0);
  if (!m) return state.SkipWithError("no model");
  const auto tokens = prompt(*m);
  for (auto _ : state) {
    auto seq = m->new_sequence(long_context());
    auto r = m->prefill(**seq, tokens);
    if (!r.is_ok()) return state.SkipWithError(r.status().message().c_str());
  }
  state.counters["tokens/s"] = benchmark::Counter(double(kPrompt) * state.iterations(), benchmark::Counter::kIsRate);
}

void BM_Decode(benchmark::State& state) {
  Model* m = model_for(static_cast<int>(state.range(0)), state.range(1) != 0);
  if (!m) return state.SkipWithError("no model");
  const auto tokens = prompt(*m);
  auto seq = m->new_sequence(long_context());
  if (!m->prefill(**seq, tokens).is_ok()) return state.SkipWithError("prefill failed");
  int32_t next = tokens.back();
  for (auto _ : state) {
    auto r = m->decode(**seq, next);
    if (!r.is_ok()) return state.SkipWithError(r.status().message().c_str());
    next = static_cast<int32_t>(std::max_element(r->begin(), r->end()) - r->begin());
  }
  state.counters["tokens/s"] = benchmark::Counter(double(state.iterations()), benchmark::Counter::kIsRate);
}

BENCHMARK(BM_Prefill)->ArgsProduct({{1, 2}, {0, 1}})->Iterations(3)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Decode)->ArgsProduct({{1, 2}, {0, 1}})->Iterations(16)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace dsv4

BENCHMARK_MAIN();
