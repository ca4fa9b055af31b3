// Clean shutdown on SIGTERM and SIGINT.
//
// A ShutdownSignal blocks SIGTERM and SIGINT in the calling thread, so create
// it first in main(), before any thread starts: every thread created later
// inherits the mask, and only the watcher thread receives the signals (a
// handler catches those the kernel hands to threads that libraries started
// before main()). Wait()
// returns on the first signal (or RequestShutdown()); a second signal while
// shutting down exits at once with status 130, for a person who pressed Ctrl-C
// twice.
//
// Thread safety: thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <thread>

#include "common/mutex.h"
#include "common/thread_annotations.h"

namespace tandem {

class ShutdownSignal {
 public:
  ShutdownSignal();
  ~ShutdownSignal();
  ShutdownSignal(const ShutdownSignal&) = delete;
  ShutdownSignal& operator=(const ShutdownSignal&) = delete;

  // Blocks until a signal arrives or RequestShutdown() is called; returns the
  // signal number (0 when requested programmatically).
  int Wait();
  // Like Wait(), but gives up after `timeout`; returns -1 then.
  int WaitFor(std::chrono::milliseconds timeout);
  void RequestShutdown();
  bool requested() const;

 private:
  void Watch();

  mutable Mutex mu_;
  CondVar cv_;
  bool requested_ TANDEM_GUARDED_BY(mu_) = false;
  int signal_ TANDEM_GUARDED_BY(mu_) = 0;
  std::atomic<bool> stop_{false};
  std::thread watcher_;
};

}  // namespace tandem
