#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace dsv4::runtime {

Status SamplingParams::validate(size_t vocab_size) const {
  auto bad = [](const char* name, double v, const char* range) {
    return Status::errorf("sampling: {} = {} is out of range (allowed: {})", name, v, range);
  };
  if (!(temperature >= 0.0f) || !std::isfinite(temperature)) return bad("temperature", temperature, ">= 0");
  if (top_k < 0) return bad("top_k", top_k, ">= 0, 0 = off");
  if (!(top_p > 0.0f && top_p <= 1.0f)) return bad("top_p", top_p, "(0, 1]");
  if (!(min_p >= 0.0f && min_p <= 1.0f)) return bad("min_p", min_p, "[0, 1]");
  if (!(repetition_penalty > 0.0f) || !std::isfinite(repetition_penalty))
    return bad("repetition_penalty", repetition_penalty, "> 0, 1 = off");
  if (!std::isfinite(presence_penalty)) return bad("presence_penalty", presence_penalty, "a finite number");
  if (!std::isfinite(frequency_penalty)) return bad("frequency_penalty", frequency_penalty, "a finite number");
  for (const auto& [id, bias] : logit_bias) {
    if (id < 0 || static_cast<size_t>(id) >= vocab_size)
      return Status::errorf("sampling: logit_bias token id {} is outside the vocabulary [0, {})", id, vocab_size);
    if (std::isnan(bias)) return Status::errorf("sampling: logit_bias for token {} is NaN", id);
  }
  return Status::ok();
}

Sampler::Sampler(SamplingParams params) : params_(std::move(params)), rng_(params_.seed) {}

void Sampler::accept(int32_t token) { ++counts_[token]; }

void Sampler::reset() {
  counts_.clear();
  rng_.seed(params_.seed);
}

double Sampler::uniform() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }

std::vector<float> Sampler::adjusted_logits(std::span<const float> logits) const {
  std::vector<float> l(logits.begin(), logits.end());
  for (const auto& [id, bias] : params_.logit_bias)
    if (id >= 0 && static_cast<size_t>(id) < l.size()) l[id] += bias;
  for (const auto& [id, count] : counts_) {
    if (id < 0 || static_cast<size_t>(id) >= l.size()) continue;
    float& x = l[id];
    if (params_.repetition_penalty != 1.0f) x = x > 0 ? x / params_.repetition_penalty : x * params_.repetition_penalty;
    x -= params_.presence_penalty + params_.frequency_penalty * static_cast<float>(count);
  }
  return l;
}

std::vector<TokenProb> Sampler::distribution(std::span<const float> logits) const {
  const std::vector<float> l = adjusted_logits(logits);
  if (l.empty()) return {};
  auto argmax = [&] {
    int32_t best = 0;
    for (size_t i = 1; i < l.size(); ++i)
      if (l[i] > l[best] || std::isnan(l[best])) best = static_cast<int32_t>(i);
    return best;
  };
  if (params_.temperature == 0.0f) return {{argmax(), 1.0f}};

  // Candidates with a finite scaled logit, best first (top-k keeps only k of them).
  std::vector<TokenProb> c;
  c.reserve(l.size());
  for (size_t i = 0; i < l.size(); ++i)
    if (std::isfinite(l[i])) c.push_back({static_cast<int32_t>(i), l[i] / params_.temperature});
  if (c.empty()) return {{argmax(), 1.0f}};
  auto by_logit = [](const TokenProb& a, const TokenProb& b) { return a.p != b.p ? a.p > b.p : a.id < b.id; };
  if (params_.top_k > 0 && static_cast<size_t>(params_.top_k) < c.size()) {
    std::nth_element(c.begin(), c.begin() + params_.top_k, c.end(), by_logit);
    c.resize(static_cast<size_t>(params_.top_k));
  }
  std::sort(c.begin(), c.end(), by_logit);

  // Softmax in double: the tail of a 129k vocabulary matters for top-p.
  const double max_logit = c.front().p;
  std::vector<double> p(c.size());
  double sum = 0;
  for (size_t i = 0; i < c.size(); ++i) sum += p[i] = std::exp(static_cast<double>(c[i].p) - max_logit);
  size_t keep = c.size();
  if (params_.top_p < 1.0f) {
    // The smallest prefix whose mass reaches top_p.
    double acc = 0;
    for (size_t i = 0; i < c.size(); ++i) {
      acc += p[i] / sum;
      if (acc >= params_.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  if (params_.min_p > 0.0f) {
    const double floor = params_.min_p * p[0];
    size_t n = 1;
    while (n < keep && p[n] >= floor) ++n;
    keep = n;
  }
  double kept = 0;
  for (size_t i = 0; i < keep; ++i) kept += p[i];
  c.resize(keep);
  for (size_t i = 0; i < keep; ++i) c[i].p = static_cast<float>(p[i] / kept);
  return c;
}

int32_t Sampler::sample(std::span<const float> logits) {
  const std::vector<TokenProb> d = distribution(logits);
  if (d.empty()) return 0;
  if (d.size() == 1) return d[0].id;
  double u = uniform();
  for (const TokenProb& t : d) {
    u -= t.p;
    if (u < 0) return t.id;
  }
  return d.back().id;  // rounding left a sliver
}

}  // namespace dsv4::runtime
