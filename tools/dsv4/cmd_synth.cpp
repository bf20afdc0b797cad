// dsv4 synth: write a runnable `deepseek4` GGUF with seeded random weights of a preset's
// geometry (tiny, small, or the full V4-Flash), streamed to disk.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "commands.h"
#include "synth/presets.h"
#include "synth/synth.h"

namespace dsv4::cli {
namespace {

struct SynthCliOptions {
  std::string preset;
  uint32_t layers = 0;
  std::string expert_type;
  std::string dense_type;
  uint64_t seed = 0;
  std::string output;
  bool force = false;
  bool no_tokenizer = false;
  bool bundled = false;
};

int fail(const Status& s) {
  fmt::print(stderr, "dsv4 synth: {}\n", s.message());
  return kExitFailure;
}

int run_synth(const SynthCliOptions& o) {
  auto preset = find_preset(o.preset);
  if (!preset.is_ok()) {
    fmt::print(stderr, "dsv4 synth: {}\n", preset.status().message());
    return kExitUsage;
  }
  SynthOptions opts;
  opts.config = preset->config;
  if (o.layers) {
    auto cut = keep_first_layers(opts.config, o.layers);
    if (!cut.is_ok()) {
      fmt::print(stderr, "dsv4 synth: {}\n", cut.status().message());
      return kExitUsage;
    }
    opts.config = *cut;
    opts.config.name += fmt::format(", first {} layers", o.layers);
  }
  opts.expert_type = preset->default_expert_type;
  opts.dense_type = preset->default_dense_type;
  for (auto [text, target] : {std::pair{&o.expert_type, &opts.expert_type},
                              std::pair{&o.dense_type, &opts.dense_type}}) {
    if (text->empty()) continue;
    auto t = ggml_type_from_name(*text);
    if (!t) {
      fmt::print(stderr, "dsv4 synth: unknown tensor type \"{}\"\n", *text);
      return kExitUsage;
    }
    *target = *t;
  }
  opts.seed = o.seed;
  opts.preset_name = o.preset;
  opts.overwrite = o.force;
  opts.write_tokenizer = !o.no_tokenizer;
  opts.layout = o.bundled ? WriteLayout::Bundled : WriteLayout::TrunkAndSidecar;

  const auto start = std::chrono::steady_clock::now();
  int last_percent = -1;
  opts.on_progress = [&](size_t done, size_t total, uint64_t bytes) {
    const int percent = static_cast<int>(100 * done / total);
    if (percent / 10 != last_percent / 10 || done == total) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      fmt::print(stderr, "dsv4 synth: {:3d}% ({} of {} tensors, {:.2f} GiB, {:.0f} s)\n", percent, done,
                 total, static_cast<double>(bytes) / (1 << 30), s);
      last_percent = percent;
    }
  };
  auto report = write_synthetic_model(o.output, opts);
  if (!report.is_ok()) return fail(report.status());
  for (const auto& note : report->notes) fmt::print(stderr, "dsv4 synth: note: {}\n", note);
  fmt::print("wrote {}: preset {}, {} layers + {} MTP, experts {}, other matrices {}, seed {}, {} "
             "tensors, {} bytes of tensor data\n",
             fmt::join(report->paths, " + "), o.preset, opts.config.n_layers, opts.config.n_mtp,
             ggml_type_name(opts.expert_type), ggml_type_name(opts.dense_type), o.seed,
             report->n_tensors, report->data_bytes);
  return kExitOk;
}

}  // namespace

void register_synth(CLI::App& app, CommandRunner& run) {
  auto o = std::make_shared<SynthCliOptions>();
  app.add_option("--preset", o->preset, "geometry: tiny, small, flash, tiny41, small41, flash41")->required();
  app.add_option("--layers", o->layers, "keep only the first N trunk layers (and the MTP block)")
      ->check(CLI::PositiveNumber);
  app.add_option("--experts", o->expert_type, "routed-expert type, e.g. q2_K, q4_K, q8_0, mxfp4");
  app.add_option("--dense", o->dense_type, "type of every other matrix, e.g. q8_0, bf16");
  app.add_option("--seed", o->seed, "random seed")->required();
  app.add_option("-o,--output", o->output, "output .gguf file")->required();
  app.add_flag("--force", o->force, "replace an existing output file");
  app.add_flag("--no-tokenizer", o->no_tokenizer, "leave out the tokenizer metadata");
  app.add_flag("--bundled", o->bundled,
               "one file with the MTP block inside (default: llama.cpp's trunk + mtp-<name> sidecar)");
  run = [o] { return run_synth(*o); };
}

}  // namespace dsv4::cli
