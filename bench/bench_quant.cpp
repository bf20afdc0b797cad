// Throughput of the CPU block arithmetic (gguf/quant.h), single thread, one 4096-element
// row that stays in L1/L2 (so this measures the kernels, not DRAM): dequantize_row,
// dot_row_f32 (reference numerics) and dot_row_quantized (fast mode, activations quantised
// beforehand). Reported as GB/s of weight bytes (bytes_per_second) and elements/s.
// memory/read_256MiB is the bound these are compared with: one thread streaming a buffer
// far larger than the caches.
//   build-*/bench/bench_quant --benchmark_min_time=0.2
#include <benchmark/benchmark.h>
#include <immintrin.h>

#include <random>
#include <vector>

#include "gguf/quant.h"

namespace {

using dsv4::GgmlType;

constexpr int64_t kRow = 4096;

const GgmlType kTypes[] = {GgmlType::F32,    GgmlType::F16,    GgmlType::BF16,   GgmlType::Q8_0,
                           GgmlType::Q6_K,   GgmlType::Q5_K,   GgmlType::Q4_K,   GgmlType::Q3_K,
                           GgmlType::Q2_K,   GgmlType::IQ2_XXS, GgmlType::MXFP4,  GgmlType::Q5_1,
                           GgmlType::Q5_0,   GgmlType::Q4_1,   GgmlType::Q4_0,   GgmlType::IQ4_NL,
                           GgmlType::IQ4_XS, GgmlType::IQ3_S,  GgmlType::IQ3_XXS, GgmlType::IQ2_S,
                           GgmlType::IQ2_XS, GgmlType::IQ1_M,  GgmlType::IQ1_S};

std::vector<float> random_values(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = normal(rng);
  return v;
}

// A realistic row: random normal weights quantised by dsv4 (the types without a quantiser get
// random bytes with a sane fp16 scale in the block's first field; IQ1_M's scale stays random).
std::vector<uint8_t> weight_row(GgmlType type) {
  std::vector<uint8_t> row(*dsv4::ggml_row_bytes(type, kRow));
  if (dsv4::can_quantize(type)) {
    const auto w = random_values(kRow, 1);
    dsv4::quantize_row(type, w.data(), row.data(), kRow);
  } else {
    std::mt19937_64 rng(2);
    for (auto& b : row) b = static_cast<uint8_t>(rng());
    const size_t block = dsv4::ggml_traits(type).block_bytes;
    if (type != GgmlType::IQ1_M)
      for (size_t off = 0; off < row.size(); off += block) row[off] = 0x00, row[off + 1] = 0x20;  // d = 2^-7
  }
  return row;
}

void set_counters(benchmark::State& state, size_t row_bytes) {
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(row_bytes));
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) * kRow);
}

void BM_Dequantize(benchmark::State& state, GgmlType type) {
  const auto row = weight_row(type);
  std::vector<float> out(kRow);
  for (auto _ : state) {
    dsv4::dequantize_row(type, row.data(), out.data(), kRow);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, row.size());
}

void BM_DotF32(benchmark::State& state, GgmlType type) {
  const auto row = weight_row(type);
  const auto x = random_values(kRow, 3);
  for (auto _ : state) benchmark::DoNotOptimize(dsv4::dot_row_f32(type, row.data(), x.data(), kRow));
  set_counters(state, row.size());
}

void BM_DotQuantized(benchmark::State& state, GgmlType type) {
  const auto row = weight_row(type);
  const auto x = random_values(kRow, 3);
  const GgmlType act = dsv4::dot_activation_type(type);
  const size_t act_bytes = act == GgmlType::F32 ? kRow * sizeof(float) : *dsv4::ggml_row_bytes(act, kRow);
  std::vector<uint8_t> qx(act_bytes);
  dsv4::quantize_activations(act, x.data(), qx.data(), kRow);
  for (auto _ : state) benchmark::DoNotOptimize(dsv4::dot_row_quantized(type, row.data(), qx.data(), kRow));
  set_counters(state, row.size());
}

// Four activation rows against one weight row (dot_rows_quantized: each weight block is
// decoded once). Counted as 4 row-dots, so the rate compares directly with dot_quantized.
void BM_DotQuantizedRows4(benchmark::State& state, GgmlType type) {
  constexpr int kRows = 4;
  const auto row = weight_row(type);
  const auto x = random_values(kRow * kRows, 3);
  const GgmlType act = dsv4::dot_activation_type(type);
  const size_t act_bytes = *dsv4::ggml_row_bytes(act, kRow);
  std::vector<uint8_t> qx(act_bytes * kRows);
  for (int r = 0; r < kRows; ++r) dsv4::quantize_activations(act, x.data() + r * kRow, qx.data() + r * act_bytes, kRow);
  float out[kRows];
  for (auto _ : state) {
    dsv4::dot_rows_quantized(type, row.data(), qx.data(), act_bytes, kRows, kRow, out);
    benchmark::DoNotOptimize(out);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(row.size()) * kRows);
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) * kRow * kRows);
}

void BM_QuantizeActivations(benchmark::State& state, GgmlType act) {
  const auto x = random_values(kRow, 3);
  std::vector<uint8_t> qx(*dsv4::ggml_row_bytes(act, kRow));
  for (auto _ : state) {
    dsv4::quantize_activations(act, x.data(), qx.data(), kRow);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kRow * 4);
}

void BM_Quantize(benchmark::State& state, GgmlType type) {
  const auto x = random_values(kRow, 4);
  std::vector<uint8_t> row(*dsv4::ggml_row_bytes(type, kRow));
  for (auto _ : state) {
    dsv4::quantize_row(type, x.data(), row.data(), kRow);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) * kRow);
}

// Single-thread DRAM read bandwidth: sum a 256 MiB buffer with four AVX accumulators.
void BM_MemoryRead(benchmark::State& state) {
  const size_t n = (256u << 20) / sizeof(float);
  std::vector<float> buf(n, 1.0f);
  for (auto _ : state) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (size_t i = 0; i < n; i += 32)
      for (int k = 0; k < 4; ++k) acc[k] = _mm256_add_ps(acc[k], _mm256_loadu_ps(buf.data() + i + 8 * k));
    benchmark::DoNotOptimize(acc);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(n * sizeof(float)));
}

const bool kRegistered = [] {
  benchmark::RegisterBenchmark("memory/read_256MiB", BM_MemoryRead)->Unit(benchmark::kMillisecond);
  for (GgmlType t : kTypes) {
    const std::string name(dsv4::ggml_type_name(t));
    benchmark::RegisterBenchmark(("dequantize/" + name).c_str(), BM_Dequantize, t);
    benchmark::RegisterBenchmark(("dot_f32/" + name).c_str(), BM_DotF32, t);
    if (dsv4::dot_activation_type(t) != GgmlType::F32) {
      benchmark::RegisterBenchmark(("dot_quantized/" + name).c_str(), BM_DotQuantized, t);
      benchmark::RegisterBenchmark(("dot_quantized_rows4/" + name).c_str(), BM_DotQuantizedRows4, t);
    }
    if (dsv4::can_quantize(t)) benchmark::RegisterBenchmark(("quantize/" + name).c_str(), BM_Quantize, t);
  }
  benchmark::RegisterBenchmark("quantize_activations/q8_0", BM_QuantizeActivations, GgmlType::Q8_0);
  benchmark::RegisterBenchmark("quantize_activations/q8_K", BM_QuantizeActivations, GgmlType::Q8_K);
  return true;
}();

}  // namespace

BENCHMARK_MAIN();
