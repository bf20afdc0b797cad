// The CPU backend: the reference implementation of every Backend operation, on host
// memory, multithreaded over output rows. Weights are views of the GGUF mapping and are
// decoded row by row inside the dot products (no whole-model dequantisation).
#pragma once

#include <memory>

#include "backend/backend.h"
#include "util/thread_pool.h"

namespace dsv4::backend {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int n_threads = 0);  // <= 0: one per hardware thread
  ~CpuBackend() override;

  std::string name() const override { return "cpu"; }
  int threads() const { return pool_->size(); }

  Result<Tensor> alloc(GgmlType type, std::span<const int64_t> shape) override;
  Result<Tensor> reserve(GgmlType type, std::span<const int64_t> shape) override;
  Result<Tensor> weight(const gguf::TensorInfo& info) override;
  Status upload(const Tensor& dst, const void* host, size_t bytes) override;
  Status download(const Tensor& src, void* host, size_t bytes) override;
  Status copy_rows(const Tensor& src, const Tensor& dst) override;

  Status matmul(const Tensor& w, const Tensor& x, const Tensor& y, MatmulMode mode) override;
  Status get_rows(const Tensor& table, const Tensor& ids, const Tensor& y) override;
  Status rms_norm(const Tensor& x, const Tensor* weight, float eps, int64_t width,
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

  Status sparse_attention(const Tensor& q, const Tensor& kv_a, const Tensor& kv_b,
                          const Tensor& idx, const Tensor& sink, float scale,
                          const Tensor& out) override;
  Result<int64_t> compress(const Tensor& kv, const Tensor& score, const Tensor& ape,
                           int64_t first_pos, int ratio, bool overlap, const Tensor& state_kv,
                           const Tensor& state_score, const Tensor& entries) override;
  Status indexer_scores(const Tensor& q, const Tensor& w, const Tensor& keys,
                        const Tensor& visible, const Tensor& scores) override;
  Status top_k(const Tensor& scores, const Tensor& visible, int k, int32_t offset,
               const Tensor& idx) override;
  Status hadamard(const Tensor& x, int64_t width) override;
  Status round_fp8_blocks(const Tensor& x, int64_t cols, int64_t block) override;
  Status round_fp4_blocks(const Tensor& x, int64_t block) override;

  Status route(const Tensor& logits, const Tensor* bias, const Tensor* tid2eid,
               const Tensor& tokens, int k, float route_scale, const Tensor& experts,
               const Tensor& weights) override;
  Status moe_experts(const Tensor& x, const Tensor& gate, const Tensor& up, const Tensor& down,
                     const Tensor& experts, const Tensor& weights, float limit, MatmulMode mode,
                     const Tensor& y) override;
  Status swiglu_expert(const Tensor& x, const Tensor& gate, const Tensor& up, const Tensor& down,
                       float limit, MatmulMode mode, const Tensor& y) override;

 private:
  std::unique_ptr<ThreadPool> pool_;
};

}  // namespace dsv4::backend
