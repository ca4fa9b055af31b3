// What every Tandem daemon shares: its configuration block, a gRPC server
// with the health service, a Prometheus /metrics endpoint, a ready file for
// launchers, and a main() that shuts down cleanly on SIGTERM and SIGINT.
//
// Life of a daemon (RunDaemon):
//   parse flags and YAML -> logging -> setup() registers services and metrics
//   -> /metrics, then gRPC, start serving -> started() -> ready file written
//   -> wait for SIGTERM/SIGINT -> stopping() -> health NOT_SERVING -> gRPC stops
//   (calls still running get `shutdown_grace`) -> ready file removed -> exit 0.
// Exit codes: 0 after a clean shutdown, 1 when the daemon could not start or
// failed while running, 2 for bad flags or configuration.
//
// Thread safety: Daemon is set up and stopped on the main thread; SetReady()
// and the registry are thread-safe in between (SetReady must not race Stop()).
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <prometheus/registry.h>

#include "common/config.h"
#include "common/grpc_util.h"
#include "common/metrics.h"
#include "common/mutex.h"
#include "common/shutdown.h"
#include "common/trace.h"

namespace tandem {

struct DaemonConfig {
  std::string name;             // instance name in logs and the ready file; default: the role
  std::string listen_address;   // gRPC host:port (port 0: a free one)
  std::string metrics_address;  // Prometheus host:port (port 0: a free one)
  uint64_t max_message_bytes = 16ull << 20;
  std::chrono::milliseconds shutdown_grace{2000};
  std::string log_level = "info";
  std::string ready_file;  // written once serving; empty: none
  TlsConfig tls;
  trace::Config trace;  // trace.dir, trace.steps: a timeline trace of this process (common/trace.h)
};

void DeclareDaemonOptions(OptionSet& options, DaemonConfig* config);

class Daemon {
 public:
  Daemon(std::string role, DaemonConfig config);
  ~Daemon();

  const std::string& role() const { return role_; }
  const DaemonConfig& config() const { return config_; }
  // Whether the name came from the configuration (--name or `name:`);
  // otherwise config().name is the role, which many processes share.
  bool name_given() const { return name_given_; }
  prometheus::Registry& registry() { return *registry_; }
  // REQUIRES: called before Start().
  void AddService(std::string full_name, grpc::Service* service);

  // Starts /metrics and the gRPC server; the health service reports SERVING.
  Status Start();
  // Readiness, reported as health service "tandem.ready" (Kubernetes readiness
  // probes ask for it; liveness asks for ""). Starts out not ready.
  void SetReady(bool ready);
  // Writes the ready file (JSON: name, role, pid, grpc and metrics addresses).
  Status WriteReadyFile() const;
  // NOT_SERVING, stop gRPC within shutdown_grace, stop /metrics, remove the ready file.
  void Stop();

  const std::string& grpc_address() const;
  const std::string& metrics_address() const;

  // Asks the daemon to shut down as SIGTERM would, from any thread. With a
  // non-OK `failure` (for example a training loop that cannot go on) the
  // daemon logs it and exits 1 after its clean shutdown.
  void RequestShutdown(Status failure = Status::Ok()) TANDEM_EXCLUDES(shutdown_mu_);
  Status failure() const TANDEM_EXCLUDES(shutdown_mu_);
  // RunDaemon's hook that wakes its main thread.
  void SetShutdownHandler(std::function<void()> handler) TANDEM_EXCLUDES(shutdown_mu_);

 private:
  std::string role_;
  DaemonConfig config_;
  bool name_given_ = false;
  std::shared_ptr<prometheus::Registry> registry_;
  std::vector<GrpcServer::ServiceEntry> services_;
  std::unique_ptr<MetricsServer> metrics_;
  std::unique_ptr<GrpcServer> grpc_;
  std::atomic<bool> ready_{false};
  mutable Mutex shutdown_mu_;
  Status failure_ TANDEM_GUARDED_BY(shutdown_mu_);
  std::function<void()> shutdown_handler_ TANDEM_GUARDED_BY(shutdown_mu_);
};

struct DaemonSpec {
  std::string program;  // "tandem-coordinator"
  std::string role;     // "coordinator"
  std::string summary;  // one sentence for --help
  std::string epilog;   // more text for --help
  DaemonConfig defaults;
  // Declares the role's own options (bound to the caller's config struct).
  std::function<void(OptionSet&)> declare;
  // Registers services and metrics; runs before the servers start.
  std::function<Status(Daemon&)> setup;
  // Runs once serving (start background work here).
  std::function<Status(Daemon&)> started;
  // Runs first on shutdown (stop background work here).
  std::function<void(Daemon&)> stopping;
};

// A daemon started and stopped by its caller, for a process whose main
// thread is not the daemon's (the Python front end runs the training loop on
// it). Start parses `args` (args[0] is the program name) and does what
// RunDaemon does up to the ready file; `on_shutdown` is called (from any
// thread) when the daemon asks to shut down: a failure, or RequestShutdown.
// Returns null after --help or --version, with the text in *output;
// INVALID_ARGUMENT for bad flags or configuration (the message names the key);
// another error when the daemon could not start (already logged, and what
// started is stopped).
class RunningDaemon {
 public:
  static Result<std::unique_ptr<RunningDaemon>> Start(const std::vector<std::string>& args, const DaemonSpec& spec,
                                                      std::function<void()> on_shutdown, std::string* output);
  ~RunningDaemon();
  RunningDaemon(const RunningDaemon&) = delete;
  RunningDaemon& operator=(const RunningDaemon&) = delete;

  Daemon& daemon() { return daemon_; }
  // The clean shutdown RunDaemon does after SIGTERM (the spec's stopping,
  // then Daemon::Stop); returns the failure the daemon stopped for (OK after
  // a clean shutdown). Idempotent; main-thread only, as Start.
  Status Shutdown();

 private:
  RunningDaemon(const DaemonSpec& spec, const DaemonConfig& config);
  std::function<void(Daemon&)> stopping_;
  Daemon daemon_;
  bool started_ = false;
  bool stopped_ = false;
};

// The exit status of a daemon that stopped because the job cannot go on, as
// it is: its failure is DATA_LOSS (partitions lost both copies with no
// checkpoint to restore them, a corrupt checkpoint) or one a restart does
// not change (INVALID_ARGUMENT, PERMISSION_DENIED, UNAUTHENTICATED,
// UNIMPLEMENTED, OUT_OF_RANGE: a configuration the job refuses, a missing
// checkpoint, a bad token). `tandem run`'s supervisor does not restart it,
// and a Kubernetes podFailurePolicy can match it. Other failures exit 1
// (2: bad flags or configuration at start-up).
inline constexpr int kExitCannotGoOn = 3;

// main() of a daemon: RunningDaemon::Start, then waits for SIGTERM or SIGINT
// (or RequestShutdown) and shuts down. Returns the exit code: 0 after a clean
// stop, kExitCannotGoOn, or 1 after another failure.
int RunDaemon(int argc, char** argv, const DaemonSpec& spec);

}  // namespace tandem
