// The routed-expert path. Decode: one token's 6 experts through all 43 layers (each layer its
// own weights, 8 experts per layer allocated, 6 chosen), replayed from a CUDA graph, against
// the time to read the same bytes at the measured read bandwidth. Batched: one layer of 256
// experts for many tokens (expert-sorted tiles), as time per layer and weight bandwidth.
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

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

void decode_43_layers(GgmlType gu, GgmlType down, const Bandwidth& bw, cudaStream_t stream) {
  constexpr int64_t kExpertsPerLayer = 8;
  std::vector<ExpertSet*> layers;
  for (int l = 0; l < kLayers; ++l) layers.push_back(new ExpertSet(gu, down, kExpertsPerLayer));
  std::mt19937 rng(5);
  Buffer x(kLayers * kHidden * sizeof(float)), y(kLayers * kHidden * sizeof(float));
  Buffer ids(kLayers * kTopK * sizeof(int32_t)), wts(kLayers * kTopK * sizeof(float));
  fill_floats(x.get<float>(), kLayers * kHidden, 9);
  std::vector<int32_t> all_ids;
  for (int l = 0; l < kLayers; ++l) {
    const auto r = route(1, kExpertsPerLayer, rng);
    all_ids.insert(all_ids.end(), r.begin(), r.end());
  }
  std::vector<float> w(kLayers * kTopK, 0.25f);
  BENCH_CUDA(cudaMemcpy(ids.p, all_ids.data(), all_ids.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(wts.p, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
  const ExpertWeights w0 = layers[0]->weights();
  Buffer ws(moe_experts_workspace_bytes(w0, 1, kTopK));
  const cudaGraphExec_t graph = capture(stream, [&] {
    for (int l = 0; l < kLayers; ++l) {
      const ExpertRouting r{ids.get<int32_t>() + l * kTopK, wts.get<float>() + l * kTopK, 1, kTopK};
      check_status(moe_experts(layers[l]->weights(), x.get<float>() + l * kHidden, r, kLimit,
                               y.get<float>() + l * kHidden, ws.p, ws.bytes, stream),
                   "moe_experts");
    }
  });
  const double us = time_us(stream, [&] { BENCH_CUDA(cudaGraphLaunch(graph, stream)); }, 10);
  cudaGraphExecDestroy(graph);
  const double bytes = double(kLayers) * kTopK * (2.0 * layers[0]->gu_bytes + layers[0]->down_bytes);
  const double bound_us = bytes / (bw.read_gbs * 1e3);
  char note[200];
  std::snprintf(note, sizeof note, "%.2f GB of expert weights; bound %.0f us at the read bandwidth; %.0f GB/s", bytes / 1e9,
                bound_us, bytes / us / 1e3);
  report("moe", std::string("decode 1 token x 6 experts x 43 layers ") + std::string(ggml_type_name(gu)) + "/" +
                    std::string(ggml_type_name(down)),
         us, "us", bound_us / us, note);
  for (auto* l : layers) delete l;
}

void batched_layer(GgmlType gu, GgmlType down, int64_t tokens, const ExpertSet& set, const Bandwidth& bw,
                   cudaStream_t stream) {
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
  char note[200];
  std::snprintf(note, sizeof note, "%.0f experts touched, %.2f GB: %.0f GB/s (%.0f%% of read bw); %.1f TFLOP/s; %.0f tok/s",
                touched, bytes / 1e9, bytes / us / 1e3, 100 * bytes / us / 1e3 / bw.read_gbs, flops / us / 1e6,
                tokens / us * 1e6);
  report("moe", "batched layer 256 experts, " + std::to_string(tokens) + " tokens " + std::string(ggml_type_name(gu)) +
                    "/" + std::string(ggml_type_name(down)),
         us, "us", bytes / us / 1e3 / bw.read_gbs, note);
}

}  // namespace

int main() {
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const Bandwidth bw = measure_bandwidth();
  check_status(prepare_matvec_tables(), "prepare_matvec_tables");
  report("bandwidth", "streaming read kernel (moe run)", bw.read_gbs, "GB/s", 1.0, "");
  decode_43_layers(GgmlType::Q2_K, GgmlType::Q2_K, bw, stream);
  decode_43_layers(GgmlType::IQ2_XXS, GgmlType::Q2_K, bw, stream);
  decode_43_layers(GgmlType::Q3_K, GgmlType::Q3_K, bw, stream);
  decode_43_layers(GgmlType::MXFP4, GgmlType::MXFP4, bw, stream);
  {
    const ExpertSet set(GgmlType::Q2_K, GgmlType::Q2_K, 256);
    for (int64_t tokens : {16, 128, 512, 2048}) batched_layer(GgmlType::Q2_K, GgmlType::Q2_K, tokens, set, bw, stream);
  }
  BENCH_CUDA(cudaStreamDestroy(stream));
  return 0;
}
