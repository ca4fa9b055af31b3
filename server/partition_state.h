// The state a parameter server keeps for one partition of the flattened
// parameter space: fp32 master weights, the optimizer's buffers, and where
// the partition stands. Shared by the server core (server/ps_core.h), the
// optimizer (common/optimizer/) and checkpoints (server/checkpoint/).
#pragma once

#include <cstdint>
#include <vector>

namespace tandem::server {

struct PartitionState {
  uint32_t id = 0;
  // Elements [begin, end) of the flattened parameter space.
  uint64_t begin = 0;
  uint64_t end = 0;
  // 0: not initialised; 1 after initialisation; +1 per applied optimizer
  // update. A step skipped for non-finite gradients applies no update and
  // leaves the version alone. The optimizer's update index (learning-rate
  // schedule, Adam bias correction) is version - 1.
  uint64_t version = 0;
  // The last training step completed (applied or skipped); 0: none.
  uint64_t step = 0;
  // Master weights, end - begin elements.
  std::vector<float> weights;
  // Optimizer buffers, each end - begin elements or empty when unused:
  // SGD keeps its momentum in state0 (empty without momentum); Adam and
  // AdamW keep the first moment (exp_avg) in state0 and the second
  // (exp_avg_sq) in state1.
  std::vector<float> state0;
  std::vector<float> state1;

  uint64_t size() const { return end - begin; }
};

}  // namespace tandem::server
