// Activation steering with GLP direction files (docs/STEERING.md): per layer a direction
// applied to the FFN output before the hyper-connection expansion (hook
// "ffn_out_pre_residual", the DeepSeek-V4 site) or to every stream after the block (hook
// "residual_stream_post_layer"), in one of two modes:
//   project  h <- h - alpha (h . d^) d^, with d^ = d / |d| normalised once when bound (the
//            norm in double), removing the component along d;
//   add      h <- h + alpha d.
// A direction of width `hidden` steers every stream alike; one of width hc_mult * hidden
// (post-layer hook only) gives each stream its own slice, each normalised on its own.
//
// File: a GGUF with keys glp.version (1), glp.mode, glp.hook, glp.alpha (the default
// strength), glp.layers (I32 array), glp.model.identity (ModelConfig::identity() of the
// model it was made for) and one F32 tensor glp.dir.<layer> per listed layer. The reader
// fails closed: an unknown mode or hook, a layer outside the model or not listed, a wrong
// width, a non-finite or zero value, another model's identity.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "util/status.h"

namespace dsv4 {

enum class SteerMode { Project, Add };
enum class SteerHook { FfnOut, PostLayerStreams };

std::string_view steer_mode_name(SteerMode m);  // "project", "add"
std::string_view steer_hook_name(SteerHook h);  // "ffn_out_pre_residual", "residual_stream_post_layer"

struct SteeringDirection {
  uint32_t layer = 0;
  std::vector<float> values;  // width hidden or hc_mult * hidden
};

struct SteeringFile {
  SteerMode mode = SteerMode::Project;
  SteerHook hook = SteerHook::FfnOut;
  float alpha = 1.0f;
  std::string model_identity;
  std::vector<SteeringDirection> directions;  // ascending layers

  static Result<SteeringFile> read(const std::string& path, const ModelConfig& config);
  Status write(const std::string& path, bool overwrite = false) const;
  // The widths the hook accepts for a model, checked by read() and by Model::bind_steering.
  static Status check_width(SteerHook hook, const ModelConfig& config, size_t width);
};

}  // namespace dsv4
