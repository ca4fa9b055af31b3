// A double-precision reference of the server-side optimizers, which the
// optimizer kernel tests (optimizer_test) and the parameter-store tests
// (ps_core_test) check against.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "common/optimizer/optimizer.h"

namespace tandem::optim {

// PyTorch's update rules (torch.optim.SGD, Adam, AdamW) element by element in
// double, from the formulas of their documentation.
struct Reference {
  std::vector<double> w;
  std::vector<double> s0;
  std::vector<double> s1;

  // `step_lr`: the update's job-wide learning rate, replacing the schedule's
  // when > 0 (Optimizer::Apply's step_lr); the group's lr_scale multiplies it.
  void Step(const Optimizer& o, const std::vector<float>& g, uint64_t t0, const GroupParams& gp, double scale,
            double step_lr = 0) {
    const v1::OptimizerConfig& c = o.config();
    const double lr = (step_lr > 0 ? step_lr : o.LearningRate(t0)) * gp.lr_scale;
    const double wd = gp.weight_decay;
    for (size_t i = 0; i < w.size(); ++i) {
      double d = static_cast<double>(g[i]) * scale;
      if (c.has_sgd()) {
        const v1::SgdConfig& s = c.sgd();
        d += wd * w[i];
        if (s.momentum() > 0) {
          s0[i] = t0 == 0 ? d : s.momentum() * s0[i] + d;
          d = s.nesterov() ? d + s.momentum() * s0[i] : s0[i];
        }
        w[i] -= lr * d;
        continue;
      }
      const v1::AdamConfig& a = c.adam();
      const double b1 = a.has_beta1() ? a.beta1() : 0.9;
      const double b2 = a.has_beta2() ? a.beta2() : 0.999;
      const double eps = a.has_eps() ? a.eps() : 1e-8;
      const bool bias = a.has_bias_correction() ? a.bias_correction() : true;
      if (a.decoupled_weight_decay()) {
        w[i] *= 1 - lr * wd;
      } else {
        d += wd * w[i];
      }
      s0[i] = b1 * s0[i] + (1 - b1) * d;
      s1[i] = b2 * s1[i] + (1 - b2) * d * d;
      const double t = static_cast<double>(t0 + 1);
      const double m_hat = bias ? s0[i] / (1 - std::pow(b1, t)) : s0[i];
      const double v_hat = bias ? s1[i] / (1 - std::pow(b2, t)) : s1[i];
      w[i] -= lr * m_hat / (std::sqrt(v_hat) + eps);
    }
  }
};

}  // namespace tandem::optim
