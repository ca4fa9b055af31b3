// The worker runtime's step sequence (runtime.h): attaching and binding
// the model, BeginStep (waiting for an epoch; resync.cc joins it),
// GradientsReady and EndStep over the mode's step (step.h), the end of the
// run, the servers' checkpoints, and the communication thread that runs
// the step's collectives and server operations in order.
#include "worker/runtime/runtime.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include <spdlog/spdlog.h>

#include "common/failpoint.h"
#include "worker/runtime/buckets.h"
#include "worker/runtime/step.h"
#include "worker/runtime/trace_spans.h"

namespace tandem::worker {

using runtime_internal::Clock;
using runtime_internal::PartName;
using runtime_internal::Seconds;

std::string_view ModeName(TrainingMode mode) {
  switch (mode) {
    case TrainingMode::kHybrid:
      return "hybrid";
    case TrainingMode::kAllReduce:
      return "allreduce";
    case TrainingMode::kPs:
      return "ps";
  }
  return "hybrid";
}

Result<TrainingMode> ParseTrainingMode(std::string_view name) {
  if (name == "hybrid") return TrainingMode::kHybrid;
  if (name == "allreduce") return TrainingMode::kAllReduce;
  if (name == "ps") return TrainingMode::kPs;
  return InvalidArgument("training mode '{}' is not one of hybrid, allreduce, ps", name);
}

std::string_view PlacementName(Placement placement) {
  return placement == Placement::kSharded ? "sharded" : "replicated";
}

Result<Placement> ParsePlacement(std::string_view name) {
  if (name == "replicated") return Placement::kReplicated;
  if (name == "sharded") return Placement::kSharded;
  return InvalidArgument("placement '{}' is not one of replicated, sharded", name);
}

Runtime::Runtime(RuntimeOptions options, DataPlane& plane) : options_(std::move(options)), plane_(plane) {
  options_.optimizer.set_reduction(v1::GRADIENT_REDUCTION_SUM);
  strategy_ = StepStrategy::Create(options_.mode, *this);
  comm_thread_ = std::thread([this] { CommLoop(); });
}

Runtime::~Runtime() {
  Stop();
  {
    MutexLock lock(&mu_);
    quit_ = true;
    cv_.NotifyAll();
  }
  comm_thread_.join();
}

void Runtime::Stop() {
  stopped_ = true;
  MutexLock lock(&mu_);
  cv_.NotifyAll();
}

Status Runtime::CheckBuffers(std::span<float> params, std::span<float> grads,
                             const std::vector<v1::TensorSpec>& tensors) {
  if (params.size() != grads.size()) {
    return InvalidArgument("parameters ({} elements) and gradients ({} elements) differ in size", params.size(),
                           grads.size());
  }
  if (params.empty()) return InvalidArgument("the model has no parameters");
  uint64_t covered = 0;
  for (const auto& t : tensors) {
    uint64_t n = 1;
    for (int64_t d : t.shape()) n *= static_cast<uint64_t>(d);
    if (t.flat_offset() != covered) {
      return InvalidArgument("tensor '{}' starts at element {}, but the tensors before it end at {}", t.name(),
                             t.flat_offset(), covered);
    }
    covered += n;
  }
  if (covered != params.size()) {
    return InvalidArgument("the tensor table covers {} elements, but the parameters have {}", covered, params.size());
  }
  return Status::Ok();
}

Status Runtime::Attach(std::span<float> params, std::span<float> grads, std::vector<v1::TensorSpec> tensors) {
  TANDEM_RETURN_IF_ERROR(CheckBuffers(params, grads, tensors));
  ModelBinding model;
  model.tensors = [tensors](int, int) { return tensors; };
  const size_t n = params.size();
  model.bounds = [n](int stages, int tensor_parallel) -> Result<std::vector<size_t>> {
    if (stages != 1 || tensor_parallel != 1) {
      return InvalidArgument(
          "the mesh has pp={} pipeline stages and tp={} tensor-parallel ranks, but the training loop attached one "
          "flat model (Runtime::Attach); model parallelism needs a model that can be split (Runtime::AttachModel)",
          stages, tensor_parallel);
    }
    return std::vector<size_t>{0, n};
  };
  model.bind = [params, grads, tensors](int, int, int, int) -> Result<StageBuffers> {
    return StageBuffers{params, grads, tensors, 0};
  };
  model.initial = [params](uint64_t b, uint64_t e, float* out) {
    std::memcpy(out, params.data() + b, (e - b) * sizeof(float));
  };
  return AttachModel(std::move(model));
}

Status Runtime::AttachModel(ModelBinding model) {
  if (!model.tensors || !model.bounds || !model.bind || !model.initial) {
    return InvalidArgument("the model binding needs tensors, bounds, bind and initial");
  }
  if (options_.gradient_wire != v1::WIRE_DTYPE_FP32 && options_.gradient_wire != v1::WIRE_DTYPE_BF16) {
    return InvalidArgument("gradient wire type must be fp32 or bf16");
  }
  if (options_.parameter_wire != v1::WIRE_DTYPE_FP32 && options_.parameter_wire != v1::WIRE_DTYPE_BF16) {
    return InvalidArgument("parameter wire type must be fp32 or bf16");
  }
  if (asynchronous()) {
    const char* name = options_.consistency.mode() == v1::CONSISTENCY_MODE_ASYNC ? "async" : "bounded";
    if (options_.mode == TrainingMode::kAllReduce) {
      return InvalidArgument(
          "consistency {}: asynchronous updates are the parameter servers'; allreduce mode is "
          "synchronous (use hybrid or ps)",
          name);
    }
    if (options_.optimizer.max_grad_norm() > 0) {
      return InvalidArgument("consistency {}: global gradient-norm clipping (max_grad_norm) needs whole steps", name);
    }
    const auto kind = options_.optimizer.lr_schedule().kind();
    if (kind == v1::LR_SCHEDULE_KIND_COSINE || kind == v1::LR_SCHEDULE_KIND_LINEAR) {
      return InvalidArgument(
          "consistency {}: the servers' learning-rate schedule counts updates, one per contributor's push here, so a "
          "decaying schedule would not end with the run (use a constant one)",
          name);
    }
  }
  if (options_.placement == Placement::kSharded && options_.mode != TrainingMode::kHybrid) {
    return InvalidArgument(
        "placement sharded needs hybrid mode (the workers of a node share the parameters there), not {} mode",
        ModeName(options_.mode));
  }
  auto whole = model.bounds(1, 1);
  if (!whole.ok()) return whole.status();
  // The optimizer configuration is checked now, not at the first epoch.
  auto local = LocalOptimizer::Create(options_.optimizer, 0);
  if (!local.ok()) return local.status().WithContext("optimizer");
  model_ = std::move(model);
  attached_ = true;
  stages_ = 0;
  return Status::Ok();
}

v1::OptimizerConfig Runtime::OptimizerFor(int tp) const {
  v1::OptimizerConfig config = options_.optimizer;
  if (tp > 1) {
    auto& copies = (*config.mutable_group_overrides())[std::string(kTensorParallelCopyGroup)];
    copies.set_weight_decay(0);
    copies.set_exclude_from_grad_norm(true);
  }
  return config;
}

Status Runtime::BindStage(const DataPlane::EpochView& view) {
  const int stages = static_cast<int>(std::max<uint32_t>(1, view.epoch.mesh().pp()));
  const int stage = static_cast<int>(view.rank.mesh().pp());
  const int tp = static_cast<int>(std::max<uint32_t>(1, view.epoch.mesh().tp()));
  const int tp_rank = static_cast<int>(view.rank.mesh().tp());
  if (stages == stages_ && stage == stage_ && tp == tp_size_ && tp_rank == tp_rank_) return Status::Ok();
  const std::string part_name = PartName(stage, stages, tp_rank, tp);
  auto bounds = model_.bounds(stages, tp);
  if (!bounds.ok()) return bounds.status();
  const auto part = static_cast<size_t>(stage * tp + tp_rank);
  if (bounds->size() != static_cast<size_t>(stages * tp) + 1 || stage >= stages || tp_rank >= tp) {
    return Internal("the model's split into {} stages of {} tensor-parallel ranks has {} bounds ({})", stages, tp,
                    bounds->size(), part_name);
  }
  auto buffers = model_.bind(stage, stages, tp_rank, tp);
  if (!buffers.ok()) return buffers.status().WithContext(part_name);
  TANDEM_RETURN_IF_ERROR(CheckBuffers(buffers->params, buffers->grads, buffers->tensors));
  if (buffers->base != (*bounds)[part] || buffers->base + buffers->params.size() != (*bounds)[part + 1]) {
    return Internal("{} holds elements [{}, {}), but the split says [{}, {})", part_name, buffers->base,
                    buffers->base + buffers->params.size(), (*bounds)[part], (*bounds)[part + 1]);
  }
  TANDEM_RETURN_IF_ERROR(strategy_->BindPart(tp, buffers->params.size()));
  if (stages_ != 0) {
    spdlog::info("epoch {}: this worker now trains {} (was {})", view.epoch.epoch(), part_name,
                 PartName(stage_, stages_, tp_rank_, tp_size_));
  }
  if (options_.placement == Placement::kSharded && (buffers->param_pages == nullptr || buffers->grad_pages == nullptr ||
                                                    buffers->param_pages->data() != buffers->params.data() ||
                                                    buffers->grad_pages->data() != buffers->grads.data())) {
    return InvalidArgument("placement sharded needs the model's parameters and gradients in page buffers");
  }
  param_pages_ = buffers->param_pages;
  grad_pages_ = buffers->grad_pages;
  bounds_ = std::move(*bounds);
  params_ = buffers->params;
  grads_ = buffers->grads;
  tensors_ = std::move(buffers->tensors);
  base_ = buffers->base;
  stage_ = stage;
  stages_ = stages;
  tp_rank_ = tp_rank;
  tp_size_ = tp;
  servers_initialized_ = false;
  stage_valid_ = stages * tp == 1 || completed_ == 0;  // a fresh model is valid only before the first step
  grads_step_ = 0;
  return Status::Ok();
}

bool Runtime::Fatal(const Status& status) const {
  switch (status.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kPermissionDenied:
    case StatusCode::kUnauthenticated:
    case StatusCode::kUnimplemented:
    case StatusCode::kOutOfRange:
    case StatusCode::kDataLoss:
      return true;
    default:
      return stopped_;
  }
}

Result<StepPlan> Runtime::BeginStep() {
  if (!attached_) return FailedPrecondition("BeginStep before Attach");
  if (in_step_) return FailedPrecondition("BeginStep while step {} is not ended (call EndStep first)", step_);
  bool resynced = false;
  while (true) {
    if (stopped_ || plane_.stopping()) return Cancelled("the worker is stopping");
    std::shared_ptr<const DataPlane::EpochView> view = plane_.built();
    if (!view || view->epoch.epoch() <= failed_epoch_) {
      const auto waited_from = Clock::now();
      view = plane_.WaitNewer(failed_epoch_, options_.epoch_wait);
      if (!view) {
        if (stopped_ || plane_.stopping()) return Cancelled("the worker is stopping");
        if (failed_epoch_ == 0) {
          return DeadlineExceeded("no membership epoch within {:.0f} s: is the coordinator forming the job?",
                                  Seconds(Clock::now() - waited_from));
        }
        return DeadlineExceeded("step {} failed in epoch {} ({}), and no new epoch came within {:.0f} s",
                                completed_ + 1, failed_epoch_, last_failure_.ToString(),
                                Seconds(Clock::now() - waited_from));
      }
    }
    if (view->epoch.epoch() != synced_epoch_) {
      // The last step's parameters may still be landing: they are pulled
      // again by the resync, so a failure to land them only matters when it
      // ends training.
      if (Status landing = Settle(); !landing.ok()) {
        if (Fatal(landing)) return landing;
        spdlog::info("epoch {}: the parameters of step {} did not all arrive ({}); the resync pulls them",
                     view->epoch.epoch(), completed_, landing.ToString());
      }
      for (auto& b : buckets_) b->landed = 0;
      Status s = Resync(*view);
      if (!s.ok()) {
        if (Fatal(s)) return s.WithContext(fmt::format("joining epoch {}", view->epoch.epoch()));
        spdlog::warn("epoch {}: resynchronising failed, waiting for the next epoch: {}", view->epoch.epoch(),
                     s.ToString());
        failed_epoch_ = view->epoch.epoch();
        last_failure_ = s;
        continue;
      }
      resynced = true;
    }
    if (view->epoch.paused()) {
      // Paused (the job is below its minimum of workers): every member has
      // resynchronised at the epoch's start, and none trains until a later
      // epoch. No time limit: a join or an operator ends the pause.
      if (paused_epoch_ != view->epoch.epoch()) {
        paused_epoch_ = view->epoch.epoch();
        spdlog::info(
            "epoch {}: training paused after step {}: the job has {} workers, below its minimum; waiting "
            "for workers to join",
            view->epoch.epoch(), completed_, view->epoch.worker_count());
      }
      (void)plane_.WaitNewer(view->epoch.epoch(), std::chrono::milliseconds(500));
      continue;
    }
    break;
  }
  in_step_ = true;
  parameter_bytes_ = 0;
  step_ = completed_ + 1;
  step_began_ = Clock::now();
  {
    MutexLock lock(&mu_);
    waited_for_.clear();
  }
  // grads_step_: the server modes' last bucket's landing clears it (EnqueueFinish).
  strategy_->BeginStep();
  next_bucket_ = 0;
  parameter_wait_ = 0;
  // The step on this worker's timeline, whatever loop drives it (the
  // reference trainer, a PyTorch script): it ends in EndStep.
  trace::SetThreadStep(step_);
  trace_step_start_ = TraceStart(step_);
  StepPlan plan;
  plan.step = step_;
  plan.epoch = synced_epoch_;
  plan.rank = view_->rank.global_rank();
  plan.world_size = view_->rank.world_size();
  plan.dp_rank = view_->rank.mesh().dp();
  plan.dp_size = std::max<uint32_t>(1, view_->epoch.mesh().dp());
  plan.resynced = resynced;
  plan.stage = static_cast<uint32_t>(stage_);
  plan.stages = static_cast<uint32_t>(stages_);
  plan.pipeline = pipeline_;
  plan.tensor_rank = static_cast<uint32_t>(tp_rank_);
  plan.tensor_size = static_cast<uint32_t>(tp_size_);
  plan.tensor = tensor_;
  return plan;
}

void Runtime::SetStepLearningRate(double lr) {
  lr_.store(lr);
}

Status Runtime::SetInitialState(std::string resume_from, v1::OptimizerConfig optimizer) {
  if (options_.mode == TrainingMode::kAllReduce) return FailedPrecondition("allreduce mode has no parameter servers");
  if (in_step_ || synced_epoch_ != 0 || completed_ != 0 || servers_initialized_) {
    return FailedPrecondition("the servers' initial state is set before the first step");
  }
  optimizer.set_reduction(v1::GRADIENT_REDUCTION_SUM);  // as the constructor sets the options' (see "Gradients")
  options_.resume_from = std::move(resume_from);
  options_.optimizer = std::move(optimizer);
  return Status::Ok();
}

void Runtime::GradientsReady(size_t ready_from) {
  if (!in_step_) return;
  if (next_bucket_ == 0) {  // nothing of the step sent yet: the step's learning rate
    step_lr_ = lr_.load();
    strategy_->StartGradients(step_lr_);
  }
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_]->begin >= ready_from) {
    Bucket* b = buckets_[next_bucket_++].get();
    Enqueue([this, b] { return strategy_->RunBucket(*b); });
  }
}

Result<StepResult> Runtime::EndStep(double loss_share, uint64_t samples, uint64_t tokens, std::span<float> more) {
  if (!in_step_) return FailedPrecondition("EndStep without BeginStep");
  if (more.size() > kMaxStepFigures) {
    return InvalidArgument("EndStep: {} more figures, at most {}", more.size(), kMaxStepFigures);
  }
  // The step's span ends when EndStep returns, done or failed.
  struct StepSpan {
    Runtime& rt;
    bool done = false;
    ~StepSpan() {
      if (rt.trace_step_start_ == 0) return;
      trace::Complete("step", "step", rt.trace_step_start_, trace::Now(), rt.step_,
                      {{"epoch", static_cast<int64_t>(rt.view_->epoch.epoch())},
                       {"rank", rt.view_->rank.global_rank()},
                       {"done", done}});
      rt.trace_step_start_ = 0;
    }
  } step_span{*this};
  // Sharded: the gradient is handed back bucket by bucket as it is sent, so
  // there is none to push again.
  grads_step_ = sharded_ ? 0 : step_;
  grads_world_ = view_->rank.world_size();
  if (const auto& parts = view_->epoch.shard_map().partitions(); !parts.empty()) {
    pushed_primaries_.assign(static_cast<size_t>(parts.size()), 0);
    for (const auto& p : parts) {
      if (p.id() < pushed_primaries_.size()) pushed_primaries_[p.id()] = p.primary_member_id();
    }
  }
  GradientsReady(0);
  if (FailpointNumber("train.crash_after_push") == step_) {  // a worker dying with a step in flight, for tests
    FailpointCrashSoon(fmt::format("train.crash_after_push: step {} is pushed; this worker dies", step_), 500);
  }
  grads_lr_ = step_lr_;
  loss_in_[0] = static_cast<float>(loss_share);
  loss_in_[1] = static_cast<float>(samples);
  loss_in_[2] = static_cast<float>(tokens);
  std::copy(more.begin(), more.end(), loss_in_.begin() + 3);
  figures_ = 3 + more.size();
  const uint64_t complete = strategy_->EnqueueFinish();
  const auto waited = Clock::now();
  Status status;
  double busy = 0;
  {
    // The step's exposed communication: what backward did not hide.
    trace::Span span("end_step_wait", "step", step_);
    MutexLock lock(&mu_);
    cv_.Wait(lock, [&]() TANDEM_REQUIRES(mu_) { return finished_ >= complete; });
    // A bucket landing after `complete` may have failed meanwhile: the step
    // is complete all the same; the next Acquire reports that failure.
    if (failed_ticket_ <= complete) status = step_status_;
    busy = comm_busy_;
    comm_busy_ = 0;
  }
  // A failed step: what is still queued is skipped, and the next step
  // starts from a clean status.
  if (!status.ok()) (void)Settle();
  in_step_ = false;
  StepResult result;
  result.step = step_;
  result.epoch = synced_epoch_;
  result.parameter_wait_seconds = parameter_wait_;
  result.exposed_seconds = Seconds(Clock::now() - waited) + parameter_wait_;
  result.comm_seconds = busy;
  parameter_wait_ = 0;
  if (!status.ok()) {
    failed_epoch_ = synced_epoch_;
    last_failure_ = status;
    synced_epoch_ = 0;  // the next step resynchronises
    return status;
  }
  // The update, where the worker applies it (allreduce mode; the servers did otherwise).
  if (Status applied = strategy_->Apply(result); !applied.ok()) {
    if (!Fatal(applied)) {  // the parts' norm could not be summed: resync as after a failed step
      failed_epoch_ = synced_epoch_;
      last_failure_ = applied;
      synced_epoch_ = 0;
    }
    return applied;
  }
  NoteParameterBytes();
  result.parameter_bytes = parameter_bytes_;
  parameter_bytes_ = 0;
  result.loss = loss_out_[0];
  result.samples = static_cast<uint64_t>(loss_out_[1]);
  result.tokens = static_cast<uint64_t>(loss_out_[2]);
  std::copy_n(loss_out_.begin() + 3, more.size(), more.begin());
  ReportWait();
  completed_ = step_;
  step_span.done = true;
  plane_.ReportStep(completed_);
  return result;
}

void Runtime::ReportWait() {
  const auto now = Clock::now();
  v1::StepWait wait;
  wait.set_step(step_);
  // The step's wall time: since the previous step ended, or (after a gap: the
  // first step, a resync) since this one began.
  wait.set_step_seconds(Seconds(now - (last_end_step_ != 0 && last_end_step_ + 1 == step_ ? last_end_ : step_began_)));
  last_end_ = now;
  last_end_step_ = step_;
  {
    MutexLock lock(&mu_);
    for (const auto& [member, seconds] : waited_for_) {
      if (wait.late_member_id() == 0 || seconds > wait.late_seconds()) {
        wait.set_late_member_id(member);
        wait.set_late_seconds(seconds);
      }
    }
    if (wait.late_member_id() != 0) wait.set_scope(waited_in_);
    waited_for_.clear();
  }
  plane_.ReportStepWait(std::move(wait));
}

void Runtime::NoteWait(const comm::Communicator& comm) {
  const comm::Wait wait = comm.last_wait();
  const uint64_t member = comm.member_id(wait.rank);
  if (member == 0) return;
  MutexLock lock(&mu_);
  waited_for_[member] += wait.seconds;
  waited_in_ = comm.name();
}

Status Runtime::ReduceLoss() {
  if (asynchronous()) {
    // No collective over the workers during a step: this worker's own
    // shard's loss, scaled to the global mean's scale.
    loss_out_ = loss_in_;
    loss_out_[0] = loss_in_[0] * static_cast<float>(std::max<uint32_t>(1, view_->epoch.mesh().dp()));
    return Status::Ok();
  }
  const int64_t start = TraceStart(step_);
  Status reduced =
      world_->AllReduce(loss_in_.data(), loss_out_.data(), figures_, comm::DType::kFloat32, comm::ReduceOp::kSum);
  TraceCollective("loss_allreduce", *world_, step_, start, figures_ * sizeof(float), reduced.ok());
  return reduced;
}

Status Runtime::AllReduceBetweenSteps(float* values, size_t count) {
  if (in_step_) return FailedPrecondition("AllReduceBetweenSteps during a step");
  if (synced_epoch_ == 0 || world_ == nullptr) return FailedPrecondition("no synced epoch to reduce over");
  std::vector<float> sum(count);
  TANDEM_RETURN_IF_ERROR(world_->AllReduce(values, sum.data(), count, comm::DType::kFloat32, comm::ReduceOp::kSum));
  std::copy(sum.begin(), sum.end(), values);
  return Status::Ok();
}

void Runtime::AbandonStep(const Status& why) {
  if (trace_step_start_ != 0) {  // the step's span, given up
    trace::Complete("step", "step", trace_step_start_, trace::Now(), step_, {{"done", false}});
    trace_step_start_ = 0;
  }
  if (in_step_) EndFailedStep(why);
}

void Runtime::EndFailedStep(const Status& why) {
  (void)Settle();
  parameter_wait_ = 0;
  in_step_ = false;
  failed_epoch_ = synced_epoch_;
  last_failure_ = why;
  synced_epoch_ = 0;
}

Status Runtime::FinishRun() {
  if (synced_epoch_ == 0) return Status::Ok();
  return strategy_->FinishRun();
}

Status Runtime::WaitForEveryWorker() {
  // Through the coordinator's epoch values rather than a collective: the
  // slowest worker may be further behind than a communicator's timeout.
  const uint64_t epoch = synced_epoch_;
  std::unique_ptr<comm::Rendezvous> values = plane_.EpochValues(epoch);
  if (!values) return Aborted("epoch {} was superseded before the end of the run", epoch);
  const uint32_t world = view_->rank.world_size();
  TANDEM_RETURN_IF_ERROR(
      values->Put(fmt::format("runtime/finished/{}", view_->rank.global_rank()), std::to_string(completed_))
          .WithContext("telling the other workers that this one ended its last step"));
  const auto started = Clock::now();
  auto next_note = started + std::chrono::seconds(10);
  for (uint32_t r = 0; r < world; ++r) {
    while (true) {
      if (stopped_ || plane_.stopping()) return Cancelled("the worker is stopping");
      auto got = values->Get(fmt::format("runtime/finished/{}", r), std::chrono::milliseconds(1000));
      if (got.ok()) break;
      if (got.status().code() != StatusCode::kDeadlineExceeded) {
        return got.status().WithContext("waiting for the other workers to end their last step");
      }
      if (Clock::now() >= next_note) {
        spdlog::info(
            "step {} was this worker's last; waiting {:.0f} s so far for rank {} (and any after it) to end "
            "theirs",
            completed_, Seconds(Clock::now() - started), r);
        next_note = Clock::now() + std::chrono::seconds(30);
      }
    }
  }
  return Status::Ok();
}

Result<std::vector<v1::CheckpointInfo>> Runtime::SaveCheckpoint(const std::string& directory, uint64_t step) {
  PsClient* ps = plane_.ps_client();
  if (ps == nullptr) return FailedPrecondition("checkpoints need parameter servers (train.mode hybrid or ps)");
  return ps->SaveCheckpoint(directory, step, "", /*async=*/true);
}

Result<bool> Runtime::CheckpointWriting() {
  PsClient* ps = plane_.ps_client();
  if (ps == nullptr) return FailedPrecondition("checkpoints need parameter servers (train.mode hybrid or ps)");
  TANDEM_ASSIGN_OR_RETURN(auto stats, ps->Stats());
  for (const auto& [member, s] : stats) {
    if (s.last_checkpoint().state() == v1::CHECKPOINT_STATE_IN_PROGRESS) return true;
  }
  return false;
}

Status Runtime::WaitForCheckpoint(const std::string& id, std::chrono::steady_clock::time_point deadline) {
  PsClient* ps = plane_.ps_client();
  if (ps == nullptr) return FailedPrecondition("checkpoints need parameter servers (train.mode hybrid or ps)");
  for (;;) {
    TANDEM_ASSIGN_OR_RETURN(auto stats, ps->Stats());
    bool done = true;
    for (const auto& [member, s] : stats) {
      const v1::CheckpointInfo& c = s.last_checkpoint();
      if (c.checkpoint_id() != id) {
        return Aborted("server {} reports checkpoint '{}', not '{}'", member, c.checkpoint_id(), id);
      }
      if (c.state() == v1::CHECKPOINT_STATE_FAILED) {
        return Internal("server {} failed to write checkpoint '{}': {}", member, id, c.error());
      }
      if (c.state() != v1::CHECKPOINT_STATE_COMPLETE) done = false;
    }
    if (done) return Status::Ok();
    if (std::chrono::steady_clock::now() >= deadline || stopped_) {
      return DeadlineExceeded("checkpoint '{}' is still being written", id);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

uint64_t Runtime::Enqueue(std::function<Status()> task) {
  MutexLock lock(&mu_);
  queue_.push_back(std::move(task));
  cv_.NotifyAll();
  return ++enqueued_;
}

Status Runtime::WaitFor(uint64_t ticket) {
  MutexLock lock(&mu_);
  cv_.Wait(lock, [&]() TANDEM_REQUIRES(mu_) { return finished_ >= ticket; });
  return step_status_;
}

Status Runtime::Settle() {
  MutexLock lock(&mu_);
  cv_.Wait(lock, [&]() TANDEM_REQUIRES(mu_) { return queue_.empty() && running_ == 0; });
  Status status = std::move(step_status_);
  step_status_ = Status::Ok();
  comm_busy_ = 0;
  // After a failure, the tasks that would have let go of these were skipped.
  for (auto& b : buckets_) {
    b->pushes.clear();
    b->pulls.clear();
  }
  return status;
}

void Runtime::CommLoop() {
  trace::SetThreadName("comm");
  MutexLock lock(&mu_);
  while (true) {
    cv_.Wait(lock, [&]() TANDEM_REQUIRES(mu_) { return quit_ || !queue_.empty(); });
    if (queue_.empty()) return;
    auto task = std::move(queue_.front());
    queue_.pop_front();
    ++running_;
    const bool failed = !step_status_.ok();
    lock.Unlock();
    Status s;
    const auto t0 = Clock::now();
    if (stopped_) {
      // Stop(): what is queued is not started (a pull could wait for its
      // whole timeout), and whoever waits for it learns why.
      if (!failed) s = Cancelled("the worker is stopping");
    } else if (!failed) {
      s = task();
    }
    const double dt = Seconds(Clock::now() - t0);
    lock.Lock();
    comm_busy_ += dt;
    if (!s.ok() && step_status_.ok()) {
      step_status_ = std::move(s);
      failed_ticket_ = finished_ + 1;
    }
    --running_;
    ++finished_;
    cv_.NotifyAll();
  }
}

}  // namespace tandem::worker
