#include "cli/supervisor.h"

#include <signal.h>

#include <algorithm>

#include "common/config.h"
#include "common/daemon.h"
#include "common/logging.h"

namespace tandem::cli {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

}  // namespace

const char* ProcessRoleName(ProcessRole role) {
  switch (role) {
    case ProcessRole::kCoordinator:
      return "coordinator";
    case ProcessRole::kServer:
      return "server";
    case ProcessRole::kWorker:
      return "worker";
  }
  return "?";
}

Supervisor::Supervisor(RestartPolicy policy, std::function<void(const std::string&)> event)
    : policy_(policy), event_(std::move(event)) {}

Supervisor::~Supervisor() {
  // A process still running here was not stopped by StopAll (an early
  // error): Subprocess's destructor kills it; a stopped one first needs
  // continuing so that it can die of SIGTERM too.
  for (auto& p : processes_) {
    if (p->stopped && p->daemon.process) (void)p->daemon.process->Signal(SIGCONT);
  }
}

Status Supervisor::Launch(LaunchSpec spec, ProcessRole role, int node) {
  auto p = std::make_unique<Supervised>();
  p->role = role;
  p->node = node;
  TANDEM_ASSIGN_OR_RETURN(p->daemon, tandem::cli::Launch(spec));
  if (role == ProcessRole::kCoordinator) {
    // Every member knows the coordinator by its address: a restarted one
    // must listen on the same port.
    TANDEM_ASSIGN_OR_RETURN(const HostPort hp, ParseHostPort(p->daemon.ready.grpc_address));
    spec.grpc_port = hp.port;
  }
  p->spec = std::move(spec);
  processes_.push_back(std::move(p));
  return Status::Ok();
}

void Supervisor::Poll(const std::function<bool(const Supervised&, const Result<ExitInfo>&)>& restartable) {
  const auto now = Clock::now();
  for (auto& ptr : processes_) {
    Supervised& p = *ptr;
    switch (p.state) {
      case Supervised::State::kRunning:
        if (!p.daemon.process->Running()) {
          const Result<ExitInfo> exit = p.daemon.process->Wait(std::chrono::milliseconds(0));
          p.stopped = false;
          if (!restartable(p, exit)) {
            p.state = Supervised::State::kRetired;
            continue;
          }
          Ended(p, exit);
        }
        break;
      case Supervised::State::kWaiting:
        if (now >= p.restart_at) Restart(p);
        break;
      case Supervised::State::kStarting: {
        auto started = CheckStarted(*p.starting);
        if (started.ok() && !*started) break;
        if (started.ok()) {
          p.daemon = std::move(p.starting->daemon);
          p.starting.reset();
          p.state = Supervised::State::kRunning;
          p.fenced = false;
          event_(fmt::format("{} is up again (pid {}, restart {} of {}), {:.1f} s after it ended", p.name(), p.pid(),
                             p.restarts, policy_.restarts, Seconds(now - p.ended_at)));
        } else {
          p.daemon = std::move(p.starting->daemon);
          p.starting.reset();
          p.state = Supervised::State::kRunning;  // Ended decides what comes next
          Ended(p, Result<ExitInfo>(started.status()));
        }
        break;
      }
      case Supervised::State::kDown:
      case Supervised::State::kRetired:
        break;
    }
  }
}

void Supervisor::Ended(Supervised& p, const Result<ExitInfo>& exit) {
  p.ended_at = Clock::now();
  p.last_end = exit.ok() ? DescribeExit(*exit) : exit.status().message();
  if (p.fenced) p.last_end += " (killed by the supervisor: the coordinator had declared it dead)";
  if (exit.ok() && exit->exited && exit->code == kExitCannotGoOn) {
    p.final = true;
    p.state = Supervised::State::kDown;
    event_(fmt::format("{} (pid {}) {}: the job cannot go on, and a restart would not help", p.name(), p.pid(),
                       p.last_end));
    return;
  }
  if (p.restarts >= policy_.restarts) {
    p.state = Supervised::State::kDown;
    event_(fmt::format("{} (pid {}) {}; it has no restarts left ({} used): it stays down", p.name(), p.pid(),
                       p.last_end, p.restarts));
    return;
  }
  // Exponential back-off: delay, 2 x delay, 4 x delay, ... at most max_delay.
  auto delay = policy_.delay;
  for (int i = 0; i < p.restarts && delay < policy_.max_delay; ++i) delay *= 2;
  delay = std::min(delay, policy_.max_delay);
  p.state = Supervised::State::kWaiting;
  p.restart_at = p.ended_at + delay;
  event_(fmt::format("{} (pid {}) {}; restarting it in {:.1f} s (restart {} of {})", p.name(), p.pid(), p.last_end,
                     std::chrono::duration<double>(delay).count(), p.restarts + 1, policy_.restarts));
}

void Supervisor::Restart(Supervised& p) {
  ++p.restarts;
  auto starting = StartDaemon(p.spec);
  if (!starting.ok()) {
    p.state = Supervised::State::kRunning;
    p.daemon.process.reset();
    Ended(p, Result<ExitInfo>(starting.status()));
    return;
  }
  p.starting.emplace(std::move(*starting));
  p.state = Supervised::State::kStarting;
  spdlog::debug("restarting {} (pid {})", p.name(), p.starting->daemon.process->pid());
}

void Supervisor::Fence(Supervised& p, const std::string& why) {
  if (p.fenced || p.state != Supervised::State::kRunning || !p.daemon.process->Running()) return;
  event_(
      fmt::format("{} (pid {}) {}: killing it, it is restarted like any process that ended", p.name(), p.pid(), why));
  p.fenced = true;
  (void)p.daemon.process->Signal(SIGKILL);
  if (p.stopped) (void)p.daemon.process->Signal(SIGCONT);
}

void Supervisor::Retire(Supervised& p) {
  if (p.state == Supervised::State::kRunning && p.daemon.process->Running()) {
    (void)p.daemon.process->Signal(SIGKILL);
    (void)p.daemon.process->Wait(std::chrono::milliseconds(5000));
  }
  p.state = Supervised::State::kRetired;
}

void Supervisor::Pause(Supervised& p) {
  if (p.state != Supervised::State::kRunning || p.stopped) return;
  if (p.daemon.process->Signal(SIGSTOP).ok()) p.stopped = true;
}

void Supervisor::Resume(Supervised& p) {
  if (!p.stopped) return;
  p.stopped = false;
  if (p.state == Supervised::State::kRunning) (void)p.daemon.process->Signal(SIGCONT);
}

std::string Supervisor::StopAll(
    const std::function<std::string(const Supervised&, const Result<ExitInfo>&)>& describe) {
  // Restarts under way are dropped (their processes are stopped too).
  for (auto& p : processes_) {
    if (p->state == Supervised::State::kStarting) {
      p->daemon = std::move(p->starting->daemon);
      p->starting.reset();
      p->state = Supervised::State::kRunning;
    } else if (p->state == Supervised::State::kWaiting) {
      p->state = Supervised::State::kDown;
    }
    Resume(*p);
  }
  const auto live = [](const Supervised& p) { return p.state == Supervised::State::kRunning; };
  for (size_t i = processes_.size(); i-- > 1;) {
    if (live(*processes_[i])) (void)processes_[i]->daemon.process->Signal(SIGTERM);
  }
  std::string unclean;
  for (size_t i = processes_.size(); i-- > 0;) {
    Supervised& p = *processes_[i];
    if (!live(p)) continue;
    if (i == 0) (void)p.daemon.process->Signal(SIGTERM);
    auto exit = p.daemon.process->Wait(std::chrono::milliseconds(10000));
    if (!exit.ok()) {
      const ExitInfo killed = p.daemon.process->Stop(std::chrono::milliseconds(0));
      unclean += fmt::format("\n  {} did not stop within 10 s ({}); the end of {}:\n{}", p.name(), killed.ToString(),
                             p.daemon.log_file, TailOfFile(p.daemon.log_file, 10));
    } else if (!exit->success()) {
      unclean += "\n  " + describe(p, exit);
    }
    p.state = Supervised::State::kRetired;
  }
  return unclean;
}

Supervised* Supervisor::Find(const std::string& name) {
  for (auto& p : processes_) {
    if (p->name() == name) return p.get();
  }
  return nullptr;
}

std::map<std::string, int> Supervisor::restarts() const {
  std::map<std::string, int> out = {{"coordinator", 0}, {"server", 0}, {"worker", 0}};
  for (const auto& p : processes_) out[ProcessRoleName(p->role)] += p->restarts;
  return out;
}

bool Supervisor::AllUp() const {
  return std::all_of(processes_.begin(), processes_.end(), [](const auto& p) {
    return p->state == Supervised::State::kRunning || p->state == Supervised::State::kRetired;
  });
}

}  // namespace tandem::cli
