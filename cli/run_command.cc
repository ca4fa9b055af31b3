// tandem run: start a whole Tandem cluster on this machine.
//
// Starts a coordinator, then the parameter servers and the workers (each on
// loopback, on ports the kernel picks), waits until every process serves and
// reports ready, shows them, and stops them all with SIGTERM, checking each
// exits cleanly. Training itself is not part of this version yet; the command
// says so plainly. With --hold the cluster stays up until Ctrl-C or SIGTERM.
#include <signal.h>
#include <stdlib.h>

#include <filesystem>
#include <thread>

#include "cli/commands.h"
#include "cli/launcher.h"
#include "common/config.h"
#include "common/grpc_util.h"
#include "common/health.h"
#include "common/logging.h"
#include "common/shutdown.h"
#include "tandem/v1/coordinator.grpc.pb.h"

namespace tandem::cli {
namespace {

struct RunConfig {
  int64_t nodes = 1;
  int64_t servers = 2;
  int64_t workers = 2;
  std::string bin_dir;
  std::string work_dir;
  bool hold = false;
  std::chrono::milliseconds startup_timeout{20000};
  std::string log_level = "info";
};

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// Counts the samples (non-comment lines) of a Prometheus text page.
int CountSamples(const std::string& page) {
  int n = 0;
  size_t pos = 0;
  while (pos < page.size()) {
    const size_t end = page.find('\n', pos);
    const std::string_view line(page.data() + pos, (end == std::string::npos ? page.size() : end) - pos);
    if (!line.empty() && line.front() != '#') ++n;
    if (end == std::string::npos) break;
    pos = end + 1;
  }
  return n;
}

// Stops every member with SIGTERM (workers, then servers, then the
// coordinator) and reports how each ended. Returns true if all exited 0.
bool StopAll(std::vector<LaunchedDaemon>& members) {
  fmt::print("Stopping {} processes with SIGTERM ...\n", members.size());
  bool clean = true;
  // Members first, all at once; the coordinator (members[0]) last.
  for (size_t i = members.size(); i-- > 1;) (void)members[i].process->Signal(SIGTERM);
  const auto wait_one = [&clean](LaunchedDaemon& m, std::chrono::steady_clock::time_point since) {
    auto exit = m.process->Wait(std::chrono::milliseconds(5000));
    if (!exit.ok()) {
      const ExitInfo killed = m.process->Stop(std::chrono::milliseconds(0));
      fmt::print("  {:<14} did not stop within 5 s; {}\n", m.name, killed.ToString());
      clean = false;
      return;
    }
    fmt::print("  {:<14} {} after {:.2f} s\n", m.name, exit->ToString(),
               Seconds(std::chrono::steady_clock::now() - since));
    if (!exit->success()) {
      clean = false;
      fmt::print("  the end of {}:\n{}", m.log_file, TailOfFile(m.log_file, 10));
    }
  };
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = members.size(); i-- > 1;) wait_one(members[i], t0);
  if (!members.empty()) {
    const auto t1 = std::chrono::steady_clock::now();
    (void)members[0].process->Signal(SIGTERM);
    wait_one(members[0], t1);
  }
  return clean;
}

}  // namespace

int RunCommand(int argc, char** argv) {
  ShutdownSignal shutdown;  // before any thread: Ctrl-C stops the cluster cleanly
  RunConfig config;
  config.bin_dir = ExecutableDir();
  OptionSet options("tandem run", "start a local Tandem cluster (coordinator, servers, workers) on this machine");
  options.EnableConfigFile();
  options.Int("nodes", &config.nodes, "simulated nodes the workers are spread over", 1, 256);
  options.Int("servers", &config.servers, "parameter-server processes", 0, 64);
  options.Int("workers", &config.workers, "worker processes", 0, 256);
  options.String("bin_dir", &config.bin_dir, "where tandem-coordinator, tandem-server and tandem-worker are");
  options.String("work_dir", &config.work_dir, "where logs and ready files go (default: a new /tmp/tandem-run-*)");
  options.Bool("hold", &config.hold, "keep the cluster running until Ctrl-C or SIGTERM");
  options.Duration("startup_timeout", &config.startup_timeout, "how long each process may take to become ready",
                   std::chrono::milliseconds(100), std::chrono::milliseconds(600000));
  options.Choice("log.level", &config.log_level, LogLevels(), "log level of the started processes");
  if (int rc = ParseOrExit(options, argc, argv); rc >= 0) return rc;
  if (config.work_dir.empty()) {
    std::string tmpl = "/tmp/tandem-run-XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) {
      fmt::print(stderr, "tandem run: cannot create a work directory under /tmp: {}\n", std::strerror(errno));
      return 1;
    }
    config.work_dir = tmpl;
  } else {
    std::error_code ec;
    std::filesystem::create_directories(config.work_dir, ec);
    if (ec) {
      fmt::print(stderr, "tandem run: work_dir: cannot create '{}': {}\n", config.work_dir, ec.message());
      return 1;
    }
  }

  fmt::print("Starting a local Tandem cluster: 1 coordinator, {} servers, {} workers (logs in {})\n", config.servers,
             config.workers, config.work_dir);
  const auto t_start = std::chrono::steady_clock::now();
  std::vector<LaunchedDaemon> members;
  const auto launch = [&](const std::string& binary, const std::string& name, std::vector<std::string> args) -> Status {
    LaunchSpec spec;
    spec.binary = config.bin_dir + "/" + binary;
    spec.name = name;
    spec.args = std::move(args);
    spec.args.insert(spec.args.end(), {"--log-level", config.log_level});
    spec.work_dir = config.work_dir;
    spec.startup_timeout = config.startup_timeout;
    auto d = Launch(spec);
    if (!d.ok()) return d.status();
    fmt::print("  started {:<14} pid {:<7} gRPC {:<21} metrics {}\n", name, d->ready.pid, d->ready.grpc_address,
               d->ready.metrics_address);
    members.push_back(std::move(*d));
    return Status::Ok();
  };

  Status status = launch("tandem-coordinator", "coordinator",
                         {"--data-dir", config.work_dir + "/coordinator-data", "--job-min-workers",
                          std::to_string(std::max<int64_t>(config.workers, 1)), "--job-max-workers",
                          std::to_string(std::max<int64_t>(config.workers, 1)), "--job-min-servers",
                          std::to_string(config.servers), "--job-last-call-window", "0s"});
  const std::string coordinator = status.ok() ? members[0].ready.grpc_address : "";
  for (int64_t i = 0; status.ok() && i < config.servers && !shutdown.requested(); ++i) {
    status = launch("tandem-server", fmt::format("server-{}", i), {"--coordinator-address", coordinator});
  }
  for (int64_t i = 0; status.ok() && i < config.workers && !shutdown.requested(); ++i) {
    const int64_t node = i * config.nodes / std::max<int64_t>(config.workers, 1);
    status = launch("tandem-worker", fmt::format("worker-{}", i),
                    {"--coordinator-address", coordinator, "--node-id", fmt::format("node-{}", node)});
  }

  // Every process must answer its health service and report ready (members
  // are ready once they reach the coordinator).
  std::vector<std::string> health(members.size()), ready(members.size());
  std::vector<int> samples(members.size(), 0);
  if (status.ok() && !shutdown.requested()) {
    fmt::print("Waiting for every process to report ready ...\n");
    const auto deadline = std::chrono::steady_clock::now() + config.startup_timeout;
    for (size_t i = 0; i < members.size() && status.ok(); ++i) {
      auto channel = MakeChannel(members[i].ready.grpc_address, TlsConfig{});
      if (!channel.ok()) {
        status = channel.status();
        break;
      }
      while (true) {
        auto h = CheckHealth(*channel, "", std::chrono::milliseconds(1000));
        auto r = CheckHealth(*channel, kReadyService, std::chrono::milliseconds(1000));
        health[i] = h.ok() ? *h : "UNREACHABLE";
        ready[i] = r.ok() ? *r : "UNREACHABLE";
        if (health[i] == "SERVING" && ready[i] == "SERVING") break;
        if (std::chrono::steady_clock::now() > deadline || shutdown.requested()) {
          status = DeadlineExceeded("{} is not ready (health {}, ready {}); the end of {}:\n{}", members[i].name,
                                    health[i], ready[i], members[i].log_file, TailOfFile(members[i].log_file, 10));
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      if (status.ok()) {
        auto page = HttpGet(members[i].ready.metrics_address, "/metrics", std::chrono::milliseconds(2000));
        if (!page.ok()) {
          status = page.status().WithContext(members[i].name + " metrics");
        } else {
          samples[i] = CountSamples(*page);
        }
      }
    }
  }

  // The job's first epoch: every member registered, ranked and acknowledged.
  v1::GetStatusResponse job;
  if (status.ok() && !shutdown.requested() && config.workers > 0) {
    auto channel = MakeChannel(coordinator, TlsConfig{});
    auto stub = v1::CoordinatorAdmin::NewStub(*channel);
    const auto deadline = std::chrono::steady_clock::now() + config.startup_timeout;
    while (true) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
      v1::GetStatusRequest request;
      const grpc::Status s = stub->GetStatus(&ctx, request, &job);
      if (s.ok() && job.active_epoch() > 0) break;
      if (std::chrono::steady_clock::now() > deadline || shutdown.requested()) {
        status = DeadlineExceeded("the job's first epoch did not become active in time ({}); the end of {}:\n{}",
                                  s.ok() ? "no active epoch" : s.error_message(), members[0].log_file,
                                  TailOfFile(members[0].log_file, 10));
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  if (!status.ok() || shutdown.requested()) {
    if (!status.ok()) fmt::print(stderr, "tandem run: {}\n", status.message());
    StopAll(members);
    return 1;
  }

  fmt::print("All {} processes are up and ready after {:.2f} s:\n\n", members.size(),
             Seconds(std::chrono::steady_clock::now() - t_start));
  fmt::print("  {:<14} {:<12} {:>7}  {:<21} {:<21} {:<8} {:<8} {}\n", "NAME", "ROLE", "PID", "GRPC", "METRICS",
             "HEALTH", "READY", "SAMPLES");
  for (size_t i = 0; i < members.size(); ++i) {
    const auto& r = members[i].ready;
    fmt::print("  {:<14} {:<12} {:>7}  {:<21} {:<21} {:<8} {:<8} {}\n", r.name, r.role, r.pid, r.grpc_address,
               r.metrics_address, health[i], ready[i], samples[i]);
  }
  if (job.active_epoch() > 0) fmt::print("\n{}", FormatStatus(job));
  fmt::print(
      "\nTraining is not available in this version of Tandem yet: this run starts the cluster, forms the job's\n"
      "first membership epoch (ranks, mesh, shard map), has every worker build and check its communicators\n"
      "(see the workers' logs), checks that every process serves and is ready, and stops it. The parameter\n"
      "servers' optimizer and the trainer come next (see README.md).\n\n");

  if (config.hold) {
    fmt::print("Holding the cluster up (--hold); press Ctrl-C or send SIGTERM to stop it.\n");
    shutdown.Wait();
  }
  const bool clean = StopAll(members);
  fmt::print("{}\n", clean ? "All processes stopped cleanly." : "Some processes did not stop cleanly: see above.");
  return clean ? 0 : 1;
}

}  // namespace tandem::cli
