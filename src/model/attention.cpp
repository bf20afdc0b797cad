// Attention (spec §3): the common Q/KV path, the window ring, the compressors, the
// lightning indexer and the grouped low-rank output.
#include <algorithm>
#include <cmath>

#include "model/forward.h"

namespace dsv4 {

using backend::MatmulMode;
using backend::Tensor;

namespace {

// Copies rows of `count` consecutive positions starting at `first_pos` between a ring of
// `slots` rows (slot = position mod slots) and a linear tensor, in at most two pieces.
template <typename CopyFn>
Status for_ring_pieces(int64_t first_pos, int64_t count, int64_t slots, CopyFn copy) {
  int64_t done = 0;
  while (done < count) {
    const int64_t slot = (first_pos + done) % slots;
    const int64_t len = std::min(count - done, slots - slot);
    DSV4_TRY(copy(slot, done, len));
    done += len;
  }
  return Status::ok();
}

}  // namespace

backend::RopeParams ForwardPass::rope_params(uint32_t b) const {
  backend::RopeParams p;
  p.dims = static_cast<int>(c.rope.dims);
  if (c.ratio(b) == 0) {  // "main" table: window-only blocks and MTP
    p.freq_base = static_cast<float>(c.rope.freq_base);
    return p;
  }
  p.freq_base = static_cast<float>(c.rope.compress_freq_base);  // "compress" table, YaRN
  p.yarn = true;
  p.yarn_factor = static_cast<float>(c.rope.yarn_factor);
  p.yarn_original_context = static_cast<int>(c.rope.yarn_original_context);
  p.yarn_beta_fast = static_cast<float>(c.rope.yarn_beta_fast);
  p.yarn_beta_slow = static_cast<float>(c.rope.yarn_beta_slow);
  return p;
}

// §3.1: Q and KV paths over all rows, attention per sequence, de-rotation, output.
Result<Tensor> ForwardPass::attention(uint32_t b, const Tensor& x, const ForwardRows& rows) const {
  const BlockWeights& bw = w.blocks[b];
  const int64_t n = rows.n, hd = c.head_dim, heads = c.n_heads;
  const backend::RopeParams rope = rope_params(b);

  DSV4_ASSIGN_OR_RETURN(Tensor qr, f32({n, static_cast<int64_t>(c.q_lora_rank)}));
  DSV4_TRY(be.matmul(bw.q_a, x, qr, opt.matmul));
  DSV4_TRY(be.rms_norm(qr, &bw.q_a_norm, c.rms_eps, qr.cols(), qr));
  DSV4_ASSIGN_OR_RETURN(Tensor q, f32({n, heads * hd}));
  DSV4_TRY(be.matmul(bw.q_b, qr, q, opt.matmul));
  DSV4_TRY(be.rms_norm(q, nullptr, c.rms_eps, hd, q));  // per-head, unweighted
  DSV4_TRY(be.rope(q, hd, rows.positions, rope, false));

  DSV4_ASSIGN_OR_RETURN(Tensor kv, f32({n, hd}));
  DSV4_TRY(be.matmul(bw.kv, x, kv, opt.matmul));
  DSV4_TRY(be.rms_norm(kv, &bw.kv_norm, c.rms_eps, hd, kv));
  DSV4_TRY(be.rope(kv, hd, rows.positions, rope, false));
  if (opt.qat) DSV4_TRY(be.round_fp8_blocks(kv, c.nope_dims(), 64));
  DSV4_TRY(note(b, "kv", kv));

  DSV4_ASSIGN_OR_RETURN(Tensor o, f32({n, heads * hd}));
  for (const SequenceRows& r : rows.items)
    DSV4_TRY(attend_sequence(b, r, x.slice(r.row0, r.n), qr.slice(r.row0, r.n),
                             q.slice(r.row0, r.n), kv.slice(r.row0, r.n),
                             rows.positions.slice(r.row0, r.n), o.slice(r.row0, r.n)));
  DSV4_TRY(be.rope(o, hd, rows.positions, rope, true));  // §3.1.9 output de-rotation

  // §3.1.10: group g's heads (concatenated) through its wo_a rows, then wo_b.
  const int64_t groups = c.o_groups, rank = c.o_lora_rank, group_width = heads * hd / groups;
  DSV4_ASSIGN_OR_RETURN(Tensor u, f32({n, groups * rank}));
  for (int64_t g = 0; g < groups; ++g)
    DSV4_TRY(be.matmul(bw.out_a.slice(g * rank, rank), o.columns(g * group_width, group_width),
                       u.columns(g * rank, rank), opt.matmul));
  DSV4_ASSIGN_OR_RETURN(Tensor out, f32({n, static_cast<int64_t>(c.hidden)}));
  DSV4_TRY(be.matmul(bw.out_b, u, out, opt.matmul));
  return out;
}

// One sequence's attention: window keys from the ring and this chunk, compressed entries
// visible at each query (all of them for HCA, the indexer's top-k for CSA), one joint
// softmax with the sink (§3.1-§3.5).
Status ForwardPass::attend_sequence(uint32_t b, const SequenceRows& r, const Tensor& x,
                                    const Tensor& qr, const Tensor& q, const Tensor& kv,
                                    const Tensor& positions, const Tensor& out) const {
  const BlockWeights& bw = w.blocks[b];
  Sequence::Block& cache = r.seq->blocks_[b];
  const int64_t win = c.sliding_window, hd = c.head_dim, ratio = c.ratio(b);
  const AttentionKind kind = c.attention_kind(b);

  // Window keys: the ring's last (window - 1) positions, then this chunk's.
  const int64_t hist = std::min<int64_t>(r.pos0, win - 1), first = r.pos0 - hist;
  DSV4_ASSIGN_OR_RETURN(Tensor keys, f32({hist + r.n, hd}));
  DSV4_TRY(for_ring_pieces(first, hist, win, [&](int64_t slot, int64_t at, int64_t len) {
    return be.copy_rows(cache.window.slice(slot, len), keys.slice(at, len));
  }));
  DSV4_TRY(be.copy_rows(kv, keys.slice(hist, r.n)));

  // Compressed entries completed by this chunk join the cache before attention: entry e
  // is visible from position e*ratio + ratio - 1 on, including to that token itself.
  if (ratio) {
    if (kind == AttentionKind::CSA) {
      DSV4_ASSIGN_OR_RETURN(Tensor keys_new, compress(b, bw.index_compressor, true, r, x,
                                                      cache.index_kv, cache.index_score));
      if (keys_new.valid())
        DSV4_TRY(be.copy_rows(keys_new, cache.index_keys.slice(cache.n_entries, keys_new.rows())));
    }
    DSV4_ASSIGN_OR_RETURN(Tensor entries_new, compress(b, bw.compressor, false, r, x,
                                                       cache.comp_kv, cache.comp_score));
    if (entries_new.valid()) {
      DSV4_TRY(be.copy_rows(entries_new, cache.entries.slice(cache.n_entries, entries_new.rows())));
      cache.n_entries += entries_new.rows();
    }
  }
  const int64_t n_entries = cache.n_entries;

  // Key slots per query: the window, then the compressed entries it may attend.
  const int64_t comp_slots =
      kind == AttentionKind::CSA ? c.index_topk : (kind == AttentionKind::HCA ? n_entries : 0);
  const int64_t slots = win + comp_slots;
  std::vector<int32_t> idx(r.n * slots, -1);
  for (int64_t i = 0; i < r.n; ++i) {
    const int64_t t = r.pos0 + i;
    int32_t* row = &idx[i * slots];
    for (int64_t p = std::max<int64_t>(0, t - win + 1), j = 0; p <= t; ++p, ++j)
      row[j] = static_cast<int32_t>(p - first);
    if (kind == AttentionKind::HCA)
      for (int64_t e = 0; e < (t + 1) / ratio; ++e) row[win + e] = static_cast<int32_t>(keys.rows() + e);
  }
  DSV4_ASSIGN_OR_RETURN(Tensor idx_t, i32(idx, {r.n, slots}));
  if (kind == AttentionKind::CSA) {
    const Tensor chosen = idx_t.columns(win, comp_slots);
    if (n_entries > 0)
      DSV4_TRY(indexer(b, r, x, qr, positions, cache.index_keys.slice(0, n_entries),
                       static_cast<int32_t>(keys.rows()), chosen));
    DSV4_TRY(note(b, "index_topk", chosen, static_cast<int32_t>(keys.rows())));
  }

  const Tensor entries = n_entries ? cache.entries.slice(0, n_entries) : Tensor{};
  DSV4_TRY(be.sparse_attention(q, keys, entries, idx_t, bw.sinks,
                               1.0f / std::sqrt(static_cast<float>(hd)), out));

  // The ring keeps the chunk's last `window` positions.
  const int64_t keep = std::min(r.n, win);
  return for_ring_pieces(r.pos0 + r.n - keep, keep, win, [&](int64_t slot, int64_t at, int64_t len) {
    return be.copy_rows(kv.slice(r.n - keep + at, len), cache.window.slice(slot, len));
  });
}

// §3.3: C = x Wkv^T, Z = x Wgate^T in fp32, pooled per completed block, then norm, RoPE at
// the block's first position, and the QAT rounding of the entry kind.
Result<Tensor> ForwardPass::compress(uint32_t b, const CompressorWeights& cw, bool indexer,
                                     const SequenceRows& r, const Tensor& x,
                                     const Tensor& state_kv, const Tensor& state_score) const {
  const int64_t ratio = c.ratio(b), wide = cw.kv.rows(), width = cw.norm.cols();
  const bool overlap = c.compressor_overlap(b) == 2;
  DSV4_ASSIGN_OR_RETURN(Tensor kv, f32({r.n, wide}));
  DSV4_ASSIGN_OR_RETURN(Tensor score, f32({r.n, wide}));
  DSV4_TRY(be.matmul(cw.kv, x, kv, MatmulMode::Exact));
  DSV4_TRY(be.matmul(cw.gate, x, score, MatmulMode::Exact));
  const int64_t first_entry = r.pos0 / ratio, n_new = (r.pos0 + r.n) / ratio - first_entry;
  DSV4_ASSIGN_OR_RETURN(Tensor entries, f32({std::max<int64_t>(n_new, 1), width}));
  DSV4_ASSIGN_OR_RETURN(int64_t written, be.compress(kv, score, cw.ape, r.pos0, static_cast<int>(ratio),
                                                     overlap, state_kv, state_score, entries));
  if (written == 0) return Tensor{};
  entries = entries.slice(0, written);
  DSV4_TRY(be.rms_norm(entries, &cw.norm, c.rms_eps, width, entries));
  std::vector<int32_t> pos(written);
  for (int64_t e = 0; e < written; ++e) pos[e] = static_cast<int32_t>((first_entry + e) * ratio);
  DSV4_ASSIGN_OR_RETURN(Tensor pos_t, i32(pos, {written}));
  DSV4_TRY(be.rope(entries, width, pos_t, rope_params(b), false));
  if (indexer) DSV4_TRY(be.hadamard(entries, width));  // in both modes; QAT adds the FP4 rounding
  DSV4_TRY(note(b, indexer ? "indexer_kv_prequant" : "compressed_kv_prequant", entries));
  if (opt.qat)
    DSV4_TRY(indexer ? be.round_fp4_blocks(entries, 32) : be.round_fp8_blocks(entries, c.nope_dims(), 64));
  DSV4_TRY(note(b, indexer ? "indexer_kv" : "compressed_kv", entries));
  return entries;
}

// §3.6: indexer queries (RoPE, Hadamard, FP4), head weights, scores over the visible
// keys, and the top-k written into `idx` as indices past `offset`.
Status ForwardPass::indexer(uint32_t b, const SequenceRows& r, const Tensor& x, const Tensor& qr,
                            const Tensor& positions, const Tensor& keys, int32_t offset,
                            const Tensor& idx) const {
  const BlockWeights& bw = w.blocks[b];
  const int64_t heads = c.index_heads, dk = c.index_head_dim;
  DSV4_ASSIGN_OR_RETURN(Tensor q, f32({r.n, heads * dk}));
  DSV4_TRY(be.matmul(bw.index_q_b, qr, q, opt.matmul));
  DSV4_TRY(be.rope(q, dk, positions, rope_params(b), false));
  DSV4_TRY(be.hadamard(q, dk));
  if (opt.qat) DSV4_TRY(be.round_fp4_blocks(q, 32));
  DSV4_ASSIGN_OR_RETURN(Tensor weights, f32({r.n, heads}));
  DSV4_TRY(be.matmul(bw.index_proj, x, weights, MatmulMode::Exact));
  DSV4_TRY(be.scale(weights, static_cast<float>(1.0 / std::sqrt(double(dk)) / std::sqrt(double(heads)))));

  std::vector<int32_t> visible(r.n);
  for (int64_t i = 0; i < r.n; ++i) visible[i] = static_cast<int32_t>((r.pos0 + i + 1) / c.ratio(b));
  DSV4_ASSIGN_OR_RETURN(Tensor visible_t, i32(visible, {r.n}));
  DSV4_ASSIGN_OR_RETURN(Tensor scores, f32({r.n, keys.rows()}));
  DSV4_TRY(be.indexer_scores(q, weights, keys, visible_t, scores));
  return be.top_k(scores, visible_t, static_cast<int>(c.index_topk), offset, idx);
}

}  // namespace dsv4
