#include "coordinator/coordinator_daemon.h"

#include <fstream>

#include <google/protobuf/util/time_util.h>
#include <spdlog/spdlog.h>

#include "common/grpc_util.h"
#include "coordinator/coordinator_core.h"
#include "coordinator/coordinator_service.h"
#include "coordinator/store.h"

namespace tandem::coordinator {
namespace {

using google::protobuf::util::TimeUtil;

struct CoordinatorConfig {
  std::string data_dir;
  std::string token_file;
  std::string job_id = "default";
  int64_t min_workers = 1;
  int64_t max_workers = 1024;
  int64_t min_servers = 0;
  std::chrono::milliseconds last_call_window{2000};
  std::chrono::milliseconds join_timeout{600000};
  std::chrono::milliseconds heartbeat_interval{1000};
  std::chrono::milliseconds heartbeat_deadline{3000};
  std::chrono::milliseconds stream_grace{500};
  int64_t dp = 0, tp = 0, pp = 0;
  int64_t parameter_count = 0;
  uint64_t partition_size = 4u << 20;
  int64_t max_members = 16384;
  int64_t host_failures_before_holdout = 2;
  std::chrono::milliseconds host_holdout_base{5000};
  std::chrono::milliseconds host_holdout_max{300000};
  std::chrono::milliseconds tick{20};
  bool drain_stragglers = false;
};

struct State {
  CoordinatorConfig config;
  std::unique_ptr<Store> store;
  std::unique_ptr<CoordinatorCore> core;
  std::unique_ptr<CoordinatorService> service;
};

v1::JobSpec SpecFrom(const CoordinatorConfig& c) {
  v1::JobSpec spec;
  spec.set_job_id(c.job_id);
  spec.set_min_workers(static_cast<uint32_t>(c.min_workers));
  spec.set_max_workers(static_cast<uint32_t>(std::max(c.max_workers, c.min_workers)));
  spec.set_min_servers(static_cast<uint32_t>(c.min_servers));
  *spec.mutable_last_call_window() = TimeUtil::MillisecondsToDuration(c.last_call_window.count());
  *spec.mutable_join_timeout() = TimeUtil::MillisecondsToDuration(c.join_timeout.count());
  *spec.mutable_heartbeat_interval() = TimeUtil::MillisecondsToDuration(c.heartbeat_interval.count());
  *spec.mutable_heartbeat_deadline() = TimeUtil::MillisecondsToDuration(c.heartbeat_deadline.count());
  *spec.mutable_stream_grace() = TimeUtil::MillisecondsToDuration(c.stream_grace.count());
  spec.mutable_mesh()->set_dp(static_cast<uint32_t>(c.dp));
  spec.mutable_mesh()->set_tp(static_cast<uint32_t>(c.tp));
  spec.mutable_mesh()->set_pp(static_cast<uint32_t>(c.pp));
  spec.set_parameter_count(static_cast<uint64_t>(c.parameter_count));
  spec.set_partition_size_bytes(c.partition_size);
  return spec;
}

}  // namespace

DaemonSpec MakeDaemonSpec() {
  auto state = std::make_shared<State>();
  DaemonSpec spec;
  spec.program = "tandem-coordinator";
  spec.role = "coordinator";
  spec.summary = "the Tandem coordinator: ranks, membership epochs and the parameter-server shard map";
  spec.defaults.listen_address = "0.0.0.0:7400";
  spec.defaults.metrics_address = "0.0.0.0:9400";
  spec.epilog =
      "The coordinator serves tandem.v1.Coordinator and tandem.v1.CoordinatorAdmin. With --data-dir its state\n"
      "(jobs, members, epochs, shard maps) survives a restart, kill -9 included; without it the state lives in\n"
      "memory only. The job of the job.* keys is created at start-up unless recovered.\n"
      "Health: the standard gRPC health service; service \"\" is liveness, \"tandem.ready\" readiness.\n"
      "Metrics: http://METRICS_ADDRESS/metrics (see docs/metrics.md).";
  spec.declare = [state](OptionSet& o) {
    CoordinatorConfig& c = state->config;
    o.String("data_dir", &c.data_dir, "directory for the durable state (log and snapshots); empty: memory only");
    o.String("auth.token_file", &c.token_file, "file holding the join token every request must carry; empty: none");
    o.Int("max_members", &c.max_members, "most members one job may have", 1, 1 << 20);
    o.Int("host_failures_before_holdout", &c.host_failures_before_holdout,
          "a host (node id, else hostname) whose members are declared dead this many times, each within 10 min of "
          "the last, is held out: its registrations are refused for host_holdout_base, doubling with each further "
          "failure; 0: never hold a host out. A restart that replaces its old incarnation (same --name) does not "
          "count",
          0, 1000);
    o.Duration("host_holdout_base", &c.host_holdout_base,
               "how long a host is first held out; each further failure doubles it, up to host_holdout_max",
               std::chrono::milliseconds(1), std::chrono::milliseconds(86400000));
    o.Duration("host_holdout_max", &c.host_holdout_max, "the longest a host is held out", std::chrono::milliseconds(1),
               std::chrono::milliseconds(86400000));
    o.Duration("tick", &c.tick, "how often timers (deadlines, windows) are checked", std::chrono::milliseconds(1),
               std::chrono::milliseconds(1000));
    o.Bool("drain_stragglers", &c.drain_stragglers,
           "drain a worker that stays named a straggler for 20 steps more, while its job has more workers than "
           "job.min_workers (one at a time); off: stragglers are named (log, tandem status, metrics), not acted on");
    o.String("job.id", &c.job_id, "the job to create at start-up (members name it); empty: none");
    o.Int("job.min_workers", &c.min_workers, "workers needed before the first epoch forms", 1, 65536);
    o.Int("job.max_workers", &c.max_workers, "most workers in an epoch (more wait on standby)", 1, 65536);
    o.Int("job.min_servers", &c.min_servers, "parameter servers needed before the first epoch forms", 0, 65536);
    o.Duration("job.last_call_window", &c.last_call_window,
               "once min_workers are in, how long to wait for more before closing the rendezvous",
               std::chrono::milliseconds(0), std::chrono::milliseconds(600000));
    o.Duration("job.join_timeout", &c.join_timeout, "how long a member waits for the rendezvous before it fails",
               std::chrono::milliseconds(100), std::chrono::milliseconds(86400000));
    o.Duration("job.heartbeat_interval", &c.heartbeat_interval, "how often members heartbeat",
               std::chrono::milliseconds(10), std::chrono::milliseconds(60000));
    o.Duration("job.heartbeat_deadline", &c.heartbeat_deadline, "a member silent this long is declared dead",
               std::chrono::milliseconds(20), std::chrono::milliseconds(600000));
    o.Duration("job.stream_grace", &c.stream_grace,
               "a member whose membership stream broke is declared dead if it is not back within this",
               std::chrono::milliseconds(0), std::chrono::milliseconds(600000));
    o.Int("job.mesh.dp", &c.dp, "data-parallel size; 0: as many as fit (elastic)", 0, 65536);
    o.Int("job.mesh.tp", &c.tp, "tensor-parallel size (inside a node); 0: 1", 0, 65536);
    o.Int("job.mesh.pp", &c.pp, "pipeline-parallel size (across nodes); 0: 1", 0, 65536);
    o.Int("job.parameter_count", &c.parameter_count, "elements of the flattened parameter space (for the shard map)", 0,
          int64_t{1} << 40);
    o.Bytes("job.partition_size", &c.partition_size, "size of one parameter-server partition", 4096, 1ull << 32);
    o.AddCheck([&c]() -> Status {
      if (c.heartbeat_deadline <= c.heartbeat_interval) {
        return InvalidArgument("job.heartbeat_deadline ({}) must be longer than job.heartbeat_interval ({})",
                               FormatDuration(c.heartbeat_deadline), FormatDuration(c.heartbeat_interval));
      }
      if (c.host_holdout_max < c.host_holdout_base) {
        return InvalidArgument("host_holdout_max ({}) is below host_holdout_base ({})",
                               FormatDuration(c.host_holdout_max), FormatDuration(c.host_holdout_base));
      }
      if (c.max_workers < c.min_workers) {
        return InvalidArgument("job.max_workers ({}) is below job.min_workers ({})", c.max_workers, c.min_workers);
      }
      return Status::Ok();
    });
  };
  spec.setup = [state](Daemon& daemon) -> Status {
    CoordinatorConfig& c = state->config;
    CoreOptions options;
    if (!c.token_file.empty()) {
      TANDEM_ASSIGN_OR_RETURN(std::string token, ReadFileContents(c.token_file, "auth.token_file"));
      while (!token.empty() && (token.back() == '\n' || token.back() == '\r' || token.back() == ' ')) token.pop_back();
      if (token.empty()) return InvalidArgument("auth.token_file: '{}' holds no token", c.token_file);
      options.token = std::move(token);
    }
    options.max_members_per_job = static_cast<uint32_t>(c.max_members);
    options.host_failures_before_holdout = static_cast<uint32_t>(c.host_failures_before_holdout);
    options.host_backoff_base = c.host_holdout_base;
    options.host_backoff_max = c.host_holdout_max;
    options.drain_stragglers = c.drain_stragglers;
    if (c.data_dir.empty()) {
      spdlog::warn("no --data-dir: the coordinator's state lives in memory and does not survive a restart");
      state->store = std::make_unique<MemoryStore>();
    } else {
      TANDEM_ASSIGN_OR_RETURN(auto store, FileStore::Open(c.data_dir));
      state->store = std::move(store);
    }
    state->core = std::make_unique<CoordinatorCore>(options, state->store.get(), SystemClock::Get());
    TANDEM_RETURN_IF_ERROR(state->core->Recover().WithContext("recovering the coordinator's state"));
    if (!c.job_id.empty()) {
      v1::GetStatusRequest status;
      status.set_job_id(c.job_id);
      status.set_token(options.token);
      if (!state->core->GetStatus(status).ok()) {
        TANDEM_RETURN_IF_ERROR(state->core->CreateJob(SpecFrom(c)).WithContext("job"));
      }
    }
    state->service =
        std::make_unique<CoordinatorService>(state->core.get(), state->store.get(), daemon.registry(), c.tick);
    daemon.AddService("tandem.v1.Coordinator", state->service->coordinator());
    daemon.AddService("tandem.v1.CoordinatorAdmin", state->service->admin());
    return Status::Ok();
  };
  spec.started = [state](Daemon& daemon) {
    state->service->Start();
    daemon.SetReady(true);
    return Status::Ok();
  };
  spec.stopping = [state](Daemon&) {
    if (state->service) state->service->Stop();
  };
  return spec;
}

}  // namespace tandem::coordinator
