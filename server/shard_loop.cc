#include "server/shard_loop.h"

#include <pthread.h>

#include <utility>

namespace tandem::server {
namespace {

// The loop the calling thread runs now, if any.
thread_local const ShardLoop* t_running = nullptr;

}  // namespace

ShardLoop::ShardLoop(std::string name) {
  thread_ = std::thread([this, name = std::move(name)] {
    pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
    ThreadMain();
  });
}

ShardLoop::~ShardLoop() {
  Stop();
}

bool ShardLoop::InLoop() const {
  return t_running == this;
}

void ShardLoop::RunTask(Task& task) {
  tasks_run_.fetch_add(1, std::memory_order_relaxed);
  task();
}

bool ShardLoop::Defer(Task task) {
  if (InLoop()) {
    RunTask(task);
    return true;
  }
  {
    MutexLock lock(&mu_);
    if (stopping_) return false;
    queue_.push_back(Entry{std::move(task), false});
    if (owner_ != Owner::kNone) return true;  // its runner takes it
    owner_ = Owner::kCaller;
  }
  Drain(/*on_thread=*/false);
  return true;
}

bool ShardLoop::Post(Task task) {
  MutexLock lock(&mu_);
  if (stopping_) return false;
  queue_.push_back(Entry{std::move(task), true});
  if (owner_ == Owner::kNone) {
    owner_ = Owner::kThread;
    wake_.NotifyAll();
  }
  return true;
}

void ShardLoop::Offload(Task task) {
  if (!InLoop()) {
    Post(std::move(task));
    return;
  }
  MutexLock lock(&mu_);
  if (owner_ == Owner::kThread) {
    lock.Unlock();
    tasks_on_thread_.fetch_add(1, std::memory_order_relaxed);
    RunTask(task);
    return;
  }
  // The caller that runs the loop hands it to the thread after this task.
  queue_.insert(queue_.begin() + static_cast<std::ptrdiff_t>(offloaded_), Entry{std::move(task), true});
  ++offloaded_;
}

void ShardLoop::Drain(bool on_thread) {
  const ShardLoop* outer = t_running;
  t_running = this;
  for (;;) {
    Task task;
    {
      MutexLock lock(&mu_);
      offloaded_ = 0;
      if (queue_.empty()) {
        owner_ = Owner::kNone;
        if (stopping_) wake_.NotifyAll();  // the loop's thread ends once nobody runs the loop
        break;
      }
      if (!on_thread && queue_.front().on_thread) {
        owner_ = Owner::kThread;
        wake_.NotifyAll();
        break;
      }
      task = std::move(queue_.front().task);
      queue_.pop_front();
    }
    if (on_thread) tasks_on_thread_.fetch_add(1, std::memory_order_relaxed);
    RunTask(task);
  }
  t_running = outer;
}

void ShardLoop::ThreadMain() {
  for (;;) {
    {
      MutexLock lock(&mu_);
      // Stopping with nobody running the loop: take it to run what is left.
      wake_.Wait(lock, [&]() TANDEM_REQUIRES(mu_) {
        return (owner_ == Owner::kThread && !queue_.empty()) || (stopping_ && owner_ == Owner::kNone);
      });
      if (owner_ == Owner::kNone) {
        if (queue_.empty()) {
          stopped_ = true;
          return;
        }
        owner_ = Owner::kThread;
      }
    }
    Drain(/*on_thread=*/true);
  }
}

bool ShardLoop::Run(Task task) {
  if (InLoop()) {
    RunTask(task);
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
  done_cv.Wait(lock, [&]() TANDEM_REQUIRES(done_mu) { return done; });
  return true;
}

void ShardLoop::Stop() {
  MutexLock stop(&stop_mu_);
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    wake_.NotifyAll();
  }
  if (thread_.joinable()) thread_.join();
}

}  // namespace tandem::server
