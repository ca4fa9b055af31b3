// tandem run: the main job. Starts a coordinator, parameter servers and
// workers over simulated nodes on this machine, trains the reference model
// (or, with --script, a user's PyTorch script: cli/script_workers.h) with a
// live progress line, and stops everything cleanly at the end, on Ctrl-C or
// on a failure (cli/local_cluster.h). --summary writes the result as JSON.
#include <filesystem>
#include <fstream>

#include "cli/commands.h"
#include "cli/launcher.h"
#include "cli/local_cluster.h"
#include "cli/script_workers.h"
#include "common/config.h"
#include "common/logging.h"
#include "common/shutdown.h"
#include "common/trace.h"

namespace tandem::cli {

int RunCommand(int argc, char** argv) {
  ShutdownSignal shutdown;  // before any thread: Ctrl-C stops the cluster cleanly
  ClusterOptions o;
  o.bin_dir = ExecutableDir();
  o.train.steps = 50;
  std::string summary_file;
  OptionSet options("tandem run",
                    "train the reference model, or a PyTorch script, on a local Tandem cluster (coordinator, servers, "
                    "workers over simulated nodes)");
  options.EnableConfigFile();
  options.Int("nodes", &o.nodes, "simulated nodes", 1, 253);
  options.Int("workers_per_node", &o.workers_per_node, "workers on each node", 1, 64);
  options.Int("servers", &o.servers, "parameter-server processes (none in allreduce mode)", 0, 64);
  options.Int("pp", &o.pp,
              "pipeline stages: the model is split into this many stages over the workers (rank order: a stage's "
              "workers are contiguous, so whole nodes hold one stage when the stage size is a multiple of "
              "--workers-per-node); train.accumulation micro-batches flow through them",
              1, 64);
  options.Int("tp", &o.tp,
              "tensor-parallel ranks: each block's layers are split over this many workers of one node (Megatron "
              "style: column- and row-parallel layers, attention heads and the vocabulary split); must divide "
              "--workers-per-node, the attention heads and the vocabulary",
              1, 64);
  options.Choice("mode", &o.train.mode, worker::TrainingModeNames(),
                 "hybrid (node reduce-scatter, servers, node all-gather), allreduce (no servers), ps (every worker "
                 "pushes to the servers)");
  options.Choice("placement", &o.train.placement, {"replicated", "sharded"},
                 "where workers keep the parameters: all of them (replicated), or each worker of a node only its "
                 "share, gathered per layer on demand (sharded, ZeRO-3; hybrid mode)");
  options.Int("steps", &o.train.steps, "training steps", 1, int64_t{1} << 40);
  options.String("data", &o.train.data, "text file to train on (default: the built-in corpus)");
  options.Int("seed", &o.train.seed, "seed of the model's initialisation and of the data order", 0, INT64_MAX);
  options.String("summary", &summary_file, "write the run's summary here as JSON");
  options.Int("kill_worker_at", &o.kill_worker_at,
              "kill one worker with SIGKILL for good (it is not restarted) once this step is done (0: never)", 0,
              int64_t{1} << 40);
  options.Int("restarts", &o.restart.restarts,
              "how many times the supervisor restarts each process that ends on its own (a worker, a server or the "
              "coordinator killed, crashed, or declared dead by the coordinator); the run fails when one ends with "
              "none left",
              0, 1000);
  options.Duration("restart_delay", &o.restart.delay,
                   "how long after a process ended it is restarted; doubles with each of its restarts (at most 60 s)",
                   std::chrono::milliseconds(0), std::chrono::minutes(10));
  std::string inject, chaos;
  options.String("inject", &inject,
                 "failures to inject, comma-separated KIND:TARGET@STEP[/DURATION]: kill:worker-1@20 (SIGKILL), "
                 "stop:server-0@30 (SIGSTOP: hangs), partition:node-1@40/4s (the node's link down; network "
                 "namespaces only), slow:worker-0@50/5s (runs at a quarter of its speed); TARGET is worker-K, "
                 "server-K or coordinator (kill only), a node for partition; each comes once its step is done and "
                 "the cluster has recovered from the one before; kill:servers@STEP kills every server at once (both "
                 "copies of every partition lost: a rollback to the latest checkpoint) (docs/failures.md)");
  options.String("chaos", &chaos,
                 "SEED[:N]: a chaos drill of N (default 3) failures of random kinds, processes and steps drawn from "
                 "SEED, only those the job is promised to survive; the seed is printed so a run can be replayed");
  options.Int("add_worker_at", &o.add_worker_at, "start one more worker once this step is done (0: never)", 0,
              int64_t{1} << 40);
  options.Bytes("partition_size", &o.partition_bytes, "size of one parameter-server partition", 4096, 1ull << 32);
  options.Choice("network", &o.network, {"auto", "netns", "loopback"},
                 "simulated nodes as network namespaces (auto: when root), or all on loopback");
  options.Choice("backend", &o.backend, {"auto", "shm", "ucx"},
                 "the workers' communicator backend (auto: shared memory within a node, UCX across nodes)");
  options.String("bin_dir", &o.bin_dir, "where tandem-coordinator, tandem-server and tandem-worker are");
  options.String("work_dir", &o.work_dir, "where logs and progress go (default: a new /tmp/tandem-run-*)");
  options.Bool("bind", &o.bind,
               "pin each worker to its own share of this machine's CPUs, as MPI launchers bind ranks (servers and the "
               "coordinator are not pinned)");
  options.Bool("hold", &o.hold, "after the last step, keep the cluster up until Ctrl-C (to look at its metrics)");
  options.Duration("startup_timeout", &o.startup_timeout, "how long each process may take to start",
                   std::chrono::milliseconds(100), std::chrono::milliseconds(600000));
  options.Duration("timeout", &o.timeout, "give up when the whole run takes longer (0s: never)",
                   std::chrono::milliseconds(0), std::chrono::hours(24 * 365));
  options.Choice("log.level", &o.log_level, LogLevels(), "log level of the started processes");
  options.String("script", &o.script.file,
                 "train this PyTorch script instead of the reference model: every worker runs it (data parallelism "
                 "through the tandem Python package; arguments after -- go to it)");
  options.String("python", &o.script.python, "the Python that runs --script (one whose torch imports)");
  options.Duration("describe_timeout", &o.script.describe_timeout,
                   "how long --script may take to create its tandem.torch.DistributedOptimizer in describe mode",
                   std::chrono::milliseconds(1000), std::chrono::hours(24));
  options.String("trace", &o.trace.dir,
                 "write a timeline trace of every process into this directory (one file per process; join them "
                 "with `tandem trace merge DIR -o trace.json` and open that in Perfetto)");
  options.String("trace_steps", &o.trace.steps,
                 "with --trace: the steps traced, A:B (both included), A: (from A on), :B or S (default: every step)");
  options.AddCheck([&o]() -> Status {
    auto range = trace::ParseStepRange(o.trace.steps);
    return range.ok() ? Status::Ok() : range.status();
  });
  worker::DeclareTrainOptions(options, &o.train, /*job_keys=*/false);
  options.SetEpilog(
      "The model, optimizer and communication options (train.*) are the workers' own; see tandem-worker --help.\n"
      "The summary has the keys steps, first_loss, last_loss, tokens_per_second, mode, world_size, epochs,\n"
      "faults, server_steps_applied, peak_rss_bytes (the largest worker's peak resident memory),\n"
      "worker_peak_rss_bytes, peak_parameter_bytes, placement, tensor_parallel, checkpoint (the last one), and\n"
      "with --pp pipeline_stages, pipeline_idle and analytic_bubble\n"
      "(docs/training.md).\n"
      "\n"
      "tandem run --script FILE.py [flags] [-- ARGS...] trains a PyTorch script: each worker is\n"
      "`PYTHON -u FILE.py ARGS...` (--python, default /usr/bin/python3), everything after -- being the\n"
      "script's argv; the script joins the cluster with tandem.torch.init() and trains data-parallel with\n"
      "tandem.torch.DistributedOptimizer. It runs once first in describe mode to learn its parameter count.\n"
      "--steps, --mode, --data, --seed and the train.* flags reach it (TANDEM_WORKER_FLAGS); --tp, --pp,\n"
      "--placement sharded and the reference model's options (train.context, d_model, heads, layers,\n"
      "activation_checkpointing, pipeline_schedule) are refused (docs/pytorch.md).");
  // What follows "--" is the script's: it is not parsed (not even --help).
  std::vector<std::string> args(argv, argv + argc);
  const SplitCommandLine split = SplitAtSeparator(args);
  std::vector<char*> launcher_argv;
  for (const auto& a : split.launcher) launcher_argv.push_back(const_cast<char*>(a.c_str()));
  if (int rc = ParseOrExit(options, static_cast<int>(launcher_argv.size()), launcher_argv.data()); rc >= 0) return rc;
  o.script.args = split.script;
  if (!inject.empty()) {
    auto faults = ParseFaults(inject);
    if (!faults.ok()) {
      fmt::print(stderr, "tandem run: {}\n", faults.status().message());
      return 2;
    }
    o.faults = std::move(*faults);
  }
  if (!chaos.empty()) {
    auto spec = ParseChaos(chaos);
    if (!spec.ok()) {
      fmt::print(stderr, "tandem run: {}\n", spec.status().message());
      return 2;
    }
    o.chaos = *spec;
  }
  if (Status s = CheckScriptOptions(o, split.launcher, split.separator); !s.ok()) {
    fmt::print(stderr, "tandem run: {}\n", s.message());
    return 2;
  }
  // A membership change after the last step would race the end of the run.
  for (const auto& [flag, at] :
       {std::pair{"--kill-worker-at", o.kill_worker_at}, {"--add-worker-at", o.add_worker_at}}) {
    if (at >= o.train.steps) {
      fmt::print(stderr, "tandem run: {}: {} must be below --steps ({}): the change comes once that step is done\n",
                 flag, at, o.train.steps);
      return 2;
    }
  }

  if (!o.trace.dir.empty()) o.trace.dir = std::filesystem::absolute(o.trace.dir).string();  // the daemons' cwd differs
  auto summary = RunLocalTraining(o, shutdown);
  if (!summary.ok()) {
    fmt::print(stderr, "tandem run: {}\n", summary.status().message());
    return 1;
  }
  const RunSummary& s = *summary;
  fmt::print(
      "\n{} {} of {} steps in {:.1f} s: loss {:.4f} -> {:.4f}, {:.0f} tokens/s, step {:.1f} ms (median), exposed "
      "communication {:.1f}% of step time\n",
      s.completed ? "Done:" : "Stopped:", s.steps, o.train.steps, s.elapsed_seconds, s.first_loss, s.last_loss,
      s.tokens_per_second, s.step_seconds_median * 1e3, s.exposed_fraction * 100);
  fmt::print("  membership epochs {}, faults injected {}, workers added {}, final world size {}\n", s.epochs, s.faults,
             s.workers_added, s.world_size);
  int restarts = 0;
  std::string by_role;
  for (const auto& [role, n] : s.restarts) {
    restarts += n;
    if (n > 0) by_role += fmt::format("{}{} {}", by_role.empty() ? "" : ", ", n, role);
  }
  if (restarts > 0) fmt::print("  processes restarted: {} ({})\n", restarts, by_role);
  if (s.rollbacks > 0) {
    fmt::print("  rolled back to a checkpoint {} time(s) (partitions lost both copies): {} steps trained again\n",
               s.rollbacks, s.steps_redone);
  }
  for (const InjectedFault& f : s.injected) {
    fmt::print("  {} at step {}: {}{}\n", FormatFault(f.fault), f.step,
               f.detected_seconds >= 0 ? fmt::format("detected in {:.1f} s ({}), ", f.detected_seconds, f.detection)
                                       : (f.detection.empty() ? std::string("not detected") : f.detection) + ", ",
               f.recovered_seconds >= 0 ? fmt::format("whole again after {:.1f} s", f.recovered_seconds)
                                        : std::string("not recovered when the run ended"));
  }
  if (s.chaos) fmt::print("  chaos seed {} (replay with --chaos {})\n", s.chaos_seed, s.chaos_seed);
  if (s.peak_rss_bytes > 0) {
    fmt::print(
        "  peak resident memory of a worker: {:.1f} MiB; rank 0's parameters ({} placement): {:.1f} MiB at most\n",
        static_cast<double>(s.peak_rss_bytes) / (1 << 20), s.placement,
        static_cast<double>(s.peak_parameter_bytes) / (1 << 20));
  }
  if (s.pipeline_stages > 1) {
    std::string idle;
    for (size_t i = 0; i < s.pipeline_idle.size(); ++i) {
      idle += fmt::format("{}stage {} {:.1f}%", i ? ", " : "", i, s.pipeline_idle[i] * 100);
    }
    fmt::print("  pipeline: {} stages, {}; idle {} (analytic bubble {:.1f}%)\n", s.pipeline_stages, s.pipeline_schedule,
               idle.empty() ? "not measured" : idle, s.analytic_bubble * 100);
  }
  if (s.server_steps_applied) {
    if (o.train.consistency != "sync") {
      // Each contributor's push is an update of its own: one per worker in
      // ps mode, one per node in hybrid mode.
      const uint64_t contributors = o.train.mode == "ps" ? s.world_size : static_cast<uint64_t>(o.nodes);
      fmt::print("  the servers applied {} updates (asynchronous: one per push; {} contributors x {} steps = {})\n",
                 *s.server_steps_applied, contributors, s.steps, contributors * s.steps);
    } else {
      fmt::print("  the servers applied {} updates{}\n", *s.server_steps_applied,
                 *s.server_steps_applied == s.steps ? " (one per completed step)" : " (NOT one per completed step)");
    }
  } else if (!s.server_steps_detail.empty() && o.train.consistency != "sync") {
    fmt::print(
        "  the partitions applied different numbers of updates (asynchronous: a push cut off by a membership change "
        "is applied on some partitions only): {}\n",
        s.server_steps_detail);
  } else if (!s.server_steps_detail.empty()) {
    fmt::print("  the servers disagree on their updates: {}\n", s.server_steps_detail);
  }
  if (!s.checkpoint.empty()) fmt::print("  last checkpoint: {}\n", s.checkpoint);
  if (!o.trace.dir.empty()) {
    fmt::print("  trace: {} (tandem trace merge {} -o trace.json, then open trace.json in Perfetto)\n", o.trace.dir,
               o.trace.dir);
  }
  if (!summary_file.empty()) {
    std::ofstream out(summary_file, std::ios::trunc);
    out << SummaryJson(s);
    if (!out) {
      fmt::print(stderr, "tandem run: --summary: cannot write '{}'\n", summary_file);
      return 1;
    }
    fmt::print("  summary: {}\n", summary_file);
  }
  if (!s.completed) {
    if (!s.interrupted) fmt::print(stderr, "tandem run: {}\n", s.failure);
    return s.interrupted ? 130 : 1;
  }
  return 0;
}

}  // namespace tandem::cli
