// The tandem-server daemon (one parameter-server shard): its DaemonSpec.
#pragma once

#include "common/daemon.h"

namespace tandem::server {

// Default addresses: gRPC 0.0.0.0:7500, metrics 0.0.0.0:9500.
DaemonSpec MakeDaemonSpec();

}  // namespace tandem::server
