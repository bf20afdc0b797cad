// The CPU backend: the reference implementation of every Backend operation, on host
// memory, multithreaded over output rows. Weights are views of the GGUF mapping and are
// decoded row by row inside the dot products (no whole-model dequantisation).
#pragma once

#include <memory>
#include <vector>

#include "backend/backend.h"
#include "util/thread_pool.h"

namespace dsv4::backend {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int n_threads = 0);  // <= 0: one per hardware thread
  ~CpuBackend() override;

  std::string name() const override { return "cpu"; }
  int threads() const { return pool_->size(); }
  // Fill every scratch tensor with NaN when it is handed out (tests: proves that nothing
  // reads a value it did not write). Off by default; DSV4_POISON_SCRATCH=1 turns it on.
  void set_poison_scratch(bool on) { poison_scratch_ = on; }

  Result<Tensor> alloc(GgmlType type, std::span<const int64_t> shape) override;
  Result<Tensor> reserve(GgmlType type, std::span<const int64_t> shape) override;
  Result<Tensor> weight(const gguf::TensorInfo& info) override;
  Status upload(const Tensor& dst, const void* host, size_t bytes) override;
  Status download(const Tensor& src, void* host, size_t bytes) override;
  Status copy_rows(const Tensor& src, const Tensor& dst) override;
  Status fill(const Tensor& t, float value) override;
  void begin_step() override;
  Result<Tensor> scratch(GgmlType type, std::span<const int64_t> shape) override;
  ScratchMark scratch_mark() const override { return {chunk_, chunk_used_}; }
  void scratch_release(ScratchMark mark) override;

  Status matmul(const Tensor& w, const Tensor& x, const Tensor& y, MatmulMode mode) override;
  Status get_rows(const Tensor& table, const Tensor& ids, const Tensor& y) override;
  Status rms_norm(const Tensor& x, const Tensor* weight, float eps, int64_t width,
                  const Tensor& y) override;
  Status rms_norm_torch_order(const Tensor& x, const Tensor* weight, float eps, int64_t width,
                              const Tensor& y) override;
  Status rope(const Tensor& x, int64_t head_dim, const Tensor& positions, const RopeParams& p,
              bool inverse) override;
  Status add(const Tensor& x, const Tensor& y) override;
  Status scale(const Tensor& x, float factor) override;

  Status hc_pre(const Tensor& streams, const Tensor& mixes, const Tensor& scale,
                const Tensor& base, int n_hc, int sinkhorn_iters, float hc_eps, float norm_eps,
                const Tensor& x, const Tensor& post, const Tensor& comb) override;
  Status hc_post(const Tensor& y, const Tensor& post, const Tensor& comb, int n_hc,
                 const Tensor& streams) override;
  Status hc_head(const Tensor& streams, const Tensor& mixes, const Tensor& scale,
                 const Tensor& base, int n_hc, float hc_eps, float norm_eps,
                 const Tensor& x) override;

  Status attention(const Tensor& q, const AttentionKeys& keys, const StepRows& rows,
                   const Tensor& sink, float scale, const Tensor& out, MatmulMode mode) override;
  Status store_window(const Tensor& kv, const StepRows& rows, int64_t window,
                      const SlotRows& ring) override;
  Status compress(const Tensor& kv, const Tensor& score, const Tensor& ape, int ratio, bool overlap,
                  const StepRows& rows, const SlotRows& state_kv, const SlotRows& state_score,
                  const Tensor& pooled) override;
  Status block_positions(const StepRows& rows, int ratio, const Tensor& out) override;
  Status store_entries(const Tensor& pooled, int ratio, const StepRows& rows,
                       const PagedRows& dst) override;
  Status indexer_scores(const Tensor& q, const Tensor& w, const PagedRows& keys, int ratio,
                        const StepRows& rows, const Tensor& scores, MatmulMode mode) override;
  Status top_k(const Tensor& scores, int ratio, const StepRows& rows, int k,
               const Tensor& idx) override;
  Status hadamard(const Tensor& x, int64_t width) override;
  Status round_fp8_blocks(const Tensor& x, int64_t cols, int64_t block) override;
  Status round_fp4_blocks(const Tensor& x, int64_t block) override;
  Status round_fp4_e4m3_blocks(const Tensor& x, int64_t block) override;
  Status hc_mix(const Tensor& streams, const Tensor& mixes, const Tensor& scale, const Tensor& base, int n_hc,
                int sinkhorn_iters, float hc_eps, float norm_eps, const Tensor& pre, const Tensor& post,
                const Tensor& comb) override;
  Status hc_collapse(const Tensor& streams, const Tensor& pre, int n_hc, const Tensor& x) override;
  Status engram_gate(const Tensor& streams, const Tensor& kv, const Tensor& q, const Tensor& k, int n_hc, float eps,
                     const Tensor& gate) override;
  Status candidate_blocks(const Tensor& scores, int ratio, const StepRows& rows, int64_t block, int k,
                          const Tensor& out) override;
  Status mask_candidates(const Tensor& scores, const Tensor& candidates, int64_t block) override;

  Status route(const Tensor& logits, const Tensor* bias, const Tensor* tid2eid,
               const Tensor& tokens, int k, float route_scale, const Tensor& experts,
               const Tensor& weights) override;
  Status moe_experts(const Tensor& x, const Tensor& gate, const Tensor& up, const Tensor& down,
                     const Tensor& experts, const Tensor& weights, float limit, MatmulMode mode,
                     const Tensor& y) override;
  Status swiglu_expert(const Tensor& x, const Tensor& gate, const Tensor& up, const Tensor& down,
                       float limit, MatmulMode mode, const Tensor& y) override;

  Status steer(const Tensor& x, const Tensor& dir, int64_t group, bool project, const Tensor& alpha) override;
  Status sample(const Tensor& logits, const Tensor& params, const Tensor* adjust,
                const Tensor& out) override;

 private:
  // Step scratch: bump allocation in 64-byte aligned chunks, the current one chunks_[chunk_];
  // begin_step() rewinds, and replaces several chunks by one of their total size so a
  // steady state uses one.
  struct Chunk { std::shared_ptr<void> memory; size_t bytes = 0; };
  std::vector<Chunk> chunks_;
  size_t chunk_ = 0;        // current chunk
  size_t chunk_used_ = 0;   // bytes used in it
  bool poison_scratch_ = false;
  std::unique_ptr<ThreadPool> pool_;
};

}  // namespace dsv4::backend
