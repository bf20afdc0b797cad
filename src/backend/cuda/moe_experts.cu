#include "backend/cuda/moe_experts.h"

#include <algorithm>
#include <string>

#include "backend/cuda/activation_quant.h"
#include "backend/cuda/matvec.h"
#include "backend/cuda/matvec_launch.cuh"
#include "backend/cuda/mmq.h"
#include "backend/cuda/mmq_launch.cuh"
#include "backend/cuda/moe_wgmma.h"
#include "backend/cuda/gemm_prefill.h"

namespace dsv4::cuda {

namespace {

using detail::MatvecArgs;
using detail::MatvecMode;

constexpr int kTileRows = detail::kExpertTileRows;  // tokens per expert tile on the batched path

size_t align256(size_t n) { return (n + 255) & ~size_t{255}; }

struct Layout {
  size_t x_q = 0, x16 = 0, h = 0, h_q = 0, partial = 0, pairs = 0, tiles = 0, total = 0;
  int64_t max_tiles = 0;
};

// The quantised activations of `rows` rows of k values for either kernel family (the dp4a
// kernels' interleaved layout or the tensor cores' row-major one), whichever is larger.
size_t activation_bytes(GgmlType type, int64_t rows, int64_t k) {
  if (type == GgmlType::BF16) return 0;
  return std::max(quantized_activations_bytes(rows, k, detail::activation_layout(type, k)),
                  quantized_activations_bytes(rows, k, mma_activation_layout()));
}

Layout layout(const ExpertWeights& w, int64_t tokens, int top_k) {
  Layout l;
  const int64_t pairs = tokens * top_k;
  const bool decode = tokens <= kMoeDecodeMaxTokens;
  // The tiles of 8 pairs bound the count for the tiles of 64 too.
  l.max_tiles = decode ? 0 : std::min(pairs, pairs / kTileRows + w.n_experts);
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t here = at;
    at += align256(bytes);
    return here;
  };
  l.x_q = take(activation_bytes(w.gate_up_type, tokens, w.hidden));
  l.x16 = take(decode ? 0 : static_cast<size_t>(tokens * w.hidden) * sizeof(__nv_bfloat16));  // the wgmma path
  l.h = take(static_cast<size_t>(pairs * w.ffn) * sizeof(float));
  l.h_q = take(activation_bytes(w.down_type, pairs, w.ffn));
  l.partial = take(decode ? 0 : static_cast<size_t>(pairs * w.hidden) * sizeof(float));
  l.pairs = take(decode ? 0 : static_cast<size_t>(pairs) * sizeof(int));
  l.tiles = take(decode ? 0 : static_cast<size_t>(3 * l.max_tiles + 1) * sizeof(int));
  l.total = at;
  return l;
}

// One block: counting sort of the (token, slot) pairs by expert, then tiles of at most
// `tile_rows` pairs of one expert. Pair order inside an expert follows atomics and does not
// affect any result.
__global__ void build_tiles_kernel(const int32_t* __restrict__ ids, int pairs, int n_experts, int tile_rows,
                                   int* __restrict__ sorted_pairs, int* __restrict__ tile_expert,
                                   int* __restrict__ tile_first, int* __restrict__ tile_count,
                                   int* __restrict__ n_tiles) {
  extern __shared__ int counts[];  // [n_experts] counts, then [n_experts] offsets, [n_experts] first tile
  int* offsets = counts + n_experts;
  int* first_tile = offsets + n_experts;
  for (int e = threadIdx.x; e < n_experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) atomicAdd(&counts[ids[p]], 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    int offset = 0, tiles = 0;
    for (int e = 0; e < n_experts; ++e) {
      offsets[e] = offset;
      first_tile[e] = tiles;
      offset += counts[e];
      tiles += (counts[e] + tile_rows - 1) / tile_rows;
    }
    *n_tiles = tiles;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < n_experts; e += blockDim.x) {
    for (int t = 0; t * tile_rows < counts[e]; ++t) {
      const int tile = first_tile[e] + t;
      tile_expert[tile] = e;
      tile_first[tile] = offsets[e] + t * tile_rows;
      tile_count[tile] = min(tile_rows, counts[e] - t * tile_rows);
    }
    counts[e] = 0;  // reused as the scatter cursor
  }
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int e = ids[p];
    sorted_pairs[offsets[e] + atomicAdd(&counts[e], 1)] = p;
  }
}

// y[t][i] = sum over slots s of partial[t*top_k + s][i], slots in order.
__global__ void sum_slots_kernel(const float* __restrict__ partial, int64_t tokens, int top_k, int64_t hidden,
                                 float* __restrict__ y) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= tokens * hidden) return;
  const int64_t t = idx / hidden, i = idx % hidden;
  float s = 0.0f;
  for (int k = 0; k < top_k; ++k) s += partial[(t * top_k + k) * hidden + i];
  y[idx] = s;
}

// The pairs of `routing` sorted by expert into tiles of at most tile_rows (one block), in the
// workspace's room for them (layout: max_tiles bounds every tile size used here).
Status sort_into_tiles(const ExpertRouting& routing, int64_t n_experts, int tile_rows, int64_t max_tiles, uint8_t* ws,
                       const Layout& l, cudaStream_t stream, detail::ExpertTiles* tiles) {
  auto* sorted_pairs = reinterpret_cast<int*>(ws + l.pairs);
  auto* tile_expert = reinterpret_cast<int*>(ws + l.tiles);
  int* tile_first = tile_expert + max_tiles;
  int* tile_count = tile_first + max_tiles;
  int* n_tiles = tile_count + max_tiles;
  const size_t sort_smem = static_cast<size_t>(3 * n_experts) * sizeof(int);
  build_tiles_kernel<<<1, 1024, sort_smem, stream>>>(routing.ids, static_cast<int>(routing.tokens * routing.top_k),
                                                     static_cast<int>(n_experts), tile_rows, sorted_pairs, tile_expert,
                                                     tile_first, tile_count, n_tiles);
  DSV4_CUDA_TRY_LAUNCH();
  *tiles = detail::ExpertTiles{sorted_pairs, tile_expert, tile_first, tile_count, n_tiles, max_tiles};
  return Status::ok();
}

template <class Policy>
Status gate_up(const MatvecArgs& a, bool decode, int64_t max_tiles, cudaStream_t stream) {
  if (decode) return detail::launch_matvec<Policy, 1, MatvecMode::kGateUp>(a, 2, max_tiles, stream);
  return detail::launch_matvec<Policy, kTileRows, MatvecMode::kGateUp>(a, 2, max_tiles, stream);
}

template <class Policy>
Status down(const MatvecArgs& a, bool decode, int64_t tasks, cudaStream_t stream) {
  if (decode) return detail::launch_matvec<Policy, 1, MatvecMode::kDownSum>(a, a.top_k, tasks, stream);
  return detail::launch_matvec<Policy, kTileRows, MatvecMode::kDownTiled>(a, 1, tasks, stream);
}

template <template <class> class Op, class... Args>
Status dispatch(GgmlType type, Args&&... args) {
  switch (type) {
    case GgmlType::Q8_0: return Op<detail::QuantPolicy<GgmlType::Q8_0>>::run(args...);
    case GgmlType::Q2_K: return Op<detail::QuantPolicy<GgmlType::Q2_K>>::run(args...);
    case GgmlType::Q3_K: return Op<detail::QuantPolicy<GgmlType::Q3_K>>::run(args...);
    case GgmlType::Q4_K: return Op<detail::QuantPolicy<GgmlType::Q4_K>>::run(args...);
    case GgmlType::Q6_K: return Op<detail::QuantPolicy<GgmlType::Q6_K>>::run(args...);
    case GgmlType::MXFP4: return Op<detail::QuantPolicy<GgmlType::MXFP4>>::run(args...);
    case GgmlType::IQ2_XXS: return Op<detail::QuantPolicy<GgmlType::IQ2_XXS>>::run(args...);
    case GgmlType::BF16: return Op<detail::Bf16Policy>::run(args...);
    default:
      if (detail::is_added_type(type)) return Op<void>::run_added(type, args...);
      return Status::error("moe_experts: weight type " + std::string(ggml_type_name(type)) + " not supported");
  }
}

// run_added: the types compiled in matvec_nibble_types.cu / matvec_codebook_types.cu.
template <class Policy>
struct GateUpOp {
  static Status run(const MatvecArgs& a, bool decode, int64_t max_tiles, cudaStream_t s) {
    return gate_up<Policy>(a, decode, max_tiles, s);
  }
  static Status run_added(GgmlType type, const MatvecArgs& a, bool decode, int64_t max_tiles, cudaStream_t s) {
    return detail::run_added_types(type, a, detail::MatvecCall{detail::MatvecOp::kGateUp, 1, decode, max_tiles}, s);
  }
};
template <class Policy>
struct DownOp {
  static Status run(const MatvecArgs& a, bool decode, int64_t tasks, cudaStream_t s) {
    return down<Policy>(a, decode, tasks, s);
  }
  static Status run_added(GgmlType type, const MatvecArgs& a, bool decode, int64_t tasks, cudaStream_t s) {
    return detail::run_added_types(type, a, detail::MatvecCall{detail::MatvecOp::kDown, 1, decode, tasks}, s);
  }
};

Status check_type(GgmlType type, int64_t k, const char* what) {
  const auto& traits = ggml_traits(type);
  if (!matvec_supported(type) || k % traits.block_elems != 0 || k % 32 != 0)
    return Status::error(std::string("moe_experts: ") + what + " type " + std::string(traits.name) +
                         " with rows of " + std::to_string(k) + " values is not supported");
  return Status::ok();
}

void set_activations(MatvecArgs& a, GgmlType type, const float* f, const QuantizedActivations& q, int64_t k) {
  a.act = detail::ActView{};
  a.act.k = k;
  if (type == GgmlType::BF16) {
    a.act.f = f;
  } else {
    a.act.q = q.q;
    a.act.d = q.d;
    a.act.s16 = q.s16;
    a.act.padded_k = q.padded_k;
    a.act.unit_weights = q.layout.unit_weights;
    a.act.lanes = q.layout.lanes;
  }
}

// Tensor-core tiles for many tokens: both types supported, and 8 or 64 pairs per tile by the
// mean pairs per expert (a 64-wide tile skips its empty column tiles, but holds shared memory
// for all of them).
bool mma_tiles_apply(const ExpertWeights& w) {
  return mma_matmul_supported(w.gate_up_type) && mma_matmul_supported(w.down_type);
}
int mma_tile_columns(const ExpertWeights& w, int64_t pairs) { return pairs <= 4 * w.n_experts ? 8 : 64; }

Status moe_experts_mma(const ExpertWeights& w, const float* x, const ExpertRouting& routing, float swiglu_limit,
                       float* y, uint8_t* ws, const Layout& l, cudaStream_t stream) {
  const int64_t tokens = routing.tokens, pairs = tokens * routing.top_k;
  const int tile_cols = mma_tile_columns(w, pairs);
  const int nt = tile_cols / 8;
  const int64_t max_tiles = std::min(pairs, pairs / tile_cols + w.n_experts);
  auto* h = reinterpret_cast<float*>(ws + l.h);
  detail::ExpertTiles tiles;
  DSV4_TRY(sort_into_tiles(routing, w.n_experts, tile_cols, max_tiles, ws, l, stream, &tiles));

  const QuantizedActivations xq = quantized_activations_view(ws + l.x_q, tokens, w.hidden, mma_activation_layout());
  DSV4_TRY(quantize_activations_q8(x, xq, stream));
  const auto& gu = ggml_traits(w.gate_up_type);
  detail::MmqArgs g;
  g.w[0] = static_cast<const uint8_t*>(w.gate);
  g.w[1] = static_cast<const uint8_t*>(w.up);
  g.row_bytes = w.hidden / gu.block_elems * gu.block_bytes;
  g.matrix_stride = g.row_bytes * w.ffn;
  g.n = w.ffn;
  g.k = w.hidden;
  g.k_stages = static_cast<int>((w.hidden + detail::kMmqStageK - 1) / detail::kMmqStageK);
  g.stages_per_split = g.k_stages;
  g.split = 1;
  g.row_tiles = (w.ffn + 31) / 32;
  g.q = xq.q;
  g.d = xq.d;
  g.s16 = xq.s16;
  g.n_tiles = tiles.n_tiles;
  g.tile_expert = tiles.tile_expert;
  g.tile_first = tiles.tile_first;
  g.tile_count = tiles.tile_count;
  g.sorted_pairs = tiles.sorted_pairs;
  g.top_k = routing.top_k;
  g.pair_weight = routing.weights;
  g.limit = swiglu_limit;
  g.out = h;
  DSV4_TRY(detail::launch_mmq(w.gate_up_type, g, nt, detail::MmqMode::kGateUp, max_tiles, stream));

  const QuantizedActivations hq = quantized_activations_view(ws + l.h_q, pairs, w.ffn, mma_activation_layout());
  DSV4_TRY(quantize_activations_q8(h, hq, stream));
  const auto& dt = ggml_traits(w.down_type);
  detail::MmqArgs d = g;
  d.w[0] = static_cast<const uint8_t*>(w.down);
  d.w[1] = nullptr;
  d.row_bytes = w.ffn / dt.block_elems * dt.block_bytes;
  d.matrix_stride = d.row_bytes * w.hidden;
  d.n = w.hidden;
  d.k = w.ffn;
  d.k_stages = static_cast<int>((w.ffn + detail::kMmqStageK - 1) / detail::kMmqStageK);
  d.stages_per_split = d.k_stages;
  d.row_tiles = (w.hidden + detail::kMmqTileRows - 1) / detail::kMmqTileRows;
  d.q = hq.q;
  d.d = hq.d;
  d.s16 = hq.s16;
  d.top_k = 1;
  d.pair_weight = nullptr;
  auto* partial = reinterpret_cast<float*>(ws + l.partial);
  d.out = partial;
  const detail::MmqMode down_mode = nt == 1 ? detail::MmqMode::kPlain : detail::MmqMode::kExpertDown;
  DSV4_TRY(detail::launch_mmq(w.down_type, d, nt, down_mode, max_tiles, stream));
  const int64_t n = tokens * w.hidden;
  sum_slots_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(partial, tokens, routing.top_k, w.hidden, y);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}


// Prefill-size batches on wgmma (moe_wgmma.h): tiles of up to 128 pairs of one expert, x and h
// in BF16, the weights decoded inside the products.
Status moe_experts_wgmma(const ExpertWeights& w, const float* x, const ExpertRouting& routing, float swiglu_limit,
                         float* y, uint8_t* ws, const Layout& l, cudaStream_t stream) {
  const int64_t tokens = routing.tokens, pairs = tokens * routing.top_k;
  const int64_t max_tiles = std::min(pairs, pairs / detail::kMoeWgmmaTileTokens + w.n_experts);
  detail::ExpertTiles tiles;
  DSV4_TRY(sort_into_tiles(routing, w.n_experts, detail::kMoeWgmmaTileTokens, max_tiles, ws, l, stream, &tiles));
  auto* x16 = reinterpret_cast<__nv_bfloat16*>(ws + l.x16);
  auto* h16 = reinterpret_cast<__nv_bfloat16*>(ws + l.h);  // pairs x ffn BF16 in the f32 h's room
  auto* partial = reinterpret_cast<float*>(ws + l.partial);
  DSV4_TRY(convert_f32_to_bf16(x, tokens * w.hidden, x16, stream));
  DSV4_TRY(detail::moe_wgmma_gate_up(w, x16, routing.weights, routing.top_k, swiglu_limit, tiles, h16, stream));
  DSV4_TRY(detail::moe_wgmma_down(w, h16, tiles, partial, stream));
  const int64_t n = tokens * w.hidden;
  sum_slots_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(partial, tokens, routing.top_k, w.hidden, y);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

}  // namespace

bool moe_experts_fused_decode(const ExpertWeights& w, int64_t tokens, int top_k) {
  const KernelChoice choice = kernel_choice();
  if (!choice.moe_decode || !detail::moe_decode_applies(w, tokens, top_k)) return false;
  if (tokens <= kMoeDecodeMaxTokens) return true;
  return choice.moe_decode_wide && !choice.batch_invariant && tokens <= kMoeDecodeWideMaxTokens &&
         tokens * top_k <= 4 * w.n_experts;
}

size_t moe_experts_workspace_bytes(const ExpertWeights& w, int64_t tokens, int top_k) {
  return std::max(layout(w, tokens, top_k).total, detail::moe_decode_workspace_bytes(w, tokens, top_k));
}

Status moe_experts(const ExpertWeights& w, const float* x, const ExpertRouting& routing, float swiglu_limit,
                   float* y, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  DSV4_TRY(check_type(w.gate_up_type, w.hidden, "gate/up"));
  DSV4_TRY(check_type(w.down_type, w.ffn, "down"));
  if (w.n_experts <= 0 || w.n_experts > 4096 || routing.top_k <= 0 || routing.top_k > w.n_experts)
    return Status::error("moe_experts: " + std::to_string(routing.top_k) + " of " + std::to_string(w.n_experts) +
                         " experts (supported: 1..4096 experts, top_k <= experts)");
  for (const void* p : {w.gate, w.up, w.down})
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return Status::error("moe_experts: weights not 16-byte aligned");
  const int64_t tokens = routing.tokens;
  if (tokens <= 0) return Status::ok();
  const int64_t pairs = tokens * routing.top_k;
  if (pairs > (int64_t{1} << 24)) return Status::error("moe_experts: " + std::to_string(pairs) + " pairs, limit 2^24");
  const Layout l = layout(w, tokens, routing.top_k);
  const size_t need = moe_experts_workspace_bytes(w, tokens, routing.top_k);
  if (workspace_bytes < need)
    return Status::error("moe_experts: workspace of " + std::to_string(workspace_bytes) + " bytes, need " +
                         std::to_string(need));
  auto* ws = static_cast<uint8_t*>(workspace);
  const bool decode = tokens <= kMoeDecodeMaxTokens;
  const KernelChoice choice = kernel_choice();
  // Batch-invariant mode: the per-token decode path in slices of kMoeDecodeMaxTokens tokens,
  // each token's pairs computed on their own (no tiles shared with other tokens). The
  // slices run one after another in the stream and reuse the workspace, which the whole
  // call's sizing covers (a slice's layout is the decode layout, the smallest).
  if (choice.batch_invariant && !decode) {
    for (int64_t t0 = 0; t0 < tokens; t0 += kMoeDecodeMaxTokens) {
      ExpertRouting slice = routing;
      slice.tokens = std::min(kMoeDecodeMaxTokens, tokens - t0);
      slice.ids = routing.ids + t0 * routing.top_k;
      slice.weights = routing.weights + t0 * routing.top_k;
      DSV4_TRY(moe_experts(w, x + t0 * w.hidden, slice, swiglu_limit, y + t0 * w.hidden, workspace, workspace_bytes,
                           stream));
    }
    return Status::ok();
  }
  if (moe_experts_fused_decode(w, tokens, routing.top_k) && reinterpret_cast<uintptr_t>(x) % 16 == 0)
    return detail::moe_decode(w, x, routing, swiglu_limit, y, workspace, workspace_bytes, stream);
  if (!decode && choice.moe_wgmma && detail::moe_wgmma_applies(w, pairs))
    return moe_experts_wgmma(w, x, routing, swiglu_limit, y, ws, l, stream);
  if (!decode && choice.moe_mma && mma_tiles_apply(w))
    return moe_experts_mma(w, x, routing, swiglu_limit, y, ws, l, stream);
  auto* h = reinterpret_cast<float*>(ws + l.h);
  detail::ExpertTiles tiles;
  if (!decode) DSV4_TRY(sort_into_tiles(routing, w.n_experts, kTileRows, l.max_tiles, ws, l, stream, &tiles));

  const auto& gu = ggml_traits(w.gate_up_type);
  MatvecArgs a;
  a.w[0] = static_cast<const uint8_t*>(w.gate);
  a.w[1] = static_cast<const uint8_t*>(w.up);
  a.row_bytes = static_cast<int64_t>(w.hidden / gu.block_elems * gu.block_bytes);
  a.matrix_stride = a.row_bytes * w.ffn;
  a.n = w.ffn;
  if (decode) {
    a.n_tasks = pairs;
  } else {
    a.n_tiles = tiles.n_tiles;
    a.tile_expert = tiles.tile_expert;
    a.tile_first = tiles.tile_first;
    a.tile_count = tiles.tile_count;
    a.sorted_pairs = tiles.sorted_pairs;
  }
  a.expert_ids = routing.ids;
  a.pair_weight = routing.weights;
  a.top_k = routing.top_k;
  a.limit = swiglu_limit;
  a.out = h;
  const QuantizedActivations xq = quantized_activations_view(ws + l.x_q, tokens, w.hidden,
                                                             detail::activation_layout(w.gate_up_type, w.hidden));
  if (w.gate_up_type != GgmlType::BF16) DSV4_TRY(quantize_activations_q8(x, xq, stream));
  set_activations(a, w.gate_up_type, x, xq, w.hidden);
  DSV4_TRY(dispatch<GateUpOp>(w.gate_up_type, a, decode, decode ? pairs : l.max_tiles, stream));

  const QuantizedActivations hq =
      quantized_activations_view(ws + l.h_q, pairs, w.ffn, detail::activation_layout(w.down_type, w.ffn));
  if (w.down_type != GgmlType::BF16) DSV4_TRY(quantize_activations_q8(h, hq, stream));
  const auto& dt = ggml_traits(w.down_type);
  MatvecArgs d = a;
  d.w[0] = static_cast<const uint8_t*>(w.down);
  d.w[1] = nullptr;
  d.row_bytes = static_cast<int64_t>(w.ffn / dt.block_elems * dt.block_bytes);
  d.matrix_stride = d.row_bytes * w.hidden;
  d.n = w.hidden;
  set_activations(d, w.down_type, h, hq, w.ffn);
  if (decode) {
    d.n_tasks = tokens;
    d.out = y;
    return dispatch<DownOp>(w.down_type, d, true, tokens, stream);
  }
  auto* partial = reinterpret_cast<float*>(ws + l.partial);
  d.out = partial;
  DSV4_TRY(dispatch<DownOp>(w.down_type, d, false, l.max_tiles, stream));
  const int64_t n = tokens * w.hidden;
  sum_slots_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(partial, tokens, routing.top_k, w.hidden, y);
  DSV4_CUDA_TRY_LAUNCH();
  return Status::ok();
}

}  // namespace dsv4::cuda
