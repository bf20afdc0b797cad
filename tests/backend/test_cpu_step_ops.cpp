// The step operations of the CPU backend (attention over window ring + paged entries, the
// window update, the compressor, entry storage, indexer scores and top-k) against plain
// definitions in double, on several sequences of one step at once: different positions,
// slots in shuffled order, pages in shuffled order, a padding row. Outputs are poisoned.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "support/test_support.h"

namespace dsv4::backend {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

struct SeqDesc {
  int32_t slot;
  int64_t pos0;
  int64_t n;
};

class CpuStepOps : public ::testing::Test {
 protected:
  CpuStepOps() : be_(2), rng_(test::test_seed()) {}

  Tensor f32(std::vector<int64_t> shape, const std::vector<float>& values) {
    Tensor t = be_.alloc(GgmlType::F32, shape).value();
    EXPECT_TRUE(be_.upload(t, values.data(), values.size() * sizeof(float)).is_ok());
    return t;
  }
  Tensor i32(std::vector<int64_t> shape, const std::vector<int32_t>& values) {
    Tensor t = be_.alloc(GgmlType::I32, shape).value();
    EXPECT_TRUE(be_.upload(t, values.data(), values.size() * sizeof(int32_t)).is_ok());
    return t;
  }
  Tensor poisoned(std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return f32(shape, std::vector<float>(n, kNaN));
  }
  std::vector<float> read(const Tensor& t) {
    std::vector<float> v(t.n_elements());
    EXPECT_TRUE(be_.download(t, v.data(), v.size() * sizeof(float)).is_ok());
    return v;
  }
  std::vector<int32_t> read_i32(const Tensor& t) {
    std::vector<int32_t> v(t.n_elements());
    EXPECT_TRUE(be_.download(t, v.data(), v.size() * sizeof(int32_t)).is_ok());
    return v;
  }
  std::vector<float> randn(size_t n, float sd = 1) { return test::random_normal(n, rng_, sd); }

  // A step of the given sequences, then `padding` padding rows.
  StepRows step(const std::vector<SeqDesc>& seqs, int64_t padding = 0) {
    std::vector<int32_t> pos, row_seq, meta;
    for (size_t s = 0; s < seqs.size(); ++s) {
      meta.insert(meta.end(), {static_cast<int32_t>(pos.size()), static_cast<int32_t>(seqs[s].n),
                               static_cast<int32_t>(seqs[s].pos0), seqs[s].slot, 0});
      for (int64_t i = 0; i < seqs[s].n; ++i) {
        pos.push_back(static_cast<int32_t>(seqs[s].pos0 + i));
        row_seq.push_back(static_cast<int32_t>(s));
      }
    }
    for (int64_t i = 0; i < padding; ++i) {
      pos.push_back(0);
      row_seq.push_back(-1);
    }
    StepRows r;
    r.n = static_cast<int64_t>(pos.size());
    r.n_seqs = static_cast<int64_t>(seqs.size());
    r.tokens = i32({r.n}, std::vector<int32_t>(r.n, 1));
    r.positions = i32({r.n}, pos);
    r.row_seq = i32({r.n}, row_seq);
    r.seqs = i32({r.n_seqs, kSeqFields}, meta);
    for (const SeqDesc& s : seqs) r.max_end = std::max(r.max_end, s.pos0 + s.n);
    return r;
  }

  // A paged list for `slots` slots of up to `max_rows` rows each, pages in shuffled order
  // (one spare page left unused), filled with random rows; host copy rows[slot][i].
  struct Paged {
    PagedRows view;
    std::vector<std::vector<std::vector<float>>> rows;
  };
  Paged paged(int32_t slots, int64_t max_rows, int64_t width, int64_t page_rows) {
    const int64_t pages_per_slot = (max_rows + page_rows - 1) / page_rows;
    const int64_t n_pages = slots * pages_per_slot + 1;
    std::vector<int32_t> order(n_pages);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng_);
    std::vector<int32_t> table(slots * pages_per_slot);
    for (size_t i = 0; i < table.size(); ++i) table[i] = order[i];
    std::vector<float> pool = randn(n_pages * page_rows * width);
    Paged p;
    p.view = {f32({n_pages * page_rows, width}, pool), i32({slots, pages_per_slot}, table), page_rows, {}};
    p.rows.resize(slots);
    for (int32_t s = 0; s < slots; ++s)
      for (int64_t i = 0; i < max_rows; ++i) {
        const int64_t at = (table[s * pages_per_slot + i / page_rows] * page_rows + i % page_rows) * width;
        p.rows[s].emplace_back(pool.begin() + at, pool.begin() + at + width);
      }
    return p;
  }

  static void expect_close(const std::vector<float>& got, const std::vector<double>& want, double tol,
                           const char* what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    double worst = 0, scale = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_TRUE(std::isfinite(got[i])) << what << " element " << i;
      worst = std::max(worst, std::fabs(got[i] - want[i]));
      scale = std::max(scale, std::fabs(want[i]));
    }
    EXPECT_LE(worst / scale, tol) << what << " (seed " << test::test_seed() << ")";
  }

  CpuBackend be_;
  std::mt19937_64 rng_;
};

// Window keys from the ring (earlier steps) and the chunk (this step), then every visible
// entry (HCA) or the selected ones (CSA), one softmax with the sink; padding rows give 0.
TEST_F(CpuStepOps, AttentionOverRingChunkAndPagedEntries) {
  const int64_t heads = 3, d = 32, win = 6, ratio = 4, page_rows = 3, slots = 4;
  const std::vector<SeqDesc> seqs = {{2, 0, 5}, {0, 13, 4}, {3, 30, 1}, {1, 7, 9}};
  const StepRows rows = step(seqs, 2);
  const int64_t n = rows.n;
  // Rings of exactly the window and of 4 rows more (the cache's rewind rows): position p at row p mod ring_rows.
  for (const int64_t ring_rows : {win, win + 4}) {
    SCOPED_TRACE(::testing::Message() << "ring rows " << ring_rows);
    const auto q = randn(n * heads * d, 0.5f), chunk = randn(n * d), ring = randn(slots * ring_rows * d),
               sink = randn(heads);
    Paged entries = paged(slots, 40 / ratio, d, page_rows);
    const float scale = 1 / std::sqrt(float(d));
    for (bool csa : {false, true}) {
      AttentionKeys keys;
      keys.window = win;
      keys.ring = {f32({slots * ring_rows, d}, ring), ring_rows};
      keys.chunk = f32({n, d}, chunk);
      keys.ratio = ratio;
      keys.entries = entries.view;
      std::vector<int32_t> sel;
      const int64_t k = 3;
      const auto pos = read_i32(rows.positions), rs = read_i32(rows.row_seq);
      if (csa) {  // a random ascending subset of each row's visible entries
        for (int64_t r = 0; r < n; ++r) {
          const int64_t vis = rs[r] < 0 ? 0 : (pos[r] + 1) / ratio;
          std::vector<int32_t> all(vis);
          std::iota(all.begin(), all.end(), 0);
          std::shuffle(all.begin(), all.end(), rng_);
          all.resize(std::min<int64_t>(vis, k));
          std::sort(all.begin(), all.end());
          all.resize(k, -1);
          sel.insert(sel.end(), all.begin(), all.end());
        }
        keys.selected = i32({n, k}, sel);
      }
      Tensor out = poisoned({n, heads * d});
      const Status st = be_.attention(f32({n, heads * d}, q), keys, rows, f32({heads}, sink), scale, out, MatmulMode::Exact);
      ASSERT_TRUE(st.is_ok()) << st.message();

      std::vector<double> want(n * heads * d, 0.0);
      for (int64_t r = 0; r < n; ++r) {
        if (rs[r] < 0) continue;  // padding: zeros
        const SeqDesc& sq = seqs[rs[r]];
        const int64_t row0 = rows.n ? std::accumulate(seqs.begin(), seqs.begin() + rs[r], int64_t{0},
                                                      [](int64_t a, const SeqDesc& s) { return a + s.n; })
                                    : 0;
        std::vector<const float*> ks;
        for (int64_t p = std::max<int64_t>(0, pos[r] - win + 1); p <= pos[r]; ++p)
          ks.push_back(p >= sq.pos0 ? &chunk[(row0 + p - sq.pos0) * d]
                                    : &ring[(sq.slot * ring_rows + p % ring_rows) * d]);
        if (csa) {
          for (int64_t j = 0; j < k; ++j)
            if (sel[r * k + j] >= 0) ks.push_back(entries.rows[sq.slot][sel[r * k + j]].data());
        } else {
          for (int64_t e = 0; e < (pos[r] + 1) / ratio; ++e) ks.push_back(entries.rows[sq.slot][e].data());
        }
        for (int64_t h = 0; h < heads; ++h) {
          std::vector<double> l(ks.size());
          double denom = std::exp(double(sink[h]));
          for (size_t j = 0; j < ks.size(); ++j) {
            double dot = 0;
            for (int64_t c = 0; c < d; ++c) dot += double(q[(r * heads + h) * d + c]) * ks[j][c];
            l[j] = dot * scale;
            denom += std::exp(l[j]);
          }
          for (size_t j = 0; j < ks.size(); ++j)
            for (int64_t c = 0; c < d; ++c) want[(r * heads + h) * d + c] += std::exp(l[j]) / denom * ks[j][c];
        }
      }
      expect_close(read(out), want, 1e-5, csa ? "attention, selected entries" : "attention, every entry");
    }
  }
}

TEST_F(CpuStepOps, StoreWindowKeepsEachSequencesLastWindow) {
  const int64_t d = 8, win = 5, slots = 3;
  const std::vector<SeqDesc> seqs = {{1, 3, 2}, {2, 10, 12}, {0, 0, 5}};
  const StepRows rows = step(seqs, 1);
  for (const int64_t ring_rows : {win, win + 4}) {  // the cache's rings have 4 rows more
    SCOPED_TRACE(::testing::Message() << "ring rows " << ring_rows);
    const auto kv = randn(rows.n * d), before = randn(slots * ring_rows * d);
    SlotRows ring{f32({slots * ring_rows, d}, before), ring_rows};
    ASSERT_TRUE(be_.store_window(f32({rows.n, d}, kv), rows, win, ring).is_ok());
    std::vector<double> want(before.begin(), before.end());
    int64_t row0 = 0;
    for (const SeqDesc& s : seqs) {
      for (int64_t i = std::max<int64_t>(0, s.n - win); i < s.n; ++i)
        for (int64_t c = 0; c < d; ++c)
          want[(s.slot * ring_rows + (s.pos0 + i) % ring_rows) * d + c] = kv[(row0 + i) * d + c];
      row0 += s.n;
    }
    const auto got = read(ring.data);
    for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], static_cast<float>(want[i])) << i;
  }
}

// The whole-sequence definition of the compressor (spec §3.3) against the streaming
// operation fed in random chunk sizes, two sequences per step in different slots; states of
// exactly overlap * ratio rows per slot and of 4 more (the cache's rewind rows).
TEST_F(CpuStepOps, CompressorStreamsExactlyPerSequence) {
  for (const auto& [ratio, extra] : {std::pair{4, 0}, std::pair{16, 0}, std::pair{4, 4}, std::pair{16, 4}}) {
    SCOPED_TRACE(::testing::Message() << "ratio " << ratio << ", extra rows " << extra);
    const bool overlap = ratio == 4;
    const int o = overlap ? 2 : 1;
    const int64_t w = 8, total = 9 * ratio + 3, slots = 3, per_slot = o * ratio + extra;
    const int32_t slot_of[2] = {2, 0};
    std::vector<float> kv[2], score[2];
    for (int s = 0; s < 2; ++s) kv[s] = randn(total * o * w), score[s] = randn(total * o * w);
    const auto ape = randn(ratio * o * w);
    SlotRows skv{f32({slots * per_slot, o * w}, std::vector<float>(slots * per_slot * o * w, 0)), per_slot};
    SlotRows ssc{f32({slots * per_slot, o * w}, std::vector<float>(slots * per_slot * o * w, -kInf)), per_slot};
    std::vector<float> got[2];
    std::uniform_int_distribution<int64_t> len(1, 2 * ratio + 1);
    int64_t at[2] = {0, 0};
    while (at[0] < total || at[1] < total) {
      std::vector<SeqDesc> seqs;
      std::vector<float> kvc, scc;
      int which[2];
      for (int s = 0; s < 2; ++s) {
        if (at[s] >= total) continue;
        const int64_t m = std::min(total - at[s], len(rng_));
        which[seqs.size()] = s;
        seqs.push_back({slot_of[s], at[s], m});
        kvc.insert(kvc.end(), kv[s].begin() + at[s] * o * w, kv[s].begin() + (at[s] + m) * o * w);
        scc.insert(scc.end(), score[s].begin() + at[s] * o * w, score[s].begin() + (at[s] + m) * o * w);
      }
      const StepRows rows = step(seqs);
      Tensor pooled = poisoned({rows.n, w});
      const Status st = be_.compress(f32({rows.n, o * w}, kvc), f32({rows.n, o * w}, scc), f32({ratio, o * w}, ape),
                                     ratio, overlap, rows, skv, ssc, pooled);
      ASSERT_TRUE(st.is_ok()) << st.message();
      const auto p = read(pooled);
      int64_t row0 = 0;
      for (size_t i = 0; i < seqs.size(); ++i) {
        for (int64_t j = 0; j < seqs[i].n; ++j)
          if ((seqs[i].pos0 + j + 1) % ratio == 0)
            got[which[i]].insert(got[which[i]].end(), p.begin() + (row0 + j) * w, p.begin() + (row0 + j + 1) * w);
          else  // rows that close no block are left alone
            for (int64_t c = 0; c < w; ++c) ASSERT_TRUE(std::isnan(p[(row0 + j) * w + c]));
        at[which[i]] += seqs[i].n;
        row0 += seqs[i].n;
      }
    }
    for (int s = 0; s < 2; ++s) {
      const int64_t n_entries = total / ratio;
      std::vector<double> want(n_entries * w);
      for (int64_t b = 0; b < n_entries; ++b)
        for (int64_t c = 0; c < w; ++c) {
          std::vector<std::pair<double, double>> slots_zv;  // (score, value)
          for (int64_t j = 0; j < ratio; ++j) {
            const int64_t p = b * ratio + j;
            if (overlap) {
              if (b > 0) {
                const int64_t pp = p - ratio;  // previous block, first half
                slots_zv.push_back({score[s][pp * 2 * w + c] + ape[j * 2 * w + c], kv[s][pp * 2 * w + c]});
              }
              slots_zv.push_back({score[s][p * 2 * w + w + c] + ape[j * 2 * w + w + c], kv[s][p * 2 * w + w + c]});
            } else {
              slots_zv.push_back({score[s][p * w + c] + ape[j * w + c], kv[s][p * w + c]});
            }
          }
          double mx = -1e300, sum = 0, acc = 0;
          for (auto& [z, v] : slots_zv) mx = std::max(mx, z);
          for (auto& [z, v] : slots_zv) sum += std::exp(z - mx);
          for (auto& [z, v] : slots_zv) acc += std::exp(z - mx) / sum * v;
          want[b * w + c] = acc;
        }
      expect_close(got[s], want, 1e-5, overlap ? "overlap compressor" : "plain compressor");
    }
  }
}

TEST_F(CpuStepOps, BlockPositionsAndStoreEntries) {
  const int ratio = 4;
  const int64_t w = 6, page_rows = 2, slots = 2;
  const std::vector<SeqDesc> seqs = {{1, 2, 7}, {0, 11, 1}};
  const StepRows rows = step(seqs, 1);
  Tensor first = i32({rows.n}, std::vector<int32_t>(rows.n, -7));
  ASSERT_TRUE(be_.block_positions(rows, ratio, first).is_ok());
  const std::vector<int32_t> fp = read_i32(first), pos = read_i32(rows.positions);
  for (int64_t r = 0; r < rows.n; ++r) EXPECT_EQ(fp[r], pos[r] / ratio * ratio) << r;

  Paged dst = paged(slots, 4, w, page_rows);
  const auto before = read(dst.view.pool);
  const auto pooled = randn(rows.n * w);
  ASSERT_TRUE(be_.store_entries(f32({rows.n, w}, pooled), ratio, rows, dst.view).is_ok());
  // Closing rows: seq 0 at positions 3 and 7 (entries 0, 1), seq 1 at 11 (entry 2).
  auto table = read_i32(dst.view.page_table);
  std::vector<float> want = before;
  const auto put = [&](int32_t slot, int64_t e, int64_t row) {
    const int64_t at = (table[slot * dst.view.page_table.cols() + e / page_rows] * page_rows + e % page_rows) * w;
    std::copy_n(&pooled[row * w], w, &want[at]);
  };
  put(1, 0, 1);
  put(1, 1, 5);
  put(0, 2, 7);
  EXPECT_EQ(read(dst.view.pool), want);
}

TEST_F(CpuStepOps, IndexerScoresAndTopKOverPagedKeys) {
  const int ratio = 4, k = 3;
  const int64_t heads = 4, dk = 16, page_rows = 2, slots = 3;
  const std::vector<SeqDesc> seqs = {{2, 0, 3}, {0, 5, 4}, {1, 27, 2}};
  const StepRows rows = step(seqs, 1);
  const int64_t n = rows.n, cols = rows.max_end / ratio;
  Paged keys = paged(slots, cols, dk, page_rows);
  const auto q = randn(n * heads * dk), wts = randn(n * heads);
  Tensor scores = poisoned({n, cols});
  ASSERT_TRUE(be_.indexer_scores(f32({n, heads * dk}, q), f32({n, heads}, wts), keys.view, ratio, rows, scores, MatmulMode::Exact).is_ok());
  const std::vector<float> got = read(scores);
  const std::vector<int32_t> pos = read_i32(rows.positions), rs = read_i32(rows.row_seq);
  for (int64_t r = 0; r < n; ++r) {
    const int64_t vis = rs[r] < 0 ? 0 : (pos[r] + 1) / ratio;
    for (int64_t b = 0; b < cols; ++b) {
      if (b >= vis) {
        EXPECT_EQ(got[r * cols + b], -kInf);
        continue;
      }
      double total = 0;
      const float* key = keys.rows[seqs[rs[r]].slot][b].data();
      for (int64_t h = 0; h < heads; ++h) {
        double dot = 0;
        for (int64_t i = 0; i < dk; ++i) dot += double(q[(r * heads + h) * dk + i]) * key[i];
        total += wts[r * heads + h] * std::max(dot, 0.0);
      }
      EXPECT_NEAR(got[r * cols + b], total, 1e-4 * (1 + std::fabs(total)));
    }
  }
  Tensor idx = i32({n, k}, std::vector<int32_t>(n * k, 12345));
  ASSERT_TRUE(be_.top_k(scores, ratio, rows, k, idx).is_ok());
  const auto sel = read_i32(idx);
  for (int64_t r = 0; r < n; ++r) {
    const int64_t vis = rs[r] < 0 ? 0 : (pos[r] + 1) / ratio;
    std::vector<int32_t> order(vis);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return got[r * cols + a] > got[r * cols + b]; });
    order.resize(std::min<size_t>(order.size(), k));
    std::sort(order.begin(), order.end());
    for (int j = 0; j < k; ++j) EXPECT_EQ(sel[r * k + j], j < static_cast<int>(order.size()) ? order[j] : -1) << "row " << r;
  }
}

TEST_F(CpuStepOps, MissingPagesAndBadMetadataAreErrors) {
  const int64_t d = 8, win = 4;
  const StepRows rows = step({{0, 20, 2}});
  AttentionKeys keys;
  keys.window = win;
  keys.ring = {f32({win, d}, randn(win * d)), win};
  keys.chunk = f32({rows.n, d}, randn(rows.n * d));
  keys.ratio = 4;
  // One page of 2 rows: entries 2.. (visible from position 11 on) have no page.
  keys.entries = {f32({2, d}, randn(2 * d)), i32({1, 3}, {0, -1, -1}), 2, {}};
  Tensor out = poisoned({rows.n, d});
  const Status st = be_.attention(f32({rows.n, d}, randn(rows.n * d)), keys, rows, f32({1}, {0.5f}), 1.0f, out, MatmulMode::Exact);
  ASSERT_FALSE(st.is_ok());
  EXPECT_EQ(st.code(), StatusCode::kInternal);
  EXPECT_NE(st.message().find("entry"), std::string::npos) << st.message();

  StepRows bad = step({{0, 0, 2}});
  bad.row_seq = i32({2}, {0, 5});  // a sequence the step does not have
  EXPECT_FALSE(be_.store_window(keys.chunk, bad, win, keys.ring).is_ok());
}

TEST_F(CpuStepOps, ScratchIsReusedPerStepAndPoisonable) {
  be_.set_poison_scratch(true);
  be_.begin_step();
  Tensor a = be_.scratch(GgmlType::F32, std::vector<int64_t>{3, 5}).value();
  for (float v : read(a)) EXPECT_TRUE(std::isnan(v));
  ASSERT_TRUE(be_.fill(a, 2.5f).is_ok());
  for (float v : read(a)) EXPECT_EQ(v, 2.5f);
  Tensor big = be_.scratch(GgmlType::F32, std::vector<int64_t>{1 << 20, 8}).value();  // a second chunk
  EXPECT_NE(big.data, a.data);
  be_.begin_step();
  Tensor b = be_.scratch(GgmlType::F32, std::vector<int64_t>{3, 5}).value();
  for (float v : read(b)) EXPECT_TRUE(std::isnan(v));  // poisoned again, not the old values
  Tensor ids = be_.scratch(GgmlType::I32, std::vector<int64_t>{4}).value();
  ASSERT_TRUE(be_.fill(ids, -1).is_ok());
  EXPECT_EQ(read_i32(ids), std::vector<int32_t>(4, -1));
  // An f32 fill's -inf, or any value an int32 cannot hold, is refused for an i32 tensor
  // (the conversion would be undefined); the tensor keeps its values.
  for (float bad : {-std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(), 0.5f, 3e9f})
    EXPECT_FALSE(be_.fill(ids, bad).is_ok()) << bad;
  EXPECT_EQ(read_i32(ids), std::vector<int32_t>(4, -1));
  ASSERT_TRUE(be_.fill(b, -std::numeric_limits<float>::infinity()).is_ok());  // this step's tensor
  for (float v : read(b)) EXPECT_EQ(v, -std::numeric_limits<float>::infinity());

  // A released scope hands the same memory out again; what was before it stays.
  const auto mark = be_.scratch_mark();
  Tensor inner = be_.scratch(GgmlType::F32, std::vector<int64_t>{7}).value();
  be_.scratch_release(mark);
  Tensor again = be_.scratch(GgmlType::F32, std::vector<int64_t>{7}).value();
  EXPECT_EQ(inner.data, again.data);
  EXPECT_EQ(read_i32(ids), std::vector<int32_t>(4, -1));
}

// Lanes (backend.h): the CPU runs every op in its call, in order, so a fork and a join change
// nothing; side lanes are numbered 1..kMaxLanes and anything else is an invalid argument.
TEST_F(CpuStepOps, LanesRunInOrderAndCheckTheLaneNumber) {
  Tensor t = f32({2, 3}, {1, 2, 3, 4, 5, 6});
  ASSERT_TRUE(be_.fork_lane(1).is_ok());
  ASSERT_TRUE(be_.scale(t, 2.0f).is_ok());
  ASSERT_TRUE(be_.main_lane().is_ok());
  EXPECT_EQ(read(t), (std::vector<float>{2, 4, 6, 8, 10, 12})) << "a side lane's op done in its call";
  ASSERT_TRUE(be_.join_lane(1).is_ok());
  for (int bad : {0, -1, Backend::kMaxLanes + 1}) {
    EXPECT_EQ(be_.fork_lane(bad).code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(be_.join_lane(bad).code(), StatusCode::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace dsv4::backend
