#include "backend/cpu/cpu_backend.h"

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "backend/cpu/cpu_math.h"
#include "gguf/gguf_file.h"
#include "gguf/quant.h"

namespace dsv4::backend {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

float* f32_row(const Tensor& t, int64_t row) {
  return reinterpret_cast<float*>(static_cast<uint8_t*>(t.data) + row * t.row_stride());
}
int32_t* i32_row(const Tensor& t, int64_t row) {
  return reinterpret_cast<int32_t*>(static_cast<uint8_t*>(t.data) + row * t.row_stride());
}
const uint8_t* byte_row(const Tensor& t, int64_t row) {
  return static_cast<const uint8_t*>(t.data) + row * t.row_stride();
}

// Shape/type checks shared by the operations: each failure names the operation, the
// argument and what was found.
Status expect(const Tensor& t, const char* op, const char* arg, GgmlType type, int64_t rows,
              int64_t cols) {
  if (!t.valid()) return Status::errorf("{}: argument {} is empty", op, arg);
  if (t.type != type)
    return Status::errorf("{}: argument {} is {}, expected type {}", op, arg, t.describe(),
                          ggml_type_name(type));
  if ((rows >= 0 && t.rows() < rows) || (cols >= 0 && t.cols() != cols))
    return Status::errorf("{}: argument {} is {}, expected [{}, {}]", op, arg, t.describe(),
                          rows, cols);
  return Status::ok();
}

struct Deleter {
  size_t bytes;
  bool mapped;
  void operator()(void* p) const {
    if (mapped) munmap(p, bytes);
    else ::operator delete(p, std::align_val_t(64));
  }
};

}  // namespace

CpuBackend::CpuBackend(int n_threads) : pool_(std::make_unique<ThreadPool>(n_threads)) {}
CpuBackend::~CpuBackend() = default;

// ---- memory ----------------------------------------------------------------------------

Result<Tensor> CpuBackend::alloc(GgmlType type, std::span<const int64_t> shape) {
  Tensor t = make_descriptor(type, shape);
  const size_t n = static_cast<size_t>(t.rank > 1 ? t.shape[0] * t.stride[0]
                                                  : ggml_row_bytes(type, t.shape[0]).value_or(0));
  if (shape.empty() || n == 0) return Status::errorf("cpu alloc: empty shape {}", t.describe());
  void* p = ::operator new(n, std::align_val_t(64));
  std::memset(p, 0, n);
  t.data = p;
  t.owner = std::shared_ptr<void>(p, Deleter{n, false});
  t.backend = this;
  return t;
}

Result<Tensor> CpuBackend::reserve(GgmlType type, std::span<const int64_t> shape) {
  Tensor t = make_descriptor(type, shape);
  const size_t n = static_cast<size_t>(t.rank > 1 ? t.shape[0] * t.stride[0]
                                                  : ggml_row_bytes(type, t.shape[0]).value_or(0));
  if (shape.empty() || n == 0) return Status::errorf("cpu reserve: empty shape {}", t.describe());
  // Anonymous private pages are zero and cost nothing until first written.
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (p == MAP_FAILED)
    return Status::errorf("cpu reserve: cannot reserve {} bytes for {}", n, t.describe());
  t.data = p;
  t.owner = std::shared_ptr<void>(p, Deleter{n, true});
  t.backend = this;
  return t;
}

Result<Tensor> CpuBackend::weight(const gguf::TensorInfo& info) {
  if (info.ne.empty() || info.ne.size() > 4)
    return Status::errorf("tensor {}: rank {} unsupported", info.name, info.ne.size());
  std::vector<int64_t> shape(info.ne.rbegin(), info.ne.rend());
  Tensor t = make_descriptor(info.type, shape);
  t.data = const_cast<uint8_t*>(info.data);  // read-only mapping; ops never write weights
  t.backend = this;
  return t;
}

Status CpuBackend::upload(const Tensor& dst, const void* host, size_t bytes) {
  if (!dst.contiguous()) return Status::errorf("cpu upload: {} is not contiguous", dst.describe());
  std::memcpy(dst.data, host, bytes);
  return Status::ok();
}

Status CpuBackend::download(const Tensor& src, void* host, size_t bytes) {
  if (!src.contiguous()) return Status::errorf("cpu download: {} is not contiguous", src.describe());
  std::memcpy(host, src.data, bytes);
  return Status::ok();
}

Status CpuBackend::copy_rows(const Tensor& src, const Tensor& dst) {
  if (src.type != dst.type || src.cols() != dst.cols() || dst.rows() < src.rows())
    return Status::errorf("cpu copy_rows: {} into {}", src.describe(), dst.describe());
  const size_t row_bytes = ggml_row_bytes(src.type, src.cols()).value_or(0);
  for (int64_t r = 0; r < src.rows(); ++r)
    std::memcpy(static_cast<uint8_t*>(dst.data) + r * dst.row_stride(), byte_row(src, r),
                row_bytes);
  return Status::ok();
}

// ---- dense operations ---------------------------------------------------------------------

Status CpuBackend::matmul(const Tensor& w, const Tensor& x, const Tensor& y, MatmulMode mode) {
  const int64_t n_in = w.cols(), n_out = w.rows(), n_rows = x.rows();
  DSV4_TRY(expect(x, "matmul", "x", GgmlType::F32, -1, n_in));
  DSV4_TRY(expect(y, "matmul", "y", GgmlType::F32, n_rows, n_out));
  const GgmlType act = dot_activation_type(w.type);
  if (mode == MatmulMode::Quantized && act != GgmlType::F32) {
    // Quantise every activation row once, then integer dot products.
    const size_t act_bytes = ggml_row_bytes(act, n_in).value_or(0);
    std::vector<uint8_t> qx(act_bytes * n_rows);
    pool_->parallel_for(n_rows, [&](int64_t b, int64_t e, int) {
      for (int64_t s = b; s < e; ++s) quantize_activations(act, f32_row(x, s), &qx[s * act_bytes], n_in);
    });
    pool_->parallel_for(n_out, [&](int64_t b, int64_t e, int) {
      for (int64_t o = b; o < e; ++o)
        for (int64_t s = 0; s < n_rows; ++s)
          f32_row(y, s)[o] = dot_row_quantized(w.type, byte_row(w, o), &qx[s * act_bytes], n_in);
    }, 4);
    return Status::ok();
  }
  pool_->parallel_for(n_out, [&](int64_t b, int64_t e, int) {
    for (int64_t o = b; o < e; ++o)
      for (int64_t s = 0; s < n_rows; ++s)
        f32_row(y, s)[o] = dot_row_f32(w.type, byte_row(w, o), f32_row(x, s), n_in);
  }, 4);
  return Status::ok();
}

Status CpuBackend::get_rows(const Tensor& table, const Tensor& ids, const Tensor& y) {
  DSV4_TRY(expect(ids, "get_rows", "ids", GgmlType::I32, -1, -1));
  const int64_t n = ids.n_elements();
  DSV4_TRY(expect(y, "get_rows", "y", GgmlType::F32, n, table.cols()));
  const int32_t* id = static_cast<const int32_t*>(ids.data);
  for (int64_t s = 0; s < n; ++s) {
    if (id[s] < 0 || id[s] >= table.rows())
      return Status::errorf("get_rows: token id {} at row {} outside [0, {})", id[s], s, table.rows());
    dequantize_row(table.type, byte_row(table, id[s]), f32_row(y, s), table.cols());
  }
  return Status::ok();
}

Status CpuBackend::rms_norm(const Tensor& x, const Tensor* weight, float eps, int64_t width,
                            const Tensor& y) {
  DSV4_TRY(expect(x, "rms_norm", "x", GgmlType::F32, -1, -1));
  DSV4_TRY(expect(y, "rms_norm", "y", GgmlType::F32, x.rows(), x.cols()));
  if (width <= 0 || x.cols() % width)
    return Status::errorf("rms_norm: width {} does not divide row {}", width, x.cols());
  if (weight) DSV4_TRY(expect(*weight, "rms_norm", "weight", GgmlType::F32, -1, width));
  const float* w = weight ? static_cast<const float*>(weight->data) : nullptr;
  pool_->parallel_for(x.rows(), [&](int64_t b, int64_t e, int) {
    for (int64_t s = b; s < e; ++s)
      for (int64_t g = 0; g < x.cols(); g += width)
        cpu::rms_norm(f32_row(x, s) + g, w, eps, width, f32_row(y, s) + g);
  });
  return Status::ok();
}

Status CpuBackend::rope(const Tensor& x, int64_t head_dim, const Tensor& positions,
                        const RopeParams& p, bool inverse) {
  DSV4_TRY(expect(x, "rope", "x", GgmlType::F32, -1, -1));
  DSV4_TRY(expect(positions, "rope", "positions", GgmlType::I32, -1, -1));
  if (positions.n_elements() < x.rows() || head_dim < p.dims || x.cols() % head_dim || p.dims % 2)
    return Status::errorf("rope: x {} head_dim {} rope dims {} positions {}", x.describe(),
                          head_dim, p.dims, positions.describe());
  const std::vector<float> omega = cpu::rope_frequencies(p);
  const int32_t* pos = static_cast<const int32_t*>(positions.data);
  pool_->parallel_for(x.rows(), [&](int64_t b, int64_t e, int) {
    for (int64_t s = b; s < e; ++s)
      for (int64_t h = head_dim; h <= x.cols(); h += head_dim)
        cpu::rope_rotate(f32_row(x, s) + h - p.dims, omega, pos[s], inverse);
  });
  return Status::ok();
}

Status CpuBackend::add(const Tensor& x, const Tensor& y) {
  DSV4_TRY(expect(x, "add", "x", GgmlType::F32, -1, -1));
  DSV4_TRY(expect(y, "add", "y", GgmlType::F32, x.rows(), x.cols()));
  for (int64_t s = 0; s < x.rows(); ++s) {
    const float* a = f32_row(x, s);
    float* o = f32_row(y, s);
    for (int64_t i = 0; i < x.cols(); ++i) o[i] += a[i];
  }
  return Status::ok();
}

Status CpuBackend::scale(const Tensor& x, float factor) {
  DSV4_TRY(expect(x, "scale", "x", GgmlType::F32, -1, -1));
  for (int64_t s = 0; s < x.rows(); ++s) {
    float* o = f32_row(x, s);
    for (int64_t i = 0; i < x.cols(); ++i) o[i] *= factor;
  }
  return Status::ok();
}

// ---- hyper-connections ------------------------------------------------------------------

Status CpuBackend::hc_pre(const Tensor& streams, const Tensor& mixes, const Tensor& scale,
                          const Tensor& base, int n_hc, int sinkhorn_iters, float hc_eps,
                          float norm_eps, const Tensor& x, const Tensor& post,
                          const Tensor& comb) {
  const int64_t n = streams.rows(), width = streams.cols() / n_hc, n_mix = (2 + n_hc) * n_hc;
  DSV4_TRY(expect(streams, "hc_pre", "streams", GgmlType::F32, -1, n_hc * width));
  DSV4_TRY(expect(mixes, "hc_pre", "mixes", GgmlType::F32, n, n_mix));
  DSV4_TRY(expect(scale, "hc_pre", "scale", GgmlType::F32, -1, 3));
  DSV4_TRY(expect(base, "hc_pre", "base", GgmlType::F32, -1, n_mix));
  DSV4_TRY(expect(x, "hc_pre", "x", GgmlType::F32, n, width));
  DSV4_TRY(expect(post, "hc_pre", "post", GgmlType::F32, n, n_hc));
  DSV4_TRY(expect(comb, "hc_pre", "comb", GgmlType::F32, n, n_hc * n_hc));
  pool_->parallel_for(n, [&](int64_t b, int64_t e, int) {
    std::vector<float> pre(n_hc);
    for (int64_t s = b; s < e; ++s) {
      const float* X = f32_row(streams, s);
      const float rho = cpu::inverse_rms(X, n_hc * width, norm_eps);
      cpu::hc_split_sinkhorn(f32_row(mixes, s), rho, static_cast<const float*>(scale.data),
                             static_cast<const float*>(base.data), n_hc, sinkhorn_iters, hc_eps,
                             pre.data(), f32_row(post, s), f32_row(comb, s));
      cpu::hc_collapse(X, pre.data(), n_hc, width, f32_row(x, s));
    }
  });
  return Status::ok();
}

Status CpuBackend::hc_post(const Tensor& y, const Tensor& post, const Tensor& comb, int n_hc,
                           const Tensor& streams) {
  const int64_t n = y.rows(), width = y.cols();
  DSV4_TRY(expect(y, "hc_post", "y", GgmlType::F32, -1, -1));
  DSV4_TRY(expect(post, "hc_post", "post", GgmlType::F32, n, n_hc));
  DSV4_TRY(expect(comb, "hc_post", "comb", GgmlType::F32, n, n_hc * n_hc));
  DSV4_TRY(expect(streams, "hc_post", "streams", GgmlType::F32, n, n_hc * width));
  pool_->parallel_for(n, [&](int64_t b, int64_t e, int) {
    std::vector<float> old(n_hc * width);
    for (int64_t s = b; s < e; ++s) {
      float* X = f32_row(streams, s);
      std::copy(X, X + n_hc * width, old.begin());
      const float* p = f32_row(post, s);
      const float* c = f32_row(comb, s);
      const float* a = f32_row(y, s);
      for (int k = 0; k < n_hc; ++k)
        for (int64_t i = 0; i < width; ++i) {
          float acc = p[k] * a[i];
          for (int j = 0; j < n_hc; ++j) acc += c[j * n_hc + k] * old[j * width + i];
          X[k * width + i] = acc;
        }
    }
  });
  return Status::ok();
}

Status CpuBackend::hc_head(const Tensor& streams, const Tensor& mixes, const Tensor& scale,
                           const Tensor& base, int n_hc, float hc_eps, float norm_eps,
                           const Tensor& x) {
  const int64_t n = streams.rows(), width = streams.cols() / n_hc;
  DSV4_TRY(expect(streams, "hc_head", "streams", GgmlType::F32, -1, n_hc * width));
  DSV4_TRY(expect(mixes, "hc_head", "mixes", GgmlType::F32, n, n_hc));
  DSV4_TRY(expect(base, "hc_head", "base", GgmlType::F32, -1, n_hc));
  DSV4_TRY(expect(x, "hc_head", "x", GgmlType::F32, n, width));
  const float sc = static_cast<const float*>(scale.data)[0];
  const float* bs = static_cast<const float*>(base.data);
  for (int64_t s = 0; s < n; ++s) {
    const float* X = f32_row(streams, s);
    const float rho = cpu::inverse_rms(X, n_hc * width, norm_eps);
    std::vector<float> w(n_hc);
    for (int j = 0; j < n_hc; ++j)
      w[j] = cpu::sigmoid(f32_row(mixes, s)[j] * rho * sc + bs[j]) + hc_eps;
    cpu::hc_collapse(X, w.data(), n_hc, width, f32_row(x, s));
  }
  return Status::ok();
}

// ---- attention ----------------------------------------------------------------------------

Status CpuBackend::sparse_attention(const Tensor& q, const Tensor& kv_a, const Tensor& kv_b,
                                    const Tensor& idx, const Tensor& sink, float scale,
                                    const Tensor& out) {
  const int64_t d = kv_a.cols(), n = q.rows(), n_heads = q.cols() / d;
  const int64_t n_a = kv_a.rows(), n_b = kv_b.valid() ? kv_b.rows() : 0;
  DSV4_TRY(expect(q, "sparse_attention", "q", GgmlType::F32, -1, n_heads * d));
  DSV4_TRY(expect(kv_a, "sparse_attention", "kv_a", GgmlType::F32, -1, d));
  if (n_b) DSV4_TRY(expect(kv_b, "sparse_attention", "kv_b", GgmlType::F32, -1, d));
  DSV4_TRY(expect(idx, "sparse_attention", "idx", GgmlType::I32, n, -1));
  DSV4_TRY(expect(sink, "sparse_attention", "sink", GgmlType::F32, -1, n_heads));
  DSV4_TRY(expect(out, "sparse_attention", "out", GgmlType::F32, n, n_heads * d));
  const int64_t k_slots = idx.cols();
  for (int64_t s = 0; s < n; ++s)
    for (int64_t j = 0; j < k_slots; ++j) {
      const int32_t i = i32_row(idx, s)[j];
      if (i < -1 || i >= n_a + n_b)
        return Status::errorf("sparse_attention: key index {} (row {}, slot {}) outside [-1, {})",
                              i, s, j, n_a + n_b);
    }
  const float* z = static_cast<const float*>(sink.data);
  pool_->parallel_for(n * n_heads, [&](int64_t b, int64_t e, int) {
    std::vector<const float*> keys(k_slots);
    std::vector<float> logits(k_slots);
    for (int64_t sh = b; sh < e; ++sh) {
      const int64_t s = sh / n_heads, h = sh % n_heads;
      int64_t n_keys = 0;
      for (int64_t j = 0; j < k_slots; ++j) {
        const int32_t i = i32_row(idx, s)[j];
        if (i < 0) continue;
        keys[n_keys++] = i < n_a ? f32_row(kv_a, i) : f32_row(kv_b, i - n_a);
      }
      cpu::attend_with_sink(f32_row(q, s) + h * d, keys.data(), n_keys, d, scale, z[h],
                            logits.data(), f32_row(out, s) + h * d);
    }
  });
  return Status::ok();
}

Result<int64_t> CpuBackend::compress(const Tensor& kv, const Tensor& score, const Tensor& ape,
                                     int64_t first_pos, int ratio, bool overlap,
                                     const Tensor& state_kv, const Tensor& state_score,
                                     const Tensor& entries) {
  const int o = overlap ? 2 : 1;
  const int64_t wide = kv.cols(), w = wide / o, n = kv.rows();
  DSV4_TRY(expect(kv, "compress", "kv", GgmlType::F32, -1, o * w));
  DSV4_TRY(expect(score, "compress", "score", GgmlType::F32, n, o * w));
  DSV4_TRY(expect(ape, "compress", "ape", GgmlType::F32, ratio, o * w));
  DSV4_TRY(expect(state_kv, "compress", "state_kv", GgmlType::F32, o * ratio, o * w));
  DSV4_TRY(expect(state_score, "compress", "state_score", GgmlType::F32, o * ratio, o * w));
  const int64_t n_new = (first_pos + n) / ratio - first_pos / ratio;
  if (n_new) DSV4_TRY(expect(entries, "compress", "entries", GgmlType::F32, n_new, w));
  const int64_t cur = overlap ? ratio : 0;  // first state row of the open block
  int64_t written = 0;
  for (int64_t s = 0; s < n; ++s) {
    const int64_t slot = (first_pos + s) % ratio;
    float* sk = f32_row(state_kv, cur + slot);
    float* ss = f32_row(state_score, cur + slot);
    const float* a = f32_row(ape, slot);
    std::copy(f32_row(kv, s), f32_row(kv, s) + wide, sk);
    for (int64_t c = 0; c < wide; ++c) ss[c] = f32_row(score, s)[c] + a[c];
    if (slot != ratio - 1) continue;
    cpu::pool_block(
        [&](int64_t row) { return f32_row(state_kv, row); },
        [&](int64_t row) { return f32_row(state_score, row); }, ratio, overlap, w,
        f32_row(entries, written++));
    if (overlap)  // the closed block becomes the previous block of the next entry
      for (int64_t r = 0; r < ratio; ++r) {
        std::copy(f32_row(state_kv, cur + r), f32_row(state_kv, cur + r) + wide, f32_row(state_kv, r));
        std::copy(f32_row(state_score, cur + r), f32_row(state_score, cur + r) + wide,
                  f32_row(state_score, r));
      }
  }
  return written;
}

Status CpuBackend::indexer_scores(const Tensor& q, const Tensor& w, const Tensor& keys,
                                  const Tensor& visible, const Tensor& scores) {
  const int64_t n = q.rows(), dk = keys.cols(), n_heads = w.cols(), n_keys = scores.cols();
  DSV4_TRY(expect(q, "indexer_scores", "q", GgmlType::F32, -1, n_heads * dk));
  DSV4_TRY(expect(w, "indexer_scores", "w", GgmlType::F32, n, n_heads));
  DSV4_TRY(expect(keys, "indexer_scores", "keys", GgmlType::F32, -1, dk));
  DSV4_TRY(expect(visible, "indexer_scores", "visible", GgmlType::I32, -1, -1));
  DSV4_TRY(expect(scores, "indexer_scores", "scores", GgmlType::F32, n, -1));
  const int32_t* vis = static_cast<const int32_t*>(visible.data);
  for (int64_t s = 0; s < n; ++s)
    if (vis[s] < 0 || vis[s] > std::min<int64_t>(n_keys, keys.rows()))
      return Status::errorf("indexer_scores: row {} sees {} keys, have {}", s, vis[s], keys.rows());
  pool_->parallel_for(n, [&](int64_t b, int64_t e, int) {
    for (int64_t s = b; s < e; ++s) {
      float* out = f32_row(scores, s);
      for (int64_t k = 0; k < n_keys; ++k)
        out[k] = k < vis[s] ? cpu::indexer_score(f32_row(q, s), f32_row(w, s), f32_row(keys, k),
                                                 n_heads, dk)
                            : kNegInf;
    }
  });
  return Status::ok();
}

Status CpuBackend::top_k(const Tensor& scores, const Tensor& visible, int k, int32_t offset,
                         const Tensor& idx) {
  const int64_t n = scores.rows();
  DSV4_TRY(expect(scores, "top_k", "scores", GgmlType::F32, -1, -1));
  DSV4_TRY(expect(visible, "top_k", "visible", GgmlType::I32, -1, -1));
  if (idx.type != GgmlType::I32 || idx.rows() < n || idx.cols() < k)
    return Status::errorf("top_k: idx {} cannot hold {} x {}", idx.describe(), n, k);
  const int32_t* vis = static_cast<const int32_t*>(visible.data);
  for (int64_t s = 0; s < n; ++s) {
    const int64_t m = std::min<int64_t>(vis[s], scores.cols());
    std::vector<int32_t> order(m);
    std::iota(order.begin(), order.end(), 0);
    const float* sc = f32_row(scores, s);
    const int64_t take = std::min<int64_t>(k, m);
    // Highest score first; equal scores keep the lower index (a fixed, documented rule).
    std::partial_sort(order.begin(), order.begin() + take, order.end(), [&](int32_t a, int32_t b) {
      return sc[a] > sc[b] || (sc[a] == sc[b] && a < b);
    });
    std::sort(order.begin(), order.begin() + take);
    int32_t* out = i32_row(idx, s);
    for (int j = 0; j < k; ++j) out[j] = j < take ? order[j] + offset : -1;
  }
  return Status::ok();
}

// ---- QAT roundings ------------------------------------------------------------------------

Status CpuBackend::hadamard(const Tensor& x, int64_t width) {
  DSV4_TRY(expect(x, "hadamard", "x", GgmlType::F32, -1, -1));
  if (width <= 0 || (width & (width - 1)) || x.cols() % width)
    return Status::errorf("hadamard: width {} must be a power of two dividing {}", width, x.cols());
  for (int64_t s = 0; s < x.rows(); ++s)
    for (int64_t g = 0; g < x.cols(); g += width) cpu::hadamard(f32_row(x, s) + g, width);
  return Status::ok();
}

Status CpuBackend::round_fp8_blocks(const Tensor& x, int64_t cols, int64_t block) {
  DSV4_TRY(expect(x, "round_fp8_blocks", "x", GgmlType::F32, -1, -1));
  if (block <= 0 || cols % block || cols > x.cols())
    return Status::errorf("round_fp8_blocks: {} columns in blocks of {} of {}", cols, block,
                          x.describe());
  for (int64_t s = 0; s < x.rows(); ++s)
    for (int64_t g = 0; g < cols; g += block) cpu::round_fp8_block(f32_row(x, s) + g, block);
  return Status::ok();
}

Status CpuBackend::round_fp4_blocks(const Tensor& x, int64_t block) {
  DSV4_TRY(expect(x, "round_fp4_blocks", "x", GgmlType::F32, -1, -1));
  if (block <= 0 || x.cols() % block)
    return Status::errorf("round_fp4_blocks: blocks of {} of {}", block, x.describe());
  for (int64_t s = 0; s < x.rows(); ++s)
    for (int64_t g = 0; g < x.cols(); g += block) cpu::round_fp4_block(f32_row(x, s) + g, block);
  return Status::ok();
}

// ---- MoE ------------------------------------------------------------------------------------

Status CpuBackend::route(const Tensor& logits, const Tensor* bias, const Tensor* tid2eid,
                         const Tensor& tokens, int k, float route_scale, const Tensor& experts,
                         const Tensor& weights) {
  const int64_t n = logits.rows(), n_experts = logits.cols();
  DSV4_TRY(expect(logits, "route", "logits", GgmlType::F32, -1, -1));
  DSV4_TRY(expect(experts, "route", "experts", GgmlType::I32, n, k));
  DSV4_TRY(expect(weights, "route", "weights", GgmlType::F32, n, k));
  if (tid2eid) {
    DSV4_TRY(expect(*tid2eid, "route", "tid2eid", GgmlType::I32, -1, k));
    DSV4_TRY(expect(tokens, "route", "tokens", GgmlType::I32, -1, -1));
  } else if (bias) {
    DSV4_TRY(expect(*bias, "route", "bias", GgmlType::F32, -1, n_experts));
  }
  std::vector<float> sc(n_experts);
  std::vector<int32_t> sel(k);
  for (int64_t s = 0; s < n; ++s) {
    for (int64_t e = 0; e < n_experts; ++e) sc[e] = cpu::sqrt_softplus(f32_row(logits, s)[e]);
    if (tid2eid) {
      const int32_t token = static_cast<const int32_t*>(tokens.data)[s];
      if (token < 0 || token >= tid2eid->rows())
        return Status::errorf("route: token id {} outside the hash table's {} rows", token,
                              tid2eid->rows());
      std::copy(i32_row(*tid2eid, token), i32_row(*tid2eid, token) + k, sel.begin());
      for (int32_t e : sel)
        if (e < 0 || e >= n_experts)
          return Status::errorf("route: tid2eid[{}] holds expert {} outside [0, {})", token, e, n_experts);
    } else {
      cpu::biased_top_k(sc.data(), bias ? static_cast<const float*>(bias->data) : nullptr,
                        n_experts, k, sel.data());
    }
    std::sort(sel.begin(), sel.end());
    float sum = 0;
    for (int j = 0; j < k; ++j) sum += sc[sel[j]];
    for (int j = 0; j < k; ++j) {
      i32_row(experts, s)[j] = sel[j];
      f32_row(weights, s)[j] = sc[sel[j]] / sum * route_scale;
    }
  }
  return Status::ok();
}

Status CpuBackend::moe_experts(const Tensor& x, const Tensor& gate, const Tensor& up,
                               const Tensor& down, const Tensor& experts, const Tensor& weights,
                               float limit, MatmulMode mode, const Tensor& y) {
  const int64_t n = x.rows(), d = x.cols(), k = experts.cols();
  const int64_t n_experts = gate.dim(0), inter = gate.dim(1);
  if (gate.rank != 3 || up.rank != 3 || down.rank != 3 || gate.dim(2) != d ||
      down.dim(1) != d || down.dim(2) != inter)
    return Status::errorf("moe_experts: gate {} up {} down {} for x {}", gate.describe(),
                          up.describe(), down.describe(), x.describe());
  DSV4_TRY(expect(experts, "moe_experts", "experts", GgmlType::I32, n, k));
  DSV4_TRY(expect(weights, "moe_experts", "weights", GgmlType::F32, n, k));
  DSV4_TRY(expect(y, "moe_experts", "y", GgmlType::F32, n, d));
  // Each (token, slot) pair's expert output lands in its own row; the per-token sums run
  // in slot order afterwards, so the result does not depend on who else is in the batch.
  DSV4_ASSIGN_OR_RETURN(Tensor outs, alloc(GgmlType::F32, std::vector<int64_t>{n * k, d}));
  for (int64_t e = 0; e < n_experts; ++e) {
    std::vector<int64_t> pairs;
    for (int64_t s = 0; s < n; ++s)
      for (int64_t j = 0; j < k; ++j)
        if (i32_row(experts, s)[j] == e) pairs.push_back(s * k + j);
    if (pairs.empty()) continue;
    const int64_t m = static_cast<int64_t>(pairs.size());
    DSV4_ASSIGN_OR_RETURN(Tensor xs, alloc(GgmlType::F32, std::vector<int64_t>{m, d}));
    DSV4_ASSIGN_OR_RETURN(Tensor g, alloc(GgmlType::F32, std::vector<int64_t>{m, inter}));
    DSV4_ASSIGN_OR_RETURN(Tensor u, alloc(GgmlType::F32, std::vector<int64_t>{m, inter}));
    DSV4_ASSIGN_OR_RETURN(Tensor o, alloc(GgmlType::F32, std::vector<int64_t>{m, d}));
    for (int64_t i = 0; i < m; ++i) std::copy(f32_row(x, pairs[i] / k), f32_row(x, pairs[i] / k) + d, f32_row(xs, i));
    DSV4_TRY(matmul(gate.at(e), xs, g, mode));
    DSV4_TRY(matmul(up.at(e), xs, u, mode));
    for (int64_t i = 0; i < m; ++i)
      cpu::swiglu(f32_row(g, i), f32_row(u, i), inter, limit,
                  f32_row(weights, pairs[i] / k)[pairs[i] % k], f32_row(g, i));
    DSV4_TRY(matmul(down.at(e), g, o, mode));
    for (int64_t i = 0; i < m; ++i) std::copy(f32_row(o, i), f32_row(o, i) + d, f32_row(outs, pairs[i]));
  }
  for (int64_t s = 0; s < n; ++s)
    for (int64_t j = 0; j < k; ++j) {
      const float* a = f32_row(outs, s * k + j);
      float* out = f32_row(y, s);
      for (int64_t i = 0; i < d; ++i) out[i] += a[i];
    }
  return Status::ok();
}

Status CpuBackend::swiglu_expert(const Tensor& x, const Tensor& gate, const Tensor& up,
                                 const Tensor& down, float limit, MatmulMode mode,
                                 const Tensor& y) {
  const int64_t n = x.rows(), inter = gate.rows();
  DSV4_ASSIGN_OR_RETURN(Tensor g, alloc(GgmlType::F32, std::vector<int64_t>{n, inter}));
  DSV4_ASSIGN_OR_RETURN(Tensor u, alloc(GgmlType::F32, std::vector<int64_t>{n, inter}));
  DSV4_ASSIGN_OR_RETURN(Tensor o, alloc(GgmlType::F32, std::vector<int64_t>{n, x.cols()}));
  DSV4_TRY(matmul(gate, x, g, mode));
  DSV4_TRY(matmul(up, x, u, mode));
  for (int64_t s = 0; s < n; ++s) cpu::swiglu(f32_row(g, s), f32_row(u, s), inter, limit, 1.0f, f32_row(g, s));
  DSV4_TRY(matmul(down, g, o, mode));
  return add(o, y);
}

}  // namespace dsv4::backend
