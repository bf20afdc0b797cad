#include "model/device_plan.h"

#include <fmt/format.h>

#include "model/tensor_catalog.h"

namespace dsv4 {
namespace {

// Device allocations are whole 256-byte units with 16 bytes of slack (cuda_backend.cu).
constexpr uint64_t kUnit = 256, kSlack = 16;
uint64_t device_size(uint64_t n) { return (n + kSlack + kUnit - 1) / kUnit * kUnit; }

}  // namespace

std::string plan_bytes_text(uint64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes >= (1ull << 30)) return fmt::format("{:.2f} GiB ({} bytes)", b / (1ull << 30), bytes);
  if (bytes >= (1ull << 20)) return fmt::format("{:.1f} MiB ({} bytes)", b / (1ull << 20), bytes);
  return fmt::format("{} bytes", bytes);
}

std::string DeviceMemoryPlan::describe() const {
  std::string s = fmt::format(
      "weights {} + caches {} ({} slot{} of {} tokens: windows and compressor states {}, page tables {}, pages {}) "
      "+ scratch {} = {}",
      plan_bytes_text(weights_bytes), plan_bytes_text(cache.total()), sequences, sequences == 1 ? "" : "s", context,
      plan_bytes_text(cache.slots), plan_bytes_text(cache.tables), plan_bytes_text(cache.pages),
      plan_bytes_text(scratch_bytes), plan_bytes_text(total()));
  if (capacity_bytes) s += fmt::format(" of {} available", plan_bytes_text(capacity_bytes));
  if (host_weights_bytes) s += fmt::format("; Engram tables {} stay on the host", plan_bytes_text(host_weights_bytes));
  return s;
}

DeviceMemoryPlan plan_device_memory(const ModelConfig& config, const ModelPlan& plan,
                                    std::span<const gguf::TensorInfo> tensors, const KvCacheOptions& cache,
                                    uint64_t scratch_bytes, uint64_t capacity_bytes) {
  DeviceMemoryPlan p;
  const TensorCatalog catalog = build_tensor_catalog(config);
  for (const gguf::TensorInfo& t : tensors) {
    const TensorSpec* spec = catalog.find(t.name);
    if (spec && spec->role == TensorRole::EngramTables) {
      p.host_weights_bytes += t.nbytes;
      continue;
    }
    if (spec && spec->role == TensorRole::VisionTower) continue;  // not loaded
    // 1-D tensors are decoded to F32 by the loader (norms, biases, mixers' scales).
    const uint64_t bytes = t.ne.size() <= 1 ? std::max<uint64_t>(t.nbytes, t.n_elements() * 4) : t.nbytes;
    p.weights_bytes += device_size(bytes);
  }
  p.cache = KvCache::plan_bytes(config, plan, cache);
  p.scratch_bytes = scratch_bytes;
  p.capacity_bytes = capacity_bytes;
  p.sequences = cache.max_sequences;
  p.context = cache.max_context ? std::min<uint64_t>(cache.max_context, config.context_length) : config.context_length;
  return p;
}

Status check_device_fit(const DeviceMemoryPlan& plan, std::string_view what) {
  if (plan.fits()) return Status::ok();
  const uint64_t over = plan.total() - plan.capacity_bytes;
  return Status::errorf(StatusCode::kResourceExhausted,
                        "{} does not fit in device memory, nothing was allocated: {}; {} short (a shorter --ctx, "
                        "fewer sequences (serve --max-seqs, --cache-entries) or a --kv-budget shrink the caches; a "
                        "smaller quantisation the weights)",
                        what, plan.describe(), plan_bytes_text(over));
}

}  // namespace dsv4
