#include "interventions.h"

#include <fmt/format.h>

#include <fmt/ranges.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "model/steering.h"

namespace dsv4::cli {

void add_intervention_flags(CLI::App& app, InterventionFlags& f) {
  app.add_option("--glp", f.glp, "GLP steering file (dsv4 glp make) to bind (docs/STEERING.md)")
      ->check(CLI::ExistingFile);
  app.add_option("--glp-alpha", f.glp_alpha, "steering strength (default: the file's glp.alpha)");
  app.add_option("--glp-layers", f.glp_layers, "steer only these layers of the file, e.g. 3 or 0,2 or 1-4");
  app.add_option("--kv-graft", f.kv_graft, "compressed-KV bank (dsv4 graft make) planted in every sequence")
      ->check(CLI::ExistingFile);
}

Result<float> parse_finite(const std::string& flag, const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || errno == ERANGE || !std::isfinite(v) || std::fabs(v) > 3.4e38)
    return Status::errorf("{} '{}': expected a finite number", flag, text);
  return static_cast<float>(v);
}

Result<std::vector<uint32_t>> parse_layer_list(const std::string& flag, const std::string& text, uint32_t n_layers) {
  const auto bad = [&](const std::string& why) {
    return Status::errorf("{} '{}': {} (expected {}layers, ascending, e.g. 3 or 0,2 or 1-4)", flag, text, why,
                          n_layers == UINT32_MAX ? "" : fmt::format("the model's {} ", n_layers));
  };
  const auto number = [&](const std::string& s, uint32_t& out) -> bool {
    if (s.empty() || s.size() > 9 || s.find_first_not_of("0123456789") != std::string::npos) return false;
    out = static_cast<uint32_t>(std::stoul(s));
    return true;
  };
  std::vector<uint32_t> layers;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    const size_t dash = item.find('-');
    uint32_t lo = 0, hi = 0;
    if (!number(item.substr(0, dash), lo) || (dash != std::string::npos && !number(item.substr(dash + 1), hi)))
      return bad(fmt::format("\"{}\" is not a layer or a range A-B", item));
    if (dash == std::string::npos) hi = lo;
    if (hi < lo) return bad(fmt::format("the range {} runs backwards", item));
    if (hi >= n_layers) return bad(fmt::format("layer {} is outside the model", hi));
    for (uint32_t l = lo; l <= hi; ++l) {
      if (!layers.empty() && l <= layers.back()) return bad(fmt::format("layer {} is repeated or out of order", l));
      layers.push_back(l);
    }
    at = comma + 1;
  }
  return layers;
}

Status validate_intervention_flags(const InterventionFlags& f) {
  if (f.glp.empty() && (!f.glp_alpha.empty() || !f.glp_layers.empty()))
    return Status::error("--glp-alpha and --glp-layers need --glp FILE");
  if (!f.glp_alpha.empty()) DSV4_TRY(parse_finite("--glp-alpha", f.glp_alpha).status());
  if (!f.glp_layers.empty()) DSV4_TRY(parse_layer_list("--glp-layers", f.glp_layers, UINT32_MAX).status());
  return Status::ok();
}

Result<std::shared_ptr<const KvGraft>> apply_interventions(const InterventionFlags& f, Model& model) {
  const ModelConfig& c = model.config();
  if (!f.glp.empty()) {
    DSV4_ASSIGN_OR_RETURN(SteeringFile file, SteeringFile::read(f.glp, c));
    std::optional<float> alpha;
    if (!f.glp_alpha.empty()) {
      DSV4_ASSIGN_OR_RETURN(alpha, parse_finite("--glp-alpha", f.glp_alpha));
    }
    std::vector<uint32_t> layers, in_file;
    for (const SteeringDirection& d : file.directions) in_file.push_back(d.layer);
    if (!f.glp_layers.empty()) {
      DSV4_ASSIGN_OR_RETURN(layers, parse_layer_list("--glp-layers", f.glp_layers, c.n_layers));
      for (uint32_t l : layers)
        if (std::none_of(file.directions.begin(), file.directions.end(),
                         [&](const SteeringDirection& d) { return d.layer == l; }))
          return Status::errorf("--glp-layers: layer {} has no direction in {} (it has {})", l, f.glp,
                                fmt::join(in_file, ","));
    }
    DSV4_TRY(model.bind_steering(file, alpha, layers).with_context("--glp " + f.glp));
  }
  if (f.kv_graft.empty()) return std::shared_ptr<const KvGraft>();
  DSV4_ASSIGN_OR_RETURN(KvGraft graft, KvGraft::read(f.kv_graft, c));
  return std::shared_ptr<const KvGraft>(std::make_shared<KvGraft>(std::move(graft)));
}

}  // namespace dsv4::cli
