// What the scheduler counts, for the server's /metrics (Prometheus) and for tests.
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/prefix_cache.h"

namespace dsv4::runtime {

// A cumulative histogram with fixed upper bounds (seconds), as Prometheus defines one.
struct Histogram {
  std::vector<double> bounds;    // ascending; an implicit +Inf bucket follows
  std::vector<uint64_t> counts;  // per bucket (not cumulative), bounds.size() + 1
  double sum = 0;
  uint64_t count = 0;

  explicit Histogram(std::vector<double> upper_bounds = {})
      : bounds(std::move(upper_bounds)), counts(bounds.size() + 1, 0) {}
  void observe(double v) {
    size_t i = 0;
    while (i < bounds.size() && v > bounds[i]) ++i;
    ++counts[i];
    sum += v;
    ++count;
  }
};

struct SchedulerMetrics {
  uint64_t queue_depth = 0, running = 0;
  uint64_t requests_started = 0, requests_finished = 0, requests_cancelled = 0, requests_failed = 0;
  uint64_t requests_rejected = 0, preemptions = 0;
  uint64_t prompt_tokens = 0, cached_prompt_tokens = 0, computed_tokens = 0, generated_tokens = 0;
  uint64_t steps = 0;
  // Speculative decoding: verify steps (one per speculating request and step), draft
  // tokens proposed and accepted.
  uint64_t spec_steps = 0, spec_drafted = 0, spec_accepted = 0;
  uint64_t cache_bytes_used = 0, cache_bytes_limit = 0;  // the shared KV budget
  PrefixCacheStats prefix;
  uint64_t replayed_turns = 0;
  Histogram time_to_first_token{{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}};
  Histogram time_per_output_token{{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5}};
};

}  // namespace dsv4::runtime
