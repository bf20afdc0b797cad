#include "backend/cuda/nccl_collective.h"

#include <string>

namespace dsv4::backend {
namespace {

Status nccl_status(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return Status::ok();
  return Status::error(std::string(what) + " failed: " + ncclGetErrorString(r));
}
#define DSV4_NCCL_TRY(call) DSV4_TRY(nccl_status((call), #call))

class NcclRank final : public Collective {
 public:
  NcclRank(ncclComm_t comm, cudaStream_t stream, int rank, int size)
      : comm_(comm), stream_(stream), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  Status all_gather(const float* send, float* recv, size_t count) override {
    return nccl_status(ncclAllGather(send, recv, count, ncclFloat32, comm_, stream_), "ncclAllGather");
  }
  Status reduce_scatter(const float* send, float* recv, size_t count) override {
    return nccl_status(ncclReduceScatter(send, recv, count, ncclFloat32, ncclSum, comm_, stream_),
                       "ncclReduceScatter");
  }
  Status all_reduce(float* data, size_t count) override {
    return nccl_status(ncclAllReduce(data, data, count, ncclFloat32, ncclSum, comm_, stream_), "ncclAllReduce");
  }
  Status all_to_all(const float* send, std::span<const size_t> send_counts, float* recv,
                    std::span<const size_t> recv_counts) override {
    if (send_counts.size() != static_cast<size_t>(size_) || recv_counts.size() != static_cast<size_t>(size_))
      return Status::errorf("all_to_all: {} send counts, {} receive counts, for {} ranks", send_counts.size(),
                            recv_counts.size(), size_);
    DSV4_NCCL_TRY(ncclGroupStart());
    size_t out = 0, in = 0;
    for (int peer = 0; peer < size_; ++peer) {
      if (send_counts[peer]) DSV4_NCCL_TRY(ncclSend(send + out, send_counts[peer], ncclFloat32, peer, comm_, stream_));
      if (recv_counts[peer]) DSV4_NCCL_TRY(ncclRecv(recv + in, recv_counts[peer], ncclFloat32, peer, comm_, stream_));
      out += send_counts[peer];
      in += recv_counts[peer];
    }
    return nccl_status(ncclGroupEnd(), "ncclGroupEnd");
  }

 private:
  ncclComm_t comm_;
  cudaStream_t stream_;
  int rank_, size_;
};

}  // namespace

Result<std::unique_ptr<NcclCollectiveGroup>> NcclCollectiveGroup::create(std::span<const int> devices,
                                                                         std::span<const cudaStream_t> streams) {
  if (devices.empty() || devices.size() != streams.size())
    return Status::errorf("NCCL group: {} devices, {} streams", devices.size(), streams.size());
  std::unique_ptr<NcclCollectiveGroup> g(new NcclCollectiveGroup());
  const int n = static_cast<int>(devices.size());
  g->comms_.resize(n);
  DSV4_NCCL_TRY(ncclCommInitAll(g->comms_.data(), n, devices.data()));
  for (int r = 0; r < n; ++r) g->ranks_.push_back(std::make_unique<NcclRank>(g->comms_[r], streams[r], r, n));
  return g;
}

NcclCollectiveGroup::~NcclCollectiveGroup() {
  for (ncclComm_t c : comms_)
    if (c) ncclCommDestroy(c);
}

Collective& NcclCollectiveGroup::rank(int r) { return *ranks_.at(r); }

}  // namespace dsv4::backend
