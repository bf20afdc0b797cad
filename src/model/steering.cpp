#include "model/steering.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "gguf/gguf_file.h"
#include "gguf/gguf_writer.h"

namespace dsv4 {

std::string_view steer_mode_name(SteerMode m) { return m == SteerMode::Project ? "project" : "add"; }
std::string_view steer_hook_name(SteerHook h) {
  return h == SteerHook::FfnOut ? "ffn_out_pre_residual" : "residual_stream_post_layer";
}

Status SteeringFile::check_width(SteerHook hook, const ModelConfig& c, size_t width) {
  const size_t d = c.hidden, streams = size_t{c.hc_mult} * c.hidden;
  if (width == d || (hook == SteerHook::PostLayerStreams && width == streams)) return Status::ok();
  return Status::errorf("width {} does not fit hook {} (expected {}{})", width, steer_hook_name(hook), d,
                        hook == SteerHook::PostLayerStreams ? fmt::format(" or {}", streams) : "");
}

Result<SteeringFile> SteeringFile::read(const std::string& path, const ModelConfig& c) {
  DSV4_ASSIGN_OR_RETURN(gguf::GgufFile file, gguf::GgufFile::open(path));
  const auto bad = [&](const std::string& what) { return Status::errorf("{}: {}", path, what); };
  DSV4_ASSIGN_OR_RETURN(uint64_t version, file.get_uint("glp.version"));
  if (version != 1) return bad(fmt::format("glp.version {} (this reader knows 1)", version));
  SteeringFile f;
  DSV4_ASSIGN_OR_RETURN(std::string mode, file.get_string("glp.mode"));
  if (mode == "project") f.mode = SteerMode::Project;
  else if (mode == "add") f.mode = SteerMode::Add;
  else return bad(fmt::format("glp.mode \"{}\" is neither \"project\" nor \"add\"", mode));
  DSV4_ASSIGN_OR_RETURN(std::string hook, file.get_string("glp.hook"));
  if (hook == steer_hook_name(SteerHook::FfnOut)) f.hook = SteerHook::FfnOut;
  else if (hook == steer_hook_name(SteerHook::PostLayerStreams)) f.hook = SteerHook::PostLayerStreams;
  else
    return bad(fmt::format("glp.hook \"{}\" is not a DeepSeek-V4 hook ({} or {})", hook,
                           steer_hook_name(SteerHook::FfnOut), steer_hook_name(SteerHook::PostLayerStreams)));
  DSV4_ASSIGN_OR_RETURN(double alpha, file.get_float("glp.alpha"));
  if (!std::isfinite(alpha)) return bad(fmt::format("glp.alpha {} is not finite", alpha));
  f.alpha = static_cast<float>(alpha);
  DSV4_ASSIGN_OR_RETURN(f.model_identity, file.get_string("glp.model.identity"));
  if (f.model_identity != c.identity())
    return bad(fmt::format("made for another model:\n  file:  {}\n  model: {}", f.model_identity, c.identity()));
  DSV4_ASSIGN_OR_RETURN(std::vector<uint64_t> layers, file.get_uint_array("glp.layers"));
  if (layers.empty()) return bad("glp.layers is empty");
  for (size_t i = 0; i < layers.size(); ++i) {
    const uint64_t layer = layers[i];
    if (layer >= c.n_layers) return bad(fmt::format("glp.layers names layer {}, the model has {}", layer, c.n_layers));
    if (i && layer <= layers[i - 1]) return bad("glp.layers must be strictly ascending");
    const std::string name = fmt::format("glp.dir.{}", layer);
    const gguf::TensorInfo* t = file.find_tensor(name);
    if (!t) return bad(fmt::format("tensor {} is missing", name));
    if (t->type != GgmlType::F32 || t->ne.size() != 1)
      return bad(fmt::format("tensor {} is {} {}, expected a 1-D f32 vector", name, ggml_type_name(t->type),
                             t->shape_string()));
    DSV4_TRY(check_width(f.hook, c, t->ne[0]).with_context(fmt::format("{}: tensor {}", path, name)));
    SteeringDirection d;
    d.layer = static_cast<uint32_t>(layer);
    d.values.resize(t->ne[0]);
    std::memcpy(d.values.data(), t->data, t->nbytes);
    double norm = 0;
    for (float v : d.values) {
      if (!std::isfinite(v)) return bad(fmt::format("tensor {} has a non-finite value", name));
      norm += double(v) * v;
    }
    if (norm == 0) return bad(fmt::format("tensor {} is all zeros", name));
    f.directions.push_back(std::move(d));
  }
  for (const gguf::TensorInfo& t : file.tensors())
    if (t.name.rfind("glp.dir.", 0) == 0 &&
        std::none_of(f.directions.begin(), f.directions.end(),
                     [&](const SteeringDirection& d) { return t.name == fmt::format("glp.dir.{}", d.layer); }))
      return bad(fmt::format("tensor {} is not listed in glp.layers", t.name));
  return f;
}

Status SteeringFile::write(const std::string& path, bool overwrite) const {
  gguf::WriterOptions wo;
  wo.overwrite = overwrite;
  gguf::GgufWriter w(path, wo);
  w.set("general.architecture", gguf::Value::string("glp"));
  w.set("glp.version", gguf::Value::u32(1));
  w.set("glp.mode", gguf::Value::string(std::string(steer_mode_name(mode))));
  w.set("glp.hook", gguf::Value::string(std::string(steer_hook_name(hook))));
  w.set("glp.alpha", gguf::Value::f32(alpha));
  w.set("glp.model.identity", gguf::Value::string(model_identity));
  std::vector<int32_t> layers;
  for (const SteeringDirection& d : directions) layers.push_back(static_cast<int32_t>(d.layer));
  w.set("glp.layers", gguf::Value::array_i32(layers));
  for (const SteeringDirection& d : directions)
    DSV4_TRY(w.add_tensor(fmt::format("glp.dir.{}", d.layer), GgmlType::F32, {d.values.size()}));
  DSV4_TRY(w.begin());
  for (const SteeringDirection& d : directions)
    DSV4_TRY(w.write_tensor_data({reinterpret_cast<const uint8_t*>(d.values.data()), d.values.size() * sizeof(float)}));
  return w.finish();
}

}  // namespace dsv4
