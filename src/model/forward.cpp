// Blocks, hyper-connections, embedding and heads (spec §2, §5).
#include "model/forward.h"

#include <fmt/format.h>

namespace dsv4 {

using backend::Tensor;

Result<Tensor> ForwardPass::i32(const std::vector<int32_t>& host, std::vector<int64_t> shape) const {
  DSV4_ASSIGN_OR_RETURN(Tensor t, be.alloc(GgmlType::I32, shape));
  DSV4_TRY(be.upload(t, host.data(), host.size() * sizeof(int32_t)));
  return t;
}

Result<ForwardRows> ForwardPass::make_rows(std::vector<SequenceRows> items,
                                           const std::vector<int32_t>& tokens) const {
  ForwardRows rows;
  rows.n = static_cast<int64_t>(tokens.size());
  std::vector<int32_t> positions(tokens.size());
  for (const SequenceRows& r : items)
    for (int64_t i = 0; i < r.n; ++i) positions[r.row0 + i] = static_cast<int32_t>(r.pos0 + i);
  rows.items = std::move(items);
  DSV4_ASSIGN_OR_RETURN(rows.tokens, i32(tokens, {rows.n}));
  DSV4_ASSIGN_OR_RETURN(rows.positions, i32(positions, {rows.n}));
  return rows;
}

Result<Tensor> ForwardPass::embed(const Tensor& table, const ForwardRows& rows) const {
  const int64_t d = c.hidden;
  DSV4_ASSIGN_OR_RETURN(Tensor e, f32({rows.n, d}));
  DSV4_TRY(be.get_rows(table, rows.tokens, e));
  DSV4_ASSIGN_OR_RETURN(Tensor streams, f32({rows.n, c.hc_mult * d}));
  for (uint32_t j = 0; j < c.hc_mult; ++j) DSV4_TRY(be.copy_rows(e, streams.columns(j * d, d)));
  return streams;
}

Result<ForwardPass::HcMix> ForwardPass::hc_pre(const HcSite& site, const Tensor& streams) const {
  const int64_t n = streams.rows(), hc = c.hc_mult;
  DSV4_ASSIGN_OR_RETURN(Tensor mixes, f32({n, static_cast<int64_t>(c.hc_dim())}));
  DSV4_TRY(be.matmul(site.fn, streams, mixes, backend::MatmulMode::Exact));  // fp32 (§2.3)
  HcMix mix;
  DSV4_ASSIGN_OR_RETURN(mix.x, f32({n, static_cast<int64_t>(c.hidden)}));
  DSV4_ASSIGN_OR_RETURN(mix.post, f32({n, hc}));
  DSV4_ASSIGN_OR_RETURN(mix.comb, f32({n, hc * hc}));
  DSV4_TRY(be.hc_pre(streams, mixes, site.scale, site.base, c.hc_mult, c.hc_sinkhorn_iters,
                     c.hc_eps, c.rms_eps, mix.x, mix.post, mix.comb));
  return mix;
}

Status ForwardPass::hc_post(const Tensor& y, const HcMix& mix, const Tensor& streams) const {
  return be.hc_post(y, mix.post, mix.comb, c.hc_mult, streams);
}

Status ForwardPass::block(uint32_t b, const Tensor& streams, const ForwardRows& rows) const {
  const BlockWeights& bw = w.blocks[b];
  const int64_t d = c.hidden;

  DSV4_ASSIGN_OR_RETURN(HcMix attn_mix, hc_pre(bw.hc_attn, streams));
  DSV4_ASSIGN_OR_RETURN(Tensor attn_in, f32({rows.n, d}));
  DSV4_TRY(be.rms_norm(attn_mix.x, &bw.attn_norm, c.rms_eps, d, attn_in));
  DSV4_TRY(note(b, "attn_in", attn_in));
  DSV4_ASSIGN_OR_RETURN(Tensor attn_out, attention(b, attn_in, rows));
  DSV4_TRY(note(b, "attn_out", attn_out));
  DSV4_TRY(hc_post(attn_out, attn_mix, streams));

  DSV4_ASSIGN_OR_RETURN(HcMix ffn_mix, hc_pre(bw.hc_ffn, streams));
  DSV4_ASSIGN_OR_RETURN(Tensor ffn_in, f32({rows.n, d}));
  DSV4_TRY(be.rms_norm(ffn_mix.x, &bw.ffn_norm, c.rms_eps, d, ffn_in));
  DSV4_ASSIGN_OR_RETURN(Tensor ffn_out, moe(b, ffn_in, rows));
  DSV4_TRY(note(b, "ffn_out", ffn_out));
  DSV4_TRY(hc_post(ffn_out, ffn_mix, streams));
  return note(b, "out_streams", streams);
}

Status ForwardPass::record(uint32_t b, const char* what, const Tensor& t, int32_t index_offset) const {
  const std::string block = c.is_mtp(b) ? fmt::format("mtp.{}", b - c.n_layers) : fmt::format("layers.{}", b);
  return trace->record(fmt::format("{}.{}", block, what), t, index_offset);
}

Result<Tensor> ForwardPass::head(const HcSite& hc, const Tensor& norm, const Tensor& output,
                                 const Tensor& streams) const {
  const int64_t n = streams.rows(), d = c.hidden;
  DSV4_ASSIGN_OR_RETURN(Tensor mixes, f32({n, static_cast<int64_t>(c.hc_mult)}));
  DSV4_TRY(be.matmul(hc.fn, streams, mixes, backend::MatmulMode::Exact));
  DSV4_ASSIGN_OR_RETURN(Tensor h, f32({n, d}));
  DSV4_TRY(be.hc_head(streams, mixes, hc.scale, hc.base, c.hc_mult, c.hc_eps, c.rms_eps, h));
  DSV4_TRY(be.rms_norm(h, &norm, c.rms_eps, d, h));
  DSV4_ASSIGN_OR_RETURN(Tensor logits, f32({n, static_cast<int64_t>(c.vocab_size)}));
  DSV4_TRY(be.matmul(output, h, logits, opt.matmul));
  return logits;
}

Result<Tensor> ForwardPass::mtp_input(const BlockWeights& bw, const Tensor& streams,
                                      const ForwardRows& rows) const {
  const int64_t n = rows.n, d = c.hidden, hc = c.hc_mult;
  DSV4_ASSIGN_OR_RETURN(Tensor e, f32({n, d}));
  DSV4_TRY(be.get_rows(bw.embed, rows.tokens, e));
  DSV4_TRY(be.rms_norm(e, &bw.enorm, c.rms_eps, d, e));
  DSV4_ASSIGN_OR_RETURN(Tensor h, f32({n, hc * d}));
  DSV4_TRY(be.rms_norm(streams, &bw.hnorm, c.rms_eps, d, h));  // each stream on its own
  // eh_proj's input is concat(enorm(e), hnorm(h_j)), one row per (token, stream).
  DSV4_ASSIGN_OR_RETURN(Tensor cat, f32({n * hc, 2 * d}));
  for (int64_t j = 0; j < hc; ++j) {
    DSV4_TRY(be.copy_rows(e, cat.view(j * 2 * d, n, d, hc * 2 * d)));
    DSV4_TRY(be.copy_rows(h.columns(j * d, d), cat.view(j * 2 * d + d, n, d, hc * 2 * d)));
  }
  DSV4_ASSIGN_OR_RETURN(Tensor z, f32({n * hc, d}));
  DSV4_TRY(be.matmul(bw.eh_proj, cat, z, opt.matmul));
  return z.as_matrix(n, hc * d);
}

}  // namespace dsv4
