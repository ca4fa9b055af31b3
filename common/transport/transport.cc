#include "common/transport/transport.h"

namespace tandem::transport {
namespace {

class CompletedRequest final : public Request {
 public:
  explicit CompletedRequest(Status status) : status_(std::move(status)) {}
  Status Wait(std::chrono::milliseconds /*timeout*/) override { return status_; }

 private:
  Status status_;
};

}  // namespace

std::unique_ptr<Request> Completed(Status status) {
  return std::make_unique<CompletedRequest>(std::move(status));
}

void DriveWhileWaiting(size_t bytes, const std::function<Transport::Progressed()>& progress,
                       const std::function<bool()>& done, std::chrono::steady_clock::time_point deadline) {
  using Progressed = Transport::Progressed;
  if (bytes > kDriveMaxBytes || !progress) return;
  auto active = std::chrono::steady_clock::now();
  while (!done()) {
    const Progressed round = progress();
    if (round == Progressed::kBusy) return;
    const auto now = std::chrono::steady_clock::now();
    if (round == Progressed::kActive) active = now;
    if (now >= deadline || now - active >= kDriveIdle) return;
  }
}

}  // namespace tandem::transport
