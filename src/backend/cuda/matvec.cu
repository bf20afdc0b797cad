#include "backend/cuda/matvec.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <mutex>
#include <sstream>

#include "backend/cuda/activation_quant.h"
#include "backend/cuda/matvec_launch.cuh"
#include "backend/cuda/matvec_row_kernel.cuh"
#include "backend/cuda/mmq.h"

namespace dsv4::cuda {

namespace {

using detail::MatvecArgs;
using detail::MatvecMode;

template <class Policy>
Status launch_rows(const MatvecArgs& a, int rows, cudaStream_t stream) {
  const int64_t tasks = a.n_tasks;
  if (rows <= 1) return detail::launch_matvec<Policy, 1, MatvecMode::kPlain>(a, 1, tasks, stream);
  if (rows <= 2) return detail::launch_matvec<Policy, 2, MatvecMode::kPlain>(a, 1, tasks, stream);
  if (rows <= 4) return detail::launch_matvec<Policy, 4, MatvecMode::kPlain>(a, 1, tasks, stream);
  if (rows <= 8) return detail::launch_matvec<Policy, 8, MatvecMode::kPlain>(a, 1, tasks, stream);
  return detail::launch_matvec<Policy, 16, MatvecMode::kPlain>(a, 1, tasks, stream);
}

// The row kernels (matvec_row_kernel.cuh) for `rows` activation rows per task: one row,
// or 2..kRowKernelMaxRows with the same arithmetic for each.
template <GgmlType T, int S>
Status launch_row_variant(const MatvecArgs& a, int rows, int64_t tasks, cudaStream_t stream, int64_t min_rows = 1) {
  using Policy = detail::QuantPolicy<T>;
  constexpr auto kPlain = MatvecMode::kPlain;
  if (rows == 1)
    return detail::launch_matvec_kernel<Policy, 1, kPlain, &detail::matvec_row_kernel<T, S>>(a, 1, tasks, stream, min_rows);
  return detail::launch_matvec_kernel<Policy, 1, kPlain, &detail::matvec_rows_kernel<T, S>>(a, 1, tasks, stream, min_rows);
}

// Shared memory the multi-row kernel may spend on quantising its rows itself; beyond it the
// rows are quantised by a launch of their own and read from L1.
constexpr int64_t kRowsFusedQuantBytes = 64 * 1024;

// The leaner kernels of matvec_row_kernel.cuh for `rows` activation rows per task (1, or up
// to kRowKernelMaxRows), when the rows' alignment suits them, their units cover the row and
// each lane's activation slice fits in registers (S units per lane; k up to 8192 for the
// K-quants). Whether they apply depends on the weights' shape alone, never on `rows` or x,
// so a row's kernel (and its bits) is the same alone and among others. Returns launched =
// false when the general kernel has to run instead.
template <GgmlType T>
Status launch_row_kernel(const MatvecArgs& a, int rows, cudaStream_t stream, bool& launched) {
  using Policy = detail::QuantPolicy<T>;
  constexpr int kAlign = detail::RowUnit<T>::kAlign;
  launched = false;
  if (a.matrix_stride % kAlign != 0 || a.row_bytes % kAlign != 0) return Status::ok();
  if (!detail::row_unit_covers<T>(a.act.k)) return Status::ok();
  const int64_t units = (a.act.k + Policy::kUnitWeights - 1) / Policy::kUnitWeights;
  const int lanes = detail::lanes_per_row(a.act.k, Policy::kUnitWeights);
  const int64_t steps = (units + lanes - 1) / lanes;
  const bool covered = steps <= 2 || ((T == GgmlType::Q8_0 || T == GgmlType::Q4_K) && steps <= 4) ||
                       (T == GgmlType::Q8_0 && steps <= 8);
  if (!covered) return Status::ok();
  const int64_t tasks = a.n_tasks;
  // f32 activations (one matrix, or one x for all): the block quantises them itself.
  MatvecArgs fused = a;
  fused.act_rows = rows;
  if (a.act.q == nullptr) {
    if (a.act.f == nullptr || (tasks != 1 && !a.shared_act) || Policy::kIq2) return Status::ok();
    if (rows == 1) {
      fused.act_smem_bytes = detail::row_quant_smem_bytes(a.act.k, Policy::kUnitWeights, lanes);
    } else {
      const int64_t padded = padded_row_values(a.act.k, ActivationLayout{Policy::kUnitWeights, lanes});
      const int64_t bytes = rows * detail::row_quant_smem_stride(padded);
      if (bytes > kRowsFusedQuantBytes) return Status::ok();  // the caller quantises first
      fused.act_smem_bytes = static_cast<int>(bytes);
    }
  }
  const MatvecArgs& b = fused;
  launched = true;
  if (steps <= 1) return launch_row_variant<T, 1>(b, rows, tasks, stream);
  // Q2_K with two units per lane (k = 8192: one 2688-byte row per 4 KB group): two rows per
  // group for the kernel's paired pass, at no cost in occupancy (registers allow 12 warps per
  // multiprocessor either way). Q3_K's larger rows would lose a third of its warps.
  const int64_t pair_rows = T == GgmlType::Q2_K ? 2 * (32 / lanes) : 1;
  if (steps <= 2) return launch_row_variant<T, 2>(b, rows, tasks, stream, pair_rows);
  if constexpr (T == GgmlType::Q8_0 || T == GgmlType::Q4_K) {
    if (steps <= 4) return launch_row_variant<T, 4>(b, rows, tasks, stream);
  }
  if constexpr (T == GgmlType::Q8_0) {
    if (steps <= 8) return launch_row_variant<T, 8>(b, rows, tasks, stream);
  }
  launched = false;
  return Status::ok();
}

// The row kernels for the types that have them (launched = false: the general kernel runs).
Status launch_one_row(GgmlType type, const MatvecArgs& a, int rows, const KernelChoice& choice, cudaStream_t stream,
                      bool& launched) {
  launched = false;
  if (type == GgmlType::Q8_0) return launch_row_kernel<GgmlType::Q8_0>(a, rows, stream, launched);
  if (type == GgmlType::Q2_K) return launch_row_kernel<GgmlType::Q2_K>(a, rows, stream, launched);
  if (type == GgmlType::Q3_K) return launch_row_kernel<GgmlType::Q3_K>(a, rows, stream, launched);
  if (!choice.matvec_row_extra) return Status::ok();
  if (type == GgmlType::MXFP4) return launch_row_kernel<GgmlType::MXFP4>(a, rows, stream, launched);
  if (type == GgmlType::Q4_K) return launch_row_kernel<GgmlType::Q4_K>(a, rows, stream, launched);
  if (type == GgmlType::Q6_K) return launch_row_kernel<GgmlType::Q6_K>(a, rows, stream, launched);
  return Status::ok();
}

// The general kernel for one task of at most kMatvecMaxRows rows.
Status launch_general(GgmlType type, const MatvecArgs& a, int rows, cudaStream_t stream) {
  switch (type) {
    case GgmlType::BF16: return launch_rows<detail::Bf16Policy>(a, rows, stream);
    case GgmlType::Q8_0: return launch_rows<detail::QuantPolicy<GgmlType::Q8_0>>(a, rows, stream);
    case GgmlType::Q2_K: return launch_rows<detail::QuantPolicy<GgmlType::Q2_K>>(a, rows, stream);
    case GgmlType::Q3_K: return launch_rows<detail::QuantPolicy<GgmlType::Q3_K>>(a, rows, stream);
    case GgmlType::Q4_K: return launch_rows<detail::QuantPolicy<GgmlType::Q4_K>>(a, rows, stream);
    case GgmlType::Q6_K: return launch_rows<detail::QuantPolicy<GgmlType::Q6_K>>(a, rows, stream);
    case GgmlType::MXFP4: return launch_rows<detail::QuantPolicy<GgmlType::MXFP4>>(a, rows, stream);
    case GgmlType::IQ2_XXS: return launch_rows<detail::QuantPolicy<GgmlType::IQ2_XXS>>(a, rows, stream);
    default: {
      detail::MatvecCall call;
      call.rows = rows;
      return detail::run_added_types(type, a, call, stream);
    }
  }
}

// Batch-invariant mode where the tensor-core kernels do not apply (or are switched off): every
// matrix and every slice of up to kMatvecMaxRows rows through the general kernel, whose
// per-row sums (each lane's units in order, then the lane group's shuffle tree,
// matvec_kernel.cuh) do not depend on how many rows share the pass. `a` holds the whole
// product's activations (quantised, or f32 for BF16).
Status invariant_slices(const MatvecWeights& w, const MatvecArgs& a, int rows, float* y, cudaStream_t stream) {
  for (int64_t b = 0; b < w.batch; ++b) {
    for (int r0 = 0; r0 < rows; r0 += kMatvecMaxRows) {
      const int n_rows = std::min(kMatvecMaxRows, rows - r0);
      const int64_t row = b * rows + r0;  // first activation row of the slice
      MatvecArgs s = a;
      s.w[0] = a.w[0] + b * a.matrix_stride;
      s.n_tasks = 1;
      s.act_rows = n_rows;
      s.out = y + row * w.n;
      if (a.act.q != nullptr) {
        s.act.q = a.act.q + row * a.act.padded_k;
        s.act.d = a.act.d + row * (a.act.padded_k / 32);
        s.act.s16 = a.act.s16 + row * (a.act.padded_k / 32) * 2;
      } else {
        s.act.f = a.act.f + row * w.k;
      }
      DSV4_TRY(launch_general(w.type, s, n_rows, stream));
    }
  }
  return Status::ok();
}

}  // namespace

namespace {
std::atomic<int> g_programmatic_launch{-1};  // -1: not read from the environment yet

std::mutex g_choice_mutex;
bool g_choice_read = false;
KernelChoice g_choice;

// DSV4_CUDA_LEGACY: "all" or names separated by commas (KernelChoice).
KernelChoice choice_from_environment() {
  KernelChoice c;
  if (const char* inv = std::getenv("DSV4_CUDA_BATCH_INVARIANT"); inv != nullptr && std::string(inv) == "1")
    c.batch_invariant = true;
  if (const char* split = std::getenv("DSV4_CUDA_FLOAT32_SPLIT"); split != nullptr) {
    const std::string terms(split);
    if (terms == "0" || terms == "3" || terms == "6")
      c.float32_split_terms = std::stoi(terms);
    else
      std::fprintf(stderr, "dsv4: DSV4_CUDA_FLOAT32_SPLIT=%s is not 0, 3 or 6; keeping %d\n", split,
                   c.float32_split_terms);
  }
  const char* env = std::getenv("DSV4_CUDA_LEGACY");
  if (env == nullptr) return c;
  std::stringstream list(env);
  std::string name;
  while (std::getline(list, name, ',')) {
    const bool all = name == "all";
    if (all || name == "bf16") c.matvec_bf16 = false;
    if (all || name == "row") c.matvec_row_extra = false;
    if (all || name == "mma") c.matvec_mma = false;
    if (all || name == "moe_decode") c.moe_decode = false;
    if (all || name == "decode64") c.moe_decode_wide = false;
    if (all || name == "pairmajor") c.moe_decode_rows_first = false;
    if (all || name == "moe_mma") c.moe_mma = false;
    if (all || name == "moe_wgmma") c.moe_wgmma = false;
    if (all || name == "wgdecode") c.moe_wgmma_pair_decode = false;
    if (all || name == "wgn96") c.moe_wgmma_n96 = false;
    if (all || name == "rows") c.matvec_rows = false;
    if (all || name == "grouped") c.grouped_batch = false;
    if (all || name == "bulk") c.mmq_bulk = false;
    if (all || name == "ring2") c.mmq_bulk_ring2 = false;
    if (all || name == "f32tiles") c.float32_tiles = false;
    if (all || name == "f32gemm") c.float32_split_terms = 0;
  }
  return c;
}
}  // namespace

KernelChoice kernel_choice() {
  std::lock_guard<std::mutex> lock(g_choice_mutex);
  if (!g_choice_read) {
    g_choice = choice_from_environment();
    g_choice_read = true;
  }
  return g_choice;
}

void set_kernel_choice(const KernelChoice& choice) {
  std::lock_guard<std::mutex> lock(g_choice_mutex);
  g_choice = choice;
  g_choice_read = true;
}

void set_programmatic_launch(bool enabled) { g_programmatic_launch = enabled ? 1 : 0; }

bool programmatic_launch() {
  int v = g_programmatic_launch.load();
  if (v < 0) {
    const char* env = std::getenv("DSV4_CUDA_PDL");
    v = (env != nullptr && std::string(env) == "0") ? 0 : 1;
    g_programmatic_launch = v;
  }
  return v == 1;
}

namespace detail {
bool programmatic_launch_enabled() { return programmatic_launch(); }
}  // namespace detail

Status prepare_matvec_tables() {
  const uint64_t* grid = nullptr;
  const uint8_t* signs = nullptr;
  DSV4_TRY(detail::iq2_tables(&grid, &signs));
  quant::IqTables iq;
  return detail::iq_tables(&iq);
}

bool matvec_supported(GgmlType type) {
  switch (type) {
    case GgmlType::Q8_0:
    case GgmlType::Q2_K:
    case GgmlType::Q3_K:
    case GgmlType::Q4_K:
    case GgmlType::Q6_K:
    case GgmlType::MXFP4:
    case GgmlType::IQ2_XXS:
    case GgmlType::BF16:
      return true;
    default:
      return detail::is_added_type(type);
  }
}

namespace detail {
int unit_weights(GgmlType type) {
  switch (type) {
    case GgmlType::Q8_0: return QuantPolicy<GgmlType::Q8_0>::kUnitWeights;
    case GgmlType::Q2_K: return QuantPolicy<GgmlType::Q2_K>::kUnitWeights;
    case GgmlType::Q3_K: return QuantPolicy<GgmlType::Q3_K>::kUnitWeights;
    case GgmlType::Q4_K: return QuantPolicy<GgmlType::Q4_K>::kUnitWeights;
    case GgmlType::Q6_K: return QuantPolicy<GgmlType::Q6_K>::kUnitWeights;
    case GgmlType::MXFP4: return QuantPolicy<GgmlType::MXFP4>::kUnitWeights;
    case GgmlType::IQ2_XXS: return QuantPolicy<GgmlType::IQ2_XXS>::kUnitWeights;
    case GgmlType::Q4_0: return QuantPolicy<GgmlType::Q4_0>::kUnitWeights;
    case GgmlType::Q4_1: return QuantPolicy<GgmlType::Q4_1>::kUnitWeights;
    case GgmlType::Q5_0: return QuantPolicy<GgmlType::Q5_0>::kUnitWeights;
    case GgmlType::Q5_1: return QuantPolicy<GgmlType::Q5_1>::kUnitWeights;
    case GgmlType::IQ4_NL: return QuantPolicy<GgmlType::IQ4_NL>::kUnitWeights;
    case GgmlType::Q5_K: return QuantPolicy<GgmlType::Q5_K>::kUnitWeights;
    case GgmlType::IQ4_XS: return QuantPolicy<GgmlType::IQ4_XS>::kUnitWeights;
    case GgmlType::IQ2_XS: return QuantPolicy<GgmlType::IQ2_XS>::kUnitWeights;
    case GgmlType::IQ2_S: return QuantPolicy<GgmlType::IQ2_S>::kUnitWeights;
    case GgmlType::IQ3_XXS: return QuantPolicy<GgmlType::IQ3_XXS>::kUnitWeights;
    case GgmlType::IQ3_S: return QuantPolicy<GgmlType::IQ3_S>::kUnitWeights;
    case GgmlType::IQ1_S: return QuantPolicy<GgmlType::IQ1_S>::kUnitWeights;
    case GgmlType::IQ1_M: return QuantPolicy<GgmlType::IQ1_M>::kUnitWeights;
    default: return Bf16Policy::kUnitWeights;
  }
}

bool is_added_type(GgmlType type) {
  switch (type) {
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::Q5_0:
    case GgmlType::Q5_1:
    case GgmlType::IQ4_NL:
    case GgmlType::Q5_K:
    case GgmlType::IQ4_XS:
    case GgmlType::IQ2_XS:
    case GgmlType::IQ2_S:
    case GgmlType::IQ3_XXS:
    case GgmlType::IQ3_S:
    case GgmlType::IQ1_S:
    case GgmlType::IQ1_M:
      return true;
    default:
      return false;
  }
}

Status run_added_types(GgmlType type, const MatvecArgs& a, const MatvecCall& c, cudaStream_t stream) {
  switch (type) {
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::Q5_0:
    case GgmlType::Q5_1:
    case GgmlType::IQ4_NL:
    case GgmlType::Q5_K:
    case GgmlType::IQ4_XS:
      return matvec_nibble_types(type, a, c, stream);
    default:
      if (!is_added_type(type))
        return Status::error("matvec: weight type " + std::string(ggml_type_name(type)) + " is not supported");
      return matvec_codebook_types(type, a, c, stream);
  }
}
}  // namespace detail

size_t matvec_workspace_bytes(const MatvecWeights& w, int rows) {
  if (w.type == GgmlType::BF16) return 0;
  const size_t dp4a = quantized_activations_bytes(w.batch * rows, w.k, detail::activation_layout(w.type, w.k));
  const size_t mma = mma_matmul_supported(w.type) ? mma_matmul_workspace_bytes(w, rows) : 0;
  return std::max(dp4a, mma);
}

Status matvec(const MatvecWeights& w, const float* x, int rows, float* y, void* workspace, size_t workspace_bytes,
              cudaStream_t stream) {
  const std::string name(ggml_type_name(w.type));
  if (!matvec_supported(w.type)) return Status::error("matvec: weight type " + name + " is not supported");
  const KernelChoice choice = kernel_choice();
  // Batch-invariant mode: the tensor-core kernels for every row count where they apply (a
  // column's sums do not depend on the columns beside it, mmq_kernel.cuh), one row included;
  // else the general dp4a kernel (invariant_slices).
  const bool invariant = choice.batch_invariant;
  // 2..kRowKernelMaxRows rows (an MTP verify step, a few sequences): each row through the
  // one-row arithmetic (the row kernels where one row takes them, else the general kernel),
  // so a row's outputs are the bits it gets alone.
  const bool few_rows = !invariant && choice.matvec_rows && rows >= 2 && rows <= kRowKernelMaxRows;
  const bool row_arithmetic = rows == 1 || few_rows;
  const bool mma = !few_rows && (rows >= 2 || invariant) && choice.matvec_mma && mma_matmul_applies(w, rows);
  if (rows < 1 || (rows > kMatvecMaxRows && !mma && !(invariant && rows <= kMmaMaxRows)))
    return Status::error("matvec: " + std::to_string(rows) + " activation rows of " + name + ", supported 1.." +
                         std::to_string(kMatvecMaxRows) + " (up to " + std::to_string(kMmaMaxRows) +
                         " on the tensor-core path, mma_matmul_applies, or batch-invariant)");
  const auto& traits = ggml_traits(w.type);
  if (w.n <= 0 || w.k <= 0 || w.batch <= 0 || w.k % traits.block_elems != 0 || w.k % 32 != 0)
    return Status::error("matvec: shape batch " + std::to_string(w.batch) + " x n " + std::to_string(w.n) + " x k " +
                         std::to_string(w.k) + " invalid for " + name + " (k must be a multiple of " +
                         std::to_string(traits.block_elems) + ")");
  if (reinterpret_cast<uintptr_t>(w.data) % 16 != 0) return Status::error("matvec: weights not 16-byte aligned");
  if (w.batch * rows > INT32_MAX / 2) return Status::error("matvec: too many activation rows");
  const size_t need = matvec_workspace_bytes(w, rows);
  if (workspace_bytes < need)
    return Status::error("matvec: workspace of " + std::to_string(workspace_bytes) + " bytes, need " +
                         std::to_string(need));

  MatvecArgs a;
  a.w[0] = static_cast<const uint8_t*>(w.data);
  a.row_bytes = static_cast<int64_t>(w.k / traits.block_elems * traits.block_bytes);
  a.matrix_stride = w.batch_stride_bytes != 0 ? w.batch_stride_bytes : a.row_bytes * w.n;
  a.n = w.n;
  a.n_tasks = w.batch;
  a.act_rows = rows;
  a.act.k = w.k;
  a.out = y;
  if (w.shared_x && w.batch > 1) {
    // One launch of the row kernel for every matrix (it quantises x once per block, whatever
    // the task); where it does not apply, each matrix on its own.
    if (row_arithmetic && !invariant && reinterpret_cast<uintptr_t>(x) % 16 == 0) {
      a.act.f = x;
      a.shared_act = true;
      bool launched = false;
      DSV4_TRY(launch_one_row(w.type, a, rows, choice, stream, launched));
      if (launched) return Status::ok();
    }
    for (int64_t b = 0; b < w.batch; ++b) {
      MatvecWeights one = w;
      one.data = static_cast<const uint8_t*>(w.data) + b * a.matrix_stride;
      one.batch = 1;
      one.batch_stride_bytes = 0;
      one.shared_x = false;
      DSV4_TRY(matvec(one, x, rows, y + b * rows * w.n, workspace, workspace_bytes, stream));
    }
    return Status::ok();
  }
  if (w.type == GgmlType::BF16) {
    if (invariant) {
      a.act.f = x;
      return invariant_slices(w, a, rows, y, stream);
    }
    if (choice.matvec_bf16 && detail::bf16_streaming_applies(w) && reinterpret_cast<uintptr_t>(x) % 16 == 0)
      return detail::matvec_bf16(w, x, rows, y, stream);
    a.act.f = x;
    return launch_rows<detail::Bf16Policy>(a, rows, stream);
  }
  if (mma) return mma_matmul(w, x, rows, y, workspace, workspace_bytes, stream);
  // Rows of one matrix: the row kernel quantises x itself when it applies.
  if (!invariant && row_arithmetic && w.batch == 1 && reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    a.act.f = x;
    bool launched = false;
    DSV4_TRY(launch_one_row(w.type, a, rows, choice, stream, launched));
    if (launched) return Status::ok();
    a.act.f = nullptr;
  }
  const QuantizedActivations q =
      quantized_activations_view(workspace, w.batch * rows, w.k, detail::activation_layout(w.type, w.k));
  DSV4_TRY(quantize_activations_q8(x, q, stream));
  a.act.q = q.q;
  a.act.d = q.d;
  a.act.s16 = q.s16;
  a.act.padded_k = q.padded_k;
  a.act.unit_weights = q.layout.unit_weights;
  a.act.lanes = q.layout.lanes;
  if (invariant) return invariant_slices(w, a, rows, y, stream);
  if (row_arithmetic) {
    bool launched = false;
    DSV4_TRY(launch_one_row(w.type, a, rows, choice, stream, launched));
    if (launched) return Status::ok();
  }
  return launch_general(w.type, a, rows, stream);
}

}  // namespace dsv4::cuda
