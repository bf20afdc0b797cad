// dsv4 synth-checkpoint: write a checkpoint in DeepSeek's official release format (the
// input of `dsv4 convert`) of a preset's geometry, or of a config.json's, with random
// weights.
#include <fmt/format.h>

#include <memory>
#include <string>

#include "commands.h"
#include "convert/synthetic_checkpoint.h"
#include "synth/presets.h"

namespace dsv4::cli {
namespace {

struct SynthCheckpointCliOptions {
  std::string preset;
  std::string config_path;
  uint32_t layers = 0;
  uint64_t seed = 0;
  std::string output;
  double shard_gb = 4.0;
  int threads = 0;
  bool tokenizer = false;
  bool force = false;
};

int run_synth_checkpoint(const SynthCheckpointCliOptions& o) {
  auto usage = [](const Status& s) {
    fmt::print(stderr, "dsv4 synth-checkpoint: {}\n", s.message());
    return kExitUsage;
  };
  convert::SyntheticCheckpointOptions opts;
  if (o.preset.empty() == o.config_path.empty())
    return usage(Status::error("give exactly one of --preset and --config"));
  if (!o.preset.empty()) {
    auto preset = find_preset(o.preset);
    if (!preset) return usage(preset.status());
    opts.config.model = preset->config;
    if (opts.config.model.is_v41()) {  // the V4.1 release's FP8 weight blocks
      opts.config.format.fp8_block_rows = 32;
      opts.config.format.fp8_block_cols = 32;
    }
  } else {
    auto config = convert::read_checkpoint_config(o.config_path);
    if (!config) return usage(config.status());
    opts.config = *config;
  }
  if (o.layers) {
    auto cut = keep_first_layers(opts.config.model, o.layers);
    if (!cut) return usage(cut.status());
    opts.config.model = *cut;
  }
  opts.seed = o.seed;
  opts.shard_max_bytes = static_cast<uint64_t>(o.shard_gb * 1e9);
  opts.threads = o.threads;
  opts.write_tokenizer = o.tokenizer;
  opts.overwrite = o.force;
  auto report = convert::write_synthetic_checkpoint(o.output, opts);
  if (!report) {
    fmt::print(stderr, "dsv4 synth-checkpoint: {}\n", report.status().message());
    return kExitFailure;
  }
  fmt::print("wrote {}: {} layers + {} MTP, {} tensors in {} shard{}, {} bytes of tensor data, seed {}\n",
             o.output, opts.config.model.n_layers, opts.config.model.n_mtp, report->n_tensors,
             report->shards.size(), report->shards.size() == 1 ? "" : "s", report->data_bytes, o.seed);
  return kExitOk;
}

}  // namespace

void register_synth_checkpoint(CLI::App& app, CommandRunner& run) {
  auto o = std::make_shared<SynthCheckpointCliOptions>();
  app.add_option("--preset", o->preset, "geometry: tiny, small, flash, tiny41, small41, flash41");
  app.add_option("--config", o->config_path, "geometry from a checkpoint folder's config.json (give the folder)");
  app.add_option("--layers", o->layers, "keep only the first N trunk layers (and the MTP block)")
      ->check(CLI::PositiveNumber);
  app.add_option("--seed", o->seed, "random seed")->required();
  app.add_option("-o,--output", o->output, "output checkpoint folder")->required();
  app.add_option("--shard-gb", o->shard_gb, "data bytes per shard, in GB")->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--threads", o->threads, "worker threads (default: all cores)")->check(CLI::NonNegativeNumber);
  app.add_flag("--tokenizer", o->tokenizer,
               "also write DeepSeek-V4's tokenizer.json (vocab >= 129280; always written for V4.1)");
  app.add_flag("--force", o->force, "write into a folder that already holds a checkpoint");
  run = [o] { return run_synth_checkpoint(*o); };
}

}  // namespace dsv4::cli
