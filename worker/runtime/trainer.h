// The reference trainer: the byte-level language model (worker/model) on a
// text dataset (worker/data), trained through the worker runtime
// (worker/runtime/runtime.h) or, for comparison, in one process with no
// cluster at all (TrainLocally). docs/training.md describes both.
//
// Pipeline parallelism: with a mesh of pp > 1 stages, each worker builds its
// stage of the model (model::PlanStages) and the `accumulation` micro-batches
// of its data-parallel shard run through the pp group on the
// train.pipeline_schedule (worker/runtime/pipeline.h); every stage reads the
// same samples (the first uses the tokens, the last the targets). Only the
// last stage has a loss, and only the first stage writes the sample log. The
// final parameters are gathered on global rank 0 (stage 0) for params_out.
//
// One step at global batch B over P data-parallel ranks: the sampler gives
// this rank its contiguous shard of the batch at the step's cursor (a pure
// function of the step, so a retried or resumed step trains on the same
// samples); the shard is split into `accumulation` micro-batches whose
// gradients are summed with no communication in between; each micro-batch's
// backward is scaled by its share of the global batch, so the runtime's sum
// over ranks is the gradient of the global batch's mean loss. On the last
// micro-batch, backward hands each finished range of gradients to the
// runtime, so they travel while the earlier layers are still computing.
//
// Thread safety: one thread runs a trainer.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/status.h"
#include "tandem/train_config.h"
#include "tandem/v1/server.pb.h"
#include "worker/model/model.h"
#include "worker/runtime/runtime.h"

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
}  // namespace prometheus

namespace tandem::worker {

// TrainConfig (the train.* options) is public: tandem/train_config.h.

// The train.* options. Without `job_keys`, steps, mode, data and seed are
// left out (a launcher that has options of its own for them).
void DeclareTrainOptions(OptionSet& options, TrainConfig* config, bool job_keys = true);
// The flags that give a tandem-worker this configuration.
std::vector<std::string> TrainFlags(const TrainConfig& config);
Result<model::ModelConfig> ModelConfigOf(const TrainConfig& config);
Result<v1::OptimizerConfig> OptimizerConfigOf(const TrainConfig& config);
Result<RuntimeOptions> RuntimeOptionsOf(const TrainConfig& config);

// One step as a person and `tandem run` see it.
struct StepRecord {
  uint64_t step = 0;
  uint64_t epoch = 0;
  double loss = 0;  // NaN: the step completed on the servers while this worker lost its result
  uint64_t tokens = 0;
  uint64_t samples = 0;  // sequences of the global batch
  double step_seconds = 0;
  double compute_seconds = 0;
  double comm_seconds = 0;
  double exposed_seconds = 0;
  uint32_t world_size = 1;
  uint32_t rank = 0;
  uint64_t retries = 0;  // failed attempts before this step completed
  bool resynced = false;
  // Pipeline parallelism (pp > 1): each stage's idle fraction of its
  // schedule (wall time not spent in forward or backward), by stage.
  std::vector<double> pipeline_idle;
  uint64_t parameter_bytes = 0;  // StepResult::parameter_bytes of this worker
};
// The record as one JSON line (no newline).
std::string ToJson(const StepRecord& record);
// A rollback's progress line (no newline): {"rollback":true,"from":...}.
std::string ToJson(const Runtime::Rollback& rollback);
// Seconds since the Unix epoch (the progress file's and the sample log's "time").
double WallSeconds();

// The step metrics (tandem_train_*, docs/metrics.md) of a training loop.
struct TrainMetrics {
  explicit TrainMetrics(prometheus::Registry& r);
  // A completed step.
  void Record(const StepRecord& record);
  prometheus::Gauge& step;
  prometheus::Gauge& loss;
  prometheus::Gauge& tokens_per_second;
  prometheus::Gauge& samples_per_second;
  prometheus::Gauge& world_size;
  prometheus::Gauge& exposed_ratio;
  prometheus::Histogram& step_seconds;
  prometheus::Counter& steps;
  prometheus::Counter& failures;      // step attempts that failed and were retried
  prometheus::Counter& rollbacks;     // rollbacks to a checkpoint after partitions lost both copies
  prometheus::Counter& steps_redone;  // steps trained again after those rollbacks
  prometheus::Counter& tokens;
  prometheus::Counter& samples;
  prometheus::Counter& comm_seconds;
  prometheus::Counter& exposed_seconds;
  // A rollback (Runtime::TakeRollback): rollbacks and steps_redone.
  void Record(const Runtime::Rollback& rollback);
};

struct TrainerHooks {
  std::function<void(const StepRecord&)> on_step;
  std::function<bool()> stopping;
  prometheus::Registry* registry = nullptr;  // step metrics (tandem_train_*) go here when set
};

// Trains config.steps steps through `runtime` (steps already completed by
// the job count). Returns OK when done, CANCELLED when stopped.
Status Train(const TrainConfig& config, DataPlane& plane, const TrainerHooks& hooks);

// The same training in this process alone: the whole global batch, the same
// micro-batches, the same optimizer kernels. `final_params` receives the
// parameters after the last step.
Status TrainLocally(const TrainConfig& config, const std::function<void(const StepRecord&)>& on_step,
                    std::vector<float>* final_params);

}  // namespace tandem::worker
