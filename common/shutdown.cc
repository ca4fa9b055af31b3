#include "common/shutdown.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

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

}  // namespace

ShutdownSignal::ShutdownSignal() {
  const sigset_t set = ShutdownSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
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
    const int sig = sigtimedwait(&set, nullptr, &tick);
    if (sig <= 0) continue;
    std::lock_guard<std::mutex> lock(mu_);
    if (requested_) {
      spdlog::warn("second {} while shutting down: exiting now", sig == SIGINT ? "SIGINT" : "SIGTERM");
      spdlog::default_logger()->flush();
      _exit(130);
    }
    spdlog::info("received {}: shutting down", sig == SIGINT ? "SIGINT" : "SIGTERM");
    requested_ = true;
    signal_ = sig;
    cv_.notify_all();
  }
}

int ShutdownSignal::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return requested_; });
  return signal_;
}

int ShutdownSignal::WaitFor(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [this] { return requested_; })) return -1;
  return signal_;
}

void ShutdownSignal::RequestShutdown() {
  std::lock_guard<std::mutex> lock(mu_);
  requested_ = true;
  cv_.notify_all();
}

bool ShutdownSignal::requested() const {
  std::lock_guard<std::mutex> lock(mu_);
  return requested_;
}

}  // namespace tandem
