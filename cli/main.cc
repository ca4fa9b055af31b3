// tandem: the command-line tool of Tandem.
#include <cstdio>
#include <cstring>

#include <fmt/format.h>

#include "cli/commands.h"
#include "cli/trace_merge.h"
#include "tandem/config.h"

namespace {

constexpr const char* kUsage =
    R"(tandem {}: command-line tool of Tandem, the parameter-server plus all-reduce training service

Usage: tandem COMMAND [flags]

Commands:
  run        train the reference model on a local cluster (coordinator, servers, workers over simulated
             nodes), with elastic faults on request ('tandem run --kill-worker-at 20')
  train      train the reference model in this process alone (the single-process reference)
  status     show a job: epoch, members with role, rank, node, step and health, shard map
  drain      take a member out of its job at the next epoch
  scale      change a job's minimum and maximum number of workers
  health     ask a daemon's gRPC health service whether it is serving
  bench      benchmarks: 'tandem bench coordinator' (rendezvous, heartbeats, failure detection);
             'tandem bench allreduce|reducescatter|allgather|broadcast|reduce|sendrecv|barrier --np N'
             (the data plane's collectives between N processes on this machine)
             'tandem bench optimizer' (the parameter server's optimizer update vs memory bandwidth and torch)
             'tandem bench ps' (parameter-server push and pull goodput vs ucx_perftest)
             'tandem bench train' (tokens/s of each training mode and the exposed communication);
             'tandem bench torch' (a PyTorch model trained by Tandem vs DistributedDataParallel);
             'tandem bench model' (the model's forward and backward on the CPU, a GPU and PyTorch);
             'tandem bench pipeline' (idle fraction of pipeline stages vs the analytic bubble)
  checkpoint the parameter servers' checkpoints: 'tandem checkpoint save|restore' (every server of a job's
             active epoch, a consistent cut at one step); 'tandem checkpoint verify PATH' (offline check)
  ps         'tandem ps stats': every parameter server's partitions, step, state, lag and last checkpoint
  trace      'tandem trace merge DIR -o trace.json': join a traced run's files (tandem run --trace DIR) into one
             timeline for Perfetto or chrome://tracing, clocks aligned, pushes linked to their updates
  version    print the version

Run 'tandem COMMAND --help' for a command's flags.
)";

}  // namespace

int main(int argc, char** argv) {
  // Progress lines appear as they happen, also when piped to a file or `tee`.
  setvbuf(stdout, nullptr, _IOLBF, 0);
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0 ||
      std::strcmp(argv[1], "help") == 0) {
    fmt::print(kUsage, TANDEM_VERSION);
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  if (command == "version" || command == "--version") {
    fmt::print("tandem {} ({}{})\n", TANDEM_VERSION, TANDEM_BUILD_TYPE, TANDEM_CUDA_ENABLED ? ", CUDA" : "");
    return 0;
  }
  // Each command parses argv[1..]: its own name stands where the program name would.
  if (command == "run") return tandem::cli::RunCommand(argc - 1, argv + 1);
  if (command == "train") return tandem::cli::TrainCommand(argc - 1, argv + 1);
  if (command == "health") return tandem::cli::HealthCommand(argc - 1, argv + 1);
  if (command == "status") return tandem::cli::StatusCommand(argc - 1, argv + 1);
  if (command == "drain") return tandem::cli::DrainCommand(argc - 1, argv + 1);
  if (command == "scale") return tandem::cli::ScaleCommand(argc - 1, argv + 1);
  if (command == "checkpoint") {
    if (argc >= 3 && std::strcmp(argv[2], "save") == 0) return tandem::cli::CheckpointSaveCommand(argc - 2, argv + 2);
    if (argc >= 3 && std::strcmp(argv[2], "restore") == 0) {
      return tandem::cli::CheckpointRestoreCommand(argc - 2, argv + 2);
    }
    if (argc >= 3 && std::strcmp(argv[2], "verify") == 0) {
      return tandem::cli::CheckpointVerifyCommand(argc - 2, argv + 2);
    }
    const bool help = argc >= 3 && (std::strcmp(argv[2], "--help") == 0 || std::strcmp(argv[2], "-h") == 0);
    fmt::print(help ? stdout : stderr,
               "tandem checkpoint: name a subcommand: save, restore, verify (each takes --help)\n");
    return help ? 0 : 2;
  }
  if (command == "ps") {
    if (argc >= 3 && std::strcmp(argv[2], "stats") == 0) return tandem::cli::PsStatsCommand(argc - 2, argv + 2);
    const bool help = argc >= 3 && (std::strcmp(argv[2], "--help") == 0 || std::strcmp(argv[2], "-h") == 0);
    fmt::print(help ? stdout : stderr, "tandem ps: name a subcommand: stats (it takes --help)\n");
    return help ? 0 : 2;
  }
  if (command == "trace") return tandem::cli::TraceCommand(argc - 1, argv + 1);
  if (command == "bench") {
    if (argc >= 3 && std::strcmp(argv[2], "coordinator") == 0) {
      return tandem::cli::BenchCoordinatorCommand(argc - 2, argv + 2);
    }
    if (argc >= 3 && std::strcmp(argv[2], "optimizer") == 0) {
      return tandem::cli::BenchOptimizerCommand(argc - 2, argv + 2);
    }
    if (argc >= 3 && std::strcmp(argv[2], "ps") == 0) return tandem::cli::BenchPsCommand(argc - 2, argv + 2);
    if (argc >= 3 && std::strcmp(argv[2], "train") == 0) return tandem::cli::BenchTrainCommand(argc - 2, argv + 2);
    if (argc >= 3 && std::strcmp(argv[2], "torch") == 0) return tandem::cli::BenchTorchCommand(argc - 2, argv + 2);
    if (argc >= 3 && std::strcmp(argv[2], "model") == 0) return tandem::cli::BenchModelCommand(argc - 2, argv + 2);
    if (argc >= 3 && std::strcmp(argv[2], "pipeline") == 0) {
      return tandem::cli::BenchPipelineCommand(argc - 2, argv + 2);
    }
    for (const char* c : {"allreduce", "reducescatter", "allgather", "broadcast", "reduce", "sendrecv", "barrier"}) {
      if (argc >= 3 && std::strcmp(argv[2], c) == 0) return tandem::cli::BenchCollectiveCommand(c, argc - 2, argv + 2);
    }
    fmt::print(stderr,
               "tandem bench: name a benchmark: coordinator, optimizer, ps, train, torch, model, pipeline, allreduce, "
               "reducescatter, allgather, broadcast, reduce, sendrecv, barrier\n");
    return 2;
  }
  fmt::print(stderr, "tandem: unknown command '{}' (run tandem --help to list the commands)\n", command);
  return 2;
}
