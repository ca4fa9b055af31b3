// tandem train: the reference model trained in this one process, with no
// cluster: the single-process reference that distributed runs are checked
// against (the same samples, micro-batches and optimizer kernels).
#include <unistd.h>

#include <fstream>

#include "cli/commands.h"
#include "cli/local_cluster.h"
#include "common/config.h"
#include "worker/runtime/trainer.h"

namespace tandem::cli {

int TrainCommand(int argc, char** argv) {
  worker::TrainConfig train;
  train.steps = 50;
  std::string summary_file;
  OptionSet options("tandem train",
                    "train the reference model in this process alone (the single-process reference for tandem run)");
  options.EnableConfigFile();
  worker::DeclareTrainOptions(options, &train);
  options.String("summary", &summary_file, "write the run's summary here as JSON (the keys of tandem run's)");
  if (int rc = ParseOrExit(options, argc, argv); rc >= 0) return rc;
  if (train.steps < 1) {
    fmt::print(stderr, "tandem train: --train-steps must be at least 1\n");
    return 2;
  }
  RunSummary summary;
  summary.mode = "local";
  summary.world_size = 1;
  summary.network = "none";
  const bool tty = isatty(STDOUT_FILENO) != 0;
  double tokens = 0, wall = 0;
  std::vector<double> step_s, compute_s;
  const auto t0 = std::chrono::steady_clock::now();
  Status s = worker::TrainLocally(
      train,
      [&](const worker::StepRecord& r) {
        summary.losses.push_back(r.loss);
        summary.steps = r.step;
        if (r.step >= 2) {
          tokens += static_cast<double>(r.tokens);
          wall += r.step_seconds;
          step_s.push_back(r.step_seconds);
          compute_s.push_back(r.compute_seconds);
        }
        const std::string line =
            fmt::format("step {}/{}  loss {:.4f}  step {:.1f} ms", r.step, train.steps, r.loss, r.step_seconds * 1e3);
        if (tty) {
          fmt::print("\r{}\033[K", line);
          std::fflush(stdout);
        } else if (r.step == 1 || r.step % std::max<int64_t>(1, train.steps / 20) == 0) {
          fmt::print("{}\n", line);
        }
      },
      nullptr);
  if (tty) fmt::print("\n");
  if (!s.ok()) {
    fmt::print(stderr, "tandem train: {}\n", s.ToString());
    return 1;
  }
  summary.completed = true;
  summary.elapsed_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  summary.first_loss = summary.losses.front();
  summary.last_loss = summary.losses.back();
  summary.tokens_per_second = wall > 0 ? tokens / wall : 0;
  summary.step_seconds_median = Median(step_s);
  summary.compute_seconds_median = Median(compute_s);
  summary.epochs = 0;
  fmt::print("Done: {} steps in {:.1f} s: loss {:.4f} -> {:.4f}, {:.0f} tokens/s\n", summary.steps,
             summary.elapsed_seconds, summary.first_loss, summary.last_loss, summary.tokens_per_second);
  if (!summary_file.empty()) {
    std::ofstream out(summary_file, std::ios::trunc);
    out << SummaryJson(summary);
    if (!out) {
      fmt::print(stderr, "tandem train: --summary: cannot write '{}'\n", summary_file);
      return 1;
    }
  }
  return 0;
}

}  // namespace tandem::cli
