// PsClient: a worker's side of the parameter servers.
//
// Data plane: Push sends a partition's gradient for a step to its primary;
// Pull asks a partition's parameters once the step is applied (and
// acknowledged by its backup), writing them straight into the caller's
// buffer. Both are asynchronous: they return an Op to wait on, so a worker
// pushes every partition of a bucket at once and overlaps the rest.
// Control plane (gRPC, tandem.v1.ParameterServer): Initialize sends the
// job's tensor table, optimizer, consistency mode and initial values to
// every server holding each partition (primary and backup; each partition is
// initialised once, later calls are ignored), and SaveCheckpoint,
// RestoreCheckpoint and Stats ask every server.
//
// Epochs: SetEpoch adopts a membership epoch (its shard map and the
// epoch's parameter-server group, common/transport/ps_group.h). Operations
// still waiting in the previous epoch fail with ABORTED ("epoch N was
// superseded"); the caller pushes the step again in the new epoch, which the
// servers make exactly-once (duplicates are acknowledged and ignored).
//
// Thread safety: thread-safe. An Op may be waited on from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "common/mutex.h"
#include "common/ps_protocol.h"
#include "common/rendezvous.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "common/transport/frame_channel.h"
#include "common/transport/ps_group.h"
#include "tandem/v1/server.grpc.pb.h"
#include "tandem/v1/types.pb.h"

namespace tandem::worker {

struct PsClientOptions {
  std::string job_id = "default";
  std::string token;
  transport::UcxOptions ucx;
  std::chrono::milliseconds timeout{30000};  // building an epoch's group; each control call
  // Makes the gRPC channel to a server's control address (TLS settings);
  // unset: insecure channels.
  std::function<Result<std::shared_ptr<grpc::Channel>>(const std::string& address)> make_channel;
  // Sees every push and pull the server answered successfully (for metrics):
  // whether it was a pull, the server (its rank among the epoch's servers,
  // ServerRank in common/member_session.h), the payload bytes (the gradient
  // pushed, the parameters pulled) and the seconds from sending the request
  // to its answer (for a pull, waiting for the step to be applied included).
  // Runs on the transport's completion thread (UCX's progress thread): it
  // must not block.
  std::function<void(bool pull, uint32_t server, uint64_t bytes, double seconds)> on_answered;
};

// One push or pull in flight.
class PsOp {
 public:
  // Blocks until the server answered, the epoch was superseded, or `timeout`
  // passed (DEADLINE_EXCEEDED; the op stays pending and can be waited again).
  // The waiting thread first drives the epoch's transport itself
  // (transport::DriveWhileWaiting, for requests of up to 1 MiB: no hand-off
  // to the transport's thread and back); the completions of other operations
  // of the epoch may run on it then. Must not be called holding a lock that
  // PsClient's callbacks (on_answered) take.
  Status Wait(std::chrono::milliseconds timeout);
  bool done() const;
  // After completion: the reply's header (flags: ps::kFlagDuplicate for an
  // ignored push; step and version of a pull).
  const ps::Frame& reply() const { return reply_; }
  // The request's trace correlation id (ps::Correlation; 0: not traced).
  uint64_t correlation() const { return corr_; }

 private:
  friend class PsClient;
  void Complete(const ps::Frame& reply, Status status);
  // Drives the epoch's transport (FrameChannel::Progress); kBusy once the
  // epoch's group is gone.
  std::function<transport::Transport::Progressed()> progress_;

  mutable Mutex mu_;
  CondVar cv_;
  bool done_ TANDEM_GUARDED_BY(mu_) = false;
  Status status_ TANDEM_GUARDED_BY(mu_);
  ps::Frame reply_;
  void* dst_ = nullptr;  // pulls: where the values go
  size_t dst_bytes_ = 0;
  int rank_ = -1;
  uint32_t server_ = 0;  // the server's rank among the epoch's servers
  size_t bytes_ = 0;     // pushes: the payload sent
  std::chrono::steady_clock::time_point sent_;
  uint64_t corr_ = 0;
};

class PsClient {
 public:
  explicit PsClient(PsClientOptions options);
  ~PsClient();
  PsClient(const PsClient&) = delete;
  PsClient& operator=(const PsClient&) = delete;

  // Adopts `epoch` (a full peer view) as member `self`: fails what waits in
  // the previous epoch and builds the new group. Errors name the member that
  // could not be reached.
  Status SetEpoch(const v1::MembershipEpoch& epoch, uint64_t self, comm::Rendezvous& rendezvous);
  // Drops the group (shutdown); operations in flight fail with CANCELLED.
  void Stop();

  // The epoch whose group is ready (0: none yet), and its shard map.
  uint64_t epoch() const;
  v1::ShardMap shard_map() const;

  // Gradient of `partition` for `step` (>= 1) as `dtype` (bytes must be the
  // partition's elements times the dtype's size); this worker is
  // `contributor` of `contributors` pushes the step needs. `lr`: the step's
  // learning rate (ps::Frame::value): 0 for the servers' configured
  // schedule, > 0 to replace it for this step (groups' lr_scale still
  // multiplies it). In sync mode every push of a step, to every partition
  // and again after a failure, must carry the same rate (the server refuses
  // one that differs with INVALID_ARGUMENT); negative, NaN or Inf is
  // refused.
  std::shared_ptr<PsOp> Push(uint32_t partition, uint64_t step, uint32_t contributor, uint32_t contributors,
                             v1::WireDType dtype, const void* data, size_t bytes, double lr = 0);
  // Parameters of `partition` once step `step` is applied (0: now), as
  // `dtype` (FP32 or BF16) into `dst` (the partition's elements times the
  // dtype's size). Asynchronous modes: with `contributors` set, the puller
  // is `contributor` and computes `step` next; the server moves its clock up
  // to step - 1 and, with bounded staleness, answers once the slowest
  // contributor is within the bound.
  std::shared_ptr<PsOp> Pull(uint32_t partition, uint64_t step, v1::WireDType dtype, void* dst, size_t bytes,
                             uint32_t contributor = 0, uint32_t contributors = 0);

  // Initialises every partition on its primary and backup from `params`
  // (the whole flattened space, fp32). Returns how many partition copies
  // this call initialised (the others were already). Each partition keeps
  // the values of the first worker to reach its primary, and its backup
  // gets the same ones: workers that initialise at once with different
  // values leave each partition with one worker's values on both copies.
  Result<int> Initialize(const google::protobuf::RepeatedPtrField<v1::TensorSpec>& tensors,
                         const v1::OptimizerConfig& optimizer, const v1::ConsistencyConfig& consistency,
                         const float* params);
  // The same for the partitions that overlap the flattened space's
  // [begin, end) only (a pipeline stage's range): `values(b, e, out)` writes
  // the initial values of [b, e) (whole partitions, so they may reach beyond
  // the range) into out[0, e - b).
  using ValueSource = std::function<void(uint64_t begin, uint64_t end, float* out)>;
  Result<int> Initialize(const google::protobuf::RepeatedPtrField<v1::TensorSpec>& tensors,
                         const v1::OptimizerConfig& optimizer, const v1::ConsistencyConfig& consistency, uint64_t begin,
                         uint64_t end, const ValueSource& values);
  // The same, with the state read by every server from a checkpoint.
  Result<int> InitializeFromCheckpoint(const google::protobuf::RepeatedPtrField<v1::TensorSpec>& tensors,
                                       const v1::OptimizerConfig& optimizer, const v1::ConsistencyConfig& consistency,
                                       const std::string& path);
  // Asks every server to save at `step` into directory/id (empty id:
  // step-<step>); a consistent cut. Returns each server's checkpoint info.
  Result<std::vector<v1::CheckpointInfo>> SaveCheckpoint(const std::string& directory, uint64_t step,
                                                         const std::string& id, bool async);
  // Every server restores the partitions it holds from `path`.
  Status RestoreCheckpoint(const std::string& path, bool skip_optimizer_state);
  // Every server's statistics, by member id; with `checksums`, each
  // partition's state_crc32c too (reads every server's whole state).
  Result<std::map<uint64_t, v1::GetStatsResponse>> Stats(bool checksums = false);

 private:
  struct Group {
    uint64_t epoch = 0;
    v1::ShardMap map;
    transport::PsGroup group;
    std::map<uint64_t, uint32_t> server_rank;  // member id -> rank among the epoch's servers
    std::unique_ptr<transport::FrameChannel> channel;
    Mutex mu;
    std::map<uint64_t, std::shared_ptr<PsOp>> ops TANDEM_GUARDED_BY(mu);
  };
  struct Server {
    uint64_t member_id = 0;
    std::string address;
    std::unique_ptr<v1::ParameterServer::Stub> stub;
  };

  std::shared_ptr<Group> Current() const;
  std::shared_ptr<PsOp> Start(ps::Frame header, const void* data, size_t bytes, void* dst, size_t dst_bytes);
  void* PayloadBuffer(const std::shared_ptr<Group>& group, const ps::Frame& header);
  void OnFrame(const std::shared_ptr<Group>& group, int rank, const ps::Frame& header, void* payload);
  void OnPeerFailed(const std::shared_ptr<Group>& group, int rank, const Status& status);
  void FailAll(const std::shared_ptr<Group>& group, const Status& status);
  // values == nullptr: from a checkpoint (no values in the request).
  Result<int> InitializeWith(const v1::InitializeParametersRequest& base, uint64_t begin, uint64_t end,
                             const ValueSource* values);
  std::unique_ptr<grpc::ClientContext> Context() const;

  const PsClientOptions options_;
  mutable Mutex mu_;
  std::shared_ptr<Group> group_ TANDEM_GUARDED_BY(mu_);
  v1::MembershipEpoch epoch_ TANDEM_GUARDED_BY(mu_);
  std::map<uint64_t, std::shared_ptr<Server>> servers_ TANDEM_GUARDED_BY(mu_);  // by member id
  // Partitions whose primary took this client's initial values, in epoch
  // init_won_epoch_: a retried Initialize still sends them to the backups.
  std::set<uint32_t> init_won_ TANDEM_GUARDED_BY(mu_);
  uint64_t init_won_epoch_ TANDEM_GUARDED_BY(mu_) = 0;
  std::atomic<uint64_t> next_request_{1};
};

}  // namespace tandem::worker
