// Host side of the attention-side step operations: argument checks, work plans, launches.
#include "backend/cuda/attention_ops.h"

#include <algorithm>
#include <climits>
#include <map>
#include <mutex>

#include "backend/cuda/attention_kernels.cuh"
#include "backend/cuda/attention_mma.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/dependent_launch.cuh"
#include "backend/cuda/matvec.h"
#include "backend/cuda/mmq.h"
#include "backend/cuda/top_k_kernel.cuh"

namespace dsv4::cuda {

namespace {

struct DeviceLimits {
  int device = 0;
  int sms = 0;
  int smem_per_block = 0;  // opt-in maximum of dynamic shared memory per block
  int smem_per_sm = 0;
};

// Queried once per device (no stream work: safe while a graph is being captured).
Result<DeviceLimits> device_limits() {
  static std::mutex mu;
  static std::map<int, DeviceLimits> cache;
  int dev = 0;
  DSV4_CUDA_TRY(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find(dev); it != cache.end()) return it->second;
  DeviceLimits l;
  l.device = dev;
  DSV4_CUDA_TRY(cudaDeviceGetAttribute(&l.sms, cudaDevAttrMultiProcessorCount, dev));
  DSV4_CUDA_TRY(cudaDeviceGetAttribute(&l.smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  DSV4_CUDA_TRY(cudaDeviceGetAttribute(&l.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
  cache[dev] = l;
  return l;
}

// Lifts a kernel's dynamic shared memory cap to the device maximum, once per kernel and
// device (the first launch; no stream work).
template <typename Kernel>
Status allow_smem(Kernel* kernel, const DeviceLimits& l) {
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, bool> done;
  const auto key = std::make_pair(l.device, reinterpret_cast<const void*>(kernel));
  std::lock_guard<std::mutex> lock(mu);
  if (done.count(key)) return Status::ok();
  cudaFuncAttributes attr{};
  cudaError_t err = cudaFuncGetAttributes(&attr, kernel);
  if (err == cudaSuccess)  // the cap covers dynamic memory only: the static part comes off the limit
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               l.smem_per_block - static_cast<int>(attr.sharedSizeBytes));
  if (err != cudaSuccess) {
    cudaGetLastError();  // not left behind for the next launch check
    return cuda_status(err, "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)", __FILE__, __LINE__);
  }
  done[key] = true;
  return Status::ok();
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
size_t align256(size_t n) { return (n + 255) & ~size_t{255}; }
bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

Status check_meta(const StepMeta& m, const char* op) {
  if (m.n < 0 || m.n > INT_MAX || m.n_seqs < 0 || m.n_seqs > 65535)
    return Status::errorf("{}: {} rows, {} sequences (limits {} and 65535)", op, m.n, m.n_seqs, INT_MAX);
  if (m.n > 0 && (!m.positions || !m.row_seq)) return Status::errorf("{}: step positions/row_seq missing", op);
  if (m.n_seqs > 0 && !m.seqs) return Status::errorf("{}: step sequences missing", op);
  return Status::ok();
}

// An F32 matrix the kernels read with 16-byte copies.
Status check_rows(const DeviceRows& t, const char* op, const char* arg, int64_t cols, bool vector_rows) {
  if (!t.data || t.rows < 0 || t.ld < t.cols) return Status::errorf("{}: {} is empty or malformed", op, arg);
  if (cols >= 0 && t.cols != cols) return Status::errorf("{}: {} has {} columns, expected {}", op, arg, t.cols, cols);
  if (vector_rows && (!aligned16(t.data) || t.ld % 4))
    return Status::errorf("{}: {} rows must start at 16-byte boundaries (row stride {} elements)", op, arg, t.ld);
  return Status::ok();
}

Status check_paged(const DevicePaged& p, const char* op, int64_t width) {
  DSV4_TRY(check_rows(p.pool, op, "paged pool", width, true));
  if (!p.page_table || p.page_rows <= 0 || p.slots < 0 || p.max_pages < 0 || p.table_ld < p.max_pages)
    return Status::errorf("{}: page table of {} slots x {} pages ({} rows per page) is malformed", op, p.slots,
                          p.max_pages, p.page_rows);
  return Status::ok();
}

}  // namespace


Status prepare_attention_kernels() {
  DSV4_ASSIGN_OR_RETURN(const DeviceLimits lim, device_limits());
  DSV4_TRY(allow_smem(attn::attention_exact_kernel<1>, lim));
  DSV4_TRY(allow_smem(attn::attention_exact_kernel<2>, lim));
  DSV4_TRY(allow_smem(attn::attention_exact_kernel<3>, lim));
  DSV4_TRY(allow_smem(attn::attention_exact_kernel<4>, lim));
  DSV4_TRY(allow_smem(attn::attention_mma_kernel<256>, lim));
  DSV4_TRY(allow_smem(attn::attention_mma_kernel<512>, lim));
  DSV4_TRY(allow_smem(attn::indexer_exact_kernel, lim));
  DSV4_TRY(allow_smem(attn::indexer_mma_kernel<128>, lim));
  DSV4_TRY(allow_smem(attn::top_k_kernel<256>, lim));
  DSV4_TRY(allow_smem(attn::top_k_kernel<1024>, lim));
  DSV4_TRY(allow_smem(attn::top_k_chunk_kernel<1024>, lim));
  return Status::ok();
}

// ---- attention ------------------------------------------------------------------------------

Status plan_attention(const AttentionArgs& a, const StepMeta& m, AttentionPrecision precision, AttentionPlan* plan) {
  if (a.heads <= 0 || a.d <= 0 || a.d % 128 || a.d > 512)
    return Status::errorf("attention: {} heads of width {} (width must be 128, 256, 384 or 512)", a.heads, a.d);
  if (a.window < 0 || a.ratio < 0 || (a.selected && a.top < 0) || (a.ring_rows != 0 && a.ring_rows < a.window))
    return Status::errorf("attention: window {} (ring rows {}), ratio {}, top {}", a.window, a.ring_rows, a.ratio, a.top);
  DSV4_TRY(check_meta(m, "attention"));
  DSV4_ASSIGN_OR_RETURN(const DeviceLimits lim, device_limits());
  AttentionPlan p;
  p.tensor_cores = precision == AttentionPrecision::Fast && (a.d == 256 || a.d == 512);
  // Batch-invariant mode (matvec.h's KernelChoice), steps of decode size: the split of a
  // row's keys must not depend on the rows beside it, so every key tile is a split of its
  // own (a row's empty splits weigh nothing in the combine: the same bits as without them).
  const KernelChoice choice = kernel_choice();
  const bool invariant = choice.batch_invariant && m.n <= kMmaMaxRows;
  // Steps of up to kRowKernelMaxRows rows (matvec.h: one sequence's decode and its MTP verify
  // rows, a few sequences) split by the keys alone: every key tile a split of its own up to
  // kRowLocalMaxSplits tiles (2048 keys on the tensor cores, so every CSA layer and HCA layers
  // to ~245K positions), so a row's bits depend neither on the step's other rows nor on its
  // max_end; past that, splits of equal tiles fixed by max_end (the same in every step a
  // graph records for the cache's longest context). The partials stay below ~67 MB.
  constexpr int64_t kRowLocalMaxSplits = 64;
  const bool row_local = !invariant && choice.matvec_rows && m.n <= kRowKernelMaxRows;
  p.max_keys = a.window + (a.ratio > 0 ? (a.selected ? a.top : m.max_end / a.ratio) : 0);
  const int tile = p.tensor_cores ? attn::kMmaKeyTile : attn::kKeyTile;
  const int64_t tiles_max = ceil_div(p.max_keys, tile);
  size_t smem = 0;
  int threads = 0;
  if (p.tensor_cores) {
    // Fewer heads per block (multiples of the mma tile's 16) while the rows' key tiles leave
    // multiprocessors idle: a decode row's 64 heads had 4-20 blocks, each converting all 64
    // query heads before its first tile. A head's arithmetic does not depend on its block.
    p.heads_per_block = std::min(64, (a.heads + 15) / 16 * 16);
    while (!invariant && p.heads_per_block > 16 && m.n * ceil_div(a.heads, p.heads_per_block) * tiles_max < lim.sms)
      p.heads_per_block = std::max(16, p.heads_per_block / 2 / 16 * 16);
    smem = attn::mma_attention_smem(p.heads_per_block, a.d);
    threads = attn::kMmaThreads;
  } else {
    // Fewer heads per block only when even one key tile per block leaves multiprocessors idle.
    p.heads_per_block = std::min(64, (a.heads + 7) / 8 * 8);
    while (!invariant && p.heads_per_block > 16 && m.n * ceil_div(a.heads, p.heads_per_block) * tiles_max < lim.sms)
      p.heads_per_block /= 2;
    smem = attn::exact_attention_smem(p.heads_per_block, a.d);
    threads = p.heads_per_block * 4;
  }
  if (smem > static_cast<size_t>(lim.smem_per_block))
    return Status::errorf("attention: {} bytes of shared memory per block, the device allows {}", smem, lim.smem_per_block);
  p.head_groups = static_cast<int>(ceil_div(a.heads, p.heads_per_block));
  if (p.head_groups > 65535) return Status::errorf("attention: {} heads exceed the launch limit", a.heads);
  // Key splits (flash-decoding) while the rows' blocks leave resident slots free, never
  // more blocks than one wave holds (a second, partial wave would cost a whole one).
  const int64_t per_sm = std::max<int64_t>(
      1, std::min<int64_t>(lim.smem_per_sm / static_cast<int64_t>(smem + 1024), 65536 / (threads * 224)));
  const int64_t capacity = lim.sms * per_sm, blocks = m.n * p.head_groups;
  int64_t splits = 1;
  if (blocks > 0 && 2 * blocks <= capacity && tiles_max > 1) splits = std::min(tiles_max, capacity / blocks);
  if (invariant) splits = std::min<int64_t>(tiles_max, attn::kCombineMaxSplits);
  if (row_local) splits = std::min<int64_t>(tiles_max, kRowLocalMaxSplits);
  p.tiles_per_split = static_cast<int>(std::max<int64_t>(1, ceil_div(tiles_max, splits)));
  p.splits = static_cast<int>(std::max<int64_t>(1, ceil_div(tiles_max, p.tiles_per_split)));
  if (p.splits > attn::kCombineMaxSplits) return Status::errorf("attention: {} splits (limit {})", p.splits, attn::kCombineMaxSplits);
  if (p.splits > 1)
    p.workspace_bytes = align256(static_cast<size_t>(m.n) * p.splits * a.heads * a.d * sizeof(float)) +
                        align256(static_cast<size_t>(m.n) * p.splits * a.heads * 2 * sizeof(float));
  *plan = p;
  return Status::ok();
}

Status attention(const AttentionArgs& a, const StepMeta& m, const AttentionPlan& plan, void* workspace,
                 size_t workspace_bytes, cudaStream_t stream) {
  DSV4_TRY(check_meta(m, "attention"));
  if (m.n == 0) return Status::ok();
  if (!a.q || !aligned16(a.q) || a.q_ld % 4 || a.q_ld < int64_t{a.heads} * a.d)
    return Status::errorf("attention: q rows of {} elements for {} heads x {} (16-byte aligned rows needed)", a.q_ld,
                          a.heads, a.d);
  if (!a.out || !aligned16(a.out) || a.out_ld % 4 || a.out_ld < int64_t{a.heads} * a.d)
    return Status::errorf("attention: out rows of {} elements for {} heads x {} (16-byte aligned rows needed)", a.out_ld,
                          a.heads, a.d);
  if (!a.sink) return Status::errorf("attention: sink missing");
  DSV4_TRY(check_rows(a.chunk, "attention", "chunk", a.d, true));
  if (a.window > 0) DSV4_TRY(check_rows(a.ring, "attention", "ring", a.d, true));
  if (a.ratio > 0) DSV4_TRY(check_paged(a.entries, "attention", a.d));
  if (a.ratio > 0 && a.selected && a.selected_ld < a.top)
    return Status::errorf("attention: selected rows of {} for top {}", a.selected_ld, a.top);
  if (plan.workspace_bytes > workspace_bytes || (plan.workspace_bytes && !workspace))
    return Status::errorf("attention: workspace of {} bytes, the plan needs {}", workspace_bytes, plan.workspace_bytes);
  DSV4_ASSIGN_OR_RETURN(const DeviceLimits lim, device_limits());

  attn::AttentionKernelArgs k;
  k.a = a;
  if (a.ratio <= 0) k.a.selected = nullptr;
  k.m = m;
  k.heads_per_block = plan.heads_per_block;
  k.splits = plan.splits;
  k.tiles_per_split = plan.tiles_per_split;
  k.max_keys = plan.max_keys;
  if (plan.splits > 1) {
    k.part_o = static_cast<float*>(workspace);
    k.part_ml = reinterpret_cast<float*>(static_cast<char*>(workspace) +
                                         align256(static_cast<size_t>(m.n) * plan.splits * a.heads * a.d * sizeof(float)));
  }
  const dim3 grid(static_cast<unsigned>(m.n), static_cast<unsigned>(plan.head_groups), static_cast<unsigned>(plan.splits));
  if (plan.tensor_cores) {
    const size_t smem = attn::mma_attention_smem(plan.heads_per_block, a.d);
    if (a.d == 512) {
      DSV4_TRY(allow_smem(attn::attention_mma_kernel<512>, lim));
      cuda::launch_dependent(attn::attention_mma_kernel<512>, grid, attn::kMmaThreads, smem, stream, k);
    } else {
      DSV4_TRY(allow_smem(attn::attention_mma_kernel<256>, lim));
      cuda::launch_dependent(attn::attention_mma_kernel<256>, grid, attn::kMmaThreads, smem, stream, k);
    }
  } else {
    const size_t smem = attn::exact_attention_smem(plan.heads_per_block, a.d);
    const int threads = plan.heads_per_block * 4;
    switch (a.d / 128) {
      case 1:
        DSV4_TRY(allow_smem(attn::attention_exact_kernel<1>, lim));
        cuda::launch_dependent(attn::attention_exact_kernel<1>, grid, threads, smem, stream, k);
        break;
      case 2:
        DSV4_TRY(allow_smem(attn::attention_exact_kernel<2>, lim));
        cuda::launch_dependent(attn::attention_exact_kernel<2>, grid, threads, smem, stream, k);
        break;
      case 3:
        DSV4_TRY(allow_smem(attn::attention_exact_kernel<3>, lim));
        cuda::launch_dependent(attn::attention_exact_kernel<3>, grid, threads, smem, stream, k);
        break;
      default:
        DSV4_TRY(allow_smem(attn::attention_exact_kernel<4>, lim));
        cuda::launch_dependent(attn::attention_exact_kernel<4>, grid, threads, smem, stream, k);
        break;
    }
  }
  DSV4_CUDA_TRY_LAUNCH();
  if (plan.splits > 1) {
    cuda::launch_dependent(attn::attention_combine_kernel,
                           dim3(static_cast<unsigned>(m.n), static_cast<unsigned>(a.heads)), a.d / 4, 0, stream, k);
    DSV4_CUDA_TRY_LAUNCH();
  }
  return Status::ok();
}

// ---- window, compressor, entries -----------------------------------------------------------

Status store_window(const DeviceRows& kv, const StepMeta& m, int64_t window, const DeviceRows& ring,
                    cudaStream_t stream, int64_t ring_rows) {
  DSV4_TRY(check_meta(m, "store_window"));
  if (ring_rows == 0) ring_rows = window;
  if (ring_rows < window) return Status::errorf("store_window: {} ring rows per slot for a window of {}", ring_rows, window);
  if (window <= 0 || m.n == 0 || m.n_seqs == 0) return Status::ok();
  DSV4_TRY(check_rows(kv, "store_window", "kv", -1, false));
  DSV4_TRY(check_rows(ring, "store_window", "ring", kv.cols, false));
  const int64_t last_rows = std::min(window, m.n);  // a sequence has at most n rows
  cuda::launch_dependent(attn::store_window_kernel,
                         dim3(static_cast<unsigned>(last_rows), static_cast<unsigned>(m.n_seqs)), 128, 0, stream, kv, m,
                         ring_rows, ring);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

namespace {

// compress's checks of its arguments for pooled rows `w` wide; the state rows per slot.
Result<int64_t> check_compress(const CompressArgs& a, const StepMeta& m, int64_t w, const char* op) {
  DSV4_TRY(check_meta(m, op));
  if (a.ratio <= 0 || a.ratio > 65535) return Status::errorf("{}: ratio {} (limit 65535)", op, a.ratio);
  const int o = a.overlap ? 2 : 1;
  DSV4_TRY(check_rows(a.kv, op, "kv", o * w, false));
  DSV4_TRY(check_rows(a.score, op, "score", o * w, false));
  DSV4_TRY(check_rows(a.ape, op, "ape", o * w, false));
  DSV4_TRY(check_rows(a.state_kv, op, "state_kv", o * w, false));
  DSV4_TRY(check_rows(a.state_score, op, "state_score", o * w, false));
  if (a.ape.rows < a.ratio) return Status::errorf("{}: ape has {} rows for ratio {}", op, a.ape.rows, a.ratio);
  const int64_t state_rows = a.state_rows ? a.state_rows : int64_t{o} * a.ratio;
  if (state_rows < int64_t{o} * a.ratio || state_rows > 65535)
    return Status::errorf("{}: {} state rows per slot for {} x ratio {} (limit 65535)", op, state_rows, o, a.ratio);
  return state_rows;
}

// The state update after pooling: every pooled entry reads the state as the step found it.
Status launch_compress_state(const attn::CompressKernelArgs& k, const StepMeta& m, cudaStream_t stream) {
  if (m.n_seqs == 0) return Status::ok();
  cuda::launch_dependent(attn::compress_state_kernel,
                         dim3(static_cast<unsigned>(k.a.state_rows), static_cast<unsigned>(m.n_seqs)), 128, 0, stream,
                         k);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

Status check_paged(const DevicePaged& dst, int64_t w, const char* op) {
  DSV4_TRY(check_rows(dst.pool, op, "paged pool", w, false));
  if (!dst.page_table || dst.page_rows <= 0 || dst.table_ld < dst.max_pages)
    return Status::errorf("{}: page table malformed ({} rows per page)", op, dst.page_rows);
  return Status::ok();
}

}  // namespace

Status compress(const CompressArgs& a, const StepMeta& m, cudaStream_t stream) {
  DSV4_TRY(check_rows(a.pooled, "compress", "pooled", -1, false));
  DSV4_ASSIGN_OR_RETURN(const int64_t state_rows, check_compress(a, m, a.pooled.cols, "compress"));
  if (m.n == 0) return Status::ok();
  attn::CompressKernelArgs k{a, m};
  k.a.state_rows = state_rows;
  cuda::launch_dependent(attn::compress_pool_kernel, static_cast<unsigned>(m.n), 128, 0, stream, k);
  DSV4_CUDA_TRY_LAUNCH();
  return launch_compress_state(k, m, stream);
}

Status compress_entries(const CompressArgs& a, const StepMeta& m, const finish::Spec& f, const DevicePaged& dst,
                        cudaStream_t stream) {
  const int64_t w = f.group;
  if (w <= 0 || w > finish::kMaxGroup)
    return Status::errorf("compress_entries: entries of {} values (limit {})", w, finish::kMaxGroup);
  DSV4_ASSIGN_OR_RETURN(const int64_t state_rows, check_compress(a, m, w, "compress_entries"));
  DSV4_TRY(check_paged(dst, w, "compress_entries"));
  if (m.n == 0) return Status::ok();
  attn::CompressEntriesArgs e{{a, m}, f, dst};
  e.k.a.state_rows = state_rows;
  cuda::launch_dependent(attn::compress_entries_kernel, static_cast<unsigned>(m.n), finish::threads_for(w),
                         static_cast<size_t>(w) * sizeof(float), stream, e);
  DSV4_CUDA_TRY_LAUNCH();
  return launch_compress_state(e.k, m, stream);
}

Status block_positions(const StepMeta& m, int ratio, int32_t* out, cudaStream_t stream) {
  DSV4_TRY(check_meta(m, "block_positions"));
  if (ratio <= 0) return Status::errorf("block_positions: ratio {}", ratio);
  if (m.n == 0) return Status::ok();
  if (!out) return Status::errorf("block_positions: out missing");
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(m.n, 256), 4096));
  cuda::launch_dependent(attn::block_positions_kernel, blocks, 256, 0, stream, m.positions, m.n, ratio, out);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

Status store_entries(const DeviceRows& pooled, int ratio, const StepMeta& m, const DevicePaged& dst,
                     cudaStream_t stream) {
  DSV4_TRY(check_meta(m, "store_entries"));
  if (ratio <= 0) return Status::errorf("store_entries: ratio {}", ratio);
  if (m.n == 0) return Status::ok();
  DSV4_TRY(check_rows(pooled, "store_entries", "pooled", -1, false));
  DSV4_TRY(check_paged(dst, pooled.cols, "store_entries"));
  cuda::launch_dependent(attn::store_entries_kernel, static_cast<unsigned>(m.n), 128, 0, stream, pooled, ratio, m, dst);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

// ---- indexer, top-k ---------------------------------------------------------------------------

Status indexer_scores(const IndexerArgs& a, const StepMeta& m, AttentionPrecision precision, cudaStream_t stream) {
  DSV4_TRY(check_meta(m, "indexer_scores"));
  if (a.ratio <= 0) return Status::errorf("indexer_scores: ratio {}", a.ratio);
  if (a.heads <= 0 || a.dk <= 0 || a.dk % 8)
    return Status::errorf("indexer_scores: {} heads of width {} (width must be a multiple of 8)", a.heads, a.dk);
  if (m.n == 0) return Status::ok();
  if (!a.q || !aligned16(a.q) || a.q_ld % 4 || a.q_ld < int64_t{a.heads} * a.dk)
    return Status::errorf("indexer_scores: q rows of {} elements for {} heads x {} (16-byte aligned rows needed)",
                          a.q_ld, a.heads, a.dk);
  if (!a.w || a.w_ld < a.heads) return Status::errorf("indexer_scores: weights rows of {} for {} heads", a.w_ld, a.heads);
  DSV4_TRY(check_paged(a.keys, "indexer_scores", a.dk));
  DSV4_TRY(check_rows(a.scores, "indexer_scores", "scores", -1, false));
  if (a.scores.cols <= 0) return Status::ok();
  DSV4_ASSIGN_OR_RETURN(const DeviceLimits lim, device_limits());
  const bool tc = precision == AttentionPrecision::Fast && a.dk == 128 && a.heads <= 64;
  attn::IndexerKernelArgs k{a, m, 1, 0};
  k.heads_padded = tc ? (a.heads + 15) / 16 * 16 : (a.heads + 63) / 64 * 64;
  const size_t smem = tc ? attn::mma_indexer_smem(k.heads_padded, a.dk) : attn::exact_indexer_smem(k.heads_padded, a.dk);
  if (smem > static_cast<size_t>(lim.smem_per_block))
    return Status::errorf("indexer_scores: {} heads x {} need {} bytes of shared memory, the device allows {}", a.heads,
                          a.dk, smem, lim.smem_per_block);
  const int64_t col_tiles = ceil_div(a.scores.cols, attn::kIndexTile);
  k.tiles_per_block = static_cast<int>(std::clamp<int64_t>(m.n * col_tiles / (8 * lim.sms), 1, 8));
  k.tiles_per_block = static_cast<int>(std::max<int64_t>(k.tiles_per_block, ceil_div(col_tiles, 65535)));
  const dim3 grid(static_cast<unsigned>(m.n), static_cast<unsigned>(ceil_div(col_tiles, k.tiles_per_block)));
  if (tc) {
    DSV4_TRY(allow_smem(attn::indexer_mma_kernel<128>, lim));
    cuda::launch_dependent(attn::indexer_mma_kernel<128>, grid, attn::kMmaIndexThreads, smem, stream, k);
  } else {
    DSV4_TRY(allow_smem(attn::indexer_exact_kernel, lim));
    cuda::launch_dependent(attn::indexer_exact_kernel, grid, attn::kIndexThreads, smem, stream, k);
  }
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

namespace {
// Chunks per row of the two-phase top-k (0: one phase): rows past kTopKTwoPhaseFrom scores,
// chunks of at least kTopKChunk, all candidates of a row staged in the second phase.
struct TopKPlan {
  int64_t v_max = 0;
  int chunks = 0, chunk = 0;
};
TopKPlan plan_top_k(const DeviceRows& scores, int ratio, const StepMeta& m, int k) {
  TopKPlan p;
  p.v_max = ratio > 0 ? std::min<int64_t>(scores.cols, m.max_end / ratio) : 0;
  if (p.v_max > attn::kTopKTwoPhaseFrom && 2 * int64_t{k} <= attn::kTopKStageMax) {
    p.chunks = static_cast<int>(std::min<int64_t>(ceil_div(p.v_max, attn::kTopKChunk), attn::kTopKStageMax / k));
    p.chunk = static_cast<int>(ceil_div(p.v_max, p.chunks));
  }
  return p;
}
}  // namespace

size_t top_k_workspace_bytes(const DeviceRows& scores, int ratio, const StepMeta& m, int k) {
  const TopKPlan p = plan_top_k(scores, ratio, m, k);
  return static_cast<size_t>(m.n) * p.chunks * k * sizeof(int32_t);
}

Status top_k(const DeviceRows& scores, int ratio, const StepMeta& m, int k, int32_t* idx, int64_t idx_ld,
             void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  DSV4_TRY(check_meta(m, "top_k"));
  if (ratio <= 0 || k <= 0) return Status::errorf("top_k: ratio {}, k {}", ratio, k);
  if (m.n == 0) return Status::ok();
  DSV4_TRY(check_rows(scores, "top_k", "scores", -1, false));
  if (scores.cols > INT_MAX / 2) return Status::errorf("top_k: {} scores per row (limit {})", scores.cols, INT_MAX / 2);
  if (!idx || idx_ld < k) return Status::errorf("top_k: idx rows of {} for k {}", idx_ld, k);
  const TopKPlan plan = plan_top_k(scores, ratio, m, k);
  const size_t need = static_cast<size_t>(m.n) * plan.chunks * k * sizeof(int32_t);
  if (need > workspace_bytes || (need && !workspace))
    return Status::errorf("top_k: workspace of {} bytes, {} needed", workspace_bytes, need);
  if (plan.chunks > 65535) return Status::errorf("top_k: {} chunks per row (limit 65535)", plan.chunks);
  DSV4_ASSIGN_OR_RETURN(const DeviceLimits lim, device_limits());
  attn::TopKKernelArgs a{scores, ratio, m, k, idx, idx_ld};
  a.chunks = plan.chunks;
  a.chunk = plan.chunk;
  a.cand = static_cast<int32_t*>(workspace);
  if (plan.chunks > 0) {
    a.stage_cap = std::min(plan.chunk, attn::kTopKStageMax);
    DSV4_TRY(allow_smem(attn::top_k_chunk_kernel<1024>, lim));
    cuda::launch_dependent(attn::top_k_chunk_kernel<1024>,
                           dim3(static_cast<unsigned>(m.n), static_cast<unsigned>(plan.chunks)), 1024,
                           static_cast<size_t>(a.stage_cap) * sizeof(uint32_t), stream, a);
    DSV4_CUDA_TRY_LAUNCH();
    a.stage_cap = plan.chunks * k;
  } else {
    a.stage_cap = static_cast<int>(std::clamp<int64_t>(plan.v_max, 1, attn::kTopKStageMax));
  }
  const size_t smem = static_cast<size_t>(a.stage_cap) * sizeof(uint32_t);
  if (plan.chunks > 0 || plan.v_max > 2048) {
    DSV4_TRY(allow_smem(attn::top_k_kernel<1024>, lim));
    cuda::launch_dependent(attn::top_k_kernel<1024>, static_cast<unsigned>(m.n), 1024, smem, stream, a);
  } else {
    DSV4_TRY(allow_smem(attn::top_k_kernel<256>, lim));
    cuda::launch_dependent(attn::top_k_kernel<256>, static_cast<unsigned>(m.n), 256, smem, stream, a);
  }
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

}  // namespace dsv4::cuda
