// A communicator: a group of ranks that run collectives together, built for
// one membership epoch. Backends (shared memory inside a node, a transport
// such as UCX between nodes, NCCL on GPUs) implement the Do* hooks;
// everything they share lives here: argument checks, collective sequence
// numbers, progress for heartbeats, and aborting when the epoch is
// superseded.
//
// Rules every backend keeps (and the shared communicator tests check):
// - Every rank calls the same collectives in the same order (SPMD). Ranks
//   that disagree on the kind, count, dtype, op or root of a collective get
//   INVALID_ARGUMENT naming both sides, never corrupted data.
// - No call waits longer than `timeout` on a peer: a peer that never enters
//   a collective gives DEADLINE_EXCEEDED naming the ranks that never
//   entered it; a peer that died gives UNAVAILABLE naming it.
// - After Abort(reason) every operation in flight or later fails with
//   ABORTED carrying `reason` (for example "epoch 3 was superseded by
//   epoch 4"), promptly, never after the timeout.
// - After an error the communicator is broken: later calls fail with the
//   first error. Build a new one (a new epoch) to go on.
// - in == out is allowed where a call takes both (in place).
//
// Thread safety: one collective at a time (calls from several threads must
// be serialised by the caller; the worker runtime's communication thread
// does this). Abort() and
// progress() may be called from any thread at any time.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "worker/collectives/dtype.h"

namespace tandem::comm {

using collectives::DType;
using collectives::ReduceOp;

enum class Kind : uint8_t {
  kAllReduce = 1,
  kReduceScatter,
  kAllGather,
  kBroadcast,
  kReduce,
  kBarrier,
  kSend,
  kRecv,
};
// "allreduce", "reduce_scatter", "all_gather", "broadcast", "reduce",
// "barrier", "send", "recv" (the names heartbeats carry).
const char* KindName(Kind kind);

// One rank's view of a collective in error messages, the same for every
// backend: "allreduce seq 4 of 100 float32 elements (op sum)",
// "broadcast seq 2 of 64 float32 elements from root 3", "barrier seq 7".
std::string DescribeCollective(Kind kind, uint64_t seq, uint64_t count, DType dtype, ReduceOp op, int root);

// Who a communicator is: what the coordinator and the logs call it.
struct CommInfo {
  std::string name = "world";  // "world", "node", "dp/3", "tp/0", "pp/1"
  uint64_t epoch = 0;
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{30000};  // longest wait on a peer
  // The members' ids in group-rank order (for reports naming a peer); empty
  // when the builder does not know them.
  std::vector<uint64_t> member_ids;
};

// Whom a collective waited for (straggler attribution): the group rank that
// entered it last, and how much later than the next-to-last rank it
// entered, in seconds. rank -1: not known (a group of one, a backend that
// does not measure it, or a rank whose neighbours entered before it).
struct Wait {
  int rank = -1;
  double seconds = 0;
};

// Progress, as heartbeats report it (v1::CollectiveProgress).
struct Progress {
  std::string communicator;
  uint64_t last_entered = 0;
  uint64_t last_completed = 0;
  std::string last_kind;
};

class Communicator {
 public:
  explicit Communicator(CommInfo info);
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  const std::string& name() const { return info_.name; }
  uint64_t epoch() const { return info_.epoch; }
  int rank() const { return info_.rank; }
  int size() const { return info_.size; }
  std::chrono::milliseconds timeout() const { return info_.timeout; }
  // The backend's name: "shm", "ucx", "local", "nccl".
  virtual std::string backend() const = 0;
  // Whether buffers are device (GPU) memory.
  virtual bool device_buffers() const { return false; }

  // out[0..count) = op over every rank's in[0..count).
  Status AllReduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op);
  // in[0..count*size) holds one block of `count` per rank; out[0..count) =
  // op over every rank's block `rank()`.
  Status ReduceScatter(const void* in, void* out, size_t count, DType dtype, ReduceOp op);
  // out[0..count*size) = every rank's in[0..count), in rank order.
  Status AllGather(const void* in, void* out, size_t count, DType dtype);
  // data[0..count) of `root` is copied to every rank.
  Status Broadcast(void* data, size_t count, DType dtype, int root);
  // out[0..count) on `root` = op over every rank's in; `out` is untouched
  // (and may be null) on the other ranks.
  Status Reduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op, int root);
  // Returns once every rank has entered.
  Status Barrier();
  // Point to point, matched in order per (sender, receiver). Not numbered as
  // collectives (only the two ranks take part) but reported as progress.
  Status Send(int peer, const void* data, size_t count, DType dtype);
  Status Recv(int peer, void* data, size_t count, DType dtype);
  // Sends to `to` and receives from `from` at the same time (a ring shift
  // when every rank calls it): never deadlocks on large messages, unlike a
  // Send followed by a Recv on both sides.
  Status SendRecv(int to, const void* send, int from, void* recv, size_t count, DType dtype);

  // Fails every operation in flight or later with ABORTED `reason`.
  void Abort(const std::string& reason);
  // The status operations fail with once the communicator is broken or
  // aborted; OK while healthy.
  Status health() const;
  Progress progress() const;

  // Sees every operation that succeeded: its kind, the bytes it carried and
  // how long it took on this rank, from the call to its return (waiting for
  // peers that enter late included). Bytes: the buffer of allreduce, reduce
  // and broadcast (count elements); the whole buffer of reduce_scatter
  // (input) and all_gather (output), count times size() elements; 0 for a
  // barrier; the message of send and recv (a SendRecv counts as one send of
  // its message). Set it before the first operation; it runs on the calling
  // thread (for metrics: keep it cheap).
  using Observer = std::function<void(Kind kind, uint64_t bytes, double seconds)>;
  void SetObserver(Observer observer) { observer_ = std::move(observer); }

  // Whom the last numbered collective that succeeded waited for (see Wait).
  // The shared-memory backend knows every rank's entry time (one clock) and
  // names the rank that entered last, on every rank. The transport backend
  // measures, without comparing clocks, how long this rank waited for each
  // ring neighbour's agreement descriptor, which a neighbour sends as it
  // enters: the two neighbours of a rank that entered late name that rank
  // (the one that caused the delay, not a predecessor that merely passed it
  // on, since nothing is chained yet at entry), and the other ranks, which
  // wait for it later inside the algorithm, report no one (rank -1); whoever
  // combines the group's reports (the coordinator) takes the largest. Read
  // it on the thread that runs the collectives, after the call.
  Wait last_wait() const { return last_wait_; }
  // The member id of group rank `rank` (CommInfo::member_ids), 0 if unknown.
  uint64_t member_id(int rank) const;

 protected:
  // The hooks a backend implements. Arguments are already checked (ranks in
  // range, non-null buffers when count > 0, op valid for dtype); `seq` is
  // the collective's sequence number in this communicator (1, 2, ...; the
  // same on every rank for the same collective).
  virtual Status DoAllReduce(uint64_t seq, const void* in, void* out, size_t count, DType dtype, ReduceOp op) = 0;
  virtual Status DoReduceScatter(uint64_t seq, const void* in, void* out, size_t count, DType dtype, ReduceOp op) = 0;
  virtual Status DoAllGather(uint64_t seq, const void* in, void* out, size_t count, DType dtype) = 0;
  virtual Status DoBroadcast(uint64_t seq, void* data, size_t count, DType dtype, int root) = 0;
  virtual Status DoReduce(uint64_t seq, const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                          int root) = 0;
  virtual Status DoBarrier(uint64_t seq) = 0;
  virtual Status DoSend(int peer, const void* data, size_t bytes) = 0;
  virtual Status DoRecv(int peer, void* data, size_t bytes) = 0;
  // By default runs DoSend on a helper thread and DoRecv on the caller's, so
  // a backend's DoSend and DoRecv must tolerate running concurrently with
  // different peers or directions. Backends override it to do better.
  virtual Status DoSendRecv(int to, const void* send, int from, void* recv, size_t bytes);
  // Called once by Abort() after the reason is recorded: wake every waiter.
  virtual void OnAbort() {}

  // For backends: true once aborted (health() then carries the reason).
  // Cheap; poll it in wait loops.
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }
  const CommInfo& info() const { return info_; }
  // For backends: records whom the collective being run waited for.
  void SetLastWait(Wait wait) { last_wait_ = wait; }

 private:
  // Fails with the first error once broken; numbers a collective (seq not
  // null) or records a point-to-point kind (seq null).
  Status Begin(Kind kind, uint64_t* seq);
  Status Finish(Status status, bool numbered);
  void Observe(Kind kind, uint64_t bytes, std::chrono::steady_clock::time_point started) const;

  const CommInfo info_;
  Observer observer_;
  std::atomic<bool> aborted_{false};
  std::atomic<uint64_t> entered_{0};
  std::atomic<uint64_t> completed_{0};
  std::atomic<uint8_t> last_kind_{0};
  Wait last_wait_;  // the collectives' thread's
  mutable Mutex mu_;
  Status broken_ TANDEM_GUARDED_BY(mu_);
};

}  // namespace tandem::comm
