#include "coordinator/coordinator_daemon.h"

namespace tandem::coordinator {

DaemonSpec MakeDaemonSpec() {
  DaemonSpec spec;
  spec.program = "tandem-coordinator";
  spec.role = "coordinator";
  spec.summary = "the Tandem coordinator: ranks, membership epochs and the parameter-server shard map";
  spec.defaults.listen_address = "0.0.0.0:7400";
  spec.defaults.metrics_address = "0.0.0.0:9400";
  spec.epilog =
      "Health: the standard gRPC health service; service \"\" is liveness, \"tandem.ready\" readiness.\n"
      "Metrics: http://METRICS_ADDRESS/metrics (see docs/metrics.md).";
  spec.started = [](Daemon& daemon) {
    daemon.SetReady(true);
    return Status::Ok();
  };
  return spec;
}

}  // namespace tandem::coordinator
