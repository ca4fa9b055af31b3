#include "common/proc_stat.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace tandem {
namespace {

double ReadBootTime() {
  std::ifstream proc_stat("/proc/stat");
  for (std::string key; proc_stat >> key;) {
    if (key == "btime") {
      double boot = 0;
      proc_stat >> boot;
      return boot;
    }
  }
  return 0;
}

double BootTime() {
  static const double boot = ReadBootTime();
  return boot;
}

// A whole /proc file, or nothing when it cannot be read. With plain reads:
// the process may exit between the open and the read, which then fails with
// ESRCH, and a stream buffer read through iterators throws on that.
std::optional<std::string> ReadProcFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::string out;
  char buf[4096];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      out.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    ::close(fd);
    if (n < 0) return std::nullopt;
    return out;
  }
}

}  // namespace

std::optional<uint64_t> ReadPeakResidentBytes(pid_t pid) {
  std::ifstream file(pid == 0 ? std::string("/proc/self/status") : "/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(file, line);) {
    if (!line.starts_with("VmHWM:")) continue;
    std::istringstream fields(line.substr(6));
    uint64_t kib = 0;
    if (fields >> kib) return kib * 1024;  // the kernel writes "VmHWM:   1234 kB"
  }
  return std::nullopt;
}

std::optional<ProcStat> ReadProcStat(pid_t pid) {
  const auto read = ReadProcFile(pid == 0 ? std::string("/proc/self/stat") : "/proc/" + std::to_string(pid) + "/stat");
  if (!read) return std::nullopt;
  const std::string& stat = *read;
  // The command name (field 2) may hold spaces: fields are counted after its ')'.
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos || paren + 2 > stat.size()) return std::nullopt;
  std::istringstream fields(stat.substr(paren + 2));
  std::vector<double> f;  // f[0] is field 3 (the state, read as 0); field N is f[N - 3]
  std::string state;
  for (std::string s; fields >> s;) {
    if (f.empty()) state = s;
    f.push_back(std::strtod(s.c_str(), nullptr));
  }
  if (f.size() < 22) return std::nullopt;
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  ProcStat out;
  out.cpu_seconds = (f[11] + f[12]) / ticks;                                // utime, stime
  out.threads = f[17];                                                      // num_threads
  out.start_unix_seconds = BootTime() + f[19] / ticks;                      // starttime
  out.virtual_bytes = f[20];                                                // vsize
  out.resident_bytes = f[21] * static_cast<double>(sysconf(_SC_PAGESIZE));  // rss pages
  out.state = state.empty() ? '?' : state[0];
  out.start_ticks = static_cast<uint64_t>(f[19]);  // exact: start ticks fit a double's 53 bits
  return out;
}

std::string ProcessGone(pid_t pid, uint64_t start_ticks) {
  const auto stat = ReadProcStat(pid);
  if (!stat) {
    if (kill(pid, 0) == 0 || errno == EPERM) return "";  // alive, /proc unreadable
    return "exited";
  }
  if (stat->state == 'Z' || stat->state == 'X') return "was killed or exited (zombie)";
  if (start_ticks != 0 && stat->start_ticks != start_ticks) return "exited (the pid now belongs to another process)";
  return "";
}

}  // namespace tandem
