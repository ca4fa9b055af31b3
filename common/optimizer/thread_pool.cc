#include "common/optimizer/thread_pool.h"

#include <algorithm>
#include <cstdlib>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tandem::optim {
namespace {

constexpr size_t kAlign = 16;           // elements: one 64-byte cache line of floats
constexpr size_t kChunksPerThread = 4;  // a few per thread, for balance on a busy machine

size_t RoundUp(size_t v, size_t to) {
  return (v + to - 1) / to * to;
}

void CpuRelax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

}  // namespace

ThreadPool::ThreadPool(int threads, std::chrono::microseconds spin) : size_(std::max(threads, 1)), spin_(spin) {
  threads_.reserve(static_cast<size_t>(size_ - 1));
  for (int i = 1; i < size_; ++i) threads_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
    wake_.store(true, std::memory_order_relaxed);
  }
  work_cv_.NotifyAll();
  for (std::thread& t : threads_) t.join();
}

size_t ThreadPool::ChunkSize(size_t n, size_t grain) const {
  const size_t even =
      (n + kChunksPerThread * static_cast<size_t>(size_) - 1) / (kChunksPerThread * static_cast<size_t>(size_));
  return RoundUp(std::max({grain, even, size_t{1}}), kAlign);
}

void ThreadPool::ParallelFor(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn) {
  if (n == 0) return;
  const size_t chunk = ChunkSize(n, grain);
  if (size_ == 1 || chunk >= n) {
    fn(0, n);
    return;
  }
  Job job{&fn, n, chunk, (n + chunk - 1) / chunk, 0, 0};
  MutexLock lock(&mu_);
  queue_.push_back(&job);
  wake_.store(true, std::memory_order_relaxed);
  work_cv_.NotifyAll();
  // Work on this call's chunks while any is unclaimed (other callers' jobs
  // are left to the pool threads, so this call returns as soon as it can).
  while (job.next < job.chunks) {
    const size_t index = job.next++;
    if (job.next == job.chunks) {
      queue_.erase(std::find(queue_.begin(), queue_.end(), &job));
      wake_.store(!queue_.empty() || stop_, std::memory_order_relaxed);
    }
    lock.Unlock();
    fn(index * chunk, std::min(n, (index + 1) * chunk));
    lock.Lock();
    job.done.fetch_add(1);
  }
  // Pool threads count their chunks done under mu_ and never touch the job
  // after that, so once done == chunks the job may leave this stack frame.
  if (job.done.load() != job.chunks && spin_.count() > 0) {
    lock.Unlock();
    Spin([&] { return job.done.load() == job.chunks; });
    lock.Lock();
  }
  done_cv_.Wait(lock, [&]() TANDEM_REQUIRES(mu_) { return job.done.load() == job.chunks; });
}

template <typename Ready>
void ThreadPool::Spin(const Ready& ready) const {
  const auto until = std::chrono::steady_clock::now() + spin_;
  while (!ready() && std::chrono::steady_clock::now() < until) {
    for (int i = 0; i < 16; ++i) CpuRelax();
  }
}

ThreadPool::Job* ThreadPool::Claim(size_t* index) {
  Job* job = queue_.front();
  *index = job->next++;
  if (job->next == job->chunks) {
    queue_.pop_front();
    wake_.store(!queue_.empty() || stop_, std::memory_order_relaxed);
  }
  return job;
}

void ThreadPool::WorkerLoop() {
  MutexLock lock(&mu_);
  while (true) {
    if (!stop_ && queue_.empty() && spin_.count() > 0) {
      // Spin a while before sleeping (see the header); wake_ is only a hint,
      // the queue is checked under the lock.
      lock.Unlock();
      Spin([&] { return wake_.load(std::memory_order_relaxed); });
      lock.Lock();
    }
    work_cv_.Wait(lock, [&]() TANDEM_REQUIRES(mu_) { return stop_ || !queue_.empty(); });
    if (stop_) return;
    size_t index = 0;
    Job* job = Claim(&index);
    lock.Unlock();
    (*job->fn)(index * job->chunk, std::min(job->n, (index + 1) * job->chunk));
    lock.Lock();
    // The last access to `job`: once done == chunks the caller may return
    // and the job be gone (done_cv_ is the pool's). Notified under the lock,
    // so a caller about to wait cannot miss it.
    const size_t chunks = job->chunks;
    if (job->done.fetch_add(1) + 1 == chunks) done_cv_.NotifyAll();
  }
}

}  // namespace tandem::optim
