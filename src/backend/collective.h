// Collectives over the N ranks of one model (docs/MULTI-GPU.md): one Collective object per
// rank, each driven by its own thread; every rank makes the same calls in the same order.
// Buffers are F32 in the memory of the rank's backend (host memory for the host
// implementation, device memory for NCCL). Sums run in rank order 0, 1, ..., N-1, so a
// result does not depend on timing (the host implementation is bit-exact run to run).
//
// Implementations: HostCollectiveGroup (backend/cpu/host_collective.h: threads and
// memcpy, the CPU reference and CI's test bed) and NcclCollectiveGroup
// (backend/cuda/nccl_collective.h, library dsv4_nccl: -DDSV4_CUDA=ON with NCCL found).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "util/status.h"

namespace dsv4::backend {

class Collective {
 public:
  virtual ~Collective() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // recv[r * count ...] = rank r's send[0 .. count); recv holds size() * count values.
  virtual Status all_gather(const float* send, float* recv, size_t count) = 0;
  // recv[i] = sum over ranks r (in rank order) of rank r's send[rank() * count + i];
  // send holds size() * count values.
  virtual Status reduce_scatter(const float* send, float* recv, size_t count) = 0;
  // data[i] = sum over ranks (in rank order) of their data[i], on every rank.
  virtual Status all_reduce(float* data, size_t count) = 0;
  // send is size() blocks, block d (send_counts[d] values) for rank d; recv is size()
  // blocks, block s (recv_counts[s] values) from rank s. recv_counts[s] must equal rank s's
  // send_counts[rank()].
  virtual Status all_to_all(const float* send, std::span<const size_t> send_counts, float* recv,
                            std::span<const size_t> recv_counts) = 0;
};

}  // namespace dsv4::backend
