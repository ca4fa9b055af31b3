#include "worker/nccl/gpu_info.h"

#include "tandem/config.h"

#if TANDEM_CUDA_ENABLED
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

namespace tandem::gpu {

#if TANDEM_CUDA_ENABLED
// Defined in self_check.cu: empty on success, else what failed.
std::string RunSelfCheckKernel(int device);
#endif

namespace {

std::string Version(int v, int major_div, int minor_div) {
  return fmt::format("{}.{}", v / major_div, (v % major_div) / minor_div);
}

}  // namespace

GpuInfo Probe() {
  GpuInfo info;
#if TANDEM_CUDA_ENABLED
  info.compiled = true;
  cudaRuntimeGetVersion(&info.runtime_version);
  if (cudaDriverGetVersion(&info.driver_version) != cudaSuccess) info.driver_version = 0;
  ncclGetVersion(&info.nccl_version);
  const cudaError_t err = cudaGetDeviceCount(&info.device_count);
  if (err != cudaSuccess) {
    info.device_count = 0;
    info.problem = cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky error for later calls
  } else if (info.device_count == 0) {
    info.problem = "no CUDA device is visible";
  }
#else
  info.problem = "built without CUDA (TANDEM_WITH_CUDA=OFF or CUDA not found at build time)";
#endif
  return info;
}

std::string Describe(const GpuInfo& info) {
  if (!info.compiled) return "GPU backend not compiled in";
  std::string text = fmt::format("CUDA runtime {}", Version(info.runtime_version, 1000, 10));
  text += info.driver_version > 0 ? fmt::format(" (driver {})", Version(info.driver_version, 1000, 10))
                                  : std::string(" (no driver)");
  text += fmt::format(", NCCL {}.{}.{}", info.nccl_version / 10000, (info.nccl_version % 10000) / 100,
                      info.nccl_version % 100);
  text += fmt::format(", {} device{}", info.device_count, info.device_count == 1 ? "" : "s");
  if (!info.problem.empty()) text += fmt::format(" ({})", info.problem);
  return text;
}

Status SelfCheck(int device) {
#if TANDEM_CUDA_ENABLED
  const std::string problem = RunSelfCheckKernel(device);
  if (!problem.empty()) return FailedPrecondition("GPU self-check of device {}: {}", device, problem);
  return Status::Ok();
#else
  return FailedPrecondition("GPU self-check of device {}: built without CUDA", device);
#endif
}

}  // namespace tandem::gpu
