// Tandem's C++ API for a training loop of your own (docs/training.md,
// "Your own training loop"). With tandem/status.h and tandem/train_config.h
// (which it includes) this is the whole public API: the headers need the
// standard library only, and an installed Tandem provides them with the
// library they declare (find_package(Tandem), target Tandem::worker; README,
// "Using Tandem from your own CMake project").
//
// A program that calls RunWorker is a tandem-worker: the same flags, YAML
// configuration, health service, metrics and clean shutdown on SIGTERM, and
// it registers with the coordinator at --coordinator-address. Its training
// loop runs on a thread of its own and drives a Runtime:
//
//   int main(int argc, char** argv) {
//     return tandem::RunWorker(argc, argv, [](tandem::WorkerContext& ctx) -> tandem::Status {
//       MyModel model;                                       // flat fp32 params and grads
//       auto options = tandem::RuntimeOptionsOf(ctx.train);  // train.mode, wires, buckets, optimizer
//       if (!options.ok()) return options.status();
//       tandem::Runtime runtime(*options, ctx);
//       TANDEM_RETURN_IF_ERROR(runtime.Attach(model.params(), model.grads(), model.tensors()));
//       while (!ctx.stopping()) {
//         auto plan = runtime.BeginStep();                // step, dp_rank, dp_size
//         if (!plan.ok()) return plan.status();
//         if (plan->step > last_step) {                   // done; async modes: wait for the others
//           if (runtime.FinishRun().ok()) break;
//           continue;                                     // a membership change: resync, then again
//         }
//         double loss = model.ForwardBackward(plan->dp_rank, plan->dp_size,
//                                             [&](size_t from) { runtime.GradientsReady(from); });
//         auto done = runtime.EndStep(loss_share, samples, tokens);
//         if (!done.ok()) continue;                       // a membership change: retried after a resync
//       }
//       return tandem::Status::Ok();
//     });
//   }
//
// examples/custom_loop.cc is a complete program.
//
// The API covers data-parallel training of one flat fp32 buffer (hybrid, ps
// and allreduce modes, every consistency); pipeline and tensor parallelism
// are the reference trainer's (worker/runtime/runtime.h, not public).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/status.h"
#include "tandem/train_config.h"

namespace tandem {

// The implementation's types, only declared here.
namespace worker {
class DataPlane;
class Runtime;
struct RuntimeOptions;
}  // namespace worker

// One tensor of the model: a named range of the flat fp32 buffers.
struct TensorSpec {
  std::string name;            // unique, 1 to 512 bytes ("layer1.weight")
  std::vector<int64_t> shape;  // outermost first; empty: a scalar
  uint64_t flat_offset = 0;    // its first element in the flat buffers
  // The optimizer group whose overrides apply: empty for the job-wide
  // hyperparameters; "no_decay" (no weight decay) with the options of
  // RuntimeOptionsOf.
  std::string group;
};

// What a Runtime's options say: the train.* options' mode, wire types,
// buckets, timeouts, consistency and optimizer.
class RuntimeOptions {
 public:
  RuntimeOptions(const RuntimeOptions& other);
  RuntimeOptions& operator=(const RuntimeOptions& other);
  RuntimeOptions(RuntimeOptions&& other) noexcept;
  RuntimeOptions& operator=(RuntimeOptions&& other) noexcept;
  ~RuntimeOptions();

  // "hybrid", "allreduce" or "ps".
  std::string mode() const;
  // Replaces the optimizer that train.optimizer and its options describe
  // (with its learning-rate schedule, gradient clipping and group overrides)
  // by plain SGD: w -= lr * (g + weight_decay * w), with momentum when > 0.
  // The gradients are still summed over the ranks (pass each rank's share of
  // the global mean to EndStep's loss and to the gradient buffer).
  void UseSgd(double lr, double momentum = 0, double weight_decay = 0);

 private:
  friend class Runtime;
  friend Result<RuntimeOptions> RuntimeOptionsOf(const TrainConfig& train);
  explicit RuntimeOptions(std::unique_ptr<worker::RuntimeOptions> impl);
  std::unique_ptr<worker::RuntimeOptions> impl_;
};

// The options the worker's train.* options give (INVALID_ARGUMENT for a
// combination the runtime refuses, naming the key).
Result<RuntimeOptions> RuntimeOptionsOf(const TrainConfig& train);

// What a training loop gets from the worker: its train.* options, whether
// the worker is shutting down, and (for the Runtime) its data plane.
class WorkerContext {
 public:
  WorkerContext(const TrainConfig& train_config, std::function<bool()> stopping_fn, worker::DataPlane& data_plane);

  const TrainConfig& train;        // the train.* options (mode, wires, buckets, optimizer, steps, ...)
  std::function<bool()> stopping;  // true once the worker shuts down: return from the loop

 private:
  friend class Runtime;
  worker::DataPlane& data_plane_;
};

// What BeginStep tells the training loop.
struct StepPlan {
  uint64_t step = 0;  // the step to run, >= 1; the parameters are those after step - 1
  uint64_t epoch = 0;
  uint32_t rank = 0;  // global rank and world size of the epoch
  uint32_t world_size = 1;
  uint32_t dp_rank = 0;  // data-parallel rank and size: this rank's share of the batch
  uint32_t dp_size = 1;
  bool resynced = false;  // the parameters were (re)loaded for this step
};

// What EndStep reports.
struct StepResult {
  uint64_t step = 0;
  uint64_t epoch = 0;
  double loss = 0;       // the global loss: the sum of every rank's loss_share
  uint64_t samples = 0;  // over every rank
  uint64_t tokens = 0;   // over every rank
  double comm_seconds = 0;
  double exposed_seconds = 0;  // communication the computation did not hide
  bool skipped = false;        // allreduce mode: a non-finite gradient skipped the update
};

// Data-parallel training steps over the worker's cluster (docs/training.md,
// "The worker runtime"): the gradients are summed over the data-parallel
// ranks, the optimizer runs on the parameter servers (hybrid, ps) or on every
// worker (allreduce), and the updated parameters are written back into the
// attached buffer. After a membership change the next BeginStep waits for
// the new epoch and resynchronises the parameters.
//
// Thread safety: BeginStep, GradientsReady, EndStep and FinishRun on the
// training thread only; Stop from any thread.
class Runtime {
 public:
  Runtime(const RuntimeOptions& options, WorkerContext& context);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // The model: flat parameters and gradients of the same size, and the
  // tensors over them. The buffers must outlive the runtime. The servers
  // start from the first worker's `params`: every worker should start from
  // the same values.
  Status Attach(std::span<float> params, std::span<float> grads, std::vector<TensorSpec> tensors);
  // Waits for an epoch (resynchronising after a membership change or a
  // failed step) and plans the next step. CANCELLED after Stop();
  // DEADLINE_EXCEEDED when no new epoch came within train.epoch_wait.
  Result<StepPlan> BeginStep();
  // Backward has made the gradients of [ready_from, end) final: their
  // buckets start communicating. Cheap; never blocks. Optional (EndStep
  // sends what is left).
  void GradientsReady(size_t ready_from);
  // The learning rate of the steps to come (> 0), instead of the schedule's
  // (0, the default). Set it before the step's backward.
  void SetStepLearningRate(double lr);
  // Finishes the step: the parameters are updated in the attached buffer.
  // `loss_share` is this rank's loss times its share of the global batch;
  // `samples` and `tokens` are this rank's. A failure (a membership change,
  // a peer that died) leaves the step to be retried by the next BeginStep.
  Result<StepResult> EndStep(double loss_share, uint64_t samples, uint64_t tokens);
  // After the last step (the BeginStep that planned the step past it):
  // asynchronous modes wait for every worker and pull the final parameters.
  // An error is a membership change: BeginStep again, then FinishRun again.
  Status FinishRun();
  // Whether a failure ends training (bad configuration or input, Stop())
  // rather than a membership change to wait out.
  bool Fatal(const Status& status) const;
  // Steps completed (the servers', after a resync).
  uint64_t completed_steps() const;
  // Fails whatever waits and makes BeginStep return CANCELLED.
  void Stop();

 private:
  std::unique_ptr<worker::Runtime> impl_;
};

// A training loop: returns when done (OK) or failed (the worker then stops
// with exit code 1).
using TrainingLoop = std::function<Status(WorkerContext&)>;

// Runs this process as a tandem-worker whose training thread runs `loop`.
// Returns the exit code for main(): 0 after a clean shutdown, 1 when the
// loop failed or the worker could not start, 2 for bad flags.
int RunWorker(int argc, char** argv, TrainingLoop loop);

// Logs `message` through the worker's logger (the format, level and
// destination that its --log-* options set), like the worker's own lines.
enum class LogLevel { kDebug, kInfo, kWarning, kError };
void Log(LogLevel level, std::string_view message);

}  // namespace tandem
