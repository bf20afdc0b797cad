// The DeepSeek-V4 forward pass over a Backend, one function per sublayer with the spec's
// names (shared/spec/deepseek-v4-architecture.md §2-§5). Internal to src/model/: the
// public entry points are Model::forward and Model::mtp (model.h).
//
// A step processes the rows of several sequences at once, every operation over all rows
// in one call: token-wise work (projections, norms, mHC, MoE) as rows, attention, the
// compressors and the indexer with per-sequence metadata on the device (backend.h's
// StepRows), so nothing loops over sequences and nothing waits for the device. Each block
// dispatches on its LayerPlan (layer_plan.h); the caches are views from the KvCache.
// Intermediates live in the backend's step scratch.
#pragma once

#include <vector>

#include "backend/backend.h"
#include "model/config.h"
#include "model/kv_cache.h"
#include "model/layer_plan.h"
#include "model/model.h"
#include "model/trace.h"
#include "model/weights.h"

namespace dsv4 {

// One sequence's rows within the step (host side).
struct StepItem {
  Sequence* seq = nullptr;
  int64_t row0 = 0;  // first row in the step's tensors
  int64_t n = 0;     // rows (tokens)
  int64_t pos0 = 0;  // absolute position of the first row
};

// The step's rows: host description and the device metadata built from it once.
struct Step {
  std::vector<StepItem> items;
  backend::StepRows rows;
  backend::Tensor steer_alpha;  // F32 [n]: each row's steering strength (with a binding)
};

// V4.1's per-step state that outlives a block (allocated before the first block):
// the last sublayer's hyper-connection `pre` (the delayed mix), the selections of the
// index sources, the candidate blocks, and the step's Engram rows (host side).
struct V41Step {
  backend::Tensor pre;                    // F32 [n, hc]: one-hot on stream 0 before block 0
  std::vector<backend::Tensor> selection; // per block: I32 [n, top-k] (index sources)
  backend::Tensor candidates;             // I32 [n, topk_blocks]
  std::vector<std::vector<float>> engram_rows;  // per Engram layer: [n][columns][dim]
  // DSpark's main hidden (§3.7), when asked for: F32 [n, targets * hidden], column block t
  // = the mean over the streams of target layer t's input (after its Engram).
  backend::Tensor dspark_hidden;
};

struct ForwardPass {
  const ModelConfig& c;
  const ModelPlan& plan;
  const ModelWeights& w;
  const ModelOptions& opt;
  backend::Backend& be;
  KvCache& cache;
  ForwardTrace* trace = nullptr;  // optional: receives the named intermediates (trace.h)
  const Model::Steering* steering = nullptr;  // optional: GLP directions (steering.h)

  // Uploads the step's tokens, positions and per-sequence metadata (one upload each).
  Result<Step> make_step(std::vector<StepItem> items, const std::vector<int32_t>& tokens) const;

  // §2.2: token embeddings copied into every stream: [n, hc*D].
  Result<backend::Tensor> embed(const backend::Tensor& table, const Step& step) const;
  // §2.5: one decoder block (trunk or MTP), updating streams in place.
  Status block(const LayerPlan& layer, const backend::Tensor& streams, const Step& step) const;
  // §2.3 / §2.4: the mHC collapse and expansion around a sublayer.
  // x: the collapsed input; normed: rms_norm(x, *norm) when hc_pre was given a norm.
  struct HcMix { backend::Tensor x, post, comb, normed; };
  Result<HcMix> hc_pre(const HcSite& site, const backend::Tensor& streams,
                       const backend::Tensor* norm = nullptr) const;
  Status hc_post(const backend::Tensor& y, const HcMix& mix, const backend::Tensor& streams) const;
  // §2.6 + §5: hyper head, final norm and logits.
  Result<backend::Tensor> head(const HcSite& hc, const backend::Tensor& norm,
                               const backend::Tensor& output, const backend::Tensor& streams) const;
  // §5: the MTP block's input streams from the main streams and the next tokens' embeddings.
  Result<backend::Tensor> mtp_input(const BlockWeights& bw, const backend::Tensor& streams,
                                    const Step& step) const;

  // §3 (attention.cpp): Q/KV paths, compressed entries, indexer, attention, output.
  Result<backend::Tensor> attention(const LayerPlan& layer, const backend::Tensor& x, const Step& step) const;
  // §3.3: a compressor's products of the step's rows (values and scores, [n, wide] each).
  struct CompressorInput { backend::Tensor kv, score; };
  Result<CompressorInput> compressor_input(const CompressorWeights& cw, int64_t n) const;
  // §3.3: feeds the step's rows (their products `in`) to a compressor and stores the entries
  // they complete (normed, rotated, QAT-rounded) in the cache list `list`.
  Status compress(const LayerPlan& layer, const CompressorWeights& cw, bool indexer, int32_t state,
                  int32_t list, const CompressorInput& in, const Step& step) const;
  // §3.6: the lightning indexer's queries from qr (F32 [n, heads * dk]), then its top-k
  // entries per row into idx I32 [n, top-k]; weights: the head weights x Wproj^T (F32
  // [n, heads]), scaled there.
  Result<backend::Tensor> indexer_query(const LayerPlan& layer, const backend::Tensor& qr, const Step& step) const;
  Status indexer(const LayerPlan& layer, const backend::Tensor& q, const backend::Tensor& weights,
                 const Step& step, const backend::Tensor& idx) const;

  // Steps of up to kLaneMaxRows rows put independent work on side lane 1 (backend.h's lanes):
  // one-row kernels leave most of a GPU idle; more rows' products fill it alone.
  static constexpr int64_t kLaneMaxRows = 64;
  bool lanes(const Step& step) const { return step.rows.n <= kLaneMaxRows; }
  Status side_lane(const Step& step) const { return lanes(step) ? be.fork_lane(1) : Status::ok(); }

  // V4.1 (forward_v41.cpp; shared/spec/deepseek-v41.md). `v41` must be set up by
  // v41_begin before the first block.
  V41Step* v41 = nullptr;
  Status v41_begin(const Step& step, std::vector<std::vector<float>> engram_rows) const;
  Status block_v41(const LayerPlan& layer, const backend::Tensor& streams, const Step& step) const;
  Status engram(const LayerPlan& layer, const backend::Tensor& streams, const Step& step) const;
  Result<backend::Tensor> attention_v41(const LayerPlan& layer, const backend::Tensor& x, const Step& step) const;
  Status compress_v41(const LayerPlan& layer, const backend::Tensor& x, const Step& step) const;
  Status indexer_v41(const LayerPlan& layer, const backend::Tensor& x, const backend::Tensor& qr,
                     const Step& step) const;
  // V4.1's fp32 mode computes as the official reference does on the CPU (fma chains in
  // input order, torch's fp32 norm sums): its QAT roundings flip on last-bit differences
  // (tiny-v41's decode: one FP8 code at layer 0). The fast mode stays as it is.
  backend::MatmulMode v41_mode(backend::MatmulMode m) const {
    return m == backend::MatmulMode::Exact ? backend::MatmulMode::Sequential : m;
  }
  // The products the reference computes in fp32 (mixes, compressors, index projections,
  // routers): the CPU's order in the exact mode, any order (a backend's fp32 GEMM) otherwise.
  backend::MatmulMode fp32_mode() const {
    return opt.matmul == backend::MatmulMode::Exact ? backend::MatmulMode::Exact : backend::MatmulMode::Float32;
  }
  // The products the reference always computes in fp32 (routers, mixes, compressors).
  backend::MatmulMode v41_exact() const {
    return opt.matmul == backend::MatmulMode::Exact ? backend::MatmulMode::Sequential : backend::MatmulMode::Exact;
  }
  Status v41_norm(const backend::Tensor& x, const backend::Tensor* weight, int64_t width,
                  const backend::Tensor& y) const {
    return opt.matmul == backend::MatmulMode::Exact ? be.rms_norm_torch_order(x, weight, c.rms_eps, width, y)
                                                    : be.rms_norm(x, weight, c.rms_eps, width, y);
  }

  // DSpark (dspark.cpp; §3.7). Writes block `layer`'s stream mean into v41->dspark_hidden
  // when the block is a target layer.
  Status dspark_target(const LayerPlan& layer, const backend::Tensor& streams, const Step& step) const;
  // main_x = main_norm(main_proj(hidden)) for the step's rows (their DSpark positions);
  // every stage's ring gets kv_norm(wkv(main_x)), rotated there and FP8-rounded in QAT.
  Result<backend::Tensor> dspark_seed(const backend::Tensor& main_hidden, const Step& step) const;
  // One draft block per sequence of `step` (rows: anchor then noise tokens at the
  // positions after the seeded one): the stages, then the last FFN-pre collapse h
  // [rows, hidden] and the shared head's logits on norm(h).
  struct DsparkOut { backend::Tensor h, logits; };
  Result<DsparkOut> dspark_draft(const Step& step) const;

  // The final collapse with the last FFN `pre` (rows `pre` of the same rows as streams),
  // final norm and logits.
  Result<backend::Tensor> head_v41(const backend::Tensor& pre, const backend::Tensor& streams) const;

  // GLP steering of `x` at `hook` in block b, when a direction is bound there.
  Status steer(uint32_t b, SteerHook hook, const backend::Tensor& x, const Step& step) const;

  // §4 (moe.cpp).
  Result<backend::Tensor> moe(const LayerPlan& layer, const backend::Tensor& x, const Step& step) const;

  // Records block b's quantity `what` in the trace, if any (trace.h: names).
  Status note(uint32_t b, const char* what, const backend::Tensor& t) const {
    return trace ? record(b, what, t) : Status::ok();
  }
  // The same for the rows of a per-row entry tensor that close a compressor block.
  Status note_entries(uint32_t b, const char* what, const backend::Tensor& t, int ratio, const Step& step) const;
  Status record(uint32_t b, const char* what, const backend::Tensor& t) const;

  Result<backend::Tensor> f32(std::vector<int64_t> shape) const { return be.scratch(GgmlType::F32, shape); }
  Result<backend::Tensor> i32(std::vector<int64_t> shape) const { return be.scratch(GgmlType::I32, shape); }
  Result<backend::Tensor> upload_i32(const std::vector<int32_t>& host, std::vector<int64_t> shape) const;
};

}  // namespace dsv4
