#include "server/shard_loop.h"

#include <pthread.h>

#include <utility>

namespace tandem::server {

ShardLoop::ShardLoop(std::string name, std::chrono::microseconds spin) : spin_(spin) {
  thread_ = std::thread([this, name = std::move(name)] {
    thread_id_.store(std::this_thread::get_id());
    pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
    Loop();
  });
  // Defer from the loop itself must see the id from the first task on.
  while (thread_id_.load() == std::thread::id()) std::this_thread::yield();
}

ShardLoop::~ShardLoop() {
  Stop();
}

bool ShardLoop::Defer(Task task) {
  if (InLoop()) {
    tasks_run_.fetch_add(1, std::memory_order_relaxed);
    task();
    return true;
  }
  bool wake = false;
  {
    MutexLock lock(&mu_);
    if (stopping_) return false;
    queue_.push_back(std::move(task));
    const size_t n = queued_.fetch_add(1, std::memory_order_release) + 1;
    if (n > max_queued_.load(std::memory_order_relaxed)) max_queued_.store(n, std::memory_order_relaxed);
    wake = sleeping_;
  }
  if (wake) wake_.NotifyOne();
  return true;
}

bool ShardLoop::Run(Task task) {
  if (InLoop()) {
    tasks_run_.fetch_add(1, std::memory_order_relaxed);
    task();
    return true;
  }
  Mutex done_mu;
  CondVar done_cv;
  bool done = false;
  const bool queued = Defer([&] {
    task();
    MutexLock lock(&done_mu);
    done = true;
    done_cv.NotifyAll();
  });
  if (!queued) return false;
  MutexLock lock(&done_mu);
  done_cv.Wait(lock, [&] { return done; });
  return true;
}

void ShardLoop::Loop() {
  for (;;) {
    // Spin a little before sleeping: a step's frames come in bursts.
    if (queued_.load(std::memory_order_acquire) == 0 && spin_.count() > 0) {
      const auto until = std::chrono::steady_clock::now() + spin_;
      // Yielding, not pausing: where the server shares a core with the
      // transport's progress thread (bench ps pins it to one), the frame
      // this loop waits for needs that thread to run.
      while (queued_.load(std::memory_order_acquire) == 0 && std::chrono::steady_clock::now() < until) {
        std::this_thread::yield();
      }
    }
    std::deque<Task> batch;
    {
      MutexLock lock(&mu_);
      sleeping_ = true;
      wake_.Wait(lock, [&]() TANDEM_REQUIRES(mu_) { return !queue_.empty() || stopping_; });
      sleeping_ = false;
      if (queue_.empty()) return;  // stopping, and nothing left
      batch.swap(queue_);
      queued_.fetch_sub(batch.size(), std::memory_order_relaxed);
    }
    for (Task& task : batch) {
      tasks_run_.fetch_add(1, std::memory_order_relaxed);
      task();
    }
  }
}

void ShardLoop::Stop() {
  MutexLock stop(&stop_mu_);
  {
    MutexLock lock(&mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  wake_.NotifyAll();
  if (thread_.joinable()) thread_.join();
}

}  // namespace tandem::server
