#include "server/server_daemon.h"

#include "common/member_daemon.h"
#include "common/transport/ucx/net_device.h"
#include "common/transport/ucx_transport.h"
#include "server/ps_node.h"

namespace tandem::server {

DaemonSpec MakeDaemonSpec() {
  DaemonSpec spec;
  spec.program = "tandem-server";
  spec.role = "server";
  spec.summary = "a Tandem parameter-server shard: fp32 master weights and optimizer state for its key ranges";
  spec.defaults.listen_address = "0.0.0.0:7500";
  spec.defaults.metrics_address = "0.0.0.0:9500";
  spec.epilog =
      "The server follows the coordinator at --coordinator-address: it stays up while the coordinator is\n"
      "unreachable and reports ready (health service \"tandem.ready\") only while it answers. For every\n"
      "membership epoch it takes the partitions the shard map gives it (as primary or backup), joins the\n"
      "epoch's parameter-server group over UCX, and serves pushes, pulls, replication and the\n"
      "tandem.v1.ParameterServer gRPC service (initialise, statistics, checkpoints).";
  struct State {
    ServerConfig config;
    std::unique_ptr<PsNode> node;
  };
  auto state = std::make_shared<State>();
  auto declare = [state](OptionSet& options) { DeclareServerOptions(options, &state->config); };
  auto started = [state](Daemon&, v1::NodeIdentity*, MemberHooks* hooks) -> Status { return state->node->Hook(hooks); };
  auto stopping = [state] {
    if (state->node) state->node->Stop();
  };
  MakeMemberSpec(spec, v1::ROLE_SERVER, declare, started, stopping);
  spec.setup = [state](Daemon& daemon) -> Status {
    transport::UcxOptions ucx;
    ucx.tls = state->config.ucx_tls;
    // auto: the interface that carries the listen address, resolved once here.
    state->config.ucx_net_devices = transport::ucx::ResolveNetDevices(
        state->config.ucx_net_devices, daemon.config().listen_address, ucx.tls, "server.ucx_net_devices");
    ucx.net_devices = state->config.ucx_net_devices;
    TANDEM_RETURN_IF_ERROR(transport::CheckUcxOptions(ucx).WithContext("server.ucx_tls and server.ucx_net_devices"));
    state->node = std::make_unique<PsNode>(state->config, daemon);
    state->node->Register(daemon);
    return Status::Ok();
  };
  return spec;
}

}  // namespace tandem::server
