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
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;

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

  // --- dense operations (x, y are F32 [rows, cols] unless stated) --------------------------
  // y[s, o] = sum_i w[o, i] * x[s, i].
  virtual Status matmul(const Tensor& w, const Tensor& x, const Tensor& y, MatmulMode mode) = 0;
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
  // mHC expand (spec §2.4), in place on streams: X'[k] = post_k y + sum_j comb[j,k] X[j].
  virtual Status hc_post(const Tensor& y, const Tensor& post, const Tensor& comb, int n_hc,
                         const Tensor& streams) = 0;
  // Hyper head collapse (spec §2.6): sigmoid weights without Sinkhorn.
  virtual Status hc_head(const Tensor& streams, const Tensor& mixes, const Tensor& scale,
                         const Tensor& base, int n_hc, float hc_eps, float norm_eps,
                         const Tensor& x) = 0;

  // Attention with a sink (spec §3.1) over selected keys. q F32 [S, H*d]; keys come from
  // the concatenation of kv_a [Na, d] and kv_b [Nb, d] (K = V); idx I32 [S, K] indexes that
  // concatenation, -1 = unused slot; sink F32 [H]; out F32 [S, H*d].
  virtual Status sparse_attention(const Tensor& q, const Tensor& kv_a, const Tensor& kv_b,
                                  const Tensor& idx, const Tensor& sink, float scale,
                                  const Tensor& out) = 0;

  // Compressor (spec §3.3): feeds tokens at consecutive positions first_pos.. into the
  // per-sequence state and writes one pooled (pre-norm) entry per completed block.
  // kv, score F32 [S, overlap*w] (score without APE); ape F32 [ratio, overlap*w];
  // state_kv, state_score F32 [overlap*ratio, overlap*w]; entries F32 [>= n_new, w].
  // Returns the number of entries written.
  virtual Result<int64_t> compress(const Tensor& kv, const Tensor& score, const Tensor& ape,
                                   int64_t first_pos, int ratio, bool overlap,
                                   const Tensor& state_kv, const Tensor& state_score,
                                   const Tensor& entries) = 0;

  // Lightning-indexer scores (spec §3.6): scores[s, b] = sum_h w[s,h] relu(q[s,h] . keys[b])
  // for b < visible[s], -inf beyond. q F32 [S, H*dk], w F32 [S, H], keys F32 [N, dk],
  // visible I32 [S], scores F32 [S, N].
  virtual Status indexer_scores(const Tensor& q, const Tensor& w, const Tensor& keys,
                                const Tensor& visible, const Tensor& scores) = 0;
  // Per row: the indices of the k largest of the first visible[s] scores (all of them
  // when visible[s] <= k), ascending, then -1 padding; written at idx[s, 0..k) + offset.
  virtual Status top_k(const Tensor& scores, const Tensor& visible, int k, int32_t offset,
                       const Tensor& idx) = 0;

  // Walsh-Hadamard rotation of each `width`-wide group of every row, scaled by width^-1/2.
  virtual Status hadamard(const Tensor& x, int64_t width) = 0;
  // QAT: FP8 e4m3 quantise-dequantise of columns [0, cols) in blocks of `block` with
  // power-of-two scales (spec §3.7), in place.
  virtual Status round_fp8_blocks(const Tensor& x, int64_t cols, int64_t block) = 0;
  // QAT: FP4 e2m1 quantise-dequantise of every row in blocks of `block`, in place.
  virtual Status round_fp4_blocks(const Tensor& x, int64_t block) = 0;

  // --- MoE ----------------------------------------------------------------------------
  // Router (spec §4.1, §4.2) from logits F32 [S, E]: scores sqrt(softplus(logit)); the
  // experts are tid2eid[token] (hash layers: tid2eid I32 [vocab, k], tokens I32 [S]) or
  // the top k of score + bias (bias F32 [E]); weights = renormalised scores * route_scale.
  // experts I32 [S, k] (ascending), weights F32 [S, k].
  virtual Status route(const Tensor& logits, const Tensor* bias, const Tensor* tid2eid,
                       const Tensor& tokens, int k, float route_scale, const Tensor& experts,
                       const Tensor& weights) = 0;
  // Routed experts (spec §4.3): y[s] += sum_j weights[s,j] * expert_{experts[s,j]}(x[s]),
  // gate/up [E, I, D], down [E, D, I], SwiGLU with the clamp `limit`.
  virtual Status moe_experts(const Tensor& x, const Tensor& gate, const Tensor& up,
                             const Tensor& down, const Tensor& experts, const Tensor& weights,
                             float limit, MatmulMode mode, const Tensor& y) = 0;
  // One dense SwiGLU expert (the shared expert): y += down(silu(min(g, L)) * clamp(u, L)).
  virtual Status swiglu_expert(const Tensor& x, const Tensor& gate, const Tensor& up,
                               const Tensor& down, float limit, MatmulMode mode,
                               const Tensor& y) = 0;
};

}  // namespace dsv4::backend
