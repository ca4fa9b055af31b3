// CoordinatorRendezvous: the Rendezvous of a job's workers, over the
// coordinator's epoch values (PutEpochValue / GetEpochValues in
// proto/tandem/v1/coordinator.proto).
//
// One object serves one member in one epoch: (job, member id, session id,
// token, epoch). Values live in the coordinator for that epoch only; they are
// dropped when the epoch is superseded, and every call for a superseded epoch
// fails with ABORTED (a Get waiting on a key returns promptly then), so a
// communicator that is being built for an epoch that is already gone gives up
// at once instead of waiting for its timeout.
//
// Put checks the proto's limits first (key 1 to 256 bytes, value at most
// 64 KiB) and retries transient failures (UNAVAILABLE, DEADLINE_EXCEEDED)
// with backoff for up to `rpc_timeout`; putting the same value again is a
// success, another value gives ALREADY_EXISTS. Get asks the coordinator to
// hold each GetEpochValues call open until the key appears (at most
// `long_poll` per call), and polls again, with backoff from `poll_min` to
// `poll_max` between calls that came back without the key, until the key
// exists or `timeout` passes (DEADLINE_EXCEEDED naming the key). Transient
// failures are retried within the timeout; other errors (ABORTED for a
// superseded epoch, NOT_FOUND for an unknown member or session, ...) are
// returned at once, with the key named.
//
// Cancel() makes every Put and Get in progress, and every later one, fail
// promptly with CANCELLED: a worker that shuts down while it builds an
// epoch's communicators does not wait for the epoch's peers.
//
// Thread safety: thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "common/mutex.h"
#include "common/rendezvous.h"
#include "tandem/v1/coordinator.grpc.pb.h"

namespace tandem::comm {

struct CoordinatorRendezvousOptions {
  std::string job_id = "default";
  uint64_t member_id = 0;
  uint64_t session_id = 0;
  std::string token;
  uint64_t epoch = 0;
  // How long a Put keeps retrying transient failures.
  std::chrono::milliseconds rpc_timeout{10000};
  // Longest wait the coordinator is asked to hold one GetEpochValues call.
  std::chrono::milliseconds long_poll{5000};
  // First and largest pause between GetEpochValues calls that came back
  // without the key (or failed transiently).
  std::chrono::milliseconds poll_min{5};
  std::chrono::milliseconds poll_max{250};
};

class CoordinatorRendezvous : public Rendezvous {
 public:
  using steady_clock_duration = std::chrono::steady_clock::duration;
  CoordinatorRendezvous(std::shared_ptr<grpc::Channel> channel, CoordinatorRendezvousOptions options);

  Status Put(const std::string& key, const std::string& value) override;
  Result<std::string> Get(const std::string& key, std::chrono::milliseconds timeout) override;

  // Fails the calls in progress and every later one with CANCELLED and
  // `reason`.
  void Cancel(const std::string& reason) TANDEM_EXCLUDES(mu_);
  // Cancels when this rendezvous's epoch is older than `latest` (the build
  // it serves is for a superseded epoch).
  void CancelIfSuperseded(uint64_t latest);
  bool cancelled() const override { return cancelled_flag_.load(); }

  uint64_t epoch() const { return options_.epoch; }
  // GetEpochValues calls made so far (for tests and diagnostics).
  uint64_t polls() const { return polls_.load(); }

 private:
  const std::unique_ptr<v1::Coordinator::Stub> stub_;
  const CoordinatorRendezvousOptions options_;
  std::atomic<uint64_t> polls_{0};
  // Registers the call about to be made (null: it is done); an error once cancelled.
  Status Track(grpc::ClientContext* ctx) TANDEM_EXCLUDES(mu_);
  // Sleeps for `pause` unless cancelled meanwhile; an error once cancelled.
  Status Pause(steady_clock_duration pause) TANDEM_EXCLUDES(mu_);
  Mutex mu_;
  CondVar cv_;
  std::string cancelled_ TANDEM_GUARDED_BY(mu_);  // the reason; empty: not cancelled
  std::atomic<bool> cancelled_flag_{false};
  grpc::ClientContext* current_ TANDEM_GUARDED_BY(mu_) = nullptr;
};

}  // namespace tandem::comm
