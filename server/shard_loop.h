// ShardLoop: the one thread on which a parameter server changes its state.
//
// Every frame a server receives (pushes, pulls, shares, replicas, state
// transfers, their replies) and every membership or control change is run
// as a task on its shard's loop, one at a time, in the order they were
// handed over. The transport's completion thread, which carries every
// peer's messages, only hands frames over (Defer) and never waits for the
// store; the store's partitions are not contended on the data path; and an
// optimizer update, which the loop spreads over the store's thread pool,
// holds up the frames behind it on the loop but never the network.
//
// Defer runs the task at once when called on the loop itself (a task that
// hands over more work, such as a send's completion arriving while the loop
// runs), and otherwise queues it and wakes the loop. Run hands a task over
// and waits for it to have run, for control calls that need its result.
// Like the optimizer's pool, an idle loop spins for a short while (`spin`)
// before it sleeps: the frames of one training step then find it awake
// instead of paying a wake-up each.
//
// Thread safety: thread-safe. Tasks must not throw and must not call Run or
// Stop (the loop would wait for itself).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <thread>

#include "common/mutex.h"
#include "common/thread_annotations.h"

namespace tandem::server {

class ShardLoop {
 public:
  using Task = std::function<void()>;

  // `name` names the thread (for logs and debuggers).
  explicit ShardLoop(std::string name = "tandem-shard",
                     std::chrono::microseconds spin = std::chrono::microseconds(100));
  // Stops the loop (Stop).
  ~ShardLoop();
  ShardLoop(const ShardLoop&) = delete;
  ShardLoop& operator=(const ShardLoop&) = delete;

  // Runs `task` on the loop: now when called from the loop, else queued.
  // After Stop, a task is dropped (returns false); true otherwise.
  bool Defer(Task task) TANDEM_EXCLUDES(mu_);
  // Runs `task` on the loop and returns once it has run (at once on the
  // loop itself). False, without running it, after Stop.
  bool Run(Task task) TANDEM_EXCLUDES(mu_);
  // Whether the calling thread is the loop.
  bool InLoop() const { return std::this_thread::get_id() == thread_id_.load(); }
  // Runs the tasks already queued, then ends the loop and joins it; later
  // tasks are dropped. Idempotent; not from a task.
  void Stop() TANDEM_EXCLUDES(mu_);

  // Tasks started so far, and the most that waited at once (for the
  // metrics).
  uint64_t tasks_run() const { return tasks_run_.load(std::memory_order_relaxed); }
  size_t max_queued() const { return max_queued_.load(std::memory_order_relaxed); }

 private:
  void Loop();

  const std::chrono::microseconds spin_;
  Mutex mu_;
  CondVar wake_;
  std::deque<Task> queue_ TANDEM_GUARDED_BY(mu_);
  bool stopping_ TANDEM_GUARDED_BY(mu_) = false;
  bool sleeping_ TANDEM_GUARDED_BY(mu_) = false;
  // Tasks queued and not yet taken (read without the lock while spinning).
  std::atomic<size_t> queued_{0};
  std::atomic<uint64_t> tasks_run_{0};
  std::atomic<size_t> max_queued_{0};
  std::atomic<std::thread::id> thread_id_{};
  Mutex stop_mu_;
  std::thread thread_;
};

}  // namespace tandem::server
