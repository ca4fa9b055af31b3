// tandem bench pipeline: the measured idle fraction of pipeline stages under
// the GPipe and 1F1B schedules (worker/runtime/pipeline.h) beside the
// analytic bubble (P - 1) / (M + P - 1), for a grid of stage counts P and
// micro-batch counts M.
//
// Method: P stages run as threads, each with a communicator of one pipeline
// group over an in-process fabric (the same TransportCommunicator the
// workers use, without the network). A stage's forward of a micro-batch
// takes --forward-ms and its backward --backward-ratio times that, as a
// timed wait rather than arithmetic: the schedule is what is measured, and
// P busy stages on a machine with fewer cores than P would measure the
// machine's scheduler instead. Activations and gradients of
// --activation-bytes travel between the stages for real. Each shape runs
// --steps steps; a stage's idle fraction is 1 - its compute time / the
// step's time (until the last stage is done), averaged over the stages (the
// worst stage is shown too), median over the steps. ratio = measured / analytic; the target is at most 1.1.
#include <stdio.h>

#include <algorithm>
#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "common/config.h"
#include "common/shutdown.h"
#include "common/transport/local_transport.h"
#include "worker/comm/transport_communicator.h"
#include "worker/runtime/pipeline.h"

namespace tandem::cli {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<int> ParseInts(const std::string& list, const char* flag, int lo, int hi, Status* error) {
  std::vector<int> out;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = std::min(list.find(',', start), list.size());
    const std::string item = list.substr(start, comma - start);
    int v = 0;
    try {
      size_t used = 0;
      v = std::stoi(item, &used);
      if (used != item.size()) throw std::invalid_argument(item);
    } catch (const std::exception&) {
      *error = InvalidArgument("--{}: '{}' is not a whole number", flag, item);
      return {};
    }
    if (v < lo || v > hi) {
      *error = InvalidArgument("--{}: {} is not between {} and {}", flag, v, lo, hi);
      return {};
    }
    out.push_back(v);
    start = comma + 1;
  }
  return out;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Shape {
  int stages = 0, micro = 0;
  worker::PipelineSchedule schedule = worker::PipelineSchedule::kGPipe;
  double idle = 0, idle_worst = 0, step_ms = 0;
};

Status Measure(Shape& shape, int steps, double forward_ms, double backward_ratio, size_t elements, int serial) {
  auto fabric = transport::LocalFabric::Create(shape.stages);
  std::vector<std::unique_ptr<comm::Communicator>> comms;
  for (int r = 0; r < shape.stages; ++r) {
    comm::CommInfo info;
    info.name = fmt::format("pp/bench{}", serial);
    info.epoch = 1;
    info.rank = r;
    info.size = shape.stages;
    TANDEM_ASSIGN_OR_RETURN(auto c, comm::TransportCommunicator::Create(info, fabric->Connect(r), {}));
    comms.push_back(std::move(c));
  }
  const auto forward = std::chrono::duration<double, std::milli>(forward_ms);
  const auto backward = std::chrono::duration<double, std::milli>(forward_ms * backward_ratio);
  std::vector<double> idle, worst, step_ms;
  for (int step = 0; step < steps; ++step) {
    std::vector<std::future<Result<worker::PipelineTiming>>> done;
    for (int s = 0; s < shape.stages; ++s) {
      done.push_back(std::async(std::launch::async, [&, s]() -> Result<worker::PipelineTiming> {
        std::vector<float> out(elements, 1.0f), grad(elements, 1.0f);
        const bool last = s == shape.stages - 1, first = s == 0;
        worker::StageCompute compute;
        compute.forward = [&](int, const float*) -> Result<std::span<const float>> {
          std::this_thread::sleep_until(Clock::now() + std::chrono::duration_cast<Clock::duration>(forward));
          if (last) return std::span<const float>();
          return std::span<const float>(out);
        };
        compute.backward = [&](int, const float*) -> Result<std::span<const float>> {
          std::this_thread::sleep_until(Clock::now() + std::chrono::duration_cast<Clock::duration>(backward));
          if (first) return std::span<const float>();
          return std::span<const float>(grad);
        };
        return worker::RunPipeline(*comms[s], worker::BuildSchedule(shape.schedule, shape.stages, s, shape.micro),
                                   elements, compute);
      }));
    }
    // The step ends when the last stage does (the first stage's last
    // backward); a stage is idle for whatever of that it does not compute.
    std::vector<double> compute;
    double longest = 0;
    for (auto& f : done) {
      auto timing = f.get();
      if (!timing.ok()) return timing.status();
      compute.push_back(timing->compute_seconds);
      longest = std::max(longest, timing->seconds);
    }
    double sum = 0, most = 0;
    for (double c : compute) {
      const double stage_idle = longest > 0 ? 1.0 - c / longest : 0;
      sum += stage_idle;
      most = std::max(most, stage_idle);
    }
    idle.push_back(sum / shape.stages);
    worst.push_back(most);
    step_ms.push_back(longest * 1e3);
  }
  shape.idle = Median(idle);
  shape.idle_worst = Median(worst);
  shape.step_ms = Median(step_ms);
  return Status::Ok();
}

}  // namespace

int BenchPipelineCommand(int argc, char** argv) {
  ShutdownSignal shutdown;
  std::string stages_list = "2,4", micro_list = "1,2,4,8,16,32", schedules = "gpipe,1f1b";
  double forward_ms = 4, backward_ratio = 2;
  uint64_t activation_bytes = 64 << 10;
  int64_t steps = 5;
  bool json = false;
  OptionSet options("tandem bench pipeline",
                    "the measured idle fraction of pipeline stages (GPipe and 1F1B) beside the analytic bubble "
                    "(P-1)/(M+P-1)");
  options.String("stages", &stages_list, "comma-separated pipeline stage counts P");
  options.String("micro_batches", &micro_list, "comma-separated micro-batch counts M");
  options.String("schedules", &schedules, "comma-separated schedules (gpipe, 1f1b)");
  options.Double("forward_ms", &forward_ms, "a stage's forward time per micro-batch, in ms", 0.1, 10000);
  options.Double("backward_ratio", &backward_ratio, "backward time as a multiple of forward time", 0, 100);
  options.Bytes("activation_bytes", &activation_bytes, "bytes of activations (and gradients) per micro-batch", 4,
                1ull << 30);
  options.Int("steps", &steps, "steps per shape (the median is shown)", 1, 1000);
  options.Bool("json", &json, "print one JSON object per shape instead of the table");
  if (int rc = ParseOrExit(options, argc, argv); rc >= 0) return rc;
  Status error;
  const std::vector<int> stage_counts = ParseInts(stages_list, "stages", 1, 64, &error);
  const std::vector<int> micro_counts =
      error.ok() ? ParseInts(micro_list, "micro-batches", 1, 4096, &error) : std::vector<int>{};
  std::vector<worker::PipelineSchedule> kinds;
  for (size_t start = 0; error.ok() && start <= schedules.size();) {
    const size_t comma = std::min(schedules.find(',', start), schedules.size());
    auto kind = worker::ParseSchedule(schedules.substr(start, comma - start));
    if (!kind.ok()) {
      error = kind.status().WithContext("--schedules");
    } else {
      kinds.push_back(*kind);
    }
    start = comma + 1;
  }
  if (!error.ok()) {
    fmt::print(stderr, "tandem bench pipeline: {}\n", error.message());
    return 2;
  }
  const size_t elements = std::max<size_t>(1, activation_bytes / sizeof(float));
  if (!json) {
    fmt::print(
        "# tandem bench pipeline: forward {:.1f} ms and backward {:.1f} ms per micro-batch per stage, {} KiB of "
        "activations per micro-batch, {} steps per shape (median)\n",
        forward_ms, forward_ms * backward_ratio, activation_bytes >> 10, steps);
    fmt::print("# idle = 1 - compute time / step time of a stage, mean over stages (worst stage beside it)\n");
    fmt::print("{:>6} {:>6} {:>8} {:>9} {:>9} {:>9} {:>7} {:>9}\n", "stages", "micro", "schedule", "idle", "worst",
               "analytic", "ratio", "step ms");
  }
  int serial = 0, worse = 0;
  for (int p : stage_counts) {
    for (int m : micro_counts) {
      for (auto kind : kinds) {
        if (shutdown.requested()) return 130;
        Shape shape;
        shape.stages = p;
        shape.micro = m;
        shape.schedule = kind;
        if (Status s = Measure(shape, static_cast<int>(steps), forward_ms, backward_ratio, elements, ++serial);
            !s.ok()) {
          fmt::print(stderr, "tandem bench pipeline: P={} M={} {}: {}\n", p, m, worker::ScheduleName(kind),
                     s.ToString());
          return 1;
        }
        const double analytic = worker::AnalyticBubble(p, m);
        const double ratio = analytic > 0 ? shape.idle / analytic : 0;
        if (analytic > 0 && ratio > 1.1) ++worse;
        if (json) {
          fmt::print(
              "{{\"stages\":{},\"microbatches\":{},\"schedule\":\"{}\",\"idle_fraction\":{:.4f},"
              "\"idle_fraction_worst_stage\":{:.4f},\"analytic_bubble\":{:.4f},\"ratio\":{:.3f},\"step_ms\":{:.2f}}}\n",
              p, m, worker::ScheduleName(kind), shape.idle, shape.idle_worst, analytic, ratio, shape.step_ms);
        } else {
          fmt::print("{:>6} {:>6} {:>8} {:>8.1f}% {:>8.1f}% {:>8.1f}% {:>6.2f}x {:>9.1f}\n", p, m,
                     worker::ScheduleName(kind), shape.idle * 100, shape.idle_worst * 100, analytic * 100, ratio,
                     shape.step_ms);
        }
        fflush(stdout);
      }
    }
  }
  if (!json) fmt::print("# shapes above 1.1x the analytic bubble: {}\n", worse);
  return 0;
}

}  // namespace tandem::cli
