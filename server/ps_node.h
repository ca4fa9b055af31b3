// PsNode: a parameter server in its job. It keeps the ParameterStore
// (server/ps_core.h) and carries it:
// - Membership: for every epoch (before acknowledging it) the store adopts
//   the epoch's shard map, the previous epoch's parameter-server group is torn
//   down (everything waiting in it fails), and the new group is built: one
//   UCX transport with every worker and server of the epoch
//   (common/transport/ps_group.h), served by a FrameChannel.
// - Data plane: frames from workers (push, pull) and servers (step shares,
//   replicated updates, state transfers, their replies) are handed from the
//   transport's completion thread to the shard's loop (server/shard_loop.h),
//   which runs them on the store one at a time; its replies and its messages
//   to other servers go back through the channel. Membership changes,
//   initialisation and restores run on the loop too, so the store's state
//   is only ever changed there (reads, such as statistics, and a
//   checkpoint's wait for its step come from the gRPC threads).
// - Control plane: the tandem.v1.ParameterServer gRPC service (initialise,
//   statistics, checkpoints), with the job's join token.
// - Metrics: tandem_server_* (docs/metrics.md), refreshed every second.
//
// Thread safety: the hooks run on the member session's threads, frames on the
// shard's loop, gRPC calls on gRPC's; Stop() from the daemon's shutdown path.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "common/coordinator_link.h"
#include "common/coordinator_rendezvous.h"
#include "common/daemon.h"
#include "common/mutex.h"
#include "common/thread_annotations.h"
#include "common/transport/frame_channel.h"
#include "common/transport/ps_group.h"
#include "server/ps_core.h"
#include "server/shard_loop.h"
#include "tandem/v1/server.grpc.pb.h"

namespace tandem::server {

struct ServerConfig {
  int64_t threads = 0;                             // optimizer threads; 0: one per core
  std::chrono::milliseconds timeout{30000};        // building an epoch's group
  std::chrono::milliseconds save_timeout{600000};  // longest wait for a checkpoint's step
  std::string ucx_tls;                             // UCX transports (UCX_TLS syntax); empty: all
  std::string ucx_net_devices = "auto";            // UCX network devices (ucx/net_device.h)
};

void DeclareServerOptions(OptionSet& options, ServerConfig* config);

// Sends a store's reply to `rank`: borrowed bytes go out without a copy and
// their `keep` is released once the channel no longer reads them.
void SendReply(transport::FrameChannel& channel, int rank, const ps::Frame& header, ReplyBody body);

class PsNode final : public ServerLinks {
 public:
  PsNode(const ServerConfig& config, Daemon& daemon);
  ~PsNode() override;

  // Registers the gRPC service (setup, before serving).
  void Register(Daemon& daemon);
  // Fills the member hooks: the full peer view and the epoch callback.
  Status Hook(MemberHooks* hooks);
  // Tears the group down (shutdown).
  void Stop();

  ParameterStore& store() { return *store_; }

  // ServerLinks
  void SendShare(uint64_t epoch, uint64_t step, const std::vector<ps::ShareEntry>& entries) override;
  void SendToBackup(uint64_t backup, const ps::Frame& header, std::shared_ptr<const std::vector<float>> payload,
                    std::function<void(const Status&)> done) override;
  void SendJob(uint64_t server, std::shared_ptr<const std::string> job) override;

 private:
  class Service;
  struct Group {
    uint64_t epoch = 0;
    transport::PsGroup group;
    std::unique_ptr<transport::FrameChannel> channel;
    std::unique_ptr<PushLanding> landing;  // pushes received into the store's buffers
    Mutex mu;
    std::map<uint64_t, std::pair<int, std::function<void(const Status&)>>> waiting TANDEM_GUARDED_BY(mu);
  };

  Status OnEpoch(const v1::MembershipEpoch& epoch, MemberSession& session);
  // Sends a reply to `rank` over the group's channel, while the group lives.
  static Reply Replier(const std::shared_ptr<Group>& group, int rank);
  // Hands a frame received on the transport's completion thread to the
  // loop, with its payload.
  void HandOver(const std::shared_ptr<Group>& group, int rank, const ps::Frame& header, void* payload,
                std::vector<char>& owned);
  // A frame, on the loop: its payload is in `landed` (a store buffer) or
  // `bytes`.
  void OnFrame(const std::shared_ptr<Group>& group, int rank, const ps::Frame& header,
               std::shared_ptr<std::vector<float>> landed, std::vector<char>& bytes);
  void OnPeerFailed(const std::shared_ptr<Group>& group, int rank, const Status& status);
  std::shared_ptr<Group> Current() const;
  void RefreshMetrics();

  const ServerConfig config_;
  std::unique_ptr<ParameterStore> store_;
  // Where the store's state changes (declared after it: stopped first).
  ShardLoop loop_{"tandem-shard"};
  std::unique_ptr<Service> service_;
  mutable Mutex mu_;
  std::shared_ptr<Group> group_ TANDEM_GUARDED_BY(mu_);
  uint64_t member_id_ TANDEM_GUARDED_BY(mu_) = 0;
  std::atomic<uint64_t> next_request_{1};
  std::atomic<bool> stopping_{false};
  // The rendezvous of the epoch being built, for a newer epoch or Stop() to cancel.
  Mutex building_mu_;
  comm::CoordinatorRendezvous* building_ TANDEM_GUARDED_BY(building_mu_) = nullptr;
  struct Metrics;
  std::unique_ptr<Metrics> metrics_;
  std::thread metrics_thread_;
  Mutex metrics_mu_;
  CondVar metrics_cv_;
  // The member session, for the store's StepWait reports (its heartbeats
  // carry them); null until the first epoch and once stopping.
  Mutex session_mu_;
  MemberSession* session_ TANDEM_GUARDED_BY(session_mu_) = nullptr;
};

}  // namespace tandem::server
