#include "server/http_server.h"

#include <dirent.h>
#include <fmt/format.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <arpa/inet.h>

#include <chrono>
#include <map>
#include <mutex>

namespace dsv4::server {
namespace {

using runtime::RequestEvent;

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The connection's socket, found by its addresses (cpp-httplib 0.11 does not hand it to
// handlers), to see a client that closed while nothing is being written to it.
class ConnectionWatch {
 public:
  explicit ConnectionWatch(const httplib::Request& req) {
    DIR* dir = opendir("/proc/self/fd");
    if (!dir) return;
    while (dirent* d = readdir(dir)) {
      const int fd = std::atoi(d->d_name);
      if (fd <= 2) continue;
      sockaddr_storage peer{}, local{};
      socklen_t pl = sizeof peer, ll = sizeof local;
      if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &pl) != 0 ||
          getsockname(fd, reinterpret_cast<sockaddr*>(&local), &ll) != 0)
        continue;
      if (port_of(peer) == req.remote_port && port_of(local) == req.local_port && addr_of(peer) == req.remote_addr) {
        fd_ = fd;
        break;
      }
    }
    closedir(dir);
  }
  // True once the peer has closed (or reset) the connection.
  bool closed() const {
    if (fd_ < 0) return false;
    pollfd p{fd_, static_cast<short>(POLLRDHUP), 0};
    return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL));
  }

 private:
  static int port_of(const sockaddr_storage& a) {
    if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(a).sin_port);
    if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(a).sin6_port);
    return -1;
  }
  static std::string addr_of(const sockaddr_storage& a) {
    char buf[INET6_ADDRSTRLEN] = {};
    if (a.ss_family == AF_INET) inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in&>(a).sin_addr, buf, sizeof buf);
    else if (a.ss_family == AF_INET6) inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6&>(a).sin6_addr, buf, sizeof buf);
    return buf;
  }
  int fd_ = -1;
};

bool constant_time_equal(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char d = 0;
  for (size_t i = 0; i < a.size(); ++i) d |= static_cast<unsigned char>(a[i] ^ b[i]);
  return d == 0;
}

ApiKind api_of(const std::string& path) { return path.rfind("/v1/messages", 0) == 0 ? ApiKind::kAnthropic : ApiKind::kOpenAI; }

}  // namespace

struct HttpServer::Impl {
  runtime::Scheduler& scheduler;
  ApiContext ctx;
  ServerOptions opt;
  httplib::Server svr;
  int port = -1;
  std::mutex mu;
  std::map<std::string, uint64_t> responses;  // "endpoint status" -> count
  std::atomic<uint64_t> next_request{1};

  Impl(runtime::Scheduler& s, ApiContext c, ServerOptions o) : scheduler(s), ctx(std::move(c)), opt(std::move(o)) {}

  void count(const std::string& path, int status) {
    std::lock_guard<std::mutex> lock(mu);
    ++responses[fmt::format("endpoint=\"{}\",status=\"{}\"", path, status)];
  }

  void send_error(const httplib::Request& req, httplib::Response& res, ApiKind api, const ApiError& e) {
    res.status = e.status;
    if (e.retry_after > 0) res.set_header("Retry-After", std::to_string(e.retry_after));
    if (e.status == 401 && api == ApiKind::kOpenAI) res.set_header("WWW-Authenticate", "Bearer");
    res.set_content(error_body(api, e), "application/json");
    count(req.path, e.status);
  }

  bool authorized(const httplib::Request& req) const {
    if (opt.api_key.empty()) return true;
    const std::string bearer = req.get_header_value("Authorization");
    if (bearer.rfind("Bearer ", 0) == 0 && constant_time_equal(std::string_view(bearer).substr(7), opt.api_key)) return true;
    return constant_time_equal(req.get_header_value("x-api-key"), opt.api_key);
  }

  // Body -> JSON, or a 400 naming the parse error.
  bool parse_body(const httplib::Request& req, httplib::Response& res, ApiKind api, OrderedJson& body) {
    try {
      body = OrderedJson::parse(req.body);
      return true;
    } catch (const std::exception& e) {
      ApiError err;
      err.message = fmt::format("the request body is not valid JSON: {}", e.what());
      send_error(req, res, api, err);
      return false;
    }
  }

  void generate(Endpoint endpoint, const httplib::Request& req, httplib::Response& res) {
    const ApiKind api = endpoint == Endpoint::kMessages ? ApiKind::kAnthropic : ApiKind::kOpenAI;
    OrderedJson body;
    if (!parse_body(req, res, api, body)) return;
    ApiError err;
    Result<ParsedRequest> parsed = Status::error("unparsed");
    switch (endpoint) {
      case Endpoint::kChatCompletions: parsed = parse_chat_completion(body, ctx, err); break;
      case Endpoint::kCompletions: parsed = parse_completion(body, ctx, err); break;
      case Endpoint::kResponses: parsed = parse_responses(body, ctx, err); break;
      case Endpoint::kMessages: parsed = parse_messages(body, ctx, err); break;
    }
    if (!parsed.is_ok()) return send_error(req, res, api, err);
    auto request = std::make_shared<ParsedRequest>(std::move(*parsed));
    runtime::Rejection rejected;
    std::shared_ptr<runtime::RequestHandle> handle = scheduler.submit(request->spec, &rejected);
    if (!handle) return send_error(req, res, api, error_from_status(rejected.status, rejected.retry_after_seconds));
    std::shared_ptr<ResponseFormatter> fmt_ =
        make_formatter(endpoint, *request, ctx, next_request.fetch_add(1), unix_now());
    auto watch = std::make_shared<ConnectionWatch>(req);
    const std::string path = req.path;

    if (request->stream) {
      res.set_header("Cache-Control", "no-cache");
      res.set_header("X-Accel-Buffering", "no");
      auto begun = std::make_shared<bool>(false);
      count(path, 200);
      res.set_chunked_content_provider(
          "text/event-stream",
          [handle, fmt_, request, watch, begun](size_t, httplib::DataSink& sink) {
            auto write = [&](const std::string& s) { return s.empty() || sink.write(s.data(), s.size()); };
            if (!*begun) {
              *begun = true;
              if (!write(fmt_->begin())) {
                handle->cancel();
                return false;
              }
            }
            const std::vector<RequestEvent> events = handle->wait(std::chrono::milliseconds(100));
            for (const RequestEvent& e : events) {
              if (!write(fmt_->event(e))) {
                handle->cancel();
                return false;
              }
              if (e.done) {
                sink.done();
                return true;
              }
            }
            if (events.empty() && watch->closed()) {
              handle->cancel();
              return false;
            }
            return true;
          },
          [handle](bool) {
            if (!handle->finished()) handle->cancel();
          });
      return;
    }
    // Not streaming: wait for the end, watching the connection.
    for (;;) {
      bool done = false;
      Status failure;
      for (const RequestEvent& e : handle->wait(std::chrono::milliseconds(100))) {
        fmt_->event(e);
        if (e.done) {
          done = true;
          failure = e.error;
        }
      }
      if (done) {
        if (!failure.is_ok()) return send_error(req, res, api, error_from_status(failure));
        res.set_content(fmt_->body().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), "application/json");
        count(path, 200);
        return;
      }
      if (watch->closed()) {
        handle->cancel();
        res.status = 499;  // never seen: the client is gone
        return;
      }
    }
  }

  void routes() {
    svr.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (req.path == "/health" || authorized(req)) return httplib::Server::HandlerResponse::Unhandled;
      ApiError e;
      e.status = 401;
      e.code = "invalid_api_key";
      e.message = "missing or wrong API key: send \"Authorization: Bearer KEY\" or \"x-api-key: KEY\"";
      send_error(req, res, api_of(req.path), e);
      return httplib::Server::HandlerResponse::Handled;
    });
    svr.set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
      ApiError e;
      e.status = res.status;
      if (res.status == 413) {
        e.message = fmt::format("the request body is larger than this server's limit of {} bytes (dsv4 serve --max-body)",
                                opt.max_body);
      } else if (res.status == 404) {
        e.message = fmt::format("unknown endpoint {} {}", req.method, req.path);
      } else if (res.status == 405) {
        e.message = fmt::format("{} does not accept {}", req.path, req.method);
      } else {
        e.message = fmt::format("HTTP {}", res.status);
      }
      res.set_content(error_body(api_of(req.path), e), "application/json");
      count(req.path, res.status);
      return httplib::Server::HandlerResponse::Handled;
    }));
    svr.set_exception_handler([this](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
      ApiError e;
      e.status = 500;
      try {
        if (ep) std::rethrow_exception(ep);
      } catch (const std::exception& x) {
        e.message = fmt::format("internal error: {}", x.what());
      } catch (...) {
        e.message = "internal error";
      }
      send_error(req, res, api_of(req.path), e);
    });
    auto post = [this](const char* path, Endpoint ep) {
      svr.Post(path, [this, ep](const httplib::Request& req, httplib::Response& res) { generate(ep, req, res); });
    };
    post("/v1/chat/completions", Endpoint::kChatCompletions);
    post("/v1/completions", Endpoint::kCompletions);
    post("/v1/responses", Endpoint::kResponses);
    post("/v1/messages", Endpoint::kMessages);
    svr.Post("/v1/messages/count_tokens", [this](const httplib::Request& req, httplib::Response& res) {
      OrderedJson body;
      if (!parse_body(req, res, ApiKind::kAnthropic, body)) return;
      ApiError err;
      auto n = count_message_tokens(body, ctx, err);
      if (!n.is_ok()) return send_error(req, res, ApiKind::kAnthropic, err);
      res.set_content(OrderedJson{{"input_tokens", *n}}.dump(), "application/json");
      count(req.path, 200);
    });
    svr.Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) {
      res.set_content(models_list(ctx, unix_now()).dump(), "application/json");
      count(req.path, 200);
    });
    svr.Get(R"(/v1/models/(.+))", [this](const httplib::Request& req, httplib::Response& res) {
      const OrderedJson list = models_list(ctx, unix_now());
      for (const OrderedJson& m : list["data"])
        if (m["id"] == req.matches[1].str()) {
          res.set_content(m.dump(), "application/json");
          count("/v1/models/{id}", 200);
          return;
        }
      ApiError e;
      e.status = 404;
      e.code = "model_not_found";
      e.message = fmt::format("the model '{}' does not exist", req.matches[1].str());
      send_error(req, res, api_of(req.path), e);
    });
    svr.Get("/health", [this](const httplib::Request& req, httplib::Response& res) {
      const runtime::SchedulerMetrics m = scheduler.metrics();
      res.set_content(OrderedJson{{"status", "ok"}, {"running", m.running}, {"queued", m.queue_depth}}.dump(),
                      "application/json");
      count(req.path, 200);
    });
    svr.Get("/metrics", [this](const httplib::Request& req, httplib::Response& res) {
      std::vector<std::pair<std::string, uint64_t>> http;
      {
        std::lock_guard<std::mutex> lock(mu);
        http.assign(responses.begin(), responses.end());
      }
      res.set_content(prometheus_text(scheduler.metrics(), http), "text/plain; version=0.0.4");
      count(req.path, 200);
    });
  }
};

HttpServer::HttpServer(runtime::Scheduler& scheduler, ApiContext ctx, ServerOptions options)
    : impl_(std::make_unique<Impl>(scheduler, std::move(ctx), std::move(options))) {
  Impl& s = *impl_;
  const int threads = std::max(4, s.opt.http_threads);
  s.svr.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  s.svr.set_payload_max_length(s.opt.max_body);
  s.svr.set_read_timeout(30, 0);
  s.svr.set_write_timeout(30, 0);
  s.svr.set_keep_alive_timeout(2);  // an idle connection closes soon (and so does stop())
  s.svr.set_keep_alive_max_count(1000);
  s.routes();
}

HttpServer::~HttpServer() { stop(); }

Status HttpServer::bind() {
  Impl& s = *impl_;
  if (s.opt.port == 0) {
    s.port = s.svr.bind_to_any_port(s.opt.host);
    if (s.port < 0) return Status::errorf(StatusCode::kIo, "cannot listen on {} (any port)", s.opt.host);
  } else {
    if (!s.svr.bind_to_port(s.opt.host, s.opt.port))
      return Status::errorf(StatusCode::kIo, "cannot listen on {}:{} (in use, or not an address of this machine)",
                            s.opt.host, s.opt.port);
    s.port = s.opt.port;
  }
  return Status::ok();
}

void HttpServer::run() { impl_->svr.listen_after_bind(); }

void HttpServer::stop() {
  if (impl_->svr.is_running()) impl_->svr.stop();
}

int HttpServer::bound_port() const { return impl_->port; }

}  // namespace dsv4::server
