// Matrix-vector and skinny matrix products (1-64 activation rows) straight from quantised
// weights, for decode: y[b][r] = W[b] · x[b][r] for every batch matrix b and row r.
// Integer types quantise the activations to Q8 (per 32 values, activation_quant.h): one row
// runs __dp4a kernels (matvec_row_kernel.cuh, matvec_kernel.cuh), 2-64 rows the int8
// tensor-core kernels of mmq.h (the dp4a kernel for 2-16 rows where those do not apply);
// BF16 weights multiply f32 activations (matvec_bf16.cu, 1-16 rows). Design and error bounds:
// docs/CUDA.md.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "gguf/ggml_types.h"
#include "util/status.h"

namespace dsv4::cuda {

// Q8_0, Q2_K, Q3_K, Q4_K, Q6_K, MXFP4, IQ2_XXS, BF16, and Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q5_K,
// IQ4_XS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M (no one-row kernel for these; IQ2_XXS has
// no tensor-core kernel, so 1-16 rows).
bool matvec_supported(GgmlType type);

// Uploads the constant tables the kernels use (the i-quants' grids). Done on first use otherwise;
// call it before capturing CUDA graphs, where the upload is not allowed.
Status prepare_matvec_tables();

// Row-major weights [batch][n][k] in GGUF's block layout. The data must start 16-byte
// aligned and stay readable up to the next multiple of 16 bytes past its end (the kernel
// copies whole 16-byte chunks); matrices of a batch may start anywhere.
struct MatvecWeights {
  GgmlType type = GgmlType::Q8_0;
  const void* data = nullptr;
  int64_t n = 0;  // output features (rows)
  int64_t k = 0;  // input features, a multiple of the type's block size
  int64_t batch = 1;
  int64_t batch_stride_bytes = 0;  // 0: the matrices are contiguous (may be negative)
  // Every matrix of the batch multiplies the same x ([rows][k], one row): a layer's products of
  // one input in one launch (the shared expert's gate and up, CudaBackend::swiglu_expert), each
  // output the bits of its matrix alone.
  bool shared_x = false;
};

// Rows every type takes; up to 64 (kMmaMaxRows, mmq.h) where mma_matmul_applies.
inline constexpr int kMatvecMaxRows = 16;

// Up to this many activation rows, a product gives each row the bits of the same product of
// that row alone (KernelChoice::matvec_rows, on by default): the one-row kernels run each row
// over the weights staged once. Steps this small (a few sequences' decode, one sequence's MTP
// verify of up to 4 drafts, or 2 sequences' of up to 3) are row-local in attention too
// (attention_ops.cu), so a verify row's logits are bit for bit its decode step's.
inline constexpr int kRowKernelMaxRows = 8;

// Which kernels the products use: the newer ones by default, each of which can be switched
// back to the path it replaced (for same-run comparisons, and as a way back should one
// misbehave). Process-wide; set before capturing CUDA graphs (a captured graph keeps the
// kernels it recorded). The environment variable DSV4_CUDA_LEGACY, read at first use, turns
// named ones off: a comma-separated list of the names in quotes below, or "all".
struct KernelChoice {
  bool matvec_bf16 = true;       // "bf16": BF16 weights through matvec_bf16.cu (else the general kernel)
  bool matvec_row_extra = true;  // "row": one row of MXFP4, Q4_K, Q6_K through the one-row kernel
  bool matvec_mma = true;        // "mma": 2-64 rows on the int8 tensor cores (else dp4a, at most 16)
  bool moe_decode = true;        // "moe_decode": 1-16 tokens through moe_decode.cu's two fused kernels
  // "decode64": 17-64 tokens with at most 4 pairs an expert (many sequences' decode steps) also
  // through moe_decode.cu (else the tensor-core tiles of 8 pairs).
  bool moe_decode_wide = true;
  // "pairmajor": moe_decode.cu's gate/up blocks ordered row block first, pair second, so that
  // the pairs of one expert read the same rows at the same time (one read from memory, the
  // rest from L2); else pair first (each pair's rows one after another).
  bool moe_decode_rows_first = true;
  bool moe_mma = true;           // "moe_mma": expert tiles of more tokens on the int8 tensor cores
  bool moe_wgmma = true;         // "moe_wgmma": prefill-size expert batches on wgmma (moe_wgmma.h)
  // "wgdecode": those wgmma tiles decode Q2_K / Q3_K weights in BF16 pair arithmetic (the
  // codes made BF16 by bit operations, the sub-block scales shared by the four lanes of a row;
  // moe_wgmma.cu), else one weight at a time in f32 as quant_decode.h, rounded once.
  bool moe_wgmma_pair_decode = true;
  // "wgn96": those tiles with 65-96 pairs run m64n96k16 (else m64n128k16, a quarter of its
  // columns empty at 96).
  bool moe_wgmma_n96 = true;
  // "rows": 2..kRowKernelMaxRows rows with the one-row arithmetic, so that a row's outputs are
  // the bits it gets alone (else the tensor-core kernels, whose sums run in another order).
  bool matvec_rows = true;
  // "grouped": grouped products (CudaBackend::matmul_grouped, wo_a) of 2-64 rows as one
  // batched product through group-major copies (else a product per group).
  bool grouped_batch = true;
  // "bulk": the int8 tensor-core kernels (mmq_kernel.cuh) of Q8_0 and Q6_K with up to 16
  // columns fill their stages by bulk copies (one per weight row span and activation column, on
  // an mbarrier) where k is a multiple of 256 (else 16-byte cp.async from every thread).
  bool mmq_bulk = true;
  // "ring2": those bulk-copied products in a ring of 2 stages (4 blocks an SM) instead of 3.
  bool mmq_bulk_ring2 = true;
  // "f32tiles": Float32-mode products of Q8_0 weights (the compressors) with 2-64 rows and
  // k <= 4096 take a block of 16 outputs x 8 rows with x and weights staged in shared memory
  // (float32_rows.cu; the same bits as the kernel of one output and row a block).
  bool float32_tiles = true;
  // Float32-mode products of 65 rows and more (prefill's compressors, index weights, routers)
  // on the BF16 tensor cores as split products of this many terms (bf16_split.h: 3, ~5e-6 per
  // row; 6, below the f32 GEMM's error), else (0) cuBLASLt's f32 GEMM on the SIMT cores.
  // Environment DSV4_CUDA_FLOAT32_SPLIT=0|3|6; "f32gemm" in DSV4_CUDA_LEGACY: 0. Off until it
  // has run on a GPU (written 2026-12-08 in a session without one; docs/PERFORMANCE.md).
  int float32_split_terms = 0;
  // Not a legacy switch: batch-invariant decode (environment DSV4_CUDA_BATCH_INVARIANT=1, or
  // CudaBackendOptions::batch_invariant). Every product of 1-64 activation rows runs a kernel
  // whose per-row arithmetic does not depend on the rows beside it: the int8 tensor-core
  // kernels (mmq.h) where they apply, one row included (no one-row kernel), else the general
  // dp4a kernel in slices of 16 rows; the routed experts the per-token decode path in slices
  // of 16 tokens; attention a fixed split of the keys (attention_ops.cu). A row's
  // result is then the same bits whatever else the step holds: a sequence alone or with 63
  // others, a verify row of MTP speculation or a plain decode step. Slower (docs/PERFORMANCE.md).
  bool batch_invariant = false;
};
KernelChoice kernel_choice();
void set_kernel_choice(const KernelChoice& choice);

// Programmatic dependent launch for the matvec-family kernels (matvec, moe_experts,
// activation quantisation): each may start while the previous kernel in its stream finishes,
// streaming constant weights before waiting for its inputs. On by default; the environment
// variable DSV4_CUDA_PDL=0 turns it off at start. Process-wide; set it before capturing graphs.
void set_programmatic_launch(bool enabled);
bool programmatic_launch();

// Scratch for the quantised activations of batch * rows rows (0 for BF16), enough for whichever
// kernel kernel_choice() picks.
size_t matvec_workspace_bytes(const MatvecWeights& w, int rows);

// x: [batch][rows][k] f32, y: [batch][rows][n] f32, device memory; 1 <= rows <= 16, or up to
// 64 where mma_matmul_applies (mmq.h) and kernel_choice().matvec_mma, or in batch-invariant mode.
Status matvec(const MatvecWeights& w, const float* x, int rows, float* y, void* workspace, size_t workspace_bytes,
              cudaStream_t stream);

}  // namespace dsv4::cuda
