#include "common/cpus.h"

#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

namespace tandem {

std::vector<int> AllowedCpus() {
  std::vector<int> cpus;
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  }
  return cpus;
}

namespace {

Result<int> ParseCpu(std::string_view text, std::string_view part) {
  int value = -1;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec != std::errc() || ptr != end || value < 0) {
    return InvalidArgument("'{}' is not a CPU number or a range like 0-3", part);
  }
  if (value >= CPU_SETSIZE)
    return InvalidArgument("CPU {} in '{}' is above the largest ({})", value, part, CPU_SETSIZE - 1);
  return value;
}

}  // namespace

Result<std::vector<int>> ParseCpuList(std::string_view text) {
  std::vector<int> cpus;
  if (text.empty()) return InvalidArgument("the CPU list is empty");
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string_view part = text.substr(start, comma - start);
    const size_t dash = part.find('-');
    if (dash == std::string_view::npos) {
      TANDEM_ASSIGN_OR_RETURN(int cpu, ParseCpu(part, part));
      cpus.push_back(cpu);
    } else {
      TANDEM_ASSIGN_OR_RETURN(int first, ParseCpu(part.substr(0, dash), part));
      TANDEM_ASSIGN_OR_RETURN(int last, ParseCpu(part.substr(dash + 1), part));
      if (last < first) return InvalidArgument("the range '{}' ends before it starts", part);
      for (int c = first; c <= last; ++c) cpus.push_back(c);
    }
    start = comma + 1;
  }
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  return cpus;
}

std::string FormatCpuList(std::vector<int> cpus) {
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += j == i ? fmt::format("{}", cpus[i]) : fmt::format("{}-{}", cpus[i], cpus[j]);
    i = j + 1;
  }
  return out;
}

std::vector<int> ShareOfCpus(const std::vector<int>& allowed, int index, int count) {
  if (allowed.empty() || count <= 0 || index < 0) return {};
  const size_t n = allowed.size();
  const auto k = static_cast<size_t>(count);
  const auto i = static_cast<size_t>(index % count);
  if (n < k) return {allowed[static_cast<size_t>(index) % n]};
  // The first n % k processes get one CPU more.
  const size_t base = n / k;
  const size_t extra = n % k;
  const size_t begin = i * base + std::min(i, extra);
  const size_t size = base + (i < extra ? 1 : 0);
  return std::vector<int>(allowed.begin() + static_cast<std::ptrdiff_t>(begin),
                          allowed.begin() + static_cast<std::ptrdiff_t>(begin + size));
}

Status BindProcess(const std::vector<int>& cpus) {
  if (cpus.empty()) return InvalidArgument("no CPUs to run on");
  const std::vector<int> allowed = AllowedCpus();
  std::vector<int> missing;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) {
    if (!std::binary_search(allowed.begin(), allowed.end(), c)) missing.push_back(c);
    if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &set);
  }
  if (!missing.empty()) {
    return InvalidArgument("CPU(s) {} are not available to this process (it may use {})", FormatCpuList(missing),
                           FormatCpuList(allowed));
  }
  // Every thread that exists now (twice: a thread that was not pinned yet
  // may have started another meanwhile); threads started later inherit.
  for (int pass = 0; pass < 2; ++pass) {
    std::error_code ec;
    for (const auto& task : std::filesystem::directory_iterator("/proc/self/task", ec)) {
      const std::string name = task.path().filename().string();
      pid_t tid = 0;
      if (std::from_chars(name.data(), name.data() + name.size(), tid).ec != std::errc()) continue;
      if (sched_setaffinity(tid, sizeof(set), &set) != 0 && errno != ESRCH) {
        return Internal("pinning thread {} to CPUs {}: {}", tid, FormatCpuList(cpus), std::strerror(errno));
      }
    }
    if (ec) return Internal("listing this process's threads: {}", ec.message());
  }
  return Status::Ok();
}

}  // namespace tandem
