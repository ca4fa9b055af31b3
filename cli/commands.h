// The subcommands of the `tandem` command line tool.
#pragma once

#include <string>

#include "common/config.h"
#include "tandem/v1/coordinator.pb.h"

namespace tandem::cli {

// Parses a command's flags: prints --help/--version/--check-config output
// (returns 0) or the error (returns 2); returns -1 when the command should run.
int ParseOrExit(OptionSet& options, int argc, char** argv);

// tandem run: start a local cluster on this machine (see run_command.cc).
int RunCommand(int argc, char** argv);
// tandem health ADDRESS: ask a daemon's gRPC health service.
int HealthCommand(int argc, char** argv);
// tandem status | drain | scale: the coordinator's admin API.
int StatusCommand(int argc, char** argv);
int DrainCommand(int argc, char** argv);
int ScaleCommand(int argc, char** argv);
// tandem bench coordinator: simulated members against a real coordinator.
int BenchCoordinatorCommand(int argc, char** argv);
// tandem bench allreduce | reducescatter | allgather | broadcast | reduce |
// sendrecv | barrier: the data plane's collectives between processes.
int BenchCollectiveCommand(const std::string& collective, int argc, char** argv);
// The text `tandem status` prints.
std::string FormatStatus(const v1::GetStatusResponse& status);

}  // namespace tandem::cli
