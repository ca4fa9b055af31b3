// How servers and workers follow their coordinator: a channel to it and a
// health watch that drives the process's readiness. A member that cannot reach
// its coordinator keeps running (liveness stays SERVING) and reports not ready
// until the coordinator answers, so it waits instead of crash-looping.
//
// Thread safety: construct and destroy on one thread; the callbacks run on the
// watcher's thread.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include <grpcpp/channel.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>

#include "common/daemon.h"
#include "common/health.h"

namespace tandem {

struct CoordinatorLinkConfig {
  std::string address = "127.0.0.1:7400";          // the coordinator's gRPC address
  std::chrono::milliseconds check_interval{1000};  // how often its health is asked
};

void DeclareCoordinatorLinkOptions(OptionSet& options, CoordinatorLinkConfig* config);

class CoordinatorLink {
 public:
  // Opens the channel (with the daemon's TLS settings) and starts watching.
  // `daemon` must outlive the link.
  static Result<std::unique_ptr<CoordinatorLink>> Start(const CoordinatorLinkConfig& config, Daemon& daemon);

  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  bool reachable() const { return watcher_ != nullptr && watcher_->serving(); }

 private:
  CoordinatorLink() = default;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<HealthWatcher> watcher_;
};

}  // namespace tandem
