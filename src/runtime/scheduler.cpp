#include "runtime/scheduler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <optional>

namespace dsv4::runtime {
namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

// Per-request state: what the request has (tokens: prompt then generated), how its text
// is turned into events, and where its sequence is.
struct Scheduler::Active {
  Active(const text::Tokenizer& tok, RequestSpec s)
      : spec(std::move(s)), sampler(spec.sampling), decoder(tok), stops(spec.stop_strings) {}

  std::shared_ptr<RequestHandle> handle;
  RequestSpec spec;
  uint64_t id = 0;
  std::vector<int32_t> tokens;
  int64_t prompt_len = 0;
  int64_t max_tokens = 0;
  uint64_t plan_bytes = 0;
  Sampler sampler;
  text::StreamDecoder decoder;
  StopStringMatcher stops;
  std::optional<text::OutputParser> parser;
  std::optional<GrammarMatcher> grammar;
  std::vector<int32_t> plan;  // tokens that complete the grammar from its state
  bool plan_valid = false;
  int64_t eos_reserve = 0;
  std::shared_ptr<CacheEntry> entry;  // while running
  bool admitted = false;
  bool done = false;
  int64_t cached = 0, generated = 0, reasoning_tokens = 0;
  bool in_reasoning = false;
  uint64_t last_served = 0;  // step of its last prefill chunk (round-robin)
  std::vector<int32_t> generated_ids;
  std::vector<TokenLogprob> pending_logprobs;
  Clock::time_point submitted, last_token;
  double ttft = -1;
  // Speculative decoding: whether this request may draft (no grammar, no log-probabilities),
  // whether its MTP block has taken every input before mtp_streams, and those: the trunk's
  // final streams at positions seq->mtp_position() .. seq->position() - 1 (the next token
  // of position p is tokens[p + 1]). draft keeps k, the acceptance and the counts.
  bool spec_eligible = false;
  bool mtp_ready = false;
  std::vector<float> mtp_streams;
  SpecSequence draft;
  uint64_t spec_step = 0;  // the step that last verified for it
};

Scheduler::Scheduler(const Model& model, const text::Tokenizer& tokenizer, SchedulerOptions options)
    : model_(model), tok_(tokenizer), opt_(std::move(options)) {
  if (opt_.max_context == 0) opt_.max_context = model_.config().context_length;
  footprint_ = opt_.prefix.graft ? opt_.prefix.graft->footprint : 0;
  token_room_ = std::max<int64_t>(0, static_cast<int64_t>(opt_.max_context) - footprint_);
  budget_ = std::make_shared<CacheBudget>(opt_.kv_budget ? opt_.kv_budget : std::numeric_limits<uint64_t>::max() / 2);
  if (opt_.speculative && (!model_.has_mtp() || opt_.prefix.graft)) opt_.speculative.reset();
  opt_.prefix.with_mtp = opt_.speculative.has_value();
  if (opt_.speculative) {
    spec_ = std::make_unique<SpeculativeDecoder>(model_, *opt_.speculative);
  }
  prefix_ = std::make_unique<PrefixCache>(model_, budget_, opt_.max_context, opt_.prefix);
  vocab_ = VocabTrie::build(tok_);
  think_end_ = tok_.find_token(text::kThinkEndText).value_or(-1);
  metrics_.cache_bytes_limit = opt_.kv_budget;
  if (!opt_.prefix.persist_dir.empty())
    (void)replay_.load((std::filesystem::path(opt_.prefix.persist_dir) / "replay.json").string(), opt_.prefix.identity);
}

Scheduler::~Scheduler() { stop(); }

std::shared_ptr<RequestHandle> Scheduler::submit(RequestSpec spec, Rejection* rejected) {
  auto reject = [&](Status s, int retry = 0) -> std::shared_ptr<RequestHandle> {
    if (rejected) *rejected = {std::move(s), retry};
    std::lock_guard<std::mutex> lock(mu_);
    ++metrics_.requests_rejected;
    return nullptr;
  };
  const size_t vocab = model_.config().vocab_size;
  if (stopping_.load()) return reject(Status::error(StatusCode::kCancelled, "the server is shutting down"));
  if (spec.prompt.empty()) return reject(Status::error("the prompt is empty"));
  for (int32_t t : spec.prompt)
    if (t < 0 || static_cast<size_t>(t) >= vocab)
      return reject(Status::errorf("prompt token {} is outside the vocabulary [0, {})", t, vocab));
  if (Status s = spec.sampling.validate(vocab); !s.is_ok()) return reject(s);
  if (spec.steering_alpha) {
    if (!model_.steering())
      return reject(Status::error("dsv4.glp_alpha: no steering file is bound (dsv4 serve --glp FILE)"));
    if (!std::isfinite(*spec.steering_alpha) || std::fabs(*spec.steering_alpha) > kMaxSteeringAlpha)
      return reject(Status::errorf("dsv4.glp_alpha = {} must be finite with |alpha| <= {}", *spec.steering_alpha,
                                   kMaxSteeringAlpha));
  }
  const int64_t ctx = token_room_, n = static_cast<int64_t>(spec.prompt.size());
  if (n >= ctx)
    return reject(Status::errorf(StatusCode::kOutOfRange,
                                 "the prompt has {} tokens and the context holds {}{} (dsv4 serve --ctx), leaving no "
                                 "room to generate", n, ctx,
                                 footprint_ ? fmt::format(" after the KV graft's {}", footprint_) : std::string()));
  if (spec.max_tokens < -1) return reject(Status::errorf("max_tokens = {} must be >= 0", spec.max_tokens));
  const int64_t max_tokens = spec.max_tokens < 0 ? ctx - n : spec.max_tokens;
  const int64_t need = footprint_ + std::min(ctx, n + max_tokens);
  auto plan = CachePlan::compute(model_.config(), static_cast<uint64_t>(need), spec_ != nullptr);
  if (!plan.is_ok()) return reject(plan.status());
  if (opt_.kv_budget && plan->total() > opt_.kv_budget)
    return reject(Status::errorf(StatusCode::kInvalidArgument,
                                 "the request needs {} bytes of KV cache for {} tokens (prompt {} + max_tokens {}), "
                                 "more than the server's whole budget of {} bytes (dsv4 serve --kv-budget): send a "
                                 "shorter prompt or a smaller max_tokens", plan->total(), need, n, need - n,
                                 opt_.kv_budget));
  auto r = std::make_unique<Active>(tok_, std::move(spec));
  r->tokens = r->spec.prompt;
  r->prompt_len = n;
  r->max_tokens = max_tokens;
  r->plan_bytes = plan->total();
  r->submitted = Clock::now();
  r->in_reasoning = r->spec.thinking == text::ThinkingMode::kThinking;
  if (r->spec.parse_output) r->parser.emplace(r->spec.thinking, r->spec.tools);
  if (r->spec.grammar) r->grammar.emplace(r->spec.grammar, vocab_);
  r->spec_eligible = spec_ && !r->spec.grammar && r->spec.top_logprobs < 0;
  if (r->spec_eligible) {
    r->draft.k = spec_->options().max_k;
    r->draft.acceptance_ema = 0.8;  // as SpeculativeDecoder::start
  }
  std::shared_ptr<RequestHandle> handle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t queued = incoming_.size() + metrics_.queue_depth;
    if (queued >= opt_.max_queue) {
      const double wait = ema_request_seconds_ * (1.0 + static_cast<double>(queued) / std::max<size_t>(opt_.max_seqs, 1));
      const int retry = static_cast<int>(std::clamp(std::ceil(wait), 1.0, 600.0));
      ++metrics_.requests_rejected;
      if (rejected)
        *rejected = {Status::errorf(StatusCode::kResourceExhausted,
                                    "the server's queue is full ({} requests waiting, dsv4 serve --max-queue {}); "
                                    "retry in about {} s", queued, opt_.max_queue, retry),
                     retry};
      return nullptr;
    }
    r->id = next_id_++;
    handle = std::make_shared<RequestHandle>(r->id);
    r->handle = handle;
    incoming_.push_back(std::move(r));
  }
  wake_.notify_all();
  return handle;
}

bool Scheduler::fits_now(const Active& r) const {
  if (!opt_.kv_budget) return true;
  uint64_t committed = 0;
  for (const auto& x : running_)
    if (x->entry) committed += x->entry->seq->committed_bytes() + x->entry->snapshot_bytes;
  return committed + r.plan_bytes <= opt_.kv_budget;
}

bool Scheduler::admit() {
  std::stable_sort(waiting_.begin(), waiting_.end(), [](const auto& a, const auto& b) {
    return a->spec.priority != b->spec.priority ? a->spec.priority > b->spec.priority : a->id < b->id;
  });
  bool any = false;
  while (running_.size() < opt_.max_seqs && !waiting_.empty()) {
    Active& r = *waiting_.front();
    if (!fits_now(r)) break;
    auto lease = prefix_->acquire(
        r.tokens, r.spec.steering_alpha ? *r.spec.steering_alpha : (model_.steering() ? model_.steering()->alpha : 0.0f));
    if (!lease.is_ok()) {
      if (lease.status().code() == StatusCode::kResourceExhausted) break;
      finish(r, FinishReason::kEos, lease.status());
      waiting_.pop_front();
      continue;
    }
    r.entry = lease->entry;
    // The MTP block can draft for this sequence only when it has taken every input so far
    // or the entry kept the ones it has not (CacheEntry::mtp_streams).
    r.mtp_ready = false;
    r.mtp_streams.clear();
    if (r.spec_eligible) {
      const Sequence& seq = *r.entry->seq;
      const size_t width = size_t{model_.config().hc_mult} * model_.config().hidden;
      const auto rows = static_cast<int64_t>(r.entry->mtp_streams.size() / width);
      if (seq.position() == 0) {
        r.mtp_ready = true;
      } else if (r.entry->mtp_streams_end == seq.position() && seq.mtp_position() + rows == seq.position() &&
                 static_cast<size_t>(rows) * width == r.entry->mtp_streams.size()) {
        r.mtp_ready = true;
        r.mtp_streams = std::move(r.entry->mtp_streams);
      }
    }
    r.entry->mtp_streams.clear();
    r.entry->mtp_streams_end = -1;
    if (!r.admitted) {
      r.admitted = true;
      r.cached = lease->reused;
      std::lock_guard<std::mutex> lock(mu_);
      ++metrics_.requests_started;
      metrics_.prompt_tokens += static_cast<uint64_t>(r.prompt_len);
      metrics_.cached_prompt_tokens += static_cast<uint64_t>(std::min(r.cached, r.prompt_len));
    }
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
    any = true;
  }
  return any;
}

void Scheduler::emit_text(Active& r, std::string_view text, RequestEvent& ev) {
  if (text.empty()) return;
  ev.text.append(text);
  if (!r.parser) return;
  const text::OutputDelta d = r.parser->push(text);
  ev.parsed.reasoning += d.reasoning;
  ev.parsed.content += d.content;
  ev.parsed.tool_calls.insert(ev.parsed.tool_calls.end(), d.tool_calls.begin(), d.tool_calls.end());
}

void Scheduler::finish(Active& r, FinishReason why, Status error) {
  if (r.done) return;
  r.done = true;
  RequestEvent ev;
  if (why != FinishReason::kStopString && error.is_ok()) {
    bool matched = false;
    emit_text(r, r.stops.push(r.decoder.flush(), matched), ev);
    if (!matched) emit_text(r, r.stops.flush(), ev);
  }
  if (r.parser) {
    const text::OutputDelta d = r.parser->finish();
    ev.parsed.reasoning += d.reasoning;
    ev.parsed.content += d.content;
    ev.parsed.tool_calls.insert(ev.parsed.tool_calls.end(), d.tool_calls.begin(), d.tool_calls.end());
    ev.result = r.parser->result();
  }
  ev.done = true;
  ev.finish = why;
  ev.error = std::move(error);
  ev.usage = {r.prompt_len, std::min(r.cached, r.prompt_len), r.generated, r.reasoning_tokens};
  ev.tokens = r.generated_ids;
  ev.generated_text = tok_.decode(r.generated_ids);
  ev.time_to_first_token = std::max(r.ttft, 0.0);
  ev.logprobs = std::move(r.pending_logprobs);
  const bool failed = !ev.error.is_ok();
  r.handle->push(std::move(ev));
  if (r.entry && r.mtp_ready && !failed) {  // a later request may draft from here on
    r.entry->mtp_streams = std::move(r.mtp_streams);
    r.entry->mtp_streams_end = r.entry->seq->position();
  }
  if (r.entry) {
    if (failed) prefix_->discard(r.entry);
    else prefix_->release(r.entry);
    r.entry.reset();
  }
  std::lock_guard<std::mutex> lock(mu_);
  ++metrics_.requests_finished;
  if (failed) ++metrics_.requests_failed;
  if (why == FinishReason::kCancelled) ++metrics_.requests_cancelled;
  ema_request_seconds_ = 0.8 * ema_request_seconds_ + 0.2 * seconds(Clock::now() - r.submitted);
}

void Scheduler::preempt(Active& r) {
  prefix_->discard(r.entry);
  r.entry.reset();
  std::lock_guard<std::mutex> lock(mu_);
  ++metrics_.preemptions;
}

void Scheduler::sample(Active& r, std::span<const float> row) {
  if (r.generated >= r.max_tokens) return finish(r, FinishReason::kLength);
  // Tokens that may still come, this one included.
  const int64_t budget = std::min<int64_t>(r.max_tokens - r.generated,
                                           token_room_ - static_cast<int64_t>(r.tokens.size()));
  const int32_t eos = tok_.eos_id();
  int32_t t = 0;
  if (r.grammar && r.grammar->must_end()) {
    t = eos;
  } else if (r.grammar) {
    // Keep "a plan that completes the grammar fits in the tokens left": take the sampled
    // token when the plan after it still fits, else the plan's next token.
    // One token stays for the EOS after the grammar ends, when there is room for it.
    if (!r.plan_valid) {
      r.plan = r.grammar->plan();
      r.plan_valid = true;
      r.eos_reserve = static_cast<int64_t>(r.plan.size()) + 1 <= budget ? 1 : 0;
    }
    const int64_t room = budget - r.eos_reserve;
    bool follow_plan = !r.plan.empty() && static_cast<int64_t>(r.plan.size()) >= room;
    if (!follow_plan) {
      t = r.sampler.sample(row);
      if (!r.grammar->accepts(t)) {
        std::vector<uint8_t> mask;
        r.grammar->allowed(mask);
        std::vector<float> masked(row.begin(), row.end());
        for (size_t i = 0; i < masked.size(); ++i)
          if (i >= mask.size() || !mask[i]) masked[i] = -std::numeric_limits<float>::infinity();
        t = r.sampler.sample(masked);
        if (!r.grammar->accepts(t)) follow_plan = true;  // nothing allowed has a finite logit
      }
      if (!follow_plan && t != eos) {
        GrammarMatcher after = *r.grammar;
        std::vector<int32_t> next;
        if (after.advance(t).is_ok()) next = after.plan();
        if (after.failed() || static_cast<int64_t>(next.size()) > std::max<int64_t>(room - 1, 0)) follow_plan = true;
        else r.plan = std::move(next);
      }
    }
    if (follow_plan && r.plan.empty() && r.grammar->can_end()) {
      t = eos;
    } else if (follow_plan) {
      if (r.plan.empty())
        return finish(r, FinishReason::kLength,
                      Status::errorf(StatusCode::kInternal, "the output grammar cannot be completed within {} tokens", budget));
      t = r.plan.front();
      r.plan.erase(r.plan.begin());
    }
  } else {
    t = r.sampler.sample(row);
  }
  if (r.spec.top_logprobs >= 0) {
    float mx = -std::numeric_limits<float>::infinity();
    for (float x : row) mx = std::max(mx, x);
    double sum = 0;
    for (float x : row) sum += std::exp(static_cast<double>(x) - mx);
    const float lse = mx + static_cast<float>(std::log(sum));
    TokenLogprob lp{t, row[t] - lse, {}};
    const size_t k = std::min<size_t>(static_cast<size_t>(r.spec.top_logprobs), row.size());
    std::vector<int32_t> idx(row.size());
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int32_t>(i);
    std::partial_sort(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(k), idx.end(),
                      [&](int32_t a, int32_t b) { return row[a] != row[b] ? row[a] > row[b] : a < b; });
    for (size_t i = 0; i < k; ++i) lp.top.push_back({idx[i], row[idx[i]] - lse});
    r.pending_logprobs.push_back(std::move(lp));
  }
  commit(r, t);
}

void Scheduler::commit(Active& r, int32_t t) {
  const auto now = Clock::now();
  const int32_t eos = tok_.eos_id();
  ++r.generated;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++metrics_.generated_tokens;
    if (r.ttft < 0) {
      r.ttft = seconds(now - r.submitted);
      metrics_.time_to_first_token.observe(r.ttft);
    } else {
      metrics_.time_per_output_token.observe(seconds(now - r.last_token));
    }
  }
  r.last_token = now;
  if (r.in_reasoning) ++r.reasoning_tokens;
  const bool stop_token = std::find(r.spec.stop_tokens.begin(), r.spec.stop_tokens.end(), t) != r.spec.stop_tokens.end();
  if (t == eos || stop_token) return finish(r, t == eos ? FinishReason::kEos : FinishReason::kStopToken);
  if (r.grammar) {
    if (Status s = r.grammar->advance(t); !s.is_ok()) return finish(r, FinishReason::kLength, s);
  }
  if (t == think_end_) r.in_reasoning = false;
  r.sampler.accept(t);
  r.tokens.push_back(t);
  r.generated_ids.push_back(t);
  RequestEvent ev;
  ev.usage = {r.prompt_len, std::min(r.cached, r.prompt_len), r.generated, r.reasoning_tokens};
  bool matched = false;
  emit_text(r, r.stops.push(r.decoder.push(t), matched), ev);
  if (matched) {
    if (!ev.text.empty() || !ev.parsed.tool_calls.empty()) r.handle->push(std::move(ev));
    return finish(r, FinishReason::kStopString);
  }
  if (r.generated >= r.max_tokens || static_cast<int64_t>(r.tokens.size()) >= token_room_) {
    if (!ev.text.empty()) r.handle->push(std::move(ev));
    return finish(r, r.generated >= r.max_tokens ? FinishReason::kLength : FinishReason::kContextFull);
  }
  ev.logprobs = std::move(r.pending_logprobs);
  r.pending_logprobs.clear();
  if (!ev.text.empty() || !ev.logprobs.empty()) r.handle->push(std::move(ev));
}

bool Scheduler::step() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    while (!incoming_.empty()) {
      waiting_.push_back(std::move(incoming_.front()));
      incoming_.pop_front();
    }
  }
  // Cancellations first: a client that went away frees its sequence now.
  for (auto& r : running_)
    if (r->handle->cancelled()) finish(*r, FinishReason::kCancelled);
  for (auto& r : waiting_)
    if (r->handle->cancelled()) finish(*r, FinishReason::kCancelled);
  auto sweep = [&] {
    std::erase_if(running_, [](const auto& r) { return r->done; });
    std::erase_if(waiting_, [](const auto& r) { return r->done; });
  };
  sweep();
  admit();
  if (running_.empty()) {
    update_metrics();
    return false;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++metrics_.steps;
  }
  const uint64_t step_no = metrics_.steps;

  struct Item {
    Active* r;
    int64_t pos, n;
  };
  // Speculating requests: the request and the most drafts its rows may take.
  std::vector<Active*> spec_rs;
  std::vector<int> spec_k;
  auto speculates = [&](const Active& r) { return spec_ && r.spec_eligible && r.mtp_ready; };
  auto build = [&](bool with_spec) {
    std::vector<Active*> order;
    for (auto& r : running_)
      if (!r->done && r->entry && r->spec_step != step_no) order.push_back(r.get());
    std::sort(order.begin(), order.end(), [](const Active* a, const Active* b) {
      return a->spec.priority != b->spec.priority ? a->spec.priority > b->spec.priority : a->id < b->id;
    });
    std::vector<Item> items;
    int64_t left = opt_.batch_tokens;
    std::vector<Active*> prefill;
    for (Active* r : order) {
      const int64_t pos = tokens_in(*r->entry->seq), pending = static_cast<int64_t>(r->tokens.size()) - pos;
      if (pending == 1 && left > 0 && with_spec && speculates(*r)) {
        // k + 1 rows; no draft past max_tokens (the last token of a step is not a draft) or
        // the context.
        const int64_t k = std::min({left - 1, r->max_tokens - r->generated - 1,
                                    token_room_ - static_cast<int64_t>(r->tokens.size()) - 1,
                                    int64_t{spec_->options().max_k}});
        spec_rs.push_back(r);
        spec_k.push_back(static_cast<int>(std::max<int64_t>(k, 0)));
        left -= spec_k.back() + 1;
      } else if (pending == 1 && left > 0 && !speculates(*r)) {
        items.push_back({r, pos, 1});
        --left;
      } else if (pending > 1) {
        prefill.push_back(r);
      }
    }
    std::stable_sort(prefill.begin(), prefill.end(), [](const Active* a, const Active* b) {
      return a->spec.priority != b->spec.priority ? a->spec.priority > b->spec.priority : a->last_served < b->last_served;
    });
    for (Active* r : prefill) {
      if (left <= 0) break;
      const int64_t pos = tokens_in(*r->entry->seq);
      const int64_t want = pos + std::min<int64_t>(left, static_cast<int64_t>(r->tokens.size()) - pos);
      const int64_t end = prefix_->chunk_end(*r->entry, want, r->prompt_len);
      items.push_back({r, pos, end - pos});
      left -= end - pos;
      r->last_served = step_no;
    }
    return items;
  };

  std::vector<Item> items = build(true);
  // The speculating requests first, in one verify forward; refused for memory, they join
  // the plain batch below (without drafts from now on), where memory is made.
  if (!spec_rs.empty() && !speculate(spec_rs, spec_k, step_no)) items = build(false);
  ForwardOutput out;
  for (;;) {
    if (items.empty()) break;
    std::vector<BatchItem> batch;
    for (const Item& it : items)
      batch.push_back({it.r->entry->seq.get(), std::span<const int32_t>(it.r->tokens).subspan(it.pos, it.n), false,
                       speculates(*it.r)});
    Status s = model_.forward(batch, out);
    if (s.is_ok()) break;
    if (s.code() != StatusCode::kResourceExhausted) {
      for (const Item& it : items) finish(*it.r, FinishReason::kEos, s);
      items.clear();
      break;
    }
    if (prefix_->evict_one() || prefix_->drop_snapshots()) continue;
    // Preempt the lowest-priority, youngest running request; the last one standing fails.
    Active* victim = nullptr;
    size_t live = 0;
    for (auto& r : running_) {
      if (r->done || !r->entry) continue;
      ++live;
      if (!victim || r->spec.priority < victim->spec.priority ||
          (r->spec.priority == victim->spec.priority && r->id > victim->id))
        victim = r.get();
    }
    if (!victim) break;
    if (live == 1) {
      finish(*victim, FinishReason::kEos,
             Status::errorf(StatusCode::kResourceExhausted, "the KV budget ({} bytes) is exhausted: {}", opt_.kv_budget,
                            s.message()));
    } else {
      preempt(*victim);
    }
    items = build(false);
  }
  // Preempted requests go back to the queue (their order there is by priority and age).
  for (auto& r : running_)
    if (!r->done && !r->entry) waiting_.push_back(std::move(r));
  std::erase_if(running_, [](const auto& r) { return !r; });

  // The MTP block's inputs of the computed positions, before any request can finish.
  const size_t width = size_t{model_.config().hc_mult} * model_.config().hidden;
  size_t stream_row = 0;
  std::vector<Active*> feed;
  for (const Item& it : items) {
    if (!speculates(*it.r)) continue;
    const auto* first = out.streams.data() + stream_row * width;
    stream_row += static_cast<size_t>(it.n);
    if (it.r->done) continue;
    it.r->mtp_streams.insert(it.r->mtp_streams.end(), first, first + it.n * width);
    feed.push_back(it.r);
  }
  if (!feed.empty()) feed_mtp(feed);

  const size_t vocab = model_.config().vocab_size;
  for (size_t i = 0; i < items.size(); ++i) {
    Active& r = *items[i].r;
    if (r.done) continue;
    r.entry->tokens.insert(r.entry->tokens.end(), r.tokens.begin() + items[i].pos,
                           r.tokens.begin() + items[i].pos + items[i].n);
    prefix_->on_advance(*r.entry, r.prompt_len);
    {
      std::lock_guard<std::mutex> lock(mu_);
      metrics_.computed_tokens += static_cast<uint64_t>(items[i].n);
    }
    if (tokens_in(*r.entry->seq) == static_cast<int64_t>(r.tokens.size()))
      sample(r, std::span<const float>(out.logits).subspan(i * vocab, vocab));
  }
  sweep();
  update_metrics();
  return true;
}

void Scheduler::feed_mtp(std::span<Active* const> rs) {
  const size_t width = size_t{model_.config().hc_mult} * model_.config().hidden;
  std::vector<MtpItem> batch;
  std::vector<Active*> fed;
  for (Active* r : rs) {
    const Sequence& seq = *r->entry->seq;
    const int64_t rows = static_cast<int64_t>(r->mtp_streams.size() / width);
    if (rows != seq.position() - seq.mtp_position()) {  // not expected: decode this one plainly
      r->mtp_ready = false;
      r->mtp_streams.clear();
      continue;
    }
    if (rows < 2) continue;  // the last input waits for the step that drafts from it
    const int64_t m = seq.mtp_position();
    batch.push_back({r->entry->seq.get(), std::span<const float>(r->mtp_streams).first((rows - 1) * width),
                     std::span<const int32_t>(r->tokens).subspan(m + 1, rows - 1)});
    fed.push_back(r);
  }
  if (batch.empty()) return;
  auto drafts = model_.mtp(batch);
  for (Active* r : fed) {
    if (!drafts.is_ok()) {  // the MTP block's state is unknown now: no drafts for these
      r->mtp_ready = false;
      r->mtp_streams.clear();
      continue;
    }
    r->mtp_streams.erase(r->mtp_streams.begin(), r->mtp_streams.end() - static_cast<std::ptrdiff_t>(width));
  }
}

bool Scheduler::speculate(std::span<Active* const> rs, std::span<const int> k, uint64_t step_no) {
  std::vector<SpecSequence*> seqs;
  std::vector<int64_t> base;
  std::vector<int> wanted, plain_steps;
  std::vector<SpecStats> before;
  for (size_t i = 0; i < rs.size(); ++i) {
    Active& r = *rs[i];
    Sequence& seq = *r.entry->seq;
    SpecSequence& d = r.draft;
    d.sequence = &seq;
    d.sampler = r.sampler;
    d.pending = r.tokens.back();
    d.mtp_streams = std::move(r.mtp_streams);
    d.mtp_tokens.assign(r.tokens.begin() + seq.mtp_position() + 1, r.tokens.begin() + seq.position() + 1);
    wanted.push_back(d.k);
    plain_steps.push_back(d.plain_steps);
    d.k = std::min(d.k, k[i]);
    base.push_back(seq.position());
    before.push_back(d.stats);
    seqs.push_back(&d);
  }
  std::vector<std::vector<int32_t>> emitted;
  const Status st = spec_->step(seqs, emitted);
  if (!st.is_ok()) {
    bool refused = st.code() == StatusCode::kResourceExhausted;
    for (size_t i = 0; i < rs.size(); ++i) refused = refused && rs[i]->entry->seq->position() == base[i];
    for (size_t i = 0; i < rs.size(); ++i) {
      Active& r = *rs[i];
      r.mtp_ready = false;  // the MTP block may have taken drafts: its state is unknown
      r.mtp_streams.clear();
      r.draft.mtp_streams.clear();
      if (!refused) finish(r, FinishReason::kEos, st);
    }
    return refused;
  }
  for (size_t i = 0; i < rs.size(); ++i) {
    Active& r = *rs[i];
    SpecSequence& d = r.draft;
    // A k cut to 0 by this step's limits (not by the acceptance) leaves the adaptive k be.
    if (wanted[i] > 0 && k[i] == 0) {
      d.k = wanted[i];
      d.plain_steps = plain_steps[i];
    }
    r.spec_step = step_no;
    r.mtp_streams = std::move(d.mtp_streams);
    // The trunk took the pending token and the accepted drafts; the last token is pending.
    const std::vector<int32_t>& e = emitted[i];
    r.entry->tokens.push_back(r.tokens.back());
    r.entry->tokens.insert(r.entry->tokens.end(), e.begin(), e.end() - 1);
    prefix_->on_advance(*r.entry, r.prompt_len);
    {
      std::lock_guard<std::mutex> lock(mu_);
      metrics_.computed_tokens += static_cast<uint64_t>(d.stats.drafted - before[i].drafted + 1);
      metrics_.spec_steps += 1;
      metrics_.spec_drafted += static_cast<uint64_t>(d.stats.drafted - before[i].drafted);
      metrics_.spec_accepted += static_cast<uint64_t>(d.stats.accepted - before[i].accepted);
    }
    for (int32_t t : e) {
      if (r.generated >= r.max_tokens) {
        finish(r, FinishReason::kLength);
        break;
      }
      commit(r, t);
      if (r.done) break;
    }
  }
  return true;
}

void Scheduler::update_metrics() {
  const PrefixCacheStats ps = prefix_->stats();
  std::lock_guard<std::mutex> lock(mu_);
  metrics_.queue_depth = waiting_.size();
  metrics_.running = running_.size();
  metrics_.cache_bytes_used = budget_->used();
  metrics_.prefix = ps;
  metrics_.replayed_turns = replay_.replayed_turns();
}

SchedulerMetrics Scheduler::metrics() const {
  std::lock_guard<std::mutex> lock(mu_);
  SchedulerMetrics m = metrics_;
  m.queue_depth += incoming_.size();
  return m;
}

void Scheduler::start() {
  if (thread_.joinable()) return;
  stopping_ = false;
  thread_ = std::thread([this] {
    while (!stopping_.load()) {
      if (step()) continue;
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait_for(lock, std::chrono::milliseconds(20), [&] { return stopping_.load() || !incoming_.empty(); });
    }
  });
}

void Scheduler::cancel_all(const Status& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    while (!incoming_.empty()) {
      waiting_.push_back(std::move(incoming_.front()));
      incoming_.pop_front();
    }
  }
  for (auto& r : running_) finish(*r, FinishReason::kCancelled, why);
  for (auto& r : waiting_) finish(*r, FinishReason::kCancelled, why);
  running_.clear();
  waiting_.clear();
}

void Scheduler::stop() {
  stopping_ = true;
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  cancel_all(Status::error(StatusCode::kCancelled, "the server is shutting down"));
  (void)prefix_->persist_all();
  if (!opt_.prefix.persist_dir.empty())
    (void)replay_.save((std::filesystem::path(opt_.prefix.persist_dir) / "replay.json").string(), opt_.prefix.identity);
  update_metrics();
}

}  // namespace dsv4::runtime
