#include "backend_choice.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "backend/cpu/cpu_backend.h"
#ifdef DSV4_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/device_info.h"
#endif

namespace dsv4::cli {

void add_backend_flags(CLI::App& app, BackendFlags& flags) {
  app.add_option("--backend", flags.backend,
                 "where the model runs: cpu, cuda, or auto (CUDA when built with it and a GPU is present)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
  auto* fast = app.add_flag("--fast", flags.fast,
                            "quantised activations in the matrix products (the CPU default is the fp32 reference)");
  app.add_flag("--exact", flags.exact,
               "the fp32 reference numerics: weights decoded exactly, fp32 products (the CUDA default is the "
               "quantised production path)")
      ->excludes(fast);
  app.add_flag("--batch-invariant", flags.batch_invariant,
               "CUDA: decode kernels whose every row is the same bits alone or in a batch of up to 64 rows, so "
               "--spec gives exactly the tokens decoding without it gives (slower; no effect on the CPU backend)");
  app.add_option("--device-memory", flags.device_memory,
                 "device memory the weights, caches and scratch must fit, e.g. 80G (default: what the GPU has "
                 "free; set, it is checked on the CPU too); also $DSV4_DEVICE_MEMORY");
}

Result<uint64_t> parse_byte_size(const std::string& flag, const std::string& s) {
  size_t used = 0;
  unsigned long long v = 0;
  try {
    v = std::stoull(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string unit = s.substr(used);
  uint64_t mult = 1;
  if (unit == "K" || unit == "KiB" || unit == "k") mult = 1ull << 10;
  else if (unit == "M" || unit == "MiB") mult = 1ull << 20;
  else if (unit == "G" || unit == "GiB") mult = 1ull << 30;
  else if (unit == "T" || unit == "TiB") mult = 1ull << 40;
  else if (!unit.empty() || used == 0) return Status::errorf("{} '{}': expected bytes, e.g. 1048576, 512M or 8G", flag, s);
  if (v > UINT64_MAX / mult) return Status::errorf("{} '{}' is too large", flag, s);
  return static_cast<uint64_t>(v) * mult;
}

Result<uint64_t> device_memory_bytes(const BackendFlags& flags) {
  if (!flags.device_memory.empty()) return parse_byte_size("--device-memory", flags.device_memory);
  if (const char* env = std::getenv("DSV4_DEVICE_MEMORY"); env && *env) return parse_byte_size("DSV4_DEVICE_MEMORY", env);
  return uint64_t{0};
}

bool cuda_built() {
#ifdef DSV4_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

std::string resolve_backend_name(const std::string& choice) {
  if (choice != "auto") return choice;
#ifdef DSV4_HAVE_CUDA
  if (cuda::query_device(0).is_ok()) return "cuda";
#endif
  return "cpu";
}

Status check_backend_available(const std::string& choice) {
  if (choice != "cuda") return Status::ok();
#ifdef DSV4_HAVE_CUDA
  if (auto device = cuda::query_device(0); !device.is_ok())
    return Status::errorf("--backend cuda: no CUDA device answers ({}); use --backend cpu or auto",
                          device.status().message());
  return Status::ok();
#else
  return Status::error("--backend cuda: this dsv4 was built without CUDA (configure with -DDSV4_CUDA=ON); use "
                       "--backend cpu or auto");
#endif
}

Result<ChosenBackend> make_backend(const BackendFlags& flags, const char* command) {
  ChosenBackend chosen;
  chosen.name = resolve_backend_name(flags.backend);
  if (chosen.name == "cpu") {
    DSV4_ASSIGN_OR_RETURN(const uint64_t device_memory, device_memory_bytes(flags));
    chosen.sized_as_device = device_memory > 0;
    chosen.backend = std::make_unique<backend::CpuBackend>(flags.threads);
    return chosen;
  }
#ifdef DSV4_HAVE_CUDA
  backend::CudaBackendOptions options;
  options.batch_invariant = flags.batch_invariant;
  // DSV4_CUDA_LANES=0: every op on one stream (docs/CUDA.md, "Lanes"), for measuring them.
  if (const char* lanes = std::getenv("DSV4_CUDA_LANES"); lanes != nullptr && std::string_view(lanes) == "0")
    options.lanes = false;
  // DSV4_CUDA_HC_CLUSTER=0: a site's mixes and hc_pre as two kernels (docs/CUDA.md), for measuring them.
  if (const char* hc = std::getenv("DSV4_CUDA_HC_CLUSTER"); hc != nullptr && std::string_view(hc) == "0")
    options.hc_cluster = false;
  if (isatty(STDERR_FILENO)) {
    options.on_upload_progress = [command, last = -1](uint64_t done, uint64_t total) mutable {
      const int percent = total ? static_cast<int>(100 * done / total) : 100;
      if (percent == last) return;
      last = percent;
      fmt::print(stderr, "\r{}: uploading weights {:3d}% ({:.1f} of {:.1f} GiB)", command, percent,
                 static_cast<double>(done) / (1 << 30), static_cast<double>(total) / (1 << 30));
      if (done >= total) fmt::print(stderr, "\n");
    };
  }
  DSV4_ASSIGN_OR_RETURN(auto cuda, backend::CudaBackend::create(options));
  chosen.backend = std::move(cuda);
  chosen.device = true;
  return chosen;
#else
  (void)command;
  return Status::error("--backend cuda: this dsv4 was built without CUDA (configure with -DDSV4_CUDA=ON)");
#endif
}

backend::MatmulMode matmul_mode(const BackendFlags& flags, const ChosenBackend& chosen) {
  if (flags.exact) return backend::MatmulMode::Exact;
  if (flags.fast || chosen.device) return backend::MatmulMode::Quantized;
  return backend::MatmulMode::Exact;
}

KvCacheOptions cache_options(const ChosenBackend& chosen, uint32_t sequences, uint64_t context) {
  KvCacheOptions o;
  if (!chosen.device && !chosen.sized_as_device) return o;
  o.max_sequences = sequences;
  o.max_context = context;
  return o;
}

}  // namespace dsv4::cli
