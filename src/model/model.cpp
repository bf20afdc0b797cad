#include "model/model.h"

#include <fmt/format.h>

#include <algorithm>

#include "gguf/gguf_file.h"
#include "model/forward.h"
#include "model/weights.h"

namespace dsv4 {

using backend::Tensor;

Model::~Model() {
  cache_.reset();  // before the weights and the backend's allocations it views
}

Result<std::unique_ptr<Model>> Model::load(const std::string& path, backend::Backend& backend,
                                           ModelOptions options) {
  DSV4_ASSIGN_OR_RETURN(gguf::GgufFile file, gguf::GgufFile::open(path));
  DSV4_ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::from_gguf(file));
  DSV4_TRY(config.validate().with_context(path));
  std::unique_ptr<Model> m(new Model());
  m->file_ = std::make_unique<gguf::GgufFile>(std::move(file));
  m->config_ = std::move(config);
  m->plan_ = ModelPlan::build(m->config_);
  m->options_ = options;
  m->backend_ = &backend;
  DSV4_ASSIGN_OR_RETURN(ModelWeights weights, ModelWeights::load(*m->file_, m->config_, backend));
  m->weights_ = std::make_unique<ModelWeights>(std::move(weights));
  DSV4_ASSIGN_OR_RETURN(m->cache_, KvCache::create(m->config_, m->plan_, backend, options.cache));
  return m;
}

Result<std::unique_ptr<Sequence>> Model::new_sequence(const SequenceOptions& so) const {
  const ModelConfig& c = config_;
  if (so.with_mtp && !has_mtp()) return Status::error("new_sequence: the model has no MTP block");
  const uint64_t context = so.max_context ? so.max_context : std::min<uint64_t>(c.context_length, cache_->max_context());
  DSV4_ASSIGN_OR_RETURN(CachePlan plan,
                        CachePlan::compute(c, context, so.with_mtp, cache_->options().page_rows));
  if (so.memory_budget && plan.total() > so.memory_budget)
    return Status::errorf(StatusCode::kResourceExhausted, "new_sequence: {} exceeds the memory budget of {} bytes",
                          plan.describe(), so.memory_budget);
  std::unique_ptr<Sequence> seq(new Sequence());
  seq->plan_ = plan;
  seq->budget_ = so.shared_budget;
  seq->with_mtp_ = so.with_mtp;
  DSV4_TRY(cache_->attach(*seq));
  return seq;
}

Result<std::unique_ptr<Sequence>> Model::fork(const Sequence& seq) const {
  if (seq.cache_ != cache_.get()) return Status::error("fork: the sequence belongs to another model");
  std::unique_ptr<Sequence> copy(new Sequence());
  copy->plan_ = seq.plan_;
  copy->budget_ = seq.budget_;
  copy->with_mtp_ = seq.with_mtp_;
  DSV4_TRY(cache_->fork(seq, *copy));
  return copy;
}

uint64_t SequenceSnapshot::bytes() const {
  uint64_t n = 0;
  for (const auto& r : snap_.rings) n += r.size() * sizeof(float);
  for (const auto& s : snap_.states) n += s.size() * sizeof(float);
  return n;
}

Result<SequenceSnapshot> Model::snapshot(const Sequence& seq) const {
  if (seq.cache_ != cache_.get()) return Status::error("snapshot: the sequence belongs to another model");
  SequenceSnapshot s;
  DSV4_ASSIGN_OR_RETURN(s.snap_, cache_->snapshot(seq));
  return s;
}

Status Model::restore(Sequence& seq, const SequenceSnapshot& snap) const {
  if (seq.cache_ != cache_.get()) return Status::error("restore: the sequence belongs to another model");
  return cache_->restore(seq, snap.snap_);
}

Status Model::forward(std::span<const BatchItem> batch, ForwardOutput& out, ForwardTrace* trace) const {
  if (batch.empty()) return Status::error("forward: empty batch");
  const ForwardPass fp{config_, plan_, *weights_, options_, *backend_, *cache_, trace};
  std::vector<StepItem> items;
  std::vector<int32_t> tokens;
  for (size_t i = 0; i < batch.size(); ++i) {
    const BatchItem& it = batch[i];
    if (!it.sequence || it.tokens.empty())
      return Status::errorf("forward: batch item {} has no sequence or no tokens", i);
    if (it.sequence->cache_ != cache_.get())
      return Status::errorf("forward: batch item {}: the sequence belongs to another model", i);
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
  // Pages for the rows this step writes, before anything is computed.
  for (const StepItem& it : items) DSV4_TRY(cache_->prepare(*it.seq, it.pos0 + it.n));
  DSV4_TRY(cache_->sync());

  backend_->begin_step();
  DSV4_ASSIGN_OR_RETURN(Step step, fp.make_step(items, tokens));
  DSV4_ASSIGN_OR_RETURN(Tensor streams, fp.embed(weights_->token_embd, step));
  for (uint32_t b = 0; b < config_.n_layers; ++b) DSV4_TRY(fp.block(plan_.layers[b], streams, step));
  if (trace) DSV4_TRY(trace->record("final_streams", streams));
  for (const StepItem& it : step.items) it.seq->position_ += it.n;

  // Logits only for the rows asked for.
  const int64_t width = streams.cols();
  std::vector<int32_t> wanted;
  out.streams.clear();
  for (size_t i = 0; i < batch.size(); ++i) {
    const StepItem& it = step.items[i];
    if (batch[i].all_logits)
      for (int64_t j = 0; j < it.n; ++j) wanted.push_back(static_cast<int32_t>(it.row0 + j));
    else
      wanted.push_back(static_cast<int32_t>(it.row0 + it.n - 1));
    if (batch[i].keep_streams) {
      const size_t at = out.streams.size();
      out.streams.resize(at + it.n * width);
      DSV4_TRY(backend_->download(streams.slice(it.row0, it.n), out.streams.data() + at, it.n * width * sizeof(float)));
    }
  }
  const int64_t n_out = static_cast<int64_t>(wanted.size());
  DSV4_ASSIGN_OR_RETURN(Tensor ids, fp.upload_i32(wanted, {n_out}));
  DSV4_ASSIGN_OR_RETURN(Tensor picked, fp.f32({n_out, width}));
  DSV4_TRY(backend_->get_rows(streams, ids, picked));
  DSV4_ASSIGN_OR_RETURN(Tensor logits, fp.head(weights_->hc_head, weights_->output_norm,
                                               weights_->output, picked));
  out.rows = n_out;
  out.logits.resize(n_out * config_.vocab_size);
  return backend_->download(logits, out.logits.data(), out.logits.size() * sizeof(float));
}

Result<std::vector<float>> Model::mtp(std::span<const MtpItem> batch, ForwardTrace* trace) const {
  if (!has_mtp()) return Status::error("mtp: the model has no MTP block");
  if (batch.empty()) return Status::error("mtp: empty batch");
  const ForwardPass fp{config_, plan_, *weights_, options_, *backend_, *cache_, trace};
  const uint32_t b = config_.n_layers;  // the (first) MTP block
  const int64_t width = int64_t{config_.hc_mult} * config_.hidden;
  std::vector<StepItem> items;
  std::vector<int32_t> tokens;
  std::vector<float> streams_host;
  for (size_t i = 0; i < batch.size(); ++i) {
    const MtpItem& it = batch[i];
    const int64_t n = static_cast<int64_t>(it.next_tokens.size());
    if (!it.sequence || n == 0 || static_cast<int64_t>(it.streams.size()) != n * width)
      return Status::errorf("mtp: item {}: {} tokens with {} stream values (expected {} per token)",
                            i, n, it.streams.size(), width);
    if (!it.sequence->with_mtp())
      return Status::errorf("mtp: item {}: the sequence was created without with_mtp", i);
    for (size_t j = 0; j < i; ++j)
      if (batch[j].sequence == it.sequence)
        return Status::errorf("mtp: items {} and {} share one sequence", j, i);
    if (static_cast<uint64_t>(it.sequence->mtp_position() + n) > it.sequence->max_context())
      return Status::errorf(StatusCode::kOutOfRange, "mtp: item {}: {} tokens at position {} exceed the context of {}", i,
                            n, it.sequence->mtp_position(), it.sequence->max_context());
    for (int32_t t : it.next_tokens)
      if (t < 0 || static_cast<uint32_t>(t) >= config_.vocab_size)
        return Status::errorf(StatusCode::kOutOfRange, "mtp: item {}: token id {} outside the vocabulary", i, t);
    items.push_back({it.sequence, static_cast<int64_t>(tokens.size()), n, it.sequence->mtp_position()});
    tokens.insert(tokens.end(), it.next_tokens.begin(), it.next_tokens.end());
    streams_host.insert(streams_host.end(), it.streams.begin(), it.streams.end());
  }
  backend_->begin_step();
  DSV4_ASSIGN_OR_RETURN(Step step, fp.make_step(items, tokens));
  DSV4_ASSIGN_OR_RETURN(Tensor main_streams, fp.f32({step.rows.n, width}));
  DSV4_TRY(backend_->upload(main_streams, streams_host.data(), streams_host.size() * sizeof(float)));
  const BlockWeights& bw = weights_->blocks[b];
  DSV4_ASSIGN_OR_RETURN(Tensor streams, fp.mtp_input(bw, main_streams, step));
  DSV4_TRY(fp.block(plan_.layers[b], streams, step));
  for (const StepItem& it : step.items) it.seq->mtp_position_ += it.n;
  DSV4_ASSIGN_OR_RETURN(Tensor logits, fp.head(bw.hc_head, bw.head_norm, bw.head, streams));
  std::vector<float> host(step.rows.n * config_.vocab_size);
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
