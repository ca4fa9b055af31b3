// CPU collective algorithms over the Transport interface (worker/transport/).
//
// The ring algorithms are bandwidth-optimal: all-reduce is a reduce-scatter
// followed by an all-gather, each of size-1 steps in which every rank sends
// one block to its right neighbour and receives one from its left. Each block
// is cut into chunks of `chunk_bytes`, all posted at once, and each chunk is
// reduced as soon as it arrives, so reduction overlaps the transfer.
//
// Before the data moves, neighbours exchange a small descriptor (operation,
// count, dtype, op): ranks that disagree get a clear error naming both sides,
// never corrupted data. Every wait is bounded by `timeout`; a dead or stuck
// peer gives an error naming it, never a hang.
//
// Thread safety: one collective at a time per Transport (tags keep
// concurrent communicators apart).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

#include "common/status.h"
#include "worker/collectives/dtype.h"
#include "worker/transport/transport.h"

namespace tandem::collectives {

struct CollectiveOptions {
  std::chrono::milliseconds timeout{30000};  // for each wait on a peer
  uint64_t tag = 0;                          // keeps concurrent collectives on one transport apart
  size_t chunk_bytes = 1 << 20;              // pipelining granularity
};

// In place: data[0..count) becomes op over all ranks' data.
Status AllReduce(transport::Transport& t, void* data, size_t count, DType dtype, ReduceOp op,
                 const CollectiveOptions& options = {});
// in[0..count*size) (rank r's contribution, in blocks of `count`); out[0..count)
// becomes op over all ranks of block `rank`.
Status ReduceScatter(transport::Transport& t, const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                     const CollectiveOptions& options = {});
// in[0..count) from each rank; out[0..count*size) holds them in rank order.
Status AllGather(transport::Transport& t, const void* in, void* out, size_t count, DType dtype,
                 const CollectiveOptions& options = {});
// data[0..count) of `root` is copied to every rank (a pipelined chain).
Status Broadcast(transport::Transport& t, void* data, size_t count, DType dtype, int root,
                 const CollectiveOptions& options = {});
// Returns once every rank has entered.
Status Barrier(transport::Transport& t, const CollectiveOptions& options = {});

}  // namespace tandem::collectives
