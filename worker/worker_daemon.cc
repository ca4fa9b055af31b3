#include "worker/worker_daemon.h"

#include <atomic>
#include <thread>

#include <prometheus/gauge.h>
#include <spdlog/spdlog.h>

#include "common/cpus.h"
#include "common/member_daemon.h"
#include "common/transport/ucx/net_device.h"
#include "common/transport/ucx_transport.h"
#include "worker/data_plane.h"
#include "worker/nccl/gpu_info.h"

namespace tandem::worker {

DaemonSpec MakeDaemonSpec(TrainingLoop loop) {
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
    TrainConfig train;
    std::string cpus;
    std::unique_ptr<DataPlane> data_plane;
    std::atomic<bool> stop{false};
    std::thread trainer;
  };
  auto state = std::make_shared<State>();
  auto declare = [state](OptionSet& options) {
    options.String("cpus", &state->cpus,
                   "CPUs this worker and all its threads run on, a list such as 0-3,8 (empty: every CPU it may use)");
    DeclareDataPlaneOptions(options, &state->config);
    DeclareTrainOptions(options, &state->train);
  };
  auto stopping = [state] {
    state->stop = true;
    if (state->data_plane) state->data_plane->Stop();
    if (state->trainer.joinable()) state->trainer.join();
  };
  auto started = [state, loop](Daemon& daemon, v1::NodeIdentity* node, MemberHooks* hooks) -> Status {
    if (!state->cpus.empty()) {
      auto cpus = ParseCpuList(state->cpus);
      Status bound = cpus.ok() ? BindProcess(*cpus) : cpus.status();
      TANDEM_RETURN_IF_ERROR(bound.WithContext(fmt::format("cpus '{}'", state->cpus)));
      spdlog::info("running on CPUs {}", FormatCpuList(*cpus));
    }
    const bool training = loop != nullptr || state->train.steps > 0;
    // auto: the interface that carries the listen address, resolved once here.
    auto& ucx = state->config.backend_options.ucx;
    ucx.net_devices = transport::ucx::ResolveNetDevices(ucx.net_devices, daemon.config().listen_address, ucx.tls,
                                                        "data_plane.ucx_net_devices");
    TANDEM_RETURN_IF_ERROR(transport::CheckUcxOptions(state->config.backend_options.ucx)
                               .WithContext("data_plane.ucx_tls and data_plane.ucx_net_devices"));
    if (training) {
      // Configuration errors stop the start-up, before the worker joins a job.
      TANDEM_RETURN_IF_ERROR(ModelConfigOf(state->train).status());
      TANDEM_RETURN_IF_ERROR(RuntimeOptionsOf(state->train).status());
      if (state->config.backend == "off") {
        return InvalidArgument("training needs a data plane, but data_plane.backend is off");
      }
    }
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
    TANDEM_RETURN_IF_ERROR(state->data_plane->Hook(hooks));
    if (training) {
      state->trainer = std::thread([state, loop, &daemon] {
        WorkerContext context{*state->data_plane, state->train, daemon.registry(),
                              [state] { return state->stop.load() || state->data_plane->drained(); }};
        Status s;
        if (loop) {
          s = loop(context);
        } else {
          TrainerHooks trainer_hooks;
          trainer_hooks.registry = &daemon.registry();
          trainer_hooks.stopping = context.stopping;
          s = Train(state->train, *state->data_plane, trainer_hooks);
        }
        if (s.ok() && loop) {
          // A loop of one's own (the PyTorch front end's returns when its
          // process shuts the worker down).
          spdlog::info("training finished: the training loop returned");
        } else if (s.ok()) {
          spdlog::info("training finished; the worker stays in the job until it is stopped");
        } else if (state->data_plane->drained()) {
          // Not a failure: a supervisor must not restart it into the job.
          spdlog::warn(
              "training ended: the coordinator drained this worker ({}); it stays up, out of the job, until "
              "it is stopped",
              s.ToString());
        } else if (!state->stop) {
          spdlog::error("training failed: {}", s.ToString());
          daemon.RequestShutdown(s.WithContext("training"));
        }
      });
    }
    return Status::Ok();
  };
  MakeMemberSpec(spec, v1::ROLE_WORKER, declare, started, stopping);
  return spec;
}

}  // namespace tandem::worker
