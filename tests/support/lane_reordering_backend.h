// A backend for checking the forward pass's use of lanes (backend.h) without a GPU: every op
// goes to an inner backend (the CPU), but an op given to a side lane runs only when that lane
// is joined (or at the next scratch_release, begin_step, download, synchronize or timing
// point), after the main lane's ops that follow the fork. A forward pass that keeps the
// lanes' contract (no op of one lane reads or writes what an op of the other writes between
// the fork and the join) gives the same bits as the inner backend running everything in
// program order; one that breaks it (the main lane reading a side result before the join, a
// side op reading what the main lane writes after the fork) gives other values, as a GPU
// would at some interleaving. Deterministic, so CI can hold it.
#pragma once

#include <functional>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"

namespace dsv4::test {

class LaneReorderingBackend final : public backend::Backend {
 public:
  using Tensor = backend::Tensor;
  using MatmulMode = backend::MatmulMode;
  explicit LaneReorderingBackend(backend::Backend& inner) : in_(inner) {}

  int deferred_ops() const { return deferred_; }  // side-lane ops run late so far

  std::string name() const override { return in_.name(); }
  backend::DeviceMemoryState device_memory() const override { return in_.device_memory(); }

  // Allocation and mapping happen at once (they are not ops of a lane).
  Result<Tensor> alloc(GgmlType type, std::span<const int64_t> shape) override { return in_.alloc(type, shape); }
  Result<Tensor> reserve(GgmlType type, std::span<const int64_t> shape) override { return in_.reserve(type, shape); }
  Result<Tensor> weight(const gguf::TensorInfo& info) override { return in_.weight(info); }
  Result<Tensor> scratch(GgmlType type, std::span<const int64_t> shape) override { return in_.scratch(type, shape); }
  ScratchMark scratch_mark() const override { return in_.scratch_mark(); }

  // Join points: the side lane's ops first.
  void begin_step() override {
    (void)flush();
    in_.begin_step();
  }
  void scratch_release(ScratchMark mark) override {
    (void)flush();
    in_.scratch_release(mark);
  }
  Status download(const Tensor& src, void* host, size_t bytes) override {
    DSV4_TRY(flush());
    return in_.download(src, host, bytes);
  }
  Status synchronize() override {
    DSV4_TRY(flush());
    return in_.synchronize();
  }
  Result<TimePoint> time_point() override {
    DSV4_TRY(flush());
    return in_.time_point();
  }
  Result<double> elapsed_ms(const TimePoint& a, const TimePoint& b) override { return in_.elapsed_ms(a, b); }

  Status fork_lane(int lane) override {
    DSV4_TRY(check_lane("fork_lane", lane));
    side_ = true;
    return Status::ok();
  }
  Status main_lane() override {
    side_ = false;
    return Status::ok();
  }
  Status join_lane(int lane) override {
    DSV4_TRY(check_lane("join_lane", lane));
    side_ = false;
    return flush();
  }

  // Ops: now on the main lane, at the join on a side lane. Arguments are copied (a side op
  // may run after the caller's locals are gone); tensors are descriptors sharing their memory.
  Status upload(const Tensor& dst, const void* host, size_t bytes) override {
    std::vector<uint8_t> copy(static_cast<const uint8_t*>(host), static_cast<const uint8_t*>(host) + bytes);
    return op([this, dst, copy = std::move(copy)] { return in_.upload(dst, copy.data(), copy.size()); });
  }
  Status copy_rows(const Tensor& src, const Tensor& dst) override {
    return op([=, this] { return in_.copy_rows(src, dst); });
  }
  Status fill(const Tensor& t, float value) override { return op([=, this] { return in_.fill(t, value); }); }
  Status matmul(const Tensor& w, const Tensor& x, const Tensor& y, MatmulMode mode) override {
    return op([=, this] { return in_.matmul(w, x, y, mode); });
  }
  Status matmul_grouped(const Tensor& w, const Tensor& x, const Tensor& y, int64_t groups, MatmulMode mode) override {
    return op([=, this] { return in_.matmul_grouped(w, x, y, groups, mode); });
  }
  Status matmul_many(std::span<const Tensor* const> ws, const Tensor& x, std::span<const Tensor* const> ys,
                     MatmulMode mode) override {
    std::vector<Tensor> w, y;
    for (const Tensor* t : ws) w.push_back(*t);
    for (const Tensor* t : ys) y.push_back(*t);
    return op([this, w, x, y, mode] {
      std::vector<const Tensor*> wp, yp;
      for (const Tensor& t : w) wp.push_back(&t);
      for (const Tensor& t : y) yp.push_back(&t);
      return in_.matmul_many(wp, x, yp, mode);
    });
  }
  Status get_rows(const Tensor& table, const Tensor& ids, const Tensor& y) override {
    return op([=, this] { return in_.get_rows(table, ids, y); });
  }
  Status rms_norm(const Tensor& x, const Tensor* weight, float eps, int64_t width, const Tensor& y) override {
    const auto w = opt(weight);
    return op([=, this] { return in_.rms_norm(x, ptr(w), eps, width, y); });
  }
  Status rms_norm_torch_order(const Tensor& x, const Tensor* weight, float eps, int64_t width,
                              const Tensor& y) override {
    const auto w = opt(weight);
    return op([=, this] { return in_.rms_norm_torch_order(x, ptr(w), eps, width, y); });
  }
  Status rope(const Tensor& x, int64_t head_dim, const Tensor& positions, const backend::RopeParams& p,
              bool inverse) override {
    return op([=, this] { return in_.rope(x, head_dim, positions, p, inverse); });
  }
  Status add(const Tensor& x, const Tensor& y) override { return op([=, this] { return in_.add(x, y); }); }
  Status scale(const Tensor& x, float factor) override { return op([=, this] { return in_.scale(x, factor); }); }
  Status hc_pre(const Tensor& streams, const Tensor& mixes, const Tensor& scale, const Tensor& base, int n_hc,
                int iters, float hc_eps, float norm_eps, const Tensor& x, const Tensor& post,
                const Tensor& comb) override {
    return op([=, this] { return in_.hc_pre(streams, mixes, scale, base, n_hc, iters, hc_eps, norm_eps, x, post, comb); });
  }
  Status hc_pre_norm(const Tensor& streams, const Tensor& mixes, const Tensor& scale, const Tensor& base, int n_hc,
                     int iters, float hc_eps, float norm_eps, const Tensor& norm_weight, const Tensor& x,
                     const Tensor& post, const Tensor& comb, const Tensor& normed) override {
    return op([=, this] {
      return in_.hc_pre_norm(streams, mixes, scale, base, n_hc, iters, hc_eps, norm_eps, norm_weight, x, post, comb,
                             normed);
    });
  }
  Status hc_post(const Tensor& y, const Tensor& post, const Tensor& comb, int n_hc, const Tensor& streams) override {
    return op([=, this] { return in_.hc_post(y, post, comb, n_hc, streams); });
  }
  Status hc_mix(const Tensor& streams, const Tensor& mixes, const Tensor& scale, const Tensor& base, int n_hc,
                int iters, float hc_eps, float norm_eps, const Tensor& pre, const Tensor& post,
                const Tensor& comb) override {
    return op([=, this] { return in_.hc_mix(streams, mixes, scale, base, n_hc, iters, hc_eps, norm_eps, pre, post, comb); });
  }
  Status hc_collapse(const Tensor& streams, const Tensor& pre, int n_hc, const Tensor& x) override {
    return op([=, this] { return in_.hc_collapse(streams, pre, n_hc, x); });
  }
  Status hc_head(const Tensor& streams, const Tensor& mixes, const Tensor& scale, const Tensor& base, int n_hc,
                 float hc_eps, float norm_eps, const Tensor& x) override {
    return op([=, this] { return in_.hc_head(streams, mixes, scale, base, n_hc, hc_eps, norm_eps, x); });
  }
  Status attention(const Tensor& q, const backend::AttentionKeys& keys, const backend::StepRows& rows,
                   const Tensor& sink, float scale, const Tensor& out, MatmulMode mode) override {
    return op([=, this] { return in_.attention(q, keys, rows, sink, scale, out, mode); });
  }
  Status store_window(const Tensor& kv, const backend::StepRows& rows, int64_t window,
                      const backend::SlotRows& ring) override {
    return op([=, this] { return in_.store_window(kv, rows, window, ring); });
  }
  Status compress(const Tensor& kv, const Tensor& score, const Tensor& ape, int ratio, bool overlap,
                  const backend::StepRows& rows, const backend::SlotRows& state_kv,
                  const backend::SlotRows& state_score, const Tensor& pooled) override {
    return op([=, this] { return in_.compress(kv, score, ape, ratio, overlap, rows, state_kv, state_score, pooled); });
  }
  Status compress_entries(const Tensor& kv, const Tensor& score, const Tensor& ape, int ratio, bool overlap,
                          const backend::StepRows& rows, const backend::SlotRows& state_kv,
                          const backend::SlotRows& state_score, const backend::RowFinish& finish,
                          const backend::PagedRows& dst) override {
    const Finish f(finish);
    return op([=, this] {
      return in_.compress_entries(kv, score, ape, ratio, overlap, rows, state_kv, state_score, f.get(), dst);
    });
  }
  Status block_positions(const backend::StepRows& rows, int ratio, const Tensor& out) override {
    return op([=, this] { return in_.block_positions(rows, ratio, out); });
  }
  Status store_entries(const Tensor& pooled, int ratio, const backend::StepRows& rows,
                       const backend::PagedRows& dst) override {
    return op([=, this] { return in_.store_entries(pooled, ratio, rows, dst); });
  }
  Status indexer_scores(const Tensor& q, const Tensor& w, const backend::PagedRows& keys, int ratio,
                        const backend::StepRows& rows, const Tensor& scores, MatmulMode mode) override {
    return op([=, this] { return in_.indexer_scores(q, w, keys, ratio, rows, scores, mode); });
  }
  Status top_k(const Tensor& scores, int ratio, const backend::StepRows& rows, int k, const Tensor& idx) override {
    return op([=, this] { return in_.top_k(scores, ratio, rows, k, idx); });
  }
  Status finish_rows(const Tensor& x, const Tensor& positions, const backend::RowFinish& finish) override {
    const Finish f(finish);
    return op([=, this] { return in_.finish_rows(x, positions, f.get()); });
  }
  Status hadamard(const Tensor& x, int64_t width) override { return op([=, this] { return in_.hadamard(x, width); }); }
  Status round_fp8_blocks(const Tensor& x, int64_t cols, int64_t block) override {
    return op([=, this] { return in_.round_fp8_blocks(x, cols, block); });
  }
  Status round_fp4_blocks(const Tensor& x, int64_t block) override {
    return op([=, this] { return in_.round_fp4_blocks(x, block); });
  }
  Status round_fp4_e4m3_blocks(const Tensor& x, int64_t block) override {
    return op([=, this] { return in_.round_fp4_e4m3_blocks(x, block); });
  }
  Status engram_gate(const Tensor& streams, const Tensor& kv, const Tensor& q, const Tensor& k, int n_hc, float eps,
                     const Tensor& gate) override {
    return op([=, this] { return in_.engram_gate(streams, kv, q, k, n_hc, eps, gate); });
  }
  Status candidate_blocks(const Tensor& scores, int ratio, const backend::StepRows& rows, int64_t block, int k,
                          const Tensor& out) override {
    return op([=, this] { return in_.candidate_blocks(scores, ratio, rows, block, k, out); });
  }
  Status mask_candidates(const Tensor& scores, const Tensor& candidates, int64_t block) override {
    return op([=, this] { return in_.mask_candidates(scores, candidates, block); });
  }
  Status route(const Tensor& logits, const Tensor* bias, const Tensor* tid2eid, const Tensor& tokens, int k,
               float route_scale, const Tensor& experts, const Tensor& weights) override {
    const auto b = opt(bias), t = opt(tid2eid);
    return op([=, this] { return in_.route(logits, ptr(b), ptr(t), tokens, k, route_scale, experts, weights); });
  }
  Status moe_experts(const Tensor& x, const Tensor& gate, const Tensor& up, const Tensor& down, const Tensor& experts,
                     const Tensor& weights, float limit, MatmulMode mode, const Tensor& y) override {
    return op([=, this] { return in_.moe_experts(x, gate, up, down, experts, weights, limit, mode, y); });
  }
  Status swiglu_expert(const Tensor& x, const Tensor& gate, const Tensor& up, const Tensor& down, float limit,
                       MatmulMode mode, const Tensor& y) override {
    return op([=, this] { return in_.swiglu_expert(x, gate, up, down, limit, mode, y); });
  }
  Status steer(const Tensor& x, const Tensor& dir, int64_t group, bool project, const Tensor& alpha) override {
    return op([=, this] { return in_.steer(x, dir, group, project, alpha); });
  }
  Status sample(const Tensor& logits, const Tensor& params, const Tensor* adjust, const Tensor& out) override {
    const auto a = opt(adjust);
    return op([=, this] { return in_.sample(logits, params, ptr(a), out); });
  }

 private:
  // A RowFinish with its own copies of what it points to.
  struct Finish {
    explicit Finish(const backend::RowFinish& f) : f(f) {
      if (f.norm_weight) norm_weight = *f.norm_weight;
      if (f.rope) rope = *f.rope;
    }
    backend::RowFinish get() const {
      backend::RowFinish r = f;
      r.norm_weight = norm_weight ? &*norm_weight : nullptr;
      r.rope = rope ? &*rope : nullptr;
      return r;
    }
    backend::RowFinish f;
    std::optional<Tensor> norm_weight;
    std::optional<backend::RopeParams> rope;
  };
  static std::optional<Tensor> opt(const Tensor* t) { return t ? std::optional<Tensor>(*t) : std::nullopt; }
  static const Tensor* ptr(const std::optional<Tensor>& t) { return t ? &*t : nullptr; }

  Status op(std::function<Status()> f) {
    if (!side_) return f();
    side_ops_.push_back(std::move(f));
    ++deferred_;
    return Status::ok();
  }
  Status flush() {
    std::vector<std::function<Status()>> ops;
    ops.swap(side_ops_);
    side_ = false;
    Status first = Status::ok();
    for (auto& f : ops) {
      Status s = f();
      if (first.is_ok() && !s.is_ok()) first = std::move(s);
    }
    return first;
  }

  backend::Backend& in_;
  bool side_ = false;
  std::vector<std::function<Status()>> side_ops_;
  int deferred_ = 0;
};

}  // namespace dsv4::test
