#include "backend/cpu/cpu_backend.h"

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "backend/cpu/cpu_math.h"
#include "backend/sampling.h"
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

// Host views of a step's metadata (the CPU backend's tensors are host memory).
struct StepView {
  int64_t n = 0, n_seqs = 0;
  const int32_t* positions = nullptr;
  const int32_t* row_seq = nullptr;
  const int32_t* seqs = nullptr;  // [n_seqs][kSeqFields]

  const int32_t* seq(int64_t s) const { return seqs + s * kSeqFields; }
  // The sequence of row r, or nullptr for a padding row.
  const int32_t* seq_of_row(int64_t r) const { return row_seq[r] < 0 ? nullptr : seq(row_seq[r]); }
};

Result<StepView> step_view(const StepRows& rows, const char* op) {
  for (const Tensor* t : {&rows.positions, &rows.row_seq})
    if (!t->valid() || t->type != GgmlType::I32 || t->n_elements() < rows.n || !t->contiguous())
      return Status::errorf(StatusCode::kInternal, "{}: step rows: positions/row_seq {} for {} rows", op,
                            t->describe(), rows.n);
  if (rows.n_seqs > 0 && (!rows.seqs.valid() || rows.seqs.type != GgmlType::I32 ||
                          rows.seqs.rows() < rows.n_seqs || rows.seqs.cols() != kSeqFields || !rows.seqs.contiguous()))
    return Status::errorf(StatusCode::kInternal, "{}: step rows: seqs {} for {} sequences", op, rows.seqs.describe(),
                          rows.n_seqs);
  StepView v{rows.n, rows.n_seqs, static_cast<const int32_t*>(rows.positions.data),
             static_cast<const int32_t*>(rows.row_seq.data), static_cast<const int32_t*>(rows.seqs.data)};
  for (int64_t r = 0; r < v.n; ++r)
    if (v.row_seq[r] >= v.n_seqs || v.row_seq[r] < -1 || v.positions[r] < 0)
      return Status::errorf(StatusCode::kInternal, "{}: row {} has sequence {} of {} at position {}", op, r,
                            v.row_seq[r], v.n_seqs, v.positions[r]);
  for (int64_t s = 0; s < v.n_seqs; ++s) {
    const int32_t* f = v.seq(s);
    if (f[kSeqFirstRow] < 0 || f[kSeqRows] < 0 || f[kSeqFirstRow] + f[kSeqRows] > v.n || f[kSeqFirstPos] < 0 ||
        f[kSeqSlot] < 0 || f[kSeqWindowStart] < 0 || f[kSeqWindowStart] > f[kSeqFirstPos])
      return Status::errorf(StatusCode::kInternal, "{}: sequence {}: rows {}+{} of {}, position {}, slot {}", op, s,
                            f[kSeqFirstRow], f[kSeqRows], v.n, f[kSeqFirstPos], f[kSeqSlot]);
  }
  return v;
}

// Row `i` of slot `slot`'s paged list, or nullptr when no page holds it.
float* paged_row(const PagedRows& p, int32_t slot, int64_t i) {
  const int64_t pi = i / p.page_rows;
  if (slot < 0 || slot >= p.page_table.rows() || i < 0 || pi >= p.page_table.cols()) return nullptr;
  const int32_t page = i32_row(p.page_table, slot)[pi];
  if (page < 0 || (int64_t{page} + 1) * p.page_rows > p.pool.rows()) return nullptr;
  return f32_row(p.pool, int64_t{page} * p.page_rows + i % p.page_rows);
}

// A slot's first existing row of a paged list (0 without a first_row table).
int64_t first_row(const PagedRows& p, int32_t slot) {
  return p.first_row.valid() ? static_cast<const int32_t*>(p.first_row.data)[slot] : 0;
}

Status expect_paged(const PagedRows& p, const char* op, int64_t width) {
  if (!p.pool.valid() || p.pool.type != GgmlType::F32 || p.pool.cols() != width || p.page_rows <= 0 ||
      !p.page_table.valid() || p.page_table.type != GgmlType::I32 ||
      (p.first_row.valid() && (p.first_row.type != GgmlType::I32 || p.first_row.n_elements() < p.page_table.rows() ||
                               !p.first_row.contiguous())))
    return Status::errorf(StatusCode::kInternal, "{}: paged rows: pool {} ({} rows per page), table {}, expected width {}",
                          op, p.pool.describe(), p.page_rows, p.page_table.describe(), width);
  return Status::ok();
}

bool slot_ok(const SlotRows& r, int32_t slot) { return slot >= 0 && (int64_t{slot} + 1) * r.rows_per_slot <= r.data.rows(); }

}  // namespace

CpuBackend::CpuBackend(int n_threads) : pool_(std::make_unique<ThreadPool>(n_threads)) {
  const char* env = std::getenv("DSV4_POISON_SCRATCH");
  poison_scratch_ = env && env[0] == '1';
}
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

Status CpuBackend::fill(const Tensor& t, float value) {
  if (t.type != GgmlType::F32 && t.type != GgmlType::I32)
    return Status::errorf("cpu fill: {} is neither f32 nor i32", t.describe());
  if (t.type == GgmlType::F32) {
    for (int64_t r = 0; r < t.rows(); ++r) std::fill_n(f32_row(t, r), t.cols(), value);
    return Status::ok();
  }
  // Converting a float outside int32's range (an f32 fill's -inf) is undefined behaviour.
  if (!(value >= -2147483648.0f && value < 2147483648.0f) || value != std::trunc(value))
    return Status::errorf("cpu fill: {} is not an int32 value for {}", value, t.describe());
  const auto as_int = static_cast<int32_t>(value);
  for (int64_t r = 0; r < t.rows(); ++r) std::fill_n(i32_row(t, r), t.cols(), as_int);
  return Status::ok();
}

void CpuBackend::begin_step() {
  if (chunks_.size() > 1) {  // one chunk of the total next time
    size_t total = 0;
    for (const Chunk& c : chunks_) total += c.bytes;
    chunks_.clear();
    void* p = ::operator new(total, std::align_val_t(64));
    chunks_.push_back({std::shared_ptr<void>(p, Deleter{total, false}), total});
  }
  chunk_ = 0;
  chunk_used_ = 0;
}

void CpuBackend::scratch_release(ScratchMark mark) {
  chunk_ = mark.chunk;
  chunk_used_ = mark.offset;
}

Result<Tensor> CpuBackend::scratch(GgmlType type, std::span<const int64_t> shape) {
  Tensor t = make_descriptor(type, shape);
  const size_t n = static_cast<size_t>(t.rank > 1 ? t.shape[0] * t.stride[0]
                                                  : ggml_row_bytes(type, t.shape[0]).value_or(0));
  if (shape.empty() || n == 0) return Status::errorf("cpu scratch: empty shape {}", t.describe());
  const size_t need = (n + 63) / 64 * 64;
  // The current chunk, else the next one that holds it, else a new one.
  while (chunk_ < chunks_.size() && chunk_used_ + need > chunks_[chunk_].bytes) {
    ++chunk_;
    chunk_used_ = 0;
  }
  if (chunk_ == chunks_.size()) {
    const size_t bytes = std::max<size_t>(need, size_t{16} << 20);
    void* p = ::operator new(bytes, std::align_val_t(64));
    chunks_.push_back({std::shared_ptr<void>(p, Deleter{bytes, false}), bytes});
    chunk_used_ = 0;
  }
  t.data = static_cast<uint8_t*>(chunks_[chunk_].memory.get()) + chunk_used_;
  chunk_used_ += need;
  t.backend = this;
  if (poison_scratch_) {
    if (type == GgmlType::F32) std::fill_n(static_cast<float*>(t.data), n / sizeof(float), std::numeric_limits<float>::quiet_NaN());
    else std::memset(t.data, 0xA5, n);
  }
  return t;
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
  if (mode == MatmulMode::Sequential) {
    // Per output, an fma chain from zero over each block of kSequentialBlock inputs, the
    // blocks' sums added in order: the K blocking of the reference's fp32 sgemm (tiny-v41's
    // main_proj, K = 384, is bit-identical this way). F32 weights run four outputs side by
    // side; other types decode a row at a time.
    constexpr int64_t kSequentialBlock = 192;
    pool_->parallel_for(n_out, [&](int64_t b, int64_t e, int) {
      std::vector<float> decoded;
      for (int64_t o0 = b; o0 < e; o0 += 4) {
        const int64_t m = std::min<int64_t>(4, e - o0);
        const float* r[4] = {};
        for (int64_t j = 0; j < m; ++j) {
          if (w.type == GgmlType::F32) {
            r[j] = reinterpret_cast<const float*>(byte_row(w, o0 + j));
            continue;
          }
          decoded.resize(static_cast<size_t>(4 * n_in));
          dequantize_row(w.type, byte_row(w, o0 + j), decoded.data() + j * n_in, n_in);
          r[j] = decoded.data() + j * n_in;
        }
        for (int64_t s = 0; s < n_rows; ++s) {
          const float* in = f32_row(x, s);
          float sum[4] = {0, 0, 0, 0};
          for (int64_t k0 = 0; k0 < n_in; k0 += kSequentialBlock) {
            float acc[4] = {0, 0, 0, 0};
            for (int64_t k = k0; k < std::min(n_in, k0 + kSequentialBlock); ++k)
              for (int64_t j = 0; j < m; ++j) acc[j] = std::fma(r[j][k], in[k], acc[j]);
            for (int64_t j = 0; j < m; ++j) sum[j] = k0 == 0 ? acc[j] : sum[j] + acc[j];
          }
          for (int64_t j = 0; j < m; ++j) f32_row(y, s)[o0 + j] = sum[j];
        }
      }
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

Status CpuBackend::rms_norm_torch_order(const Tensor& x, const Tensor* weight, float eps, int64_t width,
                                        const Tensor& y) {
  DSV4_TRY(expect(x, "rms_norm_torch_order", "x", GgmlType::F32, -1, -1));
  DSV4_TRY(expect(y, "rms_norm_torch_order", "y", GgmlType::F32, x.rows(), x.cols()));
  if (width <= 0 || x.cols() % width)
    return Status::errorf("rms_norm_torch_order: width {} does not divide row {}", width, x.cols());
  if (weight) DSV4_TRY(expect(*weight, "rms_norm_torch_order", "weight", GgmlType::F32, -1, width));
  const float* w = weight ? static_cast<const float*>(weight->data) : nullptr;
  pool_->parallel_for(x.rows(), [&](int64_t b, int64_t e, int) {
    for (int64_t s = b; s < e; ++s)
      for (int64_t g = 0; g < x.cols(); g += width)
        cpu::rms_norm_torch_order(f32_row(x, s) + g, w, eps, width, f32_row(y, s) + g);
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

Status CpuBackend::attention(const Tensor& q, const AttentionKeys& keys, const StepRows& rows,
                             const Tensor& sink, float scale, const Tensor& out, MatmulMode /*fp32 in every mode*/) {
  const int64_t d = keys.chunk.cols(), n = rows.n, win = keys.window;
  const int64_t n_heads = d ? q.cols() / d : 0;
  DSV4_ASSIGN_OR_RETURN(StepView v, step_view(rows, "attention"));
  DSV4_TRY(expect(keys.chunk, "attention", "chunk", GgmlType::F32, n, d));
  DSV4_TRY(expect(q, "attention", "q", GgmlType::F32, n, n_heads * d));
  DSV4_TRY(expect(sink, "attention", "sink", GgmlType::F32, -1, n_heads));
  DSV4_TRY(expect(out, "attention", "out", GgmlType::F32, n, n_heads * d));
  DSV4_TRY(keys.ring.check("attention", "ring", win, d));
  const bool selected = keys.selected.valid();
  if (keys.ratio) DSV4_TRY(expect_paged(keys.entries, "attention", d));
  if (selected) DSV4_TRY(expect(keys.selected, "attention", "selected", GgmlType::I32, n, -1));
  const int64_t comp_slots = selected ? keys.selected.cols() : 0;
  if (keys.draft_block && keys.ratio) return Status::error("attention: a draft block reads no compressed entries");

  // Every key a row reads must exist: rows of its own sequence, pages in place.
  for (int64_t r = 0; r < n; ++r) {
    const int32_t* sq = v.seq_of_row(r);
    if (!sq) continue;
    if (!slot_ok(keys.ring, sq[kSeqSlot]))
      return Status::errorf(StatusCode::kInternal, "attention: row {}: slot {} outside the ring", r, sq[kSeqSlot]);
    if (!keys.ratio) continue;
    const int64_t visible = (v.positions[r] + 1) / keys.ratio, first = first_row(keys.entries, sq[kSeqSlot]);
    for (int64_t j = selected ? 0 : first; j < (selected ? comp_slots : visible); ++j) {
      const int64_t e = selected ? i32_row(keys.selected, r)[j] : j;
      if (selected && e == -1) continue;
      if (e < first || e >= visible || !paged_row(keys.entries, sq[kSeqSlot], e))
        return Status::errorf(StatusCode::kInternal, "attention: row {} (position {}) selects entry {} of {} visible",
                              r, v.positions[r], e, visible);
    }
  }
  const float* z = static_cast<const float*>(sink.data);
  pool_->parallel_for(n * n_heads, [&](int64_t b, int64_t e, int) {
    std::vector<const float*> key_rows;
    std::vector<float> logits;
    for (int64_t sh = b; sh < e; ++sh) {
      const int64_t r = sh / n_heads, h = sh % n_heads;
      const int32_t* sq = v.seq_of_row(r);
      float* o = f32_row(out, r) + h * d;
      if (!sq) {  // padding row
        std::fill_n(o, d, 0.0f);
        continue;
      }
      const int64_t t = v.positions[r], first_pos = sq[kSeqFirstPos], first_row = sq[kSeqFirstRow];
      const int32_t slot = sq[kSeqSlot];
      key_rows.clear();
      if (keys.draft_block) {  // the ring up to the block, then the whole block (non-causal)
        for (int64_t p = std::max<int64_t>(sq[kSeqWindowStart], first_pos - win); p < first_pos; ++p)
          key_rows.push_back(f32_row(keys.ring.data, keys.ring.ring_row(slot, p)));
        for (int64_t i = 0; i < sq[kSeqRows]; ++i) key_rows.push_back(f32_row(keys.chunk, first_row + i));
      } else {
        for (int64_t p = std::max<int64_t>(sq[kSeqWindowStart], t - win + 1); p <= t; ++p)
          key_rows.push_back(p >= first_pos ? f32_row(keys.chunk, first_row + (p - first_pos))
                                            : f32_row(keys.ring.data, keys.ring.ring_row(slot, p)));
      }
      if (keys.ratio) {
        if (selected) {
          for (int64_t j = 0; j < comp_slots; ++j)
            if (const int32_t i = i32_row(keys.selected, r)[j]; i >= 0)
              key_rows.push_back(paged_row(keys.entries, slot, i));
        } else {
          for (int64_t i = backend::first_row(keys.entries, slot); i < (t + 1) / keys.ratio; ++i)
            key_rows.push_back(paged_row(keys.entries, slot, i));
        }
      }
      logits.resize(key_rows.size());
      cpu::attend_with_sink(f32_row(q, r) + h * d, key_rows.data(), static_cast<int64_t>(key_rows.size()), d,
                            scale, z[h], logits.data(), o);
    }
  });
  return Status::ok();
}

Status CpuBackend::store_window(const Tensor& kv, const StepRows& rows, int64_t window, const SlotRows& ring) {
  const int64_t d = kv.cols();
  DSV4_ASSIGN_OR_RETURN(StepView v, step_view(rows, "store_window"));
  DSV4_TRY(expect(kv, "store_window", "kv", GgmlType::F32, rows.n, -1));
  DSV4_TRY(ring.check("store_window", "ring", window, d));
  for (int64_t s = 0; s < v.n_seqs; ++s) {
    const int32_t* f = v.seq(s);
    if (!slot_ok(ring, f[kSeqSlot]))
      return Status::errorf(StatusCode::kInternal, "store_window: slot {} outside the ring", f[kSeqSlot]);
    // The ring keeps the sequence's last `window` positions.
    for (int64_t i = std::max<int64_t>(0, f[kSeqRows] - window); i < f[kSeqRows]; ++i) {
      const int64_t pos = f[kSeqFirstPos] + i;
      std::copy_n(f32_row(kv, f[kSeqFirstRow] + i), d, f32_row(ring.data, ring.ring_row(f[kSeqSlot], pos)));
    }
  }
  return Status::ok();
}

Status CpuBackend::compress(const Tensor& kv, const Tensor& score, const Tensor& ape, int ratio, bool overlap,
                            const StepRows& rows, const SlotRows& state_kv, const SlotRows& state_score,
                            const Tensor& pooled) {
  const int o = overlap ? 2 : 1;
  const int64_t wide = kv.cols(), w = wide / o, n = rows.n;
  DSV4_ASSIGN_OR_RETURN(StepView v, step_view(rows, "compress"));
  if (ratio <= 0) return Status::errorf("compress: ratio {}", ratio);
  DSV4_TRY(expect(kv, "compress", "kv", GgmlType::F32, n, o * w));
  DSV4_TRY(expect(score, "compress", "score", GgmlType::F32, n, o * w));
  DSV4_TRY(expect(ape, "compress", "ape", GgmlType::F32, ratio, o * w));
  DSV4_TRY(state_kv.check("compress", "state_kv", o * ratio, o * w));
  DSV4_TRY(state_score.check("compress", "state_score", o * ratio, o * w));
  if (state_score.rows_per_slot != state_kv.rows_per_slot)
    return Status::errorf(StatusCode::kInternal, "compress: state rows per slot {} (kv) and {} (score)",
                          state_kv.rows_per_slot, state_score.rows_per_slot);
  DSV4_TRY(expect(pooled, "compress", "pooled", GgmlType::F32, n, w));
  for (int64_t s = 0; s < v.n_seqs; ++s)
    if (!slot_ok(state_kv, v.seq(s)[kSeqSlot]) || !slot_ok(state_score, v.seq(s)[kSeqSlot]))
      return Status::errorf(StatusCode::kInternal, "compress: slot {} outside the states", v.seq(s)[kSeqSlot]);
  // Sequences are independent; each one's rows feed its state in position order, one ring
  // row per position, so a closed block's rows stay where they are (no shifting).
  pool_->parallel_for(v.n_seqs, [&](int64_t sb, int64_t se, int) {
    for (int64_t sq = sb; sq < se; ++sq) {
      const int32_t* f = v.seq(sq);
      const int32_t slot_id = f[kSeqSlot];
      for (int64_t i = 0; i < f[kSeqRows]; ++i) {
        const int64_t row = f[kSeqFirstRow] + i, pos = f[kSeqFirstPos] + i, res = pos % ratio;
        float* sk = f32_row(state_kv.data, state_kv.ring_row(slot_id, pos));
        float* ss = f32_row(state_score.data, state_score.ring_row(slot_id, pos));
        const float* a = f32_row(ape, res);
        std::copy(f32_row(kv, row), f32_row(kv, row) + wide, sk);
        for (int64_t c = 0; c < wide; ++c) ss[c] = f32_row(score, row)[c] + a[c];
        if (res != ratio - 1) continue;
        // Pooled slot j is position pos + 1 - o * ratio + j.
        const int64_t first = pos + 1 - int64_t{o} * ratio;
        const auto kv_row = [&](int64_t j) { return f32_row(state_kv.data, state_kv.ring_row(slot_id, first + j)); };
        const auto score_row = [&](int64_t j) {
          return f32_row(state_score.data, state_score.ring_row(slot_id, first + j));
        };
        cpu::pool_block(kv_row, score_row, ratio, overlap, w, f32_row(pooled, row));
      }
    }
  });
  return Status::ok();
}

Status CpuBackend::block_positions(const StepRows& rows, int ratio, const Tensor& out) {
  DSV4_ASSIGN_OR_RETURN(StepView v, step_view(rows, "block_positions"));
  if (ratio <= 0) return Status::errorf("block_positions: ratio {}", ratio);
  if (out.type != GgmlType::I32 || out.n_elements() < rows.n || !out.contiguous())
    return Status::errorf("block_positions: out {} for {} rows", out.describe(), rows.n);
  int32_t* o = static_cast<int32_t*>(out.data);
  for (int64_t r = 0; r < v.n; ++r) o[r] = v.positions[r] - v.positions[r] % ratio;
  return Status::ok();
}

Status CpuBackend::store_entries(const Tensor& pooled, int ratio, const StepRows& rows, const PagedRows& dst) {
  const int64_t w = pooled.cols();
  DSV4_ASSIGN_OR_RETURN(StepView v, step_view(rows, "store_entries"));
  if (ratio <= 0) return Status::errorf("store_entries: ratio {}", ratio);
  DSV4_TRY(expect(pooled, "store_entries", "pooled", GgmlType::F32, rows.n, -1));
  DSV4_TRY(expect_paged(dst, "store_entries", w));
  for (int64_t r = 0; r < v.n; ++r) {
    const int32_t* sq = v.seq_of_row(r);
    if (!sq || (v.positions[r] + 1) % ratio) continue;
    float* row = paged_row(dst, sq[kSeqSlot], v.positions[r] / ratio);
    if (!row)
      return Status::errorf(StatusCode::kInternal, "store_entries: no page for entry {} of slot {}",
                            v.positions[r] / ratio, sq[kSeqSlot]);
    std::copy_n(f32_row(pooled, r), w, row);
  }
  return Status::ok();
}

Status CpuBackend::indexer_scores(const Tensor& q, const Tensor& w, const PagedRows& keys, int ratio,
                                  const StepRows& rows, const Tensor& scores, MatmulMode /*fp32 in every mode*/) {
  const int64_t n = rows.n, dk = keys.pool.cols(), n_heads = w.cols(), n_keys = scores.cols();
  DSV4_ASSIGN_OR_RETURN(StepView v, step_view(rows, "indexer_scores"));
  if (ratio <= 0) return Status::errorf("indexer_scores: ratio {}", ratio);
  DSV4_TRY(expect_paged(keys, "indexer_scores", dk));
  DSV4_TRY(expect(q, "indexer_scores", "q", GgmlType::F32, n, n_heads * dk));
  DSV4_TRY(expect(w, "indexer_scores", "w", GgmlType::F32, n, n_heads));
  DSV4_TRY(expect(scores, "indexer_scores", "scores", GgmlType::F32, n, -1));
  for (int64_t r = 0; r < n; ++r) {
    const int32_t* sq = v.seq_of_row(r);
    const int64_t visible = sq ? (v.positions[r] + 1) / ratio : 0;
    if (visible > n_keys || (visible > (sq ? first_row(keys, sq[kSeqSlot]) : 0) && !paged_row(keys, sq[kSeqSlot], visible - 1)))
      return Status::errorf(StatusCode::kInternal, "indexer_scores: row {} sees {} keys, {} columns or pages missing",
                            r, visible, n_keys);
  }
  pool_->parallel_for(n, [&](int64_t b, int64_t e, int) {
    for (int64_t r = b; r < e; ++r) {
      const int32_t* sq = v.seq_of_row(r);
      const int64_t visible = sq ? (v.positions[r] + 1) / ratio : 0;
      const int64_t first = sq ? first_row(keys, sq[kSeqSlot]) : 0;
      float* out = f32_row(scores, r);
      for (int64_t k = 0; k < n_keys; ++k)
        out[k] = k < visible && k >= first
                     ? cpu::indexer_score(f32_row(q, r), f32_row(w, r), paged_row(keys, sq[kSeqSlot], k), n_heads, dk)
                     : kNegInf;
    }
  });
  return Status::ok();
}

Status CpuBackend::top_k(const Tensor& scores, int ratio, const StepRows& rows, int k, const Tensor& idx) {
  const int64_t n = rows.n;
  DSV4_ASSIGN_OR_RETURN(StepView v, step_view(rows, "top_k"));
  if (ratio <= 0 || k <= 0) return Status::errorf("top_k: ratio {}, k {}", ratio, k);
  DSV4_TRY(expect(scores, "top_k", "scores", GgmlType::F32, n, -1));
  if (idx.type != GgmlType::I32 || idx.rows() < n || idx.cols() < k)
    return Status::errorf("top_k: idx {} cannot hold {} x {}", idx.describe(), n, k);
  pool_->parallel_for(n, [&](int64_t b, int64_t e, int) {
    std::vector<int32_t> order;
    for (int64_t r = b; r < e; ++r) {
      const int64_t visible = v.seq_of_row(r) ? (v.positions[r] + 1) / ratio : 0;
      const int64_t m_all = std::min<int64_t>(visible, scores.cols());
      const float* sc = f32_row(scores, r);
      order.clear();
      for (int32_t i = 0; i < m_all; ++i)
        if (sc[i] != kNegInf) order.push_back(i);  // -inf: an entry that does not exist
      const int64_t m = static_cast<int64_t>(order.size());
      const int64_t take = std::min<int64_t>(k, m);
      // Highest score first; equal scores keep the lower index (a fixed, documented rule).
      std::partial_sort(order.begin(), order.begin() + take, order.end(), [&](int32_t a, int32_t c) {
        return sc[a] > sc[c] || (sc[a] == sc[c] && a < c);
      });
      std::sort(order.begin(), order.begin() + take);
      int32_t* out = i32_row(idx, r);
      for (int j = 0; j < k; ++j) out[j] = j < take ? order[j] : -1;
    }
  });
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

Status CpuBackend::round_fp4_e4m3_blocks(const Tensor& x, int64_t block) {
  DSV4_TRY(expect(x, "round_fp4_e4m3_blocks", "x", GgmlType::F32, -1, -1));
  if (block <= 0 || x.cols() % block)
    return Status::errorf("round_fp4_e4m3_blocks: blocks of {} of {}", block, x.describe());
  for (int64_t s = 0; s < x.rows(); ++s)
    for (int64_t g = 0; g < x.cols(); g += block) cpu::round_fp4_e4m3_block(f32_row(x, s) + g, block);
  return Status::ok();
}

// ---- V4.1 ---------------------------------------------------------------------------------

Status CpuBackend::hc_mix(const Tensor& streams, const Tensor& mixes, const Tensor& scale, const Tensor& base,
                          int n_hc, int sinkhorn_iters, float hc_eps, float norm_eps, const Tensor& pre,
                          const Tensor& post, const Tensor& comb) {
  const int64_t n = streams.rows(), width = streams.cols() / n_hc, n_mix = (2 + n_hc) * n_hc;
  DSV4_TRY(expect(streams, "hc_mix", "streams", GgmlType::F32, -1, n_hc * width));
  DSV4_TRY(expect(mixes, "hc_mix", "mixes", GgmlType::F32, n, n_mix));
  DSV4_TRY(expect(scale, "hc_mix", "scale", GgmlType::F32, -1, 3));
  DSV4_TRY(expect(base, "hc_mix", "base", GgmlType::F32, -1, n_mix));
  DSV4_TRY(expect(pre, "hc_mix", "pre", GgmlType::F32, n, n_hc));
  DSV4_TRY(expect(post, "hc_mix", "post", GgmlType::F32, n, n_hc));
  DSV4_TRY(expect(comb, "hc_mix", "comb", GgmlType::F32, n, n_hc * n_hc));
  pool_->parallel_for(n, [&](int64_t b, int64_t e, int) {
    for (int64_t s = b; s < e; ++s) {
      const float rho = cpu::inverse_rms(f32_row(streams, s), n_hc * width, norm_eps);
      cpu::hc_split_sinkhorn(f32_row(mixes, s), rho, static_cast<const float*>(scale.data),
                             static_cast<const float*>(base.data), n_hc, sinkhorn_iters, hc_eps,
                             f32_row(pre, s), f32_row(post, s), f32_row(comb, s));
    }
  });
  return Status::ok();
}

Status CpuBackend::hc_collapse(const Tensor& streams, const Tensor& pre, int n_hc, const Tensor& x) {
  const int64_t n = streams.rows(), width = streams.cols() / n_hc;
  DSV4_TRY(expect(streams, "hc_collapse", "streams", GgmlType::F32, -1, n_hc * width));
  DSV4_TRY(expect(pre, "hc_collapse", "pre", GgmlType::F32, n, n_hc));
  DSV4_TRY(expect(x, "hc_collapse", "x", GgmlType::F32, n, width));
  pool_->parallel_for(n, [&](int64_t b, int64_t e, int) {
    for (int64_t s = b; s < e; ++s) cpu::hc_collapse(f32_row(streams, s), f32_row(pre, s), n_hc, width, f32_row(x, s));
  });
  return Status::ok();
}

Status CpuBackend::engram_gate(const Tensor& streams, const Tensor& kv, const Tensor& q, const Tensor& k, int n_hc,
                               float eps, const Tensor& gate) {
  const int64_t n = streams.rows(), d = streams.cols() / n_hc;
  DSV4_TRY(expect(streams, "engram_gate", "streams", GgmlType::F32, -1, n_hc * d));
  DSV4_TRY(expect(kv, "engram_gate", "kv", GgmlType::F32, n, (n_hc + 1) * d));
  DSV4_TRY(expect(gate, "engram_gate", "gate", GgmlType::F32, n, n_hc));
  if (q.type != GgmlType::F32 || q.n_elements() != n_hc * d || k.type != GgmlType::F32 || k.n_elements() != n_hc * d)
    return Status::errorf("engram_gate: q {} and k {} must be F32 of {} values", q.describe(), k.describe(), n_hc * d);
  const float* qw = static_cast<const float*>(q.data);
  const float* kw = static_cast<const float*>(k.data);
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(d));
  pool_->parallel_for(n, [&](int64_t b, int64_t e, int) {
    for (int64_t r = b; r < e; ++r) {
      float* X = f32_row(streams, r);
      const float* row = f32_row(kv, r);
      const float* value = row + n_hc * d;
      for (int s = 0; s < n_hc; ++s) {
        float* x = X + s * d;
        const float* key = row + s * d;
        const float rx = cpu::inverse_rms(x, d, eps), rk = cpu::inverse_rms(key, d, eps);
        float sigma = 0.0f;
        for (int64_t i = 0; i < d; ++i) sigma += (x[i] * rx * qw[s * d + i]) * (key[i] * rk * kw[s * d + i]);
        sigma *= inv_sqrt_d;
        const float g = cpu::sigmoid(std::copysign(std::sqrt(std::max(std::fabs(sigma), 1e-6f)), sigma));
        f32_row(gate, r)[s] = g;
        for (int64_t i = 0; i < d; ++i) x[i] += g * value[i];
      }
    }
  });
  return Status::ok();
}

Status CpuBackend::candidate_blocks(const Tensor& scores, int ratio, const StepRows& rows, int64_t block, int k,
                                    const Tensor& out) {
  const int64_t n = rows.n;
  DSV4_ASSIGN_OR_RETURN(StepView v, step_view(rows, "candidate_blocks"));
  if (ratio <= 0 || block <= 0 || k <= 0) return Status::errorf("candidate_blocks: ratio {}, block {}, k {}", ratio, block, k);
  DSV4_TRY(expect(scores, "candidate_blocks", "scores", GgmlType::F32, n, -1));
  DSV4_TRY(expect(out, "candidate_blocks", "out", GgmlType::I32, n, k));
  pool_->parallel_for(n, [&](int64_t b, int64_t e, int) {
    std::vector<float> best;
    std::vector<int32_t> order;
    for (int64_t r = b; r < e; ++r) {
      const int64_t visible = v.seq_of_row(r) ? std::min<int64_t>((v.positions[r] + 1) / ratio, scores.cols()) : 0;
      const int64_t n_blocks = (visible + block - 1) / block;
      const float* sc = f32_row(scores, r);
      best.assign(static_cast<size_t>(n_blocks), kNegInf);
      for (int64_t i = 0; i < visible; ++i) best[i / block] = std::max(best[i / block], sc[i]);
      if (n_blocks > 0) best[n_blocks - 1] = std::numeric_limits<float>::infinity();  // the newest, pinned
      order.clear();
      for (int32_t j = 0; j < n_blocks; ++j)
        if (best[j] != kNegInf) order.push_back(j);
      const int64_t take = std::min<int64_t>(k, static_cast<int64_t>(order.size()));
      std::partial_sort(order.begin(), order.begin() + take, order.end(), [&](int32_t a, int32_t c) {
        return best[a] > best[c] || (best[a] == best[c] && a < c);
      });
      std::sort(order.begin(), order.begin() + take);
      int32_t* o = i32_row(out, r);
      for (int j = 0; j < k; ++j) o[j] = j < take ? order[j] : -1;
    }
  });
  return Status::ok();
}

Status CpuBackend::mask_candidates(const Tensor& scores, const Tensor& candidates, int64_t block) {
  const int64_t n = scores.rows();
  DSV4_TRY(expect(scores, "mask_candidates", "scores", GgmlType::F32, -1, -1));
  DSV4_TRY(expect(candidates, "mask_candidates", "candidates", GgmlType::I32, n, -1));
  if (block <= 0) return Status::errorf("mask_candidates: block {}", block);
  pool_->parallel_for(n, [&](int64_t b, int64_t e, int) {
    for (int64_t r = b; r < e; ++r) {
      float* sc = f32_row(scores, r);
      const int32_t* cand = i32_row(candidates, r);
      for (int64_t i = 0; i < scores.cols(); ++i) {
        bool kept = false;
        for (int64_t j = 0; j < candidates.cols(); ++j) kept |= cand[j] >= 0 && cand[j] == i / block;
        if (!kept) sc[i] = kNegInf;
      }
    }
  });
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
  std::vector<std::vector<int64_t>> pairs(n_experts);  // (token, slot) pairs per expert
  size_t most = 0;
  for (int64_t s = 0; s < n; ++s)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = i32_row(experts, s)[j];
      if (e < 0 || e >= n_experts)
        return Status::errorf("moe_experts: row {} slot {} names expert {} of {}", s, j, e, n_experts);
      pairs[e].push_back(s * k + j);
      most = std::max(most, pairs[e].size());
    }
  DSV4_ASSIGN_OR_RETURN(Tensor outs, scratch(GgmlType::F32, std::vector<int64_t>{n * k, d}));
  const int64_t cap = static_cast<int64_t>(std::max<size_t>(most, 1));
  DSV4_ASSIGN_OR_RETURN(Tensor xs_all, scratch(GgmlType::F32, std::vector<int64_t>{cap, d}));
  DSV4_ASSIGN_OR_RETURN(Tensor g_all, scratch(GgmlType::F32, std::vector<int64_t>{cap, inter}));
  DSV4_ASSIGN_OR_RETURN(Tensor u_all, scratch(GgmlType::F32, std::vector<int64_t>{cap, inter}));
  DSV4_ASSIGN_OR_RETURN(Tensor o_all, scratch(GgmlType::F32, std::vector<int64_t>{cap, d}));
  for (int64_t e = 0; e < n_experts; ++e) {
    const std::vector<int64_t>& pe = pairs[e];
    if (pe.empty()) continue;
    const int64_t m = static_cast<int64_t>(pe.size());
    const Tensor xs = xs_all.slice(0, m), g = g_all.slice(0, m), u = u_all.slice(0, m), o = o_all.slice(0, m);
    for (int64_t i = 0; i < m; ++i) std::copy(f32_row(x, pe[i] / k), f32_row(x, pe[i] / k) + d, f32_row(xs, i));
    DSV4_TRY(matmul(gate.at(e), xs, g, mode));
    DSV4_TRY(matmul(up.at(e), xs, u, mode));
    for (int64_t i = 0; i < m; ++i)
      cpu::swiglu(f32_row(g, i), f32_row(u, i), inter, limit,
                  f32_row(weights, pe[i] / k)[pe[i] % k], f32_row(g, i));
    DSV4_TRY(matmul(down.at(e), g, o, mode));
    for (int64_t i = 0; i < m; ++i) std::copy(f32_row(o, i), f32_row(o, i) + d, f32_row(outs, pe[i]));
  }
  for (int64_t s = 0; s < n; ++s) {
    float* out = f32_row(y, s);
    std::fill(out, out + d, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const float* a = f32_row(outs, s * k + j);
      for (int64_t i = 0; i < d; ++i) out[i] += a[i];
    }
  }
  return Status::ok();
}

Status CpuBackend::swiglu_expert(const Tensor& x, const Tensor& gate, const Tensor& up,
                                 const Tensor& down, float limit, MatmulMode mode,
                                 const Tensor& y) {
  const int64_t n = x.rows(), inter = gate.rows();
  DSV4_ASSIGN_OR_RETURN(Tensor g, scratch(GgmlType::F32, std::vector<int64_t>{n, inter}));
  DSV4_ASSIGN_OR_RETURN(Tensor u, scratch(GgmlType::F32, std::vector<int64_t>{n, inter}));
  DSV4_ASSIGN_OR_RETURN(Tensor o, scratch(GgmlType::F32, std::vector<int64_t>{n, x.cols()}));
  DSV4_TRY(matmul(gate, x, g, mode));
  DSV4_TRY(matmul(up, x, u, mode));
  for (int64_t s = 0; s < n; ++s) cpu::swiglu(f32_row(g, s), f32_row(u, s), inter, limit, 1.0f, f32_row(g, s));
  DSV4_TRY(matmul(down, g, o, mode));
  return add(o, y);
}

// ---- steering ---------------------------------------------------------------------------

Status CpuBackend::steer(const Tensor& x, const Tensor& dir, int64_t group, bool project, const Tensor& alpha) {
  const int64_t n = x.rows(), width = x.cols();
  DSV4_TRY(expect(x, "steer", "x", GgmlType::F32, -1, -1));
  DSV4_TRY(expect(alpha, "steer", "alpha", GgmlType::F32, -1, -1));
  if (dir.type != GgmlType::F32 || !dir.contiguous() || group <= 0 || width % group ||
      (dir.n_elements() != group && dir.n_elements() != width) || alpha.n_elements() < n || !alpha.contiguous())
    return Status::errorf("steer: x {} in groups of {} with direction {} and alpha {}", x.describe(), group,
                          dir.describe(), alpha.describe());
  const float* d0 = static_cast<const float*>(dir.data);
  const bool shared = dir.n_elements() == group;
  const float* a = static_cast<const float*>(alpha.data);
  pool_->parallel_for(n, [&](int64_t b, int64_t e, int) {
    for (int64_t r = b; r < e; ++r) {
      if (a[r] == 0.0f) continue;
      for (int64_t at = 0; at < width; at += group) {
        float* v = f32_row(x, r) + at;
        const float* d = shared ? d0 : d0 + at;
        if (project) {
          double dot = 0;  // in double: what is left along d is then fp32 rounding only
          for (int64_t i = 0; i < group; ++i) dot += double(v[i]) * d[i];
          const float c = static_cast<float>(dot) * a[r];
          for (int64_t i = 0; i < group; ++i) v[i] -= c * d[i];
        } else {
          for (int64_t i = 0; i < group; ++i) v[i] += a[r] * d[i];
        }
      }
    }
  });
  return Status::ok();
}

// ---- sampling ---------------------------------------------------------------------------

Status CpuBackend::sample(const Tensor& logits, const Tensor& params, const Tensor* adjust, const Tensor& out) {
  const int64_t n = logits.rows(), vocab = logits.cols();
  DSV4_TRY(expect(logits, "sample", "logits", GgmlType::F32, n, vocab));
  DSV4_TRY(expect(params, "sample", "params", GgmlType::I32, n, kSampleFields));
  if (out.type != GgmlType::I32 || out.n_elements() < n || !out.contiguous())
    return Status::errorf("sample: out {} for {} rows", out.describe(), n);
  if (adjust) {
    DSV4_TRY(expect(*adjust, "sample", "adjust", GgmlType::I32, -1, kAdjustFields));
    for (int64_t a = 0; a < adjust->rows(); ++a) {
      const int32_t* f = i32_row(*adjust, a);
      if (f[kAdjustRow] == -1) continue;  // an unused entry of a fixed-capacity tensor
      if (f[kAdjustRow] < 0 || f[kAdjustRow] >= n || f[kAdjustToken] < 0 || f[kAdjustToken] >= vocab)
        return Status::errorf("sample: adjustment {} names row {} token {} of [{}, {}]", a, f[kAdjustRow],
                              f[kAdjustToken], n, vocab);
      float& x = f32_row(logits, f[kAdjustRow])[f[kAdjustToken]];
      const float rep = f32_field(f, kAdjustRepetition);
      if (rep != 1.0f) x = x > 0 ? x / rep : x * rep;
      x -= f32_field(f, kAdjustSubtract);
    }
  }
  int32_t* tokens = static_cast<int32_t*>(out.data);
  pool_->parallel_for(n, [&](int64_t b, int64_t e, int) {
    std::vector<uint64_t> keys;
    std::vector<float> z(vocab);
    for (int64_t r = b; r < e; ++r) {
      const float* x = f32_row(logits, r);
      const int32_t* p = i32_row(params, r);
      const float temperature = f32_field(p, kSampleTemperature), top_p = f32_field(p, kSampleTopP);
      const float min_p = f32_field(p, kSampleMinP);
      const int32_t top_k = p[kSampleTopK];
      int32_t best = 0;  // the arg-max, lowest id on ties; NaN never wins
      for (int64_t i = 1; i < vocab; ++i)
        if (x[i] > x[best] || (std::isnan(x[best]) && !std::isnan(x[i]))) best = static_cast<int32_t>(i);
      tokens[r] = best;
      if (temperature == 0.0f || !std::isfinite(x[best])) continue;
      keys.clear();
      for (int64_t i = 0; i < vocab; ++i)
        if (std::isfinite(x[i])) {
          z[i] = x[i] / temperature;
          keys.push_back(candidate_key(z[i], static_cast<uint32_t>(i)));
        }
      const auto id_of = [](uint64_t key) { return static_cast<int64_t>(0xFFFFFFFFu - static_cast<uint32_t>(key)); };
      std::sort(keys.begin(), keys.end(), std::greater<>());  // best first
      size_t keep = keys.size();
      if (top_k > 0) keep = std::min<size_t>(keep, static_cast<size_t>(top_k));
      const double z_max = z[id_of(keys[0])];
      if (top_p < 1.0f) {  // the shortest prefix whose weight reaches top_p of the total
        uint64_t total = 0, acc = 0;
        for (size_t j = 0; j < keep; ++j) total += fixed_weight(double(z[id_of(keys[j])]) - z_max);
        const uint64_t target = top_p_target(top_p, total);
        for (size_t j = 0; j < keep; ++j) {
          acc += fixed_weight(double(z[id_of(keys[j])]) - z_max);
          if (acc >= target) {
            keep = j + 1;
            break;
          }
        }
      }
      if (min_p > 0.0f) {
        size_t m = 1;
        while (m < keep && std::exp(double(z[id_of(keys[m])]) - z_max) >= double(min_p)) ++m;
        keep = m;
      }
      const uint64_t seed = u64_fields(p, kSampleSeedLo), counter = u64_fields(p, kSampleCounterLo);
      double best_score = -INFINITY;
      for (size_t j = 0; j < keep; ++j) {
        const int64_t id = id_of(keys[j]);
        const double score = double(z[id]) + gumbel(seed, counter, static_cast<uint32_t>(id));
        if (score > best_score || (score == best_score && id < tokens[r])) {
          best_score = score;
          tokens[r] = static_cast<int32_t>(id);
        }
      }
    }
  });
  return Status::ok();
}

}  // namespace dsv4::backend
