// The shared-memory communicator: the ranks of one node run collectives by
// copying through one shared segment, with no transport and no system call on
// the data path.
//
// Why copy through shared segments: a rank's buffers are private memory, so
// data must cross processes either by a single copy from the peer's address
// space (cross-memory attach, a system call per transfer) or through a
// shared staging area. On the machines we measured, the staging copy is
// faster for every size from 4 KiB up (docs/benchmarks.md), and it needs no
// ptrace permission.
//
// The segment holds, per rank, a control block (progress counters, the
// descriptors of its last collectives, pid) and D = 2 sets of staging slots,
// each an input slot and a result slot of `round_bytes`; plus one channel per
// ordered pair of ranks for send/recv.
//
// Algorithms (every rank runs the same steps; each step is numbered, and a
// rank reuses a slot set only after every rank finished reading it):
// - allreduce, small (at most `small_bytes`): each rank copies its input into
//   its slot; once every rank posted, each reduces all slots, in rank order,
//   into its output. One synchronisation.
// - allreduce, large: rounds of `round_bytes`, each cut into one block per
//   rank. Each rank copies the blocks the others own into its slot, reduces
//   the block it owns from its own input and the others' slots (block by
//   block through L1, each block stored into its output and its result slot
//   with the C library's copy), then copies the others' results into its
//   output. Each input byte is read once from memory and each output byte
//   written once; the staging traffic stays in the shared cache. Rounds are
//   software-pipelined: round k + 1 is copied in before waiting on round k.
// - reduce_scatter, reduce, all_gather and broadcast use the same rounds
//   (broadcast in rounds of an eighth of the message, to pipeline).
// - float16 and bfloat16 accumulate in float32 over all ranks and round once.
// - Results are bit-identical on every rank.
//
// Waiting: a rank spins for `spin` (when every rank has a core of its own),
// then sleeps on a futex in the segment that whoever publishes progress rings,
// so ranks that share cores hand them over at once. Between sleeps (at most
// 2 ms each) it checks whether the communicator was aborted, whether a peer
// recorded a failure in the segment, and (every 5 ms) whether the peers it
// waits for are still alive (their /proc entry, which also catches a killed
// process its parent has not yet reaped). A wait that
// passes the timeout names the ranks that never entered the collective.
// The first rank to fail records why in the segment so its peers fail at once
// instead of waiting out their own timeouts.
//
// Thread safety: as Communicator.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/rendezvous.h"
#include "worker/comm/communicator.h"

namespace tandem::comm {

struct ShmOptions {
  // Staging bytes per rank and round; more rounds mean more synchronisation,
  // larger rounds fall out of the shared cache.
  size_t round_bytes = 1 << 20;
  // At or below this many bytes an allreduce (and a reduce) runs in one step.
  size_t small_bytes = 64 << 10;
  // From this many bytes on, outputs are written with streaming stores that
  // bypass the caches; 0 disables. Off by default: on the machines we
  // measured, block-wise reduction through L1 followed by the C library's
  // copy (which avoids reading the destination lines first) did better.
  size_t stream_bytes = 0;
  // Bytes per send/recv slot (two per ordered pair of ranks).
  size_t p2p_slot_bytes = 64 << 10;
  // The longest a waiting rank spins before it sleeps until a peer publishes
  // progress (when the ranks have a core each; otherwise 1 us). The actual
  // budget adapts to how often spinning pays off.
  std::chrono::microseconds spin{50};
};

struct ShmSegment;

class ShmCommunicator : public Communicator {
 public:
  // Rank 0 creates the segment and publishes its name under
  // "shm/<name>/<epoch>"; the others open it. Returns once every rank has
  // attached, or an error naming the ranks that did not within the timeout.
  static Result<std::unique_ptr<ShmCommunicator>> Create(CommInfo info, Rendezvous& rendezvous,
                                                         const ShmOptions& options = {});
  ~ShmCommunicator() override;

  std::string backend() const override { return "shm"; }

  // Makes this rank look dead to its peers, as a killed process would
  // (for tests whose ranks are threads of one process).
  void KillForTesting();

 protected:
  Status DoAllReduce(uint64_t seq, const void* in, void* out, size_t count, DType dtype, ReduceOp op) override;
  Status DoReduceScatter(uint64_t seq, const void* in, void* out, size_t count, DType dtype, ReduceOp op) override;
  Status DoAllGather(uint64_t seq, const void* in, void* out, size_t count, DType dtype) override;
  Status DoBroadcast(uint64_t seq, void* data, size_t count, DType dtype, int root) override;
  Status DoReduce(uint64_t seq, const void* in, void* out, size_t count, DType dtype, ReduceOp op, int root) override;
  Status DoBarrier(uint64_t seq) override;
  Status DoSend(int peer, const void* data, size_t bytes) override;
  Status DoRecv(int peer, void* data, size_t bytes) override;
  Status DoSendRecv(int to, const void* send, int from, void* recv, size_t bytes) override;
  void OnAbort() override;

 private:
  ShmCommunicator(CommInfo info, const ShmOptions& options, std::unique_ptr<ShmSegment> segment);

  struct Op;  // the collective being run: for descriptors and error messages
  enum class Counter : uint8_t { kPost, kReduced, kConsumed };

  // Starts step `t`: waits until the slot set it uses is free.
  Status BeginStep(const Op& op, uint64_t* t);
  // Publishes this rank's counter and waits for `which` >= t on `ranks`
  // (all others when empty).
  Status Publish(Counter which, uint64_t t);
  // Wakes the ranks sleeping on the segment's bell, if any.
  void Ring();
  Status WaitAll(const Op& op, Counter which, uint64_t t, int only_rank = -1);
  // Spins, yields, then sleeps until ready(); fails on abort, a peer's
  // recorded failure, the death of a rank in waiting_on(), or the timeout.
  Status WaitFor(const Op& op, const std::function<bool()>& ready, const std::function<std::vector<int>()>& waiting_on,
                 const std::function<std::string()>& explain);
  Status CheckDescriptors(const Op& op);
  Status Fail(Status status);
  Status PeerFailure() const;
  std::string Laggards(const Op& op, Counter which, uint64_t t, int only_rank) const;
  bool Streaming(size_t bytes) const;
  size_t ChunksOf(size_t bytes) const;
  Result<bool> TrySendChunk(int peer, const char* src, size_t bytes, size_t index);
  Result<bool> TryRecvChunk(int peer, char* dst, size_t bytes, size_t index);
  Status Reduction(const Op& op, const char* src, char* dst, int root);
  char* InSlot(int rank, uint64_t t) const;
  char* ResultSlot(int rank, uint64_t t) const;
  Status Enter(const Op& op);

  const ShmOptions options_;
  std::unique_ptr<ShmSegment> segment_;
  uint64_t step_ = 0;               // the last step this rank began; the same on every rank
  std::vector<uint64_t> sent_;      // chunks sent to each peer
  std::vector<uint64_t> received_;  // chunks received from each peer
  const bool oversubscribed_;       // fewer usable cores than ranks
  const std::chrono::nanoseconds spin_limit_;
  std::chrono::nanoseconds spin_budget_;  // adapts between 0 and spin_limit_
};

}  // namespace tandem::comm
