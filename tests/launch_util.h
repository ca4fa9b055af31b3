// Starting Tandem's daemons from build/bin in a test's scratch directory.
#pragma once

#include <string>
#include <vector>

#include "cli/launcher.h"
#include "test_util.h"

namespace tandem::testing {

// Starts build/bin/BINARY as NAME on loopback port 0 with `args`, logs and
// ready file in `dir`, and waits until it serves.
inline Result<cli::LaunchedDaemon> StartDaemon(const std::string& binary, const std::string& name,
                                               const std::string& dir, std::vector<std::string> args = {}) {
  cli::LaunchSpec spec;
  spec.binary = BinDir() + "/" + binary;
  spec.name = name;
  spec.args = std::move(args);
  spec.work_dir = dir;
  return cli::Launch(spec);
}

}  // namespace tandem::testing
