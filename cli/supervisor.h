// The supervisor of `tandem run`: keeps the cluster's processes running the
// way Kubernetes keeps a StatefulSet's pods running with restartPolicy:
// Always. A process that ends on its own (a signal, a crash, an exit) is
// started again with the same name, flags and node after a delay that
// doubles with each of its restarts (--restart-delay, at most 60 s), at most
// --restarts times; after that it stays down (and so does one that exits
// with kExitCannotGoOn, common/daemon.h: the job cannot go on). The
// restarted process gets a
// new incarnation (its start time), so the coordinator replaces the old one
// at once. A process that the coordinator declared dead while it still runs
// (SIGSTOPped, wedged, cut off) is killed (Fence) and so restarted too.
//
// Restarts do not block: Poll starts them and checks on them, and the
// caller goes on following the training meanwhile.
//
// Thread safety: not thread-safe (the run's one thread uses it).
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cli/launcher.h"
#include "common/status.h"

namespace tandem::cli {

enum class ProcessRole { kCoordinator, kServer, kWorker };

// "coordinator", "server", "worker".
const char* ProcessRoleName(ProcessRole role);

struct RestartPolicy {
  int64_t restarts = 3;                   // per process
  std::chrono::milliseconds delay{1000};  // before its first restart; doubles with each
  std::chrono::milliseconds max_delay{60000};
};

// One process of the cluster.
struct Supervised {
  enum class State {
    kRunning,   // serving (or it ended and Poll has not seen it yet)
    kWaiting,   // ended; restarts at restart_at
    kStarting,  // restarted, not serving yet
    kDown,      // ended with no restarts left, or failed to start again
    kRetired,   // stopped on purpose for good (--kill-worker-at), or done
  };
  LaunchSpec spec;  // how to start it again
  ProcessRole role = ProcessRole::kWorker;
  int node = -1;          // the simulated node it runs on (-1: the host)
  LaunchedDaemon daemon;  // the current (or last) incarnation
  std::optional<StartingDaemon> starting;
  State state = State::kRunning;
  int restarts = 0;
  std::chrono::steady_clock::time_point restart_at{};
  std::chrono::steady_clock::time_point ended_at{};
  std::string last_end;  // how the last incarnation ended ("was killed by SIGKILL")
  bool fenced = false;   // the supervisor killed it: the coordinator had declared it dead
  bool stopped = false;  // SIGSTOPped on purpose (a fault), not continued yet
  bool final = false;    // it exited with kExitCannotGoOn: not restarted

  const std::string& name() const { return daemon.name; }
  int pid() const { return daemon.process ? daemon.process->pid() : 0; }
  bool up() const { return state == State::kRunning; }
};

class Supervisor {
 public:
  // `event` gets one line per thing worth telling (a process ended, is
  // restarted, is up again, is given up on).
  Supervisor(RestartPolicy policy, std::function<void(const std::string&)> event);
  ~Supervisor();
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  // Starts a process (on simulated node `node`, -1: the host) and waits
  // until it serves.
  Status Launch(LaunchSpec spec, ProcessRole role, int node);

  // Looks at every process: one that ended is restarted after its delay,
  // or given up on when it has no restarts left; a restart under way is
  // checked on. `restartable(process, how it ended)` may veto a restart
  // (the training is over): the process is then retired.
  void Poll(const std::function<bool(const Supervised&, const Result<ExitInfo>&)>& restartable);

  // Kills a running process because the coordinator declared it dead: it is
  // restarted like any process that ended.
  void Fence(Supervised& process, const std::string& why);

  // Stops a process for good (SIGKILL), with no restart: --kill-worker-at.
  void Retire(Supervised& process);

  // SIGSTOP / SIGCONT, remembering which processes are stopped (a stopped
  // process is continued before it is stopped for good or killed).
  void Pause(Supervised& process);
  void Resume(Supervised& process);

  // Workers and servers at once, the coordinator last; what did not stop
  // cleanly, one "\n  NAME ..." per process ("" if all did). `describe`
  // words an unclean end.
  std::string StopAll(const std::function<std::string(const Supervised&, const Result<ExitInfo>&)>& describe);

  std::vector<std::unique_ptr<Supervised>>& processes() { return processes_; }
  Supervised* Find(const std::string& name);
  // Restarts so far, by role name.
  std::map<std::string, int> restarts() const;
  // Whether every process that is not retired is up.
  bool AllUp() const;

 private:
  void Ended(Supervised& p, const Result<ExitInfo>& exit);
  void Restart(Supervised& p);

  RestartPolicy policy_;
  std::function<void(const std::string&)> event_;
  std::vector<std::unique_ptr<Supervised>> processes_;
};

}  // namespace tandem::cli
