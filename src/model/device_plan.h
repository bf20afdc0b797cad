// Device memory before anything is allocated (a GPU has no lazily committed memory): what
// loading a model with given cache options puts in device memory, by part, and the check
// against the device's capacity, whose refusal names every figure.
//
//   weights  every tensor the loader uploads: matrices in their stored bytes, the small
//            tensors decoded to F32 (1-D ones, counted as F32), each rounded up to the
//            device's allocation unit; Engram tables stay in the file mapping (host), a
//            vision tower is not loaded.
//   caches   exactly what KvCache::create allocates for the options (every slot's windows
//            and compressor states, page tables, the page pools).
//   scratch  the step arena and workspaces the backend already holds (its first chunk; it
//            grows between steps when a step needs more).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "gguf/gguf_file.h"
#include "model/config.h"
#include "model/kv_cache.h"
#include "model/layer_plan.h"
#include "util/status.h"

namespace dsv4 {

struct DeviceMemoryPlan {
  uint64_t weights_bytes = 0;       // on the device
  uint64_t host_weights_bytes = 0;  // read from the mapping as needed (Engram tables)
  KvCacheBytes cache;               // on the device
  uint64_t scratch_bytes = 0;       // on the device
  uint64_t capacity_bytes = 0;      // what it must fit in; 0: not checked (host memory)
  uint32_t sequences = 0;           // cache slots
  uint64_t context = 0;             // tokens per slot

  uint64_t total() const { return weights_bytes + cache.total() + scratch_bytes; }
  bool fits() const { return capacity_bytes == 0 || total() <= capacity_bytes; }
  // "weights 1.2 GiB + caches 3.4 GiB (8 slots of 16384 tokens: ...) + scratch 288 MiB = ..."
  std::string describe() const;
};

// The plan for a model's tensors (ModelFiles::tensors) and cache options.
DeviceMemoryPlan plan_device_memory(const ModelConfig& config, const ModelPlan& plan,
                                    std::span<const gguf::TensorInfo> tensors, const KvCacheOptions& cache,
                                    uint64_t scratch_bytes, uint64_t capacity_bytes);

// Refuses (resource exhausted) a plan over its capacity, naming every figure and what to
// change (--ctx, --max-seqs, --kv-budget).
Status check_device_fit(const DeviceMemoryPlan& plan, std::string_view what);

// Bytes as "1.50 GiB (1610612736 bytes)".
std::string plan_bytes_text(uint64_t bytes);

}  // namespace dsv4
