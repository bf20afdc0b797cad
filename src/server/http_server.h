// The HTTP server: OpenAI- (chat completions, completions, Responses, models) and
// Anthropic-compatible (messages, count_tokens) endpoints over one scheduler, plus
// /health and /metrics (Prometheus text). cpp-httplib underneath, one thread per open
// connection; a streaming request's thread waits on its RequestHandle and writes SSE.
//
// A client that goes away is noticed within ~100 ms (a failed write, or the socket's
// peer-closed state while waiting) and its request cancelled; the scheduler frees the
// sequence at its next step. Every error is the endpoint's API's own JSON and status
// (api.h); nothing a client sends ends the process.
#pragma once

#include <memory>
#include <string>

#include "runtime/scheduler.h"
#include "server/api.h"

namespace dsv4::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;            // 0: any free port (bound_port() tells which)
  std::string api_key;        // empty: no authentication
  size_t max_body = 16 << 20;  // bytes; larger bodies get 413
  int http_threads = 64;      // connections served at once
};

class HttpServer {
 public:
  HttpServer(runtime::Scheduler& scheduler, ApiContext ctx, ServerOptions options);
  ~HttpServer();

  Status bind();  // listens on host:port
  void run();     // serves until stop()
  void stop();    // from any thread (a signal handler's watcher)
  int bound_port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// /metrics: the scheduler's counters and histograms, and the server's per-endpoint
// response counts, in the Prometheus text format.
std::string prometheus_text(const runtime::SchedulerMetrics& m,
                            const std::vector<std::pair<std::string, uint64_t>>& http_responses);

}  // namespace dsv4::server
