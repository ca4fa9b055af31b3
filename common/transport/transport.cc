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

}  // namespace tandem::transport
