// The attention-side step operations of the CUDA backend on raw device pointers (the
// CudaBackend methods in cuda_attention.cu validate tensors and call these): attention with
// a sink over window and compressed keys, the window ring update, the streaming compressor,
// block positions, entry storage, lightning-indexer scores and top-k. Semantics are the
// CpuBackend's (backend.h, cpu_backend.cpp); kernels in attention_kernels.cuh,
// attention_mma.cuh and top_k_kernel.cuh; design and bounds in docs/CUDA.md, "Attention".
//
// Every function only enqueues work on `stream`: no host synchronisation, no allocation
// (attention's split partials live in a caller-provided workspace), so a step can be
// captured into a CUDA graph once it has run once. Step metadata (positions, row_seq,
// seqs) stays on the device; what the host checks is shapes, alignment and launch limits.
// Metadata the CPU backend would reject row by row (a slot outside the ring or states, a
// selected entry that is not visible, a missing page) cannot be checked without the host:
// the kernels never read or write outside the buffers they were given, and the affected
// outputs become NaN (attention rows, pooled rows, scores) or are skipped (cache writes).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "util/status.h"

namespace dsv4::cuda {

namespace finish {
struct Spec;  // row_finish.cuh
}

// The arithmetic of attention and indexer scores (CudaBackend: Fast in the Quantized
// MatmulMode, Exact otherwise). Exact: fp32 SIMT products, the test mode (<= 1e-5 against
// the CPU). Fast: BF16 tensor-core tiles (mma.sync) with fp32 accumulation and softmax, the
// reference kernel's own rounding (q, k, p in bf16); bound in docs/CUDA.md.
enum class AttentionPrecision : int { Exact = 0, Fast = 1 };

// Queries the device and raises the shared-memory caps of every kernel here (what their
// first launch would otherwise do). Call once before a graph capture may see their first
// launch (CudaBackend::create); idempotent.
Status prepare_attention_kernels();

// Fields per sequence of StepMeta::seqs (backend::kSeqFields): first row, rows, first
// position, slot, window start.
constexpr int kStepSeqFields = 5;

// backend::StepRows on the device.
struct StepMeta {
  int64_t n = 0;              // rows
  int64_t n_seqs = 0;
  int64_t max_end = 0;        // host bound on (last position + 1)
  const int32_t* positions = nullptr;  // [n]
  const int32_t* row_seq = nullptr;    // [n], -1 = padding
  const int32_t* seqs = nullptr;       // [n_seqs][kStepSeqFields]
};

// An F32 matrix on the device: rows `ld` elements apart.
struct DeviceRows {
  float* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t ld = 0;
};

// backend::PagedRows on the device.
struct DevicePaged {
  DeviceRows pool;                     // [pages * page_rows, width]
  const int32_t* page_table = nullptr; // [slots][table_ld], -1 = no page
  int64_t slots = 0;
  int64_t max_pages = 0;
  int64_t table_ld = 0;
  int64_t page_rows = 0;
  const int32_t* first_row = nullptr;  // [slots]: rows below it do not exist (grafts); null: 0
};

struct AttentionArgs {
  const float* q = nullptr;      // [n][q_ld]: heads * d used
  int64_t q_ld = 0;
  int heads = 0;
  int d = 0;
  DeviceRows chunk;              // this step's kv rows [n, d]
  DeviceRows ring;               // [slots * ring_rows, d], position p at row p mod ring_rows
  int64_t window = 0;
  int64_t ring_rows = 0;         // rows per slot, >= window; 0: window
  int ratio = 0;                 // 0: window only
  DevicePaged entries;           // width d
  const int32_t* selected = nullptr;  // [n][selected_ld] (top entries used), or null: all visible
  int64_t selected_ld = 0;
  int top = 0;
  const float* sink = nullptr;   // [heads]
  float scale = 1;
  float* out = nullptr;          // [n][out_ld]
  int64_t out_ld = 0;
};

// How attention splits its work for a step (exposed for the benchmark and tests).
struct AttentionPlan {
  bool tensor_cores = false;
  int heads_per_block = 0;
  int head_groups = 0;
  int splits = 1;           // key ranges per row (flash-decoding), combined by a second pass
  int tiles_per_split = 0;  // key tiles per block
  int64_t max_keys = 0;     // window + compressed keys of the longest row
  size_t workspace_bytes = 0;
};

Status plan_attention(const AttentionArgs& a, const StepMeta& m, AttentionPrecision precision, AttentionPlan* plan);
Status attention(const AttentionArgs& a, const StepMeta& m, const AttentionPlan& plan, void* workspace,
                 size_t workspace_bytes, cudaStream_t stream);

// Each sequence's last min(rows, window) rows of kv into its ring at position mod ring_rows
// (rows per slot, >= window; 0: window).
Status store_window(const DeviceRows& kv, const StepMeta& m, int64_t window, const DeviceRows& ring,
                    cudaStream_t stream, int64_t ring_rows = 0);

struct CompressArgs {
  DeviceRows kv;         // [n, overlap*w]
  DeviceRows score;      // [n, overlap*w], without APE
  DeviceRows ape;        // [ratio, overlap*w]
  int ratio = 0;
  bool overlap = false;
  DeviceRows state_kv;     // [slots * state_rows, overlap*w]: position p at row p mod state_rows
  DeviceRows state_score;  // same
  int64_t state_rows = 0;  // rows per slot, >= overlap*ratio; 0: overlap*ratio
  DeviceRows pooled;       // [n, w]
};
Status compress(const CompressArgs& a, const StepMeta& m, cudaStream_t stream);
// compress, then each closing row's entry through f (RoPE at the block's first position) into
// its page of dst, without the pooled rows in memory (Backend::compress_entries). a.pooled
// is not read; the entries are f.group wide.
Status compress_entries(const CompressArgs& a, const StepMeta& m, const finish::Spec& f, const DevicePaged& dst,
                        cudaStream_t stream);

Status block_positions(const StepMeta& m, int ratio, int32_t* out, cudaStream_t stream);

Status store_entries(const DeviceRows& pooled, int ratio, const StepMeta& m, const DevicePaged& dst,
                     cudaStream_t stream);

struct IndexerArgs {
  const float* q = nullptr;  // [n][q_ld]: heads * dk
  int64_t q_ld = 0;
  const float* w = nullptr;  // [n][w_ld]: heads
  int64_t w_ld = 0;
  int heads = 0;
  int dk = 0;
  DevicePaged keys;          // width dk
  int ratio = 0;
  DeviceRows scores;         // [n, cols]
};
// Scores of entries below a slot's first row (grafts: keys.first_row) are -inf.
Status indexer_scores(const IndexerArgs& a, const StepMeta& m, AttentionPrecision precision, cudaStream_t stream);

// idx [n][idx_ld], the first k columns written: the top-k of each row's visible scores in
// ascending order, less the entries whose score is -inf (absent: grafts), then -1. Long rows are selected in two phases whose
// candidates need top_k_workspace_bytes (0 for short rows).
size_t top_k_workspace_bytes(const DeviceRows& scores, int ratio, const StepMeta& m, int k);
Status top_k(const DeviceRows& scores, int ratio, const StepMeta& m, int k, int32_t* idx, int64_t idx_ld,
             void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace dsv4::cuda
