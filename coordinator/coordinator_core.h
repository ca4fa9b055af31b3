// The coordinator's logic, apart from gRPC: jobs, registration, rendezvous,
// rank and mesh assignment, membership epochs and their acknowledgements,
// liveness, elastic joins and leaves, the parameter-server shard map, and
// durability through a Store.
//
// Every change is one internal::Record: it is appended to the store and
// applied to memory by the same Apply() that replays the log after a
// restart, so a restarted coordinator holds exactly what it had. Mutating
// calls return the store sequence their reply must wait for (the caller
// waits for durability before answering); watchers see an epoch only once its
// record is durable, so no member ever acts on an epoch a crash could undo.
//
// Time comes from a Clock, so tests move it instead of sleeping; Tick() runs
// the timers (heartbeat deadlines, stream grace, rendezvous windows, join
// timeouts) and is called by the service every few tens of milliseconds.
//
// The class is defined over three files: coordinator_core.cc (durability,
// registration, epochs, timers, admin), coordinator_status.cc (GetStatus and
// TakeStats) and coordinator_watch.cc (the watch streams' side).
//
// Thread safety: thread-safe (one mutex guards all jobs).
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "common/clock.h"
#include "common/mutex.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "coordinator/store.h"
#include "coordinator/stragglers.h"
#include "tandem/internal/coordinator_state.pb.h"
#include "tandem/v1/coordinator.pb.h"

namespace tandem::coordinator {

struct CoreOptions {
  // Join token every request must carry; empty: none required.
  std::string token;
  // Whether a Register carrying a JobSpec may create an unknown job.
  bool allow_job_creation = true;
  // Defaults for the fields a registering JobSpec leaves unset.
  v1::JobSpec job_defaults;
  // Most members (workers and servers) one job may have.
  uint32_t max_members_per_job = 16384;
  // Host hold-out after repeated failures: first hold-out, cap, and the quiet
  // period after which a host's failure count resets.
  std::chrono::milliseconds host_backoff_base{5000};
  std::chrono::milliseconds host_backoff_max{300000};
  std::chrono::milliseconds host_failure_reset{600000};
  // Failures before a host is held out at all; 0: never hold a host out.
  uint32_t host_failures_before_holdout = 2;
  // After a restart, how long recovered members have to re-attach (heartbeat
  // or re-register) before the usual deadline applies again.
  std::chrono::milliseconds recovery_grace{10000};
  // Timers that have not run for this long mean the coordinator stalled;
  // members' deadlines are then extended by the stall instead of expiring.
  std::chrono::milliseconds stall_threshold{1000};
  // Write a snapshot (and drop the log before it) after this many records
  // (checked by Tick).
  uint64_t snapshot_every_records = 50000;
  // The straggler score's window and thresholds (coordinator/stragglers.h).
  StragglerOptions stragglers;
  // Drain a worker that stays named a straggler for a whole window more,
  // when the job has more workers than its minimum. Off by default.
  bool drain_stragglers = false;
};

// The built-in defaults of a job spec (heartbeat 1 s, deadline 3 s, …).
v1::JobSpec DefaultJobSpec();

// Where a watch stream is: what it has sent so far.
struct WatchPosition {
  uint64_t epoch = 0;
  v1::EpochState state = v1::EPOCH_STATE_UNSPECIFIED;
};

// Counters and gauges the service exports as metrics.
struct CoreStats {
  uint64_t heartbeats = 0;
  uint64_t failures_detected = 0;
  uint64_t epochs_published = 0;
  uint64_t records_appended = 0;
  // Members by role ("worker", "server") and state ("joining", "active", …).
  std::map<std::pair<std::string, std::string>, uint64_t> members;
  uint64_t max_epoch = 0;  // over all jobs
  // Members declared dead by job, kind ("worker", "server") and node id.
  // Every (job, kind, node) of a member the coordinator knows is present,
  // with 0 until one of them dies.
  std::map<std::tuple<std::string, std::string, std::string>, uint64_t> failures_by_node;
  // Every ranked worker's straggler score (tandem_coordinator_straggler_*).
  struct Straggler {
    std::string job_id;
    std::string node_id;
    uint32_t rank = 0;
    double score = 0;
    bool named = false;
  };
  std::vector<Straggler> stragglers;
  uint64_t stragglers_drained = 0;
  // Durations observed since the last call (seconds), drained by TakeStats.
  std::vector<double> rendezvous_seconds;        // first registration to epoch 1 active
  std::vector<double> failure_to_epoch_seconds;  // failure detected to the next epoch active
};

class CoordinatorCore {
 public:
  // `store` and `clock` must outlive the core.
  CoordinatorCore(CoreOptions options, Store* store, const Clock* clock);

  // Reads the store (snapshot and log), rebuilds every job, and records a new
  // incarnation. Members get a fresh heartbeat deadline to re-attach.
  // REQUIRES: called once, before anything else.
  Status Recover();
  uint64_t incarnation() const;

  template <typename T>
  struct Reply {
    T response;
    uint64_t durable_after = 0;  // reply only once the store is durable up to here
  };

  // Creates a job from a spec (the coordinator's configured job). Returns
  // ALREADY_EXISTS if it exists.
  Status CreateJob(const v1::JobSpec& spec);

  Result<Reply<v1::RegisterResponse>> Register(const v1::RegisterRequest& request);
  Result<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request);
  Result<Reply<v1::AckEpochResponse>> AckEpoch(const v1::AckEpochRequest& request);
  Result<Reply<v1::LeaveResponse>> Leave(const v1::LeaveRequest& request);
  Status PutEpochValue(const v1::PutEpochValueRequest& request);
  // Returns the values present now; missing keys are listed in missing_keys.
  Result<v1::GetEpochValuesResponse> GetEpochValues(const v1::GetEpochValuesRequest& request);
  Result<v1::GetStatusResponse> GetStatus(const v1::GetStatusRequest& request);
  Result<Reply<v1::DrainResponse>> Drain(const v1::DrainRequest& request);
  Result<Reply<v1::ScaleResponse>> Scale(const v1::ScaleRequest& request);

  // Watch streams. Attach checks the request and marks the member's stream
  // up; Detach marks it broken (the member then has stream_grace to return).
  // Attach returns the stream's generation; Detach applies only to the
  // member's current stream, so the late end of a stream the member already
  // replaced cannot mark it broken.
  Result<uint64_t> AttachStream(const v1::WatchMembershipRequest& request);
  void DetachStream(const std::string& job_id, uint64_t member_id, uint64_t session_id, uint64_t generation);
  // The next update a watcher should get after `position`, if any, and
  // advances `position`. An error ends the stream (for example the member was
  // declared dead, or its rendezvous timed out).
  Result<std::optional<v1::WatchMembershipResponse>> NextUpdate(const v1::WatchMembershipRequest& request,
                                                                WatchPosition& position);

  // Runs the timers. Call every few tens of milliseconds.
  void Tick();

  // Called (without the core's lock held) when something a watcher or a
  // waiting GetEpochValues may want has changed: an epoch was published or
  // changed state, a member left or died, or an epoch value was put.
  // `epochs` is false when only epoch values changed (watchers need not wake).
  void SetChangeListener(std::function<void(bool epochs)> listener);

  // Counters since start, and durations since the last call.
  CoreStats TakeStats();
  // The store sequence of the newest epoch record of any job: once the store
  // is durable up to it, watchers may have an epoch to send.
  uint64_t epoch_sequence() const;

 private:
  struct Member {
    internal::MemberRecord record;
    Clock::TimePoint last_heartbeat{};
    Clock::TimePoint joined{};  // for the join timeout
    uint64_t stream_generation = 0;
    bool stream_broken = false;
    Clock::TimePoint stream_broken_at{};
    uint64_t last_step = 0;
    Clock::TimePoint step_changed{};  // when last_step last changed
    uint64_t epoch_seen = 0;
    std::vector<v1::CollectiveProgress> collectives;
    uint64_t replicated_epoch = 0;  // servers: HeartbeatRequest.replicated_epoch
  };
  struct Job {
    v1::JobSpec spec;
    std::map<uint64_t, Member> members;
    v1::MembershipEpoch latest;                                        // newest published epoch (epoch 0: none yet)
    v1::MembershipEpoch latest_header;                                 // `latest` without its peers (for partial views)
    std::unordered_map<uint64_t, int> latest_index;                    // member id -> index in latest.peers
    std::unordered_map<std::string, std::vector<int>> latest_by_node;  // node -> worker peer indices
    std::vector<int> latest_servers;                                   // server peer indices
    uint64_t latest_sequence = 0;                                      // store sequence of latest's newest record
    std::set<uint64_t> acked;                                          // members of `latest` that acknowledged it
    size_t pending_acks = 0;                                           // members of `latest` that have not
    std::map<std::string, internal::HostRecord> hosts;
    std::map<std::string, std::string> values;  // epoch values of `latest`
    uint64_t step = 0;
    Clock::TimePoint step_recorded{};
    std::optional<Clock::TimePoint> window_closes;  // rendezvous / join batching window
    std::optional<Clock::TimePoint> rendezvous_started;
    std::optional<Clock::TimePoint> failure_detected;
    std::string waiting_reason;  // why no epoch can form, for status
    // The workers' straggler score, from heartbeats' step_waits (not
    // durable: a restarted coordinator starts an empty window).
    StragglerTracker stragglers;
    bool stragglers_configured = false;  // with CoreOptions::stragglers
    Clock::TimePoint stragglers_evaluated{};
  };

  // Appends a record and applies it. REQUIRES: mu_ held.
  uint64_t Commit(internal::Record record) TANDEM_REQUIRES(mu_);
  void Apply(const internal::Record& record, bool live) TANDEM_REQUIRES(mu_);
  // A snapshot of the whole state when one is due (sequence and payload);
  // Tick writes it after releasing the lock.
  std::optional<std::pair<uint64_t, std::string>> PrepareSnapshot() TANDEM_REQUIRES(mu_);
  void WriteSnapshot(uint64_t sequence, std::string payload) TANDEM_EXCLUDES(mu_);

  Status CheckToken(const std::string& token) const;
  Result<Job*> FindJob(const std::string& job_id) TANDEM_REQUIRES(mu_);
  // Like FindJob, but an empty id names the only job, if there is one.
  Result<Job*> FindAdminJob(const std::string& job_id) TANDEM_REQUIRES(mu_);
  Result<Member*> FindMember(Job& job, uint64_t member_id, uint64_t session_id) TANDEM_REQUIRES(mu_);
  Result<v1::JobSpec> ValidateSpec(const v1::JobSpec& requested) const;

  // Forms and publishes the next epoch from the job's live members. Returns
  // false (with job.waiting_reason set) if none can form.
  // `pause`: the epoch is paused if it has fewer workers than min_workers
  // (Scale raised the minimum). An epoch also stays paused, below the
  // minimum, when the latest one is.
  // Three steps: ComputeEpoch forms it (changing nothing), RecordEpoch
  // commits the members' new ranks and then the epoch, AnnounceEpoch sets
  // the job's waiting reason and logs it (watchers are woken by the caller's
  // FlushNotify).
  bool PublishEpoch(Job& job, v1::EpochCause cause, const std::string& detail, bool pause = false) TANDEM_REQUIRES(mu_);
  struct NextEpoch;  // defined in coordinator_core.cc
  // The next epoch from the job's live members (changed: false when it would
  // rank the same members as the latest one); an error when the mesh cannot form.
  Result<NextEpoch> ComputeEpoch(const Job& job, v1::EpochCause cause, const std::string& detail, bool pause) const
      TANDEM_REQUIRES(mu_);
  void RecordEpoch(Job& job, const NextEpoch& next) TANDEM_REQUIRES(mu_);
  void AnnounceEpoch(Job& job, const NextEpoch& next, const std::string& detail) TANDEM_REQUIRES(mu_);
  void MaybeCloseRendezvous(Job& job) TANDEM_REQUIRES(mu_);
  // Publishes an EPOCH_CAUSE_REBALANCE epoch when the latest epoch is active
  // with every member it names alive, nothing waits to join or leave, every
  // server reports its backups in sync in it (replicated_epoch), and
  // RebalancePrimaries would swap partitions.
  void MaybeRebalance(Job& job) TANDEM_REQUIRES(mu_);
  void MaybeActivate(Job& job) TANDEM_REQUIRES(mu_);
  // Marks members dead (id, why), counts one failure per host, and publishes
  // one epoch without them. `replaced`: the members were replaced by a newer
  // incarnation of their name (a restart): no host failure is counted, and
  // nothing is logged (Register logs the restart).
  void DeclareDead(Job& job, const std::vector<std::pair<uint64_t, std::string>>& dead, bool replaced = false)
      TANDEM_REQUIRES(mu_);
  void SetMemberState(Member& member, v1::MemberState state, const std::string& detail) TANDEM_REQUIRES(mu_);
  static bool Alive(const Member& m);
  bool InLatest(const Job& job, uint64_t member_id) const;
  v1::MembershipEpoch View(const Job& job, uint64_t member_id, v1::PeerView view) const TANDEM_REQUIRES(mu_);
  void NotifyLater(bool epochs) TANDEM_REQUIRES(mu_) {
    notify_ = true;
    notify_epochs_ = notify_epochs_ || epochs;
  }
  // GetStatus's parts (coordinator_status.cc): one member's status, and the
  // collectives some workers wait in for others.
  void FillMemberStatus(const Job& job, uint64_t id, const Member& m,
                        const std::map<uint64_t, v1::RankAssignment>& ranks, Clock::TimePoint now,
                        v1::MemberStatus* status) const TANDEM_REQUIRES(mu_);
  void AddStalledCollectives(const Job& job, const std::map<uint64_t, v1::RankAssignment>& ranks,
                             v1::GetStatusResponse& response) const TANDEM_REQUIRES(mu_);
  // The straggler score (coordinator_stragglers.cc): a member's step_waits
  // from its heartbeat go into the job's tracker, which is evaluated at most
  // every 100 ms; workers named or cleared are logged, and drained when
  // options_.drain_stragglers says so.
  void NoteStepWaits(Job& job, const Member& member, const google::protobuf::RepeatedPtrField<v1::StepWait>& waits)
      TANDEM_REQUIRES(mu_);
  // Who a member is in the job's latest epoch (rank, node, name), for the tracker.
  std::optional<StragglerIdentity> StragglerWho(const Job& job, uint64_t member_id) const TANDEM_REQUIRES(mu_);
  // Calls the listener if something changed, with mu_ released meanwhile
  // (and held again on return: guarded state may have changed).
  void FlushNotify() TANDEM_REQUIRES(mu_);

  const CoreOptions options_;
  Store* const store_;        // outlives the core (constructor contract)
  const Clock* const clock_;  // outlives the core (constructor contract)

  mutable Mutex mu_;
  std::map<std::string, Job> jobs_ TANDEM_GUARDED_BY(mu_);
  uint64_t next_member_id_ TANDEM_GUARDED_BY(mu_) = 1;
  uint64_t incarnation_ TANDEM_GUARDED_BY(mu_) = 0;
  uint64_t last_sequence_ TANDEM_GUARDED_BY(mu_) = 0;
  uint64_t snapshot_sequence_ TANDEM_GUARDED_BY(mu_) = 0;
  bool snapshot_running_ TANDEM_GUARDED_BY(mu_) = false;
  std::optional<Clock::TimePoint> last_tick_ TANDEM_GUARDED_BY(mu_);
  bool notify_ TANDEM_GUARDED_BY(mu_) = false;
  bool notify_epochs_ TANDEM_GUARDED_BY(mu_) = false;
  std::mt19937_64 random_ TANDEM_GUARDED_BY(mu_);
  CoreStats stats_ TANDEM_GUARDED_BY(mu_);
  std::function<void(bool)> listener_;
};

}  // namespace tandem::coordinator
