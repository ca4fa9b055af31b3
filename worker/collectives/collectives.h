// CPU collective algorithms over the Transport interface (common/transport/).
//
// Two families, chosen by message size (CollectiveOptions::small_bytes):
//
// Large messages use bandwidth-optimal pipelines. The ring all-reduce is a
// reduce-scatter followed by an all-gather, each of size-1 steps in which
// every rank sends one block to its right neighbour and receives one from its
// left. Each block is cut into chunks of `chunk_bytes`, all posted at once,
// and each chunk is reduced as soon as it arrives, so reduction overlaps the
// transfer. The reduce-scatter reads the caller's input in place (no copy of
// the whole input) and reduces into two block-sized buffers used in turn.
// Broadcast is a chain root -> root+1 -> ... forwarding chunk by chunk;
// reduce is the ring reduce-scatter followed by a gather of the reduced
// blocks to the root.
//
// Small messages (at most `small_bytes`, and all-reduce whenever count is
// smaller than the group) use latency-optimal algorithms with about log2(size)
// steps:
// - all-reduce: recursive doubling. With p the largest power of two <= size
//   and rem = size - p, ranks below 2*rem fold in first (each even one sends
//   its data to the odd one above it and sits out), the p remaining ranks
//   exchange and reduce with the partner at distance 1, 2, 4, ..., and the
//   folded ranks get the result back.
// - reduce-scatter: the recursive-doubling all-reduce of the whole input,
//   keeping this rank's block.
// - all-gather: Bruck's algorithm (ceil(log2 size) steps for any size).
// - broadcast and reduce: binomial trees rooted at `root`.
// - barrier: the dissemination barrier (ceil(log2 size) steps of one byte).
//
// Every result is bit-identical on every rank: each element is reduced in
// one fixed order (the two ranks of a recursive-doubling step both compute
// op(lower rank's value, higher rank's value)), float16 and bfloat16 are
// widened to float32 for every pairwise step and rounded after it (dtype.h),
// and avg sums then divides once.
//
// Before the data moves, neighbours exchange a small descriptor (operation,
// count, dtype, op, root): ranks that disagree get a clear error naming both
// sides, never corrupted data. A caller that checks agreement itself (the
// TransportCommunicator, which also compares sequence numbers) turns this off.
//
// Every wait is bounded by `timeout` (plus `grace`); a dead or stuck peer gives an error
// naming it, never a hang. With an `interrupt` hook, waits run in slices and
// the hook is polled between slices, so a caller can stop a collective from
// another thread (Abort) or when a peer reports a failure.
//
// Tags: a collective with options.tag = T sends its messages with tags
// (T << 8) | phase, one phase per message stream, so collectives with
// different T never match each other's messages.
//
// Thread safety: one collective at a time per (Transport, tag); a Workspace
// serves one collective at a time.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "common/status.h"
#include "common/transport/transport.h"
#include "worker/collectives/dtype.h"

namespace tandem::collectives {

// How a collective splits `count` elements into `n` blocks, one per rank:
// block b is [BlockOffset(count, n, b), BlockOffset(count, n, b + 1)), and
// the first count % n blocks are one element larger. The collectives and
// the communicators (the shared-memory one's reduce-scatter and all-gather)
// use this one definition.
inline size_t BlockOffset(size_t count, int n, int b) {
  const size_t base = count / static_cast<size_t>(n);
  const size_t extra = count % static_cast<size_t>(n);
  const auto ub = static_cast<size_t>(b);
  return ub * base + std::min(ub, extra);
}
inline size_t BlockCount(size_t count, int n, int b) {
  return BlockOffset(count, n, b + 1) - BlockOffset(count, n, b);
}

// Buffers a caller keeps across collectives, so that steady-state calls do
// not allocate scratch memory: buffers grow to the largest size needed and
// are then reused.
class Workspace {
 public:
  static constexpr int kSlots = 4;
  Workspace() = default;
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  // A buffer of at least `bytes` in slot `slot` (0 <= slot < kSlots). Its
  // contents are undefined; it stays valid until the next call for the slot.
  char* Buffer(int slot, size_t bytes);
  // Reusable request lists (cleared by the caller before use).
  std::vector<std::unique_ptr<transport::Request>>& Requests(int which) { return requests_[which == 0 ? 0 : 1]; }

 private:
  struct Slot {
    std::unique_ptr<char[]> data;
    size_t size = 0;
  };
  std::array<Slot, kSlots> slots_;
  std::array<std::vector<std::unique_ptr<transport::Request>>, 2> requests_;
};

struct CollectiveOptions {
  std::chrono::milliseconds timeout{30000};  // for each wait on a peer
  uint64_t tag = 0;                          // < 2^55; keeps concurrent collectives on one transport apart
  size_t chunk_bytes = 1 << 20;              // pipelining granularity of the large-message algorithms
  size_t small_bytes = 64 << 10;             // at or below this many bytes: the latency-optimal algorithms
  bool check = true;                         // exchange descriptors with the neighbours first
  // When set, waits run in slices of `slice` and this is called after every
  // slice that passed without progress (the last one included); a non-OK
  // status stops the collective with it.
  std::function<Status()> interrupt;
  std::chrono::milliseconds slice{50};
  // Added to `timeout` before a wait gives up (the error still names
  // `timeout`): a caller whose ranks report their failures to each other
  // gives the waits that may be stalled behind another rank's stall a head
  // start, so that the report of the cause arrives before they give up.
  std::chrono::milliseconds grace{0};
  Workspace* workspace = nullptr;  // null: the call allocates its own scratch
};

// The algorithm a call with these arguments runs ("ring", "recursive
// doubling", "bruck", "chain", "binomial tree", ...), as chosen by the
// functions below; for logs, benchmarks and tests.
enum class Algorithm { kRing, kRecursiveDoubling, kBruck, kChain, kBinomialTree, kDissemination, kTrivial };
const char* AlgorithmName(Algorithm algorithm);
Algorithm AllReduceAlgorithm(int size, size_t count, DType dtype, const CollectiveOptions& options);
Algorithm ReduceScatterAlgorithm(int size, size_t count, DType dtype, const CollectiveOptions& options);
Algorithm AllGatherAlgorithm(int size, size_t count, DType dtype, const CollectiveOptions& options);
Algorithm BroadcastAlgorithm(int size, size_t count, DType dtype, const CollectiveOptions& options);
Algorithm ReduceAlgorithm(int size, size_t count, DType dtype, const CollectiveOptions& options);

// out[0..count) = op over all ranks' in[0..count). in == out is allowed.
Status AllReduce(transport::Transport& t, const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                 const CollectiveOptions& options = {});
// In place: data[0..count) becomes op over all ranks' data.
Status AllReduce(transport::Transport& t, void* data, size_t count, DType dtype, ReduceOp op,
                 const CollectiveOptions& options = {});
// in[0..count*size) (rank r's contribution, in blocks of `count`); out[0..count)
// becomes op over all ranks of block `rank`. out may be in (block 0).
Status ReduceScatter(transport::Transport& t, const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                     const CollectiveOptions& options = {});
// in[0..count) from each rank; out[0..count*size) holds them in rank order.
// in may be out + rank * count.
Status AllGather(transport::Transport& t, const void* in, void* out, size_t count, DType dtype,
                 const CollectiveOptions& options = {});
// data[0..count) of `root` is copied to every rank.
Status Broadcast(transport::Transport& t, void* data, size_t count, DType dtype, int root,
                 const CollectiveOptions& options = {});
// out[0..count) on `root` becomes op over all ranks' in[0..count); other
// ranks do not touch out (it may be null there). in == out is allowed.
Status Reduce(transport::Transport& t, const void* in, void* out, size_t count, DType dtype, ReduceOp op, int root,
              const CollectiveOptions& options = {});
// Returns once every rank has entered.
Status Barrier(transport::Transport& t, const CollectiveOptions& options = {});

// Waits for `request`, a transfer between rank `self` and rank `peer`, as the
// collectives do: bounded by options.timeout, in slices polling
// options.interrupt when set. A timeout gives DEADLINE_EXCEEDED "rank <peer>
// never <never> within <timeout> ms (waiting on rank <peer> from rank <self>,
// <where>[ <step>])"; other failures get "<where>[ <step>] on rank <self>" as
// context. `never` defaults to "sent its data" (receives) or "took the data
// sent to it" (sends). Messages are formatted only on failure.
Status Wait(transport::Request& request, int self, int peer, bool sending, const CollectiveOptions& options,
            const char* where, int step = -1, const char* never = nullptr);

}  // namespace tandem::collectives
