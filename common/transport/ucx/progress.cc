// The progress thread's loop (Run) and the rounds of it that a waiter runs
// on its own thread (Progress): starting what was posted, UCX progress,
// sleeping in epoll, and the role hand-over between the two.
#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>

#include "common/transport/ucx/core.h"

namespace tandem::transport::ucx {

using std::chrono::microseconds;
using std::chrono::milliseconds;

thread_local constinit const void* t_progress_core = nullptr;
thread_local constinit const void* t_deferring_core = nullptr;

Transport::Progressed Core::Progress() {
  using P = Transport::Progressed;
  if (t_progress_core == this)
    return P::kBusy;  // a completion: the round that runs it goes on when it
                      // returns
  if (!role_mu_.TryLock()) return P::kBusy;
  MutexLock role(&role_mu_, std::adopt_lock);
  if (stopping_.load()) return P::kBusy;
  {
    MutexLock lock(&mu_);
    if (!connected_) return P::kBusy;
  }
  // This thread may be another transport's progress thread, in one of its
  // completions: it gets that role back.
  const void* const outer = t_progress_core;
  t_progress_core = this;
  bool active = RunQueued();
  active = ProgressAll() || active;
  HandleFailures();
  t_progress_core = outer;
  if (polled_sends_ > 0) {
    // Sends waiting for room in a FIFO raise no event: the progress thread
    // must not sleep through them once this caller stops.
    MutexLock lock(&mu_);
    if (sleeping_) WakeLocked();
  }
  return active ? P::kActive : P::kIdle;
}

void Core::WakeLocked() {
  work_.store(true, std::memory_order_release);
  if (sleeping_) {
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = write(wake_fd_, &one, sizeof(one));
  }
}

bool Core::RunQueued() {
  bool active = RunDeferred();
  if (!work_.load(std::memory_order_acquire)) return active;
  std::vector<std::shared_ptr<Op>> cancels;
  std::vector<std::function<void()>> tasks;
  {
    MutexLock lock(&mu_);
    cancels.swap(cancels_);
    tasks.swap(tasks_);
    work_.store(false, std::memory_order_relaxed);
  }
  active = StartPosted(/*defer=*/false) || active;
  for (auto& op : cancels) Cancel(op);
  for (auto& task : tasks) task();
  return active || !cancels.empty() || !tasks.empty();
}

bool Core::StartPosted(bool defer) {
  uint64_t batch = 0;
  {
    MutexLock lock(&mu_);
    if (!posted_.empty()) {
      batch = ++batches_taken_;
      for (auto& op : posted_) starting_.push_back(std::move(op));
      posted_.clear();
    }
  }
  {
    // Restores the outer value however the loop ends.
    struct Deferring {
      const void* outer = t_deferring_core;
      ~Deferring() { t_deferring_core = outer; }
    } deferring;
    if (defer) t_deferring_core = this;
    // A completion run by a Start below may start operations itself
    // (WaitPosted): it takes them from starting_ in the same order.
    while (!starting_.empty()) {
      std::shared_ptr<Op> op = std::move(starting_.front());
      starting_.pop_front();
      Start(op);
    }
  }
  // Deferred completions: a caller's round may be the last for a while.
  const bool wake = defer && !deferred_.empty();
  if (batch != 0 || wake) {
    bool waiters = false;
    {
      MutexLock lock(&mu_);
      if (batch != 0) batches_started_ = std::max(batches_started_, batch);
      waiters = batch != 0 && posted_waiters_ > 0;
      if (wake) WakeLocked();
    }
    if (waiters) started_cv_.NotifyAll();
  }
  return batch != 0;
}

bool Core::RunDeferred() {
  if (deferred_.empty()) return false;
  std::vector<std::pair<std::shared_ptr<Op>, Status>> ended;
  ended.swap(deferred_);
  for (auto& [op, status] : ended) Finish(*op, std::move(status));
  return true;
}

bool Core::ProgressAll() {
  unsigned events = 0;
  for (ucp_worker_h w : workers_) {
    for (int i = 0; i < 64; ++i) {
      const unsigned n = ucp_worker_progress(w);
      if (n == 0) break;
      events += n;
    }
  }
  if (!closing_.empty()) {
    std::erase_if(closing_, [](void* r) {
      if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
      ucp_request_free(r);
      return true;
    });
  }
  return events > 0;
}

void Core::Drain() {
  for (int i = 0; i < 1000 && ProgressAll(); ++i) {
  }
}

bool Core::PrepareSleep() {
  for (ucp_worker_h w : workers_) {
    const ucs_status_t st = ucp_worker_arm(w);
    if (st == UCS_ERR_BUSY) return false;  // events pending: progress first
    if (st != UCS_OK) {                    // no wake-up support: poll gently
      std::this_thread::sleep_for(microseconds(100));
      return false;
    }
  }
  {
    MutexLock lock(&mu_);
    if (work_.load() || stopping_.load()) return false;
    sleeping_ = true;
  }
  return true;
}

void Core::Sleep(Clock::duration max) {
  const auto ms = std::chrono::duration_cast<milliseconds>(max).count() + 1;
  epoll_event events[4];
  epoll_wait(epoll_fd_, events, 4, static_cast<int>(std::clamp<int64_t>(ms, 1, 1000)));
  {
    MutexLock lock(&mu_);
    sleeping_ = false;
  }
  uint64_t value = 0;
  while (read(wake_fd_, &value, sizeof(value)) > 0) {
  }
}

void Core::Run() {
  auto last_activity = Clock::now();
  auto next_check = last_activity + options_.liveness_interval;
  while (!stopping_.load()) {
    if (!role_mu_.TryLock()) {
      // A caller is making progress (Progress()) and stops once its own
      // operation is done: stay awake to take over.
      last_activity = Clock::now();
      std::this_thread::yield();
      continue;
    }
    MutexLock role(&role_mu_, std::adopt_lock);
    bool active = RunQueued();
    active = ProgressAll() || active;
    HandleFailures();
    const auto now = Clock::now();
    if (now >= next_check) {
      CheckPeers();
      next_check = now + options_.liveness_interval;
    }
    if (active) {
      last_activity = now;
      continue;
    }
    if (options_.progress == UcxProgressMode::kBusyPoll || polled_sends_ > 0 || now - last_activity < options_.spin) {
      // Nothing this round: let a thread waiting for this core run (on a
      // busy host it is often the one that consumes what arrives). Costs
      // one system call when no other thread is runnable.
      role.Unlock();
      std::this_thread::yield();
      continue;
    }
    const bool may_sleep = PrepareSleep();
    role.Unlock();  // a caller may make progress meanwhile
    if (may_sleep) Sleep(next_check - now);
    last_activity = Clock::now();
  }
  Teardown();
}

}  // namespace tandem::transport::ucx
