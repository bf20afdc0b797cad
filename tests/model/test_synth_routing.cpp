// `dsv4 synth --routing shared` (SynthRouting::Shared): on the CPU reference every token of a
// prefill, in every trunk layer (hash and score routing), routes to experts 0..k-1, while the
// default routing gives tokens experts of their own; the file says which.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "gguf/gguf_file.h"
#include "model/model.h"
#include "model/trace.h"
#include "support/test_support.h"
#include "support/tiny_synth.h"
#include "synth/synth.h"

namespace dsv4 {
namespace {

// The sets of experts the rows of `name` chose (each row's k experts, ascending).
std::set<std::vector<int32_t>> expert_sets(const TracedTensor& t) {
  std::set<std::vector<int32_t>> sets;
  for (int64_t r = 0; r < t.rows(); ++r)
    sets.insert(std::vector<int32_t>(t.i32.begin() + r * t.cols, t.i32.begin() + (r + 1) * t.cols));
  return sets;
}

class SynthRoutingTest : public ::testing::TestWithParam<SynthRouting> {};

TEST_P(SynthRoutingTest, EveryTokenTakesTheSameExpertsOnlyWhenShared) {
  const bool shared = GetParam() == SynthRouting::Shared;
  test::TempDir dir;
  const std::string path = (dir / "tiny.gguf").string();
  SynthOptions so = test::tiny_synth_options(23, GgmlType::Q8_0, GgmlType::Q8_0);
  so.layout = WriteLayout::Bundled;
  so.routing = GetParam();
  ASSERT_TRUE(write_synthetic_model(path, so).is_ok());
  auto file = gguf::GgufFile::open(path);
  ASSERT_TRUE(file.is_ok()) << file.status().message();
  const auto routing = file->get_string(kSynthRoutingKey);
  EXPECT_EQ(routing.is_ok(), shared);
  if (shared && routing.is_ok()) EXPECT_EQ(*routing, "shared");

  backend::CpuBackend cpu;
  auto model = Model::load(path, cpu, {});
  ASSERT_TRUE(model.is_ok()) << model.status().message();
  SequenceOptions seq_options;
  seq_options.max_context = 256;
  auto seq = (*model)->new_sequence(seq_options);
  ASSERT_TRUE(seq.is_ok()) << seq.status().message();
  std::mt19937_64 rng(test::test_seed());
  std::uniform_int_distribution<int32_t> id(0, test::kTinyVocab - 1);
  std::vector<int32_t> tokens(40);
  for (auto& t : tokens) t = id(rng);
  const BatchItem item{seq->get(), tokens, true, false};
  ForwardOutput out;
  ForwardTrace trace;
  ASSERT_TRUE((*model)->forward(std::span<const BatchItem>(&item, 1), out, &trace).is_ok());

  const ModelConfig& c = (*model)->config();
  int layers_seen = 0;
  for (uint32_t b = 0; b < c.n_layers; ++b) {
    const TracedTensor* t = trace.find("layers." + std::to_string(b) + ".router_experts");
    ASSERT_NE(t, nullptr) << "layer " << b;
    ASSERT_EQ(t->rows(), static_cast<int64_t>(tokens.size()));
    const auto sets = expert_sets(*t);
    if (shared) {
      std::vector<int32_t> first_k(c.experts_used_of(b));
      for (size_t i = 0; i < first_k.size(); ++i) first_k[i] = static_cast<int32_t>(i);
      EXPECT_EQ(sets, std::set<std::vector<int32_t>>{first_k}) << "layer " << b;
    } else {
      EXPECT_GT(sets.size(), 5u) << "layer " << b << ": random routing gives tokens their own experts";
    }
    ++layers_seen;
  }
  EXPECT_EQ(layers_seen, static_cast<int>(c.n_layers));
}

INSTANTIATE_TEST_SUITE_P(Routing, SynthRoutingTest, ::testing::Values(SynthRouting::Random, SynthRouting::Shared),
                         [](const auto& info) { return info.param == SynthRouting::Shared ? "shared" : "random"; });

}  // namespace
}  // namespace dsv4
