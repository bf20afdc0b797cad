// CudaBackend: attention, window ring, compressors, entries, indexer scores and top-k
// (backend.h). Each method checks its tensors on the host as the CpuBackend does (types,
// shapes, layouts), then enqueues the kernels of attention_ops.h on the backend's stream.
// What the CPU checks per row on host memory (slots, pages, selected entries) is guarded on
// the device instead: see attention_ops.h.
#include <string>
#include <vector>

#include "backend/cuda/attention_ops.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_backend_impl.cuh"

namespace dsv4::backend {
namespace {

using cuda::DevicePaged;
using cuda::DeviceRows;
using cuda::StepMeta;

// The production numerics compute attention and indexer scores as the reference's kernels do
// (bf16 operands on the tensor cores, fp32 accumulation); every other mode in fp32.
cuda::AttentionPrecision precision_of(MatmulMode mode) {
  return mode == MatmulMode::Quantized ? cuda::AttentionPrecision::Fast : cuda::AttentionPrecision::Exact;
}

// An F32 (or, for `type`, I32) matrix view: rows of a rank-2 tensor, or of a contiguous one.
Result<DeviceRows> rows_of(const Tensor& t, const char* op, const char* arg, int64_t rows, int64_t cols,
                           GgmlType type = GgmlType::F32) {
  if (!t.valid()) return Status::errorf("{}: argument {} is empty", op, arg);
  if (t.type != type)
    return Status::errorf("{}: argument {} is {}, expected type {}", op, arg, t.describe(), ggml_type_name(type));
  if ((rows >= 0 && t.rows() < rows) || (cols >= 0 && t.cols() != cols))
    return Status::errorf("{}: argument {} is {}, expected [{}, {}]", op, arg, t.describe(), rows, cols);
  if (t.rank < 1 || t.stride[t.rank - 1] != 4 || (t.rank > 2 && !t.contiguous()) || t.row_stride() % 4)
    return Status::errorf("{}: argument {} ({}) needs contiguous elements in rows", op, arg, t.describe());
  return DeviceRows{static_cast<float*>(t.data), t.rows(), t.cols(), t.rank >= 2 ? t.row_stride() / 4 : t.cols()};
}

Result<StepMeta> meta_of(const StepRows& rows, const char* op) {
  for (const Tensor* t : {&rows.positions, &rows.row_seq})
    if (!t->valid() || t->type != GgmlType::I32 || t->n_elements() < rows.n || !t->contiguous())
      return Status::errorf(StatusCode::kInternal, "{}: step rows: positions/row_seq {} for {} rows", op, t->describe(),
                            rows.n);
  if (rows.n_seqs > 0 && (!rows.seqs.valid() || rows.seqs.type != GgmlType::I32 || rows.seqs.rows() < rows.n_seqs ||
                          rows.seqs.cols() != kSeqFields || !rows.seqs.contiguous()))
    return Status::errorf(StatusCode::kInternal, "{}: step rows: seqs {} for {} sequences", op, rows.seqs.describe(),
                          rows.n_seqs);
  return StepMeta{rows.n, rows.n_seqs, rows.max_end, static_cast<const int32_t*>(rows.positions.data),
                  static_cast<const int32_t*>(rows.row_seq.data), static_cast<const int32_t*>(rows.seqs.data)};
}

// A ring of positions (backend.h), checked as every backend checks it.
Result<DeviceRows> ring_of(const SlotRows& r, const char* op, const char* arg, int64_t min_rows, int64_t width) {
  DSV4_TRY(r.check(op, arg, min_rows, width));
  return rows_of(r.data, op, arg, -1, width);
}

Result<DevicePaged> paged_of(const PagedRows& p, const char* op, int64_t width) {
  if (!p.pool.valid() || p.pool.type != GgmlType::F32 || p.pool.cols() != width || p.page_rows <= 0 ||
      !p.page_table.valid() || p.page_table.type != GgmlType::I32)
    return Status::errorf(StatusCode::kInternal, "{}: paged rows: pool {} ({} rows per page), table {}, expected width {}",
                          op, p.pool.describe(), p.page_rows, p.page_table.describe(), width);
  DSV4_ASSIGN_OR_RETURN(const DeviceRows pool, rows_of(p.pool, op, "paged pool", -1, width));
  DSV4_ASSIGN_OR_RETURN(const DeviceRows table, rows_of(p.page_table, op, "page table", -1, -1, GgmlType::I32));
  if (p.first_row.valid() &&
      (p.first_row.type != GgmlType::I32 || p.first_row.n_elements() < table.rows || !p.first_row.contiguous()))
    return Status::errorf(StatusCode::kInternal, "{}: paged rows: first_row {} for {} slots", op, p.first_row.describe(),
                          table.rows);
  return DevicePaged{pool,      reinterpret_cast<const int32_t*>(table.data), table.rows, table.cols, table.ld,
                     p.page_rows, p.first_row.valid() ? static_cast<const int32_t*>(p.first_row.data) : nullptr};
}

// A compressor's inputs and states for entries `w` wide (compress, compress_entries).
Result<cuda::CompressArgs> compress_args(const char* op, const Tensor& kv, const Tensor& score, const Tensor& ape,
                                         int ratio, bool overlap, int64_t n, int64_t w, const SlotRows& state_kv,
                                         const SlotRows& state_score) {
  if (ratio <= 0) return Status::errorf("{}: ratio {}", op, ratio);
  const int o = overlap ? 2 : 1;
  cuda::CompressArgs a;
  DSV4_ASSIGN_OR_RETURN(a.kv, rows_of(kv, op, "kv", n, o * w));
  DSV4_ASSIGN_OR_RETURN(a.score, rows_of(score, op, "score", n, o * w));
  DSV4_ASSIGN_OR_RETURN(a.ape, rows_of(ape, op, "ape", ratio, o * w));
  DSV4_ASSIGN_OR_RETURN(a.state_kv, ring_of(state_kv, op, "state_kv", o * ratio, o * w));
  DSV4_ASSIGN_OR_RETURN(a.state_score, ring_of(state_score, op, "state_score", o * ratio, o * w));
  if (state_score.rows_per_slot != state_kv.rows_per_slot)
    return Status::errorf(StatusCode::kInternal, "{}: state rows per slot {} (kv) and {} (score)", op,
                          state_kv.rows_per_slot, state_score.rows_per_slot);
  a.state_rows = state_kv.rows_per_slot;
  a.ratio = ratio;
  a.overlap = overlap;
  return a;
}

static_assert(kSeqFields == cuda::kStepSeqFields, "the step metadata layout of backend.h and attention_ops.h");

}  // namespace

Status CudaBackend::attention(const Tensor& q, const AttentionKeys& keys, const StepRows& rows, const Tensor& sink,
                              float scale, const Tensor& out, MatmulMode mode) {
  if (keys.draft_block)
    return Status::error("attention: the DSpark draft block runs on the CPU backend only");
  const int64_t d = keys.chunk.cols(), n = rows.n, win = keys.window;
  const int64_t n_heads = d ? q.cols() / d : 0;
  DSV4_ASSIGN_OR_RETURN(const StepMeta m, meta_of(rows, "attention"));
  cuda::AttentionArgs a;
  DSV4_ASSIGN_OR_RETURN(a.chunk, rows_of(keys.chunk, "attention", "chunk", n, d));
  DSV4_ASSIGN_OR_RETURN(const DeviceRows qr, rows_of(q, "attention", "q", n, n_heads * d));
  DSV4_ASSIGN_OR_RETURN(const DeviceRows sk, rows_of(sink, "attention", "sink", -1, n_heads));
  DSV4_ASSIGN_OR_RETURN(const DeviceRows o, rows_of(out, "attention", "out", n, n_heads * d));
  DSV4_ASSIGN_OR_RETURN(a.ring, ring_of(keys.ring, "attention", "ring", win, d));
  a.ring_rows = keys.ring.rows_per_slot;
  const bool selected = keys.ratio > 0 && keys.selected.valid();
  if (keys.ratio) {
    DSV4_ASSIGN_OR_RETURN(a.entries, paged_of(keys.entries, "attention", d));
  }
  if (selected) {
    DSV4_ASSIGN_OR_RETURN(const DeviceRows sel, rows_of(keys.selected, "attention", "selected", n, -1, GgmlType::I32));
    a.selected = reinterpret_cast<const int32_t*>(sel.data);
    a.selected_ld = sel.ld;
    a.top = static_cast<int>(sel.cols);
  }
  a.q = qr.data;
  a.q_ld = qr.ld;
  a.heads = static_cast<int>(n_heads);
  a.d = static_cast<int>(d);
  a.window = win;
  a.ratio = keys.ratio;
  a.sink = sk.data;
  a.scale = scale;
  a.out = o.data;
  a.out_ld = o.ld;
  cuda::AttentionPlan plan;
  DSV4_TRY(cuda::plan_attention(a, m, precision_of(mode), &plan));
  void* workspace = nullptr;
  if (plan.workspace_bytes) {
    DSV4_ASSIGN_OR_RETURN(workspace, impl_->scratch_bytes(plan.workspace_bytes));
  }
  return cuda::attention(a, m, plan, workspace, plan.workspace_bytes, impl_->stream);
}

Status CudaBackend::store_window(const Tensor& kv, const StepRows& rows, int64_t window, const SlotRows& ring) {
  const int64_t d = kv.cols();
  DSV4_ASSIGN_OR_RETURN(const StepMeta m, meta_of(rows, "store_window"));
  DSV4_ASSIGN_OR_RETURN(const DeviceRows src, rows_of(kv, "store_window", "kv", rows.n, -1));
  DSV4_ASSIGN_OR_RETURN(const DeviceRows dst, ring_of(ring, "store_window", "ring", window, d));
  return cuda::store_window(src, m, window, dst, impl_->stream, ring.rows_per_slot);
}

Status CudaBackend::compress(const Tensor& kv, const Tensor& score, const Tensor& ape, int ratio, bool overlap,
                             const StepRows& rows, const SlotRows& state_kv, const SlotRows& state_score,
                             const Tensor& pooled) {
  const int64_t w = kv.cols() / (overlap ? 2 : 1), n = rows.n;
  DSV4_ASSIGN_OR_RETURN(const StepMeta m, meta_of(rows, "compress"));
  DSV4_ASSIGN_OR_RETURN(cuda::CompressArgs a,
                        compress_args("compress", kv, score, ape, ratio, overlap, n, w, state_kv, state_score));
  DSV4_ASSIGN_OR_RETURN(a.pooled, rows_of(pooled, "compress", "pooled", n, w));
  return cuda::compress(a, m, impl_->stream);
}

Status CudaBackend::compress_entries(const Tensor& kv, const Tensor& score, const Tensor& ape, int ratio, bool overlap,
                                     const StepRows& rows, const SlotRows& state_kv, const SlotRows& state_score,
                                     const RowFinish& finish, const PagedRows& dst) {
  const int64_t w = dst.pool.cols(), n = rows.n;
  DSV4_ASSIGN_OR_RETURN(const StepMeta m, meta_of(rows, "compress_entries"));
  if (finish.group != w)
    return Status::errorf("compress_entries: entries of {} values finished in groups of {}", w, finish.group);
  // The finish's checks against an entry-shaped matrix.
  const Tensor entry = make_descriptor(GgmlType::F32, std::vector<int64_t>{1, w});
  DSV4_ASSIGN_OR_RETURN(const cuda::finish::Spec f, impl_->finish_spec(this, "compress_entries", entry, finish));
  DSV4_ASSIGN_OR_RETURN(const cuda::CompressArgs a, compress_args("compress_entries", kv, score, ape, ratio, overlap,
                                                                  n, w, state_kv, state_score));
  DSV4_ASSIGN_OR_RETURN(const DevicePaged pages, paged_of(dst, "compress_entries", w));
  return cuda::compress_entries(a, m, f, pages, impl_->stream);
}

Status CudaBackend::block_positions(const StepRows& rows, int ratio, const Tensor& out) {
  DSV4_ASSIGN_OR_RETURN(const StepMeta m, meta_of(rows, "block_positions"));
  if (ratio <= 0) return Status::errorf("block_positions: ratio {}", ratio);
  if (out.type != GgmlType::I32 || out.n_elements() < rows.n || !out.contiguous())
    return Status::errorf("block_positions: out {} for {} rows", out.describe(), rows.n);
  return cuda::block_positions(m, ratio, static_cast<int32_t*>(out.data), impl_->stream);
}

Status CudaBackend::store_entries(const Tensor& pooled, int ratio, const StepRows& rows, const PagedRows& dst) {
  const int64_t w = pooled.cols();
  DSV4_ASSIGN_OR_RETURN(const StepMeta m, meta_of(rows, "store_entries"));
  if (ratio <= 0) return Status::errorf("store_entries: ratio {}", ratio);
  DSV4_ASSIGN_OR_RETURN(const DeviceRows src, rows_of(pooled, "store_entries", "pooled", rows.n, -1));
  DSV4_ASSIGN_OR_RETURN(const DevicePaged pages, paged_of(dst, "store_entries", w));
  return cuda::store_entries(src, ratio, m, pages, impl_->stream);
}

Status CudaBackend::indexer_scores(const Tensor& q, const Tensor& w, const PagedRows& keys, int ratio,
                                   const StepRows& rows, const Tensor& scores, MatmulMode mode) {
  const int64_t n = rows.n, dk = keys.pool.cols(), n_heads = w.cols();
  DSV4_ASSIGN_OR_RETURN(const StepMeta m, meta_of(rows, "indexer_scores"));
  if (ratio <= 0) return Status::errorf("indexer_scores: ratio {}", ratio);
  cuda::IndexerArgs a;
  DSV4_ASSIGN_OR_RETURN(a.keys, paged_of(keys, "indexer_scores", dk));
  DSV4_ASSIGN_OR_RETURN(const DeviceRows qr, rows_of(q, "indexer_scores", "q", n, n_heads * dk));
  DSV4_ASSIGN_OR_RETURN(const DeviceRows wr, rows_of(w, "indexer_scores", "w", n, n_heads));
  DSV4_ASSIGN_OR_RETURN(a.scores, rows_of(scores, "indexer_scores", "scores", n, -1));
  a.q = qr.data;
  a.q_ld = qr.ld;
  a.w = wr.data;
  a.w_ld = wr.ld;
  a.heads = static_cast<int>(n_heads);
  a.dk = static_cast<int>(dk);
  a.ratio = ratio;
  return cuda::indexer_scores(a, m, precision_of(mode), impl_->stream);
}

Status CudaBackend::top_k(const Tensor& scores, int ratio, const StepRows& rows, int k, const Tensor& idx) {
  const int64_t n = rows.n;
  DSV4_ASSIGN_OR_RETURN(const StepMeta m, meta_of(rows, "top_k"));
  if (ratio <= 0 || k <= 0) return Status::errorf("top_k: ratio {}, k {}", ratio, k);
  DSV4_ASSIGN_OR_RETURN(const DeviceRows sc, rows_of(scores, "top_k", "scores", n, -1));
  if (idx.type != GgmlType::I32 || idx.rows() < n || idx.cols() < k)
    return Status::errorf("top_k: idx {} cannot hold {} x {}", idx.describe(), n, k);
  DSV4_ASSIGN_OR_RETURN(const DeviceRows ir, rows_of(idx, "top_k", "idx", n, -1, GgmlType::I32));
  const size_t bytes = cuda::top_k_workspace_bytes(sc, ratio, m, k);
  void* workspace = nullptr;
  if (bytes) {
    DSV4_ASSIGN_OR_RETURN(workspace, impl_->scratch_bytes(bytes));
  }
  return cuda::top_k(sc, ratio, m, k, reinterpret_cast<int32_t*>(ir.data), ir.ld, workspace, bytes, impl_->stream);
}

}  // namespace dsv4::backend
