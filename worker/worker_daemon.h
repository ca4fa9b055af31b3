// The tandem-worker daemon: its DaemonSpec.
//
// A worker is the training process of one rank. At start-up it reports what
// the GPU backend finds (and checks each visible device with a small kernel),
// then follows its coordinator like every member.
#pragma once

#include "common/daemon.h"

namespace tandem::worker {

// Default addresses: gRPC 0.0.0.0:7600, metrics 0.0.0.0:9600.
DaemonSpec MakeDaemonSpec();

}  // namespace tandem::worker
