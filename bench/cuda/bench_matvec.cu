// Matrix-vector products at V4-Flash shapes for every weight type: achieved bytes/s over the
// weight bytes against the copy and read bandwidth measured in the same run. Rows 2-64 compare
// the int8 tensor-core kernels (mmq.h, "mma") with the dp4a kernel ("dp4a", at most 16 rows),
// and one row of BF16 / MXFP4 / Q4_K / Q6_K the new kernels with the general one ("legacy"),
// all in the same run (KernelChoice).
//  "graph": one matvec call per matrix (activation quantisation + product), many calls
//           replayed from a CUDA graph over rotating copies (larger than L2): decode's setting.
//  "graph-noPDL": the same without programmatic dependent launch (matvec.h).
//  "batched": all copies in one call (batch dimension): the kernel's steady-state rate
//           without per-launch latency.
#include <cstdio>
#include <cstdlib>
#include <regex>
#include <string>
#include <vector>

#include "backend/cuda/matvec.h"
#include "bench_util.cuh"

using namespace dsv4;
using namespace dsv4::cuda;
using namespace dsv4::cuda::bench;

namespace {

struct Shape {
  const char* name;
  int64_t n, k, groups;  // groups > 1: a grouped projection (batch of matrices, own inputs)
};

void run(GgmlType type, const Shape& s, int rows, const Bandwidth& bw, cudaStream_t stream, bool compare_launch = false,
         const char* label = nullptr, bool batched_only = false) {
  const auto& t = ggml_traits(type);
  const std::string name =
      std::string(t.name) + " " + s.name + " rows=" + std::to_string(rows) + (label ? std::string(" ") + label : "");
  // DSV4_BENCH_ONLY=<regular expression>: run only the cases whose name it matches (a plain
  // substring works), e.g. "^(Q8_0|Q2_K) .*rows=1$".
  if (const char* only = std::getenv("DSV4_BENCH_ONLY"); only != nullptr && !std::regex_search(name, std::regex(only)))
    return;
  const size_t matrix_bytes = *ggml_row_bytes(type, s.k) * s.n * s.groups;
  constexpr size_t kRotateBytes = size_t{1} << 30;  // many times the 50 MB L2
  const int64_t copies = std::max<int64_t>(2, std::min<int64_t>(4096, kRotateBytes / matrix_bytes));
  Buffer w(matrix_bytes * copies);
  fill_weights(type, w.p, matrix_bytes * copies, 42);
  const int64_t batch_rows = copies * s.groups * rows;
  Buffer x(batch_rows * s.k * sizeof(float)), y(batch_rows * s.n * sizeof(float));
  fill_floats(x.get<float>(), batch_rows * s.k, 7);
  MatvecWeights all{type, w.p, s.n, s.k, copies * s.groups, 0};
  Buffer ws(std::max<size_t>(16, matvec_workspace_bytes(all, rows)));

  auto one = [&](int64_t c) {
    MatvecWeights mw{type, w.get<uint8_t>() + c * matrix_bytes, s.n, s.k, s.groups, 0};
    check_status(matvec(mw, x.get<float>() + c * s.groups * rows * s.k, rows, y.get<float>() + c * s.groups * rows * s.n,
                        ws.p, ws.bytes, stream),
                 "matvec");
  };
  auto graph_time = [&](bool pdl) {
    set_programmatic_launch(pdl);
    const cudaGraphExec_t graph = capture(stream, [&] {
      for (int64_t c = 0; c < copies; ++c) one(c);
    });
    const double us = time_us(stream, [&] { BENCH_CUDA(cudaGraphLaunch(graph, stream)); }, 3) / copies;
    cudaGraphExecDestroy(graph);
    set_programmatic_launch(true);
    return us;
  };
  const double graph_us = batched_only ? 0.0 : graph_time(true);
  const double batched_us = time_us(stream, 
      [&] { check_status(matvec(all, x.get<float>(), rows, y.get<float>(), ws.p, ws.bytes, stream), "matvec"); }, 3) /
      copies;

  const double gbs_graph = matrix_bytes / graph_us / 1e3, gbs_batched = matrix_bytes / batched_us / 1e3;

  char note[160];
  if (!batched_only) {
    std::snprintf(note, sizeof note, "%.2f MB/matrix; graph %.2f us = %.0f GB/s (%.0f%% of copy); read-bw %.0f%%",
                  matrix_bytes / 1e6, graph_us, gbs_graph, 100 * gbs_graph / bw.copy_gbs,
                  100 * gbs_batched / bw.read_gbs);
    report("matvec", name + " graph", gbs_graph, "GB/s", gbs_graph / bw.copy_gbs, note);
  }
  if (compare_launch) {
    const double plain_us = graph_time(false);
    const double gbs = matrix_bytes / plain_us / 1e3;
    std::snprintf(note, sizeof note, "%.2f us/matrix without programmatic dependent launch", plain_us);
    report("matvec", name + " graph-noPDL", gbs, "GB/s", gbs / bw.copy_gbs, note);
  }
  std::snprintf(note, sizeof note, "%.2f us/matrix in one launch of %lld; %.0f%% of read bandwidth", batched_us,
                static_cast<long long>(copies), 100 * gbs_batched / bw.read_gbs);
  report("matvec", name + " batched", gbs_batched, "GB/s", gbs_batched / bw.copy_gbs, note);
}

}  // namespace

int main() {
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const Bandwidth bw = measure_bandwidth();
  check_status(prepare_matvec_tables(), "prepare_matvec_tables");
  report("bandwidth", "device-to-device copy (read+write)", bw.copy_gbs, "GB/s", 1.0, "2 GiB cudaMemcpyAsync");
  report("bandwidth", "streaming read kernel", bw.read_gbs, "GB/s", bw.read_gbs / bw.copy_gbs, "2 GiB, uint4 loads");

  const std::vector<Shape> shapes = {
      {"4096->1024", 1024, 4096, 1},   {"1024->32768", 32768, 1024, 1}, {"4096->512", 512, 4096, 1},
      {"8x4096->1024", 1024, 4096, 8}, {"8192->4096", 4096, 8192, 1},   {"4096->129280", 129280, 4096, 1},
  };
  // The last thirteen: the further types of published files (the general kernel only).
  const GgmlType types[] = {GgmlType::Q8_0,   GgmlType::Q2_K,   GgmlType::Q3_K,    GgmlType::Q4_K,
                            GgmlType::Q6_K,   GgmlType::MXFP4,  GgmlType::IQ2_XXS, GgmlType::BF16,
                            GgmlType::Q4_0,   GgmlType::Q4_1,   GgmlType::Q5_0,    GgmlType::Q5_1,
                            GgmlType::IQ4_NL, GgmlType::Q5_K,   GgmlType::IQ4_XS,  GgmlType::IQ2_XS,
                            GgmlType::IQ2_S,  GgmlType::IQ3_XXS, GgmlType::IQ3_S,  GgmlType::IQ1_S,
                            GgmlType::IQ1_M};
  for (GgmlType type : types)
    for (const Shape& s : shapes)
      run(type, s, 1, bw, stream, type == GgmlType::Q8_0 || type == GgmlType::Q2_K || type == GgmlType::Q3_K);
  // One row: the new kernels against the general kernel they replaced, same run.
  KernelChoice legacy;
  legacy.matvec_bf16 = legacy.matvec_row_extra = legacy.matvec_mma = false;
  for (GgmlType type : {GgmlType::BF16, GgmlType::MXFP4, GgmlType::Q4_K, GgmlType::Q6_K}) {
    set_kernel_choice(legacy);
    for (const Shape& s : {shapes[1], shapes[4], shapes[5]}) run(type, s, 1, bw, stream, false, "legacy", true);
    set_kernel_choice(KernelChoice{});
  }
  // The products of an MTP verify step at batch 1 (1 + k rows, k = 0..4, and 8 rows): each
  // matrix its own launch, as in the step ("graph"), on the row kernels.
  for (int rows : {1, 2, 3, 4, 5, 8}) {
    for (int shape : {0, 1, 4}) run(GgmlType::Q8_0, shapes[shape], rows, bw, stream, false, "verify");
    run(GgmlType::Q6_K, shapes[5], rows, bw, stream, false, "verify");
  }
  // 2-64 rows: tensor cores ("mma", the default; "mma-cpasync" without bulk copies) and dp4a
  // ("dp4a", up to 16 rows).
  // Every row count on 8192->4096 (the issue's comparison with llama.cpp), 16 rows on two more.
  for (GgmlType type : {GgmlType::Q8_0, GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::MXFP4})
    for (int rows : {2, 4, 8, 16, 32, 64})
      for (int shape : {4, 1, 0}) {
        if (shape != 4 && rows != 16) continue;
        run(type, shapes[shape], rows, bw, stream, false, "mma", true);
        // The same kernels filling their stages by 16-byte cp.async instead of bulk copies.
        KernelChoice cp_async;
        cp_async.mmq_bulk = false;
        set_kernel_choice(cp_async);
        run(type, shapes[shape], rows, bw, stream, false, "mma-cpasync", true);
        KernelChoice ring3;  // bulk copies in a ring of 3 stages
        ring3.mmq_bulk_ring2 = false;
        set_kernel_choice(ring3);
        run(type, shapes[shape], rows, bw, stream, false, "mma-ring3", true);
        set_kernel_choice(KernelChoice{});
        if (rows <= 16 && (rows == 16 || shape == 4)) {
          set_kernel_choice(legacy);
          run(type, shapes[shape], rows, bw, stream, false, "dp4a", true);
          set_kernel_choice(KernelChoice{});
        }
      }
  // The same on 8192->4096 for the further tensor-core types (mmq_chunk32.cuh): all added types.
  for (GgmlType type : {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::IQ4_NL,
                        GgmlType::Q5_K, GgmlType::IQ4_XS, GgmlType::IQ3_XXS, GgmlType::IQ3_S, GgmlType::IQ1_S,
                        GgmlType::IQ2_XS, GgmlType::IQ2_S, GgmlType::IQ1_M})
    for (int rows : {2, 4, 8, 16, 32, 64}) {
      run(type, shapes[4], rows, bw, stream, false, "mma", true);
      if (rows <= 16) {
        set_kernel_choice(legacy);
        run(type, shapes[4], rows, bw, stream, false, "dp4a", true);
        set_kernel_choice(KernelChoice{});
      }
    }
  for (int rows : {2, 4, 16}) {
    run(GgmlType::BF16, shapes[4], rows, bw, stream, false, nullptr, true);
    set_kernel_choice(legacy);
    run(GgmlType::BF16, shapes[4], rows, bw, stream, false, "legacy", true);
    set_kernel_choice(KernelChoice{});
  }
  BENCH_CUDA(cudaStreamDestroy(stream));
  return 0;
}
