// The data plane's transport interface: tagged, non-blocking, point-to-point
// messages between the ranks of one group. Collective algorithms
// (worker/collectives/) see only this interface; implementations (in-process
// for tests, UCX for shared memory, TCP and verbs) know nothing of
// algorithms, and rendezvous belongs to the coordinator.
//
// Semantics every implementation keeps (and the shared transport tests check):
// - Messages between one (sender, receiver, tag) are matched in order.
// - A receive whose size differs from the message fails with INVALID_ARGUMENT
//   naming both sizes (ranks that disagree on count or dtype get an error,
//   not corrupted data).
// - Wait() gives up after its timeout with DEADLINE_EXCEEDED naming the peer;
//   the request can be waited on again.
// - When a peer dies, every pending and later operation with it fails with
//   UNAVAILABLE naming it.
//
// Operations come in two forms. Send/Recv return a Request to Wait on.
// SendAsync/RecvAsync take a Completion instead, which the transport calls
// once, with the operation's status, on its own completion thread (UCX: the
// progress thread, a caller inside Progress(), or a thread of its own for an
// operation posted while the transport closes; LocalTransport: the fabric's
// delivery thread), never from inside the posting call: a caller may post
// while holding its own locks. Completions never run concurrently.
// That thread delivers every message, so a Completion must not block for
// long; it may post further operations. Their Request is still returned:
// destroying it before completion cancels the operation (a receive; a send
// runs to completion or fails with its peer) and returns once the Completion
// has run or never will; destroyed on the completion thread it does not wait.
// Messages of one (sender, receiver, tag) are received either with Recv or
// with RecvAsync, not with both.
//
// Thread safety: a Transport may be used from several threads; one Request
// from one thread at a time.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "common/status.h"

namespace tandem::transport {

// A send or receive in flight.
class Request {
 public:
  virtual ~Request() = default;
  // Blocks until the operation completes, fails, or `timeout` passes.
  virtual Status Wait(std::chrono::milliseconds timeout) = 0;
};

class Transport {
 public:
  using Completion = std::function<void(const Status&)>;

  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // REQUIRES: 0 <= peer < size(), peer != rank(). `data` stays valid and
  // unchanged (send) or untouched by others (receive) until the request
  // completes.
  virtual std::unique_ptr<Request> Send(int peer, uint64_t tag, const void* data, size_t bytes) = 0;
  virtual std::unique_ptr<Request> Recv(int peer, uint64_t tag, void* data, size_t bytes) = 0;
  // As Send and Recv, with `done` called on the completion thread (above).
  // The Request may be waited on as well.
  virtual std::unique_ptr<Request> SendAsync(int peer, uint64_t tag, const void* data, size_t bytes,
                                             Completion done) = 0;
  virtual std::unique_ptr<Request> RecvAsync(int peer, uint64_t tag, void* data, size_t bytes, Completion done) = 0;
  // Returns once the operations this thread posted before the call are
  // handed to the network (their completions may still be pending), so that
  // what the thread does next does not hold them up: a transport whose
  // operations are started by a thread of its own may otherwise not start
  // them until this thread gives up its core. Does not wait on that thread
  // itself, or on a transport that starts operations inside the call. Inside
  // a completion it starts what is posted right away (what that completion
  // posted, with anything posted before it), in order, where the transport
  // can, instead of when that completion returns; the completions of those
  // operations still run only after the running one returns.
  virtual void WaitPosted() {}
  // Makes one round of progress on the calling thread, for a caller about to
  // wait for an operation: starts what was posted and runs the completions of
  // operations that ended, here, so that a short request and its reply need
  // no hand-off between threads. Only one thread at a time does this (the
  // transport's own completion thread included): kBusy when another one is,
  // or when the transport cannot be driven from outside (the default); the
  // caller then waits as usual. Must not be called while holding a lock that
  // a completion may take. Inside a completion it does nothing (kBusy).
  enum class Progressed { kBusy, kIdle, kActive };
  virtual Progressed Progress() { return Progressed::kBusy; }
};

// A request that is already complete, with `status`.
std::unique_ptr<Request> Completed(Status status);

// For a thread about to block on an operation of `bytes`: calls `progress`
// (a transport's Progress) until `done` says true, `deadline` passes, the
// transport is being progressed by another thread (kBusy), or kDriveIdle
// passes without a round that found work. The caller then waits until
// `deadline` as usual for what is left. Does nothing for operations larger
// than kDriveMaxBytes: for those the hand-off is a small part of the time,
// and a waiter that polls beside the transport's thread on a shared core
// slowed 16 MiB transfers by 5-10%.
inline constexpr std::chrono::microseconds kDriveIdle{50};
inline constexpr size_t kDriveMaxBytes = size_t{1} << 20;
void DriveWhileWaiting(size_t bytes, const std::function<Transport::Progressed()>& progress,
                       const std::function<bool()>& done, std::chrono::steady_clock::time_point deadline);

}  // namespace tandem::transport
