// The worker runtime: data-parallel training steps over the epoch's
// communicators and parameter servers (docs/training.md, "The worker
// runtime").
//
// A training loop hands the runtime its flat parameter and gradient buffers
// (Attach) and then, every step:
//
//   plan = BeginStep()            which step, and this rank's share of the batch
//   ... forward and backward ...  calling GradientsReady(offset) as backward
//                                 finishes the gradients of [offset, end)
//   result = EndStep(loss, ...)   parameters updated for the next step
//
// Modes:
// - hybrid (default): gradients go out in buckets of whole parameter-server
//   partitions as backward makes them ready. Inside a node the local ranks
//   reduce-scatter each bucket so that local rank i holds the node's sum of
//   the bucket's partitions whose id is i mod L; it pushes those to their
//   servers (one contribution per node) and pulls them back once the servers
//   applied the step; the node all-gathers the pulled parameters.
// - ps: every worker pushes every partition itself (one contribution per
//   worker) and pulls every partition.
// - allreduce: no servers. Each bucket is summed over all workers with an
//   all-reduce while backward goes on; every worker then applies the same
//   optimizer locally (DDP-like), with the same kernels the servers use.
//
// Gradients. The runtime sums the ranks' gradients, so each rank passes its
// share of the global mean: the gradient of (sum of its samples' losses) /
// (global batch), not of its own mean. The servers are configured with SUM
// reduction accordingly. With this, N workers compute the same update as one
// process on the whole global batch, up to the order of float additions.
//
// Membership changes. When a worker dies or joins, the coordinator publishes
// a new epoch and the data plane aborts the old communicators, so the step in
// flight fails (EndStep returns the error; nothing was applied twice: the
// servers discard an undecided step of a superseded epoch). The next
// BeginStep waits for the new epoch and resynchronises: with servers, every
// worker pulls the parameters the servers hold and the ranks agree on the
// last applied step (a step the servers decided is complete even if its pull
// was cut off); in allreduce mode the ranks agree on the highest completed
// step and the lowest rank that completed it broadcasts parameters and
// optimizer state. The loop then retries from the step after it, with the
// new data-parallel rank and size: no checkpoint, no restart. In a paused
// epoch (MembershipEpoch.paused: the job is below the minimum of workers an
// operator asked for) BeginStep resynchronises and then waits, without a time
// limit, for the next epoch.
//
// Pipeline parallelism. With a mesh of pp > 1 stages, each worker trains
// one stage: the model is attached with AttachModel, and the
// runtime asks it for the stage of the worker's pp coordinate whenever that
// changes (the first epoch, or a re-ranking after a membership change). The
// stage's parameters are one contiguous range of the whole model's flat
// buffer. Gradients are summed over the stage's data-parallel group: inside
// a node over the "node-dp" group (the node's workers of that stage), then
// by the servers, where a partition that straddles two stages gets one
// contribution per node of each (zeros outside the contributor's range); in
// allreduce mode over the stage's "dp" group. The loss goes over the world
// (only the last stage has one). StepPlan::pipeline is the stage's "pp"
// group, over which the training loop runs its micro-batch schedule
// (worker/runtime/pipeline.h). A worker that moves to another stage pulls
// that stage's parameters from the servers; in allreduce mode it gets them
// from a worker of its new stage's dp group that holds them, and training
// stops with DATA_LOSS naming the stage when none does.
//
// Tensor parallelism. With a mesh of tp > 1, the workers of a "tp" group
// (inside one node) each hold a slice of every tensor of their stage (the
// model's business, worker/model/model.h) and StepPlan::tensor is the group
// over which the model all-reduces. For the runtime a (stage, tensor rank)
// is a part of the model like a stage: one contiguous range of the servers'
// space, whose gradients are summed over the part's "node-dp" and "dp"
// groups exactly as a stage's are. Every rank of a tp group computes the
// same loss: the training loop reports it (and the samples and tokens) from
// tensor rank 0 only.
//
// Asynchronous modes. With RuntimeOptions.consistency ASYNC or
// BOUNDED_STALENESS (server modes, tp = pp = 1) the servers apply each push
// on arrival, and a step has no collective over the workers: each pushes its
// gradient, waits for its pushes to be applied, then pulls the parameters as
// they are (bounded: once every worker's updates up to step s - k - 1 are in,
// for a worker about to compute step s). A worker's steps are its own; the
// loss it reports is its own shard's, scaled to the global mean (loss_share
// × dp), and samples and tokens its own. After a membership change every
// worker goes on from the highest step any worker completed (the epoch's
// start_step at least; the servers count pushes at or below it as
// duplicates; a step of which this worker sent any push counts as
// completed); pushes cut off by the change are lost or applied, never
// repeated. FinishRun, at the end, waits for every worker and pulls the
// servers' final parameters.
//
// Thread safety: BeginStep, GradientsReady and EndStep are called from the
// training thread only. Stop() may be called from any thread.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "common/page_buffer.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "tandem/v1/server.pb.h"
#include "worker/data_plane.h"
#include "worker/runtime/local_optimizer.h"

namespace tandem::worker {

enum class TrainingMode { kHybrid, kAllReduce, kPs };
// Where a worker keeps the parameters between steps (hybrid mode).
// replicated: every worker holds all of them. sharded (ZeRO-3): each worker
// of a node keeps only the parameter-server partitions it pushes and pulls
// (its shard); Forward and Backward gather each segment's parameters from
// the node's workers on demand (Acquire, with the next segment's gather
// prefetched) and hand them back after use (Release).
enum class Placement { kReplicated, kSharded };
std::string_view PlacementName(Placement placement);
Result<Placement> ParsePlacement(std::string_view name);
// "hybrid", "allreduce", "ps".
std::string_view ModeName(TrainingMode mode);
Result<TrainingMode> ParseTrainingMode(std::string_view name);
inline const std::vector<std::string>& TrainingModeNames() {
  static const std::vector<std::string> names = {"hybrid", "allreduce", "ps"};
  return names;
}

// The optimizer group of the copies that tensor ranks above 0 keep of a
// tensor-parallel model's replicated tensors (a model binding's tensor table
// names them so). With tp > 1 the runtime adds it to the optimizer: no
// weight decay (the replicated tensors of the reference model, LayerNorms,
// biases and position embeddings, have none), and out of the global
// gradient norm, which rank 0's copies already count in.
inline constexpr std::string_view kTensorParallelCopyGroup = "tp_copy";

struct RuntimeOptions {
  TrainingMode mode = TrainingMode::kHybrid;
  Placement placement = Placement::kReplicated;
  // Gradients go out in buckets of about this many bytes (whole partitions
  // in the server modes: at least one).
  size_t bucket_bytes = 1 << 20;
  // Element types on the wire: gradients pushed (or all-reduced) and
  // parameters pulled. FP32 or BF16.
  v1::WireDType gradient_wire = v1::WIRE_DTYPE_FP32;
  v1::WireDType parameter_wire = v1::WIRE_DTYPE_FP32;
  // The optimizer: sent to the servers, or applied locally in allreduce mode.
  // Its reduction is set to SUM (see "Gradients" above).
  v1::OptimizerConfig optimizer;
  // The longest wait for one step's communication (pulls included).
  std::chrono::milliseconds timeout{60000};
  // After a failed step, how long to wait for the coordinator's next epoch.
  std::chrono::milliseconds epoch_wait{60000};
  // Server modes: EndStep returns once the step is complete and the
  // parameters the next forward reads first have landed; the rest land
  // while that forward runs. The loop must then call Acquire(range) before
  // it reads parameters in `range` (the reference trainer's model does, a
  // segment at a time). Off: EndStep waits for every parameter.
  bool overlap_parameter_landing = false;
  // Server modes: the servers start from this checkpoint (absolute, on
  // their filesystem) instead of the model's initial values; the first
  // step is the one after the checkpoint's.
  std::string resume_from;
  // Server modes: where the job's checkpoints are (train.checkpoint_dir,
  // absolute; listed on this worker's filesystem, read by the servers on
  // theirs). When partitions lose both their primary and their backup (the
  // servers holding both died together), the synchronous modes roll the
  // whole job back to the newest checkpoint in it that restores (every
  // server's partitions, and the workers resume after its step). Empty: such
  // a loss ends training with an error saying so.
  std::string checkpoint_dir;
  // Server modes: how the servers apply pushes. SYNC (the default): every
  // step whole, once every contributor pushed it. ASYNC and
  // BOUNDED_STALENESS: each push on arrival; the workers of a data-parallel
  // mesh (tp = pp = 1) never wait for each other during a step (see
  // "Asynchronous modes" above).
  v1::ConsistencyConfig consistency;
  // Allreduce mode: the caller applies its own optimizer (the PyTorch front
  // end runs the user's torch.optim optimizer). EndStep then leaves the
  // gradient summed over the data-parallel group in the gradient buffer and
  // changes no parameter; `optimizer` is only checked. After a membership
  // change the rank that broadcasts the parameters also sends its optimizer
  // state: `save` serialises it there, and `load` restores it on every other
  // rank of the group. Called on the training thread, inside BeginStep; an
  // error from either ends training (a state that cannot be carried over).
  struct ExternalOptimizer {
    std::function<Result<std::string>()> save;
    std::function<Status(std::string_view)> load;
  };
  std::optional<ExternalOptimizer> external_optimizer;
};

// What BeginStep tells the training loop.
struct StepPlan {
  uint64_t step = 0;  // the step to run, >= 1: the servers hold the parameters after step - 1
  uint64_t epoch = 0;
  uint32_t rank = 0;  // global rank and world size of the epoch
  uint32_t world_size = 1;
  uint32_t dp_rank = 0;  // data-parallel rank and size: the batch's shard
  uint32_t dp_size = 1;
  bool resynced = false;  // the parameters were (re)loaded for this step
  // Pipeline parallelism: this worker's stage of `stages`, and the stage's
  // pp group (group rank = stage; null when stages == 1).
  uint32_t stage = 0;
  uint32_t stages = 1;
  std::shared_ptr<comm::Communicator> pipeline;
  // Tensor parallelism: this worker's rank of `tensor_size` in its tp group
  // (null when tensor_size == 1), over which the model all-reduces.
  uint32_t tensor_rank = 0;
  uint32_t tensor_size = 1;
  std::shared_ptr<comm::Communicator> tensor;
};

// One part of a model (a pipeline stage of a tensor-parallel rank): its
// parameters and gradients, the servers' flat elements [base, base +
// params.size()).
struct StageBuffers {
  std::span<float> params;
  std::span<float> grads;
  std::vector<v1::TensorSpec> tensors;  // the stage's tensors, flat_offset relative to params
  size_t base = 0;
  // The sharded placement hands pages of the parameters and gradients back
  // to the kernel: the buffers params and grads live in (null otherwise).
  PageBuffer* param_pages = nullptr;
  PageBuffer* grad_pages = nullptr;
};

// A model that can be split into pipeline stages and tensor-parallel ranks
// (Runtime::AttachModel). The servers hold every part of a split, part
// stage·tensor_parallel + rank after part: their flat space.
struct ModelBinding {
  // The servers' tensor table for a split (global flat offsets).
  std::function<std::vector<v1::TensorSpec>(int stages, int tensor_parallel)> tensors;
  // Where each part of a split into `stages` × `tensor_parallel` begins, and
  // the end: parts + 1 ascending offsets from 0 to the parameter count.
  // INVALID_ARGUMENT when the model cannot be split so (more stages than
  // blocks, a tp that does not divide the heads).
  std::function<Result<std::vector<size_t>>(int stages, int tensor_parallel)> bounds;
  // Makes this worker's model stage `stage` of `stages`, tensor-parallel
  // rank `tensor_rank` of `tensor_parallel` (with its initial parameters)
  // and returns its buffers, valid until the next call.
  std::function<Result<StageBuffers>(int stage, int stages, int tensor_rank, int tensor_parallel)> bind;
  // The initial values of the servers' [begin, end) for the last split
  // bound: the partitions that straddle two parts need both parts' values.
  std::function<void(uint64_t begin, uint64_t end, float* out)> initial;
};

// What EndStep reports.
struct StepResult {
  uint64_t step = 0;
  uint64_t epoch = 0;
  double loss = 0;          // the global loss: the sum of every rank's loss_share
  uint64_t samples = 0;     // over every rank
  uint64_t tokens = 0;      // over every rank
  double comm_seconds = 0;  // time the communication thread worked on this step
  // Communication the computation did not hide: the time EndStep waited
  // after backward, plus parameter_wait_seconds.
  double exposed_seconds = 0;
  // Time the step's forward and backward waited in Acquire for parameters:
  // the last step's, still landing from the servers, or (sharded) a
  // segment's gather from the node.
  double parameter_wait_seconds = 0;
  double optimizer_seconds = 0;  // allreduce mode: the local optimizer step
  bool skipped = false;          // allreduce mode: a non-finite gradient skipped the update
  // The most memory this worker's copies of the parameters took during the
  // step: the resident part of the model's parameter buffer (all of it when
  // replicated; the segments in use when sharded) plus the runtime's own
  // copies (the node's share of pulled partitions in hybrid mode).
  uint64_t parameter_bytes = 0;
};

class Runtime {
 public:
  Runtime(RuntimeOptions options, DataPlane& plane);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // The model: flat parameters and gradients (same size) and the tensor
  // table over them (TensorSpec.flat_offset, shapes, groups for the
  // optimizer's overrides). The buffers must outlive the runtime. On the
  // first sync the servers are initialised from `params` (the first worker
  // to call wins; every worker should start from the same values).
  Status Attach(std::span<float> params, std::span<float> grads, std::vector<v1::TensorSpec> tensors);
  // A model that can be split into pipeline stages: bound to a stage at the
  // first epoch (stage 0 of 1 when pp = 1).
  Status AttachModel(ModelBinding model);

  // Waits for an epoch (resynchronising after a membership change or a
  // failed step) and plans the next step. Errors: CANCELLED after Stop();
  // DEADLINE_EXCEEDED naming the failure when no new epoch came within
  // epoch_wait; INVALID_ARGUMENT and the like for a job the servers refuse.
  Result<StepPlan> BeginStep();

  // Backward has made the gradients of [ready_from, end) final: buckets
  // inside it start communicating. Cheap; never blocks.
  void GradientsReady(size_t ready_from);

  // The learning rate of the steps to come, valid until changed (a PyTorch
  // LR scheduler's value, set before each step): 0 (the default) means the
  // configured schedule's (RuntimeOptions::optimizer's lr_schedule), > 0
  // replaces it for the job-wide rule (groups' lr_scale overrides still
  // multiply it). Every mode applies it the same way: the server modes send
  // it with each of the step's pushes (ps::Frame::value), pushes sent again
  // after a failure included; allreduce mode gives it to the local
  // optimizer. A step takes the value set when its first gradients are
  // handed over (the first GradientsReady, or EndStep): set it before the
  // step's backward. A negative, NaN or Inf rate fails the step with
  // INVALID_ARGUMENT (fatal). Thread-safe.
  void SetStepLearningRate(double lr);

  // Server modes, before the first BeginStep: the servers start from the
  // checkpoint `resume_from` (as RuntimeOptions::resume_from says) with
  // `optimizer` as their configuration instead of the options'. The PyTorch
  // front end's load_state_dict writes the checkpoint from a torch optimizer
  // state. FAILED_PRECONDITION once a step began (the servers hold the state
  // then) or in allreduce mode.
  Status SetInitialState(std::string resume_from, v1::OptimizerConfig optimizer);

  // Finishes the step: sends what is left, waits for the updated parameters
  // (written into the attached buffer; with overlap_parameter_landing only
  // those the next forward reads first) and the global loss. `loss_share` is
  // this rank's loss times its share of the global batch; `samples` and
  // `tokens` are this rank's. A failure (a membership change, a peer that
  // died) leaves the step to be retried by the next BeginStep.
  //
  // `more` (at most kMaxStepFigures values) rides along: summed over the
  // world with the loss and written back in place, or left as it is in the
  // asynchronous modes (a worker's own figures there). The PyTorch front end
  // sends its progress figures so, without a collective of its own.
  Result<StepResult> EndStep(double loss_share, uint64_t samples, uint64_t tokens, std::span<float> more = {});
  static constexpr size_t kMaxStepFigures = 8;

  // Makes the parameters [now.first, now.second) of the stage's buffer
  // valid. Replicated: waits for those still landing from the last step
  // (overlap_parameter_landing; otherwise they already have). Sharded: waits
  // for their gather from the node's workers, and starts gathering `next`
  // (empty: none) meanwhile. The time waited counts as the step's
  // parameter_wait_seconds. Errors are the step's: the step fails. Release
  // (sharded only) hands back the pages
  // `now`'s gather wrote (but not those `next` is being gathered into). Every worker
  // of a node acquires the same segments in the same order (they run the
  // same model); outside a step too (writing the final parameters).
  Status Acquire(std::pair<size_t, size_t> now, std::pair<size_t, size_t> next);
  void Release(std::pair<size_t, size_t> now);

  // Gives up the step begun by BeginStep when its computation failed (a
  // pipeline peer died): waits for the communication already started, and
  // the next BeginStep resynchronises in a newer epoch, as after a failed
  // EndStep.
  void AbandonStep(const Status& why);
  // Waits until the parameters of the last step have all landed (with
  // overlap_parameter_landing EndStep may return before); without Acquire,
  // for a loop that is about to read the whole buffer (to save it). An error
  // is a failed step: give it to AbandonStep, and the next BeginStep
  // resynchronises.
  Status WaitForParameters();
  // After the last step (the BeginStep that planned the step past it),
  // before the final parameters are read. Asynchronous modes: waits, without
  // a time limit and through the coordinator, until every worker of the
  // epoch has ended its last step, logging every 30 s, then pulls the
  // servers' parameters, which no push changes any more. Synchronous
  // server modes with overlap_parameter_landing: waits until this worker's
  // parameters have all landed and then for every other worker's (one
  // all-reduce over the world), so that a worker that leaves the job as soon
  // as it is done (a Python script that ends) cannot cut off a peer's last
  // all-gather. Otherwise nothing to do. An error ends the step as a failed
  // one: the next BeginStep waits for a newer epoch and resynchronises.
  Status FinishRun();
  // Whether a failure ends training (bad configuration or input, state that
  // no worker holds any more, Stop()) rather than a membership change to
  // wait out.
  bool Fatal(const Status& status) const;

  // Steps completed (the servers', after a resync).
  uint64_t completed_steps() const { return completed_; }
  // A rollback to a checkpoint (see RuntimeOptions::checkpoint_dir) since
  // the last call: the last step completed before it (`from`) and the
  // checkpoint's step (`to`); the steps after `to` are trained again.
  struct Rollback {
    uint64_t from = 0;
    uint64_t to = 0;
    std::string checkpoint;
  };
  std::optional<Rollback> TakeRollback() {
    auto r = std::move(rollback_);
    rollback_.reset();
    return r;
  }
  // Server modes: has every parameter server save the state after `step`
  // into directory/step-<step>; returns once each has taken its copy (the
  // files are written meanwhile: WaitForCheckpoint). Call it on one worker,
  // after EndStep of `step` and before the next BeginStep: no server can be
  // past the step then.
  Result<std::vector<v1::CheckpointInfo>> SaveCheckpoint(const std::string& directory, uint64_t step);
  // Whether any parameter server is still writing a checkpoint (it would
  // refuse a new one while the others wrote it).
  Result<bool> CheckpointWriting();
  // Waits until every parameter server has written checkpoint `id`
  // completely; an error names a server that failed, or the deadline.
  Status WaitForCheckpoint(const std::string& id, std::chrono::steady_clock::time_point deadline);
  // Sums `values` over the workers of the synced epoch (the world group), in
  // place. Only between steps (after EndStep, before the next backward), when
  // no collective of the runtime's is in flight; for figures a training loop
  // learns after its step (the PyTorch front end's report()). An error
  // (a membership change) leaves the values alone; training is unaffected.
  Status AllReduceBetweenSteps(float* values, size_t count);
  // Fails whatever waits and makes BeginStep return CANCELLED.
  void Stop() TANDEM_EXCLUDES(mu_);

 private:
  // Where the runtime's parts live (worker/runtime/):
  //   runtime.cc          the step's sequence (BeginStep, GradientsReady,
  //                       EndStep), binding a stage, checkpoints, and the
  //                       communication thread
  //   step.{h,cc}         the per-mode step: StepStrategy, one implementation
  //                       per mode, chosen at construction
  //   buckets.{h,cc}      planning the buckets, sending them, landing them
  //   resync.cc           joining an epoch: agreeing on the step, reloading
  //                       the parameters (and optimizer state)
  //   gather.cc           Acquire and Release: the landing parameters, and
  //                       the sharded placement's gathers
  //   local_optimizer.*   the optimizer applied in the worker itself
  struct Bucket;
  struct GatherPlan;
  class StepStrategy;
  class AllReduceStep;
  class ServerStep;
  class HybridStep;
  class PsStep;

  Status Resync(const DataPlane::EpochView& view);
  Status BindStage(const DataPlane::EpochView& view);
  // options_.optimizer, with the group of kTensorParallelCopyGroup when tp > 1.
  v1::OptimizerConfig OptimizerFor(int tp) const;
  Status CheckBuffers(std::span<float> params, std::span<float> grads, const std::vector<v1::TensorSpec>& tensors);
  // Pulls the stage's partitions of `map` that `only` marks (null: all) once
  // `step` is applied (0: as they are) into the parameters (the shard when
  // sharded); returns each partition's step (INT64_MAX: not the stage's).
  // Asynchronous modes: `step` is the one this worker computes next, and the
  // pulls name it as `contributor` of `contributors`.
  Result<std::vector<int64_t>> PullStage(const v1::ShardMap& map, uint64_t step, const std::vector<bool>* only,
                                         uint32_t contributor = 0, uint32_t contributors = 0);
  Status WaitForEveryWorker();
  // Ends the step as failed: waits for its communication, and the next
  // BeginStep waits for a newer epoch and resynchronises.
  void EndFailedStep(const Status& why);
  bool asynchronous() const {
    return options_.consistency.mode() == v1::CONSISTENCY_MODE_ASYNC ||
           options_.consistency.mode() == v1::CONSISTENCY_MODE_BOUNDED_STALENESS;
  }
  // Sums the step's figures over the world (the asynchronous modes: this
  // worker's own, scaled).
  Status ReduceLoss();
  // Waits until the communication thread is idle; returns (and clears) the
  // status of what failed since the last clear.
  Status Settle() TANDEM_EXCLUDES(mu_);
  Status AwaitLanding(std::pair<size_t, size_t> range);
  Status AcquireSharded(std::pair<size_t, size_t> now, std::pair<size_t, size_t> next);
  GatherPlan& PlanGather(std::pair<size_t, size_t> range);
  Status Gather(GatherPlan& plan);
  void NoteParameterBytes();
  // Queues a task for the communication thread; returns its ticket.
  uint64_t Enqueue(std::function<Status()> task) TANDEM_EXCLUDES(mu_);
  // Waits for the task of `ticket` (and those before it); the step's status.
  Status WaitFor(uint64_t ticket) TANDEM_EXCLUDES(mu_);
  void CommLoop() TANDEM_EXCLUDES(mu_);
  // EndStep, once the step succeeded: whom the step's contribution
  // collectives waited for most and the step's wall time, to the
  // coordinator's straggler score (DataPlane::ReportStepWait).
  void ReportWait() TANDEM_EXCLUDES(mu_);
  // On the communication thread, right after a contribution collective of
  // the step on `comm` (a bucket's reduce-scatter in its node, or its
  // all-reduce in the dp group): whom it waited for (Communicator::last_wait).
  void NoteWait(const comm::Communicator& comm) TANDEM_EXCLUDES(mu_);

  RuntimeOptions options_;
  DataPlane& plane_;
  // The mode's step (step.h), chosen by the constructor from options_.mode.
  std::unique_ptr<StepStrategy> strategy_;
  ModelBinding model_;
  bool attached_ = false;
  // The bound stage: its buffers (the whole model's [base_, base_ + size)),
  // and the bounds of every stage.
  int stage_ = 0;
  int stages_ = 0;  // 0: not bound yet
  int tp_rank_ = 0;
  int tp_size_ = 0;
  std::vector<size_t> bounds_;
  size_t base_ = 0;
  std::span<float> params_;
  std::span<float> grads_;
  std::vector<v1::TensorSpec> tensors_;
  bool servers_initialized_ = false;  // for the bound stage's range
  // Allreduce mode: params_ (and the local optimizer) hold the stage's
  // state after completed_ steps; false after binding a new stage.
  bool stage_valid_ = false;

  // The synced epoch and what was derived from it.
  uint64_t synced_epoch_ = 0;
  uint64_t failed_epoch_ = 0;
  uint64_t paused_epoch_ = 0;  // the last paused epoch announced in the log
  Status last_failure_;
  uint64_t completed_ = 0;
  std::optional<Rollback> rollback_;  // ServerStep::RollBack's, until TakeRollback
  std::shared_ptr<const DataPlane::EpochView> view_;
  std::shared_ptr<comm::Communicator> world_;
  std::shared_ptr<comm::Communicator> node_;      // the node's workers of this part ("node", or "node-dp")
  std::shared_ptr<comm::Communicator> dp_;        // the part's data-parallel group ("world", or "dp/<part>")
  std::shared_ptr<comm::Communicator> pipeline_;  // "pp/<dp·tp + tp rank>" when stages_ > 1
  std::shared_ptr<comm::Communicator> tensor_;    // "tp/<stage·dp + dp rank>" when tp_size_ > 1
  std::vector<std::unique_ptr<Bucket>> buckets_;  // from the end of the buffer to its start
  // Sharded placement.
  bool sharded_ = false;
  PageBuffer* param_pages_ = nullptr;
  PageBuffer* grad_pages_ = nullptr;
  struct PartitionPlace {
    Bucket* bucket = nullptr;  // null: not in this stage
    size_t k = 0;              // index in the bucket
  };
  std::vector<PartitionPlace> places_;  // by index in the shard map
  // The sharded placement's gathers (gather.cc).
  struct Gathers {
    std::map<std::pair<size_t, size_t>, std::unique_ptr<GatherPlan>> plans;
    std::vector<float> send, staging;
    std::pair<size_t, size_t> prefetched{0, 0};       // the range being gathered ahead
    std::pair<size_t, size_t> prefetched_span{0, 0};  // the elements that gather writes
    uint64_t prefetch_ticket = 0;
  };
  Gathers gathers_;
  uint64_t parameter_bytes_ = 0;  // the step's peak (StepResult::parameter_bytes)
  double parameter_wait_ = 0;     // the step's time in Acquire (StepResult::parameter_wait_seconds)
  size_t next_bucket_ = 0;
  bool in_step_ = false;
  uint64_t step_ = 0;
  int64_t trace_step_start_ = 0;  // the step's span (common/trace.h): from BeginStep to EndStep; 0: not traced
  // The step whose whole gradient the attached buffer holds: what a resync
  // pushes again when only some servers applied it. Set by EndStep; cleared
  // once the step's last bucket landed (every partition of the stage
  // applied), or by BeginStep when nothing is landing. Until the next
  // backward the model leaves the gradient buffer alone, so a landing that
  // fails in the next forward can still push the step again. Atomic: the
  // communication thread clears it.
  std::atomic<uint64_t> grads_step_{0};
  uint32_t grads_world_ = 0;  // how many workers pushed it
  // The primary of each partition (by id) when that step was pushed: a
  // resync that finds partitions missing the step tells from it whether
  // the server holding the step's aggregation is still there.
  std::vector<uint64_t> pushed_primaries_;
  // The learning rate: as set (SetStepLearningRate); the current step's,
  // taken from it when its first gradients are handed over (its pushes
  // carry it); and grads_step_'s, which a push of that step again carries.
  std::atomic<double> lr_{0};
  double step_lr_ = 0;
  double grads_lr_ = 0;
  // The step's figures summed over the world: loss share, samples, tokens,
  // then EndStep's `more`.
  std::array<float, 3 + kMaxStepFigures> loss_in_{};
  std::array<float, 3 + kMaxStepFigures> loss_out_{};
  size_t figures_ = 3;

  // The communication thread and its queue; a failed task fails the rest of
  // the step's tasks with the same status.
  Mutex mu_;
  CondVar cv_;
  std::deque<std::function<Status()>> queue_ TANDEM_GUARDED_BY(mu_);
  size_t running_ TANDEM_GUARDED_BY(mu_) = 0;
  uint64_t enqueued_ TANDEM_GUARDED_BY(mu_) = 0;  // tickets handed out
  uint64_t finished_ TANDEM_GUARDED_BY(mu_) = 0;  // tasks done (or skipped after a failure)
  Status step_status_ TANDEM_GUARDED_BY(mu_);
  uint64_t failed_ticket_ TANDEM_GUARDED_BY(mu_) = 0;  // the task that set step_status_
  double comm_busy_ TANDEM_GUARDED_BY(mu_) = 0;
  bool quit_ TANDEM_GUARDED_BY(mu_) = false;
  // NoteWait's, summed over the step: seconds by member id, and the group.
  std::map<uint64_t, double> waited_for_ TANDEM_GUARDED_BY(mu_);
  std::string waited_in_ TANDEM_GUARDED_BY(mu_);
  std::atomic<bool> stopped_{false};
  std::thread comm_thread_;
  // For ReportWait: when the current step began, and when the last one
  // ended and which it was (a step's wall time is the time since the
  // previous one ended).
  std::chrono::steady_clock::time_point step_began_{};
  std::chrono::steady_clock::time_point last_end_{};
  uint64_t last_end_step_ = 0;
};

}  // namespace tandem::worker
