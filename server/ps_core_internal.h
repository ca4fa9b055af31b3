// What the parameter store's units share (server/ps_*.cc): limits and
// small helpers over wire dtypes and consistency modes. Not for use outside
// the store.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "common/optimizer/gradient.h"
#include "common/status.h"
#include "tandem/v1/server.pb.h"
#include "tandem/v1/types.pb.h"

namespace tandem::server::store_internal {

// The optimizer names every unit of the store uses.
using optim::AccumulateWire;
using optim::EncodeWire;
using optim::GradScan;
using optim::GroupParams;
using optim::Optimizer;
using optim::ScanGradient;
using optim::ThreadPool;
using optim::WireBytes;

constexpr uint32_t kMaxContributors = 1u << 16;
constexpr size_t kMaxTensors = 1'000'000;
constexpr size_t kApplyGrain = 1u << 15;  // elements per optimizer task
// Released gradient buffers kept for reuse (ParameterStore::Buffer).
constexpr size_t kMaxSpareBytes = size_t{128} << 20;
constexpr size_t kMaxSpares = 64;

// fp32 on the wire (UNSPECIFIED means fp32): bytes the store can use as floats.
inline bool Fp32Wire(uint16_t dtype) {
  return dtype == v1::WIRE_DTYPE_FP32 || dtype == v1::WIRE_DTYPE_UNSPECIFIED;
}

// Whether a push's payload `data` (of `dtype`, n elements) sits in `buffer`
// (from PushBuffer), so that the store may keep the buffer instead of copying.
inline bool Keepable(const std::shared_ptr<std::vector<float>>& buffer, const void* data, uint16_t dtype, size_t n) {
  return buffer && buffer->data() == data && buffer->size() == n && Fp32Wire(dtype);
}

inline bool ValidWireDType(uint16_t dtype) {
  return dtype <= v1::WIRE_DTYPE_FP16;
}

inline v1::WireDType Wire(uint16_t dtype) {
  return static_cast<v1::WireDType>(dtype);
}

inline const char* ModeName(v1::ConsistencyMode mode) {
  switch (mode) {
    case v1::CONSISTENCY_MODE_ASYNC:
      return "async";
    case v1::CONSISTENCY_MODE_BOUNDED_STALENESS:
      return "bounded-staleness";
    default:
      return "sync";
  }
}

// What a push or pull of an epoch the server has left gets back: the
// worker pushes the step again in the new one.
inline Status Superseded(uint64_t old_epoch, uint64_t new_epoch) {
  return Aborted("epoch {} was superseded by epoch {}; push the step again", old_epoch, new_epoch);
}

inline bool IsSync(const v1::ConsistencyConfig& c) {
  return c.mode() == v1::CONSISTENCY_MODE_SYNC || c.mode() == v1::CONSISTENCY_MODE_UNSPECIFIED;
}

inline uint64_t TensorElements(const v1::TensorSpec& t) {
  uint64_t n = 1;
  for (int64_t d : t.shape()) n *= static_cast<uint64_t>(d);
  return n;
}

// Widens initial values of `dtype` to fp32.
inline void WidenValues(v1::DType dtype, const char* src, float* dst, size_t n) {
  switch (dtype) {
    case v1::DTYPE_BFLOAT16:
      optim::AccumulateWire(dst, src, v1::WIRE_DTYPE_BF16, n, /*overwrite=*/true);
      break;
    case v1::DTYPE_FLOAT16:
      optim::AccumulateWire(dst, src, v1::WIRE_DTYPE_FP16, n, /*overwrite=*/true);
      break;
    default:
      std::memcpy(dst, src, n * sizeof(float));
  }
}

inline size_t ValueBytes(v1::DType dtype) {
  return dtype == v1::DTYPE_FLOAT32 ? 4 : 2;
}

}  // namespace tandem::server::store_internal
