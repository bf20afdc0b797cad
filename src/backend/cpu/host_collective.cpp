#include "backend/cpu/host_collective.h"

#include <algorithm>
#include <cstring>
#include <numeric>

namespace dsv4::backend {

// What each rank publishes for the op in progress.
struct Posted {
  const float* send = nullptr;
  std::span<const size_t> send_counts;
  size_t count = 0;
};

struct HostCollectiveGroup::Shared {
  explicit Shared(int n) : posted(n), barrier(n) {}
  std::vector<Posted> posted;
  std::barrier<> barrier;
};

class HostCollectiveGroup::Rank final : public Collective {
 public:
  Rank(Shared& shared, int rank, int size) : s_(shared), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  Status all_gather(const float* send, float* recv, size_t count) override {
    publish({send, {}, count});
    Status st = same_counts("all_gather");
    if (st.is_ok())
      for (int r = 0; r < size_; ++r) std::memcpy(recv + r * count, s_.posted[r].send, count * sizeof(float));
    s_.barrier.arrive_and_wait();
    return st;
  }

  Status reduce_scatter(const float* send, float* recv, size_t count) override {
    publish({send, {}, count});
    Status st = same_counts("reduce_scatter");
    if (st.is_ok()) sum_block(recv, rank_ * count, count);
    s_.barrier.arrive_and_wait();
    return st;
  }

  Status all_reduce(float* data, size_t count) override {
    publish({data, {}, count});
    Status st = same_counts("all_reduce");
    std::vector<float> sum;
    if (st.is_ok()) {
      sum.resize(count);
      sum_block(sum.data(), 0, count);
    }
    s_.barrier.arrive_and_wait();  // everyone has read every rank's data: now overwrite it
    if (st.is_ok()) std::copy(sum.begin(), sum.end(), data);
    return st;
  }

  Status all_to_all(const float* send, std::span<const size_t> send_counts, float* recv,
                    std::span<const size_t> recv_counts) override {
    publish({send, send_counts, 0});
    Status st = Status::ok();
    for (int r = 0; r < size_ && st.is_ok(); ++r)
      if (s_.posted[r].send_counts.size() != static_cast<size_t>(size_) ||
          recv_counts.size() != static_cast<size_t>(size_))
        st = Status::errorf("all_to_all: rank {} gave {} send counts, rank {} {} receive counts, for {} ranks", r,
                            s_.posted[r].send_counts.size(), rank_, recv_counts.size(), size_);
    size_t at = 0;
    for (int r = 0; r < size_ && st.is_ok(); ++r) {
      const auto& counts = s_.posted[r].send_counts;
      if (counts[rank_] != recv_counts[r]) {
        st = Status::errorf("all_to_all: rank {} sends {} values to rank {}, which expects {}", r, counts[rank_],
                            rank_, recv_counts[r]);
        break;
      }
      const size_t offset = std::accumulate(counts.begin(), counts.begin() + rank_, size_t{0});
      std::memcpy(recv + at, s_.posted[r].send + offset, counts[rank_] * sizeof(float));
      at += counts[rank_];
    }
    s_.barrier.arrive_and_wait();
    return st;
  }

 private:
  void publish(Posted p) {
    s_.posted[rank_] = p;
    s_.barrier.arrive_and_wait();
  }
  // Every rank gets the same verdict (all compare with rank 0).
  Status same_counts(const char* op) const {
    for (int r = 1; r < size_; ++r)
      if (s_.posted[r].count != s_.posted[0].count)
        return Status::errorf("{}: ranks disagree on the count: rank 0 gave {} values, rank {} {}", op,
                              s_.posted[0].count, r, s_.posted[r].count);
    return Status::ok();
  }
  // out[i] = rank 0's send[offset + i] + rank 1's + ... (rank order: deterministic).
  void sum_block(float* out, size_t offset, size_t count) const {
    std::memcpy(out, s_.posted[0].send + offset, count * sizeof(float));
    for (int r = 1; r < size_; ++r) {
      const float* in = s_.posted[r].send + offset;
      for (size_t i = 0; i < count; ++i) out[i] += in[i];
    }
  }

  Shared& s_;
  int rank_, size_;
};

HostCollectiveGroup::HostCollectiveGroup(int n_ranks) : shared_(std::make_unique<Shared>(std::max(n_ranks, 1))) {
  for (int r = 0; r < std::max(n_ranks, 1); ++r)
    ranks_.push_back(std::make_unique<Rank>(*shared_, r, std::max(n_ranks, 1)));
}

HostCollectiveGroup::~HostCollectiveGroup() = default;

Collective& HostCollectiveGroup::rank(int r) { return *ranks_.at(r); }

}  // namespace dsv4::backend
