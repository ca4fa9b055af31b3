// Making a communicator by backend name: what `tandem bench`, the worker and
// the communicator manager use, so each names a backend in its configuration
// rather than constructing one.
//
// Backends: "shm" (the ranks of one node, through a shared segment); "ucx"
// (any ranks: the transport communicator's algorithms over UCX, shared memory
// within a host and TCP or verbs between hosts; each rank publishes its UCX
// address under "ucx/<name>/<epoch>/<rank>" and connects to every peer).
//
// Thread safety: thread-safe.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/rendezvous.h"
#include "common/transport/ucx_transport.h"
#include "worker/comm/communicator.h"
#include "worker/comm/shm_communicator.h"
#include "worker/comm/transport_communicator.h"

namespace tandem::comm {

struct BackendOptions {
  ShmOptions shm;
  transport::UcxOptions ucx;
  TransportCommunicatorOptions transport;  // the algorithms over UCX (backend is set to "ucx")
};

// The backends this build offers, for flag validation and --help.
std::vector<std::string> BackendNames();

Result<std::unique_ptr<Communicator>> CreateCommunicator(const std::string& backend, const CommInfo& info,
                                                         Rendezvous& rendezvous, const BackendOptions& options);

}  // namespace tandem::comm
