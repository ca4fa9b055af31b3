#include "common/daemon.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>

#include <spdlog/spdlog.h>

#include "common/health.h"
#include "common/logging.h"
#include "common/trace_clock.h"
#include "tandem/config.h"

namespace tandem {

void DeclareDaemonOptions(OptionSet& options, DaemonConfig* config) {
  options.String("name", &config->name, "instance name used in logs and the ready file");
  options.Address("listen_address", &config->listen_address, "gRPC address to serve on (port 0: any free port)");
  options.Address("metrics_address", &config->metrics_address,
                  "address of the Prometheus /metrics endpoint (port 0: any free port)");
  options.Bytes("max_message_bytes", &config->max_message_bytes, "largest gRPC message accepted or sent", 4096,
                1ull << 30);
  options.Duration("shutdown_grace", &config->shutdown_grace, "how long calls in flight may finish after SIGTERM",
                   std::chrono::milliseconds(0), std::chrono::milliseconds(4000));
  options.Choice("log.level", &config->log_level, LogLevels(), "least severe log level printed");
  options.String("ready_file", &config->ready_file,
                 "file written (JSON) once serving, with the bound addresses; removed at exit");
  DeclareTlsOptions(options, &config->tls);
  trace::DeclareOptions(options, &config->trace);
}

Daemon::Daemon(std::string role, DaemonConfig config)
    : role_(std::move(role)),
      config_(std::move(config)),
      name_given_(!config_.name.empty()),
      registry_(std::make_shared<prometheus::Registry>()) {
  if (config_.name.empty()) config_.name = role_;
}

Daemon::~Daemon() {
  Stop();
}

void Daemon::AddService(std::string full_name, grpc::Service* service) {
  services_.push_back({std::move(full_name), service});
}

Status Daemon::Start() {
  TANDEM_ASSIGN_OR_RETURN(metrics_, MetricsServer::Start(config_.metrics_address, role_, registry_));
  GrpcServerConfig grpc_config;
  grpc_config.listen_address = config_.listen_address;
  grpc_config.max_message_bytes = config_.max_message_bytes;
  grpc_config.tls = config_.tls;
  TANDEM_ASSIGN_OR_RETURN(grpc_, GrpcServer::Start(grpc_config, services_));
  grpc_->SetHealth(kReadyService, ready_);
  spdlog::info("serving gRPC on {} ({}), metrics on http://{}/metrics", grpc_->address(),
               config_.tls.ServerEnabled() ? (config_.tls.require_client_cert ? "mutual TLS" : "TLS") : "plaintext",
               metrics_->address());
  return Status::Ok();
}

void Daemon::SetReady(bool ready) {
  if (ready == ready_) return;
  ready_ = ready;
  if (grpc_ != nullptr) grpc_->SetHealth(kReadyService, ready);
  spdlog::info("{}", ready ? "ready" : "not ready");
}

Status Daemon::WriteReadyFile() const {
  if (config_.ready_file.empty() || grpc_ == nullptr) return Status::Ok();
  // JSON, written to a temporary name and renamed, so readers never see half a file.
  const std::string tmp = config_.ready_file + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) return Unavailable("ready_file: cannot write '{}'", tmp);
    out << fmt::format(R"({{"name": "{}", "role": "{}", "pid": {}, "grpc_address": "{}", "metrics_address": "{}"}})",
                       config_.name, role_, getpid(), grpc_->address(), metrics_->address())
        << "\n";
    if (!out.flush()) return Unavailable("ready_file: cannot write '{}'", tmp);
  }
  if (std::rename(tmp.c_str(), config_.ready_file.c_str()) != 0) {
    return Unavailable("ready_file: cannot rename '{}' to '{}'", tmp, config_.ready_file);
  }
  return Status::Ok();
}

void Daemon::Stop() {
  if (grpc_ != nullptr) {
    const auto t0 = std::chrono::steady_clock::now();
    grpc_->Shutdown(config_.shutdown_grace);
    grpc_.reset();
    spdlog::debug("gRPC server stopped in {} ms",
                  std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count());
  }
  const auto t1 = std::chrono::steady_clock::now();
  metrics_.reset();
  spdlog::debug("metrics endpoint stopped in {} ms",
                std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t1).count());
  if (!config_.ready_file.empty()) std::remove(config_.ready_file.c_str());
}

const std::string& Daemon::grpc_address() const {
  return grpc_->address();
}
const std::string& Daemon::metrics_address() const {
  return metrics_->address();
}

void Daemon::RequestShutdown(Status failure) {
  std::function<void()> handler;
  {
    MutexLock lock(&shutdown_mu_);
    if (!failure.ok() && failure_.ok()) failure_ = std::move(failure);
    handler = shutdown_handler_;
  }
  if (handler) handler();
}

Status Daemon::failure() const {
  MutexLock lock(&shutdown_mu_);
  return failure_;
}

void Daemon::SetShutdownHandler(std::function<void()> handler) {
  MutexLock lock(&shutdown_mu_);
  shutdown_handler_ = std::move(handler);
}

Result<std::unique_ptr<RunningDaemon>> RunningDaemon::Start(const std::vector<std::string>& args,
                                                            const DaemonSpec& spec, std::function<void()> on_shutdown,
                                                            std::string* output) {
  DaemonConfig config = spec.defaults;
  OptionSet options(spec.program, spec.summary);
  options.EnableConfigFile();
  DeclareDaemonOptions(options, &config);
  if (spec.declare) spec.declare(options);
  options.SetEpilog(spec.epilog);
  std::vector<char*> argv;
  std::vector<std::string> copy = args;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  auto parsed = options.Parse(static_cast<int>(copy.size()), argv.data(), output);
  if (!parsed.ok()) return InvalidArgument("{}", parsed.status().message());
  if (*parsed == OptionSet::Outcome::kExit) return std::unique_ptr<RunningDaemon>();
  if (Status s = SetupLogging(config.name.empty() ? spec.role : config.name, config.log_level); !s.ok()) {
    return InvalidArgument("{}", s.message());
  }
  spdlog::info("{} {} starting (pid {})", spec.program, TANDEM_VERSION, getpid());

  std::unique_ptr<RunningDaemon> running(new RunningDaemon(spec, config));
  Daemon& daemon = running->daemon_;
  daemon.SetShutdownHandler(std::move(on_shutdown));
  const auto fail = [&](const Status& s, std::string_view what) -> Status {
    spdlog::error("{}: {}", what, s.message());
    // What `started` began (threads that use the daemon) ends before the daemon does.
    if (running->started_ && spec.stopping) spec.stopping(daemon);
    running->stopped_ = true;
    daemon.Stop();
    trace::Stop();
    return Status(s.code() == StatusCode::kInvalidArgument ? StatusCode::kFailedPrecondition : s.code(),
                  fmt::format("{}: {}", what, s.message()));
  };
  if (Status s = trace::Start(config.trace, spec.role, daemon.config().name); !s.ok()) {
    return fail(s, "cannot start");
  }
  trace::SetThreadName("main");
  // Every daemon answers trace-clock round trips (a traced member measures its coordinator's clock).
  daemon.AddService("tandem.v1.TraceClock", trace::TraceClockService::Get());
  if (spec.setup) {
    if (Status s = spec.setup(daemon); !s.ok()) return fail(s, "setup failed");
  }
  if (Status s = daemon.Start(); !s.ok()) return fail(s, "cannot start");
  if (spec.started) {
    running->started_ = true;
    if (Status s = spec.started(daemon); !s.ok()) return fail(s, "cannot start");
  }
  if (Status s = daemon.WriteReadyFile(); !s.ok()) return fail(s, "cannot start");
  return running;
}

RunningDaemon::RunningDaemon(const DaemonSpec& spec, const DaemonConfig& config)
    : stopping_(spec.stopping), daemon_(spec.role, config) {}

RunningDaemon::~RunningDaemon() {
  (void)Shutdown();  // the failure, if any, is logged
}

Status RunningDaemon::Shutdown() {
  if (!stopped_) {
    stopped_ = true;
    const auto begin = std::chrono::steady_clock::now();
    if (started_ && stopping_) stopping_(daemon_);
    daemon_.Stop();
    trace::Stop();
    const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - begin);
    if (Status failed = daemon_.failure(); !failed.ok()) {
      spdlog::error("stopped after a failure: {}", failed.ToString());
    } else {
      spdlog::info("stopped cleanly in {} ms", took.count());
    }
  }
  return daemon_.failure();
}

int RunDaemon(int argc, char** argv, const DaemonSpec& spec) {
  // First, before any thread exists, so every thread inherits the blocked signals.
  ShutdownSignal shutdown;
  std::string output;
  auto running = RunningDaemon::Start(
      std::vector<std::string>(argv, argv + argc), spec, [&shutdown] { shutdown.RequestShutdown(); }, &output);
  if (!running.ok()) {
    if (running.status().code() == StatusCode::kInvalidArgument) {
      fmt::print(stderr, "{}: {}\n", spec.program, running.status().message());
      return 2;
    }
    return 1;  // logged by Start
  }
  if (*running == nullptr) {
    fmt::print("{}", output);
    return 0;
  }
  shutdown.Wait();
  const Status ended = (*running)->Shutdown();
  if (ended.ok()) return 0;
  switch (ended.code()) {
    // What no restart changes: state lost with nothing to restore it from,
    // and a configuration the job refuses (a missing or foreign checkpoint,
    // options the servers or the mesh do not accept, a bad token).
    case StatusCode::kDataLoss:
    case StatusCode::kInvalidArgument:
    case StatusCode::kPermissionDenied:
    case StatusCode::kUnauthenticated:
    case StatusCode::kUnimplemented:
    case StatusCode::kOutOfRange:
      return kExitCannotGoOn;
    default:
      return 1;
  }
}

}  // namespace tandem
