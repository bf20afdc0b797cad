// The CUDA backend: every Backend operation on one Hopper GPU (sm_90a), all of a step's
// work enqueued on one stream (and a second for the step's side lane, Backend::fork_lane)
// with no host synchronisation until a download. Weights are
// uploaded once at load; caches and scratch live in device memory.
//
// Numerics (MatmulMode, backend.h):
//   Exact      weights decoded exactly, fp32 activations and accumulation: the GPU test
//              mode, per-row relative L2 against the CPU backend <= 1e-5.
//   Quantized  the production path: 1-16 activation rows through the integer matvec
//              kernels (matvec.h, Q8 activations), more rows through BF16 tensor-core GEMMs
//              (gemm_prefill.h), routed experts through moe_experts.h, attention and indexer
//              scores on bf16 tensor cores (as the reference's kernels round). Every op's
//              bound is in docs/CUDA.md.
// Everything else (norms, mHC, RoPE, compressors, routing) computes in fp32 in both modes.
//
// Files: cuda_backend.cu (memory, steps, dense and token-wise ops), cuda_attention.cu
// (attention, window ring, compressors, entries, indexer, top-k), cuda_moe.cu (routing,
// experts), cuda_timing.cu (events for benchmarks). Kernels beside them; CPU references are the CpuBackend.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace dsv4::backend {

struct CudaBackendOptions {
  int device = 0;
  // First scratch chunk; scratch grows by further chunks between steps when a step needed
  // more (a graph capture needs the arena already grown: run the step once first).
  size_t scratch_bytes = kDefaultDeviceScratchBytes;
  // Batch-invariant decode kernels (cuda::KernelChoice::batch_invariant, matvec.h): in steps
  // of up to 64 rows a row's logits are the same bits whatever else the step holds (other
  // sequences, or MTP speculation's verify rows), at some speed (docs/PERFORMANCE.md). The
  // kernel choice is process-wide: set here, it holds for every backend of the process.
  bool batch_invariant = false;
  // Backend lanes on a second stream (fork_lane / join_lane): a layer's KV path and
  // compressors beside its query path, the shared expert beside the routed ones. Off: every
  // op on one stream (the same bits; for measuring what the lanes gain).
  bool lanes = true;
  // A hyper-connection site's mix product and hc_pre_norm in one launch for decode rows
  // (CudaBackend::hc_pre_norm_from_fn: a cluster of 16 blocks per row). Off: the two kernels
  // (the same bits; for measuring what the fusion gains). DSV4_CUDA_HC_CLUSTER=0 for dsv4.
  bool hc_cluster = true;
  // Tests: a kernel that spins this many microseconds at every fork, on the side lane (a
  // missing join shows as the main lane reading results not yet written) or, with
  // lane_delay_main, on the main lane (a side lane reading main-lane work it did not wait for).
  int lane_delay_us = 0;
  bool lane_delay_main = false;
  // Called during weight upload with (bytes done, bytes total); empty: quiet.
  std::function<void(uint64_t, uint64_t)> on_upload_progress;
};

struct DeviceMemory {
  uint64_t free_bytes = 0;
  uint64_t total_bytes = 0;
  uint64_t weights_bytes = 0;  // uploaded by weight()
  uint64_t cache_bytes = 0;    // alloc() + reserve() (caches, tables, small weights)
  uint64_t scratch_bytes = 0;  // the step arena's chunks
};

class CudaBackend final : public Backend {
 public:
  static Result<std::unique_ptr<CudaBackend>> create(const CudaBackendOptions& options = {});
  ~CudaBackend() override;

  std::string name() const override { return "cuda"; }
  cudaStream_t stream() const;  // the current lane's
  DeviceMemory memory() const;
  DeviceMemoryState device_memory() const override;  // free bytes, scratch + workspace held
  // Waits for everything enqueued so far (downloads do this themselves).
  Status synchronize() override;

  Result<Tensor> alloc(GgmlType type, std::span<const int64_t> shape) override;
  Result<Tensor> reserve(GgmlType type, std::span<const int64_t> shape) override;
  Result<Tensor> weight(const gguf::TensorInfo& info) override;
  Status upload(const Tensor& dst, const void* host, size_t bytes) override;
  Status download(const Tensor& src, void* host, size_t bytes) override;
  Status copy_rows(const Tensor& src, const Tensor& dst) override;
  Status fill(const Tensor& t, float value) override;
  void begin_step() override;
  Result<Tensor> scratch(GgmlType type, std::span<const int64_t> shape) override;
  ScratchMark scratch_mark() const override;
  void scratch_release(ScratchMark mark) override;
  Status fork_lane(int lane) override;
  Status main_lane() override;
  Status join_lane(int lane) override;

  Status matmul(const Tensor& w, const Tensor& x, const Tensor& y, MatmulMode mode) override;
  Status matmul_grouped(const Tensor& w, const Tensor& x, const Tensor& y, int64_t groups, MatmulMode mode) override;
  Status matmul_many(std::span<const Tensor* const> ws, const Tensor& x, std::span<const Tensor* const> ys,
                     MatmulMode mode) override;
  Status get_rows(const Tensor& table, const Tensor& ids, const Tensor& y) override;
  Status rms_norm(const Tensor& x, const Tensor* weight, float eps, int64_t width,
                  const Tensor& y) override;
  Status rope(const Tensor& x, int64_t head_dim, const Tensor& positions, const RopeParams& p,
              bool inverse) override;
  Status finish_rows(const Tensor& x, const Tensor& positions, const RowFinish& f) override;
  Status add(const Tensor& x, const Tensor& y) override;
  Status scale(const Tensor& x, float factor) override;

  Status hc_pre(const Tensor& streams, const Tensor& mixes, const Tensor& scale,
                const Tensor& base, int n_hc, int sinkhorn_iters, float hc_eps, float norm_eps,
                const Tensor& x, const Tensor& post, const Tensor& comb) override;
  Status hc_pre_norm(const Tensor& streams, const Tensor& mixes, const Tensor& scale, const Tensor& base, int n_hc,
                     int sinkhorn_iters, float hc_eps, float norm_eps, const Tensor& norm_weight, const Tensor& x,
                     const Tensor& post, const Tensor& comb, const Tensor& normed) override;
  // V4's geometry (4 streams of 4096, F32 mix weights), Float32 mode, 1..hc_cluster_max_rows()
  // rows and hc_cluster on: one launch, the bits of matmul + hc_pre_norm; otherwise those calls.
  Status hc_pre_norm_from_fn(const Tensor& fn, const Tensor& streams, MatmulMode mode, const Tensor& scale,
                             const Tensor& base, int n_hc, int sinkhorn_iters, float hc_eps, float norm_eps,
                             const Tensor& norm_weight, const Tensor& x, const Tensor& post, const Tensor& comb,
                             const Tensor& normed) override;
  static constexpr int64_t hc_cluster_max_rows() { return 64; }
  // Whether that launch runs: options.hc_cluster and the device schedules its clusters.
  bool hc_cluster_active() const;
  Status hc_post(const Tensor& y, const Tensor& post, const Tensor& comb, int n_hc,
                 const Tensor& streams) override;
  Status hc_head(const Tensor& streams, const Tensor& mixes, const Tensor& scale,
                 const Tensor& base, int n_hc, float hc_eps, float norm_eps,
                 const Tensor& x) override;

  // cuda_attention.cu
  Status attention(const Tensor& q, const AttentionKeys& keys, const StepRows& rows,
                   const Tensor& sink, float scale, const Tensor& out, MatmulMode mode) override;
  Status store_window(const Tensor& kv, const StepRows& rows, int64_t window,
                      const SlotRows& ring) override;
  Status compress(const Tensor& kv, const Tensor& score, const Tensor& ape, int ratio, bool overlap,
                  const StepRows& rows, const SlotRows& state_kv, const SlotRows& state_score,
                  const Tensor& pooled) override;
  Status compress_entries(const Tensor& kv, const Tensor& score, const Tensor& ape, int ratio, bool overlap,
                          const StepRows& rows, const SlotRows& state_kv, const SlotRows& state_score,
                          const RowFinish& finish, const PagedRows& dst) override;
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

  // cuda_moe.cu
  Status route(const Tensor& logits, const Tensor* bias, const Tensor* tid2eid,
               const Tensor& tokens, int k, float route_scale, const Tensor& experts,
               const Tensor& weights) override;
  Status moe_experts(const Tensor& x, const Tensor& gate, const Tensor& up, const Tensor& down,
                     const Tensor& experts, const Tensor& weights, float limit, MatmulMode mode,
                     const Tensor& y) override;
  Status swiglu_expert(const Tensor& x, const Tensor& gate, const Tensor& up, const Tensor& down,
                       float limit, MatmulMode mode, const Tensor& y) override;

  // cuda_steer.cu
  Status steer(const Tensor& x, const Tensor& dir, int64_t group, bool project, const Tensor& alpha) override;

  // cuda_sample.cu
  Status sample(const Tensor& logits, const Tensor& params, const Tensor* adjust,
                const Tensor& out) override;

  // cuda_graph.cu: decode steps recorded once per batch bucket and replayed.
  bool supports_graphs() const override { return true; }
  Status begin_capture() override;
  Status end_capture(int64_t id) override;
  Status replay(int64_t id) override;

  // cuda_timing.cu: CUDA events on the backend's stream.
  Result<TimePoint> time_point() override;
  Result<double> elapsed_ms(const TimePoint& begin, const TimePoint& end) override;

  struct Impl;  // stream, handles, arena, staging buffers, counters (cuda_backend_impl.cuh)

 private:
  explicit CudaBackend(std::unique_ptr<Impl> impl);
  // hc_pre, and hc_pre_norm when norm_weight is given.
  Status hc_pre_launch(const Tensor& streams, const Tensor& mixes, const Tensor& scale, const Tensor& base, int n_hc,
                       int sinkhorn_iters, float hc_eps, float norm_eps, const Tensor* norm_weight, const Tensor& x,
                       const Tensor& post, const Tensor& comb, const Tensor* normed);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsv4::backend
