// The routed-expert path. Decode: one (or two) tokens' 6 experts through all 43 layers (each
// layer its own weights, 8 experts per layer allocated, 6 chosen), replayed from a CUDA graph,
// against the time to read the same bytes at the measured read bandwidth; the fused decode
// kernels (moe_decode.cu, default) and the earlier four-launch path ("legacy") in the same
// run. Batched: one layer of 256 experts for many tokens (expert-sorted tiles; tensor cores by
// default, the dp4a tiles as "legacy"), as time per layer, weight bandwidth and int8 TOP/s
// against cuBLASLt's BF16 rate measured in the same run on the expert shape.
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/gemm_prefill.h"
#include "backend/cuda/matvec.h"
#include "backend/cuda/moe_experts.h"
#include "bench_util.cuh"

using namespace dsv4;
using namespace dsv4::cuda;
using namespace dsv4::cuda::bench;

namespace {

constexpr int64_t kHidden = 4096, kFfn = 2048;
constexpr int kTopK = 6, kLayers = 43;
constexpr float kLimit = 10.0f;

struct ExpertSet {
  GgmlType gu, down;
  int64_t experts;
  size_t gu_bytes, down_bytes;  // per expert matrix
  Buffer gate, up, dn;
  ExpertSet(GgmlType g, GgmlType d, int64_t e)
      : gu(g), down(d), experts(e), gu_bytes(*ggml_row_bytes(g, kHidden) * kFfn),
        down_bytes(*ggml_row_bytes(d, kFfn) * kHidden), gate(gu_bytes * e), up(gu_bytes * e), dn(down_bytes * e) {
    fill_weights(g, gate.p, gate.bytes, 1);
    fill_weights(g, up.p, up.bytes, 2);
    fill_weights(d, dn.p, dn.bytes, 3);
  }
  ExpertWeights weights() const { return {gu, gate.p, up.p, down, dn.p, experts, kHidden, kFfn}; }
};

std::vector<int32_t> route(int64_t tokens, int64_t experts, std::mt19937& rng) {
  std::vector<int32_t> ids(tokens * kTopK), perm(experts);
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::copy(perm.begin(), perm.begin() + kTopK, ids.begin() + t * kTopK);
  }
  return ids;
}

KernelChoice legacy_moe() {
  KernelChoice c;
  c.moe_decode = c.moe_mma = c.moe_wgmma = false;
  return c;
}

// DSV4_BENCH_ONLY=<regular expression>: run only the cases whose name it matches (as in
// cuda_bench_matvec), e.g. "decode 1 token .*(IQ1_S|Q4_0)/".
bool selected(const std::string& name) {
  const char* only = std::getenv("DSV4_BENCH_ONLY");
  return only == nullptr || std::regex_search(name, std::regex(only));
}

void decode_43_layers(GgmlType gu, GgmlType down, const Bandwidth& bw, cudaStream_t stream, bool legacy = false,
                      int64_t tokens = 1) {
  const std::string name = std::string("decode ") + std::to_string(tokens) + " token x 6 experts x 43 layers " +
                           std::string(ggml_type_name(gu)) + "/" + std::string(ggml_type_name(down)) +
                           (legacy ? " legacy" : "");
  if (!selected(name)) return;
  constexpr int64_t kExpertsPerLayer = 8;
  set_kernel_choice(legacy ? legacy_moe() : KernelChoice{});
  std::vector<ExpertSet*> layers;
  for (int l = 0; l < kLayers; ++l) layers.push_back(new ExpertSet(gu, down, kExpertsPerLayer));
  std::mt19937 rng(5);
  const int64_t per_layer = tokens * kHidden;
  Buffer x(kLayers * per_layer * sizeof(float)), y(kLayers * per_layer * sizeof(float));
  Buffer ids(kLayers * tokens * kTopK * sizeof(int32_t)), wts(kLayers * tokens * kTopK * sizeof(float));
  fill_floats(x.get<float>(), kLayers * per_layer, 9);
  std::vector<int32_t> all_ids;
  int64_t distinct = 0;  // experts read per layer, summed (two tokens may share some)
  for (int l = 0; l < kLayers; ++l) {
    const auto r = route(tokens, kExpertsPerLayer, rng);
    all_ids.insert(all_ids.end(), r.begin(), r.end());
    std::vector<char> used(kExpertsPerLayer, 0);
    for (int32_t e : r) used[e] = 1;
    distinct += std::count(used.begin(), used.end(), 1);
  }
  std::vector<float> w(all_ids.size(), 0.25f);
  BENCH_CUDA(cudaMemcpy(ids.p, all_ids.data(), all_ids.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(wts.p, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
  const ExpertWeights w0 = layers[0]->weights();
  Buffer ws(moe_experts_workspace_bytes(w0, tokens, kTopK));
  const cudaGraphExec_t graph = capture(stream, [&] {
    for (int l = 0; l < kLayers; ++l) {
      const ExpertRouting r{ids.get<int32_t>() + l * tokens * kTopK, wts.get<float>() + l * tokens * kTopK, tokens,
                            kTopK};
      check_status(moe_experts(layers[l]->weights(), x.get<float>() + l * per_layer, r, kLimit,
                               y.get<float>() + l * per_layer, ws.p, ws.bytes, stream),
                   "moe_experts");
    }
  });
  const double us = time_us(stream, [&] { BENCH_CUDA(cudaGraphLaunch(graph, stream)); }, 10);
  cudaGraphExecDestroy(graph);
  // The bound counts each distinct expert's bytes once per layer (the kernels read a shared
  // expert once per token: two tokens sharing experts read more than the bound counts).
  const double bytes = double(distinct) * (2.0 * layers[0]->gu_bytes + layers[0]->down_bytes);
  const double bound_us = bytes / (bw.read_gbs * 1e3);
  char note[200];
  std::snprintf(note, sizeof note, "%.2f GB of expert weights; bound %.0f us at the read bandwidth; %.0f GB/s", bytes / 1e9,
                bound_us, bytes / us / 1e3);
  report("moe", name, us, "us", bound_us / us, note);
  for (auto* l : layers) delete l;
  set_kernel_choice(KernelChoice{});
}

// Variants of the batched path: the default kernels (wgmma tiles for prefill-size batches
// where the types allow, moe_wgmma.h), the int8 tensor-core tiles alone, the dp4a tiles.
// kF32Decode: the wgmma tiles with the f32 weight decoders ("wgdecode", moe_wgmma.cu); kNoN96:
// without the m64n96k16 products ("wgn96"); kBefore: both (the wgmma tiles as they were).
enum class Tiles { kDefault, kInt8, kLegacy, kF32Decode, kNoN96, kBefore };

void batched_layer(GgmlType gu, GgmlType down, int64_t tokens, const ExpertSet& set, const Bandwidth& bw,
                   double bf16_tflops, cudaStream_t stream, Tiles tiles = Tiles::kDefault) {
  const std::string name = "batched layer 256 experts, " + std::to_string(tokens) + " tokens " +
                           std::string(ggml_type_name(gu)) + "/" + std::string(ggml_type_name(down)) +
                           (tiles == Tiles::kLegacy       ? " legacy"
                            : tiles == Tiles::kInt8       ? " int8 tiles"
                            : tiles == Tiles::kF32Decode ? " f32 decode"
                            : tiles == Tiles::kNoN96     ? " no n96"
                            : tiles == Tiles::kBefore    ? " f32 decode no n96"
                                                           : "");
  if (!selected(name)) return;
  KernelChoice choice = tiles == Tiles::kLegacy ? legacy_moe() : KernelChoice{};
  if (tiles == Tiles::kInt8) choice.moe_wgmma = false;
  if (tiles == Tiles::kF32Decode || tiles == Tiles::kBefore) choice.moe_wgmma_pair_decode = false;
  if (tiles == Tiles::kNoN96 || tiles == Tiles::kBefore) choice.moe_wgmma_n96 = false;
  set_kernel_choice(choice);
  std::mt19937 rng(11);
  const auto r = route(tokens, set.experts, rng);
  std::vector<float> w(r.size(), 0.25f);
  Buffer x(tokens * kHidden * sizeof(float)), y(tokens * kHidden * sizeof(float));
  Buffer ids(r.size() * 4), wts(r.size() * 4);
  fill_floats(x.get<float>(), tokens * kHidden, 13);
  BENCH_CUDA(cudaMemcpy(ids.p, r.data(), r.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(wts.p, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
  const ExpertWeights ew = set.weights();
  Buffer ws(moe_experts_workspace_bytes(ew, tokens, kTopK));
  const ExpertRouting routing{ids.get<int32_t>(), wts.get<float>(), tokens, kTopK};
  const double us = time_us(stream, 
      [&] {
        check_status(moe_experts(ew, x.get<float>(), routing, kLimit, y.get<float>(), ws.p, ws.bytes, stream),
                     "moe_experts");
      },
      3);
  std::vector<char> used(set.experts, 0);
  for (int32_t e : r) used[e] = 1;
  const double touched = std::count(used.begin(), used.end(), 1);
  const double bytes = touched * (2.0 * set.gu_bytes + set.down_bytes);
  const double flops = 2.0 * tokens * kTopK * 3.0 * kHidden * kFfn;
  char note[240];
  std::snprintf(note, sizeof note,
                "%.0f experts touched, %.2f GB: %.0f GB/s (%.0f%% of read bw); %.1f TOP/s = %.2f of cuBLAS BF16 %.0f; "
                "%.0f tok/s",
                touched, bytes / 1e9, bytes / us / 1e3, 100 * bytes / us / 1e3 / bw.read_gbs, flops / us / 1e6,
                flops / us / 1e6 / bf16_tflops, bf16_tflops, tokens / us * 1e6);
  // Ratio: the weight bandwidth's share of the read bandwidth for decode-like counts, the
  // share of cuBLAS's BF16 rate for prefill-like ones (>= 512 tokens: compute-bound).
  const double ratio = tokens >= 512 ? flops / us / 1e6 / bf16_tflops : bytes / us / 1e3 / bw.read_gbs;
  report("moe", name, us, "us", ratio, note);
  set_kernel_choice(KernelChoice{});
}

// cuBLASLt BF16 on the expert shape (m = 4096 tokens, 4096 -> 2048): the tensor-core rate the
// prefill tiles are compared with.
double bf16_expert_tflops(cudaStream_t stream) {
  cublasLtHandle_t handle;
  if (cublasLtCreate(&handle) != CUBLAS_STATUS_SUCCESS) return 0.0;
  const int64_t m = 4096, n = kFfn, k = kHidden;
  Buffer a(m * k * 2), wb(n * k * 2), c(m * n * 4), ws(kCublasLtWorkspaceBytes);
  fill_weights(GgmlType::BF16, a.p, a.bytes, 3);
  fill_weights(GgmlType::BF16, wb.p, wb.bytes, 4);
  const double us = time_us(stream,
                            [&] {
                              check_status(gemm_bf16(handle, a.get<__nv_bfloat16>(), wb.get<__nv_bfloat16>(),
                                                     c.get<float>(), m, n, k, ws.p, ws.bytes, stream),
                                           "gemm_bf16");
                            },
                            10);
  cublasLtDestroy(handle);
  return 2.0 * m * n * k / us / 1e6;
}

}  // namespace

int main() {
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const Bandwidth bw = measure_bandwidth();
  check_status(prepare_matvec_tables(), "prepare_matvec_tables");
  report("bandwidth", "streaming read kernel (moe run)", bw.read_gbs, "GB/s", 1.0, "");
  for (const bool legacy : {false, true}) {
    decode_43_layers(GgmlType::Q2_K, GgmlType::Q2_K, bw, stream, legacy);
    decode_43_layers(GgmlType::Q2_K, GgmlType::Q3_K, bw, stream, legacy);  // the q2k recipe
  }
  decode_43_layers(GgmlType::Q2_K, GgmlType::Q3_K, bw, stream, false, 2);  // MTP verification
  decode_43_layers(GgmlType::IQ2_XXS, GgmlType::Q2_K, bw, stream);         // general path (no fused kernel)
  // The further types of published files (general path): the IQ1/IQ2 recipes' pairs.
  decode_43_layers(GgmlType::IQ1_S, GgmlType::IQ2_XS, bw, stream);
  decode_43_layers(GgmlType::IQ1_M, GgmlType::IQ2_S, bw, stream);
  decode_43_layers(GgmlType::IQ2_XS, GgmlType::IQ3_XXS, bw, stream);
  decode_43_layers(GgmlType::IQ3_S, GgmlType::IQ4_XS, bw, stream);
  decode_43_layers(GgmlType::Q4_0, GgmlType::Q5_0, bw, stream);
  decode_43_layers(GgmlType::IQ4_NL, GgmlType::Q5_K, bw, stream);
  decode_43_layers(GgmlType::Q3_K, GgmlType::Q3_K, bw, stream);
  decode_43_layers(GgmlType::MXFP4, GgmlType::MXFP4, bw, stream);
  decode_43_layers(GgmlType::Q8_0, GgmlType::Q8_0, bw, stream);
  const double bf16 = bf16_expert_tflops(stream);
  report("moe", "cuBLASLt BF16 m=4096 4096->2048", bf16, "TFLOP/s", 1.0, "the prefill tiles' reference rate");
  {
    const ExpertSet set(GgmlType::Q2_K, GgmlType::Q3_K, 256);
    for (int64_t tokens : {16, 64, 128, 512, 1024, 2048, 4096, 8192})
      batched_layer(GgmlType::Q2_K, GgmlType::Q3_K, tokens, set, bw, bf16, stream);
    for (int64_t tokens : {128, 512, 1024, 2048, 4096, 8192})
      batched_layer(GgmlType::Q2_K, GgmlType::Q3_K, tokens, set, bw, bf16, stream, Tiles::kInt8);
    for (const Tiles variant : {Tiles::kF32Decode, Tiles::kNoN96, Tiles::kBefore})
      for (int64_t tokens : {512, 2048, 4096, 8192})
        batched_layer(GgmlType::Q2_K, GgmlType::Q3_K, tokens, set, bw, bf16, stream, variant);
    for (int64_t tokens : {16, 128, 512})
      batched_layer(GgmlType::Q2_K, GgmlType::Q3_K, tokens, set, bw, bf16, stream, Tiles::kLegacy);
  }
  {
    const ExpertSet set(GgmlType::MXFP4, GgmlType::MXFP4, 256);
    for (int64_t tokens : {64, 2048}) batched_layer(GgmlType::MXFP4, GgmlType::MXFP4, tokens, set, bw, bf16, stream);
  }
  // The further types' tensor-core tiles (batched decode and prefill sizes).
  const std::pair<GgmlType, GgmlType> further[] = {
      {GgmlType::IQ1_S, GgmlType::IQ2_XS}, {GgmlType::IQ1_M, GgmlType::IQ2_S},  {GgmlType::IQ2_XS, GgmlType::IQ3_XXS},
      {GgmlType::IQ3_S, GgmlType::IQ4_XS}, {GgmlType::Q4_0, GgmlType::Q5_0},    {GgmlType::IQ4_NL, GgmlType::Q5_K}};
  for (const auto& [gu, down] : further) {
    const std::string probe = "batched layer 256 experts, 16 tokens " + std::string(ggml_type_name(gu)) + "/" +
                              std::string(ggml_type_name(down));
    const std::string probe_big = "batched layer 256 experts, 2048 tokens " + std::string(ggml_type_name(gu)) + "/" +
                                  std::string(ggml_type_name(down));
    if (!selected(probe) && !selected(probe_big)) continue;  // skip building the 256 experts
    const ExpertSet set(gu, down, 256);
    for (int64_t tokens : {16, 2048}) batched_layer(gu, down, tokens, set, bw, bf16, stream);
  }
  BENCH_CUDA(cudaStreamDestroy(stream));
  return 0;
}
