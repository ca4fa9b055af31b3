// Starting Tandem's daemons from build/bin in a test's scratch directory.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "cli/launcher.h"
#include "test_util.h"

namespace tandem::testing {

// Members started by tests talk over loopback only: UCX would otherwise open
// TCP lanes over every interface of the host, including the bridges and veth
// pairs that tests running beside them create and delete (a lane over an
// interface that goes away breaks the connection, and the peer is taken
// for dead).
inline constexpr char kTestNetDevices[] = "lo";

// Starts build/bin/BINARY as NAME on loopback port 0 with `args` (a server's
// or worker's UCX devices set to kTestNetDevices unless `args` names them),
// logs and ready file in `dir`, and waits until it serves. `prefix` goes
// before the binary (/usr/bin/env and a variable: a failpoint).
inline Result<cli::LaunchedDaemon> StartDaemon(const std::string& binary, const std::string& name,
                                               const std::string& dir, std::vector<std::string> args = {},
                                               std::vector<std::string> prefix = {}) {
  const std::string devices_flag = binary == "tandem-server"   ? "--server-ucx-net-devices"
                                   : binary == "tandem-worker" ? "--data-plane-ucx-net-devices"
                                                               : "";
  if (!devices_flag.empty() && std::find(args.begin(), args.end(), devices_flag) == args.end()) {
    args.insert(args.end(), {devices_flag, kTestNetDevices});
  }
  cli::LaunchSpec spec;
  spec.binary = BinDir() + "/" + binary;
  spec.name = name;
  spec.args = std::move(args);
  spec.work_dir = dir;
  spec.exec_prefix = std::move(prefix);
  return cli::Launch(spec);
}

}  // namespace tandem::testing
