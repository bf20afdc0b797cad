// The attention-side step operations on the GPU (attention_ops.h and the CudaBackend methods)
// against the CpuBackend on the same random data: several sequences per step in shuffled
// slots and pages, padding rows (one between sequences), long chunks through the
// compressor, decode rows whose key lists are split over many blocks, prefill rows, the
// real V4-Flash shapes. Outputs are poisoned first. Exact path: per-row relative L2 <= 1e-5;
// Fast (BF16 tensor cores): the bound in docs/CUDA.md; caches, states and selections:
// identical. Seeds are fixed (DSV4_TEST_SEED overrides them); failures name the op, the
// case, the seed and the worst row and element.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/attention_ops.h"
#include "backend/cuda/cuda_backend.h"
#include "cuda_test_util.h"
#include "support/test_support.h"

namespace dsv4::backend {
namespace {

using cuda::AttentionPrecision;
using cuda::test::DeviceBuffer;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr double kExactBound = 1e-5;
// BF16 q, k, v and p (docs/CUDA.md, "Attention"): a few times 2^-8 / sqrt(3) on data whose
// logits have a standard deviation of about 1-2.
constexpr double kFastAttentionBound = 2e-2;
constexpr double kFastIndexerBound = 3e-2;

uint64_t seed_for(uint64_t fixed) { return std::getenv("DSV4_TEST_SEED") ? dsv4::test::test_seed() : fixed; }

// ---- host descriptions of a step and of paged rows ------------------------------------------

struct SeqDesc {
  int32_t slot;
  int64_t pos0;
  int64_t n;
};

struct HostStep {
  int64_t n = 0, n_seqs = 0, max_end = 0;
  std::vector<int32_t> pos, row_seq, meta;
  std::vector<int64_t> row0;  // first row of each sequence
};

// The sequences in order, a padding row after the first one, `padding` more at the end.
HostStep make_step(const std::vector<SeqDesc>& seqs, int64_t padding) {
  HostStep h;
  for (size_t s = 0; s < seqs.size(); ++s) {
    h.row0.push_back(static_cast<int64_t>(h.pos.size()));
    h.meta.insert(h.meta.end(), {static_cast<int32_t>(h.pos.size()), static_cast<int32_t>(seqs[s].n),
                                 static_cast<int32_t>(seqs[s].pos0), seqs[s].slot, 0});
    for (int64_t i = 0; i < seqs[s].n; ++i) {
      h.pos.push_back(static_cast<int32_t>(seqs[s].pos0 + i));
      h.row_seq.push_back(static_cast<int32_t>(s));
    }
    if (s == 0 && padding > 0) {
      h.pos.push_back(7);
      h.row_seq.push_back(-1);
      --padding;
    }
    h.max_end = std::max(h.max_end, seqs[s].pos0 + seqs[s].n);
  }
  for (int64_t i = 0; i < padding; ++i) {
    h.pos.push_back(0);
    h.row_seq.push_back(-1);
  }
  h.n = static_cast<int64_t>(h.pos.size());
  h.n_seqs = static_cast<int64_t>(seqs.size());
  return h;
}

struct HostPaged {
  int64_t width = 0, page_rows = 0, slots = 0, max_pages = 0, pool_rows = 0;
  std::vector<float> pool;
  std::vector<int32_t> table;
  std::vector<int32_t> first_row;  // [slots] (grafts: rows below do not exist), or empty
  const float* row(int32_t slot, int64_t i) const {
    return &pool[(table[slot * max_pages + i / page_rows] * page_rows + i % page_rows) * width];
  }
};

// `slots` lists of up to `max_rows` rows, pages in shuffled order with two spare pages.
HostPaged make_paged(int32_t slots, int64_t max_rows, int64_t width, int64_t page_rows, std::mt19937_64& rng,
                     float sd = 1.0f) {
  HostPaged p;
  p.width = width;
  p.page_rows = page_rows;
  p.slots = slots;
  p.max_pages = std::max<int64_t>(1, (max_rows + page_rows - 1) / page_rows);
  const int64_t n_pages = slots * p.max_pages + 2;
  p.pool_rows = n_pages * page_rows;
  std::vector<int32_t> order(n_pages);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  p.table.assign(order.begin(), order.begin() + slots * p.max_pages);
  p.pool = dsv4::test::random_normal(static_cast<size_t>(p.pool_rows * width), rng, sd);
  return p;
}

// ---- tensors on a Backend (CPU reference, CudaBackend) ----------------------------------------

struct On {
  Backend& be;
  Tensor f32(std::vector<int64_t> shape, const std::vector<float>& v) const {
    Tensor t = be.alloc(GgmlType::F32, shape).value();
    EXPECT_TRUE(be.upload(t, v.data(), v.size() * sizeof(float)).is_ok());
    return t;
  }
  Tensor i32(std::vector<int64_t> shape, const std::vector<int32_t>& v) const {
    Tensor t = be.alloc(GgmlType::I32, shape).value();
    EXPECT_TRUE(be.upload(t, v.data(), v.size() * sizeof(int32_t)).is_ok());
    return t;
  }
  std::vector<float> read(const Tensor& t) const {
    std::vector<float> v(t.n_elements());
    EXPECT_TRUE(be.download(t, v.data(), v.size() * sizeof(float)).is_ok());
    return v;
  }
  std::vector<int32_t> read_i32(const Tensor& t) const {
    std::vector<int32_t> v(t.n_elements());
    EXPECT_TRUE(be.download(t, v.data(), v.size() * sizeof(int32_t)).is_ok());
    return v;
  }
  StepRows step(const HostStep& h) const {
    StepRows r;
    r.n = h.n;
    r.n_seqs = h.n_seqs;
    r.tokens = i32({h.n}, std::vector<int32_t>(h.n, 1));
    r.positions = i32({h.n}, h.pos);
    r.row_seq = i32({h.n}, h.row_seq);
    r.seqs = i32({h.n_seqs, kSeqFields}, h.meta);
    r.max_end = h.max_end;
    return r;
  }
  PagedRows paged(const HostPaged& p) const {
    return {f32({p.pool_rows, p.width}, p.pool), i32({p.slots, p.max_pages}, p.table), p.page_rows,
            p.first_row.empty() ? Tensor{} : i32({p.slots}, p.first_row)};
  }
};

// ---- raw device buffers (the kernels without the backend) -------------------------------------

struct Dev {
  std::vector<std::unique_ptr<DeviceBuffer>> keep;
  template <class T>
  T* put(const std::vector<T>& v) {
    keep.push_back(std::make_unique<DeviceBuffer>(DeviceBuffer::from(v)));
    return keep.back()->get<T>();
  }
  cuda::DeviceRows rows(const std::vector<float>& v, int64_t cols) {
    return {put(v), static_cast<int64_t>(v.size()) / cols, cols, cols};
  }
  cuda::StepMeta step(const HostStep& h) {
    return {h.n, h.n_seqs, h.max_end, put(h.pos), put(h.row_seq), put(h.meta)};
  }
  cuda::DevicePaged paged(const HostPaged& p) {
    return {{put(p.pool), p.pool_rows, p.width, p.width}, put(p.table), p.slots,           p.max_pages,
            p.max_pages,                                     p.page_rows,  p.first_row.empty() ? nullptr : put(p.first_row)};
  }
  template <class T>
  static std::vector<T> get(const T* d, size_t n) {
    std::vector<T> v(n);
    EXPECT_EQ(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
};

// ---- comparisons ---------------------------------------------------------------------------

// Per-row relative L2 error of got against want (rows of `cols`) over want's finite
// elements; want's non-finite elements (-inf tails, NaN rows left unwritten) must be
// matched exactly; rows that are zero in want (padding) must be zero in got.
::testing::AssertionResult rows_close(const std::vector<float>& got, const std::vector<float>& want, int64_t cols,
                                      double tol, const std::string& what) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  double worst = 0;
  int64_t worst_row = -1;
  for (int64_t r = 0; r < static_cast<int64_t>(want.size()) / cols; ++r) {
    double num = 0, den = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const float g = got[r * cols + c], w = want[r * cols + c];
      const bool same = g == w || (std::isnan(g) && std::isnan(w));
      if ((!std::isfinite(w) || !std::isfinite(g)) && !same)
        return ::testing::AssertionFailure() << what << ": row " << r << " column " << c << " is " << g << ", want " << w;
      if (!std::isfinite(w)) continue;
      num += (double(g) - w) * (double(g) - w);
      den += double(w) * w;
    }
    const double rel = den > 0 ? std::sqrt(num / den) : (num > 0 ? INFINITY : 0.0);
    if (rel > worst || worst_row < 0) worst = rel, worst_row = r;
  }
  std::ostringstream msg;
  if (worst_row >= 0) {
    int64_t wc = 0;
    double wd = -1;
    for (int64_t c = 0; c < cols; ++c) {
      const double diff = std::fabs(double(got[worst_row * cols + c]) - want[worst_row * cols + c]);
      if (diff > wd) wd = diff, wc = c;  // NaN differences (matched non-finite pairs) never win
    }
    msg << what << ": worst row " << worst_row << " relative L2 " << worst << " (bound " << tol << "), worst element "
        << wc << ": " << got[worst_row * cols + wc] << " vs " << want[worst_row * cols + wc];
  }
  if (worst <= tol) return ::testing::AssertionSuccess() << msg.str();
  return ::testing::AssertionFailure() << msg.str();
}

// Expects `r` and prints its message (the worst row's error), so the log records the
// errors actually reached, not only that they were within the bound.
void expect_and_log(const ::testing::AssertionResult& r) {
  EXPECT_TRUE(r);
  std::printf("[ error  ] %s\n", r.message());
}

template <class T>
::testing::AssertionResult identical(const std::vector<T>& got, const std::vector<T>& want, int64_t cols,
                                     const std::string& what) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  for (size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0)
      return ::testing::AssertionFailure() << what << ": row " << i / cols << " column " << i % cols << " is "
                                           << got[i] << ", want " << want[i];
  return ::testing::AssertionSuccess();
}

// ---- attention -------------------------------------------------------------------------------

struct AttnCase {
  std::string name;
  int heads, d;
  int64_t window;
  int ratio;
  bool csa;
  int top;
  std::vector<SeqDesc> seqs;
  int64_t padding;
  int32_t slots;
  float q_sd = 1.0f;
  int64_t ring_extra = 0;  // ring rows per slot beyond the window (the cache's rewind rows)
  int64_t ring_rows() const { return window + ring_extra; }
};

struct AttnData {
  HostStep st;
  std::vector<float> q, chunk, ring, sink;
  HostPaged entries;
  std::vector<int32_t> selected;
  float scale = 0;
};

AttnData make_attention(const AttnCase& c, std::mt19937_64& rng) {
  AttnData a;
  a.st = make_step(c.seqs, c.padding);
  const int64_t n = a.st.n, hd = int64_t{c.heads} * c.d;
  a.q = dsv4::test::random_normal(n * hd, rng, c.q_sd);
  a.chunk = dsv4::test::random_normal(n * c.d, rng);
  a.ring = dsv4::test::random_normal(c.slots * c.ring_rows() * c.d, rng);
  a.sink = dsv4::test::random_normal(c.heads, rng);
  a.scale = 1.0f / std::sqrt(static_cast<float>(c.d));
  if (c.ratio) a.entries = make_paged(c.slots, a.st.max_end / c.ratio + 1, c.d, 64, rng);
  if (c.csa) {  // a random subset of each row's visible entries, -1 in random places
    std::uniform_int_distribution<int> coin(0, 3);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t vis = a.st.row_seq[r] < 0 ? 0 : (a.st.pos[r] + 1) / c.ratio;
      std::vector<int32_t> all(vis);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      all.resize(std::min<int64_t>(vis, c.top - (coin(rng) == 0 ? 7 : 0)));
      std::sort(all.begin(), all.end());
      if (coin(rng) == 0)  // unused slots in the middle, not only at the end
        for (int i = 0; i < 5 && !all.empty(); ++i) all.insert(all.begin() + rng() % all.size(), -1);
      all.resize(c.top, -1);
      a.selected.insert(a.selected.end(), all.begin(), all.end());
    }
  }
  return a;
}

// mode: Quantized runs the CUDA backend's Fast kernels (bf16 tensor cores), any other its
// Exact ones; the CPU computes in fp32 in every mode.
std::vector<float> attention_on(Backend& be, const AttnCase& c, const AttnData& a,
                                MatmulMode mode = MatmulMode::Exact) {
  const On on{be};
  const int64_t n = a.st.n, hd = int64_t{c.heads} * c.d;
  AttentionKeys keys;
  keys.window = c.window;
  keys.ring = {on.f32({c.slots * c.ring_rows(), c.d}, a.ring), c.ring_rows()};
  keys.chunk = on.f32({n, c.d}, a.chunk);
  keys.ratio = c.ratio;
  if (c.ratio) keys.entries = on.paged(a.entries);
  if (c.csa) keys.selected = on.i32({n, c.top}, a.selected);
  Tensor out = on.f32({n, hd}, std::vector<float>(n * hd, kNaN));
  const Status st = be.attention(on.f32({n, hd}, a.q), keys, on.step(a.st), on.f32({c.heads}, a.sink), a.scale, out, mode);
  EXPECT_TRUE(st.is_ok()) << be.name() << " attention " << c.name << ": " << st.message();
  return on.read(out);
}

std::vector<float> attention_raw(const AttnCase& c, const AttnData& a, AttentionPrecision precision,
                                 cuda::AttentionPlan* plan_out) {
  Dev dev;
  const int64_t n = a.st.n, hd = int64_t{c.heads} * c.d;
  cuda::AttentionArgs args;
  args.q = dev.put(a.q);
  args.q_ld = hd;
  args.heads = c.heads;
  args.d = c.d;
  args.chunk = dev.rows(a.chunk, c.d);
  args.ring = dev.rows(a.ring, c.d);
  args.window = c.window;
  args.ring_rows = c.ring_rows();
  args.ratio = c.ratio;
  if (c.ratio) args.entries = dev.paged(a.entries);
  if (c.csa) {
    args.selected = dev.put(a.selected);
    args.selected_ld = c.top;
    args.top = c.top;
  }
  args.sink = dev.put(a.sink);
  args.scale = a.scale;
  float* out = dev.put(std::vector<float>(n * hd, kNaN));
  args.out = out;
  args.out_ld = hd;
  const cuda::StepMeta m = dev.step(a.st);
  cuda::AttentionPlan plan;
  Status st = cuda::plan_attention(args, m, precision, &plan);
  EXPECT_TRUE(st.is_ok()) << st.message();
  DeviceBuffer ws(std::max<size_t>(plan.workspace_bytes, 16));
  if (plan.workspace_bytes) ws.poison();
  st = cuda::attention(args, m, plan, ws.get(), plan.workspace_bytes, nullptr);
  EXPECT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "attention " << c.name;
  if (plan_out) *plan_out = plan;
  return Dev::get(out, n * hd);
}

std::vector<AttnCase> attention_cases() {
  return {
      // V4-Flash CSA: 64 heads x 512, window 128 from ring and chunk, top-512 with -1 slots.
      {"flash csa decode", 64, 512, 128, 4, true, 512, {{3, 5000, 1}, {0, 100, 2}, {5, 2100, 1}, {1, 0, 3}}, 2, 6},
      // HCA: every visible entry; one sequence's chunk is longer than the window.
      {"flash hca mixed", 64, 512, 128, 128, false, 0, {{2, 40000, 2}, {0, 127, 3}, {4, 300, 140}}, 1, 5},
      {"flash window only", 64, 512, 128, 0, false, 0, {{1, 900, 200}, {0, 3, 2}}, 1, 2},
      // Prefill of one sequence across the 2048-position point where top-512 starts to choose.
      {"flash csa prefill", 64, 512, 128, 4, true, 512, {{1, 1900, 256}}, 0, 2, 1.5f},
      {"small csa", 8, 256, 128, 4, true, 128, {{2, 700, 3}, {0, 10, 40}}, 1, 3},
      {"tiny hca", 4, 256, 8, 16, false, 0, {{1, 60, 5}, {0, 0, 9}, {2, 33, 1}}, 2, 3},
      {"pro heads hca", 128, 512, 128, 128, false, 0, {{0, 9000, 1}, {1, 200, 2}}, 0, 2},
      {"width 384", 16, 384, 16, 4, false, 0, {{0, 50, 3}}, 1, 1},
      // Decode rows with 20,000 and 6,250 entries: key lists split over many blocks.
      {"long hca decode", 64, 512, 128, 16, false, 0, {{1, 320015, 1}, {0, 100000, 1}}, 0, 2},
      // The cache's rings: window + 4 rows per slot (position p at row p mod 132 / 12).
      {"flash csa ring rows", 64, 512, 128, 4, true, 512, {{3, 5000, 5}, {0, 100, 2}, {1, 0, 3}}, 2, 4, 1.0f, 4},
      {"tiny hca ring rows", 4, 256, 8, 16, false, 0, {{1, 60, 5}, {0, 0, 9}, {2, 33, 1}}, 2, 3, 1.0f, 4},
      // One decode row (blocks of 16 heads on the tensor cores: 64 heads over 4 or 20 key tiles).
      {"flash window one row", 64, 512, 128, 0, false, 0, {{0, 900, 1}}, 0, 1},
      {"flash csa one row", 64, 512, 128, 4, true, 512, {{0, 5000, 1}}, 0, 1},
  };
}

class CudaAttention : public ::testing::TestWithParam<int> {};

TEST_P(CudaAttention, KernelsMatchCpu) {
  const AttnCase c = attention_cases()[GetParam()];
  const uint64_t seed = seed_for(1000 + GetParam());
  SCOPED_TRACE("attention case '" + c.name + "', seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const AttnData a = make_attention(c, rng);
  CpuBackend cpu;
  const std::vector<float> want = attention_on(cpu, c, a);
  cuda::AttentionPlan plan;
  const std::vector<float> exact = attention_raw(c, a, AttentionPrecision::Exact, &plan);
  expect_and_log(rows_close(exact, want, int64_t{c.heads} * c.d, kExactBound, "exact attention " + c.name));
  if (c.name == "long hca decode") {
    EXPECT_GT(plan.splits, 8) << "the decode rows should be split";
  }
  if (c.name == "flash csa prefill") {
    EXPECT_EQ(plan.splits, 1);
  }
  const std::vector<float> fast = attention_raw(c, a, AttentionPrecision::Fast, &plan);
  EXPECT_EQ(plan.tensor_cores, c.d == 256 || c.d == 512);
  expect_and_log(rows_close(fast, want, int64_t{c.heads} * c.d, c.d == 384 ? kExactBound : kFastAttentionBound,
                            "fast attention " + c.name));
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaAttention, ::testing::Range(0, static_cast<int>(attention_cases().size())),
                         [](const ::testing::TestParamInfo<int>& i) {
                           std::string s = attention_cases()[i.param].name;
                           for (char& ch : s) ch = std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
                           return s;
                         });

// ---- window, block positions, entries --------------------------------------------------------

TEST(CudaAttentionOps, StoreWindowBlockPositionsAndEntries) {
  const uint64_t seed = seed_for(2000);
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t d = 512, win = 128, w = 512;
  const int32_t slots = 4;
  const int ratio = 4;
  const HostStep st = make_step({{1, 3, 2}, {2, 10, 300}, {0, 0, 128}, {3, 77, 1}}, 2);
  for (const int64_t ring_rows : {win, win + 4}) {  // also the cache's rings of window + 4 rows
    SCOPED_TRACE("ring rows " + std::to_string(ring_rows));
    const auto kv = dsv4::test::random_normal(st.n * d, rng),
               ring0 = dsv4::test::random_normal(slots * ring_rows * d, rng);
    const HostPaged dst = make_paged(slots, st.max_end / ratio + 1, w, 64, rng);
    const auto pooled = dsv4::test::random_normal(st.n * w, rng);

    CpuBackend cpu;
    const On c{cpu};
    SlotRows ring_c{c.f32({slots * ring_rows, d}, ring0), ring_rows};
    const StepRows rows_c = c.step(st);
    ASSERT_TRUE(cpu.store_window(c.f32({st.n, d}, kv), rows_c, win, ring_c).is_ok());
    Tensor first_c = c.i32({st.n}, std::vector<int32_t>(st.n, -7));
    ASSERT_TRUE(cpu.block_positions(rows_c, ratio, first_c).is_ok());
    PagedRows dst_c = c.paged(dst);
    ASSERT_TRUE(cpu.store_entries(c.f32({st.n, w}, pooled), ratio, rows_c, dst_c).is_ok());

    Dev dev;
    const cuda::StepMeta m = dev.step(st);
    const cuda::DeviceRows ring_g = dev.rows(ring0, d);
    ASSERT_OK(cuda::store_window(dev.rows(kv, d), m, win, ring_g, nullptr, ring_rows));
    int32_t* first_g = dev.put(std::vector<int32_t>(st.n, -7));
    ASSERT_OK(cuda::block_positions(m, ratio, first_g, nullptr));
    const cuda::DevicePaged dst_g = dev.paged(dst);
    ASSERT_OK(cuda::store_entries(dev.rows(pooled, w), ratio, m, dst_g, nullptr));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(identical(Dev::get(ring_g.data, ring0.size()), c.read(ring_c.data), d, "store_window ring"));
    EXPECT_TRUE(identical(Dev::get(first_g, st.n), c.read_i32(first_c), 1, "block_positions"));
    EXPECT_TRUE(identical(Dev::get(dst_g.pool.data, dst.pool.size()), c.read(dst_c.pool), w, "store_entries pool"));
  }
}

// ---- compressor ------------------------------------------------------------------------------

struct CompressCase {
  int ratio;
  bool overlap;
  int64_t w;
  int64_t extra = 0;  // state rows per slot beyond overlap * ratio (the cache's rewind rows)
};

// Feeds three sequences (slots 2, 0, 4 of 5; slots 1 and 3 must stay untouched) through
// steps of random chunk lengths up to several blocks, the first chunks starting inside a
// block, one padding row per step; after every step the pooled rows must match the CPU's and
// the states must be bit-identical to the CPU's. `run` performs one step on the GPU.
template <class RunStep>
void compressor_streams(const CompressCase& cc, uint64_t seed, RunStep run) {
  SCOPED_TRACE("compress ratio " + std::to_string(cc.ratio) + (cc.overlap ? " overlap" : " plain") + " w " +
               std::to_string(cc.w) + " extra rows " + std::to_string(cc.extra) + ", seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int o = cc.overlap ? 2 : 1, R = cc.ratio;
  const int64_t wide = o * cc.w, slots = 5, per_slot = o * R + cc.extra, state_rows = slots * per_slot;
  const int32_t slot_of[3] = {2, 0, 4};
  const int64_t start[3] = {0, R + R / 2 + 1, 2 * R - 1};
  const int64_t total = 6 * R + 5;
  std::vector<float> kv[3], score[3];
  for (int s = 0; s < 3; ++s) {
    kv[s] = dsv4::test::random_normal(total * wide, rng);
    score[s] = dsv4::test::random_normal(total * wide, rng);
  }
  const auto ape = dsv4::test::random_normal(R * wide, rng, 0.5f);
  std::vector<float> skv = dsv4::test::random_normal(state_rows * wide, rng);
  std::vector<float> ssc = dsv4::test::random_normal(state_rows * wide, rng);
  for (int s = 0; s < 3; ++s)  // a sequence that starts at 0 finds no previous block
    if (start[s] == 0)
      for (int64_t r = 0; r < per_slot; ++r)
        for (int64_t c = 0; c < wide; ++c) {
          skv[(slot_of[s] * per_slot + r) * wide + c] = 0.0f;
          ssc[(slot_of[s] * per_slot + r) * wide + c] = -kInf;
        }
  CpuBackend cpu;
  const On c{cpu};
  SlotRows skv_c{c.f32({state_rows, wide}, skv), per_slot}, ssc_c{c.f32({state_rows, wide}, ssc), per_slot};
  const Tensor ape_c = c.f32({R, wide}, ape);
  std::vector<float> skv_g = skv, ssc_g = ssc;  // the GPU's state, carried from step to step on the host
  int64_t at[3] = {0, 0, 0};
  std::uniform_int_distribution<int64_t> len(1, 3 * R + 2);
  int step_no = 0;
  while (at[0] < total || at[1] < total || at[2] < total) {
    std::vector<SeqDesc> seqs;
    std::vector<int> which;
    std::vector<float> kvc, scc;
    for (int s = 0; s < 3; ++s) {
      if (at[s] >= total) continue;
      const int64_t m = std::min(total - at[s], step_no == 1 && s == 0 ? 3 * R + 2 : len(rng));
      seqs.push_back({slot_of[s], start[s] + at[s], m});
      which.push_back(s);
      at[s] += m;
    }
    const HostStep st = make_step(seqs, 1);
    kvc.assign(st.n * wide, 0.0f);
    scc.assign(st.n * wide, 0.0f);
    for (size_t i = 0; i < seqs.size(); ++i) {
      const int s = which[i];
      const int64_t from = seqs[i].pos0 - start[s];
      std::copy_n(kv[s].begin() + from * wide, seqs[i].n * wide, kvc.begin() + st.row0[i] * wide);
      std::copy_n(score[s].begin() + from * wide, seqs[i].n * wide, scc.begin() + st.row0[i] * wide);
    }
    Tensor pooled_c = c.f32({st.n, cc.w}, std::vector<float>(st.n * cc.w, kNaN));
    const Status sc = cpu.compress(c.f32({st.n, wide}, kvc), c.f32({st.n, wide}, scc), ape_c, R, cc.overlap,
                                   c.step(st), skv_c, ssc_c, pooled_c);
    ASSERT_TRUE(sc.is_ok()) << sc.message();
    std::vector<float> pooled_g(st.n * cc.w, kNaN);
    run(st, kvc, scc, ape, R, cc.overlap, skv_g, ssc_g, pooled_g);
    const std::string what = "step " + std::to_string(step_no);
    const auto pooled_ok = rows_close(pooled_g, c.read(pooled_c), cc.w, kExactBound, "pooled rows, " + what);
    EXPECT_TRUE(pooled_ok);
    if (step_no == 0) std::printf("[ error  ] %s\n", pooled_ok.message());
    EXPECT_TRUE(identical(skv_g, c.read(skv_c.data), wide, "state kv after " + what));
    EXPECT_TRUE(identical(ssc_g, c.read(ssc_c.data), wide, "state score after " + what));
    if (::testing::Test::HasFailure()) return;
    ++step_no;
  }
  EXPECT_GE(step_no, 3);
}

const CompressCase kCompressCases[] = {{4, true, 512},     {4, true, 128},      {16, false, 64},
                                       {128, false, 512},  {4, true, 128, 4},   {16, false, 64, 4},
                                       {128, false, 64, 4}};

TEST(CudaAttentionOps, CompressorMatchesCpuStepByStep) {
  int i = 0;
  for (const CompressCase& cc : kCompressCases)
    compressor_streams(cc, seed_for(3000 + i++),
                       [](const HostStep& st, const std::vector<float>& kvc, const std::vector<float>& scc,
                          const std::vector<float>& ape, int R, bool overlap, std::vector<float>& skv,
                          std::vector<float>& ssc, std::vector<float>& pooled) {
                         Dev dev;
                         const int64_t wide = static_cast<int64_t>(ape.size()) / R, w = overlap ? wide / 2 : wide;
                         cuda::CompressArgs a;
                         a.kv = dev.rows(kvc, wide);
                         a.score = dev.rows(scc, wide);
                         a.ape = dev.rows(ape, wide);
                         a.ratio = R;
                         a.overlap = overlap;
                         a.state_kv = dev.rows(skv, wide);
                         a.state_score = dev.rows(ssc, wide);
                         a.state_rows = static_cast<int64_t>(skv.size()) / wide / 5;  // 5 slots
                         a.pooled = dev.rows(pooled, w);
                         ASSERT_OK(cuda::compress(a, dev.step(st), nullptr));
                         ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
                         skv = Dev::get(a.state_kv.data, skv.size());
                         ssc = Dev::get(a.state_score.data, ssc.size());
                         pooled = Dev::get(a.pooled.data, pooled.size());
                       });
}

// ---- indexer scores and top-k ------------------------------------------------------------------

struct IndexCase {
  std::string name;
  int heads, dk, ratio, k;
  std::vector<SeqDesc> seqs;
  int64_t padding;
  int32_t slots;
};

struct IndexData {
  HostStep st;
  std::vector<float> q, w;
  HostPaged keys;
  int64_t cols = 0;
};

IndexData make_indexer(const IndexCase& c, std::mt19937_64& rng) {
  IndexData d;
  d.st = make_step(c.seqs, c.padding);
  d.cols = std::max<int64_t>(d.st.max_end / c.ratio, 1);
  d.q = dsv4::test::random_normal(d.st.n * c.heads * c.dk, rng, 0.3f);
  d.w = dsv4::test::random_normal(d.st.n * c.heads, rng, 0.1f);
  d.keys = make_paged(c.slots, d.cols, c.dk, 64, rng);
  return d;
}

std::vector<float> indexer_on(Backend& be, const IndexCase& c, const IndexData& d,
                              MatmulMode mode = MatmulMode::Exact) {
  const On on{be};
  Tensor scores = on.f32({d.st.n, d.cols}, std::vector<float>(d.st.n * d.cols, kNaN));
  const Status st = be.indexer_scores(on.f32({d.st.n, int64_t{c.heads} * c.dk}, d.q), on.f32({d.st.n, c.heads}, d.w),
                                      on.paged(d.keys), c.ratio, on.step(d.st), scores, mode);
  EXPECT_TRUE(st.is_ok()) << be.name() << " indexer_scores " << c.name << ": " << st.message();
  return on.read(scores);
}

std::vector<int32_t> top_k_on(Backend& be, const HostStep& hs, const std::vector<float>& scores, int64_t cols,
                              int ratio, int k) {
  const On on{be};
  Tensor idx = on.i32({hs.n, k}, std::vector<int32_t>(hs.n * k, 0x12345678));
  const Status st = be.top_k(on.f32({hs.n, cols}, scores), ratio, on.step(hs), k, idx);
  EXPECT_TRUE(st.is_ok()) << be.name() << " top_k: " << st.message();
  return on.read_i32(idx);
}

std::vector<int32_t> top_k_raw(const HostStep& hs, const std::vector<float>& scores, int64_t cols, int ratio, int k) {
  Dev dev;
  int32_t* idx = dev.put(std::vector<int32_t>(hs.n * k, 0x12345678));
  const cuda::DeviceRows sc = dev.rows(scores, cols);
  const cuda::StepMeta m = dev.step(hs);
  DeviceBuffer ws(std::max<size_t>(cuda::top_k_workspace_bytes(sc, ratio, m, k), 16));
  ws.poison();
  const Status st = cuda::top_k(sc, ratio, m, k, idx, k, ws.get(), ws.bytes(), nullptr);
  EXPECT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return Dev::get(idx, hs.n * k);
}

std::vector<IndexCase> indexer_cases() {
  return {
      {"flash", 64, 128, 4, 512, {{2, 4000, 2}, {0, 9, 3}, {1, 2100, 1}, {3, 30000, 1}}, 2, 4},
      {"small", 16, 128, 4, 128, {{1, 600, 30}, {0, 0, 2}}, 1, 2},
      {"tiny", 4, 128, 4, 3, {{0, 40, 6}, {1, 2, 3}}, 1, 2},
      // 100,003 visible keys: scores over many blocks, a top-k past the shared-memory stage.
      {"long decode", 64, 128, 4, 512, {{0, 400012, 1}}, 0, 1},
  };
}

class CudaIndexer : public ::testing::TestWithParam<int> {};

TEST_P(CudaIndexer, ScoresAndTopKMatchCpu) {
  const IndexCase c = indexer_cases()[GetParam()];
  const uint64_t seed = seed_for(4000 + GetParam());
  SCOPED_TRACE("indexer case '" + c.name + "', seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const IndexData d = make_indexer(c, rng);
  CpuBackend cpu;
  const std::vector<float> want = indexer_on(cpu, c, d);
  for (AttentionPrecision pr : {AttentionPrecision::Exact, AttentionPrecision::Fast}) {
    Dev dev;
    cuda::IndexerArgs a;
    a.q = dev.put(d.q);
    a.q_ld = int64_t{c.heads} * c.dk;
    a.w = dev.put(d.w);
    a.w_ld = c.heads;
    a.heads = c.heads;
    a.dk = c.dk;
    a.keys = dev.paged(d.keys);
    a.ratio = c.ratio;
    a.scores = dev.rows(std::vector<float>(d.st.n * d.cols, kNaN), d.cols);
    ASSERT_OK(cuda::indexer_scores(a, dev.step(d.st), pr, nullptr));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> got = Dev::get(a.scores.data, want.size());
    const bool exact = pr == AttentionPrecision::Exact;
    expect_and_log(rows_close(got, want, d.cols, exact ? kExactBound : kFastIndexerBound,
                              std::string(exact ? "exact" : "fast") + " indexer scores " + c.name));
    for (int64_t r = 0; r < d.st.n; ++r) {  // -inf past each row's visible count, exactly
      const int64_t vis = d.st.row_seq[r] < 0 ? 0 : (d.st.pos[r] + 1) / c.ratio;
      for (int64_t b = vis; b < d.cols; ++b)
        ASSERT_EQ(got[r * d.cols + b], -kInf) << "row " << r << " column " << b << " (visible " << vis << ")";
    }
  }
  // The same scores give the same selection.
  EXPECT_TRUE(identical(top_k_raw(d.st, want, d.cols, c.ratio, c.k), top_k_on(cpu, d.st, want, d.cols, c.ratio, c.k),
                        c.k, "top_k " + c.name));

  // Grafted slots (entries below first_row do not exist): -inf scores from the scores kernels'
  // own stores, and a selection without them (the backend ops, as the model calls them).
  IndexData g = d;
  std::uniform_int_distribution<int64_t> first(0, d.cols);
  g.keys.first_row.resize(c.slots);
  for (int32_t& f : g.keys.first_row) f = static_cast<int32_t>(first(rng));
  g.keys.first_row[0] = static_cast<int32_t>(std::min<int64_t>(d.cols, 3));
  const std::vector<float> want_g = indexer_on(cpu, c, g);
  int64_t absent = 0;
  for (float v : want_g) absent += v == -kInf;
  EXPECT_GT(absent, 0) << "no grafted entry to test";
  auto made = CudaBackend::create();
  ASSERT_TRUE(made.is_ok()) << made.status().message();
  CudaBackend& gpu = *made.value();
  for (MatmulMode mode : {MatmulMode::Exact, MatmulMode::Quantized}) {
    const bool exact = mode == MatmulMode::Exact;
    expect_and_log(rows_close(indexer_on(gpu, c, g, mode), want_g, d.cols, exact ? kExactBound : kFastIndexerBound,
                              std::string(exact ? "exact" : "fast") + " grafted indexer scores " + c.name));
  }
  EXPECT_TRUE(identical(top_k_on(gpu, g.st, want_g, d.cols, c.ratio, c.k),
                        top_k_on(cpu, g.st, want_g, d.cols, c.ratio, c.k), c.k, "grafted top_k " + c.name));
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaIndexer, ::testing::Range(0, static_cast<int>(indexer_cases().size())),
                         [](const ::testing::TestParamInfo<int>& i) {
                           std::string s = indexer_cases()[i.param].name;
                           for (char& ch : s) ch = std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
                           return s;
                         });

// Rows of 100,000 (past the shared-memory stage), 20,000, 3,000, 600, 512 and 100 visible
// scores from a small set of values (many ties at the k-th value), +0 and -0, -inf inside
// the visible range, a row of one value only, padding rows.
HostStep tie_step() { return make_step({{0, 400003, 1}, {1, 80003, 1}, {2, 12003, 1}, {3, 2403, 1}, {4, 2051, 1}, {5, 403, 1}, {6, 40003, 1}}, 2); }

std::vector<float> tie_scores(const HostStep& st, int64_t cols, std::mt19937_64& rng) {
  std::vector<float> s(st.n * cols, -kInf);
  std::uniform_int_distribution<int> level(-4, 4), pick(0, 99);
  for (int64_t r = 0; r < st.n; ++r) {
    if (st.row_seq[r] < 0) continue;
    const int64_t vis = std::min<int64_t>((st.pos[r] + 1) / 4, cols);
    for (int64_t b = 0; b < vis; ++b) {
      const int p = pick(rng);
      float v = static_cast<float>(level(rng)) * 0.5f;
      if (p < 5) v = -0.0f;
      if (p == 5) v = -kInf;
      if (p == 6) v = 1e-30f * static_cast<float>(level(rng));  // tiny values near zero
      s[r * cols + b] = st.row_seq[r] == 6 ? 1.25f : v;
    }
  }
  return s;
}

TEST(CudaAttentionOps, TopKIdenticalWithPlantedTies) {
  const uint64_t seed = seed_for(5000);
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const HostStep st = tie_step();
  const int64_t cols = st.max_end / 4;
  const std::vector<float> scores = tie_scores(st, cols, rng);
  CpuBackend cpu;
  for (int k : {512, 3, 2048, 20000})  // 20000: one phase, a row past the shared-memory stage
    EXPECT_TRUE(identical(top_k_raw(st, scores, cols, 4, k), top_k_on(cpu, st, scores, cols, 4, k), k,
                          "top_k k=" + std::to_string(k)));
  // A max_end that understates the longest row (chunks planned for 20,001 scores): that row
  // still gets its exact selection.
  HostStep understated = st;
  understated.max_end = 80004;
  EXPECT_TRUE(identical(top_k_raw(understated, scores, cols, 4, 512), top_k_on(cpu, st, scores, cols, 4, 512), 512,
                        "top_k, max_end understated"));
}

// ---- CUDA graphs and argument errors ----------------------------------------------------------

// A decode step's split attention and top-k captured into a graph and replayed give what the
// eager launches gave (nothing in them synchronises or allocates).
TEST(CudaAttentionOps, GraphReplayMatchesEager) {
  std::mt19937_64 rng(seed_for(6000));
  const auto cases = attention_cases();
  const auto long_decode = std::find_if(cases.begin(), cases.end(), [](const AttnCase& c) { return c.name == "long hca decode"; });
  ASSERT_NE(long_decode, cases.end());
  const AttnCase c = *long_decode;
  const AttnData a = make_attention(c, rng);
  Dev dev;
  const int64_t n = a.st.n, hd = int64_t{c.heads} * c.d;
  cuda::AttentionArgs args;
  args.q = dev.put(a.q);
  args.q_ld = hd;
  args.heads = c.heads;
  args.d = c.d;
  args.chunk = dev.rows(a.chunk, c.d);
  args.ring = dev.rows(a.ring, c.d);
  args.window = c.window;
  args.ratio = c.ratio;
  args.entries = dev.paged(a.entries);
  args.sink = dev.put(a.sink);
  args.scale = a.scale;
  args.out = dev.put(std::vector<float>(n * hd, kNaN));
  args.out_ld = hd;
  const cuda::StepMeta m = dev.step(a.st);
  const int64_t cols = a.st.max_end / c.ratio;
  const cuda::DeviceRows scores = dev.rows(dsv4::test::random_normal(n * cols, rng), cols);
  int32_t* idx = dev.put(std::vector<int32_t>(n * 512, 0));
  ASSERT_OK(cuda::prepare_attention_kernels());
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (AttentionPrecision pr : {AttentionPrecision::Exact, AttentionPrecision::Fast}) {
    cuda::AttentionPlan plan;
    ASSERT_OK(cuda::plan_attention(args, m, pr, &plan));
    ASSERT_GT(plan.splits, 1);
    DeviceBuffer ws(plan.workspace_bytes);
    const size_t top_bytes = cuda::top_k_workspace_bytes(scores, c.ratio, m, 512);
    ASSERT_GT(top_bytes, 0u) << "the two-phase top-k should be captured too";
    DeviceBuffer top_ws(top_bytes);
    const auto run = [&] {
      ASSERT_OK(cuda::attention(args, m, plan, ws.get(), plan.workspace_bytes, stream));
      ASSERT_OK(cuda::top_k(scores, c.ratio, m, 512, idx, 512, top_ws.get(), top_bytes, stream));
    };
    run();
    ASSERT_CUDA(cudaStreamSynchronize(stream));
    const auto eager = Dev::get(args.out, n * hd);
    const auto eager_idx = Dev::get(idx, n * 512);
    ASSERT_CUDA(cudaMemset(args.out, 0xff, n * hd * sizeof(float)));
    ASSERT_CUDA(cudaMemset(idx, 0, n * 512 * sizeof(int32_t)));
    cudaGraph_t graph;
    ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    run();
    ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec;
    ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    ASSERT_CUDA(cudaGraphLaunch(exec, stream));
    ASSERT_CUDA(cudaStreamSynchronize(stream));
    EXPECT_TRUE(identical(Dev::get(args.out, n * hd), eager, hd, "graph replay attention"));
    EXPECT_TRUE(identical(Dev::get(idx, n * 512), eager_idx, 512, "graph replay top_k"));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(stream);
}

TEST(CudaAttentionOps, UnsupportedShapesAreErrors) {
  cuda::AttentionArgs a;
  a.heads = 4;
  a.d = 100;
  cuda::StepMeta m;
  m.n = 1;
  cuda::AttentionPlan plan;
  Status st = cuda::plan_attention(a, m, AttentionPrecision::Exact, &plan);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("width"), std::string::npos) << st.message();
  cuda::CompressArgs c;
  EXPECT_FALSE(cuda::compress(c, m, nullptr).is_ok());  // ratio 0
  m.n_seqs = 70000;
  st = cuda::store_window({}, m, 128, {}, nullptr);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("65535"), std::string::npos) << st.message();
}

// ---- the same operations through CudaBackend ------------------------------------------------

class CudaBackendAttention : public ::testing::Test {
 protected:
  void SetUp() override {
    auto be = CudaBackend::create();
    ASSERT_TRUE(be.is_ok()) << be.status().message();
    gpu_ = std::move(be).value();
  }
  std::unique_ptr<CudaBackend> gpu_;
  CpuBackend cpu_;
};

TEST_F(CudaBackendAttention, AttentionMatchesCpu) {
  const auto cases = attention_cases();
  for (size_t i = 0; i < cases.size(); ++i) {
    const AttnCase& c = cases[i];
    const uint64_t seed = seed_for(1000 + i);
    SCOPED_TRACE("attention case '" + c.name + "', seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    const AttnData a = make_attention(c, rng);
    const std::vector<float> want = attention_on(cpu_, c, a);
    for (AttentionPrecision pr : {AttentionPrecision::Exact, AttentionPrecision::Fast}) {
      const MatmulMode mode = pr == AttentionPrecision::Fast ? MatmulMode::Quantized : MatmulMode::Exact;
      gpu_->begin_step();
      const bool exact = pr == AttentionPrecision::Exact || c.d == 384;
      EXPECT_TRUE(rows_close(attention_on(*gpu_, c, a, mode), want, int64_t{c.heads} * c.d,
                             exact ? kExactBound : kFastAttentionBound, "backend attention " + c.name));
    }
  }
}

TEST_F(CudaBackendAttention, WindowEntriesAndCompressorMatchCpu) {
  std::mt19937_64 rng(seed_for(2000));
  const int64_t d = 256, win = 16;
  const int32_t slots = 3;
  const HostStep st = make_step({{1, 3, 2}, {2, 10, 40}, {0, 0, 16}}, 1);
  const int64_t ring_rows = win + 4;  // the cache's rings (window + kRewindTokens rows)
  const auto kv = dsv4::test::random_normal(st.n * d, rng), ring0 = dsv4::test::random_normal(slots * ring_rows * d, rng);
  const HostPaged dst = make_paged(slots, st.max_end / 4 + 1, d, 8, rng);
  std::vector<std::vector<float>> rings;
  std::vector<std::vector<int32_t>> firsts;
  std::vector<std::vector<float>> pools;
  for (Backend* be : {static_cast<Backend*>(&cpu_), static_cast<Backend*>(gpu_.get())}) {
    const On on{*be};
    const StepRows rows = on.step(st);
    SlotRows ring{on.f32({slots * ring_rows, d}, ring0), ring_rows};
    ASSERT_TRUE(be->store_window(on.f32({st.n, d}, kv), rows, win, ring).is_ok());
    Tensor first = on.i32({st.n}, std::vector<int32_t>(st.n, -7));
    ASSERT_TRUE(be->block_positions(rows, 4, first).is_ok());
    PagedRows pages = on.paged(dst);
    ASSERT_TRUE(be->store_entries(on.f32({st.n, d}, kv), 4, rows, pages).is_ok());
    rings.push_back(on.read(ring.data));
    firsts.push_back(on.read_i32(first));
    pools.push_back(on.read(pages.pool));
  }
  EXPECT_TRUE(identical(rings[1], rings[0], d, "backend store_window"));
  EXPECT_TRUE(identical(firsts[1], firsts[0], 1, "backend block_positions"));
  EXPECT_TRUE(identical(pools[1], pools[0], d, "backend store_entries"));

  int i = 0;
  for (const CompressCase& cc : kCompressCases)
    compressor_streams(cc, seed_for(3000 + i++),
                       [&](const HostStep& hs, const std::vector<float>& kvc, const std::vector<float>& scc,
                           const std::vector<float>& ape, int R, bool overlap, std::vector<float>& skv,
                           std::vector<float>& ssc, std::vector<float>& pooled) {
                         const On on{*gpu_};
                         const int64_t wide = static_cast<int64_t>(ape.size()) / R, w = overlap ? wide / 2 : wide;
                         const int64_t rows_per_slot = static_cast<int64_t>(skv.size()) / wide / 5;  // 5 slots
                         SlotRows skv_t{on.f32({static_cast<int64_t>(skv.size()) / wide, wide}, skv), rows_per_slot};
                         SlotRows ssc_t{on.f32({static_cast<int64_t>(ssc.size()) / wide, wide}, ssc), rows_per_slot};
                         Tensor pooled_t = on.f32({hs.n, w}, pooled);
                         ASSERT_OK(gpu_->compress(on.f32({hs.n, wide}, kvc), on.f32({hs.n, wide}, scc),
                                                  on.f32({R, wide}, ape), R, overlap, on.step(hs), skv_t, ssc_t,
                                                  pooled_t));
                         skv = on.read(skv_t.data);
                         ssc = on.read(ssc_t.data);
                         pooled = on.read(pooled_t);
                       });
}

// compress_entries (pool, finish and store in one kernel, then the state update): the bits of the
// GPU's separate launches (Backend::compress_entries), and the CPU's states bit for bit and
// entries to the exact bound, over steps of one row (decode) and of several blocks, three
// sequences starting inside blocks, for the model's entry kinds (CSA KV, indexer keys, HCA
// KV) with and without the QAT roundings.
TEST_F(CudaBackendAttention, CompressEntriesFusedGivesTheStepsBits) {
  struct EntryCase {
    int ratio;
    bool overlap;
    int64_t w;
    bool indexer, qat;
  };
  const EntryCase cases[] = {{4, true, 512, false, true},   {4, true, 128, true, true},   {128, false, 512, false, true},
                             {4, true, 512, false, false}, {16, false, 64, false, false}};
  backend::RopeParams rope;
  rope.dims = 64;
  rope.freq_base = 160000;
  rope.yarn = true;
  rope.yarn_factor = 16;
  rope.yarn_original_context = 65536;
  int case_no = 0;
  for (const EntryCase& cc : cases) {
    const uint64_t seed = seed_for(3500 + case_no++);
    SCOPED_TRACE("compress_entries ratio " + std::to_string(cc.ratio) + (cc.overlap ? " overlap" : " plain") + " w " +
                 std::to_string(cc.w) + (cc.indexer ? " indexer" : "") + (cc.qat ? " qat" : "") + ", seed " +
                 std::to_string(seed));
    std::mt19937_64 rng(seed);
    const int o = cc.overlap ? 2 : 1, R = cc.ratio;
    const int64_t wide = o * cc.w, slots = 5, per_slot = o * R + 4, state_rows = slots * per_slot;
    const int32_t slot_of[3] = {2, 0, 4};
    const int64_t start[3] = {0, R + R / 2 + 1, 2 * R - 1}, total = 6 * R + 5;
    std::vector<float> skv = dsv4::test::random_normal(state_rows * wide, rng);
    std::vector<float> ssc = dsv4::test::random_normal(state_rows * wide, rng);
    for (int64_t r = 0; r < per_slot; ++r)  // slot 2 starts at 0: no previous block
      for (int64_t c = 0; c < wide; ++c) {
        skv[(slot_of[0] * per_slot + r) * wide + c] = 0.0f;
        ssc[(slot_of[0] * per_slot + r) * wide + c] = -kInf;
      }
    const auto ape = dsv4::test::random_normal(R * wide, rng, 0.5f);
    const auto norm = dsv4::test::random_normal(cc.w, rng, 0.5f);
    const HostPaged dst = make_paged(slots, (2 * R + total) / R + 1, cc.w, 8, rng);
    // Three runs of the same steps: the CPU, the fused GPU kernel, the GPU's separate launches.
    struct Run {
      Backend* be;
      bool fused;
      SlotRows skv, ssc;
      PagedRows pages;
      Tensor ape, norm;
    };
    std::vector<Run> runs;
    for (const auto& [be, fused] : std::vector<std::pair<Backend*, bool>>{{&cpu_, false}, {gpu_.get(), true}, {gpu_.get(), false}}) {
      const On on{*be};
      runs.push_back({be, fused, {on.f32({state_rows, wide}, skv), per_slot}, {on.f32({state_rows, wide}, ssc), per_slot},
                      on.paged(dst), on.f32({R, wide}, ape), on.f32({cc.w}, norm)});
    }
    int64_t at[3] = {0, 0, 0};
    std::uniform_int_distribution<int64_t> len(1, 3 * R + 2);
    std::uniform_int_distribution<int> coin(0, 2);  // 2 in 3 steps decode (1 in 3 from ratio 128 on)
    int step_no = 0;
    while (at[0] < total || at[1] < total || at[2] < total) {
      std::vector<SeqDesc> seqs;
      for (int s = 0; s < 3; ++s) {
        if (at[s] >= total) continue;
        const bool decode = R < 128 ? coin(rng) != 0 : coin(rng) == 0;
        const int64_t m = std::min(total - at[s], decode ? int64_t{1} : len(rng));
        seqs.push_back({slot_of[s], start[s] + at[s], m});
        at[s] += m;
      }
      const HostStep st = make_step(seqs, 1);
      const auto kvc = dsv4::test::random_normal(st.n * wide, rng), scc = dsv4::test::random_normal(st.n * wide, rng);
      for (Run& run : runs) {
        const On on{*run.be};
        backend::RowFinish f;
        f.group = cc.w;
        f.norm = true;
        f.norm_weight = &run.norm;
        f.eps = 1e-6f;
        f.rope = &rope;
        f.hadamard = cc.indexer;
        if (cc.qat) {
          f.round = cc.indexer ? backend::QatRounding::Fp4 : backend::QatRounding::Fp8;
          f.round_cols = cc.indexer ? 0 : cc.w - 64;
          f.round_block = cc.indexer ? 32 : 64;
        }
        const Tensor kv_t = on.f32({st.n, wide}, kvc), sc_t = on.f32({st.n, wide}, scc);
        const StepRows rows = on.step(st);
        const Status status =
            run.fused ? run.be->compress_entries(kv_t, sc_t, run.ape, R, cc.overlap, rows, run.skv, run.ssc, f, run.pages)
                      : run.be->Backend::compress_entries(kv_t, sc_t, run.ape, R, cc.overlap, rows, run.skv, run.ssc, f,
                                                          run.pages);
        ASSERT_OK(status);
        run.be->begin_step();
      }
      const std::string what = "step " + std::to_string(step_no);
      const On c{cpu_}, g{*gpu_};
      const auto pool_c = c.read(runs[0].pages.pool), pool_f = g.read(runs[1].pages.pool),
                 pool_s = g.read(runs[2].pages.pool);
      EXPECT_TRUE(identical(pool_f, pool_s, cc.w, "entries fused vs separate launches, " + what));
      EXPECT_TRUE(rows_close(pool_f, pool_c, cc.w, cc.qat ? 2e-2 : kExactBound, "entries vs cpu, " + what));
      for (int r = 1; r < 3; ++r) {
        EXPECT_TRUE(identical(g.read(runs[r].skv.data), c.read(runs[0].skv.data), wide, "state kv, " + what));
        EXPECT_TRUE(identical(g.read(runs[r].ssc.data), c.read(runs[0].ssc.data), wide, "state score, " + what));
      }
      if (::testing::Test::HasFailure()) return;
      ++step_no;
    }
    EXPECT_GE(step_no, 3);
  }
}

TEST_F(CudaBackendAttention, IndexerAndTopKMatchCpu) {
  const auto cases = indexer_cases();
  for (size_t i = 0; i < cases.size(); ++i) {
    const IndexCase& c = cases[i];
    const uint64_t seed = seed_for(4000 + i);
    SCOPED_TRACE("indexer case '" + c.name + "', seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    const IndexData d = make_indexer(c, rng);
    const std::vector<float> want = indexer_on(cpu_, c, d);
    for (AttentionPrecision pr : {AttentionPrecision::Exact, AttentionPrecision::Fast}) {
      const MatmulMode mode = pr == AttentionPrecision::Fast ? MatmulMode::Quantized : MatmulMode::Exact;
      const bool exact = pr == AttentionPrecision::Exact;
      EXPECT_TRUE(rows_close(indexer_on(*gpu_, c, d, mode), want, d.cols, exact ? kExactBound : kFastIndexerBound,
                             "backend indexer scores " + c.name));
    }
    EXPECT_TRUE(identical(top_k_on(*gpu_, d.st, want, d.cols, c.ratio, c.k),
                          top_k_on(cpu_, d.st, want, d.cols, c.ratio, c.k), c.k, "backend top_k " + c.name));
  }
  std::mt19937_64 rng(seed_for(5000));
  const HostStep st = tie_step();
  const int64_t cols = st.max_end / 4;
  const std::vector<float> scores = tie_scores(st, cols, rng);
  EXPECT_TRUE(identical(top_k_on(*gpu_, st, scores, cols, 4, 512), top_k_on(cpu_, st, scores, cols, 4, 512), 512,
                        "backend top_k with ties"));
}

}  // namespace
}  // namespace dsv4::backend
