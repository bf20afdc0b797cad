// NCCL collectives (backend/cuda/nccl_collective.h) on every GPU of the machine against the
// host collectives on the same data: all-gather and all-to-all exactly, sums within fp32
// rounding of the rank-order sum (NCCL's order is its own). Needs 2+ GPUs; skipped otherwise.
#include <gtest/gtest.h>

#ifdef DSV4_HAVE_NCCL
#include <cuda_runtime.h>

#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "backend/cpu/host_collective.h"
#include "backend/cuda/nccl_collective.h"
#include "support/test_support.h"

namespace dsv4::backend {
namespace {

TEST(NcclCollective, MatchesTheHostCollectives) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;  // no driver: no GPU
  if (n < 2) GTEST_SKIP() << "needs 2 or more GPUs, found " << n;
  std::vector<int> devices(n);
  std::vector<cudaStream_t> streams(n);
  for (int r = 0; r < n; ++r) {
    devices[r] = r;
    ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
    ASSERT_EQ(cudaStreamCreate(&streams[r]), cudaSuccess);
  }
  auto group = NcclCollectiveGroup::create(devices, streams);
  ASSERT_TRUE(group.is_ok()) << group.status().message();
  HostCollectiveGroup host(n);
  std::mt19937_64 rng(test::test_seed());
  const size_t count = 4099;
  std::vector<std::vector<float>> send(n);
  for (auto& s : send) s = test::random_normal(n * count, rng, 1.0f);
  // counts[s][d] for the all-to-all: uneven, some empty.
  std::vector<std::vector<size_t>> sc(n, std::vector<size_t>(n)), rc(n, std::vector<size_t>(n));
  for (int s = 0; s < n; ++s)
    for (int d = 0; d < n; ++d) rc[d][s] = sc[s][d] = (s * 7 + d * 3) % 5 == 0 ? 0 : (s + 1) * 13 + d;
  struct Out { std::vector<float> gathered, reduced, exchanged; };
  std::vector<Out> gpu(n), cpu(n);
  auto recv_total = [&](int r) { size_t t = 0; for (size_t c : rc[r]) t += c; return t; };
  std::vector<std::thread> threads;
  std::vector<Status> st(n, Status::ok());
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      cudaSetDevice(r);
      float *d_send = nullptr, *d_gather = nullptr, *d_reduce = nullptr, *d_x = nullptr;
      cudaMalloc(&d_send, n * count * 4);
      cudaMalloc(&d_gather, n * n * count * 4);
      cudaMalloc(&d_reduce, n * count * 4);
      cudaMalloc(&d_x, std::max<size_t>(recv_total(r), 1) * 4);
      cudaMemcpy(d_send, send[r].data(), n * count * 4, cudaMemcpyHostToDevice);
      cudaMemcpy(d_reduce, send[r].data(), n * count * 4, cudaMemcpyHostToDevice);
      Collective& c = group->get()->rank(r);
      st[r] = c.all_gather(d_send, d_gather, n * count);
      if (st[r].is_ok()) st[r] = c.all_reduce(d_reduce, n * count);
      if (st[r].is_ok()) st[r] = c.all_to_all(d_send, sc[r], d_x, rc[r]);
      cudaStreamSynchronize(streams[r]);
      gpu[r].gathered.resize(n * n * count);
      gpu[r].reduced.resize(n * count);
      gpu[r].exchanged.resize(recv_total(r));
      cudaMemcpy(gpu[r].gathered.data(), d_gather, n * n * count * 4, cudaMemcpyDeviceToHost);
      cudaMemcpy(gpu[r].reduced.data(), d_reduce, n * count * 4, cudaMemcpyDeviceToHost);
      cudaMemcpy(gpu[r].exchanged.data(), d_x, recv_total(r) * 4, cudaMemcpyDeviceToHost);
      cudaFree(d_send); cudaFree(d_gather); cudaFree(d_reduce); cudaFree(d_x);
      Collective& h = host.rank(r);
      cpu[r].gathered.resize(n * n * count);
      cpu[r].reduced = send[r];
      cpu[r].exchanged.resize(recv_total(r));
      (void)h.all_gather(send[r].data(), cpu[r].gathered.data(), n * count);
      (void)h.all_reduce(cpu[r].reduced.data(), n * count);
      (void)h.all_to_all(send[r].data(), sc[r], cpu[r].exchanged.data(), rc[r]);
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(st[r].is_ok()) << st[r].message();
    EXPECT_EQ(gpu[r].gathered, cpu[r].gathered) << "rank " << r;
    EXPECT_EQ(gpu[r].exchanged, cpu[r].exchanged) << "rank " << r;
    double worst = 0;
    for (size_t i = 0; i < cpu[r].reduced.size(); ++i) {
      ASSERT_TRUE(std::isfinite(gpu[r].reduced[i]));
      worst = std::max(worst, std::fabs(double(gpu[r].reduced[i]) - cpu[r].reduced[i]) /
                                  std::max(1.0, std::fabs(double(cpu[r].reduced[i]))));
    }
    EXPECT_LE(worst, n * 1.2e-7) << "rank " << r;
  }
  for (cudaStream_t s : streams) cudaStreamDestroy(s);
}

}  // namespace
}  // namespace dsv4::backend
#endif  // DSV4_HAVE_NCCL
