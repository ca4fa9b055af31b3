// What /proc says about a process: CPU time, memory, threads, start time.
// Used by the process metrics of every daemon and by the benchmarks, which
// watch the coordinator from outside.
//
// Thread safety: thread-safe.
#pragma once

#include <sys/types.h>

#include <optional>

namespace tandem {

struct ProcStat {
  double cpu_seconds = 0;  // user + system
  double resident_bytes = 0;
  double virtual_bytes = 0;
  double threads = 0;
  double start_unix_seconds = 0;  // boot time + start ticks (one-second resolution)
};

// `pid` 0 means this process. Empty if the process is gone or /proc is unreadable.
std::optional<ProcStat> ReadProcStat(pid_t pid = 0);

}  // namespace tandem
