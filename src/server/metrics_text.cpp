// The Prometheus text exposition format (version 0.0.4) of the scheduler's metrics.
#include <fmt/format.h>

#include "server/http_server.h"

namespace dsv4::server {
namespace {

void metric(std::string& out, const char* name, const char* type, const char* help, double value) {
  out += fmt::format("# HELP {} {}\n# TYPE {} {}\n{} {}\n", name, help, name, type, name, value);
}

void histogram(std::string& out, const char* name, const char* help, const runtime::Histogram& h) {
  out += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
  uint64_t cumulative = 0;
  for (size_t i = 0; i < h.bounds.size(); ++i) {
    cumulative += h.counts[i];
    out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, h.bounds[i], cumulative);
  }
  cumulative += h.counts.back();
  out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, cumulative, name, h.sum, name, h.count);
}

}  // namespace

std::string prometheus_text(const runtime::SchedulerMetrics& m,
                            const std::vector<std::pair<std::string, uint64_t>>& http_responses) {
  std::string out;
  metric(out, "dsv4_queue_depth", "gauge", "Requests waiting for a sequence.", static_cast<double>(m.queue_depth));
  metric(out, "dsv4_running_sequences", "gauge", "Requests being generated.", static_cast<double>(m.running));
  metric(out, "dsv4_prompt_tokens_total", "counter", "Prompt tokens of started requests.", static_cast<double>(m.prompt_tokens));
  metric(out, "dsv4_cached_prompt_tokens_total", "counter", "Prompt tokens reused from the prefix cache.",
         static_cast<double>(m.cached_prompt_tokens));
  metric(out, "dsv4_computed_tokens_total", "counter", "Tokens run through the model (prefill and decode).",
         static_cast<double>(m.computed_tokens));
  metric(out, "dsv4_generation_tokens_total", "counter", "Tokens generated.", static_cast<double>(m.generated_tokens));
  out += "# HELP dsv4_requests_total Requests by outcome.\n# TYPE dsv4_requests_total counter\n";
  out += fmt::format("dsv4_requests_total{{outcome=\"started\"}} {}\n", m.requests_started);
  out += fmt::format("dsv4_requests_total{{outcome=\"finished\"}} {}\n", m.requests_finished);
  out += fmt::format("dsv4_requests_total{{outcome=\"cancelled\"}} {}\n", m.requests_cancelled);
  out += fmt::format("dsv4_requests_total{{outcome=\"failed\"}} {}\n", m.requests_failed);
  out += fmt::format("dsv4_requests_total{{outcome=\"rejected\"}} {}\n", m.requests_rejected);
  metric(out, "dsv4_preemptions_total", "counter", "Requests preempted for memory (resumed later).",
         static_cast<double>(m.preemptions));
  metric(out, "dsv4_scheduler_steps_total", "counter", "Batches run.", static_cast<double>(m.steps));
  metric(out, "dsv4_spec_verify_steps_total", "counter",
         "Speculative decoding: verify steps (one per speculating request and batch).", static_cast<double>(m.spec_steps));
  metric(out, "dsv4_spec_drafted_tokens_total", "counter", "Speculative decoding: draft tokens proposed by the MTP block.",
         static_cast<double>(m.spec_drafted));
  metric(out, "dsv4_spec_accepted_tokens_total", "counter", "Speculative decoding: draft tokens accepted.",
         static_cast<double>(m.spec_accepted));
  histogram(out, "dsv4_time_to_first_token_seconds", "From submission to the first generated token.", m.time_to_first_token);
  histogram(out, "dsv4_time_per_output_token_seconds", "Between consecutive generated tokens of a request.",
            m.time_per_output_token);
  metric(out, "dsv4_cache_bytes_used", "gauge", "KV-cache bytes committed (sequences and snapshots).",
         static_cast<double>(m.cache_bytes_used));
  metric(out, "dsv4_cache_bytes_limit", "gauge", "The KV-cache budget (0: unlimited).",
         static_cast<double>(m.cache_bytes_limit));
  const auto& p = m.prefix;
  metric(out, "dsv4_prefix_cache_lookups_total", "counter", "Prefix-cache lookups (one per admission).",
         static_cast<double>(p.lookups));
  metric(out, "dsv4_prefix_cache_hits_total", "counter", "Lookups that reused tokens.", static_cast<double>(p.hits));
  metric(out, "dsv4_prefix_cache_hit_rate", "gauge", "Hits over lookups.",
         p.lookups ? static_cast<double>(p.hits) / static_cast<double>(p.lookups) : 0.0);
  metric(out, "dsv4_prefix_cache_reused_tokens_total", "counter", "Tokens reused.", static_cast<double>(p.reused_tokens));
  metric(out, "dsv4_prefix_cache_idle_entries", "gauge", "Finished sequences kept for reuse.",
         static_cast<double>(p.idle_entries));
  metric(out, "dsv4_prefix_cache_snapshots", "gauge", "Snapshots held.", static_cast<double>(p.snapshots));
  metric(out, "dsv4_prefix_cache_snapshot_bytes", "gauge", "Bytes of the snapshots.", static_cast<double>(p.snapshot_bytes));
  metric(out, "dsv4_prefix_cache_evictions_total", "counter", "Idle entries evicted.", static_cast<double>(p.evictions));
  metric(out, "dsv4_prefix_cache_disk_entries", "gauge", "Entries persisted on disk.", static_cast<double>(p.disk_entries));
  metric(out, "dsv4_prefix_cache_disk_bytes", "gauge", "Bytes persisted on disk.", static_cast<double>(p.disk_bytes));
  metric(out, "dsv4_prefix_cache_disk_loads_total", "counter", "Entries loaded from disk.", static_cast<double>(p.disk_loads));
  metric(out, "dsv4_replayed_turns_total", "counter", "Assistant turns tokenized from their generated tokens.",
         static_cast<double>(m.replayed_turns));
  out += "# HELP dsv4_http_responses_total HTTP responses by endpoint and status.\n"
         "# TYPE dsv4_http_responses_total counter\n";
  for (const auto& [labels, n] : http_responses) out += fmt::format("dsv4_http_responses_total{{{}}} {}\n", labels, n);
  return out;
}

}  // namespace dsv4::server
