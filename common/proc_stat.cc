#include "common/proc_stat.h"

#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace tandem {
namespace {

double BootTime() {
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

}  // namespace

std::optional<ProcStat> ReadProcStat(pid_t pid) {
  std::ifstream file(pid == 0 ? std::string("/proc/self/stat") : "/proc/" + std::to_string(pid) + "/stat");
  const std::string stat((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  // The command name (field 2) may hold spaces: fields are counted after its ')'.
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos || paren + 2 > stat.size()) return std::nullopt;
  std::istringstream fields(stat.substr(paren + 2));
  std::vector<double> f;  // f[0] is field 3 (the state, read as 0); field N is f[N - 3]
  for (std::string s; fields >> s;) f.push_back(std::strtod(s.c_str(), nullptr));
  if (f.size() < 22) return std::nullopt;
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  ProcStat out;
  out.cpu_seconds = (f[11] + f[12]) / ticks;                                // utime, stime
  out.threads = f[17];                                                      // num_threads
  out.start_unix_seconds = BootTime() + f[19] / ticks;                      // starttime
  out.virtual_bytes = f[20];                                                // vsize
  out.resident_bytes = f[21] * static_cast<double>(sysconf(_SC_PAGESIZE));  // rss pages
  return out;
}

}  // namespace tandem
