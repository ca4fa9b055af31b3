// The subcommands of the `tandem` command line tool.
#pragma once

namespace tandem::cli {

// tandem run: start a local cluster on this machine (see run_command.cc).
int RunCommand(int argc, char** argv);
// tandem health ADDRESS: ask a daemon's gRPC health service.
int HealthCommand(int argc, char** argv);

}  // namespace tandem::cli
