#include "worker/data_plane.h"

#include <array>
#include <map>
#include <set>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <spdlog/spdlog.h>

#include "common/coordinator_rendezvous.h"
#include "common/grpc_util.h"
#include "common/thread_annotations.h"

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
  options.String("data_plane.ucx_tls", &config->backend_options.ucx.tls,
                 "UCX transports for collectives across nodes and for pushes and pulls (UCX_TLS syntax, e.g. "
                 "\"rc,sm\" or \"^cma\"; empty: UCX chooses)");
  options.String("data_plane.ucx_net_devices", &config->backend_options.ucx.net_devices,
                 "UCX network devices for collectives across nodes and for pushes and pulls: auto (the interface "
                 "that carries the listen address, with its RDMA ports; all when that address is a wildcard or on "
                 "no interface), all, or names (e.g. \"eth0\", \"mlx5_0:1\")");
  auto& shm = config->backend_options.shm;
  options.Bytes("data_plane.shm.round_bytes", &shm.round_bytes,
                "shared memory: staging bytes per rank and round of a large collective", 4096, 1ULL << 30);
  options.Bytes("data_plane.shm.small_bytes", &shm.small_bytes,
                "shared memory: largest allreduce done in one step (latency path)", 0, 1ULL << 30);
  options.Bytes("data_plane.shm.stream_bytes", &shm.stream_bytes,
                "shared memory: outputs from this size on bypass the caches (0: never)", 0, 1ULL << 40);
}

namespace {

prometheus::Histogram::BucketBoundaries PsSecondsBuckets() {
  return {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
}

}  // namespace

struct DataPlane::Metrics {
  prometheus::Gauge* epoch;
  prometheus::Gauge* communicators;
  prometheus::Gauge* build_seconds;
  prometheus::Counter* builds_ok;
  prometheus::Counter* builds_failed;
  // Collectives by op, group and backend; pushes and pulls by op and server.
  prometheus::Family<prometheus::Counter>* collectives;
  prometheus::Family<prometheus::Counter>* collective_bytes;
  prometheus::Family<prometheus::Counter>* collective_seconds;
  prometheus::Family<prometheus::Counter>* ps_bytes;
  prometheus::Family<prometheus::Histogram>* ps_seconds;

  // The push and pull series of each server, made on its first answer and
  // then reused: an answer only increments (no label lookup, no buckets).
  struct PsSeries {
    prometheus::Counter* bytes = nullptr;
    prometheus::Histogram* seconds = nullptr;
  };
  Mutex ps_mu;
  std::map<std::pair<bool, uint32_t>, PsSeries> ps_series TANDEM_GUARDED_BY(ps_mu);

  void PsAnswered(bool pull, uint32_t server, uint64_t bytes, double seconds) {
    PsSeries series;
    {
      MutexLock lock(&ps_mu);
      PsSeries& s = ps_series[{pull, server}];
      if (s.bytes == nullptr) {
        const std::map<std::string, std::string> labels = {{"op", pull ? "pull" : "push"},
                                                           {"server", std::to_string(server)}};
        s.bytes = &ps_bytes->Add(labels);
        s.seconds = &ps_seconds->Add(labels, PsSecondsBuckets());
      }
      series = s;
    }
    series.bytes->Increment(static_cast<double>(bytes));
    series.seconds->Observe(seconds);
  }
};

namespace {

// The group a communicator belongs to: its name without the index
// ("dp/3" -> "dp"), so that the labels stay bounded.
std::string GroupOf(const std::string& name) {
  return name.substr(0, name.find('/'));
}

// comm::Kind runs from kAllReduce (1) to kRecv.
constexpr int kCommKinds = static_cast<int>(comm::Kind::kRecv);

}  // namespace

DataPlane::DataPlane(const DataPlaneConfig& config, Daemon& daemon)
    : config_(config),
      tls_(daemon.config().tls),
      max_message_bytes_(daemon.config().max_message_bytes),
      metrics_(std::make_unique<Metrics>()) {
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
  metrics_->collectives = &prometheus::BuildCounter()
                               .Name("tandem_worker_collectives_total")
                               .Help(
                                   "Collective and point-to-point operations this worker completed, by op, "
                                   "communicator group and backend.")
                               .Register(registry);
  metrics_->collective_bytes = &prometheus::BuildCounter()
                                    .Name("tandem_worker_collective_bytes_total")
                                    .Help("Bytes of the buffers of the completed operations, by op, group and backend.")
                                    .Register(registry);
  metrics_->collective_seconds =
      &prometheus::BuildCounter()
           .Name("tandem_worker_collective_seconds_total")
           .Help("Time in the completed operations, waiting for late peers included, by op, group and backend.")
           .Register(registry);
  metrics_->ps_bytes = &prometheus::BuildCounter()
                            .Name("tandem_worker_ps_bytes_total")
                            .Help("Gradient bytes pushed to and parameter bytes pulled from each parameter server.")
                            .Register(registry);
  metrics_->ps_seconds = &prometheus::BuildHistogram()
                              .Name("tandem_worker_ps_request_seconds")
                              .Help("From sending a push or pull to a parameter server to its answer.")
                              .Register(registry);
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
  hooks->on_newer_epoch = [this](uint64_t latest) {
    MutexLock lock(&building_mu_);
    if (building_ != nullptr) building_->CancelIfSuperseded(latest);
  };
  hooks->collective_progress = [this] {
    MutexLock lock(&mu_);
    return manager_ ? manager_->CollectiveProgress() : std::vector<v1::CollectiveProgress>{};
  };
  return Status::Ok();
}

void DataPlane::Stop() {
  stopping_ = true;
  {
    MutexLock lock(&building_mu_);
    if (building_ != nullptr) building_->Cancel("the worker is shutting down");
  }
  {
    MutexLock lock(&view_mu_);
    view_cv_.NotifyAll();
  }
  MutexLock lock(&mu_);
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
  auto made = comm::CreateCommunicator(backend, info, rendezvous, config_.backend_options);
  if (made.ok() && *made) {
    // Metrics of every operation; the families outlive the communicators.
    // The series of every op are made here, once, not on each operation.
    struct Series {
      prometheus::Counter* count = nullptr;
      prometheus::Counter* bytes = nullptr;
      prometheus::Counter* seconds = nullptr;
    };
    std::array<Series, kCommKinds + 1> series;
    for (int k = 1; k <= kCommKinds; ++k) {
      const std::map<std::string, std::string> labels = {{"op", comm::KindName(static_cast<comm::Kind>(k))},
                                                         {"group", GroupOf(info.name)},
                                                         {"backend", (*made)->backend()}};
      series[k] = {&metrics_->collectives->Add(labels), &metrics_->collective_bytes->Add(labels),
                   &metrics_->collective_seconds->Add(labels)};
    }
    (*made)->SetObserver([series](comm::Kind kind, uint64_t bytes, double seconds) {
      const Series& s = series[static_cast<size_t>(kind)];
      if (s.count == nullptr) return;
      s.count->Increment();
      s.bytes->Increment(static_cast<double>(bytes));
      s.seconds->Increment(seconds);
    });
  }
  return made;
}

Status DataPlane::OnEpoch(const v1::MembershipEpoch& epoch, MemberSession& session) {
  if (stopping_) return Status::Ok();  // leaving the job: the epoch forms without this worker
  const auto start = Clock::now();
  {
    MutexLock lock(&mu_);
    if (!ps_client_) {
      PsClientOptions ps;
      ps.job_id = session.options().job_id;
      ps.token = session.options().token;
      ps.timeout = config_.timeout;
      ps.ucx.tls = config_.backend_options.ucx.tls;
      ps.ucx.net_devices = config_.backend_options.ucx.net_devices;
      ps.make_channel = [tls = tls_, limit = max_message_bytes_](const std::string& address) {
        return MakeChannel(address, tls, limit);
      };
      ps.on_answered = [m = metrics_.get()](bool pull, uint32_t server, uint64_t bytes, double seconds) {
        m->PsAnswered(pull, server, bytes, seconds);
      };
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
  {
    // Stop() cancels the build from here on (it may wait on peers that are gone).
    MutexLock lock(&building_mu_);
    if (stopping_) return Status::Ok();
    building_ = &rendezvous;
  }
  spdlog::info("epoch {}: building the data plane", epoch.epoch());
  Status built = manager_->SetEpoch(epoch, rendezvous);
  if (built.ok() && config_.self_check) built = SelfCheck();
  if (built.ok() && epoch.server_count() > 0 && epoch.shard_map().partitions_size() > 0) {
    built = ps_client_->SetEpoch(epoch, session.member_id(), rendezvous);
  }
  {
    MutexLock lock(&building_mu_);
    building_ = nullptr;
  }
  if (!built.ok() && stopping_) {
    spdlog::info("epoch {}: building the data plane stopped: the worker is shutting down", epoch.epoch());
    return built;
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
    MutexLock lock(&view_mu_);
    built_ = std::move(view);
    session_ = &session;
    view_cv_.NotifyAll();
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
  MutexLock lock(&view_mu_);
  return built_;
}

std::shared_ptr<const DataPlane::EpochView> DataPlane::WaitNewer(uint64_t after, std::chrono::milliseconds timeout) {
  MutexLock lock(&view_mu_);
  view_cv_.WaitFor(lock, timeout,
                   [&]() TANDEM_REQUIRES(view_mu_) { return stopping_ || (built_ && built_->epoch.epoch() > after); });
  if (stopping_ || !built_ || built_->epoch.epoch() <= after) return nullptr;
  return built_;
}

std::unique_ptr<comm::Rendezvous> DataPlane::EpochValues(uint64_t epoch) {
  MutexLock lock(&view_mu_);
  if (session_ == nullptr || !built_ || built_->epoch.epoch() != epoch) return nullptr;
  comm::CoordinatorRendezvousOptions rv;
  rv.job_id = session_->options().job_id;
  rv.member_id = session_->member_id();
  rv.session_id = session_->session_id();
  rv.token = session_->options().token;
  rv.epoch = epoch;
  return std::make_unique<comm::CoordinatorRendezvous>(session_->channel(), rv);
}

void DataPlane::ReportStep(uint64_t step) {
  MutexLock lock(&view_mu_);
  if (session_ != nullptr) session_->SetStep(step);
}

bool DataPlane::drained() const {
  MutexLock lock(&view_mu_);
  return session_ != nullptr && session_->drained();
}

void DataPlane::ReportStepWait(v1::StepWait wait) {
  MutexLock lock(&view_mu_);
  if (session_ != nullptr) session_->ReportStepWait(std::move(wait));
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
