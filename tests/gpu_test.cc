// The GPU backend compiles and links wherever CUDA is found (TANDEM_WITH_CUDA
// AUTO finds it in /usr/local/cuda), and without a GPU it reports why instead
// of failing.
#include <gtest/gtest.h>

#include "tandem/config.h"
#include "worker/nccl/gpu_info.h"

namespace tandem::gpu {
namespace {

TEST(GpuBackendTest, ProbeMatchesTheBuild) {
  const GpuInfo info = Probe();
  EXPECT_EQ(info.compiled, TANDEM_CUDA_ENABLED == 1);
  if (!info.compiled) {
    EXPECT_FALSE(info.problem.empty());
    EXPECT_EQ(Describe(info), "GPU backend not compiled in");
    EXPECT_EQ(SelfCheck(0).code(), StatusCode::kFailedPrecondition);
    return;
  }
  // The CUDA runtime and NCCL were linked in and answer without a GPU.
  EXPECT_GE(info.runtime_version, 12000);
  EXPECT_GE(info.nccl_version, 21800);
  EXPECT_NE(Describe(info).find("NCCL"), std::string::npos);
  if (info.device_count == 0) {
    EXPECT_FALSE(info.problem.empty());
    const Status s = SelfCheck(0);
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(s.message().find("device 0"), std::string::npos) << s.message();
  } else {
    for (int d = 0; d < info.device_count; ++d) EXPECT_TRUE(SelfCheck(d).ok()) << "device " << d;
  }
}

}  // namespace
}  // namespace tandem::gpu
