// The interface between the model and the hardware that runs it.
//
// The model (src/model/) describes the DeepSeek-V4 forward pass as calls on a Backend;
// it never dereferences tensor memory itself, so a CUDA backend can keep weights and
// caches resident on the device and implement the same calls. The CPU backend
// (backend/cpu/) is the reference implementation and CI's test bed.
//
// Conventions shared by every operation:
// * Shapes are outer-first (row-major), as the spec writes them: a matrix W[out, in] has
//   shape {out, in}; its rows are contiguous. Activations are F32 [rows, cols].
// * Weights keep their GGUF element type; matmul decodes them on the fly.
// * Integer side data (token ids, positions, expert ids, selected key indices) are I32
//   tensors on the backend as well.
// * Each output element is computed by one fixed sequence of arithmetic that does not
//   depend on how many rows are in the call or on the thread count, so the results are
//   bit-identical whatever the batching and chunking (the invariance tests rely on this).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "gguf/ggml_types.h"
#include "util/status.h"

namespace dsv4::gguf { struct TensorInfo; }

namespace dsv4::backend {

class Backend;

// A view of backend memory: element type, shape, strides, owning backend. Views share
// ownership of the underlying allocation (or borrow a mapping that outlives them).
struct Tensor {
  Backend* backend = nullptr;
  GgmlType type = GgmlType::F32;
  int rank = 0;
  std::array<int64_t, 4> shape{0, 0, 0, 0};    // outer-first
  std::array<int64_t, 4> stride{0, 0, 0, 0};   // bytes between consecutive indices per dim
  void* data = nullptr;                         // backend address (host pointer on the CPU)
  std::shared_ptr<void> owner;                  // keeps the allocation alive

  bool valid() const { return data != nullptr; }
  int64_t dim(int i) const { return shape[i]; }
  int64_t n_elements() const;
  int64_t rows() const;                          // product of all dims but the last
  int64_t cols() const { return rank ? shape[rank - 1] : 1; }
  int64_t row_stride() const { return rank >= 2 ? stride[rank - 2] : 0; }  // bytes
  bool contiguous() const;
  std::string describe() const;                  // "f32 [72, 256]"

  // Rows [begin, begin+count) of the outermost dimension.
  Tensor slice(int64_t begin, int64_t count) const;
  // Index the outermost dimension (rank drops by one): expert e of a 3-D stack.
  Tensor at(int64_t index) const;
  // The same memory as contiguous [rows, cols] (requires contiguous rows).
  Tensor as_matrix(int64_t rows, int64_t cols) const;
  // Columns [begin, begin+count) of a plain-typed matrix (rows keep their stride).
  Tensor columns(int64_t begin, int64_t count) const;
  // A plain-typed [rows, cols] view starting `element_offset` elements in, with rows
  // `row_stride_elements` apart (interleaved layouts such as a concatenation).
  Tensor view(int64_t element_offset, int64_t rows, int64_t cols, int64_t row_stride_elements) const;
};

// Makes a contiguous tensor descriptor (no memory) of the given type and shape.
Tensor make_descriptor(GgmlType type, std::span<const int64_t> shape);

// Parameters of a rotary table (spec §2.1): partial interleaved RoPE on the last `dims`
// channels of each head, optionally with YaRN frequency blending. Angles are
// fp32(position) * fp32(omega_i), as the reference computes them.
struct RopeParams {
  int dims = 64;
  float freq_base = 10000;
  bool yarn = false;
  float yarn_factor = 1;
  int yarn_original_context = 0;
  float yarn_beta_fast = 32;
  float yarn_beta_slow = 1;
};

// The arithmetic of the matrix products.
enum class MatmulMode {
  Exact,      // weights decoded exactly, fp32 activations and accumulation (reference)
  Quantized,  // activations quantised once per row (CPU: quant.h's Q8_0/Q8_K integer
              // dot products; exact for weight types without an integer path)
  // As Exact, each output one fma chain over the inputs in order: the arithmetic of the
  // official V4.1 reference's fp32 CPU GEMM (shared/fixtures/tiny-v41), whose QAT
  // roundings flip on last-bit differences. Backends without it compute Exact.
  Sequential,
  // Weights decoded exactly, fp32 activations and products, the sums in any order: the
  // products the reference computes in fp32 (hyper-connection mixes, compressors, index
  // projections, routers) in the production mode, so that a backend may take them to a
  // fp32 GEMM library on many rows (CUDA: cuBLASLt, CUBLAS_COMPUTE_32F, no TF32). The CPU
  // computes Exact.
  Float32,
};

// ---- one step's rows and the cache views the DeepSeek-V4 operations read ---------------
//
// A step processes the rows (tokens) of several sequences at once. Row r belongs to the
// step's sequence row_seq[r] and sits at absolute position positions[r]; a sequence's rows
// are consecutive, in position order. Everything an operation needs to know about lengths
// (window fill, visible compressed entries, keys per query) follows from these arrays and
// the layer's ratio, so it lives on the device and no operation needs the host inside a
// step. Tensors are sized by capacity: a padding row (row_seq = -1, e.g. an unused slot of
// a CUDA-graph batch bucket) computes something finite and writes no cache.
struct StepRows {
  int64_t n = 0;       // rows (the tensors' first dimension)
  int64_t n_seqs = 0;  // sequences
  Tensor tokens;       // I32 [n]: input ids (hash routing, embeddings)
  Tensor positions;    // I32 [n]
  Tensor row_seq;      // I32 [n]: the row's sequence in this step, -1 for a padding row
  Tensor seqs;         // I32 [n_seqs, kSeqFields]: see SeqField
  // Upper bound on (last position + 1) over the step's sequences: sizes per-step buffers
  // that grow with the context (indexer scores); the live lengths stay on the device.
  int64_t max_end = 0;
};
// kSeqWindowStart: the first position whose KV the sequence has (0, or a KV graft's
// footprint: a grafted sequence starts there, with no window before it).
enum SeqField : int {
  kSeqFirstRow = 0,
  kSeqRows = 1,
  kSeqFirstPos = 2,
  kSeqSlot = 3,
  kSeqWindowStart = 4,
  kSeqFields = 5,
};

// Fixed-size per-sequence state in one tensor for every cache slot: slot s owns rows
// [s * rows_per_slot, (s + 1) * rows_per_slot) of `data` (F32 [slots * rows_per_slot, width]).
// Window rings and compressor states are kept this way, each as a ring of positions:
// position p's row is p mod rows_per_slot. rows_per_slot is at least the span the
// operation reads (the window; overlap * ratio); the cache keeps a few rows more, so a
// sequence can be rewound by a few tokens without copies (model/kv_cache.h, rewind).
struct SlotRows {
  Tensor data;
  int64_t rows_per_slot = 0;
  // Row of position `pos` (may be negative: a block's missing previous half) in `slot`.
  int64_t ring_row(int64_t slot, int64_t pos) const {
    return slot * rows_per_slot + ((pos % rows_per_slot) + rows_per_slot) % rows_per_slot;
  }
  // Every backend's check of a ring argument: F32, `width` columns, whole slots of at least
  // `min_rows` rows.
  Status check(const char* op, const char* arg, int64_t min_rows, int64_t width) const {
    if (!data.valid() || data.type != GgmlType::F32 || rows_per_slot < (min_rows > 1 ? min_rows : 1) ||
        data.cols() != width || data.rows() % rows_per_slot)
      return Status::errorf(StatusCode::kInternal, "{}: {} {} with {} rows per slot, expected at least {} x {}", op, arg,
                            data.describe(), rows_per_slot, min_rows, width);
    return Status::ok();
  }
};

// Rows that grow with a sequence (compressed KV entries, indexer keys), in fixed-size pages
// of one pool: row i of slot s lives at pool row page_table[s, i / page_rows] * page_rows +
// i % page_rows. Pages are handed out by the cache manager (model/kv_cache.h) before a step.
// A slot's rows below first_row[slot] do not exist (a KV graft planted fewer rows than its
// footprint spans): attention, indexer scores and top-k skip them.
struct PagedRows {
  Tensor pool;        // F32 [pages * page_rows, width]
  Tensor page_table;  // I32 [slots, max_pages]
  int64_t page_rows = 0;
  Tensor first_row;   // I32 [slots], or empty: every slot's rows start at 0
};

// The keys one attention layer reads (spec §3.1-§3.5). For row r at position t:
//   window keys: positions max(window start, t - window + 1) .. t, in position order, from
//     `chunk` (this step's KV rows) for positions of this step and from `ring` otherwise;
//   compressed keys (ratio > 0): with `selected` absent, every visible entry
//     first_row .. (t + 1) / ratio - 1 in order (HCA); else the entries listed in
//     selected[r] (CSA: ascending, -1 = unused slot) of `entries`.
struct AttentionKeys {
  int64_t window = 0;
  SlotRows ring;        // [slots * window, d]
  Tensor chunk;         // F32 [n, d]
  int ratio = 0;
  PagedRows entries;    // width d
  Tensor selected;      // I32 [n, top-k], or empty
  // V4.1 DSpark draft block (deepseek-v41.md §3.7): each sequence's rows are one draft
  // block, non-causal: every row reads the ring's positions max(window start,
  // first_pos - window) .. first_pos - 1 and then all of the sequence's chunk rows
  // (ratio must be 0). Backends without it refuse it.
  bool draft_block = false;
};

// What finish_rows applies to each `group`-wide group of a row (a head, an entry), in this
// order: RMSNorm (weighted by norm_weight F32 [group], or unweighted), RoPE of the group's
// last rope->dims channels at the row's position, the Walsh-Hadamard rotation (scaled by
// group^-1/2), a QAT rounding. The Q, KV and indexer query paths and the compressed entries
// (spec §3.1, §3.3, §3.6) are each one such pipeline.
enum class QatRounding {
  None,
  Fp8,  // round_fp8_blocks(x, round_cols, round_block): the group must be the whole row
  Fp4,  // round_fp4_blocks(x, round_block): round_block divides the group
};
struct RowFinish {
  int64_t group = 0;
  bool norm = false;
  const Tensor* norm_weight = nullptr;
  float eps = 1e-6f;
  const RopeParams* rope = nullptr;  // absent: no rotation
  bool hadamard = false;
  QatRounding round = QatRounding::None;
  int64_t round_cols = 0;
  int64_t round_block = 0;
};
// Every backend's check of a RowFinish for x (groups divide the row, RoPE dims even and within
// a group, a power-of-two group for the rotation, the rounding's blocks within the groups).
Status check_row_finish(const char* op, const Tensor& x, const RowFinish& f);

// Device memory as a device backend reports it (Backend::device_memory).
struct DeviceMemoryState {
  uint64_t free_bytes = 0;     // free on the device now; 0: host memory (not checked)
  uint64_t scratch_bytes = 0;  // held by the backend for step scratch and workspaces
};

// The step arena's first chunk on a device backend (CudaBackendOptions::scratch_bytes) and
// its matrix-product workspace: what a device backend holds before a model loads.
inline constexpr uint64_t kDefaultDeviceScratchBytes = uint64_t{256} << 20;
inline constexpr uint64_t kDeviceWorkspaceBytes = uint64_t{32} << 20;

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // What Model::load checks weights and caches against before allocating them.
  virtual DeviceMemoryState device_memory() const { return {}; }

  // --- memory -------------------------------------------------------------------------
  // A zero-filled contiguous tensor.
  virtual Result<Tensor> alloc(GgmlType type, std::span<const int64_t> shape) = 0;
  // A contiguous tensor whose pages are committed only when first written: a logical
  // reservation for a full context that costs memory as rows arrive.
  virtual Result<Tensor> reserve(GgmlType type, std::span<const int64_t> shape) = 0;
  // The GGUF tensor's bytes as a weight tensor (CPU: a view of the file mapping, so
  // resident memory stays about the file size; a device backend copies it once).
  virtual Result<Tensor> weight(const gguf::TensorInfo& info) = 0;
  virtual Status upload(const Tensor& dst, const void* host, size_t bytes) = 0;
  virtual Status download(const Tensor& src, void* host, size_t bytes) = 0;
  // dst rows [0, src.rows) = src rows (same type and row width; any row strides).
  virtual Status copy_rows(const Tensor& src, const Tensor& dst) = 0;
  // Every element of an F32 or I32 tensor set to `value` (I32: value converted).
  virtual Status fill(const Tensor& t, float value) = 0;

  // --- steps ------------------------------------------------------------------------------
  // Scratch for one step's intermediates: begin_step() releases everything scratch() handed
  // out since the previous begin_step(). Scratch memory is NOT zero-filled (the CPU backend
  // can poison it with NaN to prove that nothing reads what it did not write); tensors from
  // scratch() are valid until the next begin_step().
  virtual void begin_step() = 0;
  virtual Result<Tensor> scratch(GgmlType type, std::span<const int64_t> shape) = 0;
  // Scratch handed out after scratch_mark() is given back by scratch_release(mark), in
  // nested scopes (a block's intermediates), so a step needs its largest block's scratch,
  // not the sum over blocks. Marks and releases in the same order give the same addresses
  // (what graph replay relies on).
  struct ScratchMark {
    size_t chunk = 0;
    size_t offset = 0;
  };
  virtual ScratchMark scratch_mark() const = 0;
  virtual void scratch_release(ScratchMark mark) = 0;

  // Lanes: independent work of a step side by side (a device runs a layer's KV path beside
  // its query path; one-row kernels leave most of a GPU idle). fork_lane(i) starts side lane
  // i (1..kMaxLanes) after everything enqueued so far and sends the ops that follow to it;
  // main_lane() sends them to the main lane again; join_lane(i) makes the main lane's
  // following ops wait for what lane i was given and sends them to the main lane. Ops on
  // different lanes between a fork and its join must not write memory the other lane reads or
  // writes. scratch_release, begin_step, downloads, captures and timing points join every
  // lane first. Results are the same bits as without lanes; a backend that computes in its
  // calls (the CPU) runs every op in order and only checks the lane number.
  static constexpr int kMaxLanes = 1;
  virtual Status fork_lane(int lane) { return check_lane("fork_lane", lane); }
  virtual Status main_lane() { return Status::ok(); }
  virtual Status join_lane(int lane) { return check_lane("join_lane", lane); }

  // --- dense operations (x, y are F32 [rows, cols] unless stated) --------------------------
  // y[s, o] = sum_i w[o, i] * x[s, i].
  virtual Status matmul(const Tensor& w, const Tensor& x, const Tensor& y, MatmulMode mode) = 0;
  // The grouped product of V4's output projection (spec §3.1.10): w [groups * n, k], x
  // [rows, groups * k], y [rows, groups * n], and y's columns [g n, (g+1) n) = w's rows
  // [g n, (g+1) n) times x's columns [g k, (g+1) k). The same bits as `groups` calls of matmul
  // on those slices (this default); a backend may do them in one launch.
  virtual Status matmul_grouped(const Tensor& w, const Tensor& x, const Tensor& y, int64_t groups,
                                MatmulMode mode) {
    if (groups < 1 || w.rows() % groups || x.cols() % groups || y.cols() != w.rows() ||
        x.cols() / groups != w.cols())
      return Status::errorf(StatusCode::kInvalidArgument, "matmul_grouped: {} groups of w {} x {} into {}", groups,
                            w.describe(), x.describe(), y.describe());
    const int64_t n = w.rows() / groups, k = w.cols();
    for (int64_t g = 0; g < groups; ++g)
      DSV4_TRY(matmul(w.slice(g * n, n), x.columns(g * k, k), y.columns(g * n, n), mode));
    return Status::ok();
  }
  // ys[i] = x W_i^T for every i (products of one input: a layer's compressors and index
  // weights). The separate calls (this default), or fewer launches with the same results.
  virtual Status matmul_many(std::span<const Tensor* const> ws, const Tensor& x,
                             std::span<const Tensor* const> ys, MatmulMode mode) {
    if (ws.size() != ys.size())
      return Status::errorf("matmul_many: {} weights for {} outputs", ws.size(), ys.size());
    for (size_t i = 0; i < ws.size(); ++i) DSV4_TRY(matmul(*ws[i], x, *ys[i], mode));
    return Status::ok();
  }
  // y[s, :] = table[ids[s], :] decoded to F32.
  virtual Status get_rows(const Tensor& table, const Tensor& ids, const Tensor& y) = 0;
  // y = x / sqrt(mean(x^2) + eps) * weight, per row of `width` values (x may hold several
  // such groups per row, e.g. heads); weight F32 [width] or absent (unweighted).
  virtual Status rms_norm(const Tensor& x, const Tensor* weight, float eps, int64_t width,
                          const Tensor& y) = 0;
  // In place: rotate the last p.dims channels of every `head_dim`-wide head of row s by
  // positions[s] (inverse: the conjugate rotation, for output de-rotation).
  virtual Status rope(const Tensor& x, int64_t head_dim, const Tensor& positions,
                      const RopeParams& p, bool inverse) = 0;
  // rms_norm with the mean of squares summed in fp32 in torch's CPU order (8-lane vectors,
  // four accumulators, at::native's cascade sum), as the official V4.1 reference computes
  // it; pairs with MatmulMode::Sequential. Backends without it compute rms_norm.
  virtual Status rms_norm_torch_order(const Tensor& x, const Tensor* weight, float eps, int64_t width,
                                      const Tensor& y) {
    return rms_norm(x, weight, eps, width, y);
  }
  // y += x (same shape).
  virtual Status add(const Tensor& x, const Tensor& y) = 0;
  // x *= factor, in place.
  virtual Status scale(const Tensor& x, float factor) = 0;

  // --- DeepSeek-V4 operations ---------------------------------------------------------
  // mHC collapse (spec §2.3) from the raw mix logits m = fn . flatten(X) (F32 [S, 24]):
  // applies the RMS scale of X, sigmoid gates, the Sinkhorn split, and collapses.
  // streams F32 [S, n_hc*D]; out x F32 [S, D], post F32 [S, n_hc], comb F32 [S, n_hc*n_hc].
  virtual Status hc_pre(const Tensor& streams, const Tensor& mixes, const Tensor& scale,
                        const Tensor& base, int n_hc, int sinkhorn_iters, float hc_eps,
                        float norm_eps, const Tensor& x, const Tensor& post,
                        const Tensor& comb) = 0;
  // hc_pre, then the sublayer's RMSNorm of its output: normed = rms_norm(x, norm_weight,
  // norm_eps, D) (F32 [S, D]), what every block computes before attention and the MoE. The
  // results of the two calls (this default); a backend may do both in one kernel.
  virtual Status hc_pre_norm(const Tensor& streams, const Tensor& mixes, const Tensor& scale,
                             const Tensor& base, int n_hc, int sinkhorn_iters, float hc_eps,
                             float norm_eps, const Tensor& norm_weight, const Tensor& x,
                             const Tensor& post, const Tensor& comb, const Tensor& normed) {
    DSV4_TRY(hc_pre(streams, mixes, scale, base, n_hc, sinkhorn_iters, hc_eps, norm_eps, x, post, comb));
    return rms_norm(x, &norm_weight, norm_eps, x.cols(), normed);
  }
  // hc_pre_norm from the mix weights: mixes = streams fn^T (fn F32 [(2+n_hc)*n_hc, n_hc*D]) in
  // `mode` (the reference computes them in fp32, §2.3), then hc_pre_norm; the mix logits are
  // not kept. The results of the two calls (this default, the mixes in step scratch); a backend
  // may do both in one launch (CUDA: decode rows, docs/CUDA.md "A site's mixes and hc_pre in one
  // launch").
  virtual Status hc_pre_norm_from_fn(const Tensor& fn, const Tensor& streams, MatmulMode mode,
                                     const Tensor& scale, const Tensor& base, int n_hc,
                                     int sinkhorn_iters, float hc_eps, float norm_eps,
                                     const Tensor& norm_weight, const Tensor& x, const Tensor& post,
                                     const Tensor& comb, const Tensor& normed) {
    const std::array<int64_t, 2> shape{streams.rows(), int64_t{2 + n_hc} * n_hc};
    DSV4_ASSIGN_OR_RETURN(Tensor mixes, scratch(GgmlType::F32, shape));
    DSV4_TRY(matmul(fn, streams, mixes, mode));
    return hc_pre_norm(streams, mixes, scale, base, n_hc, sinkhorn_iters, hc_eps, norm_eps, norm_weight, x, post,
                       comb, normed);
  }
  // mHC expand (spec §2.4), in place on streams: X'[k] = post_k y + sum_j comb[j,k] X[j].
  virtual Status hc_post(const Tensor& y, const Tensor& post, const Tensor& comb, int n_hc,
                         const Tensor& streams) = 0;
  // V4.1's delayed mix (shared/spec/deepseek-v41.md §3.5): hc_pre's split without the
  // collapse; pre F32 [S, n_hc] is kept for the next sublayer's collapse.
  virtual Status hc_mix(const Tensor& streams, const Tensor& mixes, const Tensor& scale,
                        const Tensor& base, int n_hc, int sinkhorn_iters, float hc_eps,
                        float norm_eps, const Tensor& pre, const Tensor& post,
                        const Tensor& comb) = 0;
  // x[s] = sum_j pre[s, j] * X_j[s] (hc_pre's collapse with a given pre F32 [S, n_hc]).
  virtual Status hc_collapse(const Tensor& streams, const Tensor& pre, int n_hc, const Tensor& x) = 0;
  // Hyper head collapse (spec §2.6): sigmoid weights without Sinkhorn.
  virtual Status hc_head(const Tensor& streams, const Tensor& mixes, const Tensor& scale,
                         const Tensor& base, int n_hc, float hc_eps, float norm_eps,
                         const Tensor& x) = 0;

  // Attention with a sink (spec §3.1) for every row of a step over the keys described by
  // `keys` (see AttentionKeys). q F32 [n, H*d]; sink F32 [H]; out F32 [n, H*d]. Per row and
  // head one joint softmax over the window keys then the compressed keys, in that order.
  // mode: Quantized (the production numerics) lets a backend compute as the reference's
  // attention kernel does, bf16 operands with fp32 logits, softmax and accumulation (CUDA:
  // tensor cores, docs/CUDA.md "Precision"); every other mode computes in fp32. The CPU
  // computes in fp32 in every mode.
  virtual Status attention(const Tensor& q, const AttentionKeys& keys, const StepRows& rows,
                           const Tensor& sink, float scale, const Tensor& out, MatmulMode mode) = 0;
  // Window ring update after attention: each sequence's last min(rows, window) rows of
  // `kv` (F32 [n, d]) are written to its ring (ring.ring_row; rows_per_slot >= window).
  virtual Status store_window(const Tensor& kv, const StepRows& rows, int64_t window,
                              const SlotRows& ring) = 0;

  // Compressor (spec §3.3): feeds every row's kv and score (F32 [n, overlap*w]; score
  // without APE, the state keeps it with APE) at its position into its sequence's state (state_kv, state_score:
  // [slots * rows_per_slot, overlap*w], rows_per_slot >= overlap*ratio, one ring row per
  // position). A row whose position t closes a block (t % ratio == ratio - 1) writes the
  // pooled (pre-norm) entry of positions t + 1 - overlap*ratio .. t to pooled[row]
  // (F32 [n, w]): with overlap the previous block's first halves, then this block's second
  // halves; positions before the sequence's first hold the empty state (score -inf). Other
  // rows of `pooled` are left as they were. ape F32 [ratio, overlap*w].
  virtual Status compress(const Tensor& kv, const Tensor& score, const Tensor& ape, int ratio,
                          bool overlap, const StepRows& rows, const SlotRows& state_kv,
                          const SlotRows& state_score, const Tensor& pooled) = 0;
  // compress, then the entry of every row that closes a block: its pooled values through
  // `finish` with the RoPE at the block's first position (block_positions), stored as
  // entry position / ratio of its sequence in `dst` (store_entries). What the forward pass
  // does with every compressor's output; the separate calls (this default), or one kernel.
  virtual Status compress_entries(const Tensor& kv, const Tensor& score, const Tensor& ape, int ratio,
                                  bool overlap, const StepRows& rows, const SlotRows& state_kv,
                                  const SlotRows& state_score, const RowFinish& finish,
                                  const PagedRows& dst);
  // out[r] = positions[r] rounded down to a multiple of `ratio` (the first position of the
  // row's compressor block: where its entry is rotated, spec §3.3).
  virtual Status block_positions(const StepRows& rows, int ratio, const Tensor& out) = 0;
  // Rows of `pooled` (F32 [n, w]) that close a block are stored as entry position / ratio
  // of their sequence in `dst` (the pages must exist: the cache manager's job).
  virtual Status store_entries(const Tensor& pooled, int ratio, const StepRows& rows,
                               const PagedRows& dst) = 0;

  // Lightning-indexer scores (spec §3.6): for row r with visible(r) = (position + 1) / ratio
  // entries, scores[r, b] = sum_h w[r,h] relu(q[r,h] . keys_b) for first_row <= b <
  // visible(r) (keys of the row's sequence), -inf for the other b < scores.cols.
  // q F32 [n, H*dk], w F32 [n, H], keys width dk, scores F32 [n, >= max visible]. mode as
  // for attention (Quantized: bf16 q and keys, fp32 accumulation, on a backend that has it).
  virtual Status indexer_scores(const Tensor& q, const Tensor& w, const PagedRows& keys,
                                int ratio, const StepRows& rows, const Tensor& scores, MatmulMode mode) = 0;
  // Per row: the indices of the k largest finite scores among the first visible(r) (all of
  // them when there are at most k; equal scores keep the lower index; -inf marks an entry
  // that does not exist), ascending, then -1 padding, into idx I32 [n, k].
  virtual Status top_k(const Tensor& scores, int ratio, const StepRows& rows, int k,
                       const Tensor& idx) = 0;

  // In place on x (F32 [n, groups * f.group]): every group of row r through `f` (RowFinish),
  // RoPE at positions[r] (I32 [n]; unread without RoPE). The separate calls (this default:
  // rms_norm, rope, hadamard, round_fp8_blocks / round_fp4_blocks), or one kernel.
  virtual Status finish_rows(const Tensor& x, const Tensor& positions, const RowFinish& f);
  // Walsh-Hadamard rotation of each `width`-wide group of every row, scaled by width^-1/2.
  virtual Status hadamard(const Tensor& x, int64_t width) = 0;
  // QAT: FP8 e4m3 quantise-dequantise of columns [0, cols) in blocks of `block` with
  // power-of-two scales (spec §3.7), in place.
  virtual Status round_fp8_blocks(const Tensor& x, int64_t cols, int64_t block) = 0;
  // QAT: FP4 e2m1 quantise-dequantise of every row in blocks of `block`, in place.
  virtual Status round_fp4_blocks(const Tensor& x, int64_t block) = 0;
  // QAT (V4.1 compressed KV, the reference's fp4_act_quant with E4M3 scales): FP4 e2m1
  // quantise-dequantise of every row in blocks of `block` whose scale is the e4m3-rounded
  // amax/6 (amax floored at 6*2^-9), in place.
  virtual Status round_fp4_e4m3_blocks(const Tensor& x, int64_t block) = 0;

  // --- V4.1 operations (shared/spec/deepseek-v41.md) ------------------------------------
  // Engram gate (§3.2), in place on streams F32 [S, n_hc*D]: kv F32 [S, (n_hc+1)*D] holds
  // the per-stream keys then the value; q, k F32 [n_hc*D] the two RMSNorm weights. Per
  // stream s: a = rmsnorm(X_s)*q_s, b = rmsnorm(key_s)*k_s (eps), sigma = a.b / sqrt(D),
  // g = sigmoid(sign(sigma) * sqrt(max(|sigma|, 1e-6))), X_s += g * value; gate F32 [S, n_hc].
  virtual Status engram_gate(const Tensor& streams, const Tensor& kv, const Tensor& q, const Tensor& k,
                             int n_hc, float eps, const Tensor& gate) = 0;
  // Candidate blocks (§3.4) from index scores F32 [n, >= visible] (-inf: absent): block j
  // covers entries j*block .. j*block+block-1 and scores its maximum; the block holding
  // the row's newest visible entry is always kept; then the best blocks (equal scores: the
  // lower block), never an all -inf one, up to k blocks, ascending, -1 padding, into
  // out I32 [n, k].
  virtual Status candidate_blocks(const Tensor& scores, int ratio, const StepRows& rows, int64_t block,
                                  int k, const Tensor& out) = 0;
  // scores[r, e] = -inf for every entry e outside the blocks in candidates[r] (in place).
  virtual Status mask_candidates(const Tensor& scores, const Tensor& candidates, int64_t block) = 0;

  // --- MoE ----------------------------------------------------------------------------
  // Router (spec §4.1, §4.2) from logits F32 [S, E]: scores sqrt(softplus(logit)); the
  // experts are tid2eid[token] (hash layers: tid2eid I32 [vocab, k], tokens I32 [S]) or
  // the top k of score + bias (bias F32 [E]); weights = renormalised scores * route_scale.
  // experts I32 [S, k] (ascending), weights F32 [S, k].
  virtual Status route(const Tensor& logits, const Tensor* bias, const Tensor* tid2eid,
                       const Tensor& tokens, int k, float route_scale, const Tensor& experts,
                       const Tensor& weights) = 0;
  // Routed experts (spec §4.3): y[s] = sum_j weights[s,j] * expert_{experts[s,j]}(x[s]), the
  // sum from +0 in slot order (y is written, not added to: no fill before it and no add of a
  // separate sum after it), gate/up [E, I, D], down [E, D, I], SwiGLU with the clamp `limit`.
  virtual Status moe_experts(const Tensor& x, const Tensor& gate, const Tensor& up,
                             const Tensor& down, const Tensor& experts, const Tensor& weights,
                             float limit, MatmulMode mode, const Tensor& y) = 0;
  // One dense SwiGLU expert (the shared expert): y += down(silu(min(g, L)) * clamp(u, L)).
  virtual Status swiglu_expert(const Tensor& x, const Tensor& gate, const Tensor& up,
                               const Tensor& down, float limit, MatmulMode mode,
                               const Tensor& y) = 0;

  // --- steering (model/steering.h) -------------------------------------------------------
  // In place on every row r of x (F32 [n, W]), for each of its W / group groups g (a
  // stream's slice, or the whole row) with direction d_g (dir F32 [group], the same for
  // every group, or [W], one slice per group): project: x_g -= alpha[r] (x_g . d_g) d_g
  // (d_g a unit vector); add: x_g += alpha[r] d_g. alpha F32 [n]. Rows with alpha 0 are
  // left exactly as they were.
  virtual Status steer(const Tensor& x, const Tensor& dir, int64_t group, bool project, const Tensor& alpha) = 0;

  // --- sampling (backend/sampling.h) -----------------------------------------------------
  // One token per row of logits (F32 [n, V], modified in place by the adjustments).
  // adjust (optional, I32 [m, kAdjustFields]): per (row, token) a repetition factor and a
  // subtrahend, applied first; an entry whose row is -1 is unused. params I32 [n, kSampleFields]. Temperature 0: the arg-max
  // (lowest id on ties). Otherwise z = x / T over the finite x, then top-k (exactly k
  // candidates, equal z to the lower id), top-p (the shortest prefix in descending z whose
  // softmax mass reaches p), min-p (softmax >= min_p * its maximum), and one draw from the
  // renormalised softmax of the rest by the Gumbel-max rule with noise keyed by (seed,
  // counter, token): a pure function of the logits and the key. out I32 [n].
  virtual Status sample(const Tensor& logits, const Tensor& params, const Tensor* adjust,
                        const Tensor& out) = 0;

  // --- graphs (optional) -----------------------------------------------------------------
  // A backend that can record the work enqueued between begin_capture() and
  // end_capture(id) as graph `id` (replacing an older one of that id) and enqueue it again
  // with replay(id). Recording runs the host code once; replays must see the same tensor
  // addresses (persistent buffers for the inputs, the same scratch sequence) and no host
  // data (uploads go before replay). Backends without graphs say so and run steps directly.
  virtual bool supports_graphs() const { return false; }
  virtual Status begin_capture() { return Status::error(StatusCode::kInternal, name() + ": no graphs"); }
  virtual Status end_capture(int64_t /*id*/) { return Status::error(StatusCode::kInternal, name() + ": no graphs"); }
  virtual Status replay(int64_t /*id*/) { return Status::error(StatusCode::kInternal, name() + ": no graphs"); }

  // --- timing (benchmarks) -----------------------------------------------------------------
  // A point in the backend's queue of work: elapsed_ms(a, b) is the time the work enqueued
  // between the two took, as the device saw it. The default, for backends that compute in
  // their calls (the CPU), reads the host clock; a device backend records an event on its
  // stream, so host work that overlaps the device's is not counted twice and nothing waits
  // until elapsed_ms, which waits for `end`.
  struct TimePoint {
    double host_ms = 0;           // the host clock when the point was taken
    std::shared_ptr<void> event;  // the device backend's event, if any
  };
  virtual Result<TimePoint> time_point() { return TimePoint{host_clock_ms(), nullptr}; }
  virtual Result<double> elapsed_ms(const TimePoint& begin, const TimePoint& end) {
    return end.host_ms - begin.host_ms;
  }
  // Waits until everything enqueued has finished (nothing to wait for on the CPU).
  virtual Status synchronize() { return Status::ok(); }

  static double host_clock_ms() {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }

 protected:
  static Status check_lane(const char* op, int lane) {
    if (lane >= 1 && lane <= kMaxLanes) return Status::ok();
    return Status::errorf(StatusCode::kInvalidArgument, "{}: lane {} (side lanes are 1..{})", op, lane, kMaxLanes);
  }
};

}  // namespace dsv4::backend
