// A small fixed pool of threads for data-parallel loops: the parameter server
// spreads an optimizer update (and gradient scans) of a large partition over
// the cores, and so do a worker's local optimizer and the optimizer benchmark.
//
// ParallelFor cuts [0, n) into a few chunks per thread (each at least
// `grain` elements and a multiple of 16 elements, so chunks of a float
// array start on 64-byte boundaries relative to its start and two threads
// never write the same cache line), queues them, and the calling thread
// works on its own call's chunks beside the pool threads until all are done.
// Chunks are handed out in order, first come first served, so a thread that
// the machine slows down takes fewer of them. The split never changes what an
// elementwise `fn` computes, only who computes which part.
//
// Waking a sleeping thread costs tens of microseconds (far more in a virtual
// machine), as long as a whole update of a partition of a million
// parameters; so a pool thread that runs out of work spins for a short while
// (`spin`, 200 us by default) before it sleeps, as OpenMP runtimes do, and
// so does a caller waiting for the pool's last chunks: the calls of one
// training step (scans, updates, encodes of several partitions) then find
// the threads awake. `spin` 0 sleeps at once.
//
// Several threads may call ParallelFor at once: their chunks share the pool
// (first call first) and each call returns when its own chunks are done.
// Calling ParallelFor from inside `fn` is not supported (it may deadlock).
// `fn` must not throw.
//
// Thread safety: thread-safe. The destructor waits for the pool threads; no
// ParallelFor may be running then.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "common/thread_annotations.h"

namespace tandem::optim {

class ThreadPool {
 public:
  // REQUIRES: threads >= 1. The pool starts threads - 1 threads; the caller
  // of ParallelFor is the last one. 1 runs everything inline on the caller.
  explicit ThreadPool(int threads, std::chrono::microseconds spin = std::chrono::microseconds(200));
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Threads that work on a ParallelFor (the pool's and the caller).
  int size() const { return size_; }

  // Runs fn(begin, end) over chunks that together cover [0, n) exactly once,
  // on the pool and the calling thread; returns when all have returned.
  // n == 0 calls nothing.
  void ParallelFor(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn);

  // The chunk length ParallelFor uses for (n, grain): a multiple of 16, at
  // least grain (rounded up to 16), at least n / (4 * size()) (rounded up).
  size_t ChunkSize(size_t n, size_t grain) const;

 private:
  // One ParallelFor call; lives on its caller's stack until its last chunk
  // is done (see ParallelFor for why no pool thread touches it after that).
  struct Job {
    const std::function<void(size_t, size_t)>* fn;
    size_t n;
    size_t chunk;
    size_t chunks;
    size_t next = 0;               // guarded by mu_
    std::atomic<size_t> done = 0;  // written under mu_; the caller may spin on it
  };

  // Claims the next chunk of the first queued job, dequeuing it once all its
  // chunks are claimed. REQUIRES: mu_ held and queue_ not empty.
  Job* Claim(size_t* index) TANDEM_REQUIRES(mu_);
  void WorkerLoop();
  // Busy-waits until ready() or spin_ has passed. Called without mu_.
  template <typename Ready>
  void Spin(const Ready& ready) const;

  const int size_;
  const std::chrono::microseconds spin_;
  Mutex mu_;
  // !queue_.empty() || stop_, readable without mu_: what spinning threads watch.
  std::atomic<bool> wake_{false};
  CondVar work_cv_;                                // queue_ became non-empty, or stop_
  CondVar done_cv_;                                // some job's last chunk finished
  std::deque<Job*> queue_ TANDEM_GUARDED_BY(mu_);  // jobs with unclaimed chunks
  bool stop_ TANDEM_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace tandem::optim
