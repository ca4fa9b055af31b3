// The public API (include/tandem/worker.h) over the worker runtime and the
// worker daemon. Built into libtandem (the shared library an installed Tandem
// provides as Tandem::worker), which links the rest of Tandem privately.
#include <utility>

#include <spdlog/spdlog.h>

#include "common/daemon.h"
#include "common/status.h"
#include "tandem/worker.h"
#include "worker/data_plane.h"
#include "worker/runtime/runtime.h"
#include "worker/runtime/trainer.h"
#include "worker/worker_daemon.h"

namespace tandem {

RuntimeOptions::RuntimeOptions(std::unique_ptr<worker::RuntimeOptions> impl) : impl_(std::move(impl)) {}
RuntimeOptions::RuntimeOptions(const RuntimeOptions& other)
    : impl_(std::make_unique<worker::RuntimeOptions>(*other.impl_)) {}
RuntimeOptions& RuntimeOptions::operator=(const RuntimeOptions& other) {
  if (this != &other) impl_ = std::make_unique<worker::RuntimeOptions>(*other.impl_);
  return *this;
}
RuntimeOptions::RuntimeOptions(RuntimeOptions&& other) noexcept = default;
RuntimeOptions& RuntimeOptions::operator=(RuntimeOptions&& other) noexcept = default;
RuntimeOptions::~RuntimeOptions() = default;

std::string RuntimeOptions::mode() const {
  return std::string(worker::ModeName(impl_->mode));
}

void RuntimeOptions::UseSgd(double lr, double momentum, double weight_decay) {
  v1::OptimizerConfig& o = impl_->optimizer;
  o.Clear();
  o.mutable_sgd()->set_lr(lr);
  o.mutable_sgd()->set_momentum(momentum);
  o.mutable_sgd()->set_weight_decay(weight_decay);
  o.set_reduction(v1::GRADIENT_REDUCTION_SUM);
}

Result<RuntimeOptions> RuntimeOptionsOf(const TrainConfig& train) {
  auto options = worker::RuntimeOptionsOf(train);
  if (!options.ok()) return options.status();
  return RuntimeOptions(std::make_unique<worker::RuntimeOptions>(std::move(*options)));
}

WorkerContext::WorkerContext(const TrainConfig& train_config, std::function<bool()> stopping_fn,
                             worker::DataPlane& data_plane)
    : train(train_config), stopping(std::move(stopping_fn)), data_plane_(data_plane) {}

Runtime::Runtime(const RuntimeOptions& options, WorkerContext& context)
    : impl_(std::make_unique<worker::Runtime>(*options.impl_, context.data_plane_)) {}
Runtime::~Runtime() = default;

Status Runtime::Attach(std::span<float> params, std::span<float> grads, std::vector<TensorSpec> tensors) {
  std::vector<v1::TensorSpec> specs(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    specs[i].set_name(std::move(tensors[i].name));
    specs[i].set_dtype(v1::DTYPE_FLOAT32);
    for (int64_t d : tensors[i].shape) specs[i].add_shape(d);
    specs[i].set_flat_offset(tensors[i].flat_offset);
    specs[i].set_group(std::move(tensors[i].group));
  }
  return impl_->Attach(params, grads, std::move(specs));
}

Result<StepPlan> Runtime::BeginStep() {
  auto plan = impl_->BeginStep();
  if (!plan.ok()) return plan.status();
  StepPlan p;
  p.step = plan->step;
  p.epoch = plan->epoch;
  p.rank = plan->rank;
  p.world_size = plan->world_size;
  p.dp_rank = plan->dp_rank;
  p.dp_size = plan->dp_size;
  p.resynced = plan->resynced;
  return p;
}

void Runtime::GradientsReady(size_t ready_from) {
  impl_->GradientsReady(ready_from);
}

void Runtime::SetStepLearningRate(double lr) {
  impl_->SetStepLearningRate(lr);
}

Result<StepResult> Runtime::EndStep(double loss_share, uint64_t samples, uint64_t tokens) {
  auto done = impl_->EndStep(loss_share, samples, tokens);
  if (!done.ok()) return done.status();
  StepResult r;
  r.step = done->step;
  r.epoch = done->epoch;
  r.loss = done->loss;
  r.samples = done->samples;
  r.tokens = done->tokens;
  r.comm_seconds = done->comm_seconds;
  r.exposed_seconds = done->exposed_seconds;
  r.skipped = done->skipped;
  return r;
}

Status Runtime::FinishRun() {
  return impl_->FinishRun();
}

bool Runtime::Fatal(const Status& status) const {
  return impl_->Fatal(status);
}

uint64_t Runtime::completed_steps() const {
  return impl_->completed_steps();
}

void Runtime::Stop() {
  impl_->Stop();
}

int RunWorker(int argc, char** argv, TrainingLoop loop) {
  worker::TrainingLoop inner;
  if (loop) {
    inner = [loop = std::move(loop)](worker::WorkerContext& context) {
      WorkerContext ctx(context.train, context.stopping, context.data_plane);
      return loop(ctx);
    };
  }
  return RunDaemon(argc, argv, worker::MakeDaemonSpec(std::move(inner)));
}

void Log(LogLevel level, std::string_view message) {
  switch (level) {
    case LogLevel::kDebug:
      spdlog::debug("{}", message);
      break;
    case LogLevel::kInfo:
      spdlog::info("{}", message);
      break;
    case LogLevel::kWarning:
      spdlog::warn("{}", message);
      break;
    case LogLevel::kError:
      spdlog::error("{}", message);
      break;
  }
}

}  // namespace tandem
