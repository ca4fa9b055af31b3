#include "worker/data_plane.h"

#include <set>

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <spdlog/spdlog.h>

#include "common/coordinator_rendezvous.h"

namespace tandem::worker {

using Clock = std::chrono::steady_clock;

void DeclareDataPlaneOptions(OptionSet& options, DataPlaneConfig* config) {
  std::vector<std::string> backends = {"auto", "off"};
  for (const auto& name : comm::BackendNames()) backends.push_back(name);
  options.Choice("data_plane.backend", &config->backend, backends,
                 "communicator backend: auto (shared memory within a node, UCX across nodes), a backend name to "
                 "force one, or off (no communicators)");
  options.Duration("data_plane.timeout", &config->timeout,
                   "longest wait on a peer in a collective or while building communicators; a peer that never "
                   "enters a collective fails it after this long, naming the peer",
                   std::chrono::milliseconds(10), std::chrono::hours(24));
  options.Bool("data_plane.self_check", &config->self_check,
               "check every new epoch's world communicator with a barrier and an allreduce before joining it");
  auto& shm = config->backend_options.shm;
  options.Bytes("data_plane.shm.round_bytes", &shm.round_bytes,
                "shared memory: staging bytes per rank and round of a large collective", 4096, 1ULL << 30);
  options.Bytes("data_plane.shm.small_bytes", &shm.small_bytes,
                "shared memory: largest allreduce done in one step (latency path)", 0, 1ULL << 30);
  options.Bytes("data_plane.shm.stream_bytes", &shm.stream_bytes,
                "shared memory: outputs from this size on bypass the caches (0: never)", 0, 1ULL << 40);
}

struct DataPlane::Metrics {
  prometheus::Gauge* epoch;
  prometheus::Gauge* communicators;
  prometheus::Gauge* build_seconds;
  prometheus::Counter* builds_ok;
  prometheus::Counter* builds_failed;
};

DataPlane::DataPlane(const DataPlaneConfig& config, Daemon& daemon)
    : config_(config), metrics_(std::make_unique<Metrics>()) {
  auto& registry = daemon.registry();
  metrics_->epoch = &prometheus::BuildGauge()
                         .Name("tandem_worker_data_plane_epoch")
                         .Help("The membership epoch whose communicators this worker has built (0: none).")
                         .Register(registry)
                         .Add({});
  metrics_->communicators = &prometheus::BuildGauge()
                                 .Name("tandem_worker_communicators")
                                 .Help("Communicators of the current epoch this worker belongs to.")
                                 .Register(registry)
                                 .Add({});
  metrics_->build_seconds = &prometheus::BuildGauge()
                                 .Name("tandem_worker_data_plane_build_seconds")
                                 .Help("How long building the last epoch's communicators took, self-check included.")
                                 .Register(registry)
                                 .Add({});
  auto& builds = prometheus::BuildCounter()
                     .Name("tandem_worker_data_plane_builds_total")
                     .Help("Epochs whose communicators this worker built, by result.")
                     .Register(registry);
  metrics_->builds_ok = &builds.Add({{"result", "ok"}});
  metrics_->builds_failed = &builds.Add({{"result", "failed"}});
}

DataPlane::~DataPlane() {
  Stop();
}

Status DataPlane::Hook(MemberHooks* hooks) {
  if (config_.backend == "off") return Status::Ok();
  hooks->peer_view = v1::PEER_VIEW_FULL;
  v1::Endpoint ps;
  ps.set_transport(transport::kPsEndpoint);
  hooks->endpoints.push_back(ps);
  hooks->on_epoch = [this](const v1::MembershipEpoch& epoch, MemberSession& session) {
    return OnEpoch(epoch, session);
  };
  hooks->collective_progress = [this] {
    std::lock_guard lock(mu_);
    return manager_ ? manager_->CollectiveProgress() : std::vector<v1::CollectiveProgress>{};
  };
  return Status::Ok();
}

void DataPlane::Stop() {
  stopping_ = true;
  {
    std::lock_guard lock(view_mu_);
    view_cv_.notify_all();
  }
  std::lock_guard lock(mu_);
  if (manager_) manager_->Abort("the worker is shutting down");
  if (ps_client_) ps_client_->Stop();
}

Result<std::unique_ptr<comm::Communicator>> DataPlane::Make(const comm::CommInfo& info,
                                                            const std::vector<int>& global_ranks,
                                                            comm::Rendezvous& rendezvous) {
  // Which nodes the group spans, from the epoch's placement.
  std::set<uint32_t> nodes;
  for (int g : global_ranks) {
    for (const auto& p : epoch_.peers()) {
      if (p.role() == v1::ROLE_WORKER && p.has_rank() && static_cast<int>(p.rank().global_rank()) == g) {
        nodes.insert(p.rank().node_rank());
      }
    }
  }
  std::string backend = config_.backend;
  if (backend == "auto") backend = nodes.size() <= 1 ? "shm" : "ucx";
  if (backend == "shm" && nodes.size() > 1) {
    return FailedPrecondition(
        "communicator \"{}\" spans {} nodes, but the shm backend only connects the ranks of one node (use "
        "data_plane.backend auto)",
        info.name, nodes.size());
  }
  return comm::CreateCommunicator(backend, info, rendezvous, config_.backend_options);
}

Status DataPlane::OnEpoch(const v1::MembershipEpoch& epoch, MemberSession& session) {
  if (stopping_) return Status::Ok();  // leaving the job: the epoch forms without this worker
  const auto start = Clock::now();
  {
    std::lock_guard lock(mu_);
    if (!ps_client_) {
      PsClientOptions ps;
      ps.job_id = session.options().job_id;
      ps.token = session.options().token;
      ps.timeout = config_.timeout;
      ps_client_ = std::make_unique<PsClient>(ps);
    }
    if (!manager_) {
      member_id_ = session.member_id();
      comm::CommManagerOptions options;
      options.timeout = config_.timeout;
      manager_ = std::make_unique<comm::CommManager>(
          member_id_,
          [this](const comm::CommInfo& info, const std::vector<int>& ranks, comm::Rendezvous& rendezvous) {
            return Make(info, ranks, rendezvous);
          },
          options);
    }
  }
  if (manager_->epoch() == epoch.epoch() && !manager_->names().empty()) return Status::Ok();  // activation
  epoch_ = epoch;
  comm::CoordinatorRendezvousOptions rv;
  rv.job_id = session.options().job_id;
  rv.member_id = session.member_id();
  rv.session_id = session.session_id();
  rv.token = session.options().token;
  rv.epoch = epoch.epoch();
  comm::CoordinatorRendezvous rendezvous(session.channel(), rv);
  Status built = manager_->SetEpoch(epoch, rendezvous);
  if (built.ok() && config_.self_check) built = SelfCheck();
  if (built.ok() && epoch.server_count() > 0 && epoch.shard_map().partitions_size() > 0) {
    built = ps_client_->SetEpoch(epoch, session.member_id(), rendezvous);
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  metrics_->build_seconds->Set(seconds);
  if (!built.ok()) {
    metrics_->builds_failed->Increment();
    spdlog::error("epoch {}: the data plane could not be built: {}", epoch.epoch(), built.ToString());
    return built;
  }
  metrics_->builds_ok->Increment();
  metrics_->epoch->Set(static_cast<double>(epoch.epoch()));
  {
    auto view = std::make_shared<EpochView>();
    view->epoch = epoch;
    view->member_id = session.member_id();
    for (const auto& p : epoch.peers()) {
      if (p.member_id() == view->member_id) view->rank = p.rank();
    }
    std::lock_guard lock(view_mu_);
    built_ = std::move(view);
    session_ = &session;
    view_cv_.notify_all();
  }
  const auto names = manager_->names();
  metrics_->communicators->Set(static_cast<double>(names.size()));
  std::string summary;
  for (const auto& name : names) {
    auto c = manager_->Get(name);
    if (!c) continue;
    summary +=
        fmt::format("{}{} ({}, rank {} of {})", summary.empty() ? "" : ", ", name, c->backend(), c->rank(), c->size());
  }
  spdlog::info("epoch {}: data plane ready in {:.0f} ms{}: {}", epoch.epoch(), seconds * 1e3,
               config_.self_check ? ", self-check passed" : "", summary);
  return Status::Ok();
}

std::shared_ptr<const DataPlane::EpochView> DataPlane::built() const {
  std::lock_guard lock(view_mu_);
  return built_;
}

std::shared_ptr<const DataPlane::EpochView> DataPlane::WaitNewer(uint64_t after, std::chrono::milliseconds timeout) {
  std::unique_lock lock(view_mu_);
  view_cv_.wait_for(lock, timeout, [&] { return stopping_ || (built_ && built_->epoch.epoch() > after); });
  if (stopping_ || !built_ || built_->epoch.epoch() <= after) return nullptr;
  return built_;
}

void DataPlane::ReportStep(uint64_t step) {
  std::lock_guard lock(view_mu_);
  if (session_ != nullptr) session_->SetStep(step);
}

Status DataPlane::SelfCheck() {
  auto world = manager_->Get("world");
  if (!world) return Status::Ok();
  TANDEM_RETURN_IF_ERROR(world->Barrier().WithContext("data-plane self-check barrier"));
  int64_t mine = world->rank() + 1;
  int64_t sum = 0;
  TANDEM_RETURN_IF_ERROR(world->AllReduce(&mine, &sum, 1, comm::DType::kInt64, comm::ReduceOp::kSum)
                             .WithContext("data-plane self-check allreduce"));
  const int64_t n = world->size();
  if (sum != n * (n + 1) / 2) {
    return Internal("data-plane self-check: allreduce over {} ranks gave {}, expected {}", n, sum, n * (n + 1) / 2);
  }
  return Status::Ok();
}

}  // namespace tandem::worker
