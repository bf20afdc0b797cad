// The DeepSeek-V4 forward pass over a Backend, one function per sublayer with the spec's
// names (shared/spec/deepseek-v4-architecture.md §2-§5). Internal to src/model/: the
// public entry points are Model::forward and Model::mtp (model.h).
//
// A call processes the rows of several sequences at once. Token-wise work (projections,
// norms, mHC, MoE) runs over all rows together; attention, with its window ring,
// compressors and indexer, runs per sequence on that sequence's rows.
#pragma once

#include <vector>

#include "backend/backend.h"
#include "model/cache.h"
#include "model/config.h"
#include "model/model.h"
#include "model/trace.h"
#include "model/weights.h"

namespace dsv4 {

// One sequence's rows within the call.
struct SequenceRows {
  Sequence* seq = nullptr;
  int64_t row0 = 0;   // first row in the call's tensors
  int64_t n = 0;      // rows (tokens)
  int64_t pos0 = 0;   // absolute position of the first row
};

struct ForwardRows {
  std::vector<SequenceRows> items;
  int64_t n = 0;
  backend::Tensor tokens;     // I32 [n]: the input ids (hash routing)
  backend::Tensor positions;  // I32 [n]
};

struct ForwardPass {
  const ModelConfig& c;
  const ModelWeights& w;
  const ModelOptions& opt;
  backend::Backend& be;
  ForwardTrace* trace = nullptr;  // optional: receives the named intermediates (trace.h)

  // Upload the rows' tokens and positions.
  Result<ForwardRows> make_rows(std::vector<SequenceRows> items,
                                const std::vector<int32_t>& tokens) const;

  // §2.2: token embeddings copied into every stream: [n, hc*D].
  Result<backend::Tensor> embed(const backend::Tensor& table, const ForwardRows& rows) const;
  // §2.5: one decoder block (trunk or MTP), updating streams in place.
  Status block(uint32_t b, const backend::Tensor& streams, const ForwardRows& rows) const;
  // §2.3 / §2.4: the mHC collapse and expansion around a sublayer.
  struct HcMix { backend::Tensor x, post, comb; };
  Result<HcMix> hc_pre(const HcSite& site, const backend::Tensor& streams) const;
  Status hc_post(const backend::Tensor& y, const HcMix& mix, const backend::Tensor& streams) const;
  // §2.6 + §5: hyper head, final norm and logits.
  Result<backend::Tensor> head(const HcSite& hc, const backend::Tensor& norm,
                               const backend::Tensor& output, const backend::Tensor& streams) const;
  // §5: the MTP block's input streams from the main streams and the next tokens' embeddings.
  Result<backend::Tensor> mtp_input(const BlockWeights& bw, const backend::Tensor& streams,
                                    const ForwardRows& rows) const;

  // §3 (attention.cpp).
  Result<backend::Tensor> attention(uint32_t b, const backend::Tensor& x, const ForwardRows& rows) const;
  Status attend_sequence(uint32_t b, const SequenceRows& r, const backend::Tensor& x,
                         const backend::Tensor& qr, const backend::Tensor& q,
                         const backend::Tensor& kv, const backend::Tensor& positions,
                         const backend::Tensor& out) const;
  // §3.3: feeds a sequence's rows to a compressor; returns the entries completed (normed,
  // rotated, QAT-rounded), or an empty tensor when none completed.
  Result<backend::Tensor> compress(uint32_t b, const CompressorWeights& cw, bool indexer,
                                   const SequenceRows& r, const backend::Tensor& x,
                                   const backend::Tensor& state_kv,
                                   const backend::Tensor& state_score) const;
  // §3.6: the lightning indexer's top-k for a sequence's rows, into idx columns.
  Status indexer(uint32_t b, const SequenceRows& r, const backend::Tensor& x,
                 const backend::Tensor& qr, const backend::Tensor& positions,
                 const backend::Tensor& keys, int32_t offset, const backend::Tensor& idx) const;
  backend::RopeParams rope_params(uint32_t b) const;

  // §4 (moe.cpp).
  Result<backend::Tensor> moe(uint32_t b, const backend::Tensor& x, const ForwardRows& rows) const;

  // Records block b's quantity `what` in the trace, if any (trace.h: names, offsets).
  Status note(uint32_t b, const char* what, const backend::Tensor& t, int32_t index_offset = 0) const {
    return trace ? record(b, what, t, index_offset) : Status::ok();
  }
  Status record(uint32_t b, const char* what, const backend::Tensor& t, int32_t index_offset) const;

  Result<backend::Tensor> f32(std::vector<int64_t> shape) const {
    return be.alloc(GgmlType::F32, shape);
  }
  Result<backend::Tensor> i32(const std::vector<int32_t>& host, std::vector<int64_t> shape) const;
};

}  // namespace dsv4
