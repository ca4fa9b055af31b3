// A member's session with the coordinator: what every worker and server runs.
//
// It registers (retrying with backoff while the coordinator is unreachable),
// heartbeats at the interval the coordinator asks for, watches membership
// epochs, hands each epoch the member is part of to `on_epoch` (where the
// member rebuilds its communicators) and acknowledges it, and leaves
// gracefully on Leave(). When the coordinator restarts, the session re-attaches
// with its member id and session id: no new registration, no new rendezvous.
// If the coordinator has forgotten or buried the member (declared dead), the
// session registers afresh.
//
// Thread safety: thread-safe. Callbacks run on the session's threads, one at a
// time per callback.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "common/mutex.h"
#include "common/status.h"
#include "common/step_waits.h"
#include "common/thread_annotations.h"
#include "tandem/v1/coordinator.grpc.pb.h"

namespace tandem {

struct MemberSessionOptions {
  std::string job_id = "default";
  std::string token;
  v1::Role role = v1::ROLE_WORKER;
  // The member's stable name across restarts and which life of it this is
  // (RegisterRequest.member_name and incarnation); empty: no name.
  std::string member_name;
  uint64_t incarnation = 0;
  v1::NodeIdentity node;
  std::string control_address;
  std::vector<v1::Endpoint> endpoints;
  uint64_t capacity_bytes = 0;
  // Called for each epoch this member is part of, before it is acknowledged;
  // an error is reported to the coordinator (which then re-forms without it).
  std::function<Status(const v1::MembershipEpoch&)> on_epoch;
  // Called when the session becomes usable (registered and reachable) or not.
  std::function<void(bool connected, const std::string& detail)> on_connection;
  // Called when the coordinator asks the member to drain; the session then
  // leaves the job and stops.
  // Called from the heartbeat thread when the coordinator reports a newer
  // epoch than the one this member is handling. on_epoch runs on the thread
  // that reads epochs, so it cannot see the newer one itself: this lets it
  // give up building an epoch that is already superseded instead of waiting
  // out its timeouts for peers that moved on.
  std::function<void(uint64_t latest_epoch)> on_newer_epoch;
  std::function<void()> on_drain;
  // Called (once, from the session's thread) when the coordinator refuses a
  // registration because a newer incarnation of member_name holds the name:
  // this process was replaced and can never rejoin. The session has stopped
  // by then (member_id() is 0) and logged why; connected() is false, and
  // on_connection is not called for it. The owner should exit with a failure.
  std::function<void(const std::string& why)> on_fenced;
  // Called before each heartbeat for the member's progress in each
  // communicator of its epoch (HeartbeatRequest.collectives; entries beyond
  // the first 64 are dropped). Unset: none reported.
  std::function<std::vector<v1::CollectiveProgress>()> collective_progress;
  // Servers: the epoch whose backups hold their state
  // (HeartbeatRequest.replicated_epoch), read for every heartbeat; it must
  // be cheap (an atomic load). Unset: 0.
  std::function<uint64_t()> replicated_epoch;
  // How much of each epoch the member receives: PEER_VIEW_LOCAL (this node's
  // members and the servers) or PEER_VIEW_FULL (every member; workers whose
  // communicators span nodes need it).
  v1::PeerView peer_view = v1::PEER_VIEW_LOCAL;
  // First and largest wait between attempts to reach the coordinator.
  std::chrono::milliseconds retry_min{100};
  std::chrono::milliseconds retry_max{2000};
};

class MemberSession {
 public:
  MemberSession(std::shared_ptr<grpc::Channel> channel, MemberSessionOptions options);
  ~MemberSession();  // stops without leaving (use Leave() for a graceful exit)
  MemberSession(const MemberSession&) = delete;
  MemberSession& operator=(const MemberSession&) = delete;

  // Tells the coordinator this member leaves, then stops the session.
  Status Leave(const std::string& message, std::chrono::milliseconds timeout);

  // The training step to report in heartbeats.
  void SetStep(uint64_t step) { step_ = step; }
  // Who held up a step, for the next heartbeat (HeartbeatRequest.step_waits:
  // the coordinator's straggler score); the oldest go beyond 64 unsent.
  void ReportStepWait(v1::StepWait wait) { step_waits_.Add(std::move(wait)); }

  bool connected() const { return connected_; }
  uint64_t member_id() const;
  // The current registration's session id (0 before the first).
  uint64_t session_id() const;
  const MemberSessionOptions& options() const { return options_; }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  // The newest epoch seen (0: none yet) and this member's rank in it, if ranked.
  uint64_t epoch() const;
  std::optional<v1::RankAssignment> rank() const;
  // Times the session re-attached to a restarted coordinator.
  uint64_t reattachments() const { return reattachments_; }
  // True once a newer incarnation of member_name has replaced this member
  // (MemberSessionOptions::on_fenced); the session has stopped.
  bool fenced() const { return fenced_; }
  // True once the coordinator drained this member (MEMBER_COMMAND_DRAIN: an
  // administrator's `tandem drain`, or a straggler drained); it left the job.
  bool drained() const { return drained_; }
  // Waits until the member is part of an active epoch; false on timeout.
  bool WaitActive(std::chrono::milliseconds timeout);

 private:
  void Run();
  void HeartbeatLoop();
  // False with *error when the registration failed; *fenced when it was
  // refused because a newer incarnation of member_name holds the name.
  bool RegisterOnce(std::string* error, bool* fenced);
  void WatchOnce();
  void HandleEpoch(const v1::MembershipEpoch& epoch);
  void Ack(uint64_t epoch, const std::string& error);
  void SetConnected(bool connected, const std::string& detail);
  bool Sleep(std::chrono::milliseconds d);

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  const MemberSessionOptions options_;

  mutable Mutex mu_;
  CondVar cv_;
  bool stop_ TANDEM_GUARDED_BY(mu_) = false;
  uint64_t member_id_ TANDEM_GUARDED_BY(mu_) = 0;
  uint64_t session_id_ TANDEM_GUARDED_BY(mu_) = 0;
  uint64_t incarnation_ TANDEM_GUARDED_BY(mu_) = 0;
  std::chrono::milliseconds heartbeat_interval_ TANDEM_GUARDED_BY(mu_){1000};
  v1::MembershipEpoch epoch_ TANDEM_GUARDED_BY(mu_);
  std::optional<v1::RankAssignment> rank_ TANDEM_GUARDED_BY(mu_);
  bool in_epoch_ TANDEM_GUARDED_BY(mu_) = false;  // this member is a peer of epoch_
  bool active_ TANDEM_GUARDED_BY(mu_) = false;
  bool reregister_ TANDEM_GUARDED_BY(mu_) = false;
  bool left_ TANDEM_GUARDED_BY(mu_) = false;
  grpc::ClientContext* watch_context_ TANDEM_GUARDED_BY(mu_) = nullptr;  // the open stream, to cancel it
  std::atomic<bool> connected_{false};
  std::atomic<uint64_t> step_{0};
  StepWaitLog step_waits_;
  std::atomic<uint64_t> reattachments_{0};
  std::atomic<bool> fenced_{false};
  std::atomic<bool> drained_{false};
  std::thread session_thread_;
  std::thread heartbeat_thread_;
};

// A server's rank among the epoch's servers in order of member id (the order
// in which the shard map numbers them): how metrics name a server. Servers
// have no RankAssignment of their own. Empty when `member_id` is not a server
// of the epoch.
std::optional<uint32_t> ServerRank(const v1::MembershipEpoch& epoch, uint64_t member_id);

}  // namespace tandem
