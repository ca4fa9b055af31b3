// The reference model's forward and backward on a CUDA device (model.h,
// "GPU"): the same kernels as the CPU path, the matrix products through
// cuBLAS (fp32, no TF32), the rest as CUDA kernels.
//
// The engine holds a device copy of the flat parameters and gradients and
// the activations of each micro-batch slot. The Model keeps the host buffers
// that the runtime reads and writes (params(), grads()): Forward uploads the
// parameters, segment by segment as the runtime hands them out, and Backward
// downloads each run of final gradients before it reports it ready, so the
// runtime sends them while the device goes on with the earlier layers.
//
// No CUDA type appears here: the implementation is gpu_engine.cu in a build
// with CUDA, and gpu_engine_stub.cc (Create reports that the build has no
// CUDA) in one without.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace tandem::model {

// The model's dimensions (ModelConfig's, which this header does not see:
// the .cu file is compiled as C++17).
struct GpuModelShape {
  int vocab = 0;
  int context = 0;
  int d_model = 0;
  int heads = 0;
  int layers = 0;
  int mlp_ratio = 0;
  int gpu = 0;  // the CUDA device
};

class GpuEngine {
 public:
  // `offsets`: where each tensor starts in the flat buffer, in the layout's
  // order (wte, wpe, twelve per block, ln_f.weight, ln_f.bias, head.weight).
  // REQUIRES: a valid model configuration's shape (one pipeline stage, one
  // tensor rank). FAILED_PRECONDITION when the build has no CUDA or the
  // device cannot be used (named, with CUDA's reason).
  static Result<std::unique_ptr<GpuEngine>> Create(const GpuModelShape& shape, std::vector<size_t> offsets,
                                                   size_t num_parameters);
  virtual ~GpuEngine() = default;

  // "NVIDIA H100 80GB HBM3 (device 0, compute capability 9.0)".
  virtual std::string Describe() const = 0;
  // Page-locks the host's parameter and gradient buffers (`count` floats
  // each), so that uploads and downloads run at the link's full speed and
  // gradients land in host_grads directly; idempotent. UnpinHost before
  // their pages may be handed back to the kernel. A failure only leaves
  // them unpinned (slower copies through a pinned staging buffer).
  virtual void PinHost(float* params, float* grads, size_t count) = 0;
  virtual void UnpinHost() = 0;
  // Copies host[begin, end) into the device's parameters [begin, end).
  virtual Status Upload(size_t begin, size_t end, const float* host) = 0;
  virtual void SetSlots(int slots) = 0;
  // As Model::Forward (tokens and targets already checked against vocab).
  virtual Result<float> Forward(const uint8_t* tokens, const uint8_t* targets, int batch, int slot) = 0;
  // As Model::Backward: the gradients of the slot's last Forward, times
  // `scale`, added to host_grads (accumulate) or replacing them. Each time
  // the gradients of [ready_from, end) are final on the device they are
  // copied into host_grads and on_ready(ready_from) is called.
  virtual Status Backward(bool accumulate, float scale, float* host_grads,
                          const std::function<void(size_t ready_from)>& on_ready, int slot) = 0;
  // The slot's last logits, [batch, T, V], copied to the host.
  virtual Status Logits(int slot, std::vector<float>* out) = 0;
  // Device bytes held for activations (all slots).
  virtual size_t activation_bytes() const = 0;
};

}  // namespace tandem::model
