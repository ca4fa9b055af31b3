// The parameter-server group of one membership epoch: every worker and
// server of the epoch, connected by one UCX transport (shared memory between
// processes of a node, TCP or verbs between nodes), over which gradients are
// pushed, parameters pulled, and servers share step decisions and replicate.
//
// Members: every server of the epoch, and every worker that registered an
// Endpoint with transport "ps" (kPsEndpoint: it takes part in pushes and
// pulls; a worker without a data plane does not, and nobody waits for it).
// Ranks follow the epoch's peer list (workers first, then servers, each by
// global rank). Each member publishes its UCX address through the epoch's
// rendezvous under "ps/<epoch>/<member id>", reads everyone else's, and
// connects; the group is rebuilt for every epoch, so a dead member's
// operations fail at once and a new one is reached through the new group.
//
// Thread safety: BuildPsGroup may run concurrently for different epochs; the
// group's transport is thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "common/rendezvous.h"
#include "common/status.h"
#include "common/transport/ucx_transport.h"
#include "tandem/v1/types.pb.h"

namespace tandem::transport {

// The Endpoint transport name a worker registers to join the group.
inline constexpr char kPsEndpoint[] = "ps";

// Whether `peer` is a member of its epoch's parameter-server group.
bool InPsGroup(const v1::Peer& peer);

struct PsGroup {
  std::unique_ptr<UcxTransport> transport;
  int rank = -1;
  std::vector<uint64_t> members;                // member id of each rank
  std::vector<v1::Role> roles;                  // role of each rank
  std::map<uint64_t, int> rank_of;              // member id -> rank
  std::vector<int> Ranks(v1::Role role) const;  // ranks with that role
};

// Builds the group for `epoch` (which must list every member: a full peer
// view). `self` is this member's id. Errors name the member that could not be
// reached.
Result<PsGroup> BuildPsGroup(const v1::MembershipEpoch& epoch, uint64_t self, comm::Rendezvous& rendezvous,
                             const UcxOptions& options, std::chrono::milliseconds timeout);

}  // namespace tandem::transport
