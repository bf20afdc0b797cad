// A fixed set of worker threads running index ranges in parallel. The CPU backend calls
// parallel_for once per operation, so the workers are persistent (no thread start per op).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace dsv4 {

class ThreadPool {
 public:
  // n_threads <= 0: one per hardware thread. The caller's thread is one of them.
  explicit ThreadPool(int n_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  // Calls fn(begin, end, thread_index) over [0, n) split into contiguous chunks of at
  // least `grain` indices; returns when all are done. Not reentrant.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn,
                    int64_t grain = 1);

  static ThreadPool& global();            // sized by set_global_threads or hardware
  static void set_global_threads(int n);  // before first use of global()

 private:
  void worker(int index);
  int n_threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  const std::function<void(int64_t, int64_t, int)>* job_ = nullptr;
  int64_t job_n_ = 0, job_chunk_ = 0;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

}  // namespace dsv4
