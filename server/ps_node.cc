#include "server/ps_node.h"

#include <atomic>
#include <filesystem>

#include <google/protobuf/util/time_util.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <spdlog/spdlog.h>

#include "common/coordinator_rendezvous.h"
#include "common/failpoint.h"
#include "common/grpc_util.h"
#include "server/checkpoint/checkpoint.h"

namespace tandem::server {
namespace {

using google::protobuf::util::TimeUtil;

std::chrono::milliseconds Remaining(grpc::ServerContext* context, std::chrono::milliseconds fallback) {
  const auto deadline = context->deadline();
  const auto now = std::chrono::system_clock::now();
  if (deadline >= now + std::chrono::hours(24 * 365)) return fallback;
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now);
  return std::max(std::chrono::milliseconds(0), std::min(left, fallback));
}

}  // namespace

void DeclareServerOptions(OptionSet& options, ServerConfig* config) {
  options.Int("server.threads", &config->threads, "threads applying optimizer updates (0: one per core)", 0, 1024);
  options.Duration("server.timeout", &config->timeout,
                   "longest wait for the other members when building an epoch's parameter-server group",
                   std::chrono::milliseconds(100), std::chrono::hours(1));
  options.Duration("server.save_timeout", &config->save_timeout,
                   "longest wait for training to reach a checkpoint's step", std::chrono::milliseconds(100),
                   std::chrono::hours(24));
  options.String("server.ucx_tls", &config->ucx_tls,
                 "UCX transports for pushes and pulls (UCX_TLS syntax, e.g. \"tcp\" or \"^cma\"; empty: all)");
  options.String("server.ucx_net_devices", &config->ucx_net_devices,
                 "UCX network devices: auto (the interface that carries the listen address, with its RDMA ports; "
                 "all when that address is a wildcard or on no interface), all, or names (e.g. \"eth0\", "
                 "\"mlx5_0:1\")");
}

// ---------------------------------------------------------------------------
// The gRPC control service
// ---------------------------------------------------------------------------

class PsNode::Service final : public v1::ParameterServer::Service {
 public:
  explicit Service(PsNode* node) : node_(node) {}

  void SetToken(const std::string& token) {
    MutexLock lock(&mu_);
    token_ = token;
    has_token_ = true;
  }

  grpc::Status InitializeParameters(grpc::ServerContext*, const v1::InitializeParametersRequest* request,
                                    v1::InitializeParametersResponse* response) override {
    if (Status s = Check(request->token()); !s.ok()) return s.ToGrpc();
    if (const auto refusals = FailpointNumber("ps.initialize_unavailable");
        refusals && initialize_refused_.fetch_add(1) < *refusals) {
      return Unavailable(
                 "failpoint ps.initialize_unavailable: refusing InitializeParameters (a server still "
                 "starting)")
          .ToGrpc();
    }
    Result<v1::InitializeParametersResponse> result = Unavailable("the server is stopping");
    node_->loop_.Run([&] { result = node_->store().Initialize(*request); });
    if (!result.ok()) return result.status().ToGrpc();
    *response = std::move(result).value();
    return grpc::Status::OK;
  }

  grpc::Status GetStats(grpc::ServerContext*, const v1::GetStatsRequest* request,
                        v1::GetStatsResponse* response) override {
    if (Status s = Check(request->token()); !s.ok()) return s.ToGrpc();
    if (Status s = CheckJob(request->job_id()); !s.ok()) return s.ToGrpc();
    std::vector<uint32_t> ids(request->partition_ids().begin(), request->partition_ids().end());
    *response = node_->store().Stats(ids, request->checksums());
    MutexLock lock(&mu_);
    if (last_.has_checkpoint_id()) {
      *response->mutable_last_checkpoint() = last_.info;
      if (last_.info.state() == v1::CHECKPOINT_STATE_IN_PROGRESS) {
        *response->mutable_last_checkpoint()->mutable_duration() = TimeUtil::MillisecondsToDuration(
            std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - last_.started)
                .count());
      }
    }
    return grpc::Status::OK;
  }

  grpc::Status SaveCheckpoint(grpc::ServerContext* context, const v1::SaveCheckpointRequest* request,
                              v1::SaveCheckpointResponse* response) override {
    Status s = Save(context, *request, response);
    return s.ToGrpc();
  }

  grpc::Status RestoreCheckpoint(grpc::ServerContext*, const v1::RestoreCheckpointRequest* request,
                                 v1::RestoreCheckpointResponse* response) override {
    return Restore(*request, response).ToGrpc();
  }

  ~Service() override {
    std::thread writer;
    {
      MutexLock lock(&mu_);
      writer = std::move(writer_);
    }
    if (writer.joinable()) writer.join();
  }

  // Last checkpoint's duration and bytes, for the metrics.
  std::pair<double, uint64_t> LastCheckpoint() {
    MutexLock lock(&mu_);
    return {last_seconds_, last_bytes_};
  }

 private:
  struct Last {
    v1::CheckpointInfo info;
    std::chrono::steady_clock::time_point started;
    bool has_checkpoint_id() const { return !info.checkpoint_id().empty(); }
  };

  Status Check(const std::string& token) {
    MutexLock lock(&mu_);
    if (!has_token_) return Unavailable("this server has not joined its job yet; retry once it is ready");
    if (token_.empty()) return Status::Ok();
    if (token.empty()) return Unauthenticated("token: this job requires a join token");
    if (!ConstantTimeEquals(token, token_)) return Unauthenticated("token: wrong join token");
    return Status::Ok();
  }

  Status CheckJob(const std::string& job_id) {
    if (job_id.empty() || job_id.size() > 128) return InvalidArgument("job_id: must be 1 to 128 bytes");
    auto identity = node_->store().Identity();
    if (identity.ok() && identity->job_id != job_id) {
      return NotFound("job_id: this server serves job '{}', not '{}'", identity->job_id, job_id);
    }
    return Status::Ok();
  }

  Status Save(grpc::ServerContext* context, const v1::SaveCheckpointRequest& request,
              v1::SaveCheckpointResponse* response) {
    TANDEM_RETURN_IF_ERROR(Check(request.token()));
    TANDEM_RETURN_IF_ERROR(CheckJob(request.job_id()));
    if (request.directory().empty() || request.directory().size() > 4096 ||
        !std::filesystem::path(request.directory()).is_absolute()) {
      return InvalidArgument("directory: must be an absolute path of 1 to 4096 bytes, got '{}'", request.directory());
    }
    if (!request.checkpoint_id().empty()) TANDEM_RETURN_IF_ERROR(ValidateCheckpointId(request.checkpoint_id()));
    if (request.epoch() != 0 && request.epoch() < node_->store().epoch()) {
      return FailedPrecondition("epoch: {} is stale, this server is at epoch {}", request.epoch(),
                                node_->store().epoch());
    }
    TANDEM_ASSIGN_OR_RETURN(auto identity, node_->store().Identity());
    {
      MutexLock lock(&mu_);
      if (last_.info.state() == v1::CHECKPOINT_STATE_IN_PROGRESS) {
        return FailedPrecondition("checkpoint '{}' is still being written; wait for it (GetStats)",
                                  last_.info.checkpoint_id());
      }
    }
    const auto started = std::chrono::steady_clock::now();
    const auto started_wall = TimeUtil::GetCurrentTime();
    TANDEM_ASSIGN_OR_RETURN(Capture capture,
                            node_->store().CaptureAt(request.step(), Remaining(context, node_->config_.save_timeout)));
    const std::string id =
        request.checkpoint_id().empty() ? DefaultCheckpointId(capture.step) : request.checkpoint_id();
    const std::string dir = (std::filesystem::path(request.directory()) / id).string();
    CheckpointMeta meta;
    meta.job_id = identity.job_id;
    meta.checkpoint_id = id;
    meta.step = capture.step;
    meta.parameter_count = identity.parameter_count;
    meta.tensor_fingerprint = identity.fingerprint;
    meta.optimizer = identity.optimizer;
    meta.state_buffers = static_cast<uint32_t>(identity.state_buffers);

    v1::CheckpointInfo info;
    info.set_checkpoint_id(id);
    info.set_path(dir);
    info.set_step(capture.step);
    *info.mutable_started_time() = started_wall;
    info.set_state(v1::CHECKPOINT_STATE_IN_PROGRESS);
    auto write = [this, dir, meta, capture = std::move(capture), started]() -> v1::CheckpointInfo {
      if (const auto delay = FailpointNumber("ps.checkpoint_write_delay_ms")) {  // a slow disk, for tests
        std::this_thread::sleep_for(std::chrono::milliseconds(*delay));
      }
      std::vector<const PartitionState*> parts;
      for (const auto& p : capture.partitions) parts.push_back(&p);
      uint64_t bytes = 0;
      Status written = WriteCheckpointFiles(
          dir, meta, parts,
          [this](uint64_t so_far) {
            MutexLock lock(&mu_);
            last_.info.set_bytes(so_far);
          },
          &bytes);
      const auto took = std::chrono::steady_clock::now() - started;
      MutexLock lock(&mu_);
      last_.info.set_bytes(bytes);
      *last_.info.mutable_duration() =
          TimeUtil::MillisecondsToDuration(std::chrono::duration_cast<std::chrono::milliseconds>(took).count());
      last_status_ = written;
      if (written.ok()) {
        last_.info.set_state(v1::CHECKPOINT_STATE_COMPLETE);
        last_seconds_ = std::chrono::duration<double>(took).count();
        last_bytes_ = bytes;
        spdlog::info("checkpoint '{}' (step {}): {} partition(s), {} bytes in {:.3f} s to {}", meta.checkpoint_id,
                     meta.step, parts.size(), bytes, last_seconds_, dir);
      } else {
        last_.info.set_state(v1::CHECKPOINT_STATE_FAILED);
        last_.info.set_error(written.ToString().substr(0, 1024));
        spdlog::error("checkpoint '{}' (step {}) failed: {}", meta.checkpoint_id, meta.step, written.ToString());
      }
      return last_.info;
    };
    std::thread previous;
    {
      MutexLock lock(&mu_);
      last_.info = info;
      last_.started = started;
      previous = std::move(writer_);
    }
    if (previous.joinable()) previous.join();
    if (request.async()) {
      MutexLock lock(&mu_);
      writer_ = std::thread([write = std::move(write)]() mutable { write(); });
      *response->mutable_checkpoint() = info;
      return Status::Ok();
    }
    v1::CheckpointInfo done = write();
    *response->mutable_checkpoint() = done;
    MutexLock lock(&mu_);
    return last_status_;
  }

  Status Restore(const v1::RestoreCheckpointRequest& request, v1::RestoreCheckpointResponse* response) {
    TANDEM_RETURN_IF_ERROR(Check(request.token()));
    TANDEM_RETURN_IF_ERROR(CheckJob(request.job_id()));
    if (request.epoch() == 0) return InvalidArgument("epoch: must be >= 1");
    if (request.epoch() != node_->store().epoch()) {
      return FailedPrecondition("epoch: {} is not this server's epoch ({}); use the current shard map", request.epoch(),
                                node_->store().epoch());
    }
    if (request.path().empty() || request.path().size() > 4096) {
      return InvalidArgument("path: must be 1 to 4096 bytes");
    }
    const auto started = std::chrono::steady_clock::now();
    TANDEM_ASSIGN_OR_RETURN(auto identity, node_->store().Identity());
    TANDEM_ASSIGN_OR_RETURN(auto reader, CheckpointReader::Open(request.path()));
    const auto& meta = reader.meta();
    if (meta.tensor_fingerprint != identity.fingerprint || meta.parameter_count != identity.parameter_count) {
      return FailedPrecondition("path: {} holds a different parameter space ({} elements, other tensors) than job '{}'",
                                request.path(), meta.parameter_count, identity.job_id);
    }
    const bool with_state = !request.skip_optimizer_state() && meta.optimizer == identity.optimizer &&
                            static_cast<int>(meta.state_buffers) == identity.state_buffers;
    if (!request.skip_optimizer_state() && !with_state) {
      return FailedPrecondition(
          "path: the checkpoint's optimizer state is for {}, the job uses {}; restore with skip_optimizer_state",
          meta.optimizer, identity.optimizer);
    }
    std::vector<uint32_t> held = node_->store().Held(false);
    std::vector<uint32_t> ids;
    if (request.partition_ids().empty()) {
      ids = held;
    } else {
      for (uint32_t id : request.partition_ids()) {
        if (!std::binary_search(held.begin(), held.end(), id)) {
          return FailedPrecondition("partition_ids: partition {} is not held by this server", id);
        }
        ids.push_back(id);
      }
    }
    std::vector<PartitionState> states;
    for (uint32_t id : ids) {
      TANDEM_ASSIGN_OR_RETURN(auto range, node_->store().RangeOf(id));
      TANDEM_ASSIGN_OR_RETURN(PartitionState s, reader.Read(id, range.first, range.second, with_state));
      states.push_back(std::move(s));
    }
    Status replaced = Unavailable("the server is stopping");
    node_->loop_.Run([&] { replaced = node_->store().Replace(std::move(states), !with_state); });
    TANDEM_RETURN_IF_ERROR(replaced);
    std::sort(ids.begin(), ids.end());
    response->set_step(meta.step);
    for (uint32_t id : ids) response->add_partition_ids(id);
    response->set_bytes(reader.bytes_read());
    *response->mutable_duration() = TimeUtil::MillisecondsToDuration(
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - started).count());
    response->set_checkpoint_id(meta.checkpoint_id);
    spdlog::info("restored {} partition(s) from checkpoint '{}' (step {})", ids.size(), meta.checkpoint_id, meta.step);
    return Status::Ok();
  }

  PsNode* const node_;
  std::atomic<uint64_t> initialize_refused_{0};  // failpoint ps.initialize_unavailable
  Mutex mu_;
  std::string token_ TANDEM_GUARDED_BY(mu_);
  bool has_token_ TANDEM_GUARDED_BY(mu_) = false;
  Last last_ TANDEM_GUARDED_BY(mu_);
  double last_seconds_ TANDEM_GUARDED_BY(mu_) = 0;
  uint64_t last_bytes_ TANDEM_GUARDED_BY(mu_) = 0;
  Status last_status_ TANDEM_GUARDED_BY(mu_);
  std::thread writer_ TANDEM_GUARDED_BY(mu_);
};

// ---------------------------------------------------------------------------
// Metrics
// ---------------------------------------------------------------------------

struct PsNode::Metrics {
  prometheus::Counter* pushes;
  prometheus::Counter* duplicate_pushes;
  prometheus::Counter* rejected_pushes;
  prometheus::Counter* pulls;
  prometheus::Counter* push_bytes;
  prometheus::Counter* pull_bytes;
  prometheus::Counter* updates;
  prometheus::Counter* skipped_steps;
  prometheus::Counter* update_seconds;
  prometheus::Counter* aggregation_seconds;
  prometheus::Counter* transfers;
  prometheus::Gauge* staleness;
  prometheus::Gauge* replication_lag;
  prometheus::Gauge* checkpoint_seconds;
  prometheus::Gauge* checkpoint_bytes;
  prometheus::Gauge* epoch;
  prometheus::Gauge* primaries;
  prometheus::Gauge* backups;
  prometheus::Gauge* state_bytes;
  prometheus::Gauge* step;
  // Last values pushed into the counters.
  std::map<prometheus::Counter*, double> seen;
};

PsNode::PsNode(const ServerConfig& config, Daemon& daemon) : config_(config), metrics_(std::make_unique<Metrics>()) {
  StoreOptions store_options;
  store_options.threads = static_cast<int>(config.threads);
  store_options.offload = [this](std::function<void()> work) { loop_.Offload(std::move(work)); };
  store_ = std::make_unique<ParameterStore>(std::move(store_options), this);
  store_->SetStepWaitSink([this](v1::StepWait wait) {
    MutexLock lock(&session_mu_);
    if (session_ != nullptr) session_->ReportStepWait(std::move(wait));
  });
  service_ = std::make_unique<Service>(this);
  auto& r = daemon.registry();
  auto counter = [&r](const char* name, const char* help) {
    return &prometheus::BuildCounter().Name(name).Help(help).Register(r).Add({});
  };
  auto gauge = [&r](const char* name, const char* help) {
    return &prometheus::BuildGauge().Name(name).Help(help).Register(r).Add({});
  };
  Metrics& m = *metrics_;
  m.pushes = counter("tandem_server_pushes_total", "Gradient pushes received (duplicates and refused ones included).");
  m.duplicate_pushes = counter("tandem_server_duplicate_pushes_total",
                               "Pushes ignored as duplicates (a contributor's second push of a step, or a step "
                               "already applied).");
  m.rejected_pushes = counter("tandem_server_rejected_pushes_total",
                              "Pushes refused with an error (stale epoch, wrong size, future step, ...).");
  m.pulls = counter("tandem_server_pulls_total", "Parameter pulls received.");
  m.push_bytes = counter("tandem_server_push_bytes_total", "Gradient bytes received by pushes, as sent on the wire.");
  m.pull_bytes = counter("tandem_server_pull_bytes_total", "Parameter bytes sent by pulls, as sent on the wire.");
  m.updates = counter("tandem_server_updates_total", "Optimizer updates applied to partitions (primary and backup).");
  m.skipped_steps = counter("tandem_server_skipped_steps_total", "Steps skipped for NaN or Inf gradients.");
  m.update_seconds = counter("tandem_server_update_seconds_total", "Time spent applying optimizer updates.");
  m.aggregation_seconds = counter("tandem_server_aggregation_wait_seconds_total",
                                  "Time from a partition's first push of a step to the step's decision, summed.");
  m.transfers = counter("tandem_server_state_transfers_total", "Whole-partition state copies sent to new backups.");
  m.staleness = gauge("tandem_server_staleness_steps",
                      "Asynchronous modes: how many updates the partition had applied beyond the step the last "
                      "push was computed from.");
  m.replication_lag = gauge("tandem_server_replication_lag_steps",
                            "Steps applied on primaries here that their backups have not acknowledged yet.");
  m.checkpoint_seconds = gauge("tandem_server_checkpoint_duration_seconds",
                               "How long the last completed checkpoint took, from request to files in place.");
  m.checkpoint_bytes = gauge("tandem_server_checkpoint_bytes", "Bytes the last completed checkpoint wrote here.");
  m.epoch = gauge("tandem_server_epoch", "The membership epoch this server works in (0: none).");
  m.primaries = gauge("tandem_server_primary_partitions", "Partitions this server holds as primary.");
  m.backups = gauge("tandem_server_backup_partitions", "Partitions this server holds as backup.");
  m.state_bytes = gauge("tandem_server_state_bytes", "Host memory holding weights and optimizer state.");
  m.step = gauge("tandem_server_step", "The last step completed on every partition this server is primary of.");
  metrics_thread_ = std::thread([this] {
    MutexLock lock(&metrics_mu_);
    while (!stopping_.load()) {
      lock.Unlock();
      RefreshMetrics();
      lock.Lock();
      metrics_cv_.WaitFor(lock, std::chrono::seconds(1), [this] { return stopping_.load(); });
    }
  });
}

PsNode::~PsNode() {
  Stop();
  if (metrics_thread_.joinable()) metrics_thread_.join();
}

void PsNode::RefreshMetrics() {
  Metrics& m = *metrics_;
  const StoreCounters& c = store_->counters();
  auto set = [&m](prometheus::Counter* counter, double value) {
    double& seen = m.seen[counter];
    if (value > seen) counter->Increment(value - seen);
    seen = std::max(seen, value);
  };
  set(m.pushes, static_cast<double>(c.pushes.load()));
  set(m.duplicate_pushes, static_cast<double>(c.duplicate_pushes.load()));
  set(m.rejected_pushes, static_cast<double>(c.rejected_pushes.load()));
  set(m.pulls, static_cast<double>(c.pulls.load()));
  set(m.push_bytes, static_cast<double>(c.push_bytes.load()));
  set(m.pull_bytes, static_cast<double>(c.pull_bytes.load()));
  set(m.updates, static_cast<double>(c.updates.load()));
  set(m.skipped_steps, static_cast<double>(c.skipped_steps.load()));
  set(m.update_seconds, c.update_seconds.load());
  set(m.aggregation_seconds, c.aggregation_seconds.load());
  set(m.transfers, static_cast<double>(c.transfers_sent.load()));
  m.staleness->Set(static_cast<double>(c.staleness_last.load()));
  m.replication_lag->Set(static_cast<double>(store_->ReplicationLag()));
  auto [seconds, bytes] = service_->LastCheckpoint();
  m.checkpoint_seconds->Set(seconds);
  m.checkpoint_bytes->Set(static_cast<double>(bytes));
  const v1::GetStatsResponse stats = store_->Stats({});
  m.epoch->Set(static_cast<double>(stats.epoch()));
  int primaries = 0, backups = 0;
  for (const auto& p : stats.partitions()) {
    primaries += p.role() == v1::REPLICA_ROLE_PRIMARY ? 1 : 0;
    backups += p.role() == v1::REPLICA_ROLE_BACKUP ? 1 : 0;
  }
  m.primaries->Set(primaries);
  m.backups->Set(backups);
  m.state_bytes->Set(static_cast<double>(stats.state_bytes()));
  m.step->Set(static_cast<double>(stats.step()));
}

// ---------------------------------------------------------------------------
// Membership and the data plane
// ---------------------------------------------------------------------------

void PsNode::Register(Daemon& daemon) {
  daemon.AddService("tandem.v1.ParameterServer", service_.get());
}

Status PsNode::Hook(MemberHooks* hooks) {
  hooks->peer_view = v1::PEER_VIEW_FULL;
  hooks->on_epoch = [this](const v1::MembershipEpoch& epoch, MemberSession& session) {
    return OnEpoch(epoch, session);
  };
  hooks->replicated_epoch = [this] { return store_->ReplicatedEpoch(); };
  hooks->on_newer_epoch = [this](uint64_t latest) {
    MutexLock lock(&building_mu_);
    if (building_ != nullptr) building_->CancelIfSuperseded(latest);
  };
  return Status::Ok();
}

std::shared_ptr<PsNode::Group> PsNode::Current() const {
  MutexLock lock(&mu_);
  return group_;
}

void PsNode::Stop() {
  if (stopping_.exchange(true)) return;
  {
    MutexLock lock(&session_mu_);
    session_ = nullptr;
  }
  store_->StopCaptures();  // a synchronous SaveCheckpoint waiting for its step returns now
  {
    MutexLock lock(&building_mu_);
    if (building_ != nullptr) building_->Cancel("the server is stopping");
  }
  {
    // Under the lock the refresher waits with, so that the wake-up is not
    // missed; joined here, before the daemon's registry that its gauges
    // live in can go.
    MutexLock lock(&metrics_mu_);
    metrics_cv_.NotifyAll();
  }
  if (metrics_thread_.joinable() && metrics_thread_.get_id() != std::this_thread::get_id()) metrics_thread_.join();
  std::shared_ptr<Group> group;
  {
    MutexLock lock(&mu_);
    group = std::move(group_);
  }
  if (group && group->channel) group->channel->Stop();
  // What the channel handed over runs before the loop ends.
  loop_.Stop();
}

Status PsNode::OnEpoch(const v1::MembershipEpoch& epoch, MemberSession& session) {
  if (stopping_.load()) return Unavailable("the server is shutting down");
  {
    // The same epoch again (activated, or re-sent after a reconnection).
    MutexLock lock(&mu_);
    if (group_ && group_->epoch == epoch.epoch()) return Status::Ok();
  }
  if (store_->epoch() == epoch.epoch() && epoch.shard_map().partitions_size() == 0) return Status::Ok();
  const uint64_t self = session.member_id();
  service_->SetToken(session.options().token);
  {
    MutexLock lock(&session_mu_);
    session_ = &session;
  }
  // The store first: whatever was waiting in the old epoch fails now.
  const bool adopted = loop_.Run([&] {
    store_->SetEpoch(epoch.epoch(), self, epoch.shard_map(), std::max<uint32_t>(1, epoch.mesh().dp()),
                     epoch.start_step());
  });
  if (!adopted) return Unavailable("the server is shutting down");
  std::shared_ptr<Group> old;
  {
    MutexLock lock(&mu_);
    old = std::move(group_);
    member_id_ = self;
  }
  if (old && old->channel) old->channel->Stop();
  old.reset();
  if (epoch.shard_map().partitions_size() == 0) return Status::Ok();

  const auto start = std::chrono::steady_clock::now();
  comm::CoordinatorRendezvousOptions rv;
  rv.job_id = session.options().job_id;
  rv.member_id = self;
  rv.session_id = session.session_id();
  rv.token = session.options().token;
  rv.epoch = epoch.epoch();
  comm::CoordinatorRendezvous rendezvous(session.channel(), rv);
  transport::UcxOptions ucx;
  ucx.tls = config_.ucx_tls;
  ucx.net_devices = config_.ucx_net_devices;
  for (const auto& peer : epoch.peers()) {
    if (peer.member_id() == self) ucx.hostname = peer.node().hostname();
  }
  {
    // A newer epoch (reported by heartbeats) or Stop() cancels the build.
    MutexLock lock(&building_mu_);
    if (stopping_) return Cancelled("the server is stopping");
    building_ = &rendezvous;
  }
  auto ps_group = transport::BuildPsGroup(epoch, self, rendezvous, ucx, config_.timeout);
  {
    MutexLock lock(&building_mu_);
    building_ = nullptr;
  }
  if (!ps_group.ok()) return ps_group.status();
  auto group = std::make_shared<Group>();
  group->epoch = epoch.epoch();
  group->group = std::move(ps_group).value();
  std::vector<int> peers;
  for (int r = 0; r < static_cast<int>(group->group.members.size()); ++r) {
    if (r != group->group.rank) peers.push_back(r);
  }
  std::weak_ptr<Group> weak = group;
  group->landing = std::make_unique<PushLanding>(store_.get(), group->group.members.size());
  transport::FrameChannel::Handler handler;
  handler.payload_buffer = [weak](int rank, const ps::Frame& h) -> void* {
    auto g = weak.lock();
    return g ? g->landing->PayloadBuffer(rank, h) : nullptr;
  };
  // Every frame goes to the shard's loop from the completion thread it
  // arrives on (try_inline always takes it); on_frame is only the channel's
  // required fallback.
  handler.on_frame = [this, weak](int rank, const ps::Frame& h, void* payload, std::vector<char>& owned) {
    if (auto g = weak.lock()) HandOver(g, rank, h, payload, owned);
  };
  handler.on_peer_failed = [this, weak](int rank, const Status& status) {
    if (auto g = weak.lock()) loop_.Defer([this, g, rank, status] { OnPeerFailed(g, rank, status); });
  };
  handler.try_inline = [this, weak](int rank, const ps::Frame& h, void* payload, std::vector<char>& owned) {
    // A frame of a group that is gone is dropped.
    if (auto g = weak.lock()) HandOver(g, rank, h, payload, owned);
    return true;
  };
  group->channel = std::make_unique<transport::FrameChannel>(group->group.transport.get(), peers, std::move(handler),
                                                             /*start=*/false);
  {
    MutexLock lock(&mu_);
    group_ = group;
  }
  group->channel->Start();
  loop_.Run([&] { store_->LinksReady(epoch.epoch()); });
  spdlog::info("epoch {}: parameter-server group of {} members ready in {:.0f} ms", epoch.epoch(),
               group->group.members.size(),
               std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  return Status::Ok();
}

void SendReply(transport::FrameChannel& channel, int rank, const ps::Frame& header, ReplyBody body) {
  if (body.borrowed == nullptr) {
    channel.Send(rank, header, std::move(body.owned));
  } else {
    channel.Send(rank, header, body.borrowed, body.borrowed_bytes, nullptr, std::move(body.keep));
  }
  // The store often goes on with an update right after a reply (a push that
  // completes a step is acknowledged first); on a busy core the reply would
  // otherwise wait for it.
  channel.WaitPosted();
}

Reply PsNode::Replier(const std::shared_ptr<Group>& group, int rank) {
  return [g = std::weak_ptr<Group>(group), rank](ps::Frame header, ReplyBody body) {
    if (auto live = g.lock()) SendReply(*live->channel, rank, header, std::move(body));
  };
}

void PsNode::HandOver(const std::shared_ptr<Group>& group, int rank, const ps::Frame& h, void* payload,
                      std::vector<char>& owned) {
  // The payload is in the peer's landing slot (a push received into a store
  // buffer) or in `owned` (the channel's); either way the task keeps it.
  std::shared_ptr<std::vector<float>> landed = group->landing->Take(rank, payload);
  std::vector<char> bytes;
  if (!landed && payload != nullptr) bytes = std::move(owned);
  auto task = [this, group, rank, h, landed = std::move(landed), bytes = std::move(bytes)]() mutable {
    OnFrame(group, rank, h, std::move(landed), bytes);
  };
  // A light frame runs right here when the loop is free; the others on the
  // loop's thread, so that this (completion) thread is not held up.
  if (store_->Light(h)) {
    loop_.Defer(std::move(task));
  } else {
    loop_.Post(std::move(task));
  }
}

void PsNode::OnFrame(const std::shared_ptr<Group>& group, int rank, const ps::Frame& h,
                     std::shared_ptr<std::vector<float>> landed, std::vector<char>& bytes) {
  const void* payload = landed ? static_cast<const void*>(landed->data()) : (bytes.empty() ? nullptr : bytes.data());
  const uint64_t from = group->group.members[static_cast<size_t>(rank)];
  Reply reply = Replier(group, rank);
  switch (h.type) {
    case ps::FrameType::kPush:
      if (landed) return store_->Push(from, h, std::move(landed), reply);
      return store_->Push(from, h, payload, reply);
    case ps::FrameType::kPull:
      return store_->Pull(from, h, reply);
    case ps::FrameType::kShare:
      return store_->Share(from, h, payload);
    case ps::FrameType::kReplica:
      return store_->Replica(from, h, payload, reply);
    case ps::FrameType::kTransfer:
      return store_->Transfer(from, h, payload, reply);
    case ps::FrameType::kJob:
      return store_->Job(from, payload, h.payload_bytes);
    case ps::FrameType::kReplicaReply:
    case ps::FrameType::kTransferReply: {
      std::function<void(const Status&)> done;
      {
        MutexLock lock(&group->mu);
        auto it = group->waiting.find(h.request_id);
        if (it != group->waiting.end()) {
          done = std::move(it->second.second);
          group->waiting.erase(it);
        }
      }
      if (done) done(ps::ReplyStatus(h, payload));
      return;
    }
    default: {
      spdlog::warn("member {} sent a {} frame, which a server does not take; answered with an error", from,
                   ps::FrameTypeName(h.type));
      ps::Frame r = ps::ReplyTo(h, h.type);
      auto body = ps::ErrorPayload(r, InvalidArgument("a server does not take {} frames", ps::FrameTypeName(h.type)));
      reply(r, std::move(body));
    }
  }
}

void PsNode::OnPeerFailed(const std::shared_ptr<Group>& group, int rank, const Status& status) {
  const uint64_t member = group->group.members[static_cast<size_t>(rank)];
  spdlog::warn("epoch {}: member {} of the parameter-server group failed: {}", group->epoch, member, status.ToString());
  std::vector<std::function<void(const Status&)>> failed;
  {
    MutexLock lock(&group->mu);
    for (auto it = group->waiting.begin(); it != group->waiting.end();) {
      if (it->second.first == rank) {
        failed.push_back(std::move(it->second.second));
        it = group->waiting.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& done : failed) done(status);
}

void PsNode::SendShare(uint64_t epoch, uint64_t step, const std::vector<ps::ShareEntry>& entries) {
  auto group = Current();
  // A share of an older epoch's step goes over the current links.
  if (!group || group->epoch < epoch) return;
  ps::Frame h;
  h.type = ps::FrameType::kShare;
  h.epoch = epoch;
  h.step = step;
  h.contributors = static_cast<uint32_t>(entries.size());
  const auto* bytes = reinterpret_cast<const char*>(entries.data());
  for (int rank : group->group.Ranks(v1::ROLE_SERVER)) {
    group->channel->Send(rank, h, std::vector<char>(bytes, bytes + entries.size() * sizeof(ps::ShareEntry)));
  }
}

void PsNode::SendToBackup(uint64_t backup, const ps::Frame& header, std::shared_ptr<const std::vector<float>> payload,
                          std::function<void(const Status&)> done) {
  auto group = Current();
  if (!group || group->epoch != header.epoch) {
    return done(Unavailable("no parameter-server group for epoch {}", header.epoch));
  }
  auto it = group->group.rank_of.find(backup);
  if (it == group->group.rank_of.end()) return done(Unavailable("member {} is not in epoch {}", backup, header.epoch));
  const int rank = it->second;
  ps::Frame h = header;
  h.request_id = next_request_.fetch_add(1);
  {
    MutexLock lock(&group->mu);
    group->waiting[h.request_id] = {rank, std::move(done)};
  }
  const void* data = payload ? payload->data() : nullptr;
  const size_t bytes = payload ? payload->size() * sizeof(float) : 0;
  std::weak_ptr<Group> weak = group;
  const uint64_t id = h.request_id;
  group->channel->Send(
      rank, h, data, bytes,
      [this, weak, id](const Status& sent) {
        if (sent.ok()) return;
        auto g = weak.lock();
        if (!g) return;
        std::function<void(const Status&)> failed;
        {
          MutexLock lock(&g->mu);
          auto w = g->waiting.find(id);
          if (w != g->waiting.end()) {
            failed = std::move(w->second.second);
            g->waiting.erase(w);
          }
        }
        // On the completion thread: the store hears of it on its loop.
        if (failed) loop_.Defer([failed = std::move(failed), sent] { failed(sent); });
      },
      std::move(payload));
}

void PsNode::SendJob(uint64_t server, std::shared_ptr<const std::string> job) {
  auto group = Current();
  if (!group) return;
  auto it = group->group.rank_of.find(server);
  if (it == group->group.rank_of.end()) return;
  ps::Frame h;
  h.type = ps::FrameType::kJob;
  h.epoch = group->epoch;
  group->channel->Send(it->second, h, job->data(), job->size(), nullptr, job);
}

}  // namespace tandem::server
