#include "runtime/request.h"

namespace dsv4::runtime {

std::vector<RequestEvent> RequestHandle::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return !events_.empty(); });
  std::vector<RequestEvent> out(std::make_move_iterator(events_.begin()), std::make_move_iterator(events_.end()));
  events_.clear();
  return out;
}

bool RequestHandle::finished() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

void RequestHandle::push(RequestEvent e) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;
    done_ = e.done;
    events_.push_back(std::move(e));
  }
  cv_.notify_all();
}

}  // namespace dsv4::runtime
