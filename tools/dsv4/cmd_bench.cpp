// dsv4 bench: how fast a model file runs on a backend, each figure beside its physical bound
// measured in the same run (docs/PERFORMANCE.md, "How the model is measured"):
//   prefill    P-token prompts in chunks: tokens/s against FLOPs per token over the BF16
//              tensor-core rate (CPU: the backend's own f32 product rate);
//   decode     one sequence at context depth D, sampled greedily on the backend, so a step
//              is the graph-replayed path: tokens/s against the bytes a step reads over the
//              copy bandwidth;
//   aggregate  B sequences at depth D stepping together: tokens/s over all of them against
//              the same byte bound (the distinct experts B tokens touch, every sequence's
//              cache).
//   spec       (opt-in; models with an MTP block) the parts of MTP speculative decoding at
//              batch 1 and each --batches B, depth --batch-depth: a plain decode step, a
//              verify step of k + 1 rows per sequence (k = 1..4), one MTP draft pass, the
//              rollback (Model::rewind of 4 tokens: host bookkeeping; V4.1's snapshot +
//              restore + replay where rewind is not available); from them the speedup at
//              each acceptance rate and the break-even acceptance (random weights make
//              measured acceptance meaningless, so it is modelled); then, at batch 1, greedy
//              speculation end to end with drafts forced to agree (100%, ~50%) and with the
//              MTP block's own, in tokens/s against plain greedy decoding.
// Depth comes from a synthetic fill (Model::fill_for_benchmark: random cache contents, as
// costly to read as real ones) or a real prefill. Times are the backend's timing points
// (CUDA events on the GPU, the host clock on the CPU) after warm-up, the median of repeats.
// Output: one line per figure, `TABLE|...` lines for scripts/gpu.sh, and --json FILE.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "backend_choice.h"
#include "commands.h"
#include "model/model.h"
#include "model/model_files.h"
#include "model/step_cost.h"
#include "runtime/speculative.h"
#include "text/pyjson.h"
#include "util/counter_rng.h"
#include "util/thread_pool.h"
#ifdef DSV4_HAVE_CUDA
#include "backend/cuda/device_bench.h"
#include "backend/cuda/device_info.h"
#endif

namespace dsv4::cli {
namespace {

using Json = text::OrderedJson;

struct BenchOptions {
  std::string model;
  BackendFlags backend;
  std::vector<std::string> parts{"prefill", "decode", "aggregate"};
  std::vector<int64_t> prefill{8192, 32768};
  int64_t chunk = 4096;
  std::vector<int64_t> depths{4096, 32768, 131072};
  std::vector<int64_t> batches{16, 64};
  int64_t batch_depth = 4096;
  std::string fill = "random";
  int steps = 16;
  int repeats = 5;
  int prefill_repeats = 2;
  int warmup = 3;
  bool no_graphs = false;
  int verify_rows = 0;  // --verify-rows N: the spec part times only verify steps of N rows (for a profiler)
  uint64_t seed = 1;
  std::string label;
  std::string json;
};

bool wants(const BenchOptions& o, const char* part) {
  return std::find(o.parts.begin(), o.parts.end(), part) != o.parts.end();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// The ceilings of this run (device_bench.h on the GPU; the host's copy rate and the CPU
// backend's f32 product rate on the CPU).
struct Ceilings {
  double copy_gbs = 0;       // bytes read + written per second, 1e9
  double compute_tflops = 0;
  std::string copy_what, compute_what;
};

// Host: a parallel copy of 256 MiB of random words, (read + written) per second.
double host_copy_gbs() {
  const size_t words = size_t{32} << 20;
  std::vector<uint64_t> a(words), b(words);
  ThreadPool& pool = ThreadPool::global();
  pool.parallel_for(static_cast<int64_t>(words), [&](int64_t begin, int64_t end, int) {
    for (int64_t i = begin; i < end; ++i) a[i] = splitmix64(static_cast<uint64_t>(i));
  }, 1 << 16);
  std::vector<double> ms;
  for (int r = 0; r < 6; ++r) {
    const double t0 = backend::Backend::host_clock_ms();
    pool.parallel_for(static_cast<int64_t>(words), [&](int64_t begin, int64_t end, int) {
      std::memcpy(b.data() + begin, a.data() + begin, static_cast<size_t>(end - begin) * 8);
    }, 1 << 16);
    ms.push_back(backend::Backend::host_clock_ms() - t0);
  }
  ms.erase(ms.begin());  // warm-up (first touch of b)
  return 2.0 * static_cast<double>(words) * 8 / (median(ms) * 1e-3) / 1e9;
}

// The backend's own f32 product (Exact) of a 2048 x 2048 F32 weight with 128 rows.
Result<double> backend_f32_tflops(backend::Backend& be) {
  const int64_t n = 2048, k = 2048, m = 128;
  DSV4_ASSIGN_OR_RETURN(backend::Tensor w, be.alloc(GgmlType::F32, std::vector<int64_t>{n, k}));
  DSV4_ASSIGN_OR_RETURN(backend::Tensor x, be.alloc(GgmlType::F32, std::vector<int64_t>{m, k}));
  DSV4_ASSIGN_OR_RETURN(backend::Tensor y, be.alloc(GgmlType::F32, std::vector<int64_t>{m, n}));
  std::vector<float> host(static_cast<size_t>(n * k));
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(unit_double(splitmix64(i)) - 0.5);
  DSV4_TRY(be.upload(w, host.data(), host.size() * sizeof(float)));
  DSV4_TRY(be.upload(x, host.data(), static_cast<size_t>(m * k) * sizeof(float)));
  std::vector<double> ms;
  for (int r = 0; r < 4; ++r) {
    DSV4_ASSIGN_OR_RETURN(auto t0, be.time_point());
    DSV4_TRY(be.matmul(w, x, y, backend::MatmulMode::Exact));
    DSV4_ASSIGN_OR_RETURN(auto t1, be.time_point());
    DSV4_ASSIGN_OR_RETURN(double t, be.elapsed_ms(t0, t1));
    if (r > 0) ms.push_back(t);
  }
  return 2.0 * n * k * m / (median(ms) * 1e-3) / 1e12;
}

Result<Ceilings> measure_ceilings(const ChosenBackend& chosen) {
  Ceilings c;
#ifdef DSV4_HAVE_CUDA
  if (chosen.device) {
    DSV4_ASSIGN_OR_RETURN(c.copy_gbs, cuda::measure_copy_bandwidth());
    DSV4_ASSIGN_OR_RETURN(c.compute_tflops, cuda::measure_bf16_gemm_tflops());
    c.copy_what = "device-to-device copy of 2 GiB (read + write)";
    c.compute_what = "cuBLASLt BF16 GEMM 8192 x 8192 x 8192";
    return c;
  }
#endif
  c.copy_gbs = host_copy_gbs();
  DSV4_ASSIGN_OR_RETURN(c.compute_tflops, backend_f32_tflops(*chosen.backend));
  c.copy_what = "host memcpy of 256 MiB on every thread (read + write)";
  c.compute_what = "the CPU backend's f32 product, 2048 x 2048 x 128 (its own rate, not a peak)";
  return c;
}

SequenceOptions context_of(uint64_t tokens) {
  SequenceOptions so;
  so.max_context = tokens;
  return so;
}

std::vector<int32_t> random_tokens(uint64_t seed, int64_t n, uint32_t vocab) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>(splitmix64(seed + static_cast<uint64_t>(i)) % vocab);
  return t;
}

class Bench {
 public:
  Bench(const BenchOptions& o, ChosenBackend& chosen, const Model& model, const StepCost& cost, const Ceilings& ceil)
      : o_(o), be_(*chosen.backend), model_(model), cost_(cost), ceil_(ceil) {}

  Json results = Json::array();

  Status prefill(int64_t prompt) {
    const ModelConfig& c = model_.config();
    const std::vector<int32_t> tokens = random_tokens(mix_keys(o_.seed, 0x9f11), prompt, c.vocab_size);
    const auto run = [&](int64_t n, double* ms) -> Status {
      DSV4_ASSIGN_OR_RETURN(auto seq, model_.new_sequence(context_of(static_cast<uint64_t>(n))));
      DSV4_ASSIGN_OR_RETURN(auto t0, be_.time_point());
      for (int64_t at = 0; at < n; at += o_.chunk) {
        const int64_t len = std::min(o_.chunk, n - at);
        DSV4_ASSIGN_OR_RETURN(std::vector<float> logits,
                              model_.prefill(*seq, std::span<const int32_t>(tokens.data() + at, len)));
        if (at + len == n) DSV4_TRY(check_finite(logits, "prefill logits"));
      }
      DSV4_ASSIGN_OR_RETURN(auto t1, be_.time_point());
      DSV4_ASSIGN_OR_RETURN(*ms, be_.elapsed_ms(t0, t1));
      return Status::ok();
    };
    double ms = 0;
    if (!warmed_prefill_) {  // every kernel shape of a chunk, once
      DSV4_TRY(run(std::min(o_.chunk, prompt), &ms));
      warmed_prefill_ = true;
    }
    std::vector<double> times;
    for (int r = 0; r < o_.prefill_repeats; ++r) {
      DSV4_TRY(run(prompt, &ms));
      times.push_back(ms);
    }
    const double t = median(times);
    const double tps = prompt / (t * 1e-3);
    const double flops = cost_.prefill_flops_per_token(static_cast<uint64_t>(prompt), static_cast<uint64_t>(o_.chunk));
    const double bound_tps = ceil_.compute_tflops * 1e12 / flops;
    const std::string name = fmt::format("prefill P={} chunk={}", prompt, std::min(o_.chunk, prompt));
    report(name, tps, "tok/s", tps / bound_tps,
           fmt::format("{:.1f} ms; bound {:.0f} tok/s = {:.3g} GFLOP/token at {:.3g} TFLOP/s", t, bound_tps,
                       flops / 1e9, ceil_.compute_tflops));
    results.push_back(Json{{"kind", "prefill"}, {"prompt", prompt}, {"chunk", std::min(o_.chunk, prompt)},
                           {"ms", times}, {"median_ms", t}, {"tokens_per_second", tps},
                           {"flops_per_token", flops}, {"bound_tokens_per_second", bound_tps},
                           {"ratio", tps / bound_tps}});
    return Status::ok();
  }

  // `sequences` sequences at `depth` stepping together, one greedy token each per step.
  Status decode(int64_t sequences, int64_t depth, const char* kind) {
    const ModelConfig& c = model_.config();
    const uint64_t context = static_cast<uint64_t>(depth) + extra_steps() + 1;
    std::vector<std::unique_ptr<Sequence>> seqs;
    for (int64_t i = 0; i < sequences; ++i) {
      DSV4_ASSIGN_OR_RETURN(auto seq, model_.new_sequence(context_of(context)));
      const uint64_t seed = mix_keys(o_.seed, static_cast<uint64_t>(i) + 1);
      if (o_.fill == "random") {
        DSV4_TRY(model_.fill_for_benchmark(*seq, depth, seed));
      } else {
        const std::vector<int32_t> prompt = random_tokens(seed, depth, c.vocab_size);
        for (int64_t at = 0; at < depth; at += o_.chunk)
          DSV4_TRY(model_.prefill(*seq, std::span<const int32_t>(prompt.data() + at, std::min(o_.chunk, depth - at)))
                       .status());
      }
      seqs.push_back(std::move(seq));
    }
    const SampleSpec greedy{.temperature = 0, .adjust = {}};
    std::vector<int32_t> next = random_tokens(mix_keys(o_.seed, 0x70c), sequences, c.vocab_size);
    std::vector<BatchItem> items(static_cast<size_t>(sequences));
    ForwardOutput out;
    const auto step = [&]() -> Status {
      for (int64_t i = 0; i < sequences; ++i)
        items[i] = BatchItem{seqs[i].get(), std::span<const int32_t>(&next[i], 1), false, false, &greedy};
      DSV4_TRY(model_.forward(items, out));
      for (int64_t i = 0; i < sequences; ++i) {
        if (out.tokens[i] < 0 || static_cast<uint32_t>(out.tokens[i]) >= c.vocab_size)
          return Status::errorf(StatusCode::kInternal, "bench: sequence {} sampled token {} outside the vocabulary", i,
                                out.tokens[i]);
        next[i] = out.tokens[i];
      }
      return Status::ok();
    };
    for (int w = 0; w < o_.warmup; ++w) DSV4_TRY(step());  // direct, recorded, replayed
    std::vector<double> times;
    for (int r = 0; r < o_.repeats; ++r) {
      DSV4_ASSIGN_OR_RETURN(auto t0, be_.time_point());
      for (int s = 0; s < o_.steps; ++s) DSV4_TRY(step());
      DSV4_ASSIGN_OR_RETURN(auto t1, be_.time_point());
      DSV4_ASSIGN_OR_RETURN(double ms, be_.elapsed_ms(t0, t1));
      times.push_back(ms / o_.steps);
    }
    const double step_ms = median(times);
    const double tps = sequences / (step_ms * 1e-3);
    const double experts = cost_.expected_distinct_experts(static_cast<uint32_t>(sequences));
    const double bytes = cost_.decode_bytes(static_cast<uint32_t>(sequences), static_cast<uint64_t>(depth), experts);
    const double kv = static_cast<double>(sequences) * static_cast<double>(cost_.kv_read_bytes(depth));
    const double bound_ms = bytes / (ceil_.copy_gbs * 1e9) * 1e3;
    const double bound_tps = sequences / (bound_ms * 1e-3);
    const std::string name = fmt::format("{} B={} D={}", kind, sequences, depth);
    report(name, tps, "tok/s", tps / bound_tps,
           fmt::format("{:.3f} ms/step; bound {:.0f} tok/s = {:.4g} GB/step ({:.3g} GB KV, {:.0f} experts/layer) "
                       "at {:.0f} GB/s",
                       step_ms, bound_tps, bytes / 1e9, kv / 1e9, experts, ceil_.copy_gbs));
    results.push_back(Json{{"kind", kind}, {"sequences", sequences}, {"depth", depth}, {"fill", o_.fill},
                           {"steps", o_.steps}, {"ms_per_step", times}, {"median_ms_per_step", step_ms},
                           {"tokens_per_second", tps}, {"bytes_per_step", bytes}, {"kv_bytes_per_step", kv},
                           {"distinct_experts_per_layer", experts}, {"bound_ms_per_step", bound_ms},
                           {"bound_tokens_per_second", bound_tps}, {"ratio", tps / bound_tps}});
    return Status::ok();
  }

  uint64_t extra_steps() const { return static_cast<uint64_t>(o_.warmup + o_.repeats * o_.steps); }
  // Plain steps, then verify steps of 2, 3, 4 and 5 rows and one of 4 with logits, each run
  // `extra` times, then the rewind's verify-and-rewind rounds (one token each).
  static uint64_t spec_extra(uint64_t extra) { return extra * 19 + 32; }

  // Median ms of `fn` over the repeats, after warm-up, per call.
  Result<double> time_per_call(const std::function<Status()>& fn) {
    for (int w = 0; w < o_.warmup; ++w) DSV4_TRY(fn());
    std::vector<double> times;
    for (int r = 0; r < o_.repeats; ++r) {
      DSV4_ASSIGN_OR_RETURN(auto t0, be_.time_point());
      for (int s = 0; s < o_.steps; ++s) DSV4_TRY(fn());
      DSV4_ASSIGN_OR_RETURN(auto t1, be_.time_point());
      DSV4_ASSIGN_OR_RETURN(double ms, be_.elapsed_ms(t0, t1));
      times.push_back(ms / o_.steps);
    }
    return median(times);
  }

  // The parts of a speculative step for `sequences` sequences at `depth` (see the top).
  Status spec(int64_t sequences, int64_t depth) {
    const ModelConfig& c = model_.config();
    if (!model_.has_mtp()) return Status::error("bench: --parts spec needs a model with an MTP block");
    const uint64_t context = static_cast<uint64_t>(depth) + spec_extra(extra_steps());
    std::vector<std::unique_ptr<Sequence>> seqs;
    for (int64_t i = 0; i < sequences; ++i) {
      SequenceOptions so = context_of(context);
      so.with_mtp = true;
      DSV4_ASSIGN_OR_RETURN(auto seq, model_.new_sequence(so));
      DSV4_TRY(model_.fill_for_benchmark(*seq, depth, mix_keys(o_.seed, static_cast<uint64_t>(i) + 1)));
      seqs.push_back(std::move(seq));
    }
    const SampleSpec greedy{.temperature = 0, .adjust = {}};
    std::vector<int32_t> tokens = random_tokens(mix_keys(o_.seed, 0x59ec), sequences * 5, c.vocab_size);
    std::vector<BatchItem> items(static_cast<size_t>(sequences));
    ForwardOutput out;
    // rows 0: a plain sampled decode step; else a greedy verify step of `rows` tokens per
    // sequence (each row's arg-max from the backend, the streams back: the decoder's greedy
    // path, graph-replayed), or with `logits` every row's logits back (the sampling path).
    const auto forward_rows = [&](int64_t rows, bool logits = false) -> Status {
      for (int64_t i = 0; i < sequences; ++i) {
        const std::span<const int32_t> t(&tokens[i * 5], rows == 0 ? 1 : rows);
        items[i] = rows == 0 ? BatchItem{.sequence = seqs[i].get(), .tokens = t, .sample = &greedy}
                             : BatchItem{.sequence = seqs[i].get(), .tokens = t, .all_logits = logits,
                                         .keep_streams = true, .greedy_rows = !logits};
      }
      return model_.forward(items, out);
    };
    if (o_.verify_rows > 0) {  // a profiler's run: these steps alone
      DSV4_ASSIGN_OR_RETURN(double ms, time_per_call([&] { return forward_rows(o_.verify_rows); }));
      report(fmt::format("spec B={} D={} verify rows={}", sequences, depth, o_.verify_rows), ms, "ms", 1.0,
             "--verify-rows: greedy verify steps only");
      return Status::ok();
    }
    DSV4_ASSIGN_OR_RETURN(double plain_ms, time_per_call([&] { return forward_rows(0); }));
    std::vector<double> verify_ms;
    for (int k = 1; k <= 4; ++k) {
      DSV4_ASSIGN_OR_RETURN(double ms, time_per_call([&] { return forward_rows(k + 1); }));
      verify_ms.push_back(ms);
    }
    DSV4_ASSIGN_OR_RETURN(double logits_verify_ms, time_per_call([&] { return forward_rows(4, true); }));
    const int64_t width = int64_t{c.hc_mult} * c.hidden;
    std::vector<float> streams(static_cast<size_t>(sequences * width));
    for (size_t i = 0; i < streams.size(); ++i) streams[i] = static_cast<float>(unit_double(splitmix64(i)) - 0.5);
    std::vector<MtpItem> drafts;
    for (int64_t i = 0; i < sequences; ++i)
      drafts.push_back({seqs[i].get(), std::span<const float>(streams).subspan(i * width, width),
                        std::span<const int32_t>(&tokens[i * 5], 1)});
    DSV4_ASSIGN_OR_RETURN(double draft_ms, time_per_call([&] { return model_.mtp(drafts).status(); }));
    // The rollback speculative decoding runs: Model::rewind of every sequence by 4 tokens
    // after a k = 4 verify (host bookkeeping and page releases, no device work), on the host
    // clock after the verify has finished; without rewind (V4.1) a snapshot + restore.
    const bool rewind = model_.can_rewind();
    double rollback_ms = 0;
    if (rewind) {
      std::vector<double> times;
      for (int r = 0; r < std::max(o_.repeats, 3); ++r) {
        DSV4_TRY(forward_rows(5));
        DSV4_TRY(model_.backend().synchronize());
        const auto t0 = std::chrono::steady_clock::now();
        for (auto& seq : seqs)
          DSV4_TRY(model_.rewind(*seq, seq->position() - 4, std::min(seq->mtp_position(), seq->position() - 4)));
        times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      }
      rollback_ms = median(times);
    } else {
      DSV4_ASSIGN_OR_RETURN(rollback_ms, time_per_call([&]() -> Status {
        for (auto& seq : seqs) {
          DSV4_ASSIGN_OR_RETURN(SequenceSnapshot snap, model_.snapshot(*seq));
          DSV4_TRY(model_.restore(*seq, snap));
        }
        return Status::ok();
      }));
    }

    // A step at k drafts and acceptance a: E = (1 - a^(k+1)) / (1 - a) tokens for a verify,
    // k draft passes and the rollback; without rewind also (when a draft fails, 1 - a^k) a
    // replay of the kept tokens, costed as a plain step.
    const auto speedup = [&](int k, double a) {
      const double tokens_per_step = a >= 1.0 ? k + 1.0 : (1.0 - std::pow(a, k + 1)) / (1.0 - a);
      const double replay = rewind ? 0.0 : (1.0 - std::pow(a, k)) * plain_ms;
      const double step = verify_ms[k - 1] + k * draft_ms + rollback_ms + replay;
      return tokens_per_step * plain_ms / step;
    };
    const std::string name = fmt::format("spec B={} D={}", sequences, depth);
    report(name + " plain step", plain_ms, "ms", 1.0, "a decode step (graph path where the backend records graphs)");
    report(name + " draft", draft_ms, "ms", draft_ms / plain_ms, "one MTP pass, one row per sequence");
    report(name + " verify k=3 with logits", logits_verify_ms, "ms", logits_verify_ms / plain_ms,
           "4 rows/sequence, every row's logits back (the sampling path; not graph-replayed)");
    report(name + (rewind ? " rollback" : " rollback copies"), rollback_ms, "ms", rollback_ms / plain_ms,
           rewind ? "Model::rewind of every sequence by 4 tokens (host; no copies)"
                  : "snapshot + restore of every sequence (plus a replay when a draft fails)");
    Json per_k = Json::array();
    for (int k = 1; k <= 4; ++k) {
      double break_even = -1;
      for (int a = 0; a <= 100 && break_even < 0; ++a)
        if (speedup(k, a / 100.0) >= 1.0) break_even = a / 100.0;
      Json by_acceptance = Json::object();
      std::string line;
      for (double a : {0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0}) {
        by_acceptance[fmt::format("{:.1f}", a)] = speedup(k, a);
        line += fmt::format(" {:.1f}:{:.2f}x", a, speedup(k, a));
      }
      report(fmt::format("{} verify k={}", name, k), verify_ms[k - 1], "ms", verify_ms[k - 1] / plain_ms,
             fmt::format("{} rows/sequence; speedup by acceptance{}; break-even acceptance {}", k + 1, line,
                         break_even < 0 ? std::string("none") : fmt::format("{:.2f}", break_even)));
      per_k.push_back(Json{{"k", k}, {"verify_ms", verify_ms[k - 1]}, {"verify_over_plain", verify_ms[k - 1] / plain_ms},
                           {"speedup_by_acceptance", by_acceptance},
                           {"break_even_acceptance", break_even < 0 ? Json(nullptr) : Json(break_even)}});
    }
    results.push_back(Json{{"kind", "spec"}, {"sequences", sequences}, {"depth", depth}, {"plain_ms", plain_ms},
                           {"draft_ms", draft_ms}, {"rollback_ms", rollback_ms},
                           {"verify_k3_logits_ms", logits_verify_ms},
                           {"rollback", rewind ? "rewind" : "snapshot+restore+replay"}, {"by_k", per_k}});
    return Status::ok();
  }

  // Speculative greedy decoding end to end at batch 1 (issue 15's test mode,
  // SpecOptions::forced_draft): a plain greedy run of kTokens tokens after a random prompt
  // records the target's tokens; then the decoder with drafts forced to agree (acceptance
  // 100%), forced to agree at about half the positions (a hash of the position), and with the
  // MTP block's own drafts (random weights: next to none accepted; adaptive k), each on the
  // same prompt. A run is timed whole (every step returns its tokens to the host), warm: each
  // setting runs twice and the second run counts. Every run's tokens must equal the plain
  // run's (greedy speculation is exact); a difference is reported, not hidden.
  Status spec_end_to_end() {
    const ModelConfig& c = model_.config();
    constexpr int64_t kPrompt = 64, kTokens = 96;
    const std::vector<int32_t> prompt = random_tokens(mix_keys(o_.seed, 0x5e2e), kPrompt, c.vocab_size);
    SequenceOptions so = context_of(static_cast<uint64_t>(kPrompt + kTokens + 8));
    so.with_mtp = true;
    std::vector<int32_t> want;
    const auto plain = [&](double* ms) -> Status {
      DSV4_ASSIGN_OR_RETURN(auto seq, model_.new_sequence(so));
      DSV4_ASSIGN_OR_RETURN(std::vector<float> logits, model_.prefill(*seq, prompt));
      int32_t last = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      std::vector<int32_t> got{last};
      const SampleSpec greedy{.temperature = 0, .adjust = {}};
      ForwardOutput out;
      DSV4_ASSIGN_OR_RETURN(auto t0, be_.time_point());
      while (static_cast<int64_t>(got.size()) < kTokens) {
        const BatchItem item{.sequence = seq.get(), .tokens = std::span<const int32_t>(&last, 1), .sample = &greedy};
        DSV4_TRY(model_.forward(std::span<const BatchItem>(&item, 1), out));
        got.push_back(last = out.tokens[0]);
      }
      DSV4_ASSIGN_OR_RETURN(auto t1, be_.time_point());
      DSV4_ASSIGN_OR_RETURN(*ms, be_.elapsed_ms(t0, t1));
      want = std::move(got);
      return Status::ok();
    };
    double plain_ms = 0;
    DSV4_TRY(plain(&plain_ms));
    DSV4_TRY(plain(&plain_ms));
    const double plain_tps = (kTokens - 1) / (plain_ms * 1e-3);
    report("spec B=1 end to end plain", plain_tps, "tok/s", 1.0,
           fmt::format("{} greedy tokens after a {}-token prompt, device-sampled decode steps", kTokens - 1, kPrompt));
    Json runs = Json::array();
    const auto speculative = [&](const char* what, runtime::SpecOptions opts) -> Status {
      double ms = 0;
      runtime::SpecStats stats;
      int64_t first_difference = -1;
      for (int pass = 0; pass < 2; ++pass) {
        DSV4_ASSIGN_OR_RETURN(auto seq, model_.new_sequence(so));
        runtime::SpeculativeDecoder dec(model_, opts);
        runtime::SpecSequence s;
        s.sequence = seq.get();
        DSV4_ASSIGN_OR_RETURN(const int32_t first, dec.start(s, prompt));
        std::vector<int32_t> got{first};
        std::vector<std::vector<int32_t>> emitted;
        runtime::SpecSequence* one = &s;
        DSV4_ASSIGN_OR_RETURN(auto t0, be_.time_point());
        while (static_cast<int64_t>(got.size()) < kTokens) {
          DSV4_TRY(dec.step(std::span<runtime::SpecSequence* const>(&one, 1), emitted));
          got.insert(got.end(), emitted[0].begin(), emitted[0].end());
        }
        DSV4_ASSIGN_OR_RETURN(auto t1, be_.time_point());
        DSV4_ASSIGN_OR_RETURN(ms, be_.elapsed_ms(t0, t1));
        got.resize(kTokens);
        first_difference = -1;
        for (int64_t i = 0; i < kTokens && first_difference < 0; ++i)
          if (got[i] != want[i]) first_difference = i;
        stats = s.stats;
      }
      const double tps = static_cast<double>(kTokens - 1) / (ms * 1e-3);
      report(fmt::format("spec B=1 end to end {}", what), tps, "tok/s", tps / plain_tps,
             fmt::format("ratio = x plain; acceptance {:.2f}, {:.2f} tokens/step; {}", stats.acceptance(),
                         stats.tokens_per_step(),
                         first_difference < 0 ? std::string("the plain run's tokens")
                                              : fmt::format("DIFFERS from the plain run at token {}", first_difference)));
      runs.push_back(Json{{"drafts", what}, {"max_k", opts.max_k}, {"adaptive", opts.adaptive},
                          {"tokens_per_second", tps}, {"over_plain", tps / plain_tps},
                          {"acceptance", stats.acceptance()}, {"tokens_per_step", stats.tokens_per_step()},
                          {"identical", first_difference < 0}});
      return Status::ok();
    };
    const auto at = [&](int64_t position) { return want.at(static_cast<size_t>(position - kPrompt)); };
    runtime::SpecOptions agree;
    agree.max_k = 3;
    agree.adaptive = false;
    agree.forced_draft = [&](int64_t position) { return position - kPrompt < kTokens ? at(position) : 0; };
    DSV4_TRY(speculative("forced 100% k=3", agree));
    runtime::SpecOptions half = agree;
    half.forced_draft = [&](int64_t position) {
      if (position - kPrompt >= kTokens) return 0;
      const bool agrees = (static_cast<uint64_t>(position) * 0x9E3779B97F4A7C15ull) >> 63;
      return agrees ? at(position) : static_cast<int32_t>((at(position) + 1) % c.vocab_size);
    };
    DSV4_TRY(speculative("forced ~50% k=3", half));
    half.max_k = 1;
    DSV4_TRY(speculative("forced ~50% k=1", half));
    runtime::SpecOptions own;  // as dsv4 run speculates
    own.max_k = 3;
    own.measured_costs = true;
    DSV4_TRY(speculative("MTP drafts adaptive k<=3", own));
    agree.adaptive = true;  // drafts that always agree: adaptive k must keep drafting where it pays
    agree.measured_costs = true;
    DSV4_TRY(speculative("forced 100% adaptive k<=3", agree));
    results.push_back(Json{{"kind", "spec_end_to_end"}, {"prompt", kPrompt}, {"tokens", kTokens - 1},
                           {"plain_tokens_per_second", plain_tps}, {"runs", runs}});
    return Status::ok();
  }

 private:
  static Status check_finite(const std::vector<float>& v, const char* what) {
    for (float x : v)
      if (!std::isfinite(x)) return Status::errorf(StatusCode::kInternal, "bench: {} not finite", what);
    return Status::ok();
  }

  void report(const std::string& name, double value, const char* unit, double ratio, const std::string& note) {
    const std::string label = o_.label.empty() ? name : o_.label + " " + name;
    fmt::print("{:<40} {:>10.1f} {:<6} ratio {:.3f}  {}\n", label, value, unit, ratio, note);
    fmt::print("TABLE|dsv4|{}|{:.2f}|{}|{:.3f}|{}\n", label, value, unit, ratio, note);
    std::fflush(stdout);
  }

  const BenchOptions& o_;
  backend::Backend& be_;
  const Model& model_;
  const StepCost& cost_;
  const Ceilings& ceil_;
  bool warmed_prefill_ = false;
};

// The cache a device must hold for the largest scenario: every sequence's growing rows at
// its deepest, with room for page rounding and the split between row widths.
Result<KvCacheOptions> device_cache(const BenchOptions& o, const ModelConfig& c, uint64_t extra) {
  KvCacheOptions kc;
  uint64_t longest = 1, pool = 0;
  uint32_t sequences = 1;
  const auto need = [&](uint64_t n, uint64_t context) -> Status {
    DSV4_ASSIGN_OR_RETURN(CachePlan plan, CachePlan::compute(c, std::min(context, c.context_length), false, kc.page_rows));
    pool = std::max(pool, n * (plan.total() - plan.fixed()));
    longest = std::max(longest, context);
    sequences = std::max<uint32_t>(sequences, static_cast<uint32_t>(n));
    return Status::ok();
  };
  if (wants(o, "prefill"))
    for (int64_t p : o.prefill) DSV4_TRY(need(1, static_cast<uint64_t>(p)));
  if (wants(o, "decode"))
    for (int64_t d : o.depths) DSV4_TRY(need(1, static_cast<uint64_t>(d) + extra + 1));
  if (wants(o, "aggregate"))
    for (int64_t b : o.batches) DSV4_TRY(need(static_cast<uint64_t>(b), static_cast<uint64_t>(o.batch_depth) + extra + 1));
  if (wants(o, "spec"))
    for (int64_t b : o.batches)
      DSV4_TRY(need(static_cast<uint64_t>(b), static_cast<uint64_t>(o.batch_depth) + Bench::spec_extra(extra)));
  kc.max_sequences = sequences;
  kc.max_context = std::min<uint64_t>((longest + 255) / 256 * 256, c.context_length);
  kc.pool_bytes = pool + pool / 4 + (uint64_t{64} << 20);
  return kc;
}

Status check_options(const BenchOptions& o) {
  for (const std::string& p : o.parts)
    if (p != "prefill" && p != "decode" && p != "aggregate" && p != "spec")
      return Status::errorf("--parts: unknown part \"{}\" (prefill, decode, aggregate, spec)", p);
  const auto positive = [](const std::vector<int64_t>& v, const char* flag) -> Status {
    for (int64_t x : v)
      if (x <= 0) return Status::errorf("{} {}: must be positive", flag, x);
    return Status::ok();
  };
  DSV4_TRY(positive(o.prefill, "--prefill"));
  for (int64_t d : o.depths)
    if (d < 0) return Status::errorf("--depths {}: must be at least 0", d);
  DSV4_TRY(positive(o.batches, "--batches"));
  for (int64_t b : o.batches)
    if (b > 64) return Status::errorf("--batches {}: at most 64 sequences step together", b);
  if (o.chunk <= 0 || o.batch_depth < 0 || o.steps <= 0 || o.repeats <= 0 || o.prefill_repeats <= 0 || o.warmup < 0)
    return Status::error("--chunk, --steps, --repeats and --prefill-repeats must be positive, --warmup and "
                         "--batch-depth at least 0");
  return Status::ok();
}

int run_bench(const BenchOptions& o) {
  const auto fail = [](const Status& s, int code = kExitFailure) {
    fmt::print(stderr, "dsv4 bench: {}\n", s.message());
    return code;
  };
  if (Status s = check_options(o); !s) return fail(s, kExitUsage);
  auto chosen = make_backend(o.backend, "dsv4 bench");
  if (!chosen.is_ok()) return fail(chosen.status());
  std::string device = chosen->name;
#ifdef DSV4_HAVE_CUDA
  if (chosen->device)
    if (auto info = cuda::query_device(0); info.is_ok())
      device = fmt::format("cuda: {} ({} SMs, {:.0f} GiB)", info->name, info->sm_count,
                           static_cast<double>(info->global_memory_bytes) / (1 << 30));
#endif
  fmt::print("backend {}\n", device);
  auto ceilings = measure_ceilings(*chosen);
  if (!ceilings.is_ok()) return fail(ceilings.status());
  fmt::print("ceilings: copy {:.0f} GB/s ({}); compute {:.3g} TFLOP/s ({})\n", ceilings->copy_gbs,
             ceilings->copy_what, ceilings->compute_tflops, ceilings->compute_what);

  ModelFilesOptions header_only;
  header_only.open.map_data = false;
  auto files = ModelFiles::open(o.model, header_only);
  if (!files.is_ok()) return fail(files.status());
  ModelOptions mo;
  mo.matmul = matmul_mode(o.backend, *chosen);
  auto device_memory = device_memory_bytes(o.backend);
  if (!device_memory.is_ok()) return fail(device_memory.status());
  mo.device_memory = *device_memory;
  mo.graphs = !o.no_graphs;
  // Warm-up and timed steps move each sequence past its depth.
  const uint64_t extra = static_cast<uint64_t>(o.warmup + o.repeats * o.steps);
  if (chosen->device) {
    auto kc = device_cache(o, files->config(), extra);
    if (!kc.is_ok()) return fail(kc.status());
    mo.cache = *kc;
  }
  const double t0 = backend::Backend::host_clock_ms();
  auto model = Model::load(o.model, *chosen->backend, mo);
  if (!model.is_ok()) return fail(model.status());
  const double load_s = (backend::Backend::host_clock_ms() - t0) / 1e3;
  const ModelConfig& c = (*model)->config();
  auto cost = StepCost::of(c, (*model)->files().tensors());
  if (!cost.is_ok()) return fail(cost.status());
  uint64_t file_bytes = 0;
  for (const auto& t : (*model)->files().tensors()) file_bytes += t.nbytes;
  fmt::print("model {}: {} layers, {:.4g} GB of tensors, loaded in {:.1f} s; numerics {}; per step {:.4g} GB "
             "of weights besides experts, {:.3g} MB per expert per layer; cache {} sequences x {} tokens\n",
             o.model, c.n_layers, static_cast<double>(file_bytes) / 1e9, load_s,
             mo.matmul == backend::MatmulMode::Exact ? "exact" : "quantized",
             static_cast<double>(cost->always_bytes) / 1e9,
             cost->expert_bytes.empty() ? 0.0 : static_cast<double>(cost->expert_bytes.back()) / 1e6,
             (*model)->cache().options().max_sequences, (*model)->cache().max_context());

  Bench bench(o, *chosen, **model, *cost, *ceilings);
  // The JSON file is rewritten after every figure, so a run stopped early keeps what it measured.
  const auto write_json = [&](const Status& st) -> Status {
    if (o.json.empty()) return Status::ok();
    Json j{{"model", o.model},
           {"label", o.label},
           {"backend", device},
           {"numerics", mo.matmul == backend::MatmulMode::Exact ? "exact" : "quantized"},
           {"graphs", !o.no_graphs},
           {"layers", c.n_layers},
           {"tensor_bytes", file_bytes},
           {"load_seconds", load_s},
           {"copy_gbs", ceilings->copy_gbs},
           {"copy_what", ceilings->copy_what},
           {"compute_tflops", ceilings->compute_tflops},
           {"compute_what", ceilings->compute_what},
           {"weights_bytes_every_step", cost->always_bytes},
           {"expert_bytes_per_layer", cost->expert_bytes},
           {"params_per_token", cost->token_params},
           {"results", bench.results},
           {"error", st.is_ok() ? "" : st.message()}};
    std::ofstream out(o.json);
    out << j.dump(2) << "\n";
    if (!out) return Status::errorf(StatusCode::kIo, "{}: cannot write the JSON file", o.json);
    return Status::ok();
  };
  Status st = write_json(Status::ok());
  const auto measured = [&](Status s) {
    if (Status w = write_json(s); !w.is_ok() && s.is_ok()) return w;
    return s;
  };
  if (wants(o, "decode"))
    for (int64_t d : o.depths)
      if (st.is_ok()) st = measured(bench.decode(1, d, "decode"));
  if (wants(o, "aggregate"))
    for (int64_t b : o.batches)
      if (st.is_ok()) st = measured(bench.decode(b, o.batch_depth, "aggregate"));
  if (wants(o, "spec")) {
    std::vector<int64_t> sizes{1};
    for (int64_t b : o.batches)
      if (b != 1) sizes.push_back(b);
    for (int64_t b : sizes)
      if (st.is_ok()) st = measured(bench.spec(b, o.batch_depth));
    if (st.is_ok() && o.verify_rows == 0) st = measured(bench.spec_end_to_end());
  }
  if (wants(o, "prefill"))
    for (int64_t p : o.prefill)
      if (st.is_ok()) st = measured(bench.prefill(p));
  if (!st.is_ok()) return fail(st);
  return kExitOk;
}

}  // namespace

void register_bench(CLI::App& app, CommandRunner& run) {
  auto o = std::make_shared<BenchOptions>();
  app.add_option("-m,--model", o->model, "GGUF model file")->required()->check(CLI::ExistingFile);
  add_backend_flags(app, o->backend);
  app.add_option("-t,--threads", o->backend.threads, "CPU threads (default: all)")->check(CLI::NonNegativeNumber);
  app.add_option("--parts", o->parts, "what to measure: prefill, decode, aggregate, spec (MTP speculation)")->delimiter(',')->capture_default_str();
  app.add_option("--prefill", o->prefill, "prompt lengths")->delimiter(',')->capture_default_str();
  app.add_option("--chunk", o->chunk, "prefill chunk (tokens per step)")->capture_default_str();
  app.add_option("--depths", o->depths, "context depths of batch-1 decode")->delimiter(',')->capture_default_str();
  app.add_option("--batches", o->batches, "sequences stepping together (aggregate decode, at most 64)")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--batch-depth", o->batch_depth, "context depth of every aggregate sequence")->capture_default_str();
  app.add_option("--fill", o->fill,
                 "how sequences reach their depth: random (the cache filled with random values, no compute) or "
                 "prefill (real prefill of random tokens)")
      ->check(CLI::IsMember({"random", "prefill"}))
      ->capture_default_str();
  app.add_option("--steps", o->steps, "decode steps per timed repeat")->capture_default_str();
  app.add_option("--repeats", o->repeats, "timed decode repeats (the median is reported)")->capture_default_str();
  app.add_option("--prefill-repeats", o->prefill_repeats, "timed prefills per length")->capture_default_str();
  app.add_option("--warmup", o->warmup, "untimed decode steps first (direct, graph recording, replay)")
      ->capture_default_str();
  app.add_flag("--no-graphs", o->no_graphs, "run decode steps directly, not replayed from graphs");
  app.add_option("--verify-rows", o->verify_rows,
                 "with --parts spec: time only greedy verify steps of N rows per sequence (1..5), e.g. under a profiler")
      ->check(CLI::Range(1, 5));
  app.add_option("--seed", o->seed, "seed of the tokens and the cache fill")->capture_default_str();
  app.add_option("--label", o->label, "prefix of every figure's name (e.g. the model)");
  app.add_option("--json", o->json, "write every measurement, bound and ceiling to this JSON file");
  run = [o] { return run_bench(*o); };
}

}  // namespace dsv4::cli
