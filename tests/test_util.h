// Helpers shared by Tandem's tests: where the binaries are, scratch
// directories, and running a command to completion with a time bound.
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/process.h"

namespace tandem::testing {

// build/bin, where the daemons and the `tandem` command are.
inline std::string BinDir() {
  const char* dir = std::getenv("TANDEM_BIN_DIR");
  return dir != nullptr ? dir : TANDEM_TEST_BIN_DIR;
}

inline std::string SourceDir() {
  const char* dir = std::getenv("TANDEM_SOURCE_DIR");
  return dir != nullptr ? dir : TANDEM_TEST_SOURCE_DIR;
}

// A fresh directory under /tmp, removed with everything in it at the end
// (kept when TANDEM_TEST_KEEP_DIRS is set, to read the logs of a failure).
class TempDir {
 public:
  TempDir() {
    std::string tmpl = "/tmp/tandem-test-XXXXXX";
    path_ = mkdtemp(tmpl.data()) != nullptr ? tmpl : "";
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty() && std::getenv("TANDEM_TEST_KEEP_DIRS") == nullptr) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string File(const std::string& name, const std::string& contents = "") const {
    const std::string p = path_ + "/" + name;
    if (!contents.empty()) std::ofstream(p) << contents;
    return p;
  }

 private:
  std::string path_;
};

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

struct CommandResult {
  ExitInfo exit;
  std::string output;  // stdout and stderr together
};

// Runs argv to completion (killing it after `timeout`) and returns its exit and output.
inline CommandResult RunCommand(const std::vector<std::string>& argv,
                                std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  TempDir dir;
  SpawnOptions options;
  options.argv = argv;
  options.output_file = dir.path() + "/output";
  auto process = Subprocess::Spawn(options);
  if (!process.ok()) return {ExitInfo{true, 127, 0}, process.status().ToString()};
  auto exit = (*process)->Wait(timeout);
  CommandResult result;
  result.exit = exit.ok() ? *exit : (*process)->Stop(std::chrono::milliseconds(0));
  if (!exit.ok()) result.output = "[timed out] ";
  result.output += ReadFile(options.output_file);
  return result;
}

// True if no process remains in process group `pgid` (the daemons are
// started as group leaders, so this covers anything they started).
inline bool ProcessGroupGone(pid_t pgid) {
  return kill(-pgid, 0) != 0 && errno == ESRCH;
}

}  // namespace tandem::testing
