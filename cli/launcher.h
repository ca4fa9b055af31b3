// Starting Tandem daemons as child processes and waiting until they serve:
// used by `tandem run` and by the multi-process tests.
//
// A daemon is started with --ready-file; it writes that file (JSON) once its
// gRPC and metrics endpoints are up, with the addresses it actually bound, so
// daemons can listen on port 0 and launchers learn the ports without races.
//
// Thread safety: not thread-safe.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/grpc_util.h"
#include "common/process.h"
#include "common/status.h"

namespace tandem::cli {

struct ReadyInfo {
  std::string name;
  std::string role;
  int pid = 0;
  std::string grpc_address;
  std::string metrics_address;
};

Result<ReadyInfo> ReadReadyFile(const std::string& path);

struct LaunchSpec {
  std::string binary;             // path of tandem-coordinator, tandem-server or tandem-worker
  std::string name;               // instance name ("server-0")
  std::vector<std::string> args;  // extra flags
  std::string work_dir;           // log and ready files go here
  std::chrono::milliseconds startup_timeout{20000};
  // The IP the daemon listens on, port 0, for gRPC and metrics (a simulated
  // node's address: cli/node_network.h).
  std::string listen_host = "127.0.0.1";
  // The gRPC port (0: any free one, learnt from the ready file). A restarted
  // coordinator takes its old port again, since every member knows it by it.
  int grpc_port = 0;
  // Put in front of the daemon's command line, e.g. {"/usr/sbin/ip", "netns",
  // "exec", "tnd1234n0"}; it must exec the daemon in the same process (the
  // PID must be the daemon's: Launch checks the ready file's against it).
  std::vector<std::string> exec_prefix;
  // The command line that runs the daemon given its flags (--name,
  // --listen-address, --metrics-address, --ready-file, then `args`); unset:
  // `binary` followed by them. A Python script takes its flags from its
  // environment instead (cli/script_workers.h). It must exec the daemon too.
  std::function<std::vector<std::string>(const std::vector<std::string>& flags)> command;
};

struct LaunchedDaemon {
  std::string name;
  std::string log_file;
  std::unique_ptr<Subprocess> process;
  ReadyInfo ready;
};

// Starts exec_prefix + binary + flags + args (or exec_prefix + command(flags
// + args)), the daemon listening on listen_host port grpc_port for gRPC and
// port 0 for metrics, and waits for its ready file. If it exits or times out
// first, the error quotes the end of its log (a Python traceback in it).
Result<LaunchedDaemon> Launch(const LaunchSpec& spec);

// Launch in two halves, for a caller that goes on with other work while a
// daemon starts (the supervisor of `tandem run` restarting one): StartDaemon
// spawns it, CheckStarted says whether it serves yet (then `daemon.ready` is
// filled in), or why it never will.
struct StartingDaemon {
  LaunchedDaemon daemon;
  std::string ready_file;
  std::vector<std::string> exec_prefix;
  std::chrono::steady_clock::time_point deadline;
  std::chrono::milliseconds startup_timeout{0};
};
Result<StartingDaemon> StartDaemon(const LaunchSpec& spec);
Result<bool> CheckStarted(StartingDaemon& starting);

// The last `lines` lines of a file (for error messages).
std::string TailOfFile(const std::string& path, int lines);

// The end of a process's log for an error message: its last `lines` lines,
// or, when it holds a Python traceback, the last traceback (up to its
// exception line and a few lines after it), whose exception line ("ValueError:
// bad value") is `exception`.
struct LogTail {
  std::string text;       // lines prefixed with "    | ", each ending in a newline
  std::string exception;  // empty without a traceback
};
LogTail TailOfLog(const std::string& path, int lines);

// "exited with status 1", "was killed by SIGKILL".
std::string DescribeExit(const ExitInfo& exit);

// The directory holding the running executable (where the daemons are installed next to `tandem`).
std::string ExecutableDir();

}  // namespace tandem::cli
