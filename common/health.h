// Clients for the two endpoints every Tandem daemon serves: the standard gRPC
// health service and the Prometheus /metrics page.
//
// Thread safety: the functions are thread-safe; HealthWatcher is thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <grpcpp/channel.h>

#include "common/status.h"
#include "common/thread_annotations.h"

namespace tandem {

// The name of the health service that reports readiness (see Daemon::SetReady).
inline constexpr const char* kReadyService = "tandem.ready";

// Asks the health service; returns "SERVING", "NOT_SERVING", "UNKNOWN" or
// "SERVICE_UNKNOWN", or an error when the daemon cannot be reached in time.
Result<std::string> CheckHealth(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                                std::chrono::milliseconds timeout);

// GET http://HOST:PORT/PATH; returns the body of a 200 answer.
Result<std::string> HttpGet(const std::string& host_port, const std::string& path, std::chrono::milliseconds timeout);

// Polls another daemon's health every `interval` on a thread of its own and
// calls `on_change(serving, detail)` whenever its state flips (and once at the
// first answer). Used by servers and workers to follow their coordinator.
class HealthWatcher {
 public:
  HealthWatcher(std::shared_ptr<grpc::Channel> channel, std::chrono::milliseconds interval,
                std::function<void(bool serving, const std::string& detail)> on_change);
  ~HealthWatcher();  // stops and joins the thread
  HealthWatcher(const HealthWatcher&) = delete;
  HealthWatcher& operator=(const HealthWatcher&) = delete;

  bool serving() const { return serving_; }

 private:
  void Run();

  std::shared_ptr<grpc::Channel> channel_;
  std::chrono::milliseconds interval_;
  std::function<void(bool, const std::string&)> on_change_;
  std::atomic<bool> serving_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ TANDEM_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace tandem
