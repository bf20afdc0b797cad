// The CUDA backend's shared state, seen by its translation units (cuda_backend.cu,
// cuda_attention.cu, cuda_moe.cu) and nothing else.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/gemm_prefill.h"
#include "backend/cuda/row_finish.cuh"
#include "gguf/quant_decode.h"

namespace dsv4::backend {

// Errors a kernel finds in data the host never sees inside a step (an index out of range):
// the kernel sets its bit in Impl::device_errors and goes on with a harmless value; the next
// download() reports every bit set since the previous one as an error Status.
enum DeviceError : uint32_t {
  kDeviceErrorGetRowsId = 1u << 0,     // get_rows: an id outside the table
  kDeviceErrorRouteToken = 1u << 1,    // route: a token id outside tid2eid
  kDeviceErrorRouteExpert = 1u << 2,   // route: tid2eid names an expert outside [0, E)
  kDeviceErrorMoeExpert = 1u << 3,     // moe_experts: an expert id outside [0, E)
  kDeviceErrorAttention = 1u << 4,     // reserved for cuda_attention.cu
};

// Bytes in use, shared with the deleters of the tensors (which may outlive nothing, but
// must not reach into a destroyed Impl).
struct DeviceCounters {
  std::atomic<uint64_t> weights{0};
  std::atomic<uint64_t> cache{0};
};

struct CudaBackend::Impl {
  CudaBackendOptions options;
  int device = 0;
  int sms = 0;  // multiprocessors
  // The stream ops enqueue on: the main lane's, or a side lane's between fork_lane and
  // main_lane / join_lane (Backend's lanes).
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  cublasLtHandle_t cublas_lt = nullptr;

  // Step scratch: bump allocation (256-byte aligned) in device chunks. begin_step() rewinds
  // and, when a step spilled into several chunks, replaces them by one of their total
  // size, so addresses repeat from step to step (what graph replay relies on).
  struct Chunk {
    void* ptr = nullptr;
    size_t bytes = 0;
  };
  std::vector<Chunk> chunks;
  size_t chunk = 0;       // the current chunk (scratch_mark / scratch_release move it back)
  size_t chunk_used = 0;  // bytes used in it
  size_t scratch_total = 0;     // bytes of all chunks
  bool poison_scratch = false;  // DSV4_POISON_SCRATCH=1: new scratch is filled with NaN
  // options.hc_cluster and the device can hold the 16-block clusters of hc_pre_norm_from_fn
  // (cudaOccupancyMaxActiveClusters at create()).
  bool hc_cluster = false;

  // Pinned host staging for uploads (grown on demand, between steps): uploads take
  // consecutive pieces of it and the stream copies them in order; when the next piece
  // does not fit, the host waits for the stream and starts again at 0 (downloads, which
  // wait anyway, rewind it too). weight() streams through its two halves.
  void* pinned = nullptr;
  size_t pinned_bytes = 0;
  size_t pinned_used = 0;
  cudaEvent_t half_done[2] = {nullptr, nullptr};  // weight(): copies out of each half

  std::shared_ptr<DeviceCounters> counters = std::make_shared<DeviceCounters>();

  uint32_t* device_errors = nullptr;  // DeviceError bits, device memory
  uint32_t* host_errors = nullptr;    // pinned copy read by download()

  // IQ2_XXS decoding tables on the device (cuda::detail::iq2_tables), fetched at create().
  const uint64_t* iq2_grid = nullptr;
  const uint8_t* iq2_signs = nullptr;
  quant::IqTables iq_tables{};  // the other i-quants' codebooks (cuda::detail::iq_tables)

  // RoPE frequency tables, computed on the host (cpu::rope_frequencies) on first use of a
  // parameter set and kept.
  struct RopeTable {
    RopeParams params;
    float* omega = nullptr;  // [params.dims / 2]
  };
  std::vector<RopeTable> rope_tables;

  // Device buffers one op at a time uses for its internal work and the next op may reuse
  // (ops run in stream order): the BF16 copies of a prefill product's weights and activations.
  // They only grow (the host waits for the stream first), so a step's addresses repeat.
  struct Reusable {
    void* ptr = nullptr;
    size_t bytes = 0;
  };
  // One set per lane: ops of two lanes may run at the same time. The main lane's cuBLASLt
  // workspace is allocated at create(); a side lane's on its first product that needs one.
  struct LaneWork {
    Reusable bf16_weights, bf16_activations, f32_weights, cublas_lt_workspace;
    std::array<const Reusable*, 4> all() const {
      return {&bf16_weights, &bf16_activations, &f32_weights, &cublas_lt_workspace};
    }
  };

  // Lanes (Backend::fork_lane): index 0 is the main lane. A side lane's stream waits for
  // the main stream's `fork` event; the main stream waits for its `join` event.
  struct Lane {
    cudaStream_t stream = nullptr;
    cudaEvent_t fork = nullptr, join = nullptr;
    bool pending = false;  // forked and not joined since
    LaneWork work;
  };
  Lane lanes[Backend::kMaxLanes + 1];
  int lane = 0;  // the lane ops go to now
  cudaStream_t main_stream() const { return lanes[0].stream; }
  LaneWork& work() { return lanes[lane].work; }
  // The current lane's cuBLASLt workspace (cuda::kCublasLtWorkspaceBytes).
  Result<void*> cublas_lt_workspace() { return reusable(work().cublas_lt_workspace, cuda::kCublasLtWorkspaceBytes); }
  // Lane l's work so far ordered before the main stream's next op (an event, so it holds
  // inside a graph capture); l stays pending.
  Status main_waits_for(Lane& l);
  // Every pending side lane joined (main_waits_for); ops go to the main lane again.
  Status join_all();
  // The host waits for every lane's stream (no change to the lanes).
  Status wait_all();

  ~Impl();

  // Recorded steps by id (cuda_graph.cu); destroyed with the backend.
  std::map<int64_t, cudaGraphExec_t> graphs;
  bool capturing = false;

  // Raw scratch bytes for an op's internal workspace, valid until the next begin_step().
  Result<void*> scratch_bytes(size_t bytes);
  // `r` with at least `bytes` bytes (grown on first need).
  Result<void*> reusable(Reusable& r, size_t bytes);
  // Host bytes into device memory through the pinned staging buffer, in stream order.
  Status stage_upload(void* device, const void* host, size_t bytes);
  // The device copy of the frequencies for p (uploaded on the first call with p).
  Result<const float*> rope_omega(const RopeParams& p);
  // f for x on the device (check_row_finish, the norm weight's shape, the RoPE table), for
  // finish_rows and compress_entries.
  Result<cuda::finish::Spec> finish_spec(const Backend* self, const char* op, const Tensor& x, const RowFinish& f);
};

}  // namespace dsv4::backend
