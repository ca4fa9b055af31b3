// The tandem-worker daemon: its DaemonSpec.
//
// A worker is the training process of one rank. At start-up it reports what
// the GPU backend finds (and checks each visible device with a small kernel),
// then follows its coordinator like every member. With a training loop (the
// reference trainer when train.steps > 0, or the caller's own through
// RunWorker, worker/include/tandem/worker.h) it trains on a thread of its
// own; a loop that fails stops the daemon with exit code 1.
#pragma once

#include <functional>

#include "common/daemon.h"
#include "common/status.h"
#include "worker/data_plane.h"
#include "worker/runtime/trainer.h"

namespace tandem::worker {

// What a training loop gets from the worker daemon.
struct WorkerContext {
  DataPlane& data_plane;     // build a Runtime over it
  const TrainConfig& train;  // the train.* options (mode, wire types, buckets, optimizer, ...)
  prometheus::Registry& registry;
  std::function<bool()> stopping;  // true once the daemon shuts down
};
using TrainingLoop = std::function<Status(WorkerContext&)>;

// Default addresses: gRPC 0.0.0.0:7600, metrics 0.0.0.0:9600. Without a
// loop, the reference trainer runs when train.steps > 0.
DaemonSpec MakeDaemonSpec(TrainingLoop loop = nullptr);

}  // namespace tandem::worker
