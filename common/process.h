// Child processes, for launchers (`tandem run`) and multi-process tests.
//
// A Subprocess owns its child: the destructor kills it (SIGKILL, by PID, and
// its process group when it leads one) and reaps it if it is still running,
// so no test or launcher leaves processes behind. Children also get SIGKILL if the parent dies (PR_SET_PDEATHSIG).
//
// Thread safety: not thread-safe; use one Subprocess from one thread.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace tandem {

struct SpawnOptions {
  std::vector<std::string> argv;       // argv[0] is the program path
  std::vector<std::string> extra_env;  // KEY=VALUE added to this process's environment
  std::string output_file;             // stdout and stderr go here (appended); empty: inherited
  bool new_process_group = true;       // so a terminal's Ctrl-C reaches only the launcher
};

struct ExitInfo {
  bool exited = false;  // exited normally (code valid); otherwise killed by `signal`
  int code = 0;
  int signal = 0;
  bool success() const { return exited && code == 0; }
  std::string ToString() const;  // "exit 0", "killed by SIGKILL"
};

class Subprocess {
 public:
  static Result<std::unique_ptr<Subprocess>> Spawn(const SpawnOptions& options);
  ~Subprocess();
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  pid_t pid() const { return pid_; }
  // True while the child has not been reaped.
  bool Running();
  // Sends `sig`; FailedPrecondition if the child was already reaped.
  Status Signal(int sig);
  // Waits up to `timeout` for the child to exit and reaps it.
  Result<ExitInfo> Wait(std::chrono::milliseconds timeout);
  // SIGTERM, wait up to `grace`, then SIGKILL (to the group). Returns how it ended.
  ExitInfo Stop(std::chrono::milliseconds grace);

 private:
  Subprocess(pid_t pid, bool own_group) : pid_(pid), own_group_(own_group) {}
  bool Reap(bool block);
  void KillHard();  // SIGKILL to the child and, if it leads one, its process group

  pid_t pid_;
  bool own_group_;
  bool reaped_ = false;
  ExitInfo exit_;
};

}  // namespace tandem
