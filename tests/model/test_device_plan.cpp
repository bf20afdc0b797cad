// Device memory planned before allocation (model/device_plan.h), on the CPU with a given
// capacity (what --device-memory does): the cache figure is exactly what the cache manager
// then allocates, for several slot counts, contexts, page sizes and pool budgets; a load
// that fits by one byte succeeds, one byte less is refused naming every figure; 1-D
// tensors count as F32 and every tensor in whole device allocation units.
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "backend/cpu/cpu_backend.h"
#include "model/device_plan.h"
#include "model/model.h"
#include "support/test_support.h"
#include "synth/presets.h"
#include "synth/synth.h"

namespace dsv4 {
namespace {

class DevicePlanTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<test::TempDir>();
    ModelConfig c = tiny_config();
    c.vocab_size = 512;
    c.context_length = 256;
    SynthOptions so;
    so.config = c;
    so.seed = 31;
    so.write_tokenizer = false;
    so.expert_type = GgmlType::Q8_0;
    so.dense_type = GgmlType::Q8_0;
    path_ = (dir_->path() / "tiny.gguf").string();
    ASSERT_TRUE(write_synthetic_model(path_, so).is_ok());
  }
  static void TearDownTestSuite() { dir_.reset(); }

  static inline std::unique_ptr<test::TempDir> dir_;
  static inline std::string path_;
  backend::CpuBackend cpu_{1};
};

TEST_F(DevicePlanTest, CachePlanIsWhatTheCacheAllocates) {
  struct Case {
    uint32_t slots, page_rows;
    uint64_t context, pool_bytes;
  };
  for (const Case& k : {Case{1, 64, 0, 0}, Case{3, 4, 100, 0}, Case{5, 16, 256, 1 << 16}, Case{2, 8, 37, 12345}}) {
    SCOPED_TRACE(testing::Message() << k.slots << " slots, page " << k.page_rows << ", context " << k.context
                                    << ", pool " << k.pool_bytes);
    ModelOptions mo;
    mo.cache.max_sequences = k.slots;
    mo.cache.page_rows = k.page_rows;
    mo.cache.max_context = k.context;
    mo.cache.pool_bytes = k.pool_bytes;
    auto m = Model::load(path_, cpu_, mo);
    ASSERT_TRUE(m.is_ok()) << m.status().message();
    const KvCacheBytes planned = (*m)->memory_plan().cache, made = (*m)->cache().allocated_bytes();
    EXPECT_GT(made.slots, 0u);
    EXPECT_GT(made.tables, 0u);
    EXPECT_GT(made.pages, 0u);
    EXPECT_EQ(planned.slots, made.slots);
    EXPECT_EQ(planned.tables, made.tables);
    EXPECT_EQ(planned.pages, made.pages);
    EXPECT_EQ((*m)->memory_plan().sequences, k.slots);
    EXPECT_EQ((*m)->memory_plan().capacity_bytes, 0u);  // the CPU without a capacity: not checked
  }
}

TEST_F(DevicePlanTest, LoadRefusesOneByteShortWithTheNumbers) {
  ModelOptions mo;
  mo.cache.max_sequences = 3;
  mo.cache.max_context = 128;
  mo.device_memory = uint64_t{1} << 40;
  auto big = Model::load(path_, cpu_, mo);
  ASSERT_TRUE(big.is_ok()) << big.status().message();
  const DeviceMemoryPlan plan = (*big)->memory_plan();
  big->reset();
  EXPECT_GT(plan.weights_bytes, 0u);
  EXPECT_EQ(plan.scratch_bytes, backend::kDefaultDeviceScratchBytes + backend::kDeviceWorkspaceBytes);
  EXPECT_EQ(plan.weights_bytes % 256, 0u);

  mo.device_memory = plan.total();
  EXPECT_TRUE(Model::load(path_, cpu_, mo).is_ok());
  mo.device_memory = plan.total() - 1;
  auto refused = Model::load(path_, cpu_, mo);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  const std::string msg = refused.status().message();
  for (uint64_t figure : {plan.weights_bytes, plan.cache.total(), plan.cache.pages, plan.scratch_bytes, plan.total(),
                          plan.total() - 1, uint64_t{1}})
    EXPECT_NE(msg.find(std::to_string(figure) + " bytes"), std::string::npos) << figure << ": " << msg;
  EXPECT_NE(msg.find("3 slots of 128 tokens"), std::string::npos) << msg;
  EXPECT_NE(msg.find("nothing was allocated"), std::string::npos) << msg;
}

TEST_F(DevicePlanTest, WeightsCountSmallTensorsAsF32InAllocationUnits) {
  gguf::TensorInfo vec;
  vec.name = "output_norm.weight";
  vec.type = GgmlType::F16;
  vec.ne = {100};
  vec.nbytes = 200;
  gguf::TensorInfo mat;
  mat.name = "output.weight";
  mat.type = GgmlType::Q8_0;
  mat.ne = {64, 3};
  mat.nbytes = 3 * 2 * 34;
  const ModelConfig c = tiny_config();
  const gguf::TensorInfo both[] = {vec, mat};
  const DeviceMemoryPlan p = plan_device_memory(c, ModelPlan::build(c), both, {}, 0, 0);
  // 400 bytes of F32 + 16 of slack -> 512; 204 + 16 -> 256.
  EXPECT_EQ(p.weights_bytes, 512u + 256u);
  EXPECT_EQ(p.host_weights_bytes, 0u);
  EXPECT_TRUE(p.fits());
}

}  // namespace
}  // namespace dsv4
