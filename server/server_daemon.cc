#include "server/server_daemon.h"

#include "common/member_daemon.h"

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
      "unreachable and reports ready (health service \"tandem.ready\") only while it answers.";
  MakeMemberSpec(spec, v1::ROLE_SERVER, nullptr, nullptr);
  return spec;
}

}  // namespace tandem::server
