// Tandem's lock types: a mutex, a scoped lock and a condition variable that
// clang's -Wthread-safety understands. std::mutex carries no capability
// attribute, so TANDEM_GUARDED_BY(mu_) on a std::mutex is never checked; on a
// tandem::Mutex it is (the clang build in CI turns the warnings into errors).
//
//   class Queue {
//     Mutex mu_;
//     CondVar cv_;
//     std::deque<int> items_ TANDEM_GUARDED_BY(mu_);
//    public:
//     void Push(int v) TANDEM_EXCLUDES(mu_) {
//       MutexLock lock(&mu_);
//       items_.push_back(v);
//       cv_.NotifyOne();
//     }
//     int Pop() TANDEM_EXCLUDES(mu_) {
//       MutexLock lock(&mu_);
//       cv_.Wait(lock, [&]() TANDEM_REQUIRES(mu_) { return !items_.empty(); });
//       ...
//     }
//   };
//
// Thread safety: a Mutex and a CondVar are shared by the threads that use
// them; a MutexLock belongs to the thread that made it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "common/thread_annotations.h"

namespace tandem {

class TANDEM_CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() TANDEM_ACQUIRE() { mu_.lock(); }
  void Unlock() TANDEM_RELEASE() { mu_.unlock(); }
  bool TryLock() TANDEM_TRY_ACQUIRE(true) { return mu_.try_lock(); }
  // Tells the analysis the caller holds the lock (where it cannot see it).
  void AssertHeld() const TANDEM_ASSERT_CAPABILITY(this) {}

 private:
  friend class CondVar;
  friend class MutexLock;
  std::mutex mu_;
};

// Holds a Mutex for its scope. Unlock() and Lock() release and retake it
// in the middle of the scope (the destructor releases it only if held).
class TANDEM_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) TANDEM_ACQUIRE(mu) : lock_(mu->mu_) {}
  // Takes over a lock the caller already holds, as in
  //   if (!mu_.TryLock()) return;
  //   MutexLock lock(&mu_, std::adopt_lock);
  MutexLock(Mutex* mu, std::adopt_lock_t) TANDEM_REQUIRES(mu) : lock_(mu->mu_, std::adopt_lock) {}
  ~MutexLock() TANDEM_RELEASE() = default;  // releases only if held
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  void Unlock() TANDEM_RELEASE() { lock_.unlock(); }
  void Lock() TANDEM_ACQUIRE() { lock_.lock(); }
  bool owns_lock() const { return lock_.owns_lock(); }

 private:
  friend class CondVar;
  std::unique_lock<std::mutex> lock_;
};

// A condition variable for Mutex. Waits take the MutexLock that holds it.
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  void Wait(MutexLock& lock) { cv_.wait(lock.lock_); }
  template <typename Pred>
  void Wait(MutexLock& lock, Pred pred) {
    cv_.wait(lock.lock_, std::move(pred));
  }
  // False when the time ran out first.
  template <typename Rep, typename Period>
  bool WaitFor(MutexLock& lock, std::chrono::duration<Rep, Period> d) {
    return cv_.wait_for(lock.lock_, d) == std::cv_status::no_timeout;
  }
  // The predicate's value when the wait ended (false: the time ran out).
  template <typename Rep, typename Period, typename Pred>
  bool WaitFor(MutexLock& lock, std::chrono::duration<Rep, Period> d, Pred pred) {
    return cv_.wait_for(lock.lock_, d, std::move(pred));
  }
  template <typename Clock, typename Duration, typename Pred>
  bool WaitUntil(MutexLock& lock, std::chrono::time_point<Clock, Duration> t, Pred pred) {
    return cv_.wait_until(lock.lock_, t, std::move(pred));
  }
  template <typename Clock, typename Duration>
  bool WaitUntil(MutexLock& lock, std::chrono::time_point<Clock, Duration> t) {
    return cv_.wait_until(lock.lock_, t) == std::cv_status::no_timeout;
  }
  void NotifyOne() noexcept { cv_.notify_one(); }
  void NotifyAll() noexcept { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace tandem
