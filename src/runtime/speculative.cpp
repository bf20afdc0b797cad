#include "runtime/speculative.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "backend/sampling.h"

namespace dsv4::runtime {
namespace {

// What each uniform of a step is for: independent draws for the same position.
enum Purpose : int { kDraftDraw = 0, kAcceptTest = 1, kResidualDraw = 2, kBonusDraw = 3, kFirstDraw = 4 };

// Inverse-CDF draw in id order from unnormalised non-negative weights.
int32_t draw(std::span<const double> w, double u) {
  double total = 0;
  int32_t last = -1;
  for (size_t i = 0; i < w.size(); ++i)
    if (w[i] > 0) {
      total += w[i];
      last = static_cast<int32_t>(i);
    }
  const double target = u * total;
  double acc = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    if (w[i] <= 0) continue;
    acc += w[i];
    if (acc > target) return static_cast<int32_t>(i);
  }
  return last;
}

// The sampler's distribution on one logits row, dense over the vocabulary.
std::vector<double> dense(const Sampler& sampler, std::span<const float> logits) {
  std::vector<double> p(logits.size(), 0.0);
  for (const TokenProb& t : sampler.distribution(logits)) p[t.id] = t.p;
  return p;
}

// The sampler after the tokens `extra` were accepted too.
Sampler with_history(const Sampler& base, std::span<const int32_t> extra) {
  Sampler s = base;
  for (int32_t t : extra) s.accept(t);
  return s;
}

double keyed_uniform(const Sampler& s, int64_t position, int purpose) {
  return backend::sample_uniform(s.params().seed, static_cast<uint64_t>(position), 0xFFFFFF00u + purpose);
}

bool greedy(const Sampler& s) { return s.params().temperature == 0.0f; }

// Greedy without penalties or biases: the target's token is the arg-max of the raw logits,
// which the backend picks (BatchItem::greedy_rows), so no logits need to come back.
bool plain_greedy(const Sampler& s) {
  const SamplingParams& p = s.params();
  return p.temperature == 0.0f && p.repetition_penalty == 1.0f && p.presence_penalty == 0.0f &&
         p.frequency_penalty == 0.0f && p.logit_bias.empty();
}

}  // namespace

std::vector<int32_t> speculative_accept(std::span<const int32_t> drafts, std::span<const std::vector<double>> q,
                                        std::span<const std::vector<double>> p,
                                        const std::function<double(int j, int purpose)>& uniform) {
  std::vector<int32_t> out;
  const int k = static_cast<int>(drafts.size());
  for (int j = 0; j < k; ++j) {
    const int32_t d = drafts[j];
    const std::vector<double>& pj = p[j];
    // An empty q[j] is a deterministic draft: q = one-hot at d.
    const bool one_hot = q.empty() || q[j].empty();
    const double qd = one_hot ? 1.0 : q[j][d];
    if (qd > 0 && uniform(j, kAcceptTest) * qd < pj[d]) {
      out.push_back(d);
      continue;
    }
    std::vector<double> residual(pj.size());
    double mass = 0;
    for (size_t i = 0; i < pj.size(); ++i) {
      const double qi = one_hot ? (static_cast<int32_t>(i) == d ? 1.0 : 0.0) : q[j][i];
      residual[i] = std::max(0.0, pj[i] - qi);
      mass += residual[i];
    }
    out.push_back(draw(mass > 0 ? std::span<const double>(residual) : std::span<const double>(pj),
                       uniform(j, kResidualDraw)));
    return out;
  }
  out.push_back(draw(p[k], uniform(k, kBonusDraw)));
  return out;
}

SpeculativeDecoder::SpeculativeDecoder(const Model& model, SpecOptions options)
    : model_(model), options_(std::move(options)) {
  options_.max_k = std::clamp(options_.max_k, 1, 4);
}

double SpeculativeDecoder::measured_ratio(size_t batch, int k) const {
  const auto plain = step_times_.find({batch, 0}), drafted = step_times_.find({batch, k});
  if (plain == step_times_.end() || drafted == step_times_.end() || plain->second.seen < 3 ||
      drafted->second.seen < 3 || plain->second.ms <= 0)
    return 0;
  return drafted->second.ms / plain->second.ms;
}

void SpeculativeDecoder::record_step(size_t batch, int k, double ms) const {
  StepTime& t = step_times_[{batch, k}];
  ++t.seen;
  if (t.seen == 3) t.ms = ms;
  if (t.seen > 3) t.ms = 0.8 * t.ms + 0.2 * ms;
}

int SpeculativeDecoder::choose_k(const SpecSequence& s, size_t batch) const {
  if (!options_.adaptive) return options_.max_k;
  if (options_.measured_costs && s.stats.steps >= 4 && s.stats.steps % 32 < 3) {
    const auto plain = step_times_.find({batch, 0});
    if (plain == step_times_.end() || plain->second.seen < 3) return 0;  // measure a plain step
  }
  const double a = std::clamp(s.acceptance_ema, 0.0, 1.0);
  int best = 0;
  double best_rate = 1.0;  // plain decoding: one token per unit of cost
  for (int k = 1; k <= options_.max_k; ++k) {
    const double tokens = a >= 1.0 ? k + 1.0 : (1.0 - std::pow(a, k + 1)) / (1.0 - a);
    const double measured = options_.measured_costs ? measured_ratio(batch, k) : 0.0;
    const double rate = tokens / (measured > 0 ? measured : 1.0 + options_.draft_cost * k);
    if (rate > best_rate) {
      best_rate = rate;
      best = k;
    }
  }
  if (best > 0) return best;
  // Plain steps while the rates say so (the acceptance estimate does not move without
  // drafts), then one draft to probe it again.
  const int probe_after = options_.probe_every << std::min(s.failed_probes, 4);
  return s.k == 0 && s.plain_steps >= probe_after ? 1 : 0;
}

Result<int32_t> SpeculativeDecoder::start(SpecSequence& s, std::span<const int32_t> prompt) const {
  if (!s.sequence || !s.sequence->with_mtp())
    return Status::error("speculative decoding: the sequence must be created with_mtp");
  if (s.sequence->position() != 0 || prompt.empty())
    return Status::error("speculative decoding: start() takes an empty sequence and a non-empty prompt");
  if (options_.forced_draft && !greedy(s.sampler))
    return Status::error("speculative decoding: forced drafts need greedy sampling (temperature 0)");
  const BatchItem item{.sequence = s.sequence, .tokens = prompt, .keep_streams = true};
  ForwardOutput out;
  DSV4_TRY(model_.forward(std::span<const BatchItem>(&item, 1), out));
  const int64_t n = static_cast<int64_t>(prompt.size());
  const std::vector<double> p = dense(s.sampler, out.logits);
  s.pending = draw(p, keyed_uniform(s.sampler, n, kFirstDraw));
  s.sampler.accept(s.pending);
  s.mtp_streams = std::move(out.streams);
  s.mtp_tokens.assign(prompt.begin() + 1, prompt.end());
  s.mtp_tokens.push_back(s.pending);
  s.acceptance_ema = 0.8;
  s.plain_steps = 0;
  s.k = options_.max_k;
  return s.pending;
}

Status SpeculativeDecoder::step(std::span<SpecSequence* const> seqs, std::vector<std::vector<int32_t>>& emitted) const {
  const size_t n = seqs.size();
  if (n == 0) return Status::error("speculative decoding: an empty step");
  const auto t0 = std::chrono::steady_clock::now();
  const ModelConfig& c = model_.config();
  const int64_t vocab = c.vocab_size, width = int64_t{c.hc_mult} * c.hidden;
  emitted.assign(n, {});

  std::vector<int> k(n);
  std::vector<int64_t> base(n);  // P: the position of the pending token
  std::vector<std::vector<int32_t>> drafts(n);
  std::vector<std::vector<std::vector<double>>> q(n);
  std::vector<std::vector<float>> chain(n);  // the MTP block's output streams of the last draft
  // Rollback: without copies where the model allows it (Model::rewind: back to the kept
  // positions and to the MTP position after the true pairs), else by snapshot and replay.
  const bool rewind = model_.can_rewind();
  std::vector<int64_t> mtp_mark(n, 0);
  std::vector<SequenceSnapshot> snaps(n);
  int max_k = 0;
  for (size_t i = 0; i < n; ++i) {
    SpecSequence& s = *seqs[i];
    if (!s.sequence || s.pending < 0) return Status::errorf("speculative decoding: sequence {} was not started", i);
    base[i] = s.sequence->position();
    const int64_t room = static_cast<int64_t>(s.sequence->max_context()) - base[i] - 1;
    if (room < 0) return Status::errorf(StatusCode::kOutOfRange, "speculative decoding: sequence {} is full", i);
    k[i] = static_cast<int>(std::min<int64_t>(s.k, room));
    max_k = std::max(max_k, k[i]);
  }

  // The draft distribution of position base + j (or the forced token), and the draft.
  const auto propose = [&](size_t i, int j, std::span<const float> logits) {
    SpecSequence& s = *seqs[i];
    const int64_t position = base[i] + j;
    int32_t d;
    if (options_.forced_draft) {
      d = options_.forced_draft(position);
      q[i].emplace_back();
    } else {
      std::vector<double> qj = dense(with_history(s.sampler, drafts[i]), logits);
      d = draw(qj, keyed_uniform(s.sampler, position, kDraftDraw));
      q[i].push_back(greedy(s.sampler) ? std::vector<double>{} : std::move(qj));
    }
    drafts[i].push_back(d);
  };

  // Round 1: the MTP block takes its pending true pairs; the last one drafts position P + 1.
  for (int j = 1; j <= max_k; ++j) {
    std::vector<MtpItem> items;
    std::vector<size_t> who;
    for (size_t i = 0; i < n; ++i) {
      if (k[i] < j) continue;
      SpecSequence& s = *seqs[i];
      if (j == 1)
        items.push_back({s.sequence, s.mtp_streams, s.mtp_tokens});
      else
        items.push_back({s.sequence, chain[i], std::span<const int32_t>(&drafts[i][j - 2], 1)});
      who.push_back(i);
    }
    std::vector<float> out_streams;
    DSV4_ASSIGN_OR_RETURN(std::vector<float> logits, model_.mtp(items, nullptr, &out_streams));
    int64_t row = 0;
    for (size_t w = 0; w < who.size(); ++w) {
      const size_t i = who[w];
      row += static_cast<int64_t>(items[w].next_tokens.size());
      const int64_t last = row - 1;
      chain[i].assign(out_streams.begin() + last * width, out_streams.begin() + (last + 1) * width);
      propose(i, j, std::span<const float>(logits).subspan(last * vocab, vocab));
      if (j == 1) {  // the true pairs are in; the rest of the step is undone from here
        seqs[i]->mtp_streams.clear();
        seqs[i]->mtp_tokens.clear();
        mtp_mark[i] = seqs[i]->sequence->mtp_position();
        if (!rewind) {
          DSV4_ASSIGN_OR_RETURN(snaps[i], model_.snapshot(*seqs[i]->sequence));
        }
      }
    }
  }

  // Verify: the pending token and the drafts in one forward. Plain greedy sequences take
  // each row's arg-max from the backend (one graph-replayed step when every sequence has
  // the same k); otherwise the logits come back for the sampler.
  const bool argmax_rows = std::all_of(seqs.begin(), seqs.end(), [](const SpecSequence* s) { return plain_greedy(s->sampler); });
  std::vector<std::vector<int32_t>> inputs(n);
  std::vector<BatchItem> batch;
  for (size_t i = 0; i < n; ++i) {
    inputs[i].push_back(seqs[i]->pending);
    inputs[i].insert(inputs[i].end(), drafts[i].begin(), drafts[i].end());
    batch.push_back({.sequence = seqs[i]->sequence, .tokens = inputs[i], .all_logits = !argmax_rows,
                     .keep_streams = true, .greedy_rows = argmax_rows});
  }
  ForwardOutput out;
  DSV4_TRY(model_.forward(batch, out));

  std::vector<BatchItem> replay;
  std::vector<std::vector<int32_t>> kept(n);
  int64_t row0 = 0;
  for (size_t i = 0; i < n; ++i) {
    SpecSequence& s = *seqs[i];
    if (argmax_rows) {  // accept while the draft is the target's arg-max, then its arg-max
      int a = 0;
      while (a < k[i] && drafts[i][a] == out.row_tokens[row0 + a]) ++a;
      emitted[i].assign(drafts[i].begin(), drafts[i].begin() + a);
      emitted[i].push_back(out.row_tokens[row0 + a]);
    } else {
      std::vector<std::vector<double>> p;
      for (int j = 0; j <= k[i]; ++j)
        p.push_back(dense(with_history(s.sampler, std::span<const int32_t>(drafts[i]).first(j)),
                          std::span<const float>(out.logits).subspan((row0 + j) * vocab, vocab)));
      const auto uniform = [&](int j, int purpose) { return keyed_uniform(s.sampler, base[i] + 1 + j, purpose); };
      emitted[i] = speculative_accept(drafts[i], q[i], p, uniform);
    }
    const int a = static_cast<int>(emitted[i].size()) - 1;

    if (k[i] > 0 && a < k[i]) {  // rejected drafts: back to the kept positions
      if (rewind) {
        DSV4_TRY(model_.rewind(*s.sequence, base[i] + a + 1, mtp_mark[i]));
      } else {  // back to the snapshot, the kept tokens again
        DSV4_TRY(model_.restore(*s.sequence, snaps[i]));
        kept[i].assign(inputs[i].begin(), inputs[i].begin() + a + 1);
        replay.push_back({.sequence = s.sequence, .tokens = kept[i]});
      }
    } else if (k[i] > 1) {  // all accepted: only the chained drafts' MTP rows go
      if (rewind) {
        DSV4_TRY(model_.rewind(*s.sequence, s.sequence->position(), mtp_mark[i]));
      } else {
        DSV4_TRY(model_.restore_mtp(*s.sequence, snaps[i]));
      }
    }
    // The MTP block's next true pairs: streams at P .. P + a with the token after each.
    // (Appended: a sequence at k = 0 did not feed its earlier ones.)
    s.mtp_streams.insert(s.mtp_streams.end(), out.streams.begin() + row0 * width,
                         out.streams.begin() + (row0 + a + 1) * width);
    s.mtp_tokens.insert(s.mtp_tokens.end(), emitted[i].begin(), emitted[i].end());
    for (int32_t t : emitted[i]) s.sampler.accept(t);
    s.pending = emitted[i].back();

    if (k[i] > 0 && s.plain_steps > 0) s.failed_probes = a == 0 ? s.failed_probes + 1 : 0;  // a probe
    ++s.stats.steps;
    s.stats.drafted += k[i];
    s.stats.accepted += a;
    s.stats.emitted += a + 1;
    if (k[i] > 0) {
      const double examined = std::min(a + 1, k[i]);
      s.acceptance_ema = 0.7 * s.acceptance_ema + 0.3 * (a / examined);
      s.plain_steps = 0;
    } else {
      ++s.plain_steps;
    }
    row0 += k[i] + 1;
  }
  if (!replay.empty()) {
    ForwardOutput ignored;
    DSV4_TRY(model_.forward(replay, ignored));
  }
  if (options_.measured_costs && std::all_of(k.begin(), k.end(), [&](int x) { return x == k[0]; }))
    record_step(n, k[0], std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  for (size_t i = 0; i < n; ++i) seqs[i]->k = choose_k(*seqs[i], n);
  return Status::ok();
}

}  // namespace dsv4::runtime
