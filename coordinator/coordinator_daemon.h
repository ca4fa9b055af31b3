// The tandem-coordinator daemon: its configuration and its DaemonSpec.
//
// The coordinator is the control plane's centre (docs/architecture.md): it
// will assign ranks, keep membership and own the shard map. It has no
// dependency on the data plane.
#pragma once

#include "common/daemon.h"

namespace tandem::coordinator {

// Default addresses: gRPC 0.0.0.0:7400, metrics 0.0.0.0:9400.
DaemonSpec MakeDaemonSpec();

}  // namespace tandem::coordinator
