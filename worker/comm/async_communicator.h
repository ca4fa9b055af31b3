// AsyncCommunicator: a Communicator driven by a progress thread, so training
// code can start collectives, go on computing, and wait for them later.
//
// Every *Async call queues one operation and returns a Handle at once. One
// progress thread runs the operations on the wrapped communicator strictly in
// submission order (the order the SPMD rules of communicator.h need), and
// completes each handle with the operation's status.
//
// Fusion. Consecutive AllReduceAsync calls with the same dtype and op whose
// tensors are smaller than `fusion_bytes` are packed into one fusion bucket
// and run as a single allreduce through a reusable fusion buffer; the results
// are copied out and every handle of the bucket completes together. A bucket
// of one tensor skips the copies and runs in place. Because every rank must
// run the same allreduces, bucket boundaries depend only on the sequence of
// calls, never on timing. A bucket closes (and is queued to run) when
// - the next tensor would overflow it (that tensor starts a new bucket);
// - a call of another kind, or an allreduce of another dtype or op, or one of
//   `fusion_bytes` or more (which runs alone, in place), is submitted;
// - Flush() or Synchronize() is called;
// - Wait() or Done() is called on a handle of the open bucket.
// So every rank must make the same sequence of calls, Wait() and Done()
// included (the first such call on a handle is what counts). SPMD training
// code does: each rank runs the same program. (Waiting from another thread
// while the submitting thread still adds to the bucket would make the
// boundary depend on timing: wait from the submitting thread, or Flush()
// first.) Fusion copies with memcpy, so it
// is off when the communicator works on device buffers, and with
// fusion_bytes = 0.
//
// Buffers: `in` must stay valid and unchanged, and `out` valid and untouched,
// until the handle is done (the progress thread reads and writes them while
// the operation runs, not when it is submitted).
//
// Errors. When an operation fails and leaves the communicator broken (see
// Communicator::health()), every handle of that operation (all the tensors of
// a bucket) completes with the error, then every operation submitted after
// it (queued, or in the open bucket) in submission order, and every later
// operation fails fast with it without running; none of them completes
// before an operation submitted earlier. Abort(reason) aborts the wrapped communicator (so
// the operation in flight fails promptly with ABORTED carrying `reason`) and
// completes every queued operation, and the open bucket, with that status at
// once. The destructor does the same with reason "communicator closed" and
// joins the progress thread; the wrapped communicator is aborted either way,
// so an AsyncCommunicator owns the use of its communicator.
//
// Thread safety: all methods are thread-safe. Calls from several threads are
// queued in the order they take the internal lock; as the SPMD rules need the
// same order on every rank, a rank normally submits from one thread. Handles
// may be waited on from any thread, also after the AsyncCommunicator is gone
// (every handle is complete by then).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "common/status.h"
#include "worker/comm/communicator.h"

namespace tandem::comm {

struct AsyncOptions {
  // Size of a fusion bucket in bytes; allreduces of at least this size run
  // alone. 0 disables fusion.
  size_t fusion_bytes = size_t{25} * 1024 * 1024;
};

namespace internal {
struct AsyncOp;
class AsyncCore;
}  // namespace internal

class AsyncCommunicator {
 public:
  // The result of one submitted operation: shared state, cheap to copy. A
  // default-constructed Handle refers to no operation: Done() is true and its
  // status is FAILED_PRECONDITION.
  class Handle {
   public:
    Handle() = default;
    // Waits up to `timeout` for the operation and returns its status.
    // DEADLINE_EXCEEDED from Wait itself only means "not done yet" (the
    // operation keeps running; wait again); an operation that timed out on a
    // peer also fails with DEADLINE_EXCEEDED, but then Done() is true.
    // Closes the handle's fusion bucket if it is still open (see above).
    Status Wait(std::chrono::milliseconds timeout) const;
    // Whether the operation has completed. Closes the handle's fusion bucket
    // if it is still open.
    bool Done() const;
    // The operation's status once Done(); FAILED_PRECONDITION while it runs.
    Status status() const;

   private:
    friend class AsyncCommunicator;
    friend class internal::AsyncCore;
    explicit Handle(std::shared_ptr<internal::AsyncOp> op) : op_(std::move(op)) {}
    std::shared_ptr<internal::AsyncOp> op_;
  };

  explicit AsyncCommunicator(std::shared_ptr<Communicator> comm, AsyncOptions options = {});
  // Aborts with "communicator closed" and joins the progress thread.
  ~AsyncCommunicator();
  AsyncCommunicator(const AsyncCommunicator&) = delete;
  AsyncCommunicator& operator=(const AsyncCommunicator&) = delete;

  // The operations of Communicator, with the same arguments and meaning.
  Handle AllReduceAsync(const void* in, void* out, size_t count, DType dtype, ReduceOp op);
  Handle ReduceScatterAsync(const void* in, void* out, size_t count, DType dtype, ReduceOp op);
  Handle AllGatherAsync(const void* in, void* out, size_t count, DType dtype);
  Handle BroadcastAsync(void* data, size_t count, DType dtype, int root);
  Handle ReduceAsync(const void* in, void* out, size_t count, DType dtype, ReduceOp op, int root);
  Handle BarrierAsync();
  Handle SendAsync(int peer, const void* data, size_t count, DType dtype);
  Handle RecvAsync(int peer, void* data, size_t count, DType dtype);

  // Closes the open fusion bucket, if any, so that it runs. Does not wait.
  void Flush();
  // Flushes, then waits up to `timeout` until every operation submitted so
  // far has completed. Returns the first error that broke the communicator
  // (OK if none), or DEADLINE_EXCEEDED if operations are still running.
  Status Synchronize(std::chrono::milliseconds timeout);
  // Aborts the wrapped communicator and fails every queued operation with
  // ABORTED carrying `reason`, promptly. Later submissions fail at once.
  void Abort(const std::string& reason);

  // OK while healthy; otherwise the status every later operation fails with.
  Status health() const;
  Communicator& communicator() const { return *comm_; }
  const std::string& name() const { return comm_->name(); }
  int rank() const { return comm_->rank(); }
  int size() const { return comm_->size(); }
  Progress progress() const { return comm_->progress(); }

  // Counters since construction, for metrics.
  // Operations submitted (one per *Async call).
  uint64_t ops() const;
  // Allreduce tensors that went through a fusion bucket.
  uint64_t fused_tensors() const;
  // Fusion buckets run (each is one allreduce on the communicator).
  uint64_t bucket_flushes() const;
  // Bytes of the tensors of the operations that completed successfully (the
  // `count` elements each call names).
  uint64_t bytes() const;

 private:
  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<internal::AsyncCore> core_;
  std::thread thread_;
};

}  // namespace tandem::comm
