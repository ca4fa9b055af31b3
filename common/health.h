// Clients for the two endpoints every Tandem daemon serves: the standard gRPC
// health service and the Prometheus /metrics page.
//
// Thread safety: the functions are thread-safe.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include <grpcpp/channel.h>

#include "common/status.h"

namespace tandem {

// The name of the health service that reports readiness (see Daemon::SetReady).
inline constexpr const char* kReadyService = "tandem.ready";

// Asks the health service; returns "SERVING", "NOT_SERVING", "UNKNOWN" or
// "SERVICE_UNKNOWN", or an error when the daemon cannot be reached in time.
Result<std::string> CheckHealth(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                                std::chrono::milliseconds timeout);

// GET http://HOST:PORT/PATH; returns the body of a 200 answer.
Result<std::string> HttpGet(const std::string& host_port, const std::string& path, std::chrono::milliseconds timeout);

}  // namespace tandem
