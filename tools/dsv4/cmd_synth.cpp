// dsv4 synth: write a runnable `deepseek4` GGUF with seeded random weights of a preset's
// geometry (tiny, small, or the full V4-Flash), streamed to disk. --recipe takes the
// converter's per-role types; --fill random-blocks writes benchmark weights at memory speed.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "commands.h"
#include "convert/recipe.h"
#include "synth/presets.h"
#include "synth/synth.h"
#include "util/thread_pool.h"

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
  std::string recipe;
  std::vector<std::string> types;
  std::string fill = "normal";
  std::string routing = "random";
  bool no_mtp = false;
  bool dry_run = false;
  int threads = 0;
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
  if (o.no_mtp) opts.config = without_mtp(opts.config);
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
  if (!o.recipe.empty()) {
    auto recipe = convert::recipe_by_name(o.recipe);
    if (!recipe.is_ok()) {
      fmt::print(stderr, "dsv4 synth: {}\n", recipe.status().message());
      return kExitUsage;
    }
    for (const std::string& t : o.types)
      if (Status st = convert::apply_type_override(*recipe, t); !st) {
        fmt::print(stderr, "dsv4 synth: {}\n", st.message());
        return kExitUsage;
      }
    opts.tensor_type = [r = *recipe](const TensorSpec& spec, std::string* note) -> Result<GgmlType> {
      DSV4_ASSIGN_OR_RETURN(convert::TypeChoice choice, convert::choose_type(r, spec));
      if (choice.fallback() && note)
        *note = fmt::format("{}: row length {} does not fit {}; written as {}", spec.name, spec.ne[0],
                            ggml_type_name(choice.requested), ggml_type_name(choice.type));
      return choice.type;
    };
  }
  opts.fill = o.fill == "random-blocks" ? SynthFill::RandomBlocks : SynthFill::Normal;
  opts.routing = o.routing == "shared" ? SynthRouting::Shared : SynthRouting::Random;
  opts.dry_run = o.dry_run;
  if (o.threads > 0) ThreadPool::set_global_threads(o.threads);
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
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (const auto& note : report->notes) fmt::print(stderr, "dsv4 synth: note: {}\n", note);
  const std::string types = o.recipe.empty()
                                ? fmt::format("experts {}, other matrices {}", ggml_type_name(opts.expert_type),
                                              ggml_type_name(opts.dense_type))
                                : fmt::format("recipe {}", o.recipe);
  fmt::print("{} {}: preset {}, {} layers + {} MTP, {}, fill {}, routing {}, seed {}, {} tensors, {} bytes of tensor "
             "data",
             o.dry_run ? "would write" : "wrote", fmt::join(report->paths, " + "), o.preset, opts.config.n_layers,
             opts.config.n_mtp, types, o.fill, o.routing, o.seed, report->n_tensors, report->data_bytes);
  if (!o.dry_run)
    fmt::print(" in {:.1f} s ({:.2f} GB/s)", seconds, static_cast<double>(report->data_bytes) / 1e9 / seconds);
  fmt::print("\n");
  return kExitOk;
}

}  // namespace

void register_synth(CLI::App& app, CommandRunner& run) {
  auto o = std::make_shared<SynthCliOptions>();
  app.add_option("--preset", o->preset, "geometry: tiny, small, flash, pro, tiny41, small41, flash41")->required();
  app.add_option("--layers", o->layers, "keep only the first N trunk layers (and the MTP block)")
      ->check(CLI::PositiveNumber);
  auto* experts = app.add_option("--experts", o->expert_type, "routed-expert type, e.g. q2_K, q4_K, q8_0, mxfp4");
  auto* dense = app.add_option("--dense", o->dense_type, "type of every other matrix, e.g. q8_0, bf16");
  app.add_option("--seed", o->seed, "random seed")->required();
  app.add_option("-o,--output", o->output, "output .gguf file")->required();
  app.add_flag("--force", o->force, "replace an existing output file");
  app.add_flag("--no-tokenizer", o->no_tokenizer, "leave out the tokenizer metadata");
  app.add_flag("--bundled", o->bundled,
               "one file with the MTP block inside (default: llama.cpp's trunk + mtp-<name> sidecar)");
  std::string recipes = "types by role as dsv4 convert's recipe (instead of --experts/--dense):";
  for (const auto& r : convert::recipe_list()) recipes += fmt::format("\n  {}: {}", r.name, r.summary);
  app.add_option("--recipe", o->recipe, recipes)->excludes(experts)->excludes(dense);
  app.add_option("--type", o->types, "with --recipe: ROLE=TYPE overrides one role, as in dsv4 convert (repeatable)")
      ->allow_extra_args(false);
  app.add_option("--fill", o->fill,
                 "normal: the fixture's distributions, quantised; random-blocks: random valid blocks of the "
                 "same magnitude for the quantised matrices, written at memory speed (benchmarks)")
      ->check(CLI::IsMember({"normal", "random-blocks"}))
      ->capture_default_str();
  app.add_option("--routing", o->routing,
                 "random: each token its own experts (the fixture's draws); shared: every token experts 0..k-1 in "
                 "every layer (hash rows and router biases made so; for benchmarks of verify steps, issue 15)")
      ->check(CLI::IsMember({"random", "shared"}))
      ->capture_default_str();
  app.add_flag("--no-mtp", o->no_mtp, "leave out the MTP block: one trunk-only file (what llama.cpp loads alone)");
  app.add_flag("--dry-run", o->dry_run, "print the files and their tensor bytes, write nothing");
  app.add_option("--threads", o->threads, "worker threads (default: all cores)")->check(CLI::NonNegativeNumber);
  run = [o] { return run_synth(*o); };
}

}  // namespace dsv4::cli
