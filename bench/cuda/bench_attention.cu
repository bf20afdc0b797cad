// The attention-side step operations at V4-Flash shapes (64 heads x 512, window 128, CSA
// top-512 of ratio-4 entries, HCA ratio 128, indexer 64 heads x 128): decode rows at several
// contexts and prefill chunks of one sequence, in both precisions. Each case reports its
// time, the bytes it must read and the FLOPs it must do, and the ratio of the larger of the
// two bounds (bytes at the measured read bandwidth; FLOPs at 67 TFLOP/s fp32 for Exact,
// 790 TFLOP/s BF16 for Fast) to the time.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "backend/cuda/attention_ops.h"
#include "bench_util.cuh"

using namespace dsv4;
using namespace dsv4::cuda;
using namespace dsv4::cuda::bench;

namespace {

constexpr int kHeads = 64, kDim = 512, kWindow = 128, kTop = 512, kIndexHeads = 64, kIndexDim = 128;
constexpr int64_t kPageRows = 64;
constexpr double kFp32Peak = 67e12, kBf16Peak = 790e12;

template <class T>
T* upload(Buffer& b, const std::vector<T>& v) {
  BENCH_CUDA(cudaMemcpy(b.p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return b.get<T>();
}

// A step: `seqs` sequences of `rows` rows each, sequence s in slot s ending at position `end`.
struct Step {
  std::vector<int32_t> pos, row_seq, meta;
  int64_t n = 0, n_seqs = 0, max_end = 0;
  Buffer *d_pos = nullptr, *d_row_seq = nullptr, *d_meta = nullptr;
  StepMeta meta_dev() const {
    return {n, n_seqs, max_end, d_pos->get<int32_t>(), d_row_seq->get<int32_t>(), d_meta->get<int32_t>()};
  }
};

Step make_step(int64_t seqs, int64_t rows, int64_t end, std::vector<Buffer*>& keep) {
  Step st;
  for (int64_t s = 0; s < seqs; ++s) {
    for (const int64_t f : {s * rows, rows, end - rows, s}) st.meta.push_back(static_cast<int32_t>(f));
    for (int64_t i = 0; i < rows; ++i) {
      st.pos.push_back(static_cast<int32_t>(end - rows + i));
      st.row_seq.push_back(static_cast<int32_t>(s));
    }
  }
  st.n = seqs * rows;
  st.n_seqs = seqs;
  st.max_end = end;
  keep.push_back(st.d_pos = new Buffer(st.pos.size() * 4));
  keep.push_back(st.d_row_seq = new Buffer(st.row_seq.size() * 4));
  keep.push_back(st.d_meta = new Buffer(st.meta.size() * 4));
  upload(*st.d_pos, st.pos);
  upload(*st.d_row_seq, st.row_seq);
  upload(*st.d_meta, st.meta);
  return st;
}

// Paged lists of `rows` rows for each of `slots` slots, pages in shuffled order.
DevicePaged make_paged(int64_t slots, int64_t rows, int64_t width, std::vector<Buffer*>& keep, uint64_t seed) {
  const int64_t pages = std::max<int64_t>(1, (rows + kPageRows - 1) / kPageRows);
  std::vector<int32_t> table(slots * pages);
  std::iota(table.begin(), table.end(), 0);
  std::mt19937 rng(static_cast<unsigned>(seed));
  std::shuffle(table.begin(), table.end(), rng);
  Buffer* pool = new Buffer(static_cast<size_t>(slots * pages * kPageRows * width) * 4);
  Buffer* tab = new Buffer(table.size() * 4);
  keep.push_back(pool);
  keep.push_back(tab);
  fill_floats(pool->get<float>(), slots * pages * kPageRows * width, seed);
  upload(*tab, table);
  return {{pool->get<float>(), slots * pages * kPageRows, width, width}, tab->get<int32_t>(), slots, pages, pages,
          kPageRows};
}

DeviceRows make_rows(int64_t rows, int64_t cols, std::vector<Buffer*>& keep, uint64_t seed) {
  Buffer* b = new Buffer(static_cast<size_t>(rows * cols) * 4);
  keep.push_back(b);
  fill_floats(b->get<float>(), rows * cols, seed);
  return {b->get<float>(), rows, cols, cols};
}

// Per-call time of fn: run once (first-use set-up), then `calls` calls captured into one
// graph, replayed (launch gaps between a step's kernels are a graph's, not the host's).
double time_calls(cudaStream_t stream, const std::function<void()>& fn, int calls, int iters) {
  fn();
  BENCH_CUDA(cudaStreamSynchronize(stream));
  const cudaGraphExec_t graph = capture(stream, [&] {
    for (int i = 0; i < calls; ++i) fn();
  });
  const double us = time_us(stream, [&] { BENCH_CUDA(cudaGraphLaunch(graph, stream)); }, iters);
  cudaGraphExecDestroy(graph);
  return us / calls;
}

// DSV4_BENCH_ONLY=<regular expression>: run only the cases whose name it matches.
bool wanted(const std::string& name) {
  const char* only = std::getenv("DSV4_BENCH_ONLY");
  return only == nullptr || std::regex_search(name, std::regex(only));
}

const char* precision_name(AttentionPrecision p) { return p == AttentionPrecision::Exact ? "exact" : "fast"; }

void report_case(const std::string& name, double us, double bytes, double flops, AttentionPrecision p,
                 const Bandwidth& bw, const std::string& extra) {
  const double peak = p == AttentionPrecision::Exact ? kFp32Peak : kBf16Peak;
  const double bound_us = std::max(bytes / (bw.read_gbs * 1e3), flops / peak * 1e6);
  char note[300];
  std::snprintf(note, sizeof note, "%.1f MB, %.2f GFLOP; bound %.1f us (%s); %.0f GB/s, %.1f TFLOP/s%s", bytes / 1e6,
                flops / 1e9, bound_us, bytes / (bw.read_gbs * 1e3) > flops / peak * 1e6 ? "bytes" : "flops",
                bytes / us / 1e3, flops / us / 1e6, extra.c_str());
  report("attention", name + " " + precision_name(p), us, "us", bound_us / us, note);
}

// Attention over window + compressed keys: `seqs` sequences of `rows` rows ending at `end`.
void attention_case(const std::string& name, int ratio, bool csa, int64_t seqs, int64_t rows, int64_t end,
                    const Bandwidth& bw, cudaStream_t stream) {
  if (!wanted(name)) return;
  std::vector<Buffer*> keep;
  const Step st = make_step(seqs, rows, end, keep);
  const int64_t n = st.n, entries = ratio ? end / ratio : 0;
  AttentionArgs a;
  const DeviceRows q = make_rows(n, int64_t{kHeads} * kDim, keep, 1);
  a.q = q.data;
  a.q_ld = q.ld;
  a.heads = kHeads;
  a.d = kDim;
  a.chunk = make_rows(n, kDim, keep, 2);
  a.ring = make_rows(seqs * kWindow, kDim, keep, 3);
  a.window = kWindow;
  a.ratio = ratio;
  if (ratio) a.entries = make_paged(seqs, entries + 1, kDim, keep, 4);
  std::vector<int32_t> sel;
  double keys = 0;
  std::mt19937 rng(7);
  for (int64_t r = 0; r < n; ++r) {
    const int64_t t = st.pos[r], vis = ratio ? (t + 1) / ratio : 0;
    keys += std::min<int64_t>(t + 1, kWindow);
    if (!csa) {
      keys += vis;
      continue;
    }
    std::vector<int32_t> all(vis);
    std::iota(all.begin(), all.end(), 0);
    if (vis > kTop) {
      std::shuffle(all.begin(), all.end(), rng);
      all.resize(kTop);
      std::sort(all.begin(), all.end());
    }
    keys += static_cast<double>(all.size());
    all.resize(kTop, -1);
    sel.insert(sel.end(), all.begin(), all.end());
  }
  if (csa) {
    Buffer* b = new Buffer(sel.size() * 4);
    keep.push_back(b);
    a.selected = upload(*b, sel);
    a.selected_ld = kTop;
    a.top = kTop;
  }
  const DeviceRows sink = make_rows(1, kHeads, keep, 5);
  a.sink = sink.data;
  a.scale = 1.0f / std::sqrt(float(kDim));
  const DeviceRows out = make_rows(n, int64_t{kHeads} * kDim, keep, 6);
  a.out = out.data;
  a.out_ld = out.ld;
  const StepMeta m = st.meta_dev();
  for (AttentionPrecision p : {AttentionPrecision::Exact, AttentionPrecision::Fast}) {
    AttentionPlan plan;
    check_status(plan_attention(a, m, p, &plan), "plan_attention");
    Buffer ws(std::max<size_t>(plan.workspace_bytes, 16));
    const double us = time_calls(stream, [&] {
      check_status(attention(a, m, plan, ws.p, plan.workspace_bytes, stream), "attention");
    }, n > 256 ? 2 : 20, n > 256 ? 3 : 10);
    const double bytes = keys * kDim * 4 + 2.0 * n * kHeads * kDim * 4;
    const double flops = keys * kHeads * kDim * 4.0;
    char extra[120];
    std::snprintf(extra, sizeof extra, "; %d head groups x %d splits of %d tiles", plan.head_groups, plan.splits,
                  plan.tiles_per_split);
    report_case(name, us, bytes, flops, p, bw, extra);
  }
  for (Buffer* b : keep) delete b;
}

// Indexer scores over every visible key, then the top-512, for `seqs` x `rows` rows ending at `end`.
void indexer_case(const std::string& name, int64_t seqs, int64_t rows, int64_t end, const Bandwidth& bw,
                  cudaStream_t stream) {
  if (!wanted(name + " indexer")) return;
  std::vector<Buffer*> keep;
  const Step st = make_step(seqs, rows, end, keep);
  const int64_t n = st.n, cols = end / 4;
  IndexerArgs a;
  const DeviceRows q = make_rows(n, int64_t{kIndexHeads} * kIndexDim, keep, 11);
  const DeviceRows w = make_rows(n, kIndexHeads, keep, 12);
  a.q = q.data;
  a.q_ld = q.ld;
  a.w = w.data;
  a.w_ld = w.ld;
  a.heads = kIndexHeads;
  a.dk = kIndexDim;
  a.keys = make_paged(seqs, cols + 1, kIndexDim, keep, 13);
  a.ratio = 4;
  a.scores = make_rows(n, cols, keep, 14);
  Buffer idx(static_cast<size_t>(n) * kTop * 4);
  double visible = 0;
  for (int64_t r = 0; r < n; ++r) visible += (st.pos[r] + 1) / 4;
  const StepMeta m = st.meta_dev();
  for (AttentionPrecision p : {AttentionPrecision::Exact, AttentionPrecision::Fast}) {
    const double us = time_calls(stream, [&] { check_status(indexer_scores(a, m, p, stream), "indexer_scores"); },
                                 n > 256 ? 2 : 20, n > 256 ? 3 : 10);
    report_case(name + " indexer scores", us, visible * kIndexDim * 4 + double(n) * cols * 4,
                visible * kIndexHeads * kIndexDim * 2.0, p, bw, "");
  }
  Buffer top_ws(std::max<size_t>(top_k_workspace_bytes(a.scores, 4, m, kTop), 16));
  const double us = time_calls(stream, [&] {
    check_status(top_k(a.scores, 4, m, kTop, idx.get<int32_t>(), kTop, top_ws.p, top_ws.bytes, stream), "top_k");
  }, n > 256 ? 2 : 20, n > 256 ? 3 : 10);
  char note[200];
  const double bytes = visible * 4;
  std::snprintf(note, sizeof note, "%.1f MB of scores; bound %.1f us at the read bandwidth", bytes / 1e6,
                bytes / (bw.read_gbs * 1e3));
  report("attention", name + " top-512", us, "us", bytes / (bw.read_gbs * 1e3) / us, note);
  for (Buffer* b : keep) delete b;
}

}  // namespace

int main() {
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const Bandwidth bw = measure_bandwidth();
  report("bandwidth", "streaming read kernel (attention run)", bw.read_gbs, "GB/s", 1.0, "");
  for (int64_t rows : {1, 64}) {
    const std::string r = "decode " + std::to_string(rows) + (rows == 1 ? " row" : " rows");
    attention_case(r + " CSA 32K ctx (128 + 512 keys)", 4, true, rows, 1, 32768, bw, stream);
    for (int64_t ctx : {4096, 32768, 131072})
      attention_case(r + " HCA " + std::to_string(ctx / 1024) + "K ctx", 128, false, rows, 1, ctx, bw, stream);
  }
  attention_case("decode 1 row HCA 1M ctx", 128, false, 1, 1, 1 << 20, bw, stream);
  for (int64_t ctx : {4096, 32768, 131072, 1 << 20})
    indexer_case("decode 1 row " + std::to_string(ctx / 1024) + "K ctx", 1, 1, ctx, bw, stream);
  indexer_case("decode 64 rows 32K ctx", 64, 1, 32768, bw, stream);
  for (int64_t rows : {2048, 8192}) {
    const std::string r = "prefill " + std::to_string(rows / 1024) + "K rows";
    attention_case(r + " CSA", 4, true, 1, rows, rows, bw, stream);
    attention_case(r + " HCA", 128, false, 1, rows, rows, bw, stream);
    indexer_case(r, 1, rows, rows, bw, stream);
  }
  BENCH_CUDA(cudaStreamDestroy(stream));
  return 0;
}
