// dsv4 glp make: a GLP steering file (steering.h, docs/STEERING.md) from two sets of
// prompts: per layer, the mean of the hooked activation over the positive prompts minus
// its mean over the negative ones (accumulated in double). Each prompt contributes one
// vector, the mean of its tokens' activations (--pool mean) or its last token's (--pool
// last), so long prompts do not outweigh short ones. The activation is the one the hook
// steers: `ffn_out` (the FFN output before the hyper-connection expansion, width hidden)
// or `out_streams` (the streams after the block, width hc_mult * hidden: one slice per
// stream), as the forward trace (trace.h) records them.
//
// Prompt files: one prompt per line, tokenized as is (no chat format added); blank lines
// are skipped; a line starting with '"' is a JSON string, so a prompt can hold newlines.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>

#include "backend_choice.h"
#include "commands.h"
#include "gguf/gguf_file.h"
#include "interventions.h"
#include "model/model.h"
#include "model/steering.h"
#include "model/trace.h"
#include "text/tokenizer.h"

namespace dsv4::cli {
namespace {

struct GlpMakeOptions {
  std::string model;
  std::string positive, negative, output;
  std::string hook = "ffn_out_pre_residual";
  std::string mode = "add";
  std::string layers;  // empty: every layer
  std::string alpha = "1";
  std::string pool = "mean";
  bool force = false;
  BackendFlags backend;
};

Result<std::vector<std::string>> read_prompts(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::errorf("{}: cannot open the prompt file", path);
  std::vector<std::string> prompts;
  std::string line;
  for (size_t n = 1; std::getline(in, line); ++n) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    if (line[0] == '"') {
      const auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_discarded() || !j.is_string())
        return Status::errorf("{}:{}: a line starting with '\"' must be one JSON string", path, n);
      line = j.get<std::string>();
      if (line.empty()) return Status::errorf("{}:{}: empty prompt", path, n);
    }
    prompts.push_back(line);
  }
  if (prompts.empty()) return Status::errorf("{}: no prompts", path);
  return prompts;
}

struct PromptSet {
  std::vector<std::vector<double>> sums;  // per steered layer: sum of the prompts' pooled vectors
  size_t prompts = 0;
};

Status accumulate(const Model& model, const text::Tokenizer& tok, const std::string& path, bool streams, bool last,
                  const std::vector<uint32_t>& layers, PromptSet& set) {
  DSV4_ASSIGN_OR_RETURN(std::vector<std::string> prompts, read_prompts(path));
  const ModelConfig& c = model.config();
  const size_t width = streams ? size_t{c.hc_mult} * c.hidden : c.hidden;
  set.sums.assign(layers.size(), std::vector<double>(width, 0.0));
  for (size_t p = 0; p < prompts.size(); ++p) {
    DSV4_ASSIGN_OR_RETURN(std::vector<text::TokenId> ids, tok.encode(prompts[p]));
    if (ids.empty()) return Status::errorf("{}: prompt {} has no tokens", path, p + 1);
    if (ids.size() >= c.context_length)
      return Status::errorf("{}: prompt {} has {} tokens, over the model's context", path, p + 1, ids.size());
    SequenceOptions so;
    so.max_context = ids.size() + 1;
    DSV4_ASSIGN_OR_RETURN(std::unique_ptr<Sequence> seq, model.new_sequence(so));
    const BatchItem item{seq.get(), std::span<const int32_t>(ids.data(), ids.size())};
    ForwardOutput out;
    ForwardTrace trace;
    DSV4_TRY(model.forward(std::span<const BatchItem>(&item, 1), out, &trace));
    for (size_t i = 0; i < layers.size(); ++i) {
      const std::string name = fmt::format("layers.{}.{}", layers[i], streams ? "out_streams" : "ffn_out");
      const TracedTensor* t = trace.find(name);
      if (!t || t->cols != static_cast<int64_t>(width) || t->rows() != static_cast<int64_t>(ids.size()))
        return Status::errorf("internal: the trace lacks {} [{}, {}]", name, ids.size(), width);
      const int64_t first = last ? t->rows() - 1 : 0, rows = t->rows() - first;
      std::vector<double>& sum = set.sums[i];
      for (int64_t r = first; r < t->rows(); ++r)
        for (size_t k = 0; k < width; ++k) sum[k] += double(t->f32[r * width + k]) / double(rows);
    }
  }
  set.prompts = prompts.size();
  return Status::ok();
}

Status run_glp_make(const GlpMakeOptions& o) {
  SteeringFile file;
  if (o.hook == steer_hook_name(SteerHook::FfnOut)) file.hook = SteerHook::FfnOut;
  else if (o.hook == steer_hook_name(SteerHook::PostLayerStreams)) file.hook = SteerHook::PostLayerStreams;
  else return Status::errorf("--hook {}: expected ffn_out_pre_residual or residual_stream_post_layer", o.hook);
  file.mode = o.mode == "project" ? SteerMode::Project : SteerMode::Add;
  DSV4_ASSIGN_OR_RETURN(file.alpha, parse_finite("--alpha", o.alpha));

  gguf::OpenOptions header_only;
  header_only.map_data = false;
  DSV4_ASSIGN_OR_RETURN(gguf::GgufFile header, gguf::GgufFile::open(o.model, header_only));
  DSV4_ASSIGN_OR_RETURN(text::Tokenizer tok, text::Tokenizer::from_gguf(header));
  DSV4_ASSIGN_OR_RETURN(ChosenBackend chosen, make_backend(o.backend, "dsv4 glp"));
  ModelOptions mo;
  mo.matmul = matmul_mode(o.backend, chosen);
  DSV4_ASSIGN_OR_RETURN(mo.device_memory, device_memory_bytes(o.backend));
  mo.cache = cache_options(chosen, 1, 16384);
  DSV4_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, Model::load(o.model, *chosen.backend, mo));
  const ModelConfig& c = model->config();
  file.model_identity = c.identity();
  std::vector<uint32_t> layers;
  if (o.layers.empty()) {
    for (uint32_t l = 0; l < c.n_layers; ++l) layers.push_back(l);
  } else {
    DSV4_ASSIGN_OR_RETURN(layers, parse_layer_list("--layers", o.layers, c.n_layers));
  }
  const bool streams = file.hook == SteerHook::PostLayerStreams, last = o.pool == "last";
  PromptSet pos, neg;
  DSV4_TRY(accumulate(*model, tok, o.positive, streams, last, layers, pos));
  DSV4_TRY(accumulate(*model, tok, o.negative, streams, last, layers, neg));
  for (size_t i = 0; i < layers.size(); ++i) {
    SteeringDirection d;
    d.layer = layers[i];
    double norm = 0;
    for (size_t k = 0; k < pos.sums[i].size(); ++k) {
      const double v = pos.sums[i][k] / double(pos.prompts) - neg.sums[i][k] / double(neg.prompts);
      d.values.push_back(static_cast<float>(v));
      norm += v * v;
    }
    if (!(norm > 0) || !std::isfinite(norm))
      return Status::errorf("layer {}: the two sets' mean activations do not differ (norm {}); nothing to steer along",
                            d.layer, std::sqrt(norm));
    fmt::print("layer {}: |d| = {:.6g}\n", d.layer, std::sqrt(norm));
    file.directions.push_back(std::move(d));
  }
  DSV4_TRY(file.write(o.output, o.force));
  fmt::print("{}: {} directions ({} prompts positive, {} negative), hook {}, mode {}, alpha {}\n", o.output,
             file.directions.size(), pos.prompts, neg.prompts, steer_hook_name(file.hook), steer_mode_name(file.mode),
             file.alpha);
  return Status::ok();
}

}  // namespace

void register_glp(CLI::App& app, CommandRunner& run) {
  app.require_subcommand(1);
  auto o = std::make_shared<GlpMakeOptions>();
  CLI::App* make = app.add_subcommand("make", "Write a steering direction: mean activation of --positive minus --negative");
  make->add_option("-m,--model", o->model, "GGUF model file")->required()->check(CLI::ExistingFile);
  make->add_option("--positive", o->positive, "prompts to steer towards, one per line")->required()->check(CLI::ExistingFile);
  make->add_option("--negative", o->negative, "prompts to steer away from, one per line")->required()->check(CLI::ExistingFile);
  make->add_option("-o,--output", o->output, "the steering file to write (.gguf)")->required();
  make->add_option("--hook", o->hook, "ffn_out_pre_residual (default) or residual_stream_post_layer")
      ->check(CLI::IsMember({"ffn_out_pre_residual", "residual_stream_post_layer"}));
  make->add_option("--mode", o->mode, "add (default: h += alpha d) or project (h -= alpha (h.d^) d^)")
      ->check(CLI::IsMember({"add", "project"}));
  make->add_option("--layers", o->layers, "layers to make directions for, e.g. 3 or 0,2 or 1-4 (default: all)");
  make->add_option("--alpha", o->alpha, "the file's default strength glp.alpha (default 1)");
  make->add_option("--pool", o->pool, "a prompt's vector: mean of its tokens (default) or last token")
      ->check(CLI::IsMember({"mean", "last"}));
  make->add_flag("--force", o->force, "replace the output file if it exists");
  add_backend_flags(*make, o->backend);
  make->add_option("-t,--threads", o->backend.threads, "CPU threads (default: all)");
  run = [o] {
    const Status s = run_glp_make(*o);
    if (!s.is_ok()) {
      fmt::print(stderr, "dsv4 glp make: {}\n", s.message());
      return static_cast<int>(kExitFailure);
    }
    return static_cast<int>(kExitOk);
  };
}

}  // namespace dsv4::cli
