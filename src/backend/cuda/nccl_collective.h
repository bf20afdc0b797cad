// Collectives (backend/collective.h) between the GPUs of one host through NCCL: one
// process, one thread and one stream per GPU (each rank's stream is its CudaBackend's, so
// a collective is ordered with the backend's work and needs no host synchronisation; NCCL
// supports stream capture, so it may go into the decode graph, not yet tried). Library
// dsv4_nccl, built only with -DDSV4_CUDA=ON when NCCL is found (it defines DSV4_HAVE_NCCL);
// dsv4 and test_cuda do not link it.
//
// Sums are NCCL's: deterministic run to run on the same GPUs, counts and NCCL version, but
// not in rank order; the expert-parallel MoE combines with all_gather only (a copy), so
// its result does not depend on the reduction order. Keep NVLink SHARP / multicast off
// (NCCL_NVLS_ENABLE=0): the device machines do not support it (docs/MULTI-GPU.md).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <memory>
#include <span>
#include <vector>

#include "backend/collective.h"

namespace dsv4::backend {

class NcclCollectiveGroup {
 public:
  // One rank per device, in order; streams[r] is rank r's stream (on devices[r]).
  static Result<std::unique_ptr<NcclCollectiveGroup>> create(std::span<const int> devices,
                                                             std::span<const cudaStream_t> streams);
  ~NcclCollectiveGroup();
  int size() const { return static_cast<int>(ranks_.size()); }
  Collective& rank(int r);

 private:
  NcclCollectiveGroup() = default;
  std::vector<ncclComm_t> comms_;
  std::vector<std::unique_ptr<Collective>> ranks_;
};

}  // namespace dsv4::backend
