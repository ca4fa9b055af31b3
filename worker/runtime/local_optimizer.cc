#include "worker/runtime/local_optimizer.h"

#include <cmath>

#include <spdlog/spdlog.h>

namespace tandem::worker {

Result<std::unique_ptr<LocalOptimizer>> LocalOptimizer::Create(const v1::OptimizerConfig& config, size_t parameters) {
  auto optimizer = optim::Optimizer::Create(config);
  if (!optimizer.ok()) return optimizer.status();
  std::unique_ptr<LocalOptimizer> local(new LocalOptimizer(std::move(*optimizer)));
  if (local->optimizer_.state_buffers() >= 1) local->state0_.assign(parameters, 0.0f);
  if (local->optimizer_.state_buffers() >= 2) local->state1_.assign(parameters, 0.0f);
  return local;
}

Status LocalOptimizer::Step(std::span<float> params, std::span<const float> grads,
                            const std::vector<v1::TensorSpec>& tensors, bool* skipped, const NormCombiner& combine) {
  *skipped = false;
  TANDEM_RETURN_IF_ERROR(
      optim::Optimizer::CheckStepLearningRate(lr_).WithContext(fmt::format("update {}", updates_ + 1)));
  optim::GradScan scan = optim::ScanGradient(grads.data(), grads.size());
  // The norm counts the tensors of groups that count in it (not the copies
  // a tensor-parallel rank keeps of replicated tensors).
  bool excluded = false;
  for (const auto& t : tensors) excluded = excluded || !optimizer_.Group(t.group()).in_grad_norm;
  if (excluded) {
    scan.sum_squares = 0;
    for (const auto& t : tensors) {
      if (!optimizer_.Group(t.group()).in_grad_norm) continue;
      uint64_t n = 1;
      for (int64_t d : t.shape()) n *= static_cast<uint64_t>(d);
      scan.sum_squares += optim::ScanGradient(grads.data() + t.flat_offset(), n).sum_squares;
    }
  }
  if (combine) {
    auto whole = combine(scan);
    if (!whole.ok()) return whole.status();
    scan = *whole;
  }
  if (!scan.finite || !std::isfinite(scan.sum_squares)) {
    if (optimizer_.non_finite_policy() == v1::NON_FINITE_POLICY_FAIL) {
      return InvalidArgument("update {}: the gradient holds NaN or Inf (non_finite_policy FAIL)", updates_ + 1);
    }
    spdlog::warn("update {}: the gradient holds NaN or Inf; the update is skipped (non_finite_policy SKIP_STEP)",
                 updates_ + 1);
    *skipped = true;
    return Status::Ok();
  }
  // The servers' decision, with SUM reduction (divisor 1).
  double coef = 1.0;
  const double norm = std::sqrt(scan.sum_squares);
  if (optimizer_.max_grad_norm() > 0 && norm > optimizer_.max_grad_norm()) {
    coef = optimizer_.max_grad_norm() / (norm + 1e-6);
  }
  for (const auto& t : tensors) {
    uint64_t n = 1;
    for (int64_t d : t.shape()) n *= static_cast<uint64_t>(d);
    const size_t o = t.flat_offset();
    optimizer_.Apply(params.data() + o, state0_.empty() ? nullptr : state0_.data() + o,
                     state1_.empty() ? nullptr : state1_.data() + o, grads.data() + o, n, updates_,
                     optimizer_.Group(t.group()), coef, lr_);
  }
  ++updates_;
  return Status::Ok();
}

}  // namespace tandem::worker
