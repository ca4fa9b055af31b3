// GpuEngine in a build without CUDA: Create says so (gpu_engine.h).
#include "worker/model/gpu_engine.h"

namespace tandem::model {

Result<std::unique_ptr<GpuEngine>> GpuEngine::Create(const GpuModelShape& shape, std::vector<size_t>, size_t) {
  return FailedPrecondition(
      "model gpu: device {} was asked for, but this build has no CUDA (TANDEM_WITH_CUDA=OFF or CUDA not found at "
      "build time); use gpu -1 (the CPU)",
      shape.gpu);
}

}  // namespace tandem::model
