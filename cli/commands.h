// The subcommands of the `tandem` command line tool.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/config.h"
#include "common/json.h"
#include "tandem/v1/coordinator.pb.h"

namespace tandem::cli {

// Parses a command's flags: prints --help/--version/--check-config output
// (returns 0) or the error (returns 2); returns -1 when the command should run.
int ParseOrExit(OptionSet& options, int argc, char** argv);

// Helpers for the commands' --json output and statistics (JsonQuote is in
// common/json.h).
// `v` with `precision` significant digits, or null when unset or not finite.
std::string JsonNumber(std::optional<double> v, int precision);
// The median of `v` (0 when empty).
double Median(std::vector<double> v);
// The items of a comma-separated list, empty items left out ("a,,b" -> a, b).
std::vector<std::string> SplitList(const std::string& s);

// tandem run: start a local cluster on this machine (see run_command.cc).
int RunCommand(int argc, char** argv);
// tandem train: the reference model in this process alone.
int TrainCommand(int argc, char** argv);
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
// tandem bench optimizer: the parameter server's optimizer update beside the
// memory bandwidth and torch.optim.
int BenchOptimizerCommand(int argc, char** argv);
// tandem bench ps: parameter-server push and pull goodput beside ucx_perftest.
int BenchPsCommand(int argc, char** argv);
// tandem bench train: tokens/s of each training mode beside one process.
int BenchTrainCommand(int argc, char** argv);
// tandem bench torch: a PyTorch model trained by Tandem beside torch's
// DistributedDataParallel (runs bench/torch_bench.py).
int BenchTorchCommand(int argc, char** argv);
// tandem bench model: the reference model's forward and backward on the CPU,
// a GPU and PyTorch on that GPU.
int BenchModelCommand(int argc, char** argv);
// tandem bench pipeline: measured idle fraction of pipeline stages beside the
// analytic bubble.
int BenchPipelineCommand(int argc, char** argv);
// tandem checkpoint save | restore | verify: the parameter servers'
// checkpoints (verify reads a checkpoint directory offline).
int CheckpointSaveCommand(int argc, char** argv);
int CheckpointRestoreCommand(int argc, char** argv);
int CheckpointVerifyCommand(int argc, char** argv);
// tandem ps stats: every parameter server's statistics.
int PsStatsCommand(int argc, char** argv);
// The text `tandem status` prints.
std::string FormatStatus(const v1::GetStatusResponse& status);

}  // namespace tandem::cli
