#include "cli/launcher.h"

#include <unistd.h>

#include <algorithm>
#include <deque>
#include <filesystem>
#include <fstream>
#include <string_view>
#include <thread>

#include <fmt/ranges.h>
#include <yaml-cpp/yaml.h>

namespace tandem::cli {

Result<ReadyInfo> ReadReadyFile(const std::string& path) {
  try {
    const YAML::Node node = YAML::LoadFile(path);  // the ready file is JSON, which YAML reads
    ReadyInfo info;
    info.name = node["name"].as<std::string>();
    info.role = node["role"].as<std::string>();
    info.pid = node["pid"].as<int>();
    info.grpc_address = node["grpc_address"].as<std::string>();
    info.metrics_address = node["metrics_address"].as<std::string>();
    return info;
  } catch (const YAML::Exception& e) {
    return InvalidArgument("ready file '{}' is not valid: {}", path, e.what());
  }
}

std::string TailOfFile(const std::string& path, int lines) {
  std::ifstream in(path);
  std::deque<std::string> tail;
  for (std::string line; std::getline(in, line);) {
    tail.push_back(line);
    if (static_cast<int>(tail.size()) > lines) tail.pop_front();
  }
  std::string out;
  for (const auto& l : tail) out += "    | " + l + "\n";
  return out;
}

LogTail TailOfLog(const std::string& path, int lines) {
  // The last few thousand lines are plenty for a traceback and keep a long
  // log's memory bounded.
  constexpr size_t kKeep = 4000;
  constexpr std::string_view kTraceback = "Traceback (most recent call last):";
  std::ifstream in(path);
  std::deque<std::string> all;
  for (std::string line; std::getline(in, line);) {
    all.push_back(std::move(line));
    if (all.size() > kKeep) all.pop_front();
  }
  LogTail tail;
  const auto quote = [&](size_t from, size_t to) {
    for (size_t i = from; i < to; ++i) tail.text += "    | " + all[i] + "\n";
  };
  size_t start = all.size();
  for (size_t i = all.size(); i-- > 0;) {
    if (all[i].rfind(kTraceback, 0) == 0) {
      start = i;
      break;
    }
  }
  if (start == all.size()) {  // no traceback
    quote(all.size() - std::min(all.size(), static_cast<size_t>(std::max(lines, 0))), all.size());
    return tail;
  }
  // The exception line is the first one after the indented frames.
  size_t exception = start + 1;
  while (exception < all.size() && (all[exception].empty() || all[exception][0] == ' ')) ++exception;
  if (exception < all.size()) tail.exception = all[exception];
  // A deep stack is cut in the middle: its innermost frames stay.
  constexpr size_t kFrames = 40;
  const size_t end = std::min(all.size(), exception + 6);
  if (exception > start + kFrames) {
    quote(start, start + 1);
    tail.text += "    | ...\n";
    quote(exception - kFrames, end);
  } else {
    quote(start, end);
  }
  return tail;
}

std::string DescribeExit(const ExitInfo& exit) {
  return exit.exited ? fmt::format("exited with status {}", exit.code) : "was " + exit.ToString();
}

std::string ExecutableDir() {
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : exe.parent_path().string();
}

Result<StartingDaemon> StartDaemon(const LaunchSpec& spec) {
  StartingDaemon s;
  LaunchedDaemon& d = s.daemon;
  d.name = spec.name;
  d.log_file = spec.work_dir + "/" + spec.name + ".log";
  s.ready_file = spec.work_dir + "/" + spec.name + ".ready.json";
  std::remove(s.ready_file.c_str());
  // host:port, an IPv6 host in brackets.
  const std::string host =
      spec.listen_host.find(':') != std::string::npos ? "[" + spec.listen_host + "]" : spec.listen_host;
  std::vector<std::string> flags = {
      "--name",    spec.name,      "--listen-address", fmt::format("{}:{}", host, spec.grpc_port), "--metrics-address",
      host + ":0", "--ready-file", s.ready_file};
  flags.insert(flags.end(), spec.args.begin(), spec.args.end());
  SpawnOptions options;
  options.argv = spec.exec_prefix;
  if (spec.command) {
    const std::vector<std::string> command = spec.command(flags);
    options.argv.insert(options.argv.end(), command.begin(), command.end());
  } else {
    options.argv.push_back(spec.binary);
    options.argv.insert(options.argv.end(), flags.begin(), flags.end());
  }
  options.output_file = d.log_file;
  TANDEM_ASSIGN_OR_RETURN(d.process, Subprocess::Spawn(options));
  s.exec_prefix = spec.exec_prefix;
  s.startup_timeout = spec.startup_timeout;
  s.deadline = std::chrono::steady_clock::now() + spec.startup_timeout;
  return s;
}

Result<bool> CheckStarted(StartingDaemon& s) {
  LaunchedDaemon& d = s.daemon;
  if (access(s.ready_file.c_str(), R_OK) == 0) {
    auto ready = ReadReadyFile(s.ready_file);
    if (!ready.ok()) return ready.status();
    d.ready = *ready;
    // A prefix that forked would leave d.process a wrapper that signals cannot stop cleanly.
    if (!s.exec_prefix.empty() && d.ready.pid != d.process->pid()) {
      return FailedPrecondition(
          "{} reports PID {} but was started as PID {}: the exec prefix '{}' must exec the "
          "daemon, not fork it",
          d.name, d.ready.pid, d.process->pid(), fmt::join(s.exec_prefix, " "));
    }
    return true;
  }
  if (!d.process->Running()) {
    auto exit = d.process->Wait(std::chrono::milliseconds(0));
    const LogTail tail = TailOfLog(d.log_file, 15);
    return Unavailable("{} {} during start-up{}; the end of {}:\n{}", d.name, exit.ok() ? DescribeExit(*exit) : "ended",
                       tail.exception.empty() ? "" : ": " + tail.exception, d.log_file, tail.text);
  }
  if (std::chrono::steady_clock::now() > s.deadline) {
    return DeadlineExceeded("{} did not start serving within {} ms; the end of {}:\n{}", d.name,
                            s.startup_timeout.count(), d.log_file, TailOfFile(d.log_file, 15));
  }
  return false;
}

Result<LaunchedDaemon> Launch(const LaunchSpec& spec) {
  TANDEM_ASSIGN_OR_RETURN(StartingDaemon s, StartDaemon(spec));
  while (true) {
    TANDEM_ASSIGN_OR_RETURN(const bool started, CheckStarted(s));
    if (started) return std::move(s.daemon);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace tandem::cli
