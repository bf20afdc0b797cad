// Which backend a command runs on, decided in one place for every command that loads a
// model (run, chat, score, bench, serve): --backend cpu|cuda|auto (auto: CUDA when this dsv4 was
// built with it and a GPU is present, else the CPU), the matrix-product numerics that go
// with it, and cache sizes a device can hold.
#pragma once

#include <CLI/CLI.hpp>

#include <memory>
#include <string>

#include "backend/backend.h"
#include "model/kv_cache.h"
#include "util/status.h"

namespace dsv4::cli {

struct BackendFlags {
  std::string backend = "auto";  // cpu, cuda, auto
  int threads = 0;               // CPU threads (the CPU backend; 0: all)
  bool fast = false;             // --fast: Quantized on the CPU too
  bool exact = false;            // --exact: the fp32 reference numerics on any backend
  std::string device_memory;     // --device-memory BYTES (model/device_plan.h)
  bool batch_invariant = false;  // --batch-invariant: CUDA kernels whose rows do not depend on the batch
};

// "1048576", "512K", "8M", "2G", "1T" (powers of 1024); the message names `flag`.
Result<uint64_t> parse_byte_size(const std::string& flag, const std::string& s);

// --device-memory, else $DSV4_DEVICE_MEMORY, else 0 (the backend's free device memory).
Result<uint64_t> device_memory_bytes(const BackendFlags& flags);

// --backend, --fast, --exact, --batch-invariant and --device-memory (the command adds -t/--threads itself where it has one).
void add_backend_flags(CLI::App& app, BackendFlags& flags);

bool cuda_built();  // this dsv4 has the CUDA backend
// "cpu" or "cuda" for --backend auto: CUDA when built with it and device 0 answers.
std::string resolve_backend_name(const std::string& choice);

// Whether --backend names a backend this process can have: "cuda" needs a build with CUDA
// and a device that answers (the message says which is missing); "cpu" and "auto" always.
// Commands call it before reading a model, so the refusal is a usage error.
Status check_backend_available(const std::string& choice);

// --ctx on a device when absent: every slot is allocated at it up front.
inline constexpr uint64_t kDeviceContext = 16384;

struct ChosenBackend {
  std::unique_ptr<backend::Backend> backend;
  bool device = false;  // a device backend (memory is not committed lazily)
  // --device-memory on the CPU: caches sized as on a device (cache_options), so the
  // check at load sees what a device would allocate.
  bool sized_as_device = false;
  std::string name;     // "cpu" or "cuda"
};

// The backend for the flags; `command` prefixes progress lines ("dsv4 run"); a device
// backend shows its weight upload as a progress line on a terminal.
Result<ChosenBackend> make_backend(const BackendFlags& flags, const char* command);

// The numerics: --exact the reference, --fast the quantised path, else the backend's
// default (the CPU: exact, the reference CI runs; CUDA: the production quantised path).
backend::MatmulMode matmul_mode(const BackendFlags& flags, const ChosenBackend& chosen);

// Cache options for `sequences` sequences of up to `context` tokens: on a device (or
// sized_as_device) every slot is allocated up front, so it gets exactly that; the CPU keeps
// its lazily committed defaults (context 0 there: the model's).
KvCacheOptions cache_options(const ChosenBackend& chosen, uint32_t sequences, uint64_t context);

}  // namespace dsv4::cli
