#include "backend/cuda/gemm_prefill.h"

#include <string>
#include <utility>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/matvec.h"
#include "backend/cuda/matvec_launch.cuh"
#include "backend/cuda/quant_units.cuh"

namespace dsv4::cuda {

namespace {

Status cublas_status(cublasStatus_t s, const char* what, const char* file, int line) {
  if (s == CUBLAS_STATUS_SUCCESS) return Status::ok();
  return Status::error(std::string(file) + ":" + std::to_string(line) + ": " + what +
                       " failed: " + cublasLtGetStatusString(s));
}
#define DSV4_CUBLAS_TRY(call) DSV4_TRY(cublas_status((call), #call, __FILE__, __LINE__))

// One thread per 32 weights (one part of a wide unit, decoded whole and the rest dropped):
// neighbouring threads write neighbouring 64-byte pieces.
template <GgmlType T>
__global__ void dequantize_bf16_kernel(const uint8_t* __restrict__ w, int64_t n, int64_t k, int64_t row_bytes,
                                       const uint64_t* grid, const uint8_t* signs, quant::IqTables iq,
                                       __nv_bfloat16* __restrict__ out) {
  using U = QuantUnit<T>;
  const int64_t parts_per_row = k / 32;
  const int64_t part = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (part >= n * parts_per_row) return;
  const int64_t row = part / parts_per_row;
  const int p = static_cast<int>(part % parts_per_row);
  const int u = p / U::kSub, j = p % U::kSub;
  const int valid = min(U::kSub, static_cast<int>(parts_per_row) - u * U::kSub);
  int where;
  const uint8_t* at = unit_address<U>(w + row * row_bytes, u, where);
  Unit32 d[U::kSub];
  U::decode(at, where, Iq2Tables{grid, signs, iq}, d, valid);
  Unit32 mine = d[0];
#pragma unroll
  for (int i = 1; i < U::kSub; ++i)
    if (i == j) mine = d[i];
  uint4 packed[4];
  auto* h = reinterpret_cast<__nv_bfloat162*>(packed);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float a = i < 4 ? mine.a0 : mine.a1;
    const float b = i < 4 ? mine.b0 : mine.b1;
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = a * static_cast<float>(static_cast<int8_t>(mine.q[i] >> (8 * e))) - b;
    h[2 * i] = __floats2bfloat162_rn(v[0], v[1]);
    h[2 * i + 1] = __floats2bfloat162_rn(v[2], v[3]);
  }
  uint4* dst = reinterpret_cast<uint4*>(out + part * 32);
#pragma unroll
  for (int i = 0; i < 4; ++i) dst[i] = packed[i];
}

__global__ void f32_to_bf16_kernel(const float* __restrict__ x, int64_t count, __nv_bfloat16* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) out[i] = __float2bfloat16_rn(x[i]);
}

template <GgmlType T>
Status launch_dequantize(const void* w, int64_t n, int64_t k, __nv_bfloat16* out, cudaStream_t stream) {
  const uint64_t* grid = nullptr;
  const uint8_t* signs = nullptr;
  quant::IqTables iq{};
  if constexpr (T == GgmlType::IQ2_XXS) DSV4_TRY(detail::iq2_tables(&grid, &signs));
  if constexpr (needs_iq_tables(T)) DSV4_TRY(detail::iq_tables(&iq));
  const auto& traits = ggml_traits(T);
  const int64_t units = n * (k / 32);
  constexpr int kThreads = 256;
  dequantize_bf16_kernel<T><<<static_cast<unsigned>((units + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      static_cast<const uint8_t*>(w), n, k, static_cast<int64_t>(k / traits.block_elems * traits.block_bytes), grid,
      signs, iq, out);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

}  // namespace

Status dequantize_to_bf16(GgmlType type, const void* w, int64_t n, int64_t k, __nv_bfloat16* out, cudaStream_t stream) {
  const auto& traits = ggml_traits(type);
  if (!matvec_supported(type) || type == GgmlType::BF16 || n <= 0 || k <= 0 || k % traits.block_elems != 0 ||
      k % 32 != 0)
    return Status::error("dequantize_to_bf16: type " + std::string(traits.name) + " with shape " + std::to_string(n) +
                         " x " + std::to_string(k) + " is not supported");
  if (reinterpret_cast<uintptr_t>(w) % 4 != 0 || reinterpret_cast<uintptr_t>(out) % 16 != 0)
    return Status::error("dequantize_to_bf16: weights must be 4-byte and output 16-byte aligned");
  switch (type) {
    case GgmlType::Q8_0: return launch_dequantize<GgmlType::Q8_0>(w, n, k, out, stream);
    case GgmlType::Q2_K: return launch_dequantize<GgmlType::Q2_K>(w, n, k, out, stream);
    case GgmlType::Q3_K: return launch_dequantize<GgmlType::Q3_K>(w, n, k, out, stream);
    case GgmlType::Q4_K: return launch_dequantize<GgmlType::Q4_K>(w, n, k, out, stream);
    case GgmlType::Q6_K: return launch_dequantize<GgmlType::Q6_K>(w, n, k, out, stream);
    case GgmlType::MXFP4: return launch_dequantize<GgmlType::MXFP4>(w, n, k, out, stream);
    case GgmlType::IQ2_XXS: return launch_dequantize<GgmlType::IQ2_XXS>(w, n, k, out, stream);
    case GgmlType::Q4_0: return launch_dequantize<GgmlType::Q4_0>(w, n, k, out, stream);
    case GgmlType::Q4_1: return launch_dequantize<GgmlType::Q4_1>(w, n, k, out, stream);
    case GgmlType::Q5_0: return launch_dequantize<GgmlType::Q5_0>(w, n, k, out, stream);
    case GgmlType::Q5_1: return launch_dequantize<GgmlType::Q5_1>(w, n, k, out, stream);
    case GgmlType::IQ4_NL: return launch_dequantize<GgmlType::IQ4_NL>(w, n, k, out, stream);
    case GgmlType::Q5_K: return launch_dequantize<GgmlType::Q5_K>(w, n, k, out, stream);
    case GgmlType::IQ4_XS: return launch_dequantize<GgmlType::IQ4_XS>(w, n, k, out, stream);
    case GgmlType::IQ2_XS: return launch_dequantize<GgmlType::IQ2_XS>(w, n, k, out, stream);
    case GgmlType::IQ2_S: return launch_dequantize<GgmlType::IQ2_S>(w, n, k, out, stream);
    case GgmlType::IQ3_XXS: return launch_dequantize<GgmlType::IQ3_XXS>(w, n, k, out, stream);
    case GgmlType::IQ3_S: return launch_dequantize<GgmlType::IQ3_S>(w, n, k, out, stream);
    case GgmlType::IQ1_S: return launch_dequantize<GgmlType::IQ1_S>(w, n, k, out, stream);
    case GgmlType::IQ1_M: return launch_dequantize<GgmlType::IQ1_M>(w, n, k, out, stream);
    default: return Status::error("dequantize_to_bf16: unreachable type");
  }
}

Status convert_f32_to_bf16(const float* x, int64_t count, __nv_bfloat16* out, cudaStream_t stream) {
  if (count <= 0) return Status::ok();
  f32_to_bf16_kernel<<<static_cast<unsigned>((count + 255) / 256), 256, 0, stream>>>(x, count, out);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

namespace {

// The largest power of two up to 256 that divides the address.
uint32_t pointer_alignment(const void* p) {
  const auto at = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && at % align != 0) align /= 2;
  return align;
}

// C [m][n] f32 (rows ldc apart) = A [m][k] (rows lda apart) · W [n][k]^T (rows ldw apart), A and W
// of `type`, f32 accumulation (CUBLAS_COMPUTE_32F: no TF32).
Status lt_matmul(cublasLtHandle_t handle, cudaDataType_t type, const void* a, int64_t lda, const void* w, int64_t ldw,
                 float* c, int64_t ldc, int64_t m, int64_t n, int64_t k, void* workspace, size_t workspace_bytes,
                 cudaStream_t stream, const char* what, bool tell_alignment = false) {
  if (m <= 0 || n <= 0 || k <= 0) return Status::error(std::string(what) + ": empty shape");
  // Column-major view: C^T (n x m) = W (k x n)^T · A^T (k x m).
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t lw = nullptr, la = nullptr, lc = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  auto cleanup = [&] {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (lw) cublasLtMatrixLayoutDestroy(lw);
    if (op) cublasLtMatmulDescDestroy(op);
  };
  Status st = [&]() -> Status {
    DSV4_CUBLAS_TRY(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
    DSV4_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof transpose));
    DSV4_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof keep));
    DSV4_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&lw, type, static_cast<uint64_t>(k), static_cast<uint64_t>(n), ldw));
    DSV4_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&la, type, static_cast<uint64_t>(k), static_cast<uint64_t>(m), lda));
    DSV4_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, static_cast<uint64_t>(n), static_cast<uint64_t>(m), ldc));
    DSV4_CUBLAS_TRY(cublasLtMatmulPreferenceCreate(&pref));
    DSV4_CUBLAS_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                         &workspace_bytes, sizeof workspace_bytes));
    // The buffers' real alignment where asked (cuBLASLt assumes 256 bytes unless told): a
    // split product's output is a column slice of y, which may start on any 4-byte boundary.
    if (tell_alignment) {
      const uint32_t align_w = pointer_alignment(w), align_a = pointer_alignment(a), align_c = pointer_alignment(c);
      const std::pair<cublasLtMatmulPreferenceAttributes_t, const uint32_t*> aligns[] = {
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_w},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_a},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c}};
      for (const auto& [attribute, value] : aligns)
        DSV4_CUBLAS_TRY(cublasLtMatmulPreferenceSetAttribute(pref, attribute, value, sizeof *value));
    }
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    DSV4_CUBLAS_TRY(cublasLtMatmulAlgoGetHeuristic(handle, op, lw, la, lc, lc, pref, 1, &result, &found));
    if (found == 0)
      return Status::error(std::string(what) + ": cuBLASLt has no algorithm for m " + std::to_string(m) + " n " +
                           std::to_string(n) + " k " + std::to_string(k));
    const float alpha = 1.0f, beta = 0.0f;
    DSV4_CUBLAS_TRY(cublasLtMatmul(handle, op, &alpha, w, lw, a, la, &beta, c, lc, c, lc, &result.algo, workspace,
                                   workspace_bytes, stream));
    return Status::ok();
  }();
  cleanup();
  return st;
}

}  // namespace

Status gemm_bf16(cublasLtHandle_t handle, const __nv_bfloat16* a, const __nv_bfloat16* w, float* c, int64_t m,
                 int64_t n, int64_t k, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  return lt_matmul(handle, CUDA_R_16BF, a, k, w, k, c, n, m, n, k, workspace, workspace_bytes, stream, "gemm_bf16");
}

Status gemm_f32(cublasLtHandle_t handle, const float* a, int64_t lda, const float* w, int64_t ldw, float* c,
                int64_t ldc, int64_t m, int64_t n, int64_t k, void* workspace, size_t workspace_bytes,
                cudaStream_t stream) {
  return lt_matmul(handle, CUDA_R_32F, a, lda, w, ldw, c, ldc, m, n, k, workspace, workspace_bytes, stream,
                   "gemm_f32");
}

namespace {

// One thread: 8 consecutive values of a row, each of the TERMS parts written as one 16-byte
// piece (bf16_split.h's layout).
template <int TERMS, Bf16SplitSide SIDE>
__global__ void split_to_bf16_kernel(const float* __restrict__ x, int64_t ldx, int64_t rows, int64_t k,
                                     __nv_bfloat16* __restrict__ out) {
  const int64_t per_row = k / 8;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * per_row) return;
  const int64_t r = i / per_row, c = (i % per_row) * 8;
  const float* src = x + r * ldx + c;
  uint32_t packed[3][4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const Bf16Parts a = bf16_split(src[2 * e]), b = bf16_split(src[2 * e + 1]);
#pragma unroll
    for (int p = 0; p < 3; ++p) packed[p][e] = a.part[p] | static_cast<uint32_t>(b.part[p]) << 16;
  }
  __nv_bfloat16* row = out + r * TERMS * k + c;
#pragma unroll
  for (int t = 0; t < TERMS; ++t) {
    const uint32_t(&p)[4] = packed[bf16_split_part(SIDE, t)];
    *reinterpret_cast<uint4*>(row + t * k) = make_uint4(p[0], p[1], p[2], p[3]);
  }
}

}  // namespace

Status split_to_bf16(const float* x, int64_t ldx, int64_t rows, int64_t k, int terms, Bf16SplitSide side,
                     __nv_bfloat16* out, cudaStream_t stream) {
  if (!bf16_split_terms_valid(terms) || rows <= 0 || k <= 0 || k % 8 != 0 || ldx < k)
    return Status::errorf("split_to_bf16: {} terms of {} rows x {} (rows {} apart): terms must be 3 or 6, k a "
                          "positive multiple of 8", terms, rows, k, ldx);
  if (reinterpret_cast<uintptr_t>(out) % 16 != 0) return Status::error("split_to_bf16: output must be 16-byte aligned");
  const int64_t threads = rows * (k / 8);
  const unsigned blocks = static_cast<unsigned>((threads + 255) / 256);
  const bool weights = side == Bf16SplitSide::weights;
  if (terms == 3 && !weights)
    split_to_bf16_kernel<3, Bf16SplitSide::activations><<<blocks, 256, 0, stream>>>(x, ldx, rows, k, out);
  else if (terms == 3)
    split_to_bf16_kernel<3, Bf16SplitSide::weights><<<blocks, 256, 0, stream>>>(x, ldx, rows, k, out);
  else if (!weights)
    split_to_bf16_kernel<6, Bf16SplitSide::activations><<<blocks, 256, 0, stream>>>(x, ldx, rows, k, out);
  else
    split_to_bf16_kernel<6, Bf16SplitSide::weights><<<blocks, 256, 0, stream>>>(x, ldx, rows, k, out);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

Status gemm_bf16_split(cublasLtHandle_t handle, const __nv_bfloat16* a, const __nv_bfloat16* w, float* c,
                       int64_t ldc, int64_t m, int64_t n, int64_t k, int terms, void* workspace,
                       size_t workspace_bytes, cudaStream_t stream) {
  if (!bf16_split_terms_valid(terms)) return Status::errorf("gemm_bf16_split: {} terms (3 or 6)", terms);
  const int64_t kk = terms * k;
  return lt_matmul(handle, CUDA_R_16BF, a, kk, w, kk, c, ldc, m, n, kk, workspace, workspace_bytes, stream,
                   "gemm_bf16_split", /*tell_alignment=*/true);
}

Status gemm_prefill(cublasLtHandle_t handle, GgmlType type, const void* w, int64_t n, int64_t k,
                    const __nv_bfloat16* a, int64_t m, float* c, __nv_bfloat16* w_bf16, void* workspace,
                    size_t workspace_bytes, cudaStream_t stream) {
  const __nv_bfloat16* weights = static_cast<const __nv_bfloat16*>(w);
  if (type != GgmlType::BF16) {
    DSV4_TRY(dequantize_to_bf16(type, w, n, k, w_bf16, stream));
    weights = w_bf16;
  }
  return gemm_bf16(handle, a, weights, c, m, n, k, workspace, workspace_bytes, stream);
}

}  // namespace dsv4::cuda
