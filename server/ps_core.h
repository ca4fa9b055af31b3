// ParameterStore: the state and rules of one parameter server, independent
// of how messages arrive (server/ps_node.h carries them over the transport
// and gRPC; tests drive the store directly).
//
// What it holds: for the partitions the shard map gives this server (as
// primary or backup), fp32 master weights, the optimizer state, a version and
// the last step completed (PartitionState), plus the job's tensor table,
// optimizer and consistency mode, which every initialisation must repeat.
//
// Synchronous steps (the default) are two-phase, so that a step is applied
// on every server or on none:
// 1. Aggregate. A primary folds the pushes of step s into the partition's
//    accumulator in contributor order (a push that arrives early waits in a
//    buffer until the ones before it are folded), so the reduced gradient is
//    bit-identical whatever order the pushes came in. Duplicates (the same
//    contributor again, or a step already applied) are acknowledged and
//    ignored; pushes from another epoch are refused.
// 2. Decide. Once all its primary partitions have every contribution, a
//    server sends its share (per partition: sum of squares of the reduced
//    gradient, and whether it is finite) to every other server. When a
//    server holds a share for every partition of the map it decides, the
//    same way on every server: skip the step if any gradient is not finite
//    (NonFinitePolicy SKIP_STEP), else clip by the global norm (summed in
//    partition order, so every server computes the same coefficient). Then
//    it applies the update to its primaries, replicates it to their backups,
//    and answers the pulls waiting for the step once the backup has applied
//    it too. A single server decides alone.
//
// A membership change (new epoch) fails waiting pulls with ABORTED. A step
// whose aggregation this server had not finished is discarded: no server can
// have decided it, and workers push it again in the new epoch. A step this
// server had shared may have been decided elsewhere, so it is kept: its
// accumulators stay, shares of it from the old epoch are still taken, and
// on the new epoch's links every server sends its last share again. So a
// step decided on one server before the change is decided and applied on
// every server from the same gradients, without new pushes (the workers see
// it applied somewhere and do not push it again). New pushes of a kept step
// replace its accumulator (no server had decided it); a partition that
// already applied a step treats new pushes of it as duplicates and shares
// its decided share again.
//
// Learning rate: a push carries its step's (ps::Frame::value; 0: the
// optimizer's schedule). In sync mode every push of a step must carry the
// same one (a push that differs is refused), and the update of the step
// applies it; the asynchronous modes apply each push with its own.
//
// Asynchronous and bounded-staleness modes apply each push on arrival
// (scaled like a mean over the data-parallel world), per partition; bounded
// staleness makes a pull wait while its contributor is more than
// staleness_bound steps ahead of the slowest one. Global gradient-norm
// clipping needs whole steps, so those modes refuse max_grad_norm.
//
// Replication: a primary sends every update (the reduced gradient, the
// scale and the learning rate it applied) to the partition's backup, which
// replays it with the same kernel, so both stay bit-identical. A pull of step
// s is answered only once the backup acknowledged s ("safe"): no
// acknowledged update exists on one server only. When the map gives a
// partition a new backup, the primary sends it the partition's whole state,
// then the updates after it, in order.
//
// Thread safety: thread-safe. Callbacks (replies, links) are invoked without
// the store's locks held. In a server every change comes from the shard's
// loop (server/shard_loop.h), one at a time, so the locks are uncontended
// on the data path; they stay for the readers (statistics, a checkpoint's
// capture) and for callers without a loop (tests, benchmarks).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "common/optimizer/gradient.h"
#include "common/optimizer/optimizer.h"
#include "common/optimizer/thread_pool.h"
#include "common/ps_protocol.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "server/partition_state.h"
#include "tandem/v1/server.pb.h"
#include "tandem/v1/types.pb.h"

namespace tandem::server {

// A reply's payload: bytes it owns, or bytes it borrows from the store
// (`borrowed`, `borrowed_bytes`), which stay valid while `keep` is held. An
// fp32 pull is answered with the partition's weights themselves, borrowed:
// whoever sends the reply holds `keep` until the transport no longer reads
// the bytes, and the store leaves that buffer alone until then (it updates a
// copy). Converts from a vector of owned bytes.
struct ReplyBody {
  ReplyBody() = default;
  ReplyBody(std::vector<char> bytes) : owned(std::move(bytes)) {}  // NOLINT(google-explicit-constructor)

  const char* data() const { return borrowed != nullptr ? static_cast<const char*>(borrowed) : owned.data(); }
  size_t size() const { return borrowed != nullptr ? borrowed_bytes : owned.size(); }
  // The bytes as a vector of their own (a copy when borrowed), for a caller
  // that keeps them past the reply.
  std::vector<char> Take() &&;

  std::vector<char> owned;
  const void* borrowed = nullptr;
  size_t borrowed_bytes = 0;
  std::shared_ptr<const void> keep;
};

// Replies to a request: the header (type, status, step, ...) and payload.
using Reply = std::function<void(ps::Frame header, ReplyBody body)>;

// What the store sends to other servers; implemented over the transport by
// ps_node (and by tests).
class ServerLinks {
 public:
  virtual ~ServerLinks() = default;
  // This server's share of a sync step, to every other server holding
  // primaries, over the current epoch's links (`epoch` is the step's, which
  // may be an older one whose step is still being decided).
  virtual void SendShare(uint64_t epoch, uint64_t step, const std::vector<ps::ShareEntry>& entries) = 0;
  // An update (or a state transfer) for `backup`; `done` runs with the
  // backup's answer (or the failure to reach it). `payload` stays alive
  // until the send is done.
  virtual void SendToBackup(uint64_t backup, const ps::Frame& header, std::shared_ptr<const std::vector<float>> payload,
                            std::function<void(const Status&)> done) = 0;
  // The job's configuration (a serialized InitializeParametersRequest
  // without values) for a server that becomes a backup and may never have
  // been initialised; sent before the state transfer.
  virtual void SendJob(uint64_t server, std::shared_ptr<const std::string> job) = 0;
};

struct StoreOptions {
  StoreOptions() = default;
  explicit StoreOptions(int optimizer_threads) : threads(optimizer_threads) {}

  int threads = 0;  // optimizer threads; 0: the hardware's
  // Runs work that may take long (a step's scan, decision and update on a
  // server holding more than ParameterStore::kInlineStepBytes) where it
  // holds up no one's messages: a server passes its loop's Offload. Unset:
  // right away, on the calling thread.
  std::function<void(std::function<void()>)> offload;
};

// Counters for GetStats and the metrics.
struct StoreCounters {
  std::atomic<uint64_t> pushes{0};
  std::atomic<uint64_t> duplicate_pushes{0};
  std::atomic<uint64_t> rejected_pushes{0};
  std::atomic<uint64_t> pulls{0};
  std::atomic<uint64_t> push_bytes{0};
  std::atomic<uint64_t> pull_bytes{0};
  std::atomic<uint64_t> updates{0};
  std::atomic<uint64_t> skipped_steps{0};
  std::atomic<uint64_t> replicas_applied{0};
  std::atomic<uint64_t> transfers_sent{0};
  std::atomic<uint64_t> transfers_received{0};
  std::atomic<double> update_seconds{0};       // time spent applying updates
  std::atomic<double> aggregation_seconds{0};  // first push of a step to its decision, summed
  std::atomic<uint64_t> staleness_last{0};     // async: server steps since the pusher's step (last push)
};

// A consistent copy of partitions at one step, for a checkpoint.
struct Capture {
  uint64_t step = 0;
  std::vector<PartitionState> partitions;
};

class ParameterStore {
 public:
  ParameterStore(StoreOptions options, ServerLinks* links);
  ~ParameterStore();
  ParameterStore(const ParameterStore&) = delete;
  ParameterStore& operator=(const ParameterStore&) = delete;

  // --- membership ---------------------------------------------------------
  // Adopts an epoch: which partitions this server (`member_id`) holds and as
  // what, the data-parallel size (the mean's divisor) and the step the epoch
  // starts from. Steps this server had not shared are discarded (shared ones
  // are kept: another server may have decided them); pulls waiting fail with
  // ABORTED. Older epochs are ignored.
  void SetEpoch(uint64_t epoch, uint64_t member_id, const v1::ShardMap& map, uint32_t dp_size, uint64_t start_step);
  // The links to the other servers of the current epoch are up: sends the
  // state of partitions whose backup is new, then lets replication go on.
  void LinksReady(uint64_t epoch);
  uint64_t epoch() const;

  // --- control (gRPC) -----------------------------------------------------
  Result<v1::InitializeParametersResponse> Initialize(const v1::InitializeParametersRequest& request);
  // With `checksums`, each partition's state_crc32c too (reads all its state).
  v1::GetStatsResponse Stats(const std::vector<uint32_t>& partition_ids, bool checksums = false) const;
  // Copies the state of this server's primaries once all of them completed
  // `step` (0: the step they are at now, which must be the same on all),
  // waiting up to `timeout`. FAILED_PRECONDITION if a primary is already past
  // `step` or the primaries disagree; DEADLINE_EXCEEDED if not reached. The
  // wait survives a new epoch in which this server still holds every one of
  // those partitions (as primary or backup: a rebalance); ABORTED if one of
  // them moved to another server.
  Result<Capture> CaptureAt(uint64_t step, std::chrono::milliseconds timeout);
  // How many CaptureAt calls are waiting for their step.
  size_t WaitingCaptures() const;
  // The server is stopping: every CaptureAt waiting, and every later one,
  // fails with UNAVAILABLE at once (a save in flight does not hold the
  // shutdown up for its whole timeout).
  void StopCaptures();
  // Replaces partitions' state (restore). `states` must match partitions
  // this server holds; their ranges are checked. Waiting pulls of them fail.
  Status Replace(std::vector<PartitionState> states, bool skip_optimizer_state);
  // What checkpoints record about the job (fingerprint of the tensor table,
  // optimizer name, parameter count); FAILED_PRECONDITION before
  // initialisation.
  struct JobIdentity {
    std::string job_id;
    uint64_t parameter_count = 0;
    uint64_t partition_size = 0;
    uint64_t fingerprint = 0;
    std::string optimizer;
    int state_buffers = 0;
  };
  Result<JobIdentity> Identity() const;
  // The partition ids this server holds (as primary when `primary_only`).
  std::vector<uint32_t> Held(bool primary_only) const;
  // The range of a partition of the current map.
  Result<std::pair<uint64_t, uint64_t>> RangeOf(uint32_t partition) const;
  // Whether the job was configured (first InitializeParameters).
  bool configured() const;
  // Validates a job's tensor table, optimizer and consistency, and fixes them
  // for this store; later calls must match. Initialize calls it.
  Status Configure(const std::string& job_id, const google::protobuf::RepeatedPtrField<v1::TensorSpec>& tensors,
                   const v1::OptimizerConfig& optimizer, const v1::ConsistencyConfig& consistency);

  // --- data plane ---------------------------------------------------------
  // `from` is the sender's member id (for logs and errors). A sync push is
  // acknowledged once it is checked and folded in; when it completes the
  // partition's step, the step's scan (norm, NaN and Inf) and the update
  // follow the reply, on the calling thread.
  void Push(uint64_t from, const ps::Frame& header, const void* payload, Reply reply);
  // Where the payload of a push (a header as it arrived, not yet checked)
  // can be received so that the store takes the buffer over as the
  // partition's accumulator instead of copying the gradient into it: the
  // first contribution of an fp32 step then costs no copy. Empty when that
  // cannot apply (another dtype, a partition this server does not hold, a
  // size that does not match, the store's lock held: it never waits for
  // it, since the transport's completion thread asks). The contents are not
  // initialised.
  std::shared_ptr<std::vector<float>> PushBuffer(const ps::Frame& header);
  // A push whose payload was received into `buffer` (from PushBuffer).
  void Push(uint64_t from, const ps::Frame& header, std::shared_ptr<std::vector<float>> buffer, Reply reply);
  void Pull(uint64_t from, const ps::Frame& header, Reply reply);
  // A server whose partitions (primaries and backups) hold at most this
  // many bytes of fp32 finishes a step where the push or share that
  // completed it is handled; a larger one offloads the step's scan,
  // decision and update (StoreOptions::offload).
  static constexpr uint64_t kInlineStepBytes = 1ULL << 20;
  // Pushes of at most this many bytes count as light (Light).
  static constexpr uint64_t kLightPushBytes = 1ULL << 20;
  // Whether handling `header` costs little, at most a small step's update
  // (a pull; a sync-mode push of at most kLightPushBytes; a share; a
  // backup's answer), so that the thread that received it may handle it;
  // the others (large or asynchronous pushes, replicated updates, state
  // transfers) belong on a thread of their own. Reads no lock.
  bool Light(const ps::Frame& header) const;
  void Share(uint64_t from, const ps::Frame& header, const void* payload);
  void Replica(uint64_t from, const ps::Frame& header, const void* payload, Reply reply);
  void Transfer(uint64_t from, const ps::Frame& header, const void* payload, Reply reply);
  // The job's configuration from a primary (kJob).
  void Job(uint64_t from, const void* payload, size_t bytes);

  const StoreCounters& counters() const { return counters_; }
  // Steps decided but not yet safe (waiting for backups), summed over
  // partitions: the replication lag.
  uint64_t ReplicationLag() const;
  // The current epoch when the backup of every partition this server is
  // primary of holds the partition's state: it acknowledged a whole-state
  // transfer or an update in this epoch, or did in the previous epoch and
  // stayed its backup with nothing unacknowledged (also the current epoch
  // when this server is primary of nothing). 0 otherwise, and while a
  // primary has no backup. Servers report it in heartbeats
  // (HeartbeatRequest.replicated_epoch): the coordinator swaps primaries and
  // backups only once it is the latest epoch everywhere. Reads an atomic.
  uint64_t ReplicatedEpoch() const { return replicated_epoch_.load(std::memory_order_acquire); }

  // Where a synchronous step's decision reports who held it up: of this
  // server's primary partitions of the step, the member that pushed last to
  // the most of them, and the mean of how long after the push before it its
  // last pushes came (v1::StepWait, scope "server"; partitions with a
  // single contributor say nothing). Called under the store's lock: it must not call back into
  // the store. Set it before the first push.
  void SetStepWaitSink(std::function<void(v1::StepWait)> sink) { step_wait_sink_ = std::move(sink); }

  // The fingerprint of a tensor table (FNV-1a over names, shapes, dtypes and
  // groups), as checkpoints record it.
  static uint64_t Fingerprint(const google::protobuf::RepeatedPtrField<v1::TensorSpec>& tensors);

 private:
  struct Segment {
    uint64_t offset = 0;  // within the partition
    uint64_t count = 0;
    optim::GroupParams group;
  };
  // A partition's gradient: finite over all of it, the sum of squares over
  // the segments that count in the global norm (GroupParams::in_grad_norm).
  static optim::GradScan ScanForNorm(const float* g, size_t n, const std::vector<Segment>& segments);
  struct PendingPull {
    uint64_t from = 0;
    ps::Frame header;
    uint64_t target = 0;  // the step the partition must be safe at
    Reply reply;
  };
  // A checkpoint's wait for partitions to reach a step.
  struct CaptureRequest {
    uint64_t step = 0;
    std::set<uint32_t> expected;
    Capture result;
    Status failed;
    bool done() const { return !failed.ok() || result.partitions.size() == expected.size(); }
    bool Captured(uint32_t id) const {
      return std::any_of(result.partitions.begin(), result.partitions.end(),
                         [id](const PartitionState& p) { return p.id == id; });
    }
  };
  // A weights buffer that fp32 pull replies are still sending from, after
  // the partition moved on to a copy (see Part::lent).
  struct Lent {
    std::vector<float> buffer;
    std::atomic<int> readers{0};  // replies still reading the weights
  };
  struct Part {
    Part() = default;
    Part(const Part&) = delete;
    Part& operator=(const Part&) = delete;
    // Replies in flight keep reading the weights after the partition is gone.
    ~Part() {
      if (lent) lent->buffer = std::move(state.weights);
    }
    Mutex mu;
    PartitionState state TANDEM_GUARDED_BY(mu);
    // state.size(), readable without the lock (PushBuffer).
    std::atomic<uint64_t> elements{0};
    // Held by every fp32 pull reply that borrows state.weights (created with
    // the first one, counted in readers). Before the weights change,
    // UnlendLocked gives the buffer to the replies still reading it, if any,
    // and the partition goes on with a copy.
    std::shared_ptr<Lent> lent TANDEM_GUARDED_BY(mu);
    v1::ReplicaRole role TANDEM_GUARDED_BY(mu) = v1::REPLICA_ROLE_UNSPECIFIED;
    // The store's epoch, set with the role (SetEpoch; a partition that left
    // gets the epoch it left in): a push or pull checked against an older
    // epoch before the change reached it is refused here, not parked.
    uint64_t epoch TANDEM_GUARDED_BY(mu) = 0;
    uint64_t primary TANDEM_GUARDED_BY(mu) = 0;
    uint64_t backup TANDEM_GUARDED_BY(mu) = 0;
    bool needs_transfer TANDEM_GUARDED_BY(mu) = false;  // primary: the backup is new
    bool links_ready TANDEM_GUARDED_BY(mu) = false;     // primary: replication may go
    std::vector<Segment> segments TANDEM_GUARDED_BY(mu);
    // Sync aggregation of step agg_step in agg_epoch.
    uint64_t agg_epoch TANDEM_GUARDED_BY(mu) = 0;
    uint64_t agg_step TANDEM_GUARDED_BY(mu) = 0;
    uint32_t contributors TANDEM_GUARDED_BY(mu) = 0;
    uint32_t folded TANDEM_GUARDED_BY(mu) = 0;  // contributions folded, in order
    std::vector<bool> seen TANDEM_GUARDED_BY(mu);
    std::map<uint32_t, std::pair<uint16_t, std::vector<char>>> early TANDEM_GUARDED_BY(mu);
    std::shared_ptr<std::vector<float>> acc TANDEM_GUARDED_BY(mu);
    // The learning rate the step's pushes carry (Frame::value; 0: the
    // schedule's), fixed by the first push taken into the aggregation.
    double agg_lr TANDEM_GUARDED_BY(mu) = 0;
    bool ready TANDEM_GUARDED_BY(mu) = false;
    // Complete, acknowledged, and waiting for its scan (ScanStep).
    bool scan_pending TANDEM_GUARDED_BY(mu) = false;
    std::chrono::steady_clock::time_point first_push TANDEM_GUARDED_BY(mu);
    // Who held the aggregation up (Decide reports it: StepWait): the member
    // whose push came last, when it came, and when the one before it came.
    uint64_t last_pusher TANDEM_GUARDED_BY(mu) = 0;
    std::chrono::steady_clock::time_point last_push TANDEM_GUARDED_BY(mu);
    std::chrono::steady_clock::time_point previous_push TANDEM_GUARDED_BY(mu);
    // The decided step's share (kept to share again when a step is retried).
    ps::ShareEntry last_share TANDEM_GUARDED_BY(mu);
    // The decision of the last step applied here (as primary, by a replica
    // update, or with a transfer): when a step is retried after some
    // partitions applied it, they share it, whichever server aggregated it.
    uint64_t decided_step TANDEM_GUARDED_BY(mu) = 0;
    double decided_coef TANDEM_GUARDED_BY(mu) = 1.0;
    bool decided_skip TANDEM_GUARDED_BY(mu) = false;
    // Highest step the backup has acknowledged (or applied here, without a
    // backup).
    uint64_t safe_step TANDEM_GUARDED_BY(mu) = 0;
    uint64_t replicating TANDEM_GUARDED_BY(mu) = 0;  // updates sent, not yet acknowledged
    // Primary: the epoch in which the backup last held the state
    // (ReplicatedEpoch); 0: never, or not since the state changed otherwise.
    uint64_t in_sync_epoch TANDEM_GUARDED_BY(mu) = 0;
    std::vector<PendingPull> pulls TANDEM_GUARDED_BY(mu);
    std::vector<std::pair<uint64_t, Reply>> push_acks TANDEM_GUARDED_BY(mu);  // async: replies after replication
    // Async / bounded staleness: each contributor's last pushed step.
    std::vector<uint64_t> clocks TANDEM_GUARDED_BY(mu);
    // Traffic.
    uint64_t bytes_pushed TANDEM_GUARDED_BY(mu) = 0;
    uint64_t bytes_pulled TANDEM_GUARDED_BY(mu) = 0;
    uint64_t pushes TANDEM_GUARDED_BY(mu) = 0;
    uint64_t pulls_served TANDEM_GUARDED_BY(mu) = 0;
  };
  // A sync step being decided.
  struct Round {
    std::map<uint32_t, ps::ShareEntry> entries;  // by partition
    bool shared = false;                         // this server sent its share
    bool decided = false;
    uint32_t dp = 1;  // data-parallel size when this server shared (the mean's divisor)
  };
  // The last share this server sent, sent again on a new epoch's links.
  struct SentShare {
    uint64_t epoch = 0;
    uint64_t step = 0;
    std::vector<ps::ShareEntry> entries;
  };
  using Actions = std::vector<std::function<void()>>;

  std::shared_ptr<Part> Find(uint32_t partition) const;
  std::vector<Segment> SegmentsFor(uint64_t begin, uint64_t end) const TANDEM_REQUIRES(mu_);
  Result<std::shared_ptr<Part>> CheckDataFrame(const ps::Frame& header, bool primary) const;
  // `buffer`, when set, holds `payload` (PushBuffer) and may be kept (moved
  // from).
  void PushImpl(uint64_t from, const ps::Frame& header, const void* payload,
                std::shared_ptr<std::vector<float>>& buffer, Reply& reply);
  // A push being taken in.
  struct PushIn {
    uint64_t from;
    const ps::Frame& h;
    const void* payload;
    std::shared_ptr<std::vector<float>>& buffer;
    Reply& reply;
    uint64_t epoch;
    std::shared_ptr<Part> keep;  // the partition, for work offloaded
  };
  // StoreOptions::offload, or `work` now.
  void Offload(std::function<void()> work);
  // Whether this server's partitions hold at most kInlineStepBytes of fp32.
  bool StepFitsHere() const TANDEM_EXCLUDES(mu_);
  bool StepFitsHereLocked() const TANDEM_REQUIRES(mu_);
  // Answers the push with `status`'s error.
  void RefusePush(PushIn& in, const Status& status);
  // Checks what every push must be (dtype, contributors, step, learning
  // rate, size) against the partition, and counts it in.
  Status TakePushLocked(Part& part, const ps::Frame& h) TANDEM_REQUIRES(part.mu);
  // Sync mode: folds the push into its step's aggregation in contributor
  // order; the push that completes it goes on with the step's scan.
  void PushSync(PushIn& in, Part& part, v1::NonFinitePolicy policy) TANDEM_EXCLUDES(part.mu);
  // Asynchronous and bounded-staleness modes: applies the push now.
  void PushAsync(PushIn& in, Part& part, const v1::ConsistencyConfig& consistency, v1::NonFinitePolicy policy,
                 uint32_t dp, uint64_t start_step) TANDEM_EXCLUDES(part.mu);
  // Shares the step once this server's partitions have all aggregated it
  // (MaybeShare), then runs what follows (a decision applies the update).
  void ShareStep(uint64_t epoch, uint64_t step);
  // The rest of a sync push that completed the aggregation of `step` into
  // `acc` (already acknowledged): marks its scan pending (unless a new epoch
  // replaced the aggregation meanwhile) and runs ScanStep.
  void FinishAggregation(Part& part, const std::shared_ptr<std::vector<float>>& acc, uint64_t epoch, uint64_t step);
  // Once every primary partition here has `step` aggregated (or applied),
  // claims the pending scans (norm, NaN and Inf), runs them without locks,
  // marks those partitions ready and shares the step. Returns at once
  // otherwise, or when another thread claimed them.
  void ScanStep(uint64_t epoch, uint64_t step);
  // An aggregation of `step` in `epoch` with every contribution folded in,
  // not yet ready (scanned).
  static bool Complete(const Part& part, uint64_t epoch, uint64_t step) TANDEM_REQUIRES(part.mu);
  void SetScanPending(Part& part, bool pending) TANDEM_REQUIRES(part.mu);
  // Folds the next contribution in order (taking `buffer` over as the
  // accumulator when it is the first and holds fp32 `data`), then the
  // buffered early pushes that follow it.
  void FoldLocked(Part& part, uint16_t dtype, const void* data, std::shared_ptr<std::vector<float>>& buffer)
      TANDEM_REQUIRES(part.mu);
  // A gradient-sized buffer, reused from released ones when one of that size
  // is spare (contents not initialised then).
  std::shared_ptr<std::vector<float>> Buffer(size_t n);
  // After a partition became ready: shares or decides (sync mode).
  void MaybeShare(uint64_t epoch, uint64_t step, Actions& actions);
  void MaybeDecide(uint64_t epoch, uint64_t step, Actions& actions) TANDEM_REQUIRES(mu_);
  void Decide(uint64_t epoch, uint64_t step, const Round& round, Actions& actions) TANDEM_REQUIRES(mu_);
  // Applies one update to a partition (grad already reduced) with the
  // learning rate `lr` (0: the schedule's; Optimizer::Apply's step_lr).
  void ApplyLocked(Part& part, const float* grad, double grad_scale, double lr) TANDEM_REQUIRES(part.mu);
  // Applies a decided sync step to the partitions that aggregated it.
  void ApplyDecision(std::vector<std::shared_ptr<Part>> parts, uint64_t epoch, uint64_t step, bool skip, double coef,
                     double grad_scale);
  // A partition completed `step`: hands its state to checkpoints waiting for
  // it.
  void StepCompleted(uint32_t partition, uint64_t step);
  // Sends an update to the backup (or marks it safe without one), queueing
  // the acknowledgement's follow-ups.
  void ReplicateLocked(Part& part, ps::Frame header, std::shared_ptr<const std::vector<float>> grad, Actions& actions)
      TANDEM_REQUIRES(part.mu);
  void SendTransferLocked(Part& part, Actions& actions) TANDEM_REQUIRES(part.mu);
  // `transfer`: the message was a whole-state transfer (a refused update is
  // answered with one; a refused transfer only waits for the next epoch).
  void OnReplicated(uint32_t partition, uint64_t step, uint64_t epoch, const Status& status, bool transfer);
  // The backup acknowledged the partition's state in `epoch` (a primary
  // with a backup and state): counts it towards ReplicatedEpoch.
  void MarkInSyncLocked(Part& part, uint64_t epoch) TANDEM_REQUIRES(part.mu);
  // The primary's state changed without reaching its backup (a restore).
  void ClearInSyncLocked(Part& part) TANDEM_REQUIRES(part.mu);
  // Called before state.weights is written or replaced: a buffer that
  // replies still borrow goes to them; with `keep_values` the partition goes
  // on with a copy of it, else with an empty vector for the caller to fill.
  static void UnlendLocked(Part& part, bool keep_values) TANDEM_REQUIRES(part.mu);
  // Answers the pulls that can be answered.
  void ServePullsLocked(Part& part, Actions& actions) TANDEM_REQUIRES(part.mu);
  void AnswerPullLocked(Part& part, const PendingPull& pull, Actions& actions) TANDEM_REQUIRES(part.mu);
  static void Run(Actions& actions);
  // The error reply to a push or a pull, its message prefixed with which
  // one ("push of partition 3 step 7: ...").
  static ps::Frame Refusal(const ps::Frame& request, const Status& status, std::vector<char>* payload);
  static ps::Frame ErrorReply(const ps::Frame& request, ps::FrameType type, const Status& status,
                              std::vector<char>* payload);

  // Released gradient buffers for Buffer() to hand out again (a buffer
  // returns here when its last holder drops it, whichever thread that is).
  struct Spares {
    Mutex mu;
    std::vector<std::unique_ptr<std::vector<float>>> free TANDEM_GUARDED_BY(mu);
    size_t bytes TANDEM_GUARDED_BY(mu) = 0;
  };

  const StoreOptions options_;
  ServerLinks* const links_;
  const std::shared_ptr<Spares> spares_ = std::make_shared<Spares>();
  std::unique_ptr<optim::ThreadPool> pool_;
  StoreCounters counters_;
  std::function<void(v1::StepWait)> step_wait_sink_;  // SetStepWaitSink
  // Partitions whose scan_pending is set.
  std::atomic<int> scans_pending_{0};
  // ReplicatedEpoch: the epoch SetEpoch last adopted, and how many of its
  // primaries have no backup in sync in it (a leaf lock: taken under a
  // partition's).
  Mutex sync_mu_;
  uint64_t sync_epoch_ TANDEM_GUARDED_BY(sync_mu_) = 0;
  size_t unsynced_ TANDEM_GUARDED_BY(sync_mu_) = 0;
  std::atomic<uint64_t> replicated_epoch_{0};

  mutable Mutex mu_;
  CondVar changed_;  // a partition completed a step (CaptureAt)
  // Job configuration (fixed by the first initialisation).
  bool configured_ TANDEM_GUARDED_BY(mu_) = false;
  std::string job_id_ TANDEM_GUARDED_BY(mu_);
  google::protobuf::RepeatedPtrField<v1::TensorSpec> tensors_ TANDEM_GUARDED_BY(mu_);
  std::vector<uint64_t> tensor_offsets_ TANDEM_GUARDED_BY(mu_);
  uint64_t fingerprint_ TANDEM_GUARDED_BY(mu_) = 0;
  std::optional<optim::Optimizer> optimizer_ TANDEM_GUARDED_BY(mu_);
  // Fixed once configured; read without mu_ by code that holds a partition's
  // lock (the lock order is mu_, then a partition's mu).
  std::atomic<const optim::Optimizer*> opt_{nullptr};
  std::atomic<int> mode_{v1::CONSISTENCY_MODE_SYNC};
  std::atomic<uint32_t> bound_{0};
  v1::OptimizerConfig optimizer_config_ TANDEM_GUARDED_BY(mu_);
  v1::ConsistencyConfig consistency_ TANDEM_GUARDED_BY(mu_);
  // Membership.
  uint64_t epoch_ TANDEM_GUARDED_BY(mu_) = 0;
  uint64_t member_id_ TANDEM_GUARDED_BY(mu_) = 0;
  uint32_t dp_size_ TANDEM_GUARDED_BY(mu_) = 1;
  uint64_t start_step_ TANDEM_GUARDED_BY(mu_) = 0;
  v1::ShardMap map_ TANDEM_GUARDED_BY(mu_);
  size_t primaries_ TANDEM_GUARDED_BY(mu_) = 0;        // partitions this server is primary of
  bool other_servers_ TANDEM_GUARDED_BY(mu_) = false;  // another server holds primaries
  std::map<uint32_t, std::shared_ptr<Part>> parts_ TANDEM_GUARDED_BY(mu_);
  std::map<std::pair<uint64_t, uint64_t>, Round> rounds_ TANDEM_GUARDED_BY(mu_);  // (epoch, step)
  SentShare last_shared_ TANDEM_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<CaptureRequest>> captures_ TANDEM_GUARDED_BY(mu_);
  bool captures_stopped_ TANDEM_GUARDED_BY(mu_) = false;
};

// Lands pushes in store buffers for a frame channel (FrameChannel::Handler):
// payload_buffer asks the store for a buffer it can keep
// (ParameterStore::PushBuffer) and holds it for the frame's peer until the
// frame's handler takes it (Take) to hand it to ParameterStore::Push. A
// channel receives each peer's frames one at a time (a frame's
// payload_buffer and handler calls end before the next frame's begin,
// whichever threads make them), so one slot per peer suffices and needs no
// lock.
class PushLanding {
 public:
  // `peers`: ranks are 0 to peers - 1.
  PushLanding(ParameterStore* store, size_t peers) : store_(store), slots_(peers) {}
  // For FrameChannel::Handler::payload_buffer: nullptr lets the channel
  // allocate.
  void* PayloadBuffer(int peer, const ps::Frame& header);
  // The buffer the frame from `peer` whose payload is at `payload` was
  // received into (null when the channel allocated it), taken out of the
  // peer's slot.
  std::shared_ptr<std::vector<float>> Take(int peer, const void* payload);

 private:
  ParameterStore* const store_;
  std::vector<std::shared_ptr<std::vector<float>>> slots_;
};

}  // namespace tandem::server
