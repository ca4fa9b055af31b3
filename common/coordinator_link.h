// How servers and workers take part in their job: a member session with the
// coordinator (common/member_session.h) whose state drives the process's
// readiness and metrics. A member that cannot reach its coordinator keeps
// running (liveness stays SERVING) and reports not ready until the
// coordinator answers, so it waits instead of crash-looping. On shutdown it
// leaves the job gracefully, so the next epoch forms at once.
//
// Thread safety: construct and destroy on one thread; the callbacks run on the
// session's threads.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/channel.h>

#include "common/daemon.h"
#include "common/member_session.h"
#include "common/trace_clock.h"

namespace tandem {

struct CoordinatorLinkConfig {
  std::string address = "127.0.0.1:7400";  // the coordinator's gRPC address
  std::string job_id = "default";          // the job to join
  std::string token_file;                  // file with the join token; empty: none
  std::string node_id;                     // node identity (members with equal ids share a node); default: hostname
  // Which life of the daemon's --name this process is (RegisterRequest.incarnation);
  // 0: the time the link starts, in microseconds since the Unix epoch.
  int64_t incarnation = 0;
};

void DeclareCoordinatorLinkOptions(OptionSet& options, CoordinatorLinkConfig* config);

// What a role adds to its member session.
struct MemberHooks {
  // Data-plane addresses to register (RegisterRequest.endpoints).
  std::vector<v1::Endpoint> endpoints;
  v1::PeerView peer_view = v1::PEER_VIEW_LOCAL;
  // Called for every epoch this member is part of, before it is acknowledged
  // (an error is reported to the coordinator, which re-forms without it).
  std::function<Status(const v1::MembershipEpoch&, MemberSession&)> on_epoch;
  // The coordinator has published an epoch newer than the one on_epoch is
  // handling (MemberSessionOptions::on_newer_epoch).
  std::function<void(uint64_t latest_epoch)> on_newer_epoch;
  // Progress in the member's communicators, for heartbeats.
  std::function<std::vector<v1::CollectiveProgress>()> collective_progress;
  // Servers: the epoch whose backups hold their state, for heartbeats
  // (MemberSessionOptions::replicated_epoch).
  std::function<uint64_t()> replicated_epoch;
};

class CoordinatorLink {
 public:
  // Opens the channel (with the daemon's TLS settings) and starts the session.
  // `daemon` must outlive the link. A daemon whose --name was given registers
  // under that name (RegisterRequest.member_name) with its incarnation: it
  // replaces a live member of the same name at once, and when a newer
  // incarnation of its name has replaced it, it asks the daemon to shut down
  // with a failure (exit 1), since it can never rejoin. INVALID_ARGUMENT when
  // the name is not one the coordinator accepts.
  // `node` carries what the role knows of its node (devices, capabilities);
  // the link adds the hostname, node id, cores and memory.
  static Result<std::unique_ptr<CoordinatorLink>> Start(const CoordinatorLinkConfig& config, Daemon& daemon,
                                                        v1::Role role, const v1::NodeIdentity& node,
                                                        MemberHooks hooks = {});
  ~CoordinatorLink();

  // Leaves the job (bounded by `timeout`) and stops the session.
  void Leave(std::chrono::milliseconds timeout);

  MemberSession& session() { return *session_; }

 private:
  CoordinatorLink() = default;
  std::unique_ptr<MemberSession> session_;
  // While tracing: round trips to the coordinator's trace clock (trace_clock.h).
  std::unique_ptr<trace::ClockSampler> clock_;
  // session_ once constructed, for the session's own callbacks.
  std::atomic<MemberSession*> published_{nullptr};
};

}  // namespace tandem
