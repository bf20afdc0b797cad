#include "synth/builtin_model.h"

#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>

#include "gguf/gguf_file.h"
#include "model/config.h"
#include "synth/presets.h"
#include "synth/synth.h"
#include "model/tensor_catalog.h"

namespace dsv4 {
namespace {

constexpr std::string_view kPreset = "tiny";

std::string file_name() { return fmt::format("dsv4-builtin-{}-v{}.gguf", kPreset, kSynthVersion); }

}  // namespace

Result<std::filesystem::path> builtin_model_path() {
  if (const char* dir = std::getenv("DSV4_CACHE_DIR"); dir && *dir)
    return std::filesystem::path(dir) / file_name();
  const char* home = std::getenv("HOME");
  if (!home || !*home)
    return Status::error("built-in model: neither DSV4_CACHE_DIR nor HOME is set, so there is "
                         "no cache folder to write it to");
  return std::filesystem::path(home) / ".cache" / "dsv4" / file_name();
}

Status check_builtin_model(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return Status::errorf("{}: missing", path.string());
  gguf::OpenOptions opts;
  opts.map_data = false;
  DSV4_ASSIGN_OR_RETURN(gguf::GgufFile file, gguf::GgufFile::open(path.string(), opts));
  DSV4_ASSIGN_OR_RETURN(uint64_t version, file.get_uint(kSynthVersionKey));
  if (version != kSynthVersion)
    return Status::errorf("{}: generator version {}, this program writes {}", path.string(),
                          version, kSynthVersion);
  DSV4_ASSIGN_OR_RETURN(uint64_t seed, file.get_uint(kSynthSeedKey));
  if (seed != kBuiltinModelSeed)
    return Status::errorf("{}: seed {}, expected {}", path.string(), seed, kBuiltinModelSeed);
  DSV4_ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::from_gguf(file));
  DSV4_TRY(check_tensors(build_tensor_catalog(config), file.tensors(), path.string()));
  return Status::ok();
}

Result<std::filesystem::path> ensure_builtin_model(
    const std::function<void(std::string_view)>& log) {
  DSV4_ASSIGN_OR_RETURN(std::filesystem::path path, builtin_model_path());
  const Status existing = check_builtin_model(path);
  if (existing.is_ok()) return path;

  std::error_code ec;
  std::filesystem::create_directories(path.parent_path(), ec);
  if (ec)
    return Status::errorf("built-in model: cannot create {}: {}", path.parent_path().string(),
                          ec.message());
  if (log)
    log(fmt::format("writing the built-in tiny model to {} ({})", path.string(),
                    existing.message()));

  DSV4_ASSIGN_OR_RETURN(Preset preset, find_preset(kPreset));
  SynthOptions opts;
  opts.config = preset.config;
  opts.expert_type = preset.default_expert_type;
  opts.dense_type = preset.default_dense_type;
  opts.seed = kBuiltinModelSeed;
  opts.preset_name = std::string(kPreset);
  opts.overwrite = true;
  opts.layout = WriteLayout::Bundled;  // one cache file, renamed into place whole
  // A private name per writer, renamed into place only when complete, so concurrent
  // first runs never see (or leave) a partial file.
  static std::atomic<uint64_t> counter{0};
  const auto stamp = std::chrono::steady_clock::now().time_since_epoch().count();
  const std::filesystem::path temp =
      path.parent_path() /
      fmt::format(".{}.{}-{}-{}.partial", path.filename().string(), getpid(), stamp, counter++);
  Result<SynthReport> written = write_synthetic_model(temp.string(), opts);
  if (!written.is_ok()) {
    std::filesystem::remove(temp, ec);
    return written.status().with_context("built-in model");
  }
  std::filesystem::rename(temp, path, ec);
  if (ec) {
    const std::string why = ec.message();
    std::filesystem::remove(temp, ec);
    return Status::errorf("built-in model: cannot rename into {}: {}", path.string(), why);
  }
  DSV4_TRY(check_builtin_model(path));
  return path;
}

}  // namespace dsv4
