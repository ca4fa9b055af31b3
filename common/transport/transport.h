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
// Thread safety: a Transport may be used from several threads; one Request
// from one thread at a time.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
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
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // REQUIRES: 0 <= peer < size(), peer != rank(). `data` stays valid and
  // unchanged (send) or untouched by others (receive) until the request
  // completes.
  virtual std::unique_ptr<Request> Send(int peer, uint64_t tag, const void* data, size_t bytes) = 0;
  virtual std::unique_ptr<Request> Recv(int peer, uint64_t tag, void* data, size_t bytes) = 0;
};

// A request that is already complete, with `status`.
std::unique_ptr<Request> Completed(Status status);

}  // namespace tandem::transport
