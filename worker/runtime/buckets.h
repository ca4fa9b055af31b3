// The runtime's buckets (worker/runtime/runtime.h): ranges of the flat
// buffer whose gradients travel together, with what each mode needs to send
// them and land the parameters that come back; and the sharded placement's
// gathers over the same partitions. Planned at each resync (step.h's
// PlanBuckets; buckets.cc). Internal header: not installed.
//
// Thread safety: a bucket is the training thread's while no task of the
// step is queued, and the communication thread's while its task runs.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "worker/ps/ps_client.h"
#include "worker/runtime/runtime.h"

namespace tandem::worker {

// One bucket: a range of the flat buffer whose gradients travel together.
struct Runtime::Bucket {
  size_t begin = 0;
  size_t end = 0;
  // Server modes: the partitions this worker pushes and pulls, each with
  // where its reduced gradient comes from and where its parameters go.
  struct Owned {
    uint32_t partition = 0;
    const float* grad = nullptr;
    float* param = nullptr;
    size_t count = 0;
    size_t wire_offset = 0;    // elements into wire_out / wire_in
    uint32_t contributor = 0;  // among the partition's contributors (its stages' together)
    uint32_t contributors = 0;
    // A partition only partly in this stage (not packed): the whole
    // partition's gradient (zeros outside the stage) and pulled parameters.
    size_t cut = 0;  // index into the bucket's partitions
    std::vector<float> edge_grad, edge_param;
  };
  std::vector<Owned> owned;
  // Hybrid with L > 1 local ranks: partition k of the bucket belongs to local
  // rank k % L, at slot[k] in that rank's block of `block` elements.
  std::vector<uint32_t> partitions;
  std::vector<std::pair<size_t, size_t>> ranges;  // whole partitions, in the whole model's elements
  // The part of each partition in this stage: [first, second) of params_,
  // and where it starts inside the partition.
  std::vector<std::pair<size_t, size_t>> cuts;
  std::vector<size_t> cut_offset;
  std::vector<size_t> slot;
  std::vector<uint32_t> owner;  // the local rank of each partition: its id % L
  size_t block = 0;
  size_t share = 0;  // elements of this rank's partitions in the bucket (its block's first `share`)
  // This rank's share of the block (`share` elements; the node collectives
  // move whole blocks, through scratch when share < block): the node's sum
  // of its partitions' gradients, and their new parameters.
  std::vector<float> mine;
  std::vector<float> pulled;
  std::vector<uint16_t> wire_out;
  std::vector<uint16_t> wire_in;
  std::vector<std::shared_ptr<PsOp>> pushes;
  std::vector<std::shared_ptr<PsOp>> pulls;
  // The task that lands the last step's pulled parameters (0: none since
  // the last resync); Acquire waits for it.
  uint64_t landed = 0;
};

// One gather of the sharded placement: the partitions that overlap a range
// of the stage, each from the worker that owns it (partition k of a bucket
// belongs to local rank k % L), packed by owner as the buckets are.
struct Runtime::GatherPlan {
  std::vector<std::pair<Bucket*, size_t>> parts;  // (bucket, k)
  std::vector<size_t> slot;                       // in its owner's block
  size_t block = 0;
  std::pair<size_t, size_t> span{0, 0};  // the stage's elements the gather writes
};

}  // namespace tandem::worker
