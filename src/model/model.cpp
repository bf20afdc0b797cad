#include "model/model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "gguf/gguf_file.h"
#include "backend/sampling.h"
#include "model/forward.h"
#include "model/kv_graft.h"
#include "model/model_files.h"
#include "model/weights.h"

namespace dsv4 {

using backend::Tensor;

namespace {

// Single-token sampled steps run padded to these sizes (ModelOptions::graphs).
constexpr int64_t kMaxBucketRows = 64;
constexpr int64_t kAdjustPerBucketRow = 256;  // adjustments a bucketed step can carry per row
constexpr int64_t kMaxVerifyRows = 5;          // tokens per sequence of a bucketed verify step (k + 1 <= 5)

int32_t f32_bits(float f) {
  int32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// The parameter row and adjustments of one sampled row, in sampling.h's layout.
void append_sample_spec(const SampleSpec& spec, int32_t row, std::vector<int32_t>& params, std::vector<int32_t>& adjust) {
  params.insert(params.end(), {f32_bits(spec.temperature), f32_bits(spec.top_p), f32_bits(spec.min_p), spec.top_k,
                               static_cast<int32_t>(spec.seed), static_cast<int32_t>(spec.seed >> 32),
                               static_cast<int32_t>(spec.counter), static_cast<int32_t>(spec.counter >> 32)});
  for (const LogitAdjustment& a : spec.adjust)
    adjust.insert(adjust.end(), {row, a.token, f32_bits(a.repetition), f32_bits(a.subtract)});
}

Status validate_spec(const SampleSpec& s, uint32_t vocab, size_t item) {
  if (!(s.temperature >= 0) || !std::isfinite(s.temperature) || !(s.top_p > 0 && s.top_p <= 1) ||
      !(s.min_p >= 0 && s.min_p <= 1) || s.top_k < 0)
    return Status::errorf("forward: batch item {}: sampling temperature {} top_p {} min_p {} top_k {} out of range",
                          item, s.temperature, s.top_p, s.min_p, s.top_k);
  for (const LogitAdjustment& a : s.adjust)
    if (a.token < 0 || static_cast<uint32_t>(a.token) >= vocab || !std::isfinite(a.repetition) || a.repetition <= 0 ||
        std::isnan(a.subtract))
      return Status::errorf("forward: batch item {}: adjustment of token {} (repetition {}, subtract {}) out of range",
                            item, a.token, a.repetition, a.subtract);
  return Status::ok();
}

}  // namespace

struct Model::DecodeBucket {
  int64_t rows = 0;
  int64_t graph_id = 0;
  Tensor tokens, positions, row_seq, seqs, params, adjust, sampled, steer_alpha;
  Tensor streams;  // verify buckets: the final streams of every row, copied out of the scratch
  bool warmed = false;    // ran once directly (first-use uploads, scratch grown)
  bool recorded = false;  // graph `rows` recorded
};

Model::~Model() {
  cache_.reset();  // before the weights and the backend's allocations it views
}

Result<std::unique_ptr<Model>> Model::load(const std::string& path, backend::Backend& backend,
                                           ModelOptions options) {
  ModelFilesOptions fo;
  fo.mtp_path = options.mtp_path;
  DSV4_ASSIGN_OR_RETURN(ModelFiles files, ModelFiles::open(path, fo));
  DSV4_TRY(files.config().validate().with_context(path));
  std::unique_ptr<Model> m(new Model());
  m->files_ = std::make_unique<ModelFiles>(std::move(files));
  m->config_ = m->files_->config();
  m->plan_ = ModelPlan::build(m->config_);
  m->options_ = options;
  m->backend_ = &backend;
  // A device commits memory at allocation: refuse what cannot fit before allocating any.
  const backend::DeviceMemoryState device = backend.device_memory();
  const uint64_t capacity = options.device_memory ? options.device_memory
                                                  : device.free_bytes ? device.free_bytes + device.scratch_bytes : 0;
  // A capacity given for the CPU plans as a device would hold the step: its first arena chunk.
  const uint64_t scratch = device.free_bytes     ? device.scratch_bytes
                           : options.device_memory ? backend::kDefaultDeviceScratchBytes + backend::kDeviceWorkspaceBytes
                                                   : 0;
  m->memory_plan_ = plan_device_memory(m->config_, m->plan_, m->files_->tensors(), options.cache, scratch, capacity);
  DSV4_TRY(check_device_fit(m->memory_plan_, path));
  DSV4_ASSIGN_OR_RETURN(ModelWeights weights, ModelWeights::load(*m->files_, backend));
  m->weights_ = std::make_unique<ModelWeights>(std::move(weights));
  DSV4_ASSIGN_OR_RETURN(m->cache_, KvCache::create(m->config_, m->plan_, backend, options.cache));
  if (m->config_.engram) {
    DSV4_ASSIGN_OR_RETURN(EngramHasher hasher, EngramHasher::from_gguf(m->files_->trunk(), m->config_));
    m->engram_hasher_ = std::make_unique<EngramHasher>(std::move(hasher));
    DSV4_ASSIGN_OR_RETURN(m->engram_tables_,
                          open_engram_tables(m->files_->trunk(), m->config_, EngramTable::Access::Mapped));
  }
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
  if (so.graft && so.graft->model_identity != c.identity())
    return Status::errorf("new_sequence: the KV graft was made for another model:\n  graft: {}\n  model: {}",
                          so.graft->model_identity, c.identity());
  std::unique_ptr<Sequence> seq(new Sequence());
  seq->plan_ = plan;
  seq->budget_ = so.shared_budget;
  seq->with_mtp_ = so.with_mtp;
  seq->steering_alpha_ = steering_ ? steering_->alpha : 0.0f;
  if (engram_hasher_) seq->engram_history_ = engram_hasher_->start();
  DSV4_TRY(cache_->attach(*seq));
  if (so.graft) {
    DSV4_TRY(cache_->plant(*seq, *so.graft));
    seq->graft_ = so.graft;
  }
  return seq;
}

Status Model::bind_steering(const SteeringFile& file, std::optional<float> alpha, const std::vector<uint32_t>& layers) {
  Steering st;
  st.mode = file.mode;
  st.hook = file.hook;
  st.alpha = alpha.value_or(file.alpha);
  if (!std::isfinite(st.alpha)) return Status::errorf("steering: strength {} is not finite", st.alpha);
  st.directions.resize(config_.n_layers);
  for (uint32_t l : layers)
    if (std::none_of(file.directions.begin(), file.directions.end(), [&](const SteeringDirection& d) { return d.layer == l; }))
      return Status::errorf("steering: layer {} has no direction in the file", l);
  for (const SteeringDirection& d : file.directions) {
    if (!layers.empty() && std::find(layers.begin(), layers.end(), d.layer) == layers.end()) continue;
    if (d.layer >= config_.n_layers) return Status::errorf("steering: layer {} outside the model's {}", d.layer, config_.n_layers);
    DSV4_TRY(SteeringFile::check_width(file.hook, config_, d.values.size()).with_context(fmt::format("steering: layer {}", d.layer)));
    std::vector<float> v = d.values;
    if (st.mode == SteerMode::Project) {
      // Each group the op steers (a stream's slice, or the one shared direction) as a unit
      // vector; the norm in double.
      const size_t g = st.hook == SteerHook::FfnOut || v.size() == config_.hidden ? v.size() : config_.hidden;
      for (size_t at = 0; at < v.size(); at += g) {
        double norm = 0;
        for (size_t i = at; i < at + g; ++i) norm += double(v[i]) * v[i];
        if (norm == 0) return Status::errorf("steering: layer {} has a zero direction", d.layer);
        for (size_t i = at; i < at + g; ++i) v[i] = static_cast<float>(double(v[i]) / std::sqrt(norm));
      }
    }
    DSV4_ASSIGN_OR_RETURN(Tensor t, backend_->alloc(GgmlType::F32, std::vector<int64_t>{static_cast<int64_t>(v.size())}));
    DSV4_TRY(backend_->upload(t, v.data(), v.size() * sizeof(float)));
    st.directions[d.layer] = t;
  }
  steering_ = std::move(st);
  return Status::ok();
}

void Model::unbind_steering() { steering_.reset(); }

Result<KvGraft> Model::extract_graft(const Sequence& seq) const {
  if (seq.cache_ != cache_.get()) return Status::error("graft: the sequence belongs to another model");
  const int64_t T = seq.position_;
  if (T == 0 || T % plan_.max_ratio())
    return Status::errorf("graft: the prompt's {} tokens are not a positive multiple of the largest compress ratio {}", T,
                          plan_.max_ratio());
  if (seq.window_start_ != 0) return Status::error("graft: the sequence is itself grafted");
  KvGraft g;
  g.model_identity = config_.identity();
  for (const LayerPlan& l : plan_.layers) {
    if (l.mtp || !l.ratio) continue;
    KvGraftLayer gl;
    gl.block = l.block;
    gl.slots = T / l.ratio;
    DSV4_ASSIGN_OR_RETURN(gl.kv, cache_->read_rows(seq, l.kv_list, 0, gl.slots));
    if (l.key_list >= 0) {
      DSV4_ASSIGN_OR_RETURN(gl.keys, cache_->read_rows(seq, l.key_list, 0, gl.slots));
    }
    g.layers.push_back(std::move(gl));
  }
  DSV4_TRY(g.finalize(config_));
  return g;
}

Result<std::unique_ptr<Sequence>> Model::fork(const Sequence& seq) const {
  if (seq.cache_ != cache_.get()) return Status::error("fork: the sequence belongs to another model");
  std::unique_ptr<Sequence> copy(new Sequence());
  copy->plan_ = seq.plan_;
  copy->budget_ = seq.budget_;
  copy->with_mtp_ = seq.with_mtp_;
  copy->steering_alpha_ = seq.steering_alpha_;
  DSV4_TRY(cache_->fork(seq, *copy));
  copy->window_start_ = seq.window_start_;
  copy->graft_ = seq.graft_;
  return copy;
}

uint64_t SequenceSnapshot::bytes() const {
  uint64_t n = 0;
  if (!state_) return 0;
  for (const auto& r : state_->rings) n += r.size() * sizeof(float);
  for (const auto& s : state_->states) n += s.size() * sizeof(float);
  return n;
}

Status Model::fill_for_benchmark(Sequence& seq, int64_t position, uint64_t seed) const {
  if (seq.cache_ != cache_.get()) return Status::error("fill_for_benchmark: the sequence belongs to another model");
  if (position < 0 || static_cast<uint64_t>(position) > seq.max_context())
    return Status::errorf(StatusCode::kOutOfRange, "fill_for_benchmark: position {} outside the sequence's context of {}",
                          position, seq.max_context());
  return cache_->fill_random(seq, position, seed);
}

Result<SequenceSnapshot> Model::snapshot(const Sequence& seq) const {
  if (seq.cache_ != cache_.get()) return Status::error("snapshot: the sequence belongs to another model");
  SequenceSnapshot s;
  DSV4_ASSIGN_OR_RETURN(SlotSnapshot state, cache_->snapshot(seq));
  s.state_ = std::make_shared<const SlotSnapshot>(std::move(state));
  return s;
}

Status Model::restore(Sequence& seq, const SequenceSnapshot& snap) const {
  if (seq.cache_ != cache_.get()) return Status::error("restore: the sequence belongs to another model");
  if (!snap.valid()) return Status::error("restore: an empty snapshot");
  return cache_->restore(seq, *snap.state_);
}

Result<std::vector<std::vector<float>>> Model::gather_engram(const std::vector<StepItem>& items,
                                                             const std::vector<int32_t>& tokens) const {
  std::vector<std::vector<float>> rows;
  if (!engram_hasher_) return rows;
  const EngramHasher& h = *engram_hasher_;
  const uint32_t cols = h.columns(), layers = h.n_layers(), dim = config_.engram->dim;
  const size_t n = tokens.size();
  std::vector<uint32_t> ids(n * h.rows_per_token());
  for (const StepItem& it : items)
    DSV4_TRY(h.hash(it.seq->engram_history_, std::span<const int32_t>(tokens).subspan(it.row0, it.n), {},
                    std::span<uint32_t>(ids).subspan(it.row0 * h.rows_per_token(), it.n * h.rows_per_token())));
  rows.resize(layers);
  std::vector<uint32_t> layer_ids(n * cols);
  for (uint32_t l = 0; l < layers; ++l) {
    for (size_t t = 0; t < n; ++t)
      for (uint32_t j = 0; j < cols; ++j) layer_ids[t * cols + j] = ids[(t * layers + l) * cols + j];
    rows[l].resize(n * cols * dim);
    DSV4_TRY(engram_tables_.at(l).read(layer_ids, rows[l]));
  }
  return rows;
}

Status Model::rewind(Sequence& seq, int64_t position, int64_t mtp_position) const {
  if (seq.cache_ != cache_.get()) return Status::error("rewind: the sequence belongs to another model");
  return cache_->rewind(seq, position, mtp_position);
}

Status Model::restore_mtp(Sequence& seq, const SequenceSnapshot& snap) const {
  if (seq.cache_ != cache_.get()) return Status::error("restore_mtp: the sequence belongs to another model");
  if (!snap.valid()) return Status::error("restore_mtp: an empty snapshot");
  return cache_->restore_mtp(seq, *snap.state_);
}

Status Model::forward(std::span<const BatchItem> batch, ForwardOutput& out, ForwardTrace* trace) const {
  if (batch.empty()) return Status::error("forward: empty batch");
  ForwardPass fp{config_, plan_, *weights_, options_, *backend_, *cache_, trace, steering()};
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
    if (it.sample) DSV4_TRY(validate_spec(*it.sample, config_.vocab_size, i));
    if (it.sample && it.greedy_rows)
      return Status::errorf("forward: batch item {}: sample and greedy_rows exclude each other", i);
    if (config_.is_v41()) DSV4_TRY(refuse_image_tokens(config_, it.tokens).with_context(fmt::format("forward: batch item {}", i)));
    items.push_back({it.sequence, static_cast<int64_t>(tokens.size()), n, it.sequence->position()});
    tokens.insert(tokens.end(), it.tokens.begin(), it.tokens.end());
  }
  // Bucketed steps (decode_step): single-token sampled items, or greedy_rows items of one
  // token count (speculative verification).
  const bool can_bucket = !trace && !config_.is_v41() && static_cast<int64_t>(batch.size()) <= kMaxBucketRows &&
                          ((backend_->supports_graphs() && options_.graphs) || options_.decode_buckets);
  const size_t verify_rows = batch[0].tokens.size();
  const bool bucketed = can_bucket && std::all_of(batch.begin(), batch.end(), [](const BatchItem& it) {
    return it.tokens.size() == 1 && it.sample && !it.all_logits && !it.keep_streams &&
           static_cast<int64_t>(it.sample->adjust.size()) <= kAdjustPerBucketRow;
  });
  const bool verify_bucketed =
      can_bucket && static_cast<int64_t>(verify_rows) <= kMaxVerifyRows &&
      std::all_of(batch.begin(), batch.end(), [&](const BatchItem& it) {
        return it.greedy_rows && it.tokens.size() == verify_rows && !it.sample && !it.all_logits;
      });
  if (bucketed || verify_bucketed) return decode_step(batch, out);
  // Pages for the rows this step writes, before anything is computed.
  for (const StepItem& it : items) DSV4_TRY(cache_->prepare(*it.seq, it.pos0 + it.n));
  DSV4_TRY(cache_->sync());

  backend_->begin_step();
  DSV4_ASSIGN_OR_RETURN(Step step, fp.make_step(items, tokens));
  DSV4_ASSIGN_OR_RETURN(Tensor streams, fp.embed(weights_->token_embd, step));
  V41Step v41;
  if (config_.is_v41()) {
    DSV4_ASSIGN_OR_RETURN(auto engram_rows, gather_engram(items, tokens));
    fp.v41 = &v41;
    DSV4_TRY(fp.v41_begin(step, std::move(engram_rows)));
    const bool keep = std::any_of(batch.begin(), batch.end(), [](const BatchItem& it) { return it.keep_streams; });
    if (config_.dspark && config_.n_mtp > 0 && (keep || trace)) {
      const int64_t width = static_cast<int64_t>(config_.dspark->target_layers.size()) * config_.hidden;
      DSV4_ASSIGN_OR_RETURN(v41.dspark_hidden, fp.f32({step.rows.n, width}));
    }
    for (uint32_t b = 0; b < config_.n_layers; ++b) DSV4_TRY(fp.block_v41(plan_.layers[b], streams, step));
  } else {
    for (uint32_t b = 0; b < config_.n_layers; ++b) DSV4_TRY(fp.block(plan_.layers[b], streams, step));
  }
  if (trace) DSV4_TRY(trace->record("final_streams", streams));
  if (trace && v41.dspark_hidden.valid()) DSV4_TRY(trace->record("dspark_main_hidden", v41.dspark_hidden));
  const Tensor& kept = v41.dspark_hidden.valid() ? v41.dspark_hidden : streams;  // what keep_streams returns
  for (const StepItem& it : step.items) it.seq->position_ += it.n;

  // Logits for the rows asked for and the rows that sample.
  const int64_t width = streams.cols();
  std::vector<int32_t> wanted;    // stream rows that get logits
  std::vector<int32_t> returned;  // rows of `wanted` whose logits go back
  std::vector<int32_t> sampled;   // rows of `wanted` that sample, in batch order
  std::vector<int32_t> sampled_item;  // per sampled row: its item (a `sample`), or -1 (a greedy row)
  std::vector<int32_t> params, adjust;
  SampleSpec greedy;  // greedy_rows: every row's arg-max
  greedy.temperature = 0;
  out.streams.clear();
  out.row_tokens.clear();
  out.tokens.assign(batch.size(), -1);
  for (size_t i = 0; i < batch.size(); ++i) {
    const StepItem& it = step.items[i];
    const BatchItem& bi = batch[i];
    if (bi.all_logits || bi.greedy_rows)
      for (int64_t j = 0; j < it.n; ++j) {
        if (bi.all_logits) returned.push_back(static_cast<int32_t>(wanted.size()));
        if (bi.greedy_rows) {
          append_sample_spec(greedy, static_cast<int32_t>(sampled.size()), params, adjust);
          sampled.push_back(static_cast<int32_t>(wanted.size()));
          sampled_item.push_back(-1);
        }
        wanted.push_back(static_cast<int32_t>(it.row0 + j));
      }
    else
      wanted.push_back(static_cast<int32_t>(it.row0 + it.n - 1));
    if (!bi.all_logits && !bi.sample && !bi.greedy_rows) returned.push_back(static_cast<int32_t>(wanted.size() - 1));
    if (bi.sample) {
      append_sample_spec(*bi.sample, static_cast<int32_t>(sampled.size()), params, adjust);
      sampled.push_back(static_cast<int32_t>(wanted.size() - 1));
      sampled_item.push_back(static_cast<int32_t>(i));
    }
    if (bi.keep_streams) {
      const size_t at = out.streams.size();
      const int64_t kw = kept.cols();
      out.streams.resize(at + it.n * kw);
      DSV4_TRY(backend_->download(kept.slice(it.row0, it.n), out.streams.data() + at, it.n * kw * sizeof(float)));
    }
  }
  const int64_t n_out = static_cast<int64_t>(wanted.size());
  DSV4_ASSIGN_OR_RETURN(Tensor ids, fp.upload_i32(wanted, {n_out}));
  DSV4_ASSIGN_OR_RETURN(Tensor picked, fp.f32({n_out, width}));
  DSV4_TRY(backend_->get_rows(streams, ids, picked));
  Tensor logits;
  if (config_.is_v41()) {
    DSV4_ASSIGN_OR_RETURN(Tensor pre, fp.f32({n_out, static_cast<int64_t>(config_.hc_mult)}));
    DSV4_TRY(backend_->get_rows(v41.pre, ids, pre));
    DSV4_ASSIGN_OR_RETURN(logits, fp.head_v41(pre, picked));
  } else {
    DSV4_ASSIGN_OR_RETURN(logits, fp.head(weights_->hc_head, weights_->output_norm, weights_->output, picked));
  }
  const int64_t vocab = config_.vocab_size;
  if (!sampled.empty()) {
    const int64_t m = static_cast<int64_t>(sampled.size());
    DSV4_ASSIGN_OR_RETURN(Tensor rows, fp.upload_i32(sampled, {m}));
    DSV4_ASSIGN_OR_RETURN(Tensor sub, fp.f32({m, vocab}));
    DSV4_TRY(backend_->get_rows(logits, rows, sub));  // a copy: adjustments change it
    DSV4_ASSIGN_OR_RETURN(Tensor params_t, fp.upload_i32(params, {m, backend::kSampleFields}));
    Tensor adjust_t;
    if (!adjust.empty()) {
      DSV4_ASSIGN_OR_RETURN(adjust_t, fp.upload_i32(adjust, {static_cast<int64_t>(adjust.size()) / backend::kAdjustFields,
                                                             backend::kAdjustFields}));
    }
    DSV4_ASSIGN_OR_RETURN(Tensor chosen, fp.i32({m}));
    DSV4_TRY(backend_->sample(sub, params_t, adjust.empty() ? nullptr : &adjust_t, chosen));
    std::vector<int32_t> host(m);
    DSV4_TRY(backend_->download(chosen, host.data(), m * sizeof(int32_t)));
    for (int64_t j = 0; j < m; ++j) {
      if (sampled_item[j] >= 0)
        out.tokens[sampled_item[j]] = host[j];
      else
        out.row_tokens.push_back(host[j]);  // greedy rows, in batch order
    }
  }
  out.rows = static_cast<int64_t>(returned.size());
  out.logits.resize(out.rows * vocab);
  if (out.rows == 0) return Status::ok();
  if (out.rows == n_out) return backend_->download(logits, out.logits.data(), out.logits.size() * sizeof(float));
  DSV4_ASSIGN_OR_RETURN(Tensor back_ids, fp.upload_i32(returned, {out.rows}));
  DSV4_ASSIGN_OR_RETURN(Tensor back, fp.f32({out.rows, vocab}));
  DSV4_TRY(backend_->get_rows(logits, back_ids, back));
  return backend_->download(back, out.logits.data(), out.logits.size() * sizeof(float));
}

// A bucketed step, padded to a bucket of sequences: either single-token sampled items
// (decode), or items of r tokens each (1 <= r <= kMaxVerifyRows) that ask for every row's
// greedy token (speculative verification). Persistent inputs are uploaded first, then the
// compute (embedding through sampling) runs directly the first time, is recorded as a graph
// the second and replayed from then on, where the backend records graphs: one graph per
// (sequence bucket, r).
Status Model::decode_step(std::span<const BatchItem> batch, ForwardOutput& out) const {
  const int64_t n = static_cast<int64_t>(batch.size());
  const bool verify = batch[0].greedy_rows;
  const int64_t r = static_cast<int64_t>(batch[0].tokens.size());  // rows per sequence
  int64_t seq_bucket = 1;
  while (seq_bucket < n) seq_bucket *= 2;
  const int64_t rows = seq_bucket * r;
  size_t index = 0;
  while ((int64_t{1} << index) < seq_bucket) ++index;
  index = index * (kMaxVerifyRows + 1) + static_cast<size_t>(verify ? r : 0);
  if (buckets_.size() <= index) buckets_.resize(index + 1);
  if (!buckets_[index]) {
    auto b = std::make_unique<DecodeBucket>();
    b->rows = rows;
    b->graph_id = verify ? 1000 * r + seq_bucket : seq_bucket;
    backend::Backend& be = *backend_;
    const auto i32 = [&](std::vector<int64_t> shape) { return be.alloc(GgmlType::I32, shape); };
    DSV4_ASSIGN_OR_RETURN(b->tokens, i32({rows}));
    DSV4_ASSIGN_OR_RETURN(b->positions, i32({rows}));
    DSV4_ASSIGN_OR_RETURN(b->row_seq, i32({rows}));
    DSV4_ASSIGN_OR_RETURN(b->seqs, i32({seq_bucket, backend::kSeqFields}));
    DSV4_ASSIGN_OR_RETURN(b->params, i32({rows, backend::kSampleFields}));
    DSV4_ASSIGN_OR_RETURN(b->adjust, i32({rows * kAdjustPerBucketRow, backend::kAdjustFields}));
    DSV4_ASSIGN_OR_RETURN(b->sampled, i32({rows}));
    DSV4_ASSIGN_OR_RETURN(b->steer_alpha, be.alloc(GgmlType::F32, std::vector<int64_t>{rows}));
    if (verify) {
      const int64_t width = int64_t{config_.hc_mult} * config_.hidden;
      DSV4_ASSIGN_OR_RETURN(b->streams, be.alloc(GgmlType::F32, std::vector<int64_t>{rows, width}));
    }
    buckets_[index] = std::move(b);
  }
  DecodeBucket& bucket = *buckets_[index];

  // Real sequences first (sequence i's rows at i * r ..), then padding rows (no sequence)
  // and empty padding sequences.
  std::vector<int32_t> tokens(rows, 0), positions(rows, 0), row_seq(rows, -1), seqs(seq_bucket * backend::kSeqFields, 0);
  std::vector<int32_t> params, adjust;
  SampleSpec greedy;  // padding rows and verify rows: greedy, nothing else
  greedy.temperature = 0;
  for (int64_t i = 0; i < seq_bucket; ++i) {
    int32_t* f = &seqs[i * backend::kSeqFields];
    f[backend::kSeqSlot] = static_cast<int32_t>(batch[0].sequence->slot());
    if (i >= n) {
      for (int64_t j = 0; j < r; ++j) append_sample_spec(greedy, static_cast<int32_t>(i * r + j), params, adjust);
      continue;
    }
    const Sequence& seq = *batch[i].sequence;
    for (int64_t j = 0; j < r; ++j) {
      tokens[i * r + j] = batch[i].tokens[j];
      positions[i * r + j] = static_cast<int32_t>(seq.position() + j);
      row_seq[i * r + j] = static_cast<int32_t>(i);
      append_sample_spec(verify ? greedy : *batch[i].sample, static_cast<int32_t>(i * r + j), params, adjust);
    }
    f[backend::kSeqFirstRow] = static_cast<int32_t>(i * r);
    f[backend::kSeqRows] = static_cast<int32_t>(r);
    f[backend::kSeqFirstPos] = static_cast<int32_t>(seq.position());
    f[backend::kSeqSlot] = static_cast<int32_t>(seq.slot());
    f[backend::kSeqWindowStart] = static_cast<int32_t>(seq.window_start());
  }
  const size_t used = adjust.size();
  adjust.resize(static_cast<size_t>(rows * kAdjustPerBucketRow * backend::kAdjustFields), 0);
  for (size_t a = used; a < adjust.size(); a += backend::kAdjustFields) adjust[a] = -1;  // unused: skipped
  for (const BatchItem& it : batch) DSV4_TRY(cache_->prepare(*it.sequence, it.sequence->position() + r));
  DSV4_TRY(cache_->sync());
  backend::Backend& be = *backend_;
  DSV4_TRY(be.upload(bucket.tokens, tokens.data(), tokens.size() * sizeof(int32_t)));
  DSV4_TRY(be.upload(bucket.positions, positions.data(), positions.size() * sizeof(int32_t)));
  DSV4_TRY(be.upload(bucket.row_seq, row_seq.data(), row_seq.size() * sizeof(int32_t)));
  DSV4_TRY(be.upload(bucket.seqs, seqs.data(), seqs.size() * sizeof(int32_t)));
  DSV4_TRY(be.upload(bucket.params, params.data(), params.size() * sizeof(int32_t)));
  DSV4_TRY(be.upload(bucket.adjust, adjust.data(), adjust.size() * sizeof(int32_t)));
  std::vector<float> alpha(rows, 0.0f);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < r; ++j) alpha[i * r + j] = batch[i].sequence->steering_alpha();
  DSV4_TRY(be.upload(bucket.steer_alpha, alpha.data(), alpha.size() * sizeof(float)));

  const ForwardPass fp{config_, plan_, *weights_, options_, be, *cache_, nullptr, steering()};
  Step step;
  step.rows = {rows, seq_bucket, bucket.tokens, bucket.positions, bucket.row_seq, bucket.seqs,
               static_cast<int64_t>(cache_->max_context())};
  step.steer_alpha = bucket.steer_alpha;
  const auto compute = [&]() -> Status {
    be.begin_step();
    DSV4_ASSIGN_OR_RETURN(Tensor streams, fp.embed(weights_->token_embd, step));
    for (uint32_t b = 0; b < config_.n_layers; ++b) DSV4_TRY(fp.block(plan_.layers[b], streams, step));
    if (bucket.streams.valid()) DSV4_TRY(be.copy_rows(streams, bucket.streams));  // outlives the step's scratch
    DSV4_ASSIGN_OR_RETURN(Tensor logits, fp.head(weights_->hc_head, weights_->output_norm, weights_->output, streams));
    return be.sample(logits, bucket.params, &bucket.adjust, bucket.sampled);
  };
  if (!(be.supports_graphs() && options_.graphs) || !bucket.warmed) {
    DSV4_TRY(compute());
    bucket.warmed = true;
  } else {
    if (!bucket.recorded) {
      DSV4_TRY(be.begin_capture());
      const Status recorded = compute();
      const Status ended = be.end_capture(bucket.graph_id);
      DSV4_TRY(recorded);
      DSV4_TRY(ended);
      bucket.recorded = true;
    }
    DSV4_TRY(be.replay(bucket.graph_id));
  }
  std::vector<int32_t> chosen(rows);
  DSV4_TRY(be.download(bucket.sampled, chosen.data(), chosen.size() * sizeof(int32_t)));
  out.rows = 0;
  out.logits.clear();
  out.streams.clear();
  out.row_tokens.clear();
  if (verify) {
    out.tokens.assign(n, -1);
    out.row_tokens.assign(chosen.begin(), chosen.begin() + n * r);
    const int64_t width = bucket.streams.cols();
    for (int64_t i = 0; i < n; ++i) {
      if (!batch[i].keep_streams) continue;
      const size_t at = out.streams.size();
      out.streams.resize(at + r * width);
      DSV4_TRY(be.download(bucket.streams.slice(i * r, r), out.streams.data() + at, r * width * sizeof(float)));
    }
  } else {
    out.tokens.assign(chosen.begin(), chosen.begin() + n);
  }
  for (const BatchItem& it : batch) it.sequence->position_ += r;
  return Status::ok();
}

Result<std::vector<float>> Model::mtp(std::span<const MtpItem> batch, ForwardTrace* trace,
                                      std::vector<float>* streams_out) const {
  if (!has_mtp()) return Status::error("mtp: the model has no MTP block");
  if (config_.is_v41())
    return Status::error("mtp: a V4.1 model drafts with its DSpark stages (Model::dspark), not an MTP block");
  if (batch.empty()) return Status::error("mtp: empty batch");
  const ForwardPass fp{config_, plan_, *weights_, options_, *backend_, *cache_, trace, steering()};
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
  if (streams_out) {
    streams_out->resize(static_cast<size_t>(step.rows.n * width));
    DSV4_TRY(backend_->download(streams, streams_out->data(), streams_out->size() * sizeof(float)));
  }
  DSV4_ASSIGN_OR_RETURN(Tensor logits, fp.head(bw.hc_head, bw.head_norm, bw.head, streams));
  std::vector<float> host(step.rows.n * config_.vocab_size);
  DSV4_TRY(backend_->download(logits, host.data(), host.size() * sizeof(float)));
  return host;
}

Result<std::vector<DsparkDraft>> Model::dspark(std::span<const DsparkItem> batch, ForwardTrace* trace) const {
  if (!config_.is_v41() || !config_.dspark || config_.n_mtp == 0)
    return Status::error("dspark: the model has no DSpark draft stages");
  if (batch.empty()) return Status::error("dspark: empty batch");
  const DsparkConfig& ds = *config_.dspark;
  const int64_t width = static_cast<int64_t>(ds.target_layers.size()) * config_.hidden, block = ds.block_size;
  const int64_t d = config_.hidden, vocab = config_.vocab_size, rank = ds.markov_rank;
  std::vector<StepItem> seeds, drafts;
  std::vector<int32_t> seed_tokens, draft_tokens;
  std::vector<float> hidden;
  for (size_t i = 0; i < batch.size(); ++i) {
    const DsparkItem& it = batch[i];
    const int64_t n = width ? static_cast<int64_t>(it.main_hidden.size()) / width : 0;
    if (!it.sequence || n == 0 || static_cast<int64_t>(it.main_hidden.size()) != n * width)
      return Status::errorf("dspark: item {}: {} main-hidden values (expected a multiple of {})", i,
                            it.main_hidden.size(), width);
    if (it.sequence->cache_ != cache_.get())
      return Status::errorf("dspark: item {}: the sequence belongs to another model", i);
    if (!it.sequence->with_mtp()) return Status::errorf("dspark: item {}: the sequence was created without with_mtp", i);
    for (size_t j = 0; j < i; ++j)
      if (batch[j].sequence == it.sequence) return Status::errorf("dspark: items {} and {} share one sequence", j, i);
    const int64_t pos = it.sequence->mtp_position();
    if (static_cast<uint64_t>(pos + n) > it.sequence->max_context())
      return Status::errorf(StatusCode::kOutOfRange, "dspark: item {}: {} rows at position {} exceed the context of {}",
                            i, n, pos, it.sequence->max_context());
    if (it.anchor < -1 || it.anchor >= static_cast<int32_t>(vocab))
      return Status::errorf(StatusCode::kOutOfRange, "dspark: item {}: anchor token {} outside the vocabulary of {}", i,
                            it.anchor, vocab);
    if (it.anchor >= 0) DSV4_TRY(refuse_image_tokens(config_, std::span<const int32_t>(&it.anchor, 1))
                                     .with_context(fmt::format("dspark: item {}", i)));
    seeds.push_back({it.sequence, static_cast<int64_t>(seed_tokens.size()), n, pos});
    seed_tokens.insert(seed_tokens.end(), static_cast<size_t>(n), 0);  // rows carry no token
    hidden.insert(hidden.end(), it.main_hidden.begin(), it.main_hidden.end());
    if (it.anchor >= 0) {
      // The block sits after the last seeded row: its RoPE positions only, nothing is stored.
      drafts.push_back({it.sequence, static_cast<int64_t>(draft_tokens.size()), block, pos + n});
      draft_tokens.push_back(it.anchor);
      draft_tokens.insert(draft_tokens.end(), static_cast<size_t>(block - 1), static_cast<int32_t>(ds.noise_token_id));
    }
  }
  const ForwardPass fp{config_, plan_, *weights_, options_, *backend_, *cache_, trace, steering()};
  backend_->begin_step();
  DSV4_ASSIGN_OR_RETURN(Step seed_step, fp.make_step(seeds, seed_tokens));
  DSV4_ASSIGN_OR_RETURN(Tensor main_hidden, fp.f32({seed_step.rows.n, width}));
  DSV4_TRY(backend_->upload(main_hidden, hidden.data(), hidden.size() * sizeof(float)));
  DSV4_TRY(fp.dspark_seed(main_hidden, seed_step).status());
  for (const StepItem& it : seeds) it.seq->mtp_position_ += it.n;

  std::vector<DsparkDraft> out(batch.size());
  if (drafts.empty()) return out;
  DSV4_ASSIGN_OR_RETURN(Step step, fp.make_step(drafts, draft_tokens));
  V41Step v41;
  ForwardPass draft_fp = fp;
  draft_fp.v41 = &v41;
  DSV4_ASSIGN_OR_RETURN(ForwardPass::DsparkOut drafted, draft_fp.dspark_draft(step));
  std::vector<float> logits(static_cast<size_t>(step.rows.n * vocab));
  DSV4_TRY(backend_->download(drafted.logits, logits.data(), logits.size() * sizeof(float)));

  // The Markov head walks each block left to right: slot i adds the bias of the token
  // before it (the anchor, then the previous greedy draft) and its embedding feeds the
  // confidence head with the slot's pre-norm hidden.
  const int64_t m = static_cast<int64_t>(drafts.size());
  std::vector<int32_t> prev(m);
  for (int64_t k = 0; k < m; ++k) prev[k] = draft_tokens[drafts[k].row0];
  std::vector<std::vector<int32_t>> tokens(m);
  std::vector<std::vector<float>> confidence(m);
  std::vector<float> bias(static_cast<size_t>(m * vocab)), conf(m);
  for (int64_t i = 0; i < block; ++i) {
    DSV4_ASSIGN_OR_RETURN(Tensor ids, fp.upload_i32(prev, {m}));
    DSV4_ASSIGN_OR_RETURN(Tensor embed, fp.f32({m, rank}));
    DSV4_TRY(backend_->get_rows(weights_->dspark.markov_embd, ids, embed));
    DSV4_ASSIGN_OR_RETURN(Tensor b, fp.f32({m, vocab}));
    DSV4_TRY(backend_->matmul(weights_->dspark.markov_head, embed, b, fp.v41_exact()));
    std::vector<int32_t> slot_rows(m);
    for (int64_t k = 0; k < m; ++k) slot_rows[k] = static_cast<int32_t>(drafts[k].row0 + i);
    DSV4_ASSIGN_OR_RETURN(Tensor rows_t, fp.upload_i32(slot_rows, {m}));
    DSV4_ASSIGN_OR_RETURN(Tensor joined, fp.f32({m, d + rank}));
    DSV4_ASSIGN_OR_RETURN(Tensor h, fp.f32({m, d}));
    DSV4_TRY(backend_->get_rows(drafted.h, rows_t, h));
    DSV4_TRY(backend_->copy_rows(h, joined.columns(0, d)));
    DSV4_TRY(backend_->copy_rows(embed, joined.columns(d, rank)));
    DSV4_ASSIGN_OR_RETURN(Tensor c, fp.f32({m, 1}));
    DSV4_TRY(backend_->matmul(weights_->dspark.conf_proj, joined, c, fp.v41_exact()));
    DSV4_TRY(backend_->download(b, bias.data(), bias.size() * sizeof(float)));
    DSV4_TRY(backend_->download(c, conf.data(), conf.size() * sizeof(float)));
    for (int64_t k = 0; k < m; ++k) {
      float* row = logits.data() + (drafts[k].row0 + i) * vocab;
      int32_t best = 0;  // greedy: the lowest id among equal maxima
      for (int64_t v = 0; v < vocab; ++v) {
        row[v] += bias[k * vocab + v];
        if (row[v] > row[best]) best = static_cast<int32_t>(v);
      }
      prev[k] = best;
      tokens[k].push_back(best);
      confidence[k].push_back(conf[k]);
    }
  }
  for (size_t i = 0, k = 0; i < batch.size(); ++i) {
    if (batch[i].anchor < 0) continue;
    DsparkDraft& o = out[i];
    o.tokens = std::move(tokens[k]);
    o.confidence = std::move(confidence[k]);
    const float* first = logits.data() + drafts[k].row0 * vocab;
    o.logits.assign(first, first + block * vocab);
    ++k;
  }
  return out;
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
