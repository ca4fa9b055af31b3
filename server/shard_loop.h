// ShardLoop: where a parameter server changes its state, one task at a time.
//
// Every frame a server receives (pushes, pulls, shares, replicas, state
// transfers, their replies) and every membership or control change is run
// as a task on its shard's loop, one at a time, in the order they were
// handed over; nothing else changes the store. The loop is a serial
// executor in the manner of tensorpipe's on-demand deferred executor: it is
// not tied to a thread, but run by whichever thread holds it.
//
// - Defer(task): at once when the calling thread already runs the loop;
//   else queued, and when no thread runs the loop the caller takes it and
//   runs the queue itself. So the transport's completion thread answers a
//   pull, or takes in a small push, without handing it to another thread
//   when the server is idle, and only queues it while another thread runs
//   the loop.
// - Post(task) and Offload(task): for work that must not run on the caller
//   (an optimizer update, a large push, a replica: they would hold up the
//   completion thread that carries every peer's messages). The loop's own
//   thread runs them, in order with everything else: Post queues the task;
//   Offload, called from a task, puts the rest of that task's work first
//   in the queue, and the thread that runs the loop hands it to the loop's
//   thread once the current task returns. On the loop's thread, Offload
//   runs the work at once.
// - Run(task): Defer, then wait until it has run (control calls that need
//   its result).
//
// Thread safety: thread-safe. Tasks must not throw, and must not call Run
// of another loop or Stop.
#pragma once

#include <atomic>
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

  // `name` names the loop's thread (for logs and debuggers).
  explicit ShardLoop(std::string name = "tandem-shard");
  // Stops the loop (Stop).
  ~ShardLoop();
  ShardLoop(const ShardLoop&) = delete;
  ShardLoop& operator=(const ShardLoop&) = delete;

  // Runs `task` on the loop, on this thread when it can (above). False,
  // having dropped the task, after Stop.
  bool Defer(Task task) TANDEM_EXCLUDES(mu_);
  // Runs `task` on the loop's thread, after what is queued. False after
  // Stop.
  bool Post(Task task) TANDEM_EXCLUDES(mu_);
  // From a task: runs `task` on the loop's thread before anything queued
  // (at once when already there). Outside a task it is Post.
  void Offload(Task task) TANDEM_EXCLUDES(mu_);
  // Runs `task` on the loop and returns once it has run (at once when the
  // caller runs the loop). False, without running it, after Stop.
  bool Run(Task task) TANDEM_EXCLUDES(mu_);
  // Whether the calling thread runs the loop now.
  bool InLoop() const;
  // Runs the tasks already queued, then ends the loop's thread; later tasks
  // are dropped. Idempotent; not from a task.
  void Stop() TANDEM_EXCLUDES(mu_);

  // Tasks started so far, and those the loop's thread ran (for tests).
  uint64_t tasks_run() const { return tasks_run_.load(std::memory_order_relaxed); }
  uint64_t tasks_on_thread() const { return tasks_on_thread_.load(std::memory_order_relaxed); }

 private:
  struct Entry {
    Task task;
    bool on_thread = false;  // only the loop's thread may run it
  };
  enum class Owner { kNone, kCaller, kThread };

  // Runs queued tasks on the calling thread, which holds the loop (as a
  // caller or as the loop's thread), until the queue is empty or, for a
  // caller, a task that must run on the loop's thread is next.
  void Drain(bool on_thread) TANDEM_EXCLUDES(mu_);
  void ThreadMain();
  void RunTask(Task& task);

  Mutex mu_;
  CondVar wake_;
  std::deque<Entry> queue_ TANDEM_GUARDED_BY(mu_);
  Owner owner_ TANDEM_GUARDED_BY(mu_) = Owner::kNone;
  // Offloaded by the task running now: they go before the rest, in order.
  size_t offloaded_ TANDEM_GUARDED_BY(mu_) = 0;
  bool stopping_ TANDEM_GUARDED_BY(mu_) = false;
  bool stopped_ TANDEM_GUARDED_BY(mu_) = false;
  std::atomic<uint64_t> tasks_run_{0};
  std::atomic<uint64_t> tasks_on_thread_{0};
  Mutex stop_mu_;
  std::thread thread_;
};

}  // namespace tandem::server
