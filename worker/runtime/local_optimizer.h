// The optimizer a worker applies itself (worker/runtime/runtime.h: allreduce
// mode; worker/runtime/trainer.h: the single-process reference).
//
// Thread safety: a LocalOptimizer belongs to the thread that steps it (the
// training thread).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "common/optimizer/gradient.h"
#include "common/optimizer/optimizer.h"
#include "common/status.h"
#include "tandem/v1/server.pb.h"

namespace tandem::worker {

// The optimizer applied in the worker itself (allreduce mode, and the
// single-process reference): the servers' kernels over the whole flat
// buffer, tensor by tensor with each tensor's group overrides, with the same
// global-norm clipping and non-finite policy as the servers' decision.
class LocalOptimizer {
 public:
  static Result<std::unique_ptr<LocalOptimizer>> Create(const v1::OptimizerConfig& config, size_t parameters);
  // Turns the scan of this buffer's gradient into the whole model's (its
  // other parts' norms and finiteness, when the buffer is one part).
  using NormCombiner = std::function<Result<optim::GradScan>(const optim::GradScan& part)>;
  // One update from the summed gradient. A non-finite gradient skips the
  // update (*skipped = true) or fails, as the policy says. The clipping norm
  // leaves out the groups excluded from it (exclude_from_grad_norm). The
  // learning rate is set_learning_rate's.
  Status Step(std::span<float> params, std::span<const float> grads, const std::vector<v1::TensorSpec>& tensors,
              bool* skipped, const NormCombiner& combine = nullptr);
  std::vector<float>& state0() { return state0_; }
  std::vector<float>& state1() { return state1_; }
  uint64_t updates() const { return updates_; }
  void set_updates(uint64_t updates) { updates_ = updates; }
  // The job-wide learning rate of the following updates, as a push carries
  // it to the servers (optim::Optimizer::Apply's step_lr): 0 (the default)
  // for the schedule's, > 0 to replace it (groups' lr_scale still
  // multiplies it). Step fails with INVALID_ARGUMENT on a negative, NaN or
  // Inf rate.
  void set_learning_rate(double lr) { lr_ = lr; }

 private:
  explicit LocalOptimizer(optim::Optimizer optimizer) : optimizer_(std::move(optimizer)) {}
  optim::Optimizer optimizer_;
  std::vector<float> state0_, state1_;
  uint64_t updates_ = 0;
  double lr_ = 0;
};

}  // namespace tandem::worker
