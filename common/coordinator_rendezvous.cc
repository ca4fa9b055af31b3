#include "common/coordinator_rendezvous.h"

#include <algorithm>

#include <google/protobuf/util/time_util.h>

namespace tandem::comm {
namespace {

using google::protobuf::util::TimeUtil;
using std::chrono::milliseconds;
using std::chrono::steady_clock;

constexpr size_t kMaxKeyBytes = 256;         // PutEpochValueRequest.key
constexpr size_t kMaxValueBytes = 64 << 10;  // PutEpochValueRequest.value
// Time a GetEpochValues call may take beyond the wait it asks for.
constexpr milliseconds kRpcSlack{2000};

Status CheckKey(const std::string& key) {
  if (key.empty() || key.size() > kMaxKeyBytes) {
    return InvalidArgument("rendezvous key must be 1 to {} bytes, got {}", kMaxKeyBytes, key.size());
  }
  return Status::Ok();
}

// Failures worth another try: the coordinator is unreachable or slow (for
// example restarting). Everything else is an answer.
bool Transient(const grpc::Status& s) {
  return s.error_code() == grpc::StatusCode::UNAVAILABLE || s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
}

std::chrono::system_clock::time_point Deadline(milliseconds d) {
  return std::chrono::system_clock::now() + d;
}

}  // namespace

CoordinatorRendezvous::CoordinatorRendezvous(std::shared_ptr<grpc::Channel> channel,
                                             CoordinatorRendezvousOptions options)
    : stub_(v1::Coordinator::NewStub(std::move(channel))), options_(std::move(options)) {}

void CoordinatorRendezvous::Cancel(const std::string& reason) {
  MutexLock lock(&mu_);
  cancelled_ = reason.empty() ? "cancelled" : reason;
  cancelled_flag_ = true;
  if (current_ != nullptr) current_->TryCancel();
  cv_.NotifyAll();
}

void CoordinatorRendezvous::CancelIfSuperseded(uint64_t latest) {
  if (options_.epoch < latest) {
    Cancel(fmt::format("epoch {} was superseded by epoch {}", options_.epoch, latest));
  }
}

Status CoordinatorRendezvous::Track(grpc::ClientContext* ctx) {
  MutexLock lock(&mu_);
  current_ = ctx;
  if (!cancelled_.empty()) {
    current_ = nullptr;
    return Cancelled("rendezvous of epoch {}: {}", options_.epoch, cancelled_);
  }
  return Status::Ok();
}

Status CoordinatorRendezvous::Pause(steady_clock_duration pause) {
  MutexLock lock(&mu_);
  cv_.WaitFor(lock, pause, [&]() TANDEM_REQUIRES(mu_) { return !cancelled_.empty(); });
  if (!cancelled_.empty()) return Cancelled("rendezvous of epoch {}: {}", options_.epoch, cancelled_);
  return Status::Ok();
}

Status CoordinatorRendezvous::Put(const std::string& key, const std::string& value) {
  TANDEM_RETURN_IF_ERROR(CheckKey(key));
  if (value.size() > kMaxValueBytes) {
    return InvalidArgument("rendezvous value for {} is {} bytes, more than {}", key, value.size(), kMaxValueBytes);
  }
  v1::PutEpochValueRequest request;
  request.set_job_id(options_.job_id);
  request.set_member_id(options_.member_id);
  request.set_session_id(options_.session_id);
  request.set_token(options_.token);
  request.set_epoch(options_.epoch);
  request.set_key(key);
  request.set_value(value);
  const auto deadline = steady_clock::now() + options_.rpc_timeout;
  auto pause = options_.poll_min;
  while (true) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - steady_clock::now());
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(std::max(left, milliseconds(1))));
    v1::PutEpochValueResponse response;
    TANDEM_RETURN_IF_ERROR(Track(&ctx));
    const grpc::Status s = stub_->PutEpochValue(&ctx, request, &response);
    TANDEM_RETURN_IF_ERROR(Track(nullptr));
    if (s.ok()) return Status::Ok();
    if (!Transient(s) || steady_clock::now() + pause >= deadline) {
      return Status::FromGrpc(s).WithContext(
          fmt::format("publishing rendezvous key {} for epoch {}", key, options_.epoch));
    }
    TANDEM_RETURN_IF_ERROR(Pause(pause));
    pause = std::min(pause * 2, options_.poll_max);
  }
}

Result<std::string> CoordinatorRendezvous::Get(const std::string& key, milliseconds timeout) {
  TANDEM_RETURN_IF_ERROR(CheckKey(key));
  v1::GetEpochValuesRequest request;
  request.set_job_id(options_.job_id);
  request.set_member_id(options_.member_id);
  request.set_session_id(options_.session_id);
  request.set_token(options_.token);
  request.set_epoch(options_.epoch);
  request.add_keys(key);
  const auto deadline = steady_clock::now() + timeout;
  auto pause = options_.poll_min;
  Status last;  // the last transient failure, to explain a timeout
  while (true) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - steady_clock::now());
    const milliseconds wait = std::clamp(left, milliseconds(0), options_.long_poll);
    *request.mutable_wait() = TimeUtil::MillisecondsToDuration(wait.count());
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(wait + kRpcSlack));
    v1::GetEpochValuesResponse response;
    polls_.fetch_add(1, std::memory_order_relaxed);
    TANDEM_RETURN_IF_ERROR(Track(&ctx));
    const grpc::Status s = stub_->GetEpochValues(&ctx, request, &response);
    TANDEM_RETURN_IF_ERROR(Track(nullptr));
    if (s.ok()) {
      if (auto it = response.values().find(key); it != response.values().end()) return it->second;
    } else if (Transient(s)) {
      last = Status::FromGrpc(s);
    } else {
      return Status::FromGrpc(s).WithContext(
          fmt::format("waiting for rendezvous key {} of epoch {}", key, options_.epoch));
    }
    const auto now = steady_clock::now();
    if (now >= deadline) {
      return DeadlineExceeded("rendezvous key {} did not appear in epoch {} within {} ms{}", key, options_.epoch,
                              timeout.count(), last.ok() ? "" : " (last error: " + last.ToString() + ")");
    }
    TANDEM_RETURN_IF_ERROR(Pause(std::min<steady_clock::duration>(pause, deadline - now)));
    pause = std::min(pause * 2, options_.poll_max);
  }
}

}  // namespace tandem::comm
