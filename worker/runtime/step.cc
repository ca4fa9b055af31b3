// The per-mode step (step.h): the factory, and each mode's end of a step:
// what EndStep queues after the last bucket, the update applied in the
// worker (allreduce mode), and the end of the run.
#include "worker/runtime/step.h"

#include <algorithm>
#include <iterator>

#include "common/trace.h"
#include "worker/runtime/buckets.h"

namespace tandem::worker {

using runtime_internal::Clock;
using runtime_internal::Seconds;

std::unique_ptr<Runtime::StepStrategy> Runtime::StepStrategy::Create(TrainingMode mode, Runtime& rt) {
  switch (mode) {
    case TrainingMode::kAllReduce:
      return std::make_unique<AllReduceStep>(rt);
    case TrainingMode::kPs:
      return std::make_unique<PsStep>(rt);
    case TrainingMode::kHybrid:
      break;
  }
  return std::make_unique<HybridStep>(rt);
}

Status Runtime::AllReduceStep::BindPart(int tp, size_t parameters) {
  // An external optimizer keeps its own state: the local one only counts updates.
  auto local = LocalOptimizer::Create(rt_.OptimizerFor(tp), rt_.options_.external_optimizer ? 0 : parameters);
  if (!local.ok()) return local.status().WithContext("optimizer");
  local_ = std::move(*local);
  return Status::Ok();
}

void Runtime::AllReduceStep::BeginStep() {
  rt_.grads_step_ = 0;  // nothing lands after the step: no step to push again
}

void Runtime::AllReduceStep::StartGradients(double lr) {
  if (local_) local_->set_learning_rate(lr);
}

uint64_t Runtime::AllReduceStep::EnqueueFinish() {
  return rt_.Enqueue([this] { return rt_.ReduceLoss(); });
}

Status Runtime::AllReduceStep::Apply(StepResult& result) {
  if (rt_.options_.external_optimizer) {
    local_->set_updates(local_->updates() + 1);  // the caller applies it
    return Status::Ok();
  }
  trace::Span span("optimizer", "compute", rt_.step_);
  const auto t0 = Clock::now();
  LocalOptimizer::NormCombiner combine;
  if (rt_.stages_ * rt_.tp_size_ > 1) {
    // Each worker holds one part: the whole model's norm and finiteness
    // are the parts' together. Every part's dp replicas hold the same
    // summed gradient, so the world's sum counts each part dp times.
    const auto dp = static_cast<float>(std::max<uint32_t>(1, rt_.view_->epoch.mesh().dp()));
    combine = [this, dp](const optim::GradScan& part) -> Result<optim::GradScan> {
      float mine[2] = {static_cast<float>(part.sum_squares), part.finite ? 0.0f : 1.0f};
      float all[2] = {0, 0};
      TANDEM_RETURN_IF_ERROR(rt_.world_->AllReduce(mine, all, 2, comm::DType::kFloat32, comm::ReduceOp::kSum)
                                 .WithContext("summing the parts' gradient norms"));
      return optim::GradScan{static_cast<double>(all[0]) / dp, all[1] == 0.0f};
    };
  }
  Status applied = local_->Step(rt_.params_, rt_.grads_, rt_.tensors_, &result.skipped, combine);
  result.optimizer_seconds = Seconds(Clock::now() - t0);
  return applied;
}

uint64_t Runtime::ServerStep::EnqueueFinish() {
  if (rt_.asynchronous()) {
    rt_.Enqueue([this]() -> Status {
      TANDEM_RETURN_IF_ERROR(FinishPushes());
      PostPulls();
      pulls_posted_ = true;
      return Status::Ok();
    });
  } else {
    rt_.Enqueue([this] { return FinishPushes(); });
  }
  // Buckets land in the order the next forward reads them (the first
  // elements first). Any pull answered proves the step decided, and a
  // decided step is applied on every server (a server that died before
  // applying it has it pushed again after the resync, from the gradient
  // kept until the last bucket landed): the step is complete once the first
  // bucket landed, and the rest arrive while the next step's forward runs,
  // which waits for each bucket in Acquire.
  uint64_t complete = 0;
  for (auto it = rt_.buckets_.rbegin(); it != rt_.buckets_.rend(); ++it) {
    Bucket* b = it->get();
    const bool last = std::next(it) == rt_.buckets_.rend();
    b->landed = rt_.Enqueue([this, b, last, step = rt_.step_]() -> Status {
      TANDEM_RETURN_IF_ERROR(LandBucket(*b, step));
      // Every partition of the stage applied the step: its gradient is no
      // longer needed (unless the next step's gradient is already there).
      uint64_t expected = step;
      if (last) rt_.grads_step_.compare_exchange_strong(expected, 0);
      return Status::Ok();
    });
    if (complete == 0 && rt_.options_.overlap_parameter_landing)
      complete = rt_.Enqueue([this] { return rt_.ReduceLoss(); });
  }
  if (complete == 0) complete = rt_.Enqueue([this] { return rt_.ReduceLoss(); });
  return complete;
}

Status Runtime::ServerStep::FinishRun() {
  if (Status landed = rt_.WaitForParameters(); !landed.ok()) {  // nothing of the last step lands after this
    rt_.EndFailedStep(landed);
    return landed;
  }
  if (!rt_.asynchronous()) {
    if (!rt_.options_.overlap_parameter_landing) return Status::Ok();
    float mine = 0, all = 0;
    Status s = rt_.world_->AllReduce(&mine, &all, 1, comm::DType::kFloat32, comm::ReduceOp::kSum)
                   .WithContext("waiting for every worker's final parameters");
    if (!s.ok()) rt_.EndFailedStep(s);
    return s;
  }
  Status s = rt_.WaitForEveryWorker();
  if (s.ok()) {
    // No push changes the servers' parameters any more.
    auto pulled = rt_.PullStage(rt_.view_->epoch.shard_map(), 0, nullptr);
    s = pulled.ok() ? Status::Ok() : pulled.status().WithContext("pulling the final parameters");
  }
  // As a failed step: the next BeginStep resynchronises in a newer epoch.
  if (!s.ok()) rt_.EndFailedStep(s);
  return s;
}

}  // namespace tandem::worker
