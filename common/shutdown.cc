#include "common/shutdown.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <ctime>

#include <spdlog/spdlog.h>

namespace tandem {
namespace {

sigset_t ShutdownSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  return set;
}

// A signal caught by the handler below (0: none).
std::atomic<int> g_caught{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs a lock-free atomic");

void OnSignal(int sig) {
  g_caught.store(sig);
}

}  // namespace

ShutdownSignal::ShutdownSignal() {
  const sigset_t set = ShutdownSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  // Threads that libraries start while they load, before main() (OpenBLAS's
  // pool), do not have the signals blocked, and a signal the kernel hands to
  // one of them would kill the process. A handler catches it there instead,
  // and the watcher picks it up.
  struct sigaction action {};
  action.sa_handler = OnSignal;
  action.sa_flags = SA_RESTART;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  // A peer closing a socket must surface as an error, not kill the process.
  signal(SIGPIPE, SIG_IGN);
  watcher_ = std::thread([this] { Watch(); });
}

ShutdownSignal::~ShutdownSignal() {
  stop_ = true;
  watcher_.join();
}

void ShutdownSignal::Watch() {
  const sigset_t set = ShutdownSignals();
  const timespec tick{0, 100 * 1000 * 1000};
  while (!stop_) {
    int sig = sigtimedwait(&set, nullptr, &tick);
    if (sig <= 0) sig = g_caught.exchange(0);
    if (sig <= 0) continue;
    MutexLock lock(&mu_);
    if (requested_) {
      spdlog::warn("second {} while shutting down: exiting now", sig == SIGINT ? "SIGINT" : "SIGTERM");
      spdlog::default_logger()->flush();
      _exit(130);
    }
    spdlog::info("received {}: shutting down", sig == SIGINT ? "SIGINT" : "SIGTERM");
    requested_ = true;
    signal_ = sig;
    cv_.NotifyAll();
  }
}

int ShutdownSignal::Wait() {
  MutexLock lock(&mu_);
  cv_.Wait(lock, [this]() TANDEM_REQUIRES(mu_) { return requested_; });
  return signal_;
}

int ShutdownSignal::WaitFor(std::chrono::milliseconds timeout) {
  MutexLock lock(&mu_);
  if (!cv_.WaitFor(lock, timeout, [this]() TANDEM_REQUIRES(mu_) { return requested_; })) return -1;
  return signal_;
}

void ShutdownSignal::RequestShutdown() {
  MutexLock lock(&mu_);
  requested_ = true;
  cv_.NotifyAll();
}

bool ShutdownSignal::requested() const {
  MutexLock lock(&mu_);
  return requested_;
}

}  // namespace tandem
