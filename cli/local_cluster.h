// A whole Tandem training job on this machine: what `tandem run` and
// `tandem bench train` start.
//
// RunLocalTraining starts a coordinator, the parameter servers and the
// workers over K simulated nodes (network namespaces joined by a bridge when
// run as root, loopback otherwise: cli/node_network.h), has the workers train
// the reference model or a user's PyTorch script, follows their progress
// (the JSON lines global rank 0 of the current epoch appends, one per step),
// supervises the processes (cli/supervisor.h: one that ends on its own is
// restarted, one the coordinator declared dead is killed and restarted),
// injects the faults asked for (cli/faults.h; start one more worker at a
// step), and stops everything with SIGTERM once the last step is done, on
// Ctrl-C, or when training cannot go on. It then asks every server how many
// updates it applied.
// (cli/local_cluster_detail.h: a LocalCluster runs these as its Start, Follow and
// Summarise steps.)
//
// Thread safety: one run at a time per process.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "cli/faults.h"
#include "cli/supervisor.h"
#include "common/shutdown.h"
#include "common/status.h"
#include "common/trace.h"
#include "worker/runtime/trainer.h"

namespace tandem::cli {

// A user's PyTorch script trains instead of the reference model: each
// worker runs it (cli/script_workers.h has the contract with the `tandem`
// Python package).
struct ScriptOptions {
  std::string file;               // empty: tandem-worker trains the reference model
  std::vector<std::string> args;  // its arguments (what follows `--` on tandem run's command line)
  std::string python = "/usr/bin/python3";
  std::chrono::milliseconds describe_timeout{120000};  // the run that learns its parameter count
};

struct ClusterOptions {
  int64_t nodes = 2;
  int64_t workers_per_node = 1;
  int64_t servers = 1;
  int64_t pp = 1;                        // pipeline stages (the job's mesh.pp)
  int64_t tp = 1;                        // tensor-parallel ranks (the job's mesh.tp), inside a node
  worker::TrainConfig train;             // steps, mode, data, seed, model, optimizer, ...
  uint64_t partition_bytes = 256 << 10;  // the servers' partition size
  int64_t kill_worker_at = 0;            // SIGKILL one worker for good once this step is done (0: never)
  int64_t add_worker_at = 0;             // start one more worker once this step is done (0: never)
  std::string network = "auto";          // auto | netns | loopback
  std::string backend = "auto";          // the workers' data_plane.backend
  std::string bin_dir;
  std::string work_dir;  // empty: a new /tmp/tandem-run-*
  std::string log_level = "info";
  std::chrono::milliseconds startup_timeout{30000};
  std::chrono::milliseconds timeout{0};  // the whole run (0: none)
  bool progress = true;                  // print the live progress line and events
  bool hold = false;                     // after the last step, keep the cluster up until Ctrl-C / SIGTERM
  bool bind = true;                      // pin each worker to its own share of this machine's CPUs
  ScriptOptions script;                  // script.file set: the workers run this script
  RestartPolicy restart;                 // what the supervisor does with a process that ends on its own
  std::vector<Fault> faults;             // --inject
  std::optional<ChaosSpec> chaos;        // --chaos: faults drawn from a seed (after `faults`)
  trace::Config trace;                   // --trace DIR, --trace-steps: every process started traces into DIR
};

// A fault the run injected, and what came of it.
struct InjectedFault {
  Fault fault;            // fault.step: the step it was planned at
  uint64_t step = 0;      // the step it came at (the first one done after `fault.step` with the cluster whole)
  double at_seconds = 0;  // since the start of the run
  // Seconds from the injection until the coordinator declared the target
  // dead (a slow process: named a straggler or late; the coordinator: the
  // supervisor saw it end), and until the cluster was whole again (every
  // process up and in the active epoch, every partition backed up); -1:
  // not seen (a partition ridden out in the same epoch is never detected).
  double detected_seconds = -1;
  double recovered_seconds = -1;
  std::string detection;  // what was seen, in words
};

struct RunSummary {
  bool completed = false;    // every step done
  bool interrupted = false;  // Ctrl-C / SIGTERM
  std::string failure;       // what went wrong, when not completed
  uint64_t steps = 0;        // steps completed
  double first_loss = 0;
  double last_loss = 0;
  std::vector<double> losses;    // by step, from step 1
  double tokens_per_second = 0;  // over steps 2..N (step 1 includes start-up)
  double step_seconds_median = 0;
  double compute_seconds_median = 0;
  double exposed_fraction = 0;  // sum of exposed communication / sum of step time, steps 2..N
  std::string mode;
  uint32_t world_size = 0;  // workers in the last step's epoch
  uint64_t epochs = 0;      // distinct membership epochs that trained steps
  uint64_t faults = 0;      // faults injected (--kill-worker-at, --inject, --chaos)
  uint64_t workers_added = 0;
  std::optional<uint64_t> server_steps_applied;  // updates applied, when every server agrees
  std::string server_steps_detail;               // per server, when they disagree or could not be asked
  std::string network;                           // "netns" or "loopback"
  // Pipeline parallelism: stages, and each stage's idle fraction over
  // steps 2..N (mean of the per-step fractions) beside the analytic bubble
  // (stages - 1) / (micro-batches + stages - 1).
  // The largest peak resident memory (VmHWM) of a worker that ran to the
  // end, and each one's (by worker name), read just before they stop.
  uint64_t peak_rss_bytes = 0;
  std::map<std::string, uint64_t> worker_peak_rss_bytes;
  // Global rank 0's largest StepResult::parameter_bytes (its copies of the
  // parameters: all of them replicated, its shard and the segments in use
  // sharded), and the placement.
  uint64_t peak_parameter_bytes = 0;
  std::string placement;
  uint32_t pipeline_stages = 1;
  uint32_t tensor_parallel = 1;
  std::string pipeline_schedule;
  std::vector<double> pipeline_idle;
  double analytic_bubble = 0;
  double elapsed_seconds = 0;
  std::string work_dir;
  std::string checkpoint;               // the final checkpoint's directory, when one was written
  std::map<std::string, int> restarts;  // by role: coordinator, server, worker
  uint64_t rollbacks = 0;               // rollbacks to a checkpoint (partitions lost both copies)
  uint64_t steps_redone = 0;            // steps trained again after them
  std::vector<InjectedFault> injected;
  uint64_t chaos_seed = 0;  // with --chaos
  bool chaos = false;
};

// Runs the job; `shutdown` stops it early (the summary says interrupted).
// Errors are for runs that could not start (bad options, a process that
// would not come up); a run that fails midway returns a summary with
// `failure` set.
Result<RunSummary> RunLocalTraining(const ClusterOptions& options, ShutdownSignal& shutdown);

// The summary as a JSON object (the keys `tandem run --summary` documents).
std::string SummaryJson(const RunSummary& summary);

}  // namespace tandem::cli
