#include "common/optimizer/optimizer.h"

#include <cmath>
#include <numbers>
#include <vector>

#include "common/optimizer/kernel_clones.h"

// The kernels are built with -O3 -ffp-contract=off -fno-math-errno (see
// common/CMakeLists.txt) and, on x86-64 with GCC, cloned for AVX-512 and AVX2
// and chosen at load time, as worker/collectives/kernels.cc does. Without
// contraction and reassociation every clone computes every element
// identically. (AVX-512 matters: with sqrt and a division per element the
// update is compute bound in cache on AVX2, about 0.6 of the cache's
// bandwidth on the 2-core benchmark machine; 512-bit vectors reach 0.9.)

namespace tandem::optim {
namespace {

constexpr size_t kMaxGroups = 64;
constexpr size_t kMaxGroupKeyBytes = 128;

// --- Validation -------------------------------------------------------------

Status CheckPositive(std::string_view path, double v) {
  if (v > 0 && std::isfinite(v)) return Status::Ok();
  return InvalidArgument("{}: {} must be > 0 and finite", path, v);
}

Status CheckNonNegative(std::string_view path, double v) {
  if (v >= 0 && std::isfinite(v)) return Status::Ok();
  return InvalidArgument("{}: {} must be >= 0 and finite", path, v);
}

// [0, 1): momentum and the betas.
Status CheckDecay(std::string_view path, double v) {
  if (v >= 0 && v < 1) return Status::Ok();
  return InvalidArgument("{}: {} must be in [0, 1)", path, v);
}

Status ValidateSgd(const v1::SgdConfig& c) {
  TANDEM_RETURN_IF_ERROR(CheckPositive("optimizer.sgd.lr", c.lr()));
  TANDEM_RETURN_IF_ERROR(CheckDecay("optimizer.sgd.momentum", c.momentum()));
  if (c.nesterov() && c.momentum() == 0) {
    return InvalidArgument("optimizer.sgd.nesterov: true requires optimizer.sgd.momentum > 0 (it is 0)");
  }
  return CheckNonNegative("optimizer.sgd.weight_decay", c.weight_decay());
}

Status ValidateAdam(const v1::AdamConfig& c) {
  TANDEM_RETURN_IF_ERROR(CheckPositive("optimizer.adam.lr", c.lr()));
  if (c.has_beta1()) TANDEM_RETURN_IF_ERROR(CheckDecay("optimizer.adam.beta1", c.beta1()));
  if (c.has_beta2()) TANDEM_RETURN_IF_ERROR(CheckDecay("optimizer.adam.beta2", c.beta2()));
  if (c.has_eps()) TANDEM_RETURN_IF_ERROR(CheckPositive("optimizer.adam.eps", c.eps()));
  return CheckNonNegative("optimizer.adam.weight_decay", c.weight_decay());
}

Status ValidateSchedule(const v1::LrSchedule& s) {
  if (!v1::LrScheduleKind_IsValid(s.kind())) {
    return InvalidArgument("optimizer.lr_schedule.kind: {} is not a known LrScheduleKind", static_cast<int>(s.kind()));
  }
  const bool decays = s.kind() == v1::LR_SCHEDULE_KIND_COSINE || s.kind() == v1::LR_SCHEDULE_KIND_LINEAR;
  if (decays && s.total_steps() <= s.warmup_steps()) {
    return InvalidArgument("optimizer.lr_schedule.total_steps: {} must be > warmup_steps ({}) for {}", s.total_steps(),
                           s.warmup_steps(), v1::LrScheduleKind_Name(s.kind()));
  }
  if (!(s.min_lr_ratio() >= 0 && s.min_lr_ratio() <= 1)) {
    return InvalidArgument("optimizer.lr_schedule.min_lr_ratio: {} must be in [0, 1]", s.min_lr_ratio());
  }
  return Status::Ok();
}

// A key as it appears in messages: quoted and escaped, at most 40 bytes of it.
std::string QuoteKey(std::string_view key) {
  if (key.size() > 40) return fmt::format("{:?}…", key.substr(0, 40));
  return fmt::format("{:?}", key);
}

// --- Kernels ----------------------------------------------------------------
//
// One pass over the buffers per update. Per-step scalars arrive in float;
// every variant of the update rule is its own instantiation so the loop body
// holds no branches and vectorises. `__restrict`: the buffers do not overlap
// (Apply's contract), which lets the compiler vectorise without alias checks.

struct AdamScalars {
  float grad_scale;
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float step_size;     // lr / (1 - beta1^t), or lr without bias correction
  float inv_bc2_sqrt;  // 1 / sqrt(1 - beta2^t), or 1
  float eps;
  float l2;     // Adam: weight decay added to the gradient
  float decay;  // AdamW: 1 - lr * weight_decay
};

template <bool kL2, bool kDecoupled>
TANDEM_KERNEL void AdamKernel(float* __restrict w, float* __restrict m, float* __restrict v, const float* __restrict g,
                              size_t n, AdamScalars s) {
  for (size_t i = 0; i < n; ++i) {
    float wi = w[i];
    float gi = g[i] * s.grad_scale;
    if constexpr (kL2) gi = gi + s.l2 * wi;
    if constexpr (kDecoupled) wi = wi * s.decay;
    const float mi = s.beta1 * m[i] + s.one_minus_beta1 * gi;
    const float vi = s.beta2 * v[i] + s.one_minus_beta2 * (gi * gi);
    const float denom = std::sqrt(vi) * s.inv_bc2_sqrt + s.eps;
    m[i] = mi;
    v[i] = vi;
    w[i] = wi - s.step_size * (mi / denom);
  }
}

struct SgdScalars {
  float grad_scale;
  float lr;
  float momentum;
  float weight_decay;
};

enum class Momentum { kNone, kFirst, kLater };

template <bool kDecay, Momentum kMomentum, bool kNesterov>
TANDEM_KERNEL void SgdKernel(float* __restrict w, float* __restrict buf, const float* __restrict g, size_t n,
                             SgdScalars s) {
  for (size_t i = 0; i < n; ++i) {
    const float wi = w[i];
    float d = g[i] * s.grad_scale;
    if constexpr (kDecay) d = d + s.weight_decay * wi;
    if constexpr (kMomentum != Momentum::kNone) {
      // torch: the first step sets the buffer to the gradient; later ones
      // buf = momentum * buf + d (dampening 0).
      float b = d;
      if constexpr (kMomentum == Momentum::kLater) b = s.momentum * buf[i] + d;
      buf[i] = b;
      if constexpr (kNesterov) {
        d = d + s.momentum * b;
      } else {
        d = b;
      }
    }
    w[i] = wi - s.lr * d;
  }
}

template <bool kDecay>
void Sgd(float* w, float* buf, const float* g, size_t n, bool momentum, bool first, bool nesterov, SgdScalars s) {
  if (!momentum) return SgdKernel<kDecay, Momentum::kNone, false>(w, buf, g, n, s);
  if (first) {
    if (nesterov) return SgdKernel<kDecay, Momentum::kFirst, true>(w, buf, g, n, s);
    return SgdKernel<kDecay, Momentum::kFirst, false>(w, buf, g, n, s);
  }
  if (nesterov) return SgdKernel<kDecay, Momentum::kLater, true>(w, buf, g, n, s);
  return SgdKernel<kDecay, Momentum::kLater, false>(w, buf, g, n, s);
}

}  // namespace

Result<Optimizer> Optimizer::Create(const v1::OptimizerConfig& config) {
  Optimizer o;
  o.config_ = config;
  switch (config.optimizer_case()) {
    case v1::OptimizerConfig::kSgd: {
      const v1::SgdConfig& c = config.sgd();
      TANDEM_RETURN_IF_ERROR(ValidateSgd(c));
      o.rule_ = Rule::kSgd;
      o.name_ = "sgd";
      o.lr_ = c.lr();
      o.momentum_ = c.momentum();
      o.nesterov_ = c.nesterov();
      o.state_buffers_ = c.momentum() > 0 ? 1 : 0;
      o.defaults_.weight_decay = c.weight_decay();
      break;
    }
    case v1::OptimizerConfig::kAdam: {
      const v1::AdamConfig& c = config.adam();
      TANDEM_RETURN_IF_ERROR(ValidateAdam(c));
      o.rule_ = c.decoupled_weight_decay() ? Rule::kAdamW : Rule::kAdam;
      o.name_ = c.decoupled_weight_decay() ? "adamw" : "adam";
      o.lr_ = c.lr();
      o.beta1_ = c.has_beta1() ? c.beta1() : 0.9;
      o.beta2_ = c.has_beta2() ? c.beta2() : 0.999;
      o.eps_ = c.has_eps() ? c.eps() : 1e-8;
      o.bias_correction_ = c.has_bias_correction() ? c.bias_correction() : true;
      o.state_buffers_ = 2;
      o.defaults_.weight_decay = c.weight_decay();
      break;
    }
    case v1::OptimizerConfig::OPTIMIZER_NOT_SET:
      return InvalidArgument("optimizer: no update rule: set exactly one of optimizer.sgd or optimizer.adam");
  }
  TANDEM_RETURN_IF_ERROR(ValidateSchedule(config.lr_schedule()));
  TANDEM_RETURN_IF_ERROR(CheckNonNegative("optimizer.max_grad_norm", config.max_grad_norm()));
  if (!v1::NonFinitePolicy_IsValid(config.non_finite_policy())) {
    return InvalidArgument("optimizer.non_finite_policy: {} is not a known NonFinitePolicy",
                           static_cast<int>(config.non_finite_policy()));
  }
  if (!v1::GradientReduction_IsValid(config.reduction())) {
    return InvalidArgument("optimizer.reduction: {} is not a known GradientReduction",
                           static_cast<int>(config.reduction()));
  }
  if (config.group_overrides_size() > static_cast<int>(kMaxGroups)) {
    return InvalidArgument("optimizer.group_overrides: {} groups; at most {} are allowed",
                           config.group_overrides_size(), kMaxGroups);
  }
  // Sorted, so the first error reported does not depend on hash order.
  std::map<std::string, const v1::GroupHyperparameters*> sorted;
  for (const auto& [key, value] : config.group_overrides()) sorted.emplace(key, &value);
  for (const auto& [key, h] : sorted) {
    if (key.empty() || key.size() > kMaxGroupKeyBytes) {
      return InvalidArgument("optimizer.group_overrides: key {} is {} bytes; keys must be 1 to {} bytes", QuoteKey(key),
                             key.size(), kMaxGroupKeyBytes);
    }
    GroupParams p = o.defaults_;
    if (h->has_lr_scale()) {
      TANDEM_RETURN_IF_ERROR(
          CheckNonNegative(fmt::format("optimizer.group_overrides[{}].lr_scale", QuoteKey(key)), h->lr_scale()));
      p.lr_scale = h->lr_scale();
    }
    if (h->has_weight_decay()) {
      TANDEM_RETURN_IF_ERROR(CheckNonNegative(fmt::format("optimizer.group_overrides[{}].weight_decay", QuoteKey(key)),
                                              h->weight_decay()));
      p.weight_decay = h->weight_decay();
    }
    if (h->has_exclude_from_grad_norm()) p.in_grad_norm = !h->exclude_from_grad_norm();
    o.groups_.emplace(key, p);
  }
  return o;
}

double Optimizer::LearningRate(uint64_t update_index) const {
  const v1::LrSchedule& s = config_.lr_schedule();
  const uint64_t warmup = s.warmup_steps();
  if (update_index < warmup) {
    return lr_ * (static_cast<double>(update_index) + 1) / static_cast<double>(warmup);
  }
  const v1::LrScheduleKind kind = s.kind();
  if (kind != v1::LR_SCHEDULE_KIND_COSINE && kind != v1::LR_SCHEDULE_KIND_LINEAR) return lr_;
  const double min_ratio = s.min_lr_ratio();
  if (update_index >= s.total_steps()) return lr_ * min_ratio;
  const double progress =
      static_cast<double>(update_index - warmup) / static_cast<double>(s.total_steps() - warmup);  // [0, 1)
  const double shape =
      kind == v1::LR_SCHEDULE_KIND_COSINE ? 0.5 * (1 + std::cos(std::numbers::pi * progress)) : 1 - progress;
  return lr_ * (min_ratio + (1 - min_ratio) * shape);
}

Status Optimizer::CheckStepLearningRate(double lr) {
  if (lr == 0 || (lr > 0 && std::isfinite(lr))) return Status::Ok();
  return InvalidArgument("learning rate {}: must be 0 (the configured schedule) or > 0 and finite", lr);
}

GroupParams Optimizer::Group(std::string_view group) const {
  if (auto it = groups_.find(group); it != groups_.end()) return it->second;
  return defaults_;
}

v1::NonFinitePolicy Optimizer::non_finite_policy() const {
  const v1::NonFinitePolicy p = config_.non_finite_policy();
  return p == v1::NON_FINITE_POLICY_UNSPECIFIED ? v1::NON_FINITE_POLICY_SKIP_STEP : p;
}

v1::GradientReduction Optimizer::reduction() const {
  const v1::GradientReduction r = config_.reduction();
  return r == v1::GRADIENT_REDUCTION_UNSPECIFIED ? v1::GRADIENT_REDUCTION_MEAN : r;
}

void Optimizer::Apply(float* w, float* s0, float* s1, const float* g, size_t count, uint64_t update_index,
                      const GroupParams& group, double grad_scale, double step_lr) const {
  if (count == 0) return;
  const double lr = LearningRate(update_index, step_lr) * group.lr_scale;
  const double wd = group.weight_decay;
  if (rule_ == Rule::kSgd) {
    const SgdScalars s{static_cast<float>(grad_scale), static_cast<float>(lr), static_cast<float>(momentum_),
                       static_cast<float>(wd)};
    const bool momentum = state_buffers_ > 0;
    const bool first = update_index == 0;
    if (wd != 0) return Sgd<true>(w, s0, g, count, momentum, first, nesterov_, s);
    return Sgd<false>(w, s0, g, count, momentum, first, nesterov_, s);
  }
  // Adam and AdamW, as torch computes the scalars (in double, then used as
  // float by the elementwise kernels).
  const double t = static_cast<double>(update_index) + 1;
  double step_size = lr;
  double inv_bc2_sqrt = 1;
  if (bias_correction_) {
    step_size = lr / (1 - std::pow(beta1_, t));
    inv_bc2_sqrt = 1 / std::sqrt(1 - std::pow(beta2_, t));
  }
  const bool decoupled = rule_ == Rule::kAdamW;
  const AdamScalars s{static_cast<float>(grad_scale),   static_cast<float>(beta1_),     static_cast<float>(1 - beta1_),
                      static_cast<float>(beta2_),       static_cast<float>(1 - beta2_), static_cast<float>(step_size),
                      static_cast<float>(inv_bc2_sqrt), static_cast<float>(eps_),       static_cast<float>(wd),
                      static_cast<float>(1 - lr * wd)};
  if (wd == 0) return AdamKernel<false, false>(w, s0, s1, g, count, s);
  if (decoupled) return AdamKernel<false, true>(w, s0, s1, g, count, s);
  return AdamKernel<true, false>(w, s0, s1, g, count, s);
}

}  // namespace tandem::optim
