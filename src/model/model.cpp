#include "model/model.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "gguf/gguf_file.h"
#include "model/forward.h"
#include "model/weights.h"

namespace dsv4 {

using backend::Tensor;

Model::~Model() = default;

Result<std::unique_ptr<Model>> Model::load(const std::string& path, backend::Backend& backend,
                                           ModelOptions options) {
  DSV4_ASSIGN_OR_RETURN(gguf::GgufFile file, gguf::GgufFile::open(path));
  DSV4_ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::from_gguf(file));
  DSV4_TRY(config.validate().with_context(path));
  if (config.is_v41())  // the config, catalog and weights load; the V4.1 forward pass does not exist yet
    return Status::errorf("{}: a deepseek41 (DeepSeek-V4.1) model: this build has no V4.1 forward pass yet "
                          "(`dsv4 info` describes the file)", path);
  std::unique_ptr<Model> m(new Model());
  m->file_ = std::make_unique<gguf::GgufFile>(std::move(file));
  m->config_ = std::move(config);
  m->options_ = options;
  m->backend_ = &backend;
  DSV4_ASSIGN_OR_RETURN(ModelWeights weights, ModelWeights::load(*m->file_, m->config_, backend));
  m->weights_ = std::make_unique<ModelWeights>(std::move(weights));
  return m;
}

Result<std::unique_ptr<Sequence>> Model::new_sequence(const SequenceOptions& so) const {
  const ModelConfig& c = config_;
  if (so.with_mtp && !has_mtp()) return Status::error("new_sequence: the model has no MTP block");
  DSV4_ASSIGN_OR_RETURN(CachePlan plan,
                        CachePlan::compute(c, so.max_context ? so.max_context : c.context_length, so.with_mtp));
  if (so.memory_budget && plan.total() > so.memory_budget)
    return Status::errorf(StatusCode::kResourceExhausted, "new_sequence: {} exceeds the memory budget of {} bytes", plan.describe(),
                          so.memory_budget);
  if (so.shared_budget) DSV4_TRY(so.shared_budget->commit(plan.fixed(), "new sequence (windows, compressor states)"));
  std::unique_ptr<Sequence> seq(new Sequence());
  seq->plan_ = plan;
  seq->budget_ = so.shared_budget;
  seq->committed_ = plan.fixed();
  seq->entry_row_bytes_ = kv_entry_bytes(c, CacheFormat::F32);
  seq->key_row_bytes_ = index_key_bytes(c, CacheFormat::F32);
  backend::Backend& be = *backend_;
  const int64_t hd = c.head_dim, ctx = static_cast<int64_t>(plan.context);
  const auto state = [&](int64_t rows, int64_t cols, Tensor& kv, Tensor& score) -> Status {
    DSV4_ASSIGN_OR_RETURN(kv, be.alloc(GgmlType::F32, std::vector<int64_t>{rows, cols}));
    DSV4_ASSIGN_OR_RETURN(score, be.alloc(GgmlType::F32, std::vector<int64_t>{rows, cols}));
    // Empty slots score -inf: a block's missing "previous" half weighs nothing.
    const std::vector<float> empty(rows * cols, -std::numeric_limits<float>::infinity());
    return be.upload(score, empty.data(), empty.size() * sizeof(float));
  };
  const uint32_t n_blocks = so.with_mtp ? c.n_blocks() : c.n_layers;
  seq->blocks_.resize(n_blocks);
  for (uint32_t b = 0; b < n_blocks; ++b) {
    Sequence::Block& blk = seq->blocks_[b];
    DSV4_ASSIGN_OR_RETURN(blk.window, be.alloc(GgmlType::F32, std::vector<int64_t>{c.sliding_window, hd}));
    const int64_t ratio = c.ratio(b);
    blk.ratio = ratio;
    if (ratio == 0) continue;
    const int64_t o = c.compressor_overlap(b), cap = std::max<int64_t>(ctx / ratio, 1);
    DSV4_ASSIGN_OR_RETURN(blk.entries, be.reserve(GgmlType::F32, std::vector<int64_t>{cap, hd}));
    DSV4_TRY(state(o * ratio, o * hd, blk.comp_kv, blk.comp_score));
    if (c.attention_kind(b) != AttentionKind::CSA) continue;
    const int64_t dk = c.index_head_dim;
    DSV4_ASSIGN_OR_RETURN(blk.index_keys, be.reserve(GgmlType::F32, std::vector<int64_t>{cap, dk}));
    DSV4_TRY(state(o * ratio, o * dk, blk.index_kv, blk.index_score));
  }
  return seq;
}

Status Model::forward(std::span<const BatchItem> batch, ForwardOutput& out, ForwardTrace* trace) const {
  if (batch.empty()) return Status::error("forward: empty batch");
  const ForwardPass fp{config_, *weights_, options_, *backend_, trace};
  std::vector<SequenceRows> items;
  std::vector<int32_t> tokens;
  for (size_t i = 0; i < batch.size(); ++i) {
    const BatchItem& it = batch[i];
    if (!it.sequence || it.tokens.empty())
      return Status::errorf("forward: batch item {} has no sequence or no tokens", i);
    for (size_t j = 0; j < i; ++j)
      if (batch[j].sequence == it.sequence)
        return Status::errorf("forward: batch items {} and {} share one sequence", j, i);
    const int64_t n = static_cast<int64_t>(it.tokens.size());
    if (static_cast<uint64_t>(it.sequence->position() + n) > it.sequence->max_context())
      return Status::errorf(StatusCode::kOutOfRange, "forward: batch item {}: {} tokens at position {} exceed the "
                            "sequence's context of {}", i, n, it.sequence->position(),
                            it.sequence->max_context());
    for (int32_t t : it.tokens)
      if (t < 0 || static_cast<uint32_t>(t) >= config_.vocab_size)
        return Status::errorf(StatusCode::kOutOfRange, "forward: batch item {}: token id {} outside the vocabulary of {}",
                              i, t, config_.vocab_size);
    items.push_back({it.sequence, static_cast<int64_t>(tokens.size()), n, it.sequence->position()});
    tokens.insert(tokens.end(), it.tokens.begin(), it.tokens.end());
  }
  for (const SequenceRows& r : items) DSV4_TRY(r.seq->commit_through(r.pos0 + r.n));
  DSV4_ASSIGN_OR_RETURN(ForwardRows rows, fp.make_rows(items, tokens));
  DSV4_ASSIGN_OR_RETURN(Tensor streams, fp.embed(weights_->token_embd, rows));
  for (uint32_t b = 0; b < config_.n_layers; ++b) DSV4_TRY(fp.block(b, streams, rows));
  if (trace) DSV4_TRY(trace->record("final_streams", streams));
  for (const SequenceRows& r : rows.items) r.seq->position_ += r.n;

  // Logits only for the rows asked for.
  const int64_t width = streams.cols();
  std::vector<int64_t> wanted;
  out.streams.clear();
  for (size_t i = 0; i < batch.size(); ++i) {
    const SequenceRows& r = rows.items[i];
    if (batch[i].all_logits)
      for (int64_t j = 0; j < r.n; ++j) wanted.push_back(r.row0 + j);
    else
      wanted.push_back(r.row0 + r.n - 1);
    if (batch[i].keep_streams) {
      const size_t at = out.streams.size();
      out.streams.resize(at + r.n * width);
      DSV4_ASSIGN_OR_RETURN(Tensor part, fp.f32({r.n, width}));
      DSV4_TRY(backend_->copy_rows(streams.slice(r.row0, r.n), part));
      DSV4_TRY(backend_->download(part, out.streams.data() + at, r.n * width * sizeof(float)));
    }
  }
  const int64_t n_out = static_cast<int64_t>(wanted.size());
  DSV4_ASSIGN_OR_RETURN(Tensor picked, fp.f32({n_out, width}));
  for (int64_t i = 0; i < n_out; ++i)
    DSV4_TRY(backend_->copy_rows(streams.slice(wanted[i], 1), picked.slice(i, 1)));
  DSV4_ASSIGN_OR_RETURN(Tensor logits, fp.head(weights_->hc_head, weights_->output_norm,
                                               weights_->output, picked));
  out.rows = n_out;
  out.logits.resize(n_out * config_.vocab_size);
  return backend_->download(logits, out.logits.data(), out.logits.size() * sizeof(float));
}

Result<std::vector<float>> Model::mtp(std::span<const MtpItem> batch, ForwardTrace* trace) const {
  if (!has_mtp()) return Status::error("mtp: the model has no MTP block");
  if (batch.empty()) return Status::error("mtp: empty batch");
  const ForwardPass fp{config_, *weights_, options_, *backend_, trace};
  const uint32_t b = config_.n_layers;  // the (first) MTP block
  const int64_t width = int64_t{config_.hc_mult} * config_.hidden;
  std::vector<SequenceRows> items;
  std::vector<int32_t> tokens;
  std::vector<float> streams_host;
  for (size_t i = 0; i < batch.size(); ++i) {
    const MtpItem& it = batch[i];
    const int64_t n = static_cast<int64_t>(it.next_tokens.size());
    if (!it.sequence || n == 0 || static_cast<int64_t>(it.streams.size()) != n * width)
      return Status::errorf("mtp: item {}: {} tokens with {} stream values (expected {} per token)",
                            i, n, it.streams.size(), width);
    if (it.sequence->blocks_.size() <= b)
      return Status::errorf("mtp: item {}: the sequence was created without with_mtp", i);
    if (static_cast<uint64_t>(it.sequence->mtp_position() + n) > it.sequence->max_context())
      return Status::errorf("mtp: item {}: {} tokens at position {} exceed the context of {}", i,
                            n, it.sequence->mtp_position(), it.sequence->max_context());
    for (int32_t t : it.next_tokens)
      if (t < 0 || static_cast<uint32_t>(t) >= config_.vocab_size)
        return Status::errorf("mtp: item {}: token id {} outside the vocabulary", i, t);
    items.push_back({it.sequence, static_cast<int64_t>(tokens.size()), n, it.sequence->mtp_position()});
    tokens.insert(tokens.end(), it.next_tokens.begin(), it.next_tokens.end());
    streams_host.insert(streams_host.end(), it.streams.begin(), it.streams.end());
  }
  DSV4_ASSIGN_OR_RETURN(ForwardRows rows, fp.make_rows(items, tokens));
  DSV4_ASSIGN_OR_RETURN(Tensor main_streams, fp.f32({rows.n, width}));
  DSV4_TRY(backend_->upload(main_streams, streams_host.data(), streams_host.size() * sizeof(float)));
  const BlockWeights& bw = weights_->blocks[b];
  DSV4_ASSIGN_OR_RETURN(Tensor streams, fp.mtp_input(bw, main_streams, rows));
  DSV4_TRY(fp.block(b, streams, rows));
  for (const SequenceRows& r : rows.items) r.seq->mtp_position_ += r.n;
  DSV4_ASSIGN_OR_RETURN(Tensor logits, fp.head(bw.hc_head, bw.head_norm, bw.head, streams));
  std::vector<float> host(rows.n * config_.vocab_size);
  DSV4_TRY(backend_->download(logits, host.data(), host.size() * sizeof(float)));
  return host;
}

Result<std::vector<float>> Model::prefill(Sequence& seq, std::span<const int32_t> tokens,
                                          bool all_logits) const {
  const BatchItem item{&seq, tokens, all_logits, false};
  ForwardOutput out;
  DSV4_TRY(forward(std::span<const BatchItem>(&item, 1), out));
  return std::move(out.logits);
}

Result<std::vector<float>> Model::decode(Sequence& seq, int32_t token) const {
  return prefill(seq, std::span<const int32_t>(&token, 1), false);
}

}  // namespace dsv4
