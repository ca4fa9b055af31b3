// A worker's data plane: the communicators of each membership epoch.
//
// For every epoch the worker is part of, before it acknowledges the epoch,
// the data plane aborts the previous epoch's communicators (operations in
// flight fail at once with "epoch N was superseded by epoch M"), builds the
// new ones (comm::CommManager: world, node, dp, tp, pp), exchanging what the
// backends need through the coordinator's epoch values, and checks them with
// a barrier and a small allreduce over the world communicator. A failure is
// reported in the acknowledgement, so the coordinator re-forms without this
// worker instead of training on a broken mesh.
//
// Backends by group: `auto` uses shared memory for a group whose members all
// run on this node and the UCX transport for a group that spans nodes; `shm`
// and `ucx` force one; `off` builds nothing (a worker without a data plane,
// for control-plane tests).
//
// When the epoch has parameter servers, the worker also joins the epoch's
// parameter-server group (its PsClient, worker/ps/ps_client.h): it registers
// an endpoint "ps" so the servers include it.
//
// Heartbeats carry every communicator's collective sequence numbers, so the
// coordinator (and `tandem status`) can name the ranks that never entered a
// collective the others wait in.
//
// Metrics (docs/metrics.md): the epoch built and how, and every operation of
// the communicators (by op, group and backend) and of the parameter-server
// client (by op and server) as it completes.
//
// Thread safety: the hooks run on the member session's threads; Stop() from
// the daemon's shutdown path.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>

#include "common/coordinator_link.h"
#include "common/coordinator_rendezvous.h"
#include "common/daemon.h"
#include "common/mutex.h"
#include "worker/comm/comm_manager.h"
#include "worker/comm/factory.h"
#include "worker/ps/ps_client.h"

namespace tandem::worker {

struct DataPlaneConfig {
  std::string backend = "auto";              // auto | shm | ucx | off
  std::chrono::milliseconds timeout{30000};  // longest wait on a peer, building included
  bool self_check = true;                    // barrier + allreduce on every new world communicator
  // backend_options.ucx.net_devices starts as "auto": the worker daemon
  // resolves it from its listen address (common/transport/ucx/net_device.h).
  comm::BackendOptions backend_options = [] {
    comm::BackendOptions o;
    o.ucx.net_devices = "auto";
    return o;
  }();
};

void DeclareDataPlaneOptions(OptionSet& options, DataPlaneConfig* config);

class DataPlane {
 public:
  DataPlane(const DataPlaneConfig& config, Daemon& daemon);
  ~DataPlane();

  // Fills the member hooks: a full peer view, the epoch callback, the
  // heartbeat progress, and this worker's data-plane endpoints.
  Status Hook(MemberHooks* hooks);
  // Aborts the communicators (shutdown).
  void Stop();

  comm::CommManager& manager() { return *manager_; }
  // The parameter-server client, joined to every epoch that has servers.
  // Null until the first epoch arrives.
  PsClient* ps_client() { return ps_client_.get(); }

  // The newest epoch whose data plane is built (communicators and, when it
  // has servers, the parameter-server group), as this member sees it.
  struct EpochView {
    v1::MembershipEpoch epoch;
    uint64_t member_id = 0;
    v1::RankAssignment rank;  // this worker's ranks in it
  };
  // Null before the first epoch is built.
  std::shared_ptr<const EpochView> built() const;
  // Waits until an epoch newer than `after` is built; null after `timeout`
  // or once the data plane stops.
  std::shared_ptr<const EpochView> WaitNewer(uint64_t after, std::chrono::milliseconds timeout);
  // The last training step this worker completed, for its heartbeats (the
  // coordinator keeps the job's step and starts new epochs from it).
  void ReportStep(uint64_t step);
  // Who held up a completed step, for the next heartbeat (the coordinator's
  // straggler score).
  void ReportStepWait(v1::StepWait wait);
  // True once the coordinator drained this worker (MemberSession::drained).
  bool drained() const;
  // The coordinator's values of the built epoch `epoch` (PutEpochValue and
  // GetEpochValues), for agreements that may wait longer than a
  // communicator's timeout; a Get returns ABORTED once the epoch is
  // superseded. Null when `epoch` is not the built one.
  std::unique_ptr<comm::Rendezvous> EpochValues(uint64_t epoch);
  bool stopping() const { return stopping_; }

 private:
  Status OnEpoch(const v1::MembershipEpoch& epoch, MemberSession& session);
  Result<std::unique_ptr<comm::Communicator>> Make(const comm::CommInfo& info, const std::vector<int>& global_ranks,
                                                   comm::Rendezvous& rendezvous);
  Status SelfCheck();

  const DataPlaneConfig config_;
  // The daemon's TLS settings and message limit, for the channels to the servers.
  const TlsConfig tls_;
  const uint64_t max_message_bytes_;
  // Before the communicators and the client, whose observers use it: destroyed after them.
  struct Metrics;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<comm::CommManager> manager_;
  std::unique_ptr<PsClient> ps_client_;
  Mutex mu_;
  v1::MembershipEpoch epoch_;  // the epoch being built (the factory reads node placement from it)
  uint64_t member_id_ = 0;
  std::atomic<bool> stopping_{false};
  mutable Mutex view_mu_;
  CondVar view_cv_;
  std::shared_ptr<const EpochView> built_ TANDEM_GUARDED_BY(view_mu_);
  MemberSession* session_ TANDEM_GUARDED_BY(view_mu_) = nullptr;
  // The rendezvous of the epoch being built, which Stop() cancels.
  Mutex building_mu_;
  comm::CoordinatorRendezvous* building_ TANDEM_GUARDED_BY(building_mu_) = nullptr;
};

}  // namespace tandem::worker
