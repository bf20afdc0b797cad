// Collectives between N ranks that are threads of one process, over host memory: each op
// publishes every rank's buffers, waits for all ranks (a barrier), copies or sums in rank
// order, and waits again before anyone may reuse its buffers. The CPU reference for the
// multi-GPU path (collective.h) and the test bed of expert-parallel MoE.
#pragma once

#include <barrier>
#include <memory>
#include <vector>

#include "backend/collective.h"

namespace dsv4::backend {

class HostCollectiveGroup {
 public:
  explicit HostCollectiveGroup(int n_ranks);  // n_ranks >= 1
  ~HostCollectiveGroup();
  int size() const { return static_cast<int>(ranks_.size()); }
  Collective& rank(int r);  // r in [0, size())

 private:
  struct Shared;
  class Rank;
  std::unique_ptr<Shared> shared_;
  std::vector<std::unique_ptr<Collective>> ranks_;
};

}  // namespace dsv4::backend
