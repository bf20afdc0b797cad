// The flags that attach an intervention (docs/STEERING.md) to a command that loads a model
// (run, chat, score, serve): --glp FILE [--glp-alpha A] [--glp-layers LIST] binds a GLP
// steering file, --kv-graft FILE reads a compressed-KV bank for every new sequence.
// Errors name the flag and the file: a file made for another model, a layer list that is
// malformed or names a layer the file lacks, a strength that is not finite.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/kv_graft.h"
#include "model/model.h"
#include "util/status.h"

namespace dsv4::cli {

struct InterventionFlags {
  std::string glp;         // --glp FILE
  std::string glp_alpha;   // --glp-alpha A (empty: the file's glp.alpha)
  std::string glp_layers;  // --glp-layers LIST (empty: every layer of the file)
  std::string kv_graft;    // --kv-graft FILE
};

void add_intervention_flags(CLI::App& app, InterventionFlags& flags);

// What CLI11 cannot check: --glp-alpha and --glp-layers only with --glp, the strength
// finite, the list's syntax.
Status validate_intervention_flags(const InterventionFlags& flags);

// "3", "0,2,4", "1-3,6": ascending distinct layers below n_layers; `flag` names the option
// in errors.
Result<std::vector<uint32_t>> parse_layer_list(const std::string& flag, const std::string& text, uint32_t n_layers);

// A finite float, or an error naming `flag`.
Result<float> parse_finite(const std::string& flag, const std::string& text);

// Binds --glp to the model (reading and checking the file against it) and reads --kv-graft
// (nullptr without it).
Result<std::shared_ptr<const KvGraft>> apply_interventions(const InterventionFlags& flags, Model& model);

}  // namespace dsv4::cli
