// Blocks, hyper-connections, embedding and heads (spec §2, §5).
#include "model/forward.h"

#include <fmt/format.h>

#include <algorithm>

namespace dsv4 {

using backend::Tensor;

Result<Tensor> ForwardPass::upload_i32(const std::vector<int32_t>& host, std::vector<int64_t> shape) const {
  DSV4_ASSIGN_OR_RETURN(Tensor t, i32(std::move(shape)));
  DSV4_TRY(be.upload(t, host.data(), host.size() * sizeof(int32_t)));
  return t;
}

Result<Step> ForwardPass::make_step(std::vector<StepItem> items, const std::vector<int32_t>& tokens) const {
  Step step;
  backend::StepRows& rows = step.rows;
  rows.n = static_cast<int64_t>(tokens.size());
  rows.n_seqs = static_cast<int64_t>(items.size());
  std::vector<int32_t> positions(tokens.size()), row_seq(tokens.size());
  std::vector<int32_t> seqs(items.size() * backend::kSeqFields);
  for (size_t s = 0; s < items.size(); ++s) {
    const StepItem& it = items[s];
    for (int64_t i = 0; i < it.n; ++i) {
      positions[it.row0 + i] = static_cast<int32_t>(it.pos0 + i);
      row_seq[it.row0 + i] = static_cast<int32_t>(s);
    }
    int32_t* f = &seqs[s * backend::kSeqFields];
    f[backend::kSeqFirstRow] = static_cast<int32_t>(it.row0);
    f[backend::kSeqRows] = static_cast<int32_t>(it.n);
    f[backend::kSeqFirstPos] = static_cast<int32_t>(it.pos0);
    f[backend::kSeqSlot] = static_cast<int32_t>(it.seq->slot());
    f[backend::kSeqWindowStart] = static_cast<int32_t>(it.seq->window_start());
    rows.max_end = std::max(rows.max_end, it.pos0 + it.n);
  }
  DSV4_ASSIGN_OR_RETURN(rows.tokens, upload_i32(tokens, {rows.n}));
  DSV4_ASSIGN_OR_RETURN(rows.positions, upload_i32(positions, {rows.n}));
  DSV4_ASSIGN_OR_RETURN(rows.row_seq, upload_i32(row_seq, {rows.n}));
  DSV4_ASSIGN_OR_RETURN(rows.seqs, upload_i32(seqs, {rows.n_seqs, backend::kSeqFields}));
  if (steering) {
    std::vector<float> alpha(tokens.size());
    for (const StepItem& it : items) std::fill_n(alpha.begin() + it.row0, it.n, it.seq->steering_alpha());
    DSV4_ASSIGN_OR_RETURN(step.steer_alpha, f32({rows.n}));
    DSV4_TRY(be.upload(step.steer_alpha, alpha.data(), alpha.size() * sizeof(float)));
  }
  step.items = std::move(items);
  return step;
}

Result<Tensor> ForwardPass::embed(const Tensor& table, const Step& step) const {
  const int64_t d = c.hidden, n = step.rows.n;
  DSV4_ASSIGN_OR_RETURN(Tensor e, f32({n, d}));
  DSV4_TRY(be.get_rows(table, step.rows.tokens, e));
  DSV4_ASSIGN_OR_RETURN(Tensor streams, f32({n, c.hc_mult * d}));
  for (uint32_t j = 0; j < c.hc_mult; ++j) DSV4_TRY(be.copy_rows(e, streams.columns(j * d, d)));
  return streams;
}

Result<ForwardPass::HcMix> ForwardPass::hc_pre(const HcSite& site, const Tensor& streams,
                                               const Tensor* norm) const {
  const int64_t n = streams.rows(), hc = c.hc_mult;
  HcMix mix;
  DSV4_ASSIGN_OR_RETURN(mix.x, f32({n, static_cast<int64_t>(c.hidden)}));
  DSV4_ASSIGN_OR_RETURN(mix.post, f32({n, hc}));
  DSV4_ASSIGN_OR_RETURN(mix.comb, f32({n, hc * hc}));
  if (norm == nullptr) {
    DSV4_ASSIGN_OR_RETURN(Tensor mixes, f32({n, static_cast<int64_t>(c.hc_dim())}));
    DSV4_TRY(be.matmul(site.fn, streams, mixes, fp32_mode()));  // fp32 (§2.3)
    DSV4_TRY(be.hc_pre(streams, mixes, site.scale, site.base, c.hc_mult, c.hc_sinkhorn_iters,
                       c.hc_eps, c.rms_eps, mix.x, mix.post, mix.comb));
    return mix;
  }
  // The mixes in fp32 (§2.3) and the collapse with the sublayer's norm: one call, which a
  // backend may run as one launch (backend.h).
  DSV4_ASSIGN_OR_RETURN(mix.normed, f32({n, static_cast<int64_t>(c.hidden)}));
  DSV4_TRY(be.hc_pre_norm_from_fn(site.fn, streams, fp32_mode(), site.scale, site.base, c.hc_mult,
                                  c.hc_sinkhorn_iters, c.hc_eps, c.rms_eps, *norm, mix.x, mix.post,
                                  mix.comb, mix.normed));
  return mix;
}

Status ForwardPass::hc_post(const Tensor& y, const HcMix& mix, const Tensor& streams) const {
  return be.hc_post(y, mix.post, mix.comb, c.hc_mult, streams);
}

Status ForwardPass::block(const LayerPlan& layer, const Tensor& streams, const Step& step) const {
  const uint32_t b = layer.block;
  const BlockWeights& bw = w.blocks[b];
  // The block's intermediates go back to the scratch when it ends (streams persist).
  struct Scope {
    backend::Backend& be;
    backend::Backend::ScratchMark mark;
    ~Scope() { be.scratch_release(mark); }
  } scope{be, be.scratch_mark()};

  DSV4_ASSIGN_OR_RETURN(HcMix attn_mix, hc_pre(bw.hc_attn, streams, &bw.attn_norm));
  const Tensor& attn_in = attn_mix.normed;
  DSV4_TRY(note(b, "attn_in", attn_in));
  DSV4_ASSIGN_OR_RETURN(Tensor attn_out, attention(layer, attn_in, step));
  DSV4_TRY(note(b, "attn_out", attn_out));
  DSV4_TRY(hc_post(attn_out, attn_mix, streams));

  DSV4_ASSIGN_OR_RETURN(HcMix ffn_mix, hc_pre(bw.hc_ffn, streams, &bw.ffn_norm));
  const Tensor& ffn_in = ffn_mix.normed;
  DSV4_ASSIGN_OR_RETURN(Tensor ffn_out, moe(layer, ffn_in, step));
  DSV4_TRY(note(b, "ffn_out", ffn_out));
  DSV4_TRY(steer(b, SteerHook::FfnOut, ffn_out, step));
  DSV4_TRY(hc_post(ffn_out, ffn_mix, streams));
  DSV4_TRY(note(b, "out_streams", streams));
  return steer(b, SteerHook::PostLayerStreams, streams, step);
}

Status ForwardPass::steer(uint32_t b, SteerHook hook, const Tensor& x, const Step& step) const {
  if (!steering || steering->hook != hook || b >= steering->directions.size() || !steering->directions[b].valid())
    return Status::ok();
  DSV4_TRY(be.steer(x, steering->directions[b], c.hidden, steering->mode == SteerMode::Project, step.steer_alpha));
  return note(b, hook == SteerHook::FfnOut ? "ffn_out_steered" : "out_streams_steered", x);
}

Status ForwardPass::record(uint32_t b, const char* what, const Tensor& t) const {
  const std::string block = c.is_mtp(b) ? fmt::format("mtp.{}", b - c.n_layers) : fmt::format("layers.{}", b);
  return trace->record(fmt::format("{}.{}", block, what), t);
}

Status ForwardPass::note_entries(uint32_t b, const char* what, const Tensor& t, int ratio,
                                 const Step& step) const {
  if (!trace) return Status::ok();
  // Rows that close a block, per sequence in step order (rows are in step order already).
  std::vector<int32_t> closing;
  for (const StepItem& it : step.items)
    for (int64_t i = 0; i < it.n; ++i)
      if ((it.pos0 + i + 1) % ratio == 0) closing.push_back(static_cast<int32_t>(it.row0 + i));
  if (closing.empty()) return Status::ok();
  DSV4_ASSIGN_OR_RETURN(Tensor ids, upload_i32(closing, {static_cast<int64_t>(closing.size())}));
  DSV4_ASSIGN_OR_RETURN(Tensor picked, f32({static_cast<int64_t>(closing.size()), t.cols()}));
  DSV4_TRY(be.get_rows(t, ids, picked));
  return record(b, what, picked);
}

Result<Tensor> ForwardPass::head(const HcSite& hc, const Tensor& norm, const Tensor& output,
                                 const Tensor& streams) const {
  const int64_t n = streams.rows(), d = c.hidden;
  DSV4_ASSIGN_OR_RETURN(Tensor mixes, f32({n, static_cast<int64_t>(c.hc_mult)}));
  DSV4_TRY(be.matmul(hc.fn, streams, mixes, fp32_mode()));
  DSV4_ASSIGN_OR_RETURN(Tensor h, f32({n, d}));
  DSV4_TRY(be.hc_head(streams, mixes, hc.scale, hc.base, c.hc_mult, c.hc_eps, c.rms_eps, h));
  DSV4_TRY(be.rms_norm(h, &norm, c.rms_eps, d, h));
  DSV4_ASSIGN_OR_RETURN(Tensor logits, f32({n, static_cast<int64_t>(c.vocab_size)}));
  DSV4_TRY(be.matmul(output, h, logits, opt.matmul));
  return logits;
}

Result<Tensor> ForwardPass::mtp_input(const BlockWeights& bw, const Tensor& streams,
                                      const Step& step) const {
  const int64_t n = step.rows.n, d = c.hidden, hc = c.hc_mult;
  DSV4_ASSIGN_OR_RETURN(Tensor e, f32({n, d}));
  DSV4_TRY(be.get_rows(bw.embed, step.rows.tokens, e));
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
