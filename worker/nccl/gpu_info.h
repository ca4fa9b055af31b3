// What the GPU backend finds on this machine: whether it was compiled in, the
// CUDA runtime, driver and NCCL versions, and how many devices are visible.
//
// Thread safety: thread-safe.
#pragma once

#include <string>

#include "common/status.h"

namespace tandem::gpu {

struct GpuInfo {
  bool compiled = false;    // built with TANDEM_WITH_CUDA
  int runtime_version = 0;  // CUDA runtime, e.g. 13000 for 13.0
  int driver_version = 0;   // 0 when no driver is installed
  int nccl_version = 0;     // e.g. 22805 for 2.28.5
  int device_count = 0;     // visible devices; 0 when none or no driver
  std::string problem;      // why no device can be used, if none can
};

GpuInfo Probe();

// One line for logs: "CUDA 13.0 (driver 12.8), NCCL 2.28.5, 1 device".
std::string Describe(const GpuInfo& info);

// Runs a small kernel on `device` and checks its result (a start-up check that
// the device, the driver and the compiled code work together).
// FailedPrecondition when built without CUDA or the device is absent.
Status SelfCheck(int device);

}  // namespace tandem::gpu
