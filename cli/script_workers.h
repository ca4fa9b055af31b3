// `tandem run --script FILE.py [-- ARGS...]`: a user's PyTorch script as the
// workers of a local cluster (RunLocalTraining, cli/local_cluster.h), through
// the Python package `tandem` (python/, docs/pytorch.md).
//
// The contract between the launcher and the script:
//
// - Each worker is `PYTHON -u FILE.py ARGS...` (PYTHON: --python, default
//   /usr/bin/python3), started like a tandem-worker: in its node's network
//   namespace, with its log (stdout and stderr) in WORK_DIR/worker-<i>.log.
// - Its environment has
//     TANDEM_WORKER_FLAGS  a JSON array of strings: exactly the flags
//                          `tandem run` gives a tandem-worker (--name,
//                          --listen-address, --metrics-address, --ready-file,
//                          --coordinator-address, --node-id, data_plane.*,
//                          --cpus, every train.* flag of worker::TrainFlags,
//                          --log-level); tandem.torch.init() starts the worker
//                          daemon from them, which binds the CPUs and writes
//                          the ready file the launcher waits for;
//     PYTHONPATH           BUILD/python (BIN_DIR/../python, where the package
//                          is built) in front of the launcher's own value;
//     PYTHONUNBUFFERED=1;
//   and no TANDEM_DESCRIBE.
// - Before the cluster starts, the script runs once in describe mode, on
//   loopback: TANDEM_DESCRIBE=WORK_DIR/describe.json besides the flags of
//   worker 0 (no --coordinator-address and no --ready-file: no cluster is up
//   yet; --name describe), its output in WORK_DIR/describe.log. Its
//   tandem.torch.DistributedOptimizer writes {"parameters": N, "tensors": T}
//   there and the process exits 0; N is the job's parameter count.
// - Global rank 0 appends worker::ToJson(StepRecord) lines and the final
//   {"finished": true, ...} line to train.progress_file, as the reference
//   trainer does.
//
// The variables are set with /usr/bin/env in front of PYTHON (it execs
// PYTHON, so the PID stays the worker's): a value of the launcher's own
// environment would otherwise shadow them.
//
// Thread safety: thread-compatible functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cli/local_cluster.h"
#include "common/process.h"
#include "common/shutdown.h"
#include "common/status.h"

namespace tandem::cli {

// A command line split at its first "--": the launcher's arguments before it
// (argv[0] included), the script's after it.
struct SplitCommandLine {
  std::vector<std::string> launcher;
  std::vector<std::string> script;
  bool separator = false;  // there was a "--"
};
SplitCommandLine SplitAtSeparator(const std::vector<std::string>& argv);

// Refuses what --script cannot do, naming the option: tp or pp above 1,
// sharded placement, the reference model's own options (train.context,
// d_model, heads, layers, activation_checkpointing, pipeline_schedule) when
// given in `flags` (tandem run's arguments before "--") or away from their
// defaults. Without --script, refuses script arguments (`separator`).
Status CheckScriptOptions(const ClusterOptions& options, const std::vector<std::string>& flags, bool separator);

// Whether the script and PYTHON can be run (before anything starts).
Status CheckScriptFiles(const ScriptOptions& script);

// `flags` as a JSON array of strings (TANDEM_WORKER_FLAGS).
std::string FlagsJson(const std::vector<std::string>& flags);

// BIN_DIR/../python (absolute) in front of `existing` (PYTHONPATH; may be null or empty).
std::string ScriptPythonPath(const std::string& bin_dir, const char* existing);

// The command line of one script process given its worker flags: env (the
// variables above; TANDEM_DESCRIBE=describe_file when not empty) PYTHON -u
// FILE ARGS...
std::vector<std::string> ScriptCommand(const ScriptOptions& script, const std::string& bin_dir,
                                       const std::vector<std::string>& flags, const std::string& describe_file = "");

// What the describe run says about the script's model.
struct ScriptModel {
  uint64_t parameters = 0;
  uint64_t tensors = 0;
};
// Runs the script in describe mode with `flags` (those of worker 0, on
// loopback) and reads its description. Errors quote the end of its log;
// CANCELLED when `shutdown` is requested meanwhile.
Result<ScriptModel> DescribeScript(const ScriptOptions& script, const std::string& bin_dir,
                                   const std::vector<std::string>& flags, const std::string& work_dir,
                                   ShutdownSignal& shutdown);

}  // namespace tandem::cli
