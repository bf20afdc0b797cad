// Benchmark models (SynthFill::RandomBlocks): random blocks decode to finite values of the
// row's intended magnitude and mean zero, the bytes depend on the key and block index only,
// and a random-blocks file is a loadable model whose small tensors are the normal draw's.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "gguf/gguf_file.h"
#include "gguf/quant.h"
#include "model/model.h"
#include "support/test_support.h"
#include "synth/presets.h"
#include "synth/random_blocks.h"
#include "synth/synth.h"
#include "util/thread_pool.h"

namespace dsv4 {
namespace {

constexpr GgmlType kTypes[] = {GgmlType::Q8_0, GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K,
                               GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::MXFP4};

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

struct Moments {
  double mean = 0, std = 0;
  bool finite = true;
};

Moments moments(const std::vector<float>& v) {
  Moments m;
  double s = 0, q = 0;
  for (float x : v) {
    m.finite = m.finite && std::isfinite(x);
    s += x;
    q += double(x) * x;
  }
  m.mean = s / v.size();
  m.std = std::sqrt(q / v.size() - m.mean * m.mean);
  return m;
}

// Rows of 16384 values at the magnitudes V4-Flash's matrices have (1 for the embedding,
// 1/64 for a 4096-wide linear, an expert down row of gain 5: 1/(25 sqrt 2048)).
TEST(RandomBlocksTest, DecodeToFiniteValuesOfTheTargetScale) {
  const int64_t n = 16384;
  const std::vector<float> targets = {1.0f, 1.0f / 64, 1.0f / (25 * std::sqrt(2048.0f))};
  for (GgmlType type : kTypes) {
    ASSERT_TRUE(random_blocks_supported(type));
    const uint64_t per_row = n / ggml_traits(type).block_elems;
    const uint64_t row_bytes = *ggml_row_bytes(type, n);
    std::vector<uint8_t> bytes(targets.size() * row_bytes, 0xAB);
    fill_random_blocks(type, 0x5eed, 0, per_row, targets, bytes.data());
    for (size_t r = 0; r < targets.size(); ++r) {
      std::vector<float> v(n, std::nanf(""));
      dequantize_row(type, bytes.data() + r * row_bytes, v.data(), n);
      const Moments m = moments(v);
      ASSERT_TRUE(m.finite) << ggml_type_name(type) << " row " << r;
      // MXFP4's power-of-two scales round the target by up to 2^(1/2).
      const double tolerance = type == GgmlType::MXFP4 ? 0.45 : 0.1;
      EXPECT_NEAR(m.std / targets[r], 1.0, tolerance) << ggml_type_name(type) << " row " << r;
      EXPECT_LT(std::abs(m.mean), 0.1 * targets[r]) << ggml_type_name(type) << " row " << r;
    }
  }
}

TEST(RandomBlocksTest, BytesDependOnKeyAndBlockOnly) {
  const int64_t n = 1024;
  const std::vector<float> targets = {0.5f, 0.02f, 0.1f, 1.0f};
  for (GgmlType type : kTypes) {
    const uint64_t per_row = n / ggml_traits(type).block_elems;
    const uint64_t row_bytes = *ggml_row_bytes(type, n);
    std::vector<uint8_t> whole(4 * row_bytes), pieces(4 * row_bytes), again(4 * row_bytes), other(4 * row_bytes);
    fill_random_blocks(type, 7, 0, per_row, targets, whole.data());
    fill_random_blocks(type, 7, 0, per_row, std::span(targets).first(1), pieces.data());
    fill_random_blocks(type, 7, per_row, per_row, std::span(targets).subspan(1), pieces.data() + row_bytes);
    fill_random_blocks(type, 7, 0, per_row, targets, again.data());
    fill_random_blocks(type, 8, 0, per_row, targets, other.data());
    EXPECT_EQ(whole, pieces) << ggml_type_name(type);
    EXPECT_EQ(whole, again) << ggml_type_name(type);
    EXPECT_NE(whole, other) << ggml_type_name(type);
  }
}

// The target each row is filled to is the normal draw's magnitude before its per-group
// jitter (which adds 16% for the dense linears' 2^U(-1,1) per 128 x 128 block, 4% for the
// experts' 2^U(-1/2,1/2) per 32), on V4-Flash's matrices: 8 rows from each of 16 places
// spread over a tensor (the few rows of the small ones) (experts: the first rows of experts 0-15, gains included), so that
// hundreds of the normal draw's block scales enter each estimate.
TEST(RandomBlocksTest, RowTargetsFollowTheNormalDraw) {
  const ModelConfig c = flash_config();
  const TensorCatalog catalog = build_tensor_catalog(c);
  int checked = 0;
  for (const TensorSpec& spec : catalog.tensors) {
    if (spec.type_class != TypeClass::Matrix || (spec.block && *spec.block != 2 && *spec.block != 3)) continue;
    if (spec.global_kind == GlobalTensor::TokenEmbd || spec.global_kind == GlobalTensor::Output) continue;  // N(0, s)
    const uint64_t n = spec.ne[0], rows = spec.n_elements() / n;
    const bool experts = spec.role == TensorRole::RoutedExperts;
    const uint64_t take = std::min<uint64_t>(8, rows), places = rows >= 16 * take ? 16 : 1;
    std::vector<float> v(take * n);
    double drawn = 0, target = 0;
    for (uint64_t k = 0; k < places; ++k) {
      const uint64_t row0 = experts ? k * spec.ne[1] : k * (rows / places);
      synth_rows(c, spec, 11, row0, take, v.data());
      for (float x : v) drawn += double(x) * x;
      for (uint64_t r = 0; r < take; ++r) target += std::pow(synth_row_std(c, spec, row0 + r), 2) * n;
    }
    const double ratio = std::sqrt(drawn / target);
    EXPECT_GT(ratio, 0.9) << spec.name;
    EXPECT_LT(ratio, 1.3) << spec.name;
    ++checked;
  }
  EXPECT_EQ(checked, 40);  // 2 globals (the mHC head, ...), 22 of the CSA block, 16 of the HCA block
}

SynthOptions model_options(uint64_t seed, SynthFill fill) {
  SynthOptions o;
  o.config = tiny_config();
  o.config.vocab_size = 512;
  o.seed = seed;
  o.write_tokenizer = false;
  o.layout = WriteLayout::Bundled;
  o.expert_type = GgmlType::Q2_K;
  o.dense_type = GgmlType::Q8_0;
  o.fill = fill;
  return o;
}

TEST(RandomBlocksTest, FileIsDeterministicAndLoads) {
  test::TempDir dir;
  ThreadPool one(1), three(3);
  SynthOptions a = model_options(3, SynthFill::RandomBlocks), b = a, other = model_options(4, SynthFill::RandomBlocks);
  a.pool = &one;
  b.pool = &three;
  const std::string pa = (dir / "a.gguf").string(), pb = (dir / "b.gguf").string();
  ASSERT_TRUE(write_synthetic_model(pa, a).is_ok());
  ASSERT_TRUE(write_synthetic_model(pb, b).is_ok());
  ASSERT_TRUE(write_synthetic_model((dir / "c.gguf").string(), other).is_ok());
  const std::string fa = read_all(pa);
  EXPECT_TRUE(fa == read_all(pb));
  EXPECT_FALSE(fa == read_all((dir / "c.gguf").string()));

  auto f = gguf::GgufFile::open(pa);
  ASSERT_TRUE(f.is_ok()) << f.status().message();
  auto fill = f->get_string(kSynthFillKey);
  ASSERT_TRUE(fill.is_ok());
  EXPECT_EQ(*fill, "random-blocks");
  EXPECT_EQ(f->find_tensor("blk.2.ffn_gate_exps.weight")->type, GgmlType::Q2_K);

  backend::CpuBackend cpu(2);
  auto model = Model::load(pa, cpu, {});
  ASSERT_TRUE(model.is_ok()) << model.status().message();
  SequenceOptions so;
  so.max_context = 64;
  auto seq = (*model)->new_sequence(so);
  ASSERT_TRUE(seq.is_ok());
  const std::vector<int32_t> prompt = {1, 20, 300, 4, 55, 6, 7, 80, 9, 10, 11, 12};
  auto logits = (*model)->prefill(**seq, prompt);
  ASSERT_TRUE(logits.is_ok()) << logits.status().message();
  const Moments m = moments(*logits);
  EXPECT_TRUE(m.finite);
  EXPECT_GT(m.std, 0.0);
}

// Small tensors (norms, mHC, biases, tid2eid, APE) and float matrices keep the normal draw
// byte for byte; the quantised matrices are random blocks that decode to finite values.
TEST(RandomBlocksTest, SmallTensorsKeepTheNormalDraw) {
  test::TempDir dir;
  const std::string pn = (dir / "n.gguf").string(), pr = (dir / "r.gguf").string();
  ASSERT_TRUE(write_synthetic_model(pn, model_options(5, SynthFill::Normal)).is_ok());
  ASSERT_TRUE(write_synthetic_model(pr, model_options(5, SynthFill::RandomBlocks)).is_ok());
  auto fn = gguf::GgufFile::open(pn);
  auto fr = gguf::GgufFile::open(pr);
  ASSERT_TRUE(fn.is_ok() && fr.is_ok());
  int same = 0, random = 0;
  for (const gguf::TensorInfo& t : fr->tensors()) {
    const gguf::TensorInfo* u = fn->find_tensor(t.name);
    ASSERT_NE(u, nullptr) << t.name;
    ASSERT_EQ(t.type, u->type) << t.name;
    const bool equal = std::equal(t.bytes().begin(), t.bytes().end(), u->bytes().begin(), u->bytes().end());
    if (!random_blocks_supported(t.type)) {
      EXPECT_TRUE(equal) << t.name;
      ++same;
      continue;
    }
    EXPECT_FALSE(equal) << t.name;
    const uint64_t rb = *ggml_row_bytes(t.type, t.ne[0]);
    std::vector<float> v(t.ne[0]);
    bool finite = true;
    for (uint64_t r = 0; r < t.n_rows(); ++r) {
      dequantize_row(t.type, t.data + r * rb, v.data(), static_cast<int64_t>(t.ne[0]));
      for (float x : v) finite = finite && std::isfinite(x);
    }
    EXPECT_TRUE(finite) << t.name;
    ++random;
  }
  EXPECT_GT(same, 20);
  EXPECT_GT(random, 20);
}

}  // namespace
}  // namespace dsv4
