// tandem bench train: training throughput of each mode on a local cluster,
// beside the same training in one process measured in the same run.
//
// For each mode it runs the reference model (cli/local_cluster.h) with the
// same global batch and reports tokens per second, the ratio to the
// single-process run, the median step and compute (forward + backward)
// times, and the fraction of step time the workers spent waiting for
// communication after backward and, in the next forward, for parameters still
// arriving: the communication that the computation did not hide.
#include <stdlib.h>
#include <time.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include <fmt/ranges.h>

#include "cli/commands.h"
#include "cli/launcher.h"
#include "cli/local_cluster.h"
#include "common/config.h"
#include "common/shutdown.h"
#include "common/trace.h"
#include "worker/runtime/trainer.h"

namespace tandem::cli {
namespace {

struct Row {
  std::string mode;
  int64_t workers = 1;
  int64_t servers = 0;
  double tokens_per_second = 0;
  double step_ms = 0;
  double compute_ms = 0;
  double exposed = 0;
  double last_loss = 0;
};

// The recorder's own cost, on this machine: CPU time (every thread of this
// process: recording and the writer's formatting and writing) per span of
// the kind a step records, over `n` spans; and in *recording, the recording
// thread's alone (what a traced thread pays on its own path).
Result<double> RecorderNanosPerSpan(int n, double* recording) {
  char tmpl[] = "/tmp/tandem-bench-trace-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return Unavailable("cannot make a trace directory in /tmp");
  trace::Config config;
  config.dir = tmpl;
  TANDEM_RETURN_IF_ERROR(trace::Start(config, "bench", "recorder"));
  const auto cpu = [](clockid_t clock) {
    timespec ts;
    clock_gettime(clock, &ts);
    return static_cast<double>(ts.tv_sec) * 1e9 + static_cast<double>(ts.tv_nsec);
  };
  const double start = cpu(CLOCK_PROCESS_CPUTIME_ID), thread_start = cpu(CLOCK_THREAD_CPUTIME_ID);
  for (int i = 0; i < n; ++i) {
    trace::Span span("push", "ps", 1);
    span.Add("partition", i & 15);
    span.Add("server", 1);
    span.Add("corr", i);
    span.Add("bytes", 65536);
  }
  *recording = (cpu(CLOCK_THREAD_CPUTIME_ID) - thread_start) / n;
  trace::Stop();  // the writer's last drain, counted
  const double ns = (cpu(CLOCK_PROCESS_CPUTIME_ID) - start) / n;
  std::filesystem::remove_all(tmpl);
  return ns;
}

// Spans per step and process in the trace files of `dir` (the largest).
double SpansPerStep(const std::string& dir, int64_t steps) {
  double most = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    std::ifstream in(entry.path());
    double n = 0;
    for (std::string line; std::getline(in, line);) n += line.starts_with("{\"ph\"");
    most = std::max(most, n / static_cast<double>(std::max<int64_t>(1, steps)));
  }
  return most;
}

// The cost of tracing: per mode, `rounds` pairs of runs, one without
// tracing and one tracing every step (in alternating order, so that both see
// the same drift of the machine), each run's median step time; the overhead
// is the median over the pairs of traced / untraced - 1. Beside it, what
// does not depend on the machine's load: the recorder's CPU time per span
// times the spans a process records per step, over the untraced step time.
int TraceOverhead(const ClusterOptions& o, const std::string& modes, int64_t rounds, bool json,
                  ShutdownSignal& shutdown) {
  constexpr int kSpans = 100000;
  double recording = 0;
  auto per_span = RecorderNanosPerSpan(kSpans, &recording);
  if (!per_span.ok()) {
    fmt::print(stderr, "tandem bench train: {}\n", per_span.status().ToString());
    return 1;
  }
  if (!json) {
    fmt::print(
        "# tandem bench train --trace-rounds {}: reference model, {} layers x d_model {}, global batch {}, {} steps "
        "per run; {} node(s) x {} worker(s), {} server(s), network {}\n"
        "# median step time of each run (steps 2..N), {} rounds of a run without tracing and one tracing every step, "
        "in alternating order; overhead: median over the rounds of traced / untraced - 1\n"
        "# recorder: {:.0f} ns of CPU per span, {:.0f} ns of them on the recording thread (the rest formats and "
        "writes; {} spans); CPU per step: that times the spans per step of the busiest process, over the untraced "
        "step\n",
        rounds, o.train.layers, o.train.d_model, o.train.global_batch, o.train.steps, o.nodes, o.workers_per_node,
        o.servers, o.network, rounds, *per_span, recording, kSpans);
    fmt::print("{:<10} {:>12} {:>12} {:>9} {:>10} {:>14}  {}\n", "mode", "untraced ms", "traced ms", "overhead",
               "spans/step", "CPU per step", "per round (traced/untraced)");
  }
  for (const std::string& mode : SplitList(modes)) {
    if (!worker::ParseTrainingMode(mode).ok()) {
      fmt::print(stderr, "tandem bench train: --modes: '{}' is not one of hybrid, allreduce, ps\n", mode);
      return 2;
    }
    std::vector<double> off, on, ratios, spans;
    for (int64_t r = 0; r < rounds && !shutdown.requested(); ++r) {
      // ABBA: every other round the traced run goes first, so that neither
      // side always follows the other.
      for (const bool traced : r % 2 == 0 ? std::vector<bool>{false, true} : std::vector<bool>{true, false}) {
        ClusterOptions run = o;
        run.train.mode = mode;
        std::string dir;
        if (traced) {
          char tmpl[] = "/tmp/tandem-bench-trace-XXXXXX";
          if (mkdtemp(tmpl) == nullptr) {
            fmt::print(stderr, "tandem bench train: cannot make a trace directory in /tmp\n");
            return 1;
          }
          dir = tmpl;
          run.trace.dir = dir;
        }
        auto summary = RunLocalTraining(run, shutdown);
        if (!dir.empty()) {
          spans.push_back(SpansPerStep(dir, o.train.steps));
          std::filesystem::remove_all(dir);
        }
        if (!summary.ok() || !summary->completed) {
          fmt::print(stderr, "tandem bench train: {} mode{}: {}\n", mode, traced ? " (traced)" : "",
                     summary.ok() ? summary->failure : summary.status().ToString());
          return 1;
        }
        (traced ? on : off).push_back(summary->step_seconds_median * 1e3);
      }
      ratios.push_back(on.back() / off.back());  // this round's pair
    }
    if (ratios.empty()) break;
    const double overhead = Median(ratios) - 1;
    const double spans_per_step = Median(spans);
    const double cpu_share = spans_per_step * *per_span * 1e-6 / Median(off);
    std::string each;
    for (double x : ratios) each += fmt::format("{}{:.3f}", each.empty() ? "" : " ", x);
    if (json) {
      fmt::print(
          "{{\"mode\":{},\"rounds\":{},\"untraced_step_ms\":{},\"traced_step_ms\":{},\"trace_overhead\":{},"
          "\"ratios\":[{}],\"spans_per_step\":{},\"recorder_ns_per_span\":{},\"cpu_share_of_step\":{}}}\n",
          JsonQuote(mode), ratios.size(), JsonNumber(Median(off), 5), JsonNumber(Median(on), 5),
          JsonNumber(overhead, 4), fmt::join(ratios, ","), JsonNumber(spans_per_step, 4), JsonNumber(*per_span, 4),
          JsonNumber(cpu_share, 4));
    } else {
      fmt::print("{:<10} {:>12.1f} {:>12.1f} {:>+8.1f}% {:>10.0f} {:>13.4f}%  {}\n", mode, Median(off), Median(on),
                 overhead * 100, spans_per_step, cpu_share * 100, each);
    }
  }
  return 0;
}

}  // namespace

int BenchTrainCommand(int argc, char** argv) {
  ShutdownSignal shutdown;
  ClusterOptions o;
  o.bin_dir = ExecutableDir();
  o.train.steps = 40;
  o.network = "loopback";
  o.progress = false;
  std::string modes = "hybrid,allreduce,ps";
  bool json = false;
  OptionSet options("tandem bench train",
                    "tokens/s of each training mode on a local cluster, beside one process, and the communication "
                    "backward does not hide");
  options.EnableConfigFile();
  options.String("modes", &modes, "comma-separated modes to measure (hybrid, allreduce, ps)");
  options.Int("steps", &o.train.steps, "training steps per mode (the first is not timed)", 3, 1 << 20);
  options.Int("nodes", &o.nodes, "simulated nodes", 1, 253);
  options.Int("workers_per_node", &o.workers_per_node, "workers on each node", 1, 64);
  options.Int("servers", &o.servers, "parameter servers (hybrid and ps modes)", 1, 64);
  options.Bytes("partition_size", &o.partition_bytes, "size of one parameter-server partition", 4096, 1ull << 32);
  options.Choice("network", &o.network, {"auto", "netns", "loopback"},
                 "simulated nodes as network namespaces, or all on loopback");
  options.Bool("bind", &o.bind,
               "pin each worker to its own share of this machine's CPUs, as MPI launchers bind ranks (servers and the "
               "coordinator are not pinned)");
  options.Bool("json", &json, "print one JSON object per mode instead of the table");
  int64_t trace_rounds = 0;
  options.Int("trace_rounds", &trace_rounds,
              "instead of the table: the cost of tracing (tandem run --trace) in each mode, from this many rounds of "
              "a run without tracing and one tracing every step, alternating (0: off)",
              0, 1000);
  worker::DeclareTrainOptions(options, &o.train, /*job_keys=*/false);
  if (int rc = ParseOrExit(options, argc, argv); rc >= 0) return rc;
  o.nodes = std::max<int64_t>(o.nodes, 1);
  if (o.nodes * o.workers_per_node == 1) o.nodes = 2;

  if (trace_rounds > 0) return TraceOverhead(o, modes, trace_rounds, json, shutdown);

  std::vector<Row> rows;
  // One process: the baseline.
  {
    Row row;
    row.mode = "1 process";
    std::vector<double> step_s, compute_s;
    double tokens = 0, wall = 0;
    Status s = worker::TrainLocally(
        o.train,
        [&](const worker::StepRecord& r) {
          if (r.step < 2) return;
          step_s.push_back(r.step_seconds);
          compute_s.push_back(r.compute_seconds);
          tokens += static_cast<double>(r.tokens);
          wall += r.step_seconds;
          row.last_loss = r.loss;
        },
        nullptr);
    if (!s.ok()) {
      fmt::print(stderr, "tandem bench train: one process: {}\n", s.ToString());
      return 1;
    }
    row.tokens_per_second = wall > 0 ? tokens / wall : 0;
    row.step_ms = Median(step_s) * 1e3;
    row.compute_ms = Median(compute_s) * 1e3;
    rows.push_back(row);
  }
  const int64_t workers = o.nodes * o.workers_per_node;
  if (!json) {
    fmt::print(
        "# tandem bench train: reference model, {} layers x d_model {}, context {}, global batch {}, {} steps; "
        "{} node(s) x {} worker(s), network {}\n",
        o.train.layers, o.train.d_model, o.train.context, o.train.global_batch, o.train.steps, o.nodes,
        o.workers_per_node, o.network);
    fmt::print(
        "# tokens/s over steps 2..N; 'exposed' is the share of step time spent waiting for communication after "
        "backward and for parameters still arriving during forward\n");
    fmt::print("{:<10} {:>7} {:>7} {:>10} {:>12} {:>9} {:>11} {:>8} {:>9}\n", "mode", "workers", "servers", "tokens/s",
               "vs 1 process", "step ms", "compute ms", "exposed", "loss");
  }
  const auto print_row = [&](const Row& r) {
    const double ratio = rows.front().tokens_per_second > 0 ? r.tokens_per_second / rows.front().tokens_per_second : 0;
    if (json) {
      fmt::print(
          "{{\"mode\":{},\"workers\":{},\"servers\":{},\"tokens_per_second\":{},\"ratio_to_one_process\":{},"
          "\"step_ms\":{},\"compute_ms\":{},\"exposed_comm_fraction\":{},\"last_loss\":{}}}\n",
          JsonQuote(r.mode), r.workers, r.servers, JsonNumber(r.tokens_per_second, 6), JsonNumber(ratio, 4),
          JsonNumber(r.step_ms, 5), JsonNumber(r.compute_ms, 5), JsonNumber(r.exposed, 4), JsonNumber(r.last_loss, 6));
    } else {
      fmt::print("{:<10} {:>7} {:>7} {:>10.0f} {:>11.2f}x {:>9.1f} {:>11.1f} {:>7.1f}% {:>9.4f}\n", r.mode, r.workers,
                 r.servers, r.tokens_per_second, ratio, r.step_ms, r.compute_ms, r.exposed * 100, r.last_loss);
    }
  };
  print_row(rows.front());
  for (const std::string& mode : SplitList(modes)) {
    if (shutdown.requested()) break;
    if (!worker::ParseTrainingMode(mode).ok()) {
      fmt::print(stderr, "tandem bench train: --modes: '{}' is not one of hybrid, allreduce, ps\n", mode);
      return 2;
    }
    ClusterOptions run = o;
    run.train.mode = mode;
    auto summary = RunLocalTraining(run, shutdown);
    if (!summary.ok() || !summary->completed) {
      fmt::print(stderr, "tandem bench train: {} mode: {}\n", mode,
                 summary.ok() ? summary->failure : summary.status().ToString());
      return 1;
    }
    Row row;
    row.mode = mode;
    row.workers = workers;
    row.servers = mode == "allreduce" ? 0 : o.servers;
    row.tokens_per_second = summary->tokens_per_second;
    row.step_ms = summary->step_seconds_median * 1e3;
    row.compute_ms = summary->compute_seconds_median * 1e3;
    row.exposed = summary->exposed_fraction;
    row.last_loss = summary->last_loss;
    rows.push_back(row);
    print_row(row);
  }
  return 0;
}

}  // namespace tandem::cli
