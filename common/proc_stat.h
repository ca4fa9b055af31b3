// What /proc says about a process: CPU time, memory, threads, start time.
// Used by the process metrics of every daemon and by the benchmarks, which
// watch the coordinator from outside.
//
// Thread safety: thread-safe.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>

namespace tandem {

struct ProcStat {
  double cpu_seconds = 0;  // user + system
  double resident_bytes = 0;
  double virtual_bytes = 0;
  double threads = 0;
  double start_unix_seconds = 0;  // boot time + start ticks (one-second resolution)
  char state = '?';               // R, S, D, Z (zombie), X (dead), ...
  uint64_t start_ticks = 0;       // start time in clock ticks since boot: with the pid, names one process
};

// `pid` 0 means this process. Empty if the process is gone or /proc is unreadable.
std::optional<ProcStat> ReadProcStat(pid_t pid = 0);

// The most resident memory `pid` (0: this process) has had so far, in bytes
// (VmHWM of /proc/<pid>/status). Empty if the process is gone.
std::optional<uint64_t> ReadPeakResidentBytes(pid_t pid = 0);

// Why process `pid`, started at `start_ticks` (0: unknown), is no longer
// running: "exited", "was killed or exited (zombie)", "exited (the pid now
// belongs to another process)"; empty while it runs. A killed child its
// parent has not reaped yet counts as gone.
std::string ProcessGone(pid_t pid, uint64_t start_ticks);

}  // namespace tandem
