// The bounds benchmarks divide by (model/step_cost.h), on the V4-Flash geometry, against
// shared/spec/performance-limits.md's independent accounting (§0 parameters, §5.3 prefill
// FLOPs) and issue 10's expert counts.
#include <gtest/gtest.h>

#include <vector>

#include "model/step_cost.h"
#include "model/tensor_catalog.h"
#include "synth/presets.h"

namespace dsv4 {
namespace {

// The catalog's tensors with sizes: routed experts in Q2_K (84 bytes per 256), the rest F32.
std::vector<gguf::TensorInfo> flash_tensors(const ModelConfig& c) {
  std::vector<gguf::TensorInfo> out;
  for (const TensorSpec& spec : build_tensor_catalog(c).tensors) {
    if (!spec.required) continue;
    gguf::TensorInfo t;
    t.name = spec.name;
    t.ne = spec.ne;
    t.type = spec.role == TensorRole::RoutedExperts ? GgmlType::Q2_K : GgmlType::F32;
    t.nbytes = *ggml_row_bytes(t.type, spec.ne[0]) * (spec.n_elements() / spec.ne[0]);
    out.push_back(t);
  }
  return out;
}

TEST(StepCostTest, FlashMatchesTheSpecsAccounting) {
  const ModelConfig c = flash_config();
  const std::vector<gguf::TensorInfo> tensors = flash_tensors(c);
  auto cost = StepCost::of(c, tensors);
  ASSERT_TRUE(cost.is_ok()) << cost.status().message();
  // §0: 6.25 B run every token + 6.49 B of active experts = 12.74 B; head 0.53 B.
  EXPECT_NEAR(cost->token_params / 1e9, 12.74, 0.13);
  EXPECT_NEAR(cost->head_params / 1e9, 0.53, 0.01);
  // One expert of a layer: 3 x 2048 x 4096 Q2_K weights.
  ASSERT_EQ(cost->expert_bytes.size(), 43u);
  EXPECT_EQ(cost->expert_bytes[5], 3u * 2048 * 4096 / 256 * 84);
  EXPECT_EQ(cost->embedding_row_bytes, 4096u * 4);
  // §5.3: attention GFLOP per token averaged over 2K / 8K / 32K prompts: 1.5, 2.4, 3.8.
  const double matmul = 2 * cost->token_params;
  for (auto [prompt, attention] : {std::pair{2048, 1.5}, {8192, 2.4}, {32768, 3.8}}) {
    const double flops = cost->prefill_flops_per_token(prompt, prompt);
    EXPECT_NEAR((flops - matmul - 2 * cost->head_params / prompt) / 1e9, attention, 0.05) << prompt;
  }
  // Issue 10: about 81 of 256 experts per layer at 16 sequences, 200 at 64.
  EXPECT_DOUBLE_EQ(cost->expected_distinct_experts(1), 6.0);
  EXPECT_NEAR(cost->expected_distinct_experts(16), 81, 1);
  EXPECT_NEAR(cost->expected_distinct_experts(64), 200, 2);
}

// The cache bytes a decode step reads, counted by hand for V4-Flash in the F32 layout at a
// depth of 4096: 43 window rings of 128 rows; 21 CSA layers read 1024 indexer keys and 512
// selected entries plus their two compressor states; 20 HCA layers read 32 entries plus
// one state.
TEST(StepCostTest, KvReadBytesAtDepth) {
  const ModelConfig c = flash_config();
  auto cost = StepCost::of(c, flash_tensors(c));
  ASSERT_TRUE(cost.is_ok());
  const uint64_t entry = 512 * 4, key = 128 * 4;
  const uint64_t csa_states = 2 * (8 * 1024 * 4) + 2 * (8 * 256 * 4);  // kv + score, main and indexer
  const uint64_t hca_state = 2 * (128 * 512 * 4);
  const uint64_t want = 43 * 128 * entry + 21 * (1024 * key + 512 * entry + csa_states) +
                        20 * (32 * entry + hca_state);
  EXPECT_EQ(cost->kv_read_bytes(4095), want);
  // Decode bytes: everything but the experts, plus 6 experts per layer, plus the cache.
  const double bytes = cost->decode_bytes(1, 4095, 6);
  EXPECT_DOUBLE_EQ(bytes, double(cost->always_bytes) + cost->embedding_row_bytes + 6.0 * 43 * cost->expert_bytes[5] +
                              double(want));
}

}  // namespace
}  // namespace dsv4
