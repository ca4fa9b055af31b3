// The optimizer: a validated v1::OptimizerConfig (update rule, learning-rate
// schedule, per-group overrides, clipping and non-finite policy) and the
// kernel that applies one update in place to a range of fp32 weights and
// their state buffers. The parameter server runs it on its partitions
// (server/partition_state.h); workers in all-reduce mode run it as their
// local optimizer. It lives in common/ so that both can link it.
//
// Semantics are PyTorch's, element for element: torch.optim.SGD (momentum
// with dampening 0, the first step initialising the buffer to the gradient,
// Nesterov, weight decay as L2 added to the gradient), torch.optim.Adam (L2
// weight decay) and torch.optim.AdamW (decoupled: w -= lr * wd * w), with
// Adam's bias correction optional. The learning rate follows server.proto's
// LrSchedule, unless the caller gives an update its own (Apply's `step_lr`: a
// PyTorch LR scheduler driving the servers, one rate per step).
//
// Determinism: Apply is elementwise: element i of the result depends only on
// element i of the inputs and on per-step scalars, which are computed in
// double once per call from (update_index, group, grad_scale, step_lr) and
// rounded to float. The element math is fp32 with no fused multiply-adds (the kernel is
// built with -ffp-contract=off) and no reassociation, so the AVX-512, AVX2
// and baseline clones, a vector lane and the scalar tail, one call over
// [0, n) and any number of calls over pieces of it all give bit-identical
// results: a backup server that replays the primary's update ends
// bit-identical to it however either splits the work.
//
// Speed: one pass over the buffers (AdamW reads w, g, m, v and writes w, m,
// v: 28 bytes per parameter), vectorised, so a call is memory bound; the
// caller spreads large ranges over a ThreadPool (common/optimizer/thread_pool.h).
//
// Thread safety: an Optimizer is immutable after Create; any number of
// threads may call its const methods at once (on disjoint ranges for Apply).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "common/status.h"
#include "tandem/v1/server.pb.h"

namespace tandem::optim {

// The hyperparameters that a tensor group may override.
struct GroupParams {
  double lr_scale = 1.0;      // multiplies the scheduled learning rate; 0 freezes the weights
  double weight_decay = 0.0;  // L2 (SGD, Adam) or decoupled (AdamW) decay factor
  bool in_grad_norm = true;   // counts in the global gradient norm (exclude_from_grad_norm unset)
};

class Optimizer {
 public:
  // Validates everything in `config` as server.proto documents it and
  // returns INVALID_ARGUMENT naming the field path and the bad value
  // ("optimizer.adam.beta1: 1.5 must be in [0, 1)") for the first field that
  // is wrong.
  static Result<Optimizer> Create(const v1::OptimizerConfig& config);

  // "sgd", "adam" (Adam with L2 weight decay) or "adamw".
  std::string_view name() const { return name_; }
  // Number of state buffers Apply uses: 0 (SGD without momentum), 1 (SGD
  // with momentum: s0 is the momentum), 2 (Adam, AdamW: s0 = exp_avg, s1 =
  // exp_avg_sq).
  int state_buffers() const { return state_buffers_; }
  // The peak learning rate times the schedule at `update_index` (the number
  // of updates applied before this one).
  double LearningRate(uint64_t update_index) const;
  // The job-wide learning rate of an update: `lr` when it is > 0 (a rate
  // given for the update, replacing the schedule's), else
  // LearningRate(update_index). A group's lr_scale multiplies either.
  double LearningRate(uint64_t update_index, double lr) const { return lr > 0 ? lr : LearningRate(update_index); }
  // Checks a learning rate given for an update (Apply's `step_lr`): 0 (the
  // schedule's) or > 0 and finite; INVALID_ARGUMENT naming it otherwise.
  static Status CheckStepLearningRate(double lr);
  // The job-wide hyperparameters with `group`'s overrides applied ("" and
  // groups without overrides get the job-wide values).
  GroupParams Group(std::string_view group) const;
  // Global gradient-norm clipping threshold; 0 means no clipping.
  double max_grad_norm() const { return config_.max_grad_norm(); }
  // UNSPECIFIED normalised to SKIP_STEP.
  v1::NonFinitePolicy non_finite_policy() const;
  // UNSPECIFIED normalised to MEAN.
  v1::GradientReduction reduction() const;
  const v1::OptimizerConfig& config() const { return config_; }

  // One update of `count` elements in place. `w`: fp32 master weights; `s0`,
  // `s1`: the state buffers (see state_buffers(); nullptr when unused);
  // `g`: the reduced gradient, multiplied by `grad_scale` first (the caller
  // folds the mean's divisor and the clipping coefficient into it).
  // `update_index`: updates applied before this one (the schedule's step;
  // Adam's bias correction uses t = update_index + 1; SGD's first momentum
  // step, update_index 0, sets the buffer to the gradient).
  // `step_lr`: the job-wide learning rate of this update, replacing the
  // schedule's when > 0; 0 (the default): the schedule's at update_index.
  // The group's lr_scale multiplies either (LearningRate(update_index,
  // step_lr)).
  // REQUIRES: the buffers do not overlap one another; the used state buffers
  // are not null; CheckStepLearningRate(step_lr) is OK. Buffers need no
  // particular alignment.
  void Apply(float* w, float* s0, float* s1, const float* g, size_t count, uint64_t update_index,
             const GroupParams& group, double grad_scale, double step_lr = 0) const;

 private:
  enum class Rule { kSgd, kAdam, kAdamW };

  Optimizer() = default;

  v1::OptimizerConfig config_;
  Rule rule_ = Rule::kSgd;
  std::string_view name_ = "sgd";
  int state_buffers_ = 0;
  // Resolved job-wide hyperparameters.
  double lr_ = 0;
  double momentum_ = 0;
  bool nesterov_ = false;
  double beta1_ = 0.9;
  double beta2_ = 0.999;
  double eps_ = 1e-8;
  bool bias_correction_ = true;
  GroupParams defaults_;
  std::map<std::string, GroupParams, std::less<>> groups_;
};

}  // namespace tandem::optim
