// dsv4 serve: an OpenAI-, Anthropic- and Responses-compatible HTTP server over one
// model: continuous batching of many requests, prefix reuse across them, one KV-cache
// budget for all (docs/SERVER.md). Without -m it serves the built-in tiny model, whose
// random weights make noise but exercise every path. SIGINT or SIGTERM stops it
// cleanly: running requests end, idle prefix caches are persisted (--kv-persist).
#include <fmt/format.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include "backend_choice.h"
#include "commands.h"
#include "interventions.h"
#include "gguf/gguf_file.h"
#include "model/model.h"
#include "runtime/scheduler.h"
#include "server/http_server.h"
#include "synth/builtin_model.h"
#include "text/tokenizer.h"

namespace dsv4::cli {
namespace {

std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop.store(true); }

struct ServeOptions {
  std::string model;
  std::string mtp;       // --mtp FILE: the MTP sidecar of a trunk-only model
  int spec = 0;          // --spec K: MTP speculative decoding, at most K drafts per step
  BackendFlags backend;  // --backend, -t, --fast, --exact (backend_choice.h)
  std::string host = "127.0.0.1";
  int port = 8080;
  std::string port_file;
  std::string api_key;
  uint64_t ctx = 0;
  size_t max_seqs = 8;
  size_t max_queue = 64;
  int64_t batch_tokens = 256;
  std::string kv_budget = "0";
  std::string kv_persist;
  std::string kv_persist_budget = "1G";
  int64_t snapshot_interval = 0;
  size_t cache_entries = 16;
  std::vector<std::string> served_names;
  bool any_model = false;
  bool think = false, nothink = false;
  std::string effort_table = "v4";
  std::string max_body = "16M";
  int http_threads = 64;
  InterventionFlags interventions;  // --glp, --glp-alpha, --glp-layers, --kv-graft
};

// FNV-1a of a file's bytes: a steering file's part of the prefix-cache identity.
Result<uint64_t> file_hash(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::errorf("{}: cannot read", path);
  uint64_t h = 0xcbf29ce484222325ull;
  char buf[1 << 16];
  while (in.read(buf, sizeof buf) || in.gcount() > 0)
    for (std::streamsize i = 0; i < in.gcount(); ++i) h = (h ^ static_cast<uint8_t>(buf[i])) * 0x100000001b3ull;
  return h;
}

int fail(const Status& s, int code = kExitFailure) {
  fmt::print(stderr, "dsv4 serve: {}\n", s.message());
  return code;
}

int run_serve(ServeOptions& o) {
  // A backend that cannot exist here is a usage error, found before the model is read.
  if (Status s = check_backend_available(o.backend.backend); !s.is_ok()) return fail(s, kExitUsage);
  auto kv_budget = parse_byte_size("--kv-budget", o.kv_budget);
  auto persist_budget = parse_byte_size("--kv-persist-budget", o.kv_persist_budget);
  auto max_body = parse_byte_size("--max-body", o.max_body);
  auto device_memory = device_memory_bytes(o.backend);
  for (const auto* r : {&kv_budget, &persist_budget, &max_body, &device_memory})
    if (!r->is_ok()) return fail(r->status(), kExitUsage);
  if (Status s = validate_intervention_flags(o.interventions); !s.is_ok()) return fail(s, kExitUsage);
  if (o.spec > 0 && !o.interventions.kv_graft.empty())  // as run and chat
    return fail(Status::error("--spec: speculative decoding does not take a KV graft (--kv-graft) in this build"),
                kExitUsage);
  if (o.max_seqs == 0) return fail(Status::error("--max-seqs must be at least 1"), kExitUsage);
  if (o.batch_tokens < 1) return fail(Status::error("--batch-tokens must be at least 1"), kExitUsage);
  if (o.api_key.empty())
    if (const char* env = std::getenv("DSV4_API_KEY"); env && *env) o.api_key = env;

  std::string path = o.model;
  bool builtin = false;
  if (path.empty()) {
    auto p = ensure_builtin_model([](std::string_view line) { fmt::print(stderr, "dsv4 serve: {}\n", line); });
    if (!p.is_ok()) return fail(p.status());
    path = p->string();
    builtin = true;
  }
  std::unique_ptr<text::Tokenizer> tokenizer;
  {
    gguf::OpenOptions header_only;
    header_only.map_data = false;
    auto file = gguf::GgufFile::open(path, header_only);
    if (!file.is_ok()) return fail(file.status());
    auto tok = text::Tokenizer::from_gguf(*file);
    if (!tok.is_ok()) return fail(tok.status());
    tokenizer = std::make_unique<text::Tokenizer>(std::move(*tok));
  }
  auto chosen = make_backend(o.backend, "dsv4 serve");
  if (!chosen.is_ok()) return fail(chosen.status());
  ModelOptions mo;
  mo.matmul = matmul_mode(o.backend, *chosen);
  mo.mtp_path = o.mtp;
  mo.device_memory = *device_memory;
  // A device allocates the cache up front (backend_choice.h): a slot per running sequence
  // and per idle prefix-cache entry, of --ctx tokens (default kDeviceContext there, as run
  // and chat), and pages for --kv-budget bytes when given (else every slot at --ctx).
  const uint64_t device_ctx = o.ctx ? o.ctx : kDeviceContext;
  mo.cache = cache_options(*chosen, static_cast<uint32_t>(o.max_seqs + o.cache_entries), device_ctx);
  if (chosen->device || chosen->sized_as_device) mo.cache.pool_bytes = *kv_budget;
  auto model = Model::load(path, *chosen->backend, mo);
  if (!model.is_ok()) return fail(model.status());
  const bool device_sized = chosen->device || chosen->sized_as_device;
  if (device_sized) fmt::print(stderr, "dsv4 serve: device memory: {}\n", (*model)->memory_plan().describe());
  const ModelConfig& config = (*model)->config();
  if (o.ctx > config.context_length)
    return fail(Status::errorf("--ctx {} exceeds the model's context length {}", o.ctx, config.context_length), kExitUsage);
  if (o.spec > 0 && !(*model)->has_mtp())
    return fail(Status::errorf("--spec {}: {} has no MTP block to draft with (--mtp FILE for a trunk-only model)",
                               o.spec, path), kExitUsage);
  const uint64_t ctx = o.ctx ? o.ctx : device_sized ? std::min(device_ctx, config.context_length) : config.context_length;
  auto graft = apply_interventions(o.interventions, **model);
  if (!graft.is_ok()) return fail(graft.status());
  if (*graft && static_cast<uint64_t>((*graft)->footprint) + 1 >= ctx)
    return fail(Status::errorf("--kv-graft {}: its footprint of {} tokens leaves no room in a context of {} (--ctx)",
                               o.interventions.kv_graft, (*graft)->footprint, ctx), kExitUsage);

  runtime::SchedulerOptions so;
  so.max_context = ctx;
  so.max_seqs = o.max_seqs;
  so.max_queue = o.max_queue;
  so.batch_tokens = o.batch_tokens;
  so.kv_budget = *kv_budget;
  so.prefix.snapshot_interval = o.snapshot_interval;
  so.prefix.max_idle = o.cache_entries;
  so.prefix.graft = *graft;
  if (o.spec > 0) {
    runtime::SpecOptions spec;
    spec.max_k = o.spec;
    spec.measured_costs = true;  // adaptive k by the steps' measured times at each batch size
    so.speculative = spec;
  }
  if (!o.kv_persist.empty()) {
    auto identity = runtime::model_identity(path, mo);
    if (!identity.is_ok()) return fail(identity.status());
    // What changes the rows is part of the identity: the steering binding and the graft
    // (grafted sequences are not persisted at all, prefix_cache.h).
    if (!o.interventions.glp.empty()) {
      auto h = file_hash(o.interventions.glp);
      if (!h.is_ok()) return fail(h.status());
      *identity += fmt::format(" glp={:016x} alpha={} layers={}", *h, (*model)->steering()->alpha,
                               o.interventions.glp_layers);
    }
    if (*graft) *identity += fmt::format(" graft={:016x}", (*graft)->hash);
    if (o.spec > 0) *identity += " mtp";  // the sequences keep the MTP blocks' windows
    so.prefix.persist_dir = o.kv_persist;
    so.prefix.persist_budget = *persist_budget;
    so.prefix.identity = *identity;
  }
  const uint64_t footprint = *graft ? static_cast<uint64_t>((*graft)->footprint) : 0;
  if (so.kv_budget) {
    auto one = CachePlan::compute(config, std::min<uint64_t>(ctx, footprint + 1), o.spec > 0);
    if (one.is_ok() && one->total() > so.kv_budget)
      return fail(Status::errorf("--kv-budget {} bytes cannot hold even one sequence ({} bytes fixed)", so.kv_budget,
                                 one->total()), kExitUsage);
  }
  runtime::Scheduler scheduler(**model, *tokenizer, so);

  server::ApiContext api;
  api.tokenizer = tokenizer.get();
  api.model_names = o.served_names;
  if (api.model_names.empty()) api.model_names.push_back(std::filesystem::path(path).stem().string());
  api.any_model = o.any_model;
  api.max_context = ctx - footprint;
  api.steering_bound = (*model)->steering() != nullptr;
  api.vocab_size = config.vocab_size;
  api.replay = &scheduler.replay();
  api.vocab = scheduler.vocab();
  api.default_thinking = !o.nothink;
  api.effort_table = o.effort_table == "0731" ? text::EffortTable::kV4_0731 : text::EffortTable::kV4;

  server::ServerOptions http;
  http.host = o.host;
  http.port = o.port;
  http.api_key = o.api_key;
  http.max_body = *max_body;
  http.http_threads = o.http_threads;
  server::HttpServer srv(scheduler, api, http);
  if (Status s = srv.bind(); !s.is_ok()) return fail(s);
  if (!o.port_file.empty()) {
    std::ofstream pf(o.port_file + ".tmp");
    pf << srv.bound_port() << "\n";
    pf.close();
    std::filesystem::rename(o.port_file + ".tmp", o.port_file);
  }

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  std::signal(SIGPIPE, SIG_IGN);
  scheduler.start();
  fmt::print(stderr,
             "dsv4 serve: http://{}:{} serving {} as {}{} | backend {} | ctx {} | max-seqs {} | kv-budget {} | batch {} "
             "tokens{}{}\n",
             o.host, srv.bound_port(), path, api.model_names[0], builtin ? " (built-in tiny model, random weights)" : "",
             chosen->name, ctx, o.max_seqs, so.kv_budget ? fmt::format("{} B", so.kv_budget) : "unlimited", o.batch_tokens,
             o.spec > 0 ? fmt::format(" | speculative decoding, up to {} drafts", o.spec) : "",
             o.api_key.empty() ? "" : " | API key required");
  std::thread watcher([&] {
    while (!g_stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    scheduler.stop();  // running requests end (their streams close), caches persist
    srv.stop();
  });
  srv.run();
  g_stop.store(true);
  watcher.join();
  const runtime::SchedulerMetrics m = scheduler.metrics();
  fmt::print(stderr, "dsv4 serve: stopped after {} requests ({} prompt tokens, {} cached, {} generated{})\n",
             m.requests_finished, m.prompt_tokens, m.cached_prompt_tokens, m.generated_tokens,
             o.spec > 0 ? fmt::format("; {} of {} drafts accepted", m.spec_accepted, m.spec_drafted) : "");
  return kExitOk;
}

}  // namespace

void register_serve(CLI::App& app, CommandRunner& run) {
  auto o = std::make_shared<ServeOptions>();
  app.add_option("-m,--model", o->model, "GGUF model file (default: the built-in tiny model, random weights)")
      ->check(CLI::ExistingFile);
  app.add_option("--mtp", o->mtp, "MTP sidecar of a trunk-only model (default: mtp-*.gguf found next to it)");
  add_backend_flags(app, o->backend);
  app.add_option("--spec", o->spec,
                 "MTP speculative decoding: at most K draft tokens per step and request, 1..4 (default 0 = off)")
      ->check(CLI::Range(0, 4));
  app.add_option("--host", o->host, "address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)");
  app.add_option("--port", o->port, "TCP port (default 8080; 0: any free port)")->check(CLI::Range(0, 65535));
  app.add_option("--port-file", o->port_file, "write the port listened on to this file (with --port 0)");
  app.add_option("--api-key", o->api_key, "require this key (Authorization: Bearer KEY or x-api-key); default: $DSV4_API_KEY");
  app.add_option("--ctx", o->ctx, "tokens per sequence (default: the model's context length)");
  app.add_option("--max-seqs", o->max_seqs, "sequences generated at once (default 8)");
  app.add_option("--max-queue", o->max_queue, "requests waiting beyond those; more get 429 (default 64)");
  app.add_option("--batch-tokens", o->batch_tokens, "tokens per forward pass: decodes plus prefill chunks (default 256)");
  app.add_option("--kv-budget", o->kv_budget, "bytes for every sequence's cache and snapshot, e.g. 8G (default: unlimited)");
  app.add_option("--kv-persist", o->kv_persist, "folder for prefix caches that outlive the process");
  app.add_option("--kv-persist-budget", o->kv_persist_budget, "bytes on disk for --kv-persist (default 1G)");
  app.add_option("--snapshot-interval", o->snapshot_interval,
                 "tokens between prefix-cache snapshots (default: 8 compression blocks)");
  app.add_option("--cache-entries", o->cache_entries, "finished sequences kept for prefix reuse (default 16)");
  app.add_option("--served-model-name", o->served_names, "model name clients use (repeatable; default: the file's stem)");
  app.add_flag("--any-model", o->any_model, "accept any model name in requests");
  auto* think = app.add_flag("--think", o->think, "reason first unless a request says otherwise (default)");
  app.add_flag("--nothink", o->nothink, "answer directly unless a request asks for reasoning")->excludes(think);
  app.add_option("--effort-table", o->effort_table, "reasoning-effort prompts of: v4 or 0731")->check(CLI::IsMember({"v4", "0731"}));
  app.add_option("-t,--threads", o->backend.threads, "CPU threads (default: all)")->check(CLI::NonNegativeNumber);
  app.add_option("--max-body", o->max_body, "largest request body; larger get 413 (default 16M)");
  app.add_option("--http-threads", o->http_threads, "connections served at once (default 64)");
  add_intervention_flags(app, o->interventions);
  run = [o] { return run_serve(*o); };
}

}  // namespace dsv4::cli
