// Starting Tandem's daemons from build/bin in a test's scratch directory.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "cli/launcher.h"
#include "test_util.h"

namespace tandem::testing {

// Starts build/bin/BINARY as NAME on loopback port 0 with `args`, logs and
// ready file in `dir`, and waits until it serves.
// Members started by tests talk over loopback only: UCX would otherwise open
// TCP lanes over every interface of the host, including the bridges and veth
// pairs that tests running beside them create and delete (a lane over an
// interface that goes away breaks the connection, and the peer is taken
// for dead).
inline constexpr char kTestNetDevices[] = "lo";

inline Result<cli::LaunchedDaemon> StartDaemon(const std::string& binary, const std::string& name,
                                               const std::string& dir, std::vector<std::string> args = {}) {
  const auto has = [&](const std::string& flag) { return std::find(args.begin(), args.end(), flag) != args.end(); };
  for (const char* flag : {"--server-ucx-net-devices", "--data-plane-ucx-net-devices"}) {
    const bool belongs =
        std::string(flag) == "--server-ucx-net-devices" ? binary == "tandem-server" : binary == "tandem-worker";
    if (belongs && !has(flag)) args.insert(args.end(), {flag, kTestNetDevices});
  }
  cli::LaunchSpec spec;
  spec.binary = BinDir() + "/" + binary;
  spec.name = name;
  spec.args = std::move(args);
  spec.work_dir = dir;
  return cli::Launch(spec);
}

}  // namespace tandem::testing
