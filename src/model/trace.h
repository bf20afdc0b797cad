// Named intermediates of a forward pass, for localising a numerical difference against a
// reference (shared/fixtures/tiny-v4's intermediates table uses the same names).
//
//   ForwardTrace trace;
//   model.forward(batch, out, &trace);              // or model.mtp(items, &trace)
//   const TracedTensor* t = trace.find("layers.3.attn_out");
//
// Per block (prefix "layers.N." for trunk block N, "mtp.K." for MTP block K):
//   attn_in                 attention input (after the mHC collapse and attn_norm)  [rows, D]
//   kv                      window KV vector (kv_norm, RoPE, FP8 rule in QAT)       [rows, hd]
//   compressed_kv_prequant  compressed entries before the FP8 rule                  [entries, hd]
//   compressed_kv           compressed entries as attended                          [entries, hd]
//   indexer_kv_prequant     indexer keys (rotated basis) before the FP4 rule        [entries, dk]
//   indexer_kv              indexer keys as scored                                  [entries, dk]
//   index_topk              I32 entries chosen per query, ascending, -1 unused      [rows, top-k]
//   attn_out                attention output (after wo_b, before mHC post)          [rows, D]
//   router_experts          I32 chosen experts, ascending                           [rows, k]
//   router_weights          their weights (renormalised, times the routed scale)    [rows, k]
//   ffn_out                 MoE output (routed + shared, before mHC post)           [rows, D]
//   out_streams             the hyper-connection streams after the block            [rows, hc*D]
//   ffn_out_steered         ffn_out after GLP steering (only where a direction is bound)
//   out_streams_steered     out_streams after GLP steering (post-layer hook)
// and "final_streams" [rows, hc*D] after the last trunk block.
//
// Rows are the call's rows in batch order; the compressor and indexer quantities are
// recorded per sequence, in batch order, with only the entries each call completes. A
// name recorded again (a second call, or the next sequence) appends rows, so a chunked
// prefill traced into one ForwardTrace reads like a single call. Tracing downloads every
// quantity: a debugging and testing tool, not for serving.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "util/status.h"

namespace dsv4 {

struct TracedTensor {
  GgmlType type = GgmlType::F32;  // F32 or I32
  int64_t cols = 0;
  std::vector<float> f32;    // F32: rows * cols values
  std::vector<int32_t> i32;  // I32: rows * cols values
  int64_t rows() const;
};

class ForwardTrace {
 public:
  // Appends the rows of a 2-D F32 or I32 tensor under `name`. Non-negative I32 values are
  // recorded `index_offset` lower (index tensors whose entries are stored past an offset).
  Status record(const std::string& name, const backend::Tensor& t, int32_t index_offset = 0);

  const TracedTensor* find(const std::string& name) const;  // nullptr when absent
  const std::map<std::string, TracedTensor>& tensors() const { return tensors_; }

 private:
  std::map<std::string, TracedTensor> tensors_;
};

}  // namespace dsv4
