#include "util/thread_pool.h"

#include <algorithm>
#include <memory>

namespace dsv4 {
namespace {
int g_global_threads = 0;
}

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = std::max(1u, std::thread::hardware_concurrency());
  n_threads_ = n_threads;
  for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker(int index) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t, int64_t, int)>* job;
    int64_t n, chunk;
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
      n = job_n_;
      chunk = job_chunk_;
    }
    const int64_t b = std::min(n, chunk * index), e = std::min(n, b + chunk);
    if (b < e) (*job)(b, e, index);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn,
                              int64_t grain) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t max_parts = std::max<int64_t>(1, n / grain);
  const int parts = static_cast<int>(std::min<int64_t>(n_threads_, max_parts));
  if (parts <= 1) {
    fn(0, n, 0);
    return;
  }
  const int64_t chunk = (n + n_threads_ - 1) / n_threads_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    job_n_ = n;
    job_chunk_ = chunk;
    pending_ = n_threads_ - 1;
    ++generation_;
  }
  start_cv_.notify_all();
  fn(0, std::min(n, chunk), 0);
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return pending_ == 0; });
}

ThreadPool& ThreadPool::global() {
  static ThreadPool pool(g_global_threads);
  return pool;
}

void ThreadPool::set_global_threads(int n) { g_global_threads = n; }

}  // namespace dsv4
