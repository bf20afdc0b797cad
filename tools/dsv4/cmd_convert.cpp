// dsv4 convert: DeepSeek's official checkpoint (safetensors, FP8/FP4) -> deepseek4 GGUF.
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "convert/converter.h"

namespace dsv4::cli {
namespace {

struct ConvertCliOptions {
  std::string checkpoint;
  std::string output;
  std::string recipe = "q2k";
  std::vector<std::string> types;
  std::string split_max_size;
  int threads = 0;
  bool force = false;
  bool bundled = false;
  bool dry_run = false;
  bool keep_vision = false;
};

// "50G", "500M", "64K" (powers of 1000, as llama.cpp's gguf-split reads them) or bytes.
Result<uint64_t> parse_size(const std::string& text) {
  if (text.empty()) return uint64_t{0};
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string unit = text.substr(used);
  double mult = 1;
  if (unit == "K" || unit == "k") mult = 1e3;
  else if (unit == "M" || unit == "m") mult = 1e6;
  else if (unit == "G" || unit == "g") mult = 1e9;
  else if (unit == "T" || unit == "t") mult = 1e12;
  else if (!unit.empty()) used = 0;
  if (used == 0 || value <= 0)
    return Status::errorf("--split-max-size {}: expected a size such as 50G, 500M or 1000000", text);
  return static_cast<uint64_t>(value * mult);
}

std::string format_duration(double s) {
  const long t = static_cast<long>(s + 0.5);
  if (t >= 3600) return fmt::format("{}h{:02d}m", t / 3600, (t / 60) % 60);
  if (t >= 60) return fmt::format("{}m{:02d}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

// One status line redrawn in place on a terminal; nothing when stderr is not a terminal.
class ProgressBar {
 public:
  ProgressBar() : enabled_(isatty(STDERR_FILENO) == 1), start_(std::chrono::steady_clock::now()) {}

  void update(const convert::ConvertProgress& p) {
    if (!enabled_) return;
    const auto now = std::chrono::steady_clock::now();
    const bool done = p.tensors_done == p.tensors_total;
    if (!done && now - last_ < std::chrono::milliseconds(200)) return;
    last_ = now;
    const double s = std::chrono::duration<double>(now - start_).count();
    const double frac = p.bytes_total ? static_cast<double>(p.bytes_done) / static_cast<double>(p.bytes_total) : 1;
    const double rate = s > 0 ? static_cast<double>(p.bytes_done) / s : 0;
    const std::string eta = rate > 0 && !done
        ? format_duration(static_cast<double>(p.bytes_total - p.bytes_done) / rate) : "-";
    constexpr int kWidth = 24;
    const int filled = static_cast<int>(frac * kWidth);
    fmt::print(stderr, "\r[{}{}] {:3.0f}% {}/{} tensors {:.2f}/{:.2f} GB {:.0f} MB/s ETA {} {:<40.40}",
               std::string(filled, '#'), std::string(kWidth - filled, '.'), 100 * frac, p.tensors_done,
               p.tensors_total, static_cast<double>(p.bytes_done) / 1e9,
               static_cast<double>(p.bytes_total) / 1e9, rate / 1e6, eta, p.current);
    if (done) fmt::print(stderr, "\n");
    std::fflush(stderr);
  }

 private:
  bool enabled_;
  std::chrono::steady_clock::time_point start_, last_{};
};

// Set by SIGINT / SIGTERM: the converter stops between chunks and removes its temporary
// output, so an interrupted conversion leaves nothing behind.
std::atomic<bool> g_cancel{false};
extern "C" void on_stop_signal(int) { g_cancel.store(true); }

int run_convert(const ConvertCliOptions& o) {
  auto usage = [](const Status& s) {
    fmt::print(stderr, "dsv4 convert: {}\n", s.message());
    return kExitUsage;
  };
  auto recipe = convert::recipe_by_name(o.recipe);
  if (!recipe) return usage(recipe.status());
  for (const std::string& t : o.types)
    if (Status s = convert::apply_type_override(*recipe, t); !s) return usage(s);
  recipe->keep_vision = o.keep_vision;
  auto split = parse_size(o.split_max_size);
  if (!split) return usage(split.status());

  if (o.dry_run) {
    auto config = convert::read_checkpoint_config(o.checkpoint);
    if (!config) {
      fmt::print(stderr, "dsv4 convert: {}\n", config.status().message());
      return kExitFailure;
    }
    auto plan = convert::plan_conversion(*config, *recipe);
    if (!plan) {
      fmt::print(stderr, "dsv4 convert: {}\n", plan.status().message());
      return kExitFailure;
    }
    fmt::print("dry run (nothing written): {}", convert::ConvertSummary::of_plan(std::move(*plan)).to_string());
    return kExitOk;
  }
  if (o.output.empty()) return usage(Status::error("-o/--output is required (or --dry-run)"));

  convert::ConvertOptions opts;
  opts.checkpoint_dir = o.checkpoint;
  opts.output = o.output;
  opts.recipe = *recipe;
  opts.split_max_bytes = *split;
  opts.layout = o.bundled ? WriteLayout::Bundled : WriteLayout::TrunkAndSidecar;
  opts.threads = o.threads;
  opts.force = o.force;
  ProgressBar bar;
  opts.on_progress = [&](const convert::ConvertProgress& p) { bar.update(p); };
  opts.cancel = &g_cancel;
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  auto summary = convert::convert_checkpoint(opts);
  if (!summary && summary.status().message() == convert::kInterrupted) {
    fmt::print(stderr, "\ndsv4 convert: interrupted; no output written\n");
    return kExitInterrupted;
  }
  if (!summary) {
    fmt::print(stderr, "\ndsv4 convert: {}\n", summary.status().message());
    return kExitFailure;
  }
  fmt::print("{}", summary->to_string());
  return kExitOk;
}

}  // namespace

void register_convert(CLI::App& app, CommandRunner& run) {
  auto o = std::make_shared<ConvertCliOptions>();
  std::string recipes = "conversion recipe:";
  for (const auto& r : convert::recipe_list()) recipes += fmt::format("\n  {}: {}", r.name, r.summary);
  app.add_option("checkpoint", o->checkpoint, "official checkpoint folder (config.json, safetensors)")
      ->required();
  app.add_option("-o,--output", o->output, "output .gguf file");
  app.add_option("--recipe", o->recipe, recipes)->capture_default_str();
  app.add_option("--type", o->types,
                 "ROLE=TYPE override, repeatable; roles: experts, experts_down, attention, shared, "
                 "embedding, head, indexer, compressor, router, mtp, small, engram (V4.1 tables: i8 = the official "
                 "FP8 rows, or a matrix type), all");
  app.add_option("--split-max-size", o->split_max_size, "split the output into parts of at most SIZE (e.g. 50G)");
  app.add_option("--threads", o->threads, "worker threads (default: all cores)")->check(CLI::NonNegativeNumber);
  app.add_flag("--force", o->force, "replace an existing output file");
  app.add_flag("--bundled", o->bundled,
               "one file with the MTP block inside (default: llama.cpp's trunk + mtp-<name> sidecar)");
  app.add_flag("--keep-vision", o->keep_vision,
               "V4.1: keep the vision tower and the image-token routing bias (dropped by default)");
  app.add_flag("--dry-run", o->dry_run, "print the plan (types, sizes, fallbacks) from config.json only");
  run = [o] { return run_convert(*o); };
}

}  // namespace dsv4::cli
