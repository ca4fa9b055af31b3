#include "worker/worker_daemon.h"

#include <prometheus/gauge.h>
#include <spdlog/spdlog.h>

#include "common/member_daemon.h"
#include "worker/data_plane.h"
#include "worker/nccl/gpu_info.h"

namespace tandem::worker {

DaemonSpec MakeDaemonSpec() {
  DaemonSpec spec;
  spec.program = "tandem-worker";
  spec.role = "worker";
  spec.summary = "a Tandem worker: one training rank (collectives, model parallelism, the hybrid step)";
  spec.defaults.listen_address = "0.0.0.0:7600";
  spec.defaults.metrics_address = "0.0.0.0:9600";
  spec.epilog =
      "The worker follows the coordinator at --coordinator-address: it stays up while the coordinator is\n"
      "unreachable and reports ready (health service \"tandem.ready\") only while it answers.";
  struct State {
    DataPlaneConfig config;
    std::unique_ptr<DataPlane> data_plane;
  };
  auto state = std::make_shared<State>();
  auto declare = [state](OptionSet& options) { DeclareDataPlaneOptions(options, &state->config); };
  auto stopping = [state] {
    if (state->data_plane) state->data_plane->Stop();
  };
  auto started = [state](Daemon& daemon, v1::NodeIdentity* node, MemberHooks* hooks) -> Status {
    const gpu::GpuInfo info = gpu::Probe();
    spdlog::info("GPU backend: {}", gpu::Describe(info));
    int usable = 0;
    for (int d = 0; d < info.device_count; ++d) {
      if (Status s = gpu::SelfCheck(d); !s.ok()) {
        spdlog::error("{}", s.message());
      } else {
        ++usable;
      }
    }
    prometheus::BuildGauge()
        .Name("tandem_worker_gpus")
        .Help("GPUs this worker can use: visible and passing the start-up self-check.")
        .Register(daemon.registry())
        .Add({})
        .Set(usable);
    // What the coordinator learns of this worker's node at registration.
    node->set_local_device_count(static_cast<uint32_t>(usable));
    auto* caps = node->mutable_capabilities();
    caps->set_cuda(info.compiled && usable > 0);
    caps->set_nccl(info.compiled && usable > 0);
    if (info.compiled) {
      caps->set_cuda_version(fmt::format("{}.{}", info.runtime_version / 1000, (info.runtime_version % 1000) / 10));
      caps->set_nccl_version(fmt::format("{}.{}.{}", info.nccl_version / 10000, (info.nccl_version % 10000) / 100,
                                         info.nccl_version % 100));
    }
    state->data_plane = std::make_unique<DataPlane>(state->config, daemon);
    return state->data_plane->Hook(hooks);
  };
  MakeMemberSpec(spec, v1::ROLE_WORKER, declare, started, stopping);
  return spec;
}

}  // namespace tandem::worker
