// The per-mode step of the worker runtime (worker/runtime/runtime.h): what
// differs between allreduce, hybrid and ps mode, behind one interface that
// the Runtime's constructor picks once from RuntimeOptions::mode. The
// Runtime keeps the step's sequence (BeginStep, GradientsReady, EndStep,
// resynchronising); the strategy does the mode's part of each:
//
//   AllReduceStep  no servers: buckets all-reduced over the part's dp group,
//                  the optimizer applied locally (LocalOptimizer), a resync
//                  broadcast from a worker that holds the state
//   ServerStep     the parameter servers: buckets of whole partitions pushed
//                  and pulled, a resync pulled from the servers; with the
//                  asynchronous consistencies, pulls after the pushes
//     HybridStep   one contribution per node: the node's workers
//                  reduce-scatter each bucket first and all-gather the
//                  pulled parameters after
//     PsStep       one contribution per worker
//
// Private to the runtime (nested classes of Runtime: they read and write its
// state through rt_). Internal header: not installed.
//
// Thread safety: as the Runtime's. The training thread calls the strategy;
// RunBucket, FinishPushes and LandBucket run on the communication thread, as
// tasks the training thread queued (one at a time, between the training
// thread's waits).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "worker/runtime/buckets.h"
#include "worker/runtime/runtime.h"

namespace tandem::worker {

// Helpers the runtime's units share.
namespace runtime_internal {

using Clock = std::chrono::steady_clock;

inline double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// "pipeline stage 1 of 2, tensor-parallel rank 0 of 2" (the parts a mesh has).
inline std::string PartName(int stage, int stages, int tp_rank, int tp) {
  std::string name = stages > 1 || tp == 1 ? fmt::format("pipeline stage {} of {}", stage, stages) : "";
  if (tp > 1) name += fmt::format("{}tensor-parallel rank {} of {}", name.empty() ? "" : ", ", tp_rank, tp);
  return name;
}

}  // namespace runtime_internal

class Runtime::StepStrategy {
 public:
  explicit StepStrategy(Runtime& rt) : rt_(rt) {}
  virtual ~StepStrategy() = default;
  StepStrategy(const StepStrategy&) = delete;
  StepStrategy& operator=(const StepStrategy&) = delete;

  // The strategy of `mode`.
  static std::unique_ptr<StepStrategy> Create(TrainingMode mode, Runtime& rt);

  // BindStage: a part of `parameters` elements of a model split over `tp`
  // tensor-parallel ranks is bound (before the buffers are taken).
  virtual Status BindPart(int tp, size_t parameters) = 0;
  // Resync, before planning the buckets: who contributes to each part's
  // partitions (server modes).
  virtual Status CountContributors(const DataPlane::EpochView& view) = 0;
  // Resync: the buckets of the bound stage for the epoch.
  virtual Status PlanBuckets(const DataPlane::EpochView& view) = 0;
  // Resync, once the buckets are planned: agrees on the last completed step
  // (completed_) and brings the parameters (and optimizer state) to it.
  virtual Status Resync(const DataPlane::EpochView& view) = 0;
  // BeginStep: a step begins.
  virtual void BeginStep() = 0;
  // The step's first gradients are handed over, with the step's learning rate.
  virtual void StartGradients(double lr) = 0;
  // On the communication thread: sends a bucket whose gradients are final.
  virtual Status RunBucket(Bucket& bucket) = 0;
  // EndStep, after the last bucket was queued: queues the step's remaining
  // tasks and returns the ticket after which the step is complete.
  virtual uint64_t EnqueueFinish() = 0;
  // EndStep, after the step's communication succeeded: the update, where
  // the worker applies it (result's optimizer figures).
  virtual Status Apply(StepResult& result) = 0;
  // FinishRun, in a synced epoch.
  virtual Status FinishRun() = 0;

 protected:
  Runtime& rt_;
};

class Runtime::AllReduceStep final : public StepStrategy {
 public:
  using StepStrategy::StepStrategy;

  Status BindPart(int tp, size_t parameters) override;
  Status CountContributors(const DataPlane::EpochView&) override { return Status::Ok(); }
  Status PlanBuckets(const DataPlane::EpochView& view) override;
  Status Resync(const DataPlane::EpochView& view) override;
  void BeginStep() override;
  void StartGradients(double lr) override;
  Status RunBucket(Bucket& bucket) override;
  uint64_t EnqueueFinish() override;
  Status Apply(StepResult& result) override;
  Status FinishRun() override { return Status::Ok(); }

 private:
  // With an external optimizer: `root` of the dp group sends its state.
  Status BroadcastExternalState(int root);

  std::unique_ptr<LocalOptimizer> local_;  // the bound part's
};

class Runtime::ServerStep : public StepStrategy {
 public:
  using StepStrategy::StepStrategy;

  Status BindPart(int, size_t) override { return Status::Ok(); }
  Status PlanBuckets(const DataPlane::EpochView& view) override;
  Status Resync(const DataPlane::EpochView& view) override;
  void BeginStep() override { pulls_posted_ = false; }
  void StartGradients(double) override {}
  Status RunBucket(Bucket& bucket) override;
  uint64_t EnqueueFinish() override;
  Status Apply(StepResult&) override { return Status::Ok(); }
  Status FinishRun() override;

 protected:
  // The ranks that share a contribution (the node's workers of the part in
  // hybrid mode; 1 in ps mode), and this worker's rank among them.
  virtual int LocalRanks() const = 0;
  virtual int LocalRank() const = 0;

  // Contributions per part (nodes in hybrid mode, workers in ps mode), and
  // this worker's index among its part's.
  std::vector<uint32_t> stage_contributors_;
  uint32_t contributor_ = 0;

 private:
  // Initialises the servers with the stage's range (once per bound stage).
  Status InitializeServers(const DataPlane::EpochView& view);
  // Partitions lost both copies (recreated_ here, or on another rank): rolls
  // every server back to the newest checkpoint that restores, or fails
  // (DATA_LOSS) when there is none.
  Status RollBack(const DataPlane::EpochView& view);
  // Posts every pull of the step (RunBucket with the first bucket, or, in
  // the asynchronous modes, once the pushes are applied).
  void PostPulls();
  Status FinishPushes();
  Status LandBucket(Bucket& bucket, uint64_t step);
  // Resync: the servers' step `step` is not applied everywhere; pushes it
  // again when the same workers still hold its gradient.
  Result<bool> PushStepAgainIfWhole(uint64_t step, size_t lagging, const std::string& which);

  // Asynchronous modes: the highest step of which this worker sent a push
  // (written by the communication thread).
  std::atomic<uint64_t> sent_step_{0};
  bool pulls_posted_ = false;  // this step's (RunBucket posts them with the first bucket)
  // InitializeServers created partitions from the model's initial values
  // after the job had trained (the epoch's start_step > 0): their state was
  // lost with both of their servers.
  bool recreated_ = false;
  // The reduce-scatter input and all-gather output of every bucket (one at a
  // time on the communication thread), L blocks of the largest bucket.
  std::vector<float> staging_;
  std::vector<float> block_scratch_;  // one block, for a rank whose share of a bucket is less than the block
};

class Runtime::HybridStep final : public ServerStep {
 public:
  using ServerStep::ServerStep;
  Status CountContributors(const DataPlane::EpochView& view) override;

 protected:
  int LocalRanks() const override { return rt_.node_->size(); }
  int LocalRank() const override { return rt_.node_->rank(); }
};

class Runtime::PsStep final : public ServerStep {
 public:
  using ServerStep::ServerStep;
  Status CountContributors(const DataPlane::EpochView& view) override;

 protected:
  int LocalRanks() const override { return 1; }
  int LocalRank() const override { return 0; }
};

}  // namespace tandem::worker
