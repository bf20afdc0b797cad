// The host collectives (backend/cpu/host_collective.h): each op over 1-4 rank threads
// against the same data moved or summed by hand in rank order (so sums compare exactly),
// variable all-to-all blocks, and mismatched counts reported on every rank.
#include <gtest/gtest.h>

#include <random>
#include <thread>
#include <vector>

#include "backend/cpu/host_collective.h"
#include "support/test_support.h"

namespace dsv4::backend {
namespace {

// Runs body(rank) on n threads and returns each rank's status.
template <class Body>
std::vector<Status> on_ranks(int n, Body body) {
  std::vector<Status> out(n, Status::ok());
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([&, r] { out[r] = body(r); });
  for (auto& t : threads) t.join();
  return out;
}

std::vector<std::vector<float>> random_per_rank(int n, size_t count, std::mt19937_64& rng) {
  std::vector<std::vector<float>> v;
  for (int r = 0; r < n; ++r) v.push_back(test::random_normal(count, rng, 1.0f));
  return v;
}

constexpr float kPoison = std::numeric_limits<float>::quiet_NaN();

TEST(HostCollective, GatherScatterReduceInRankOrder) {
  std::mt19937_64 rng(test::test_seed());
  for (int n : {1, 2, 3, 4}) {
    SCOPED_TRACE(n);
    HostCollectiveGroup group(n);
    const size_t count = 37;
    const auto send = random_per_rank(n, n * count, rng);
    std::vector<std::vector<float>> gathered(n, std::vector<float>(n * count, kPoison));
    std::vector<std::vector<float>> scattered(n, std::vector<float>(count, kPoison));
    std::vector<std::vector<float>> reduced = send;
    for (const Status& s : on_ranks(n, [&](int r) -> Status {
           Collective& c = group.rank(r);
           DSV4_TRY(c.all_gather(send[r].data(), gathered[r].data(), count));
           DSV4_TRY(c.reduce_scatter(send[r].data(), scattered[r].data(), count));
           return c.all_reduce(reduced[r].data(), n * count);
         }))
      ASSERT_TRUE(s.is_ok()) << s.message();
    for (int r = 0; r < n; ++r) {
      for (int src = 0; src < n; ++src)
        for (size_t i = 0; i < count; ++i) ASSERT_EQ(gathered[r][src * count + i], send[src][i]);
      for (size_t i = 0; i < n * count; ++i) {
        float sum = send[0][i];
        for (int src = 1; src < n; ++src) sum += send[src][i];
        ASSERT_EQ(reduced[r][i], sum) << "rank " << r << " element " << i;  // rank order: exact
        if (i / count == static_cast<size_t>(r)) {
          ASSERT_EQ(scattered[r][i % count], sum);
        }
      }
    }
  }
}

TEST(HostCollective, AllToAllWithBlocksOfDifferentSizes) {
  std::mt19937_64 rng(test::test_seed());
  const int n = 3;
  HostCollectiveGroup group(n);
  // counts[s][d]: values rank s sends to rank d.
  const std::vector<std::vector<size_t>> counts = {{2, 0, 5}, {1, 4, 3}, {6, 2, 0}};
  std::vector<std::vector<float>> send, recv(n);
  std::vector<std::vector<size_t>> recv_counts(n, std::vector<size_t>(n));
  for (int s = 0; s < n; ++s) {
    send.push_back(test::random_normal(counts[s][0] + counts[s][1] + counts[s][2], rng, 1.0f));
    for (int d = 0; d < n; ++d) recv_counts[d][s] = counts[s][d];
  }
  for (int d = 0; d < n; ++d) recv[d].assign(counts[0][d] + counts[1][d] + counts[2][d], kPoison);
  for (const Status& s : on_ranks(n, [&](int r) {
         return group.rank(r).all_to_all(send[r].data(), counts[r], recv[r].data(), recv_counts[r]);
       }))
    ASSERT_TRUE(s.is_ok()) << s.message();
  for (int d = 0; d < n; ++d) {
    size_t at = 0;
    for (int s = 0; s < n; ++s) {
      size_t offset = 0;
      for (int before = 0; before < d; ++before) offset += counts[s][before];
      for (size_t i = 0; i < counts[s][d]; ++i) ASSERT_EQ(recv[d][at++], send[s][offset + i]) << s << "->" << d;
    }
  }
}

TEST(HostCollective, MismatchedCountsFailOnEveryRank) {
  HostCollectiveGroup group(2);
  std::vector<float> a(8, 1.0f), b(16, kPoison);
  const auto st = on_ranks(2, [&](int r) { return group.rank(r).all_gather(a.data(), b.data(), r == 0 ? 4 : 3); });
  for (const Status& s : st) {
    ASSERT_FALSE(s.is_ok());
    EXPECT_NE(s.message().find("all_gather: ranks disagree on the count: rank 0 gave 4 values, rank 1 3"), std::string::npos) << s.message();
  }
  const std::vector<size_t> send_counts = {1, 2}, recv_wrong = {1, 5};
  const auto st2 = on_ranks(2, [&](int r) {
    return group.rank(r).all_to_all(a.data(), send_counts, b.data(), r == 1 ? std::span<const size_t>(recv_wrong)
                                                                            : std::span<const size_t>(send_counts));
  });
  EXPECT_FALSE(st2[1].is_ok());
  EXPECT_NE(st2[1].message().find("which expects"), std::string::npos) << st2[1].message();
}

}  // namespace
}  // namespace dsv4::backend
