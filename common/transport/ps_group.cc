#include "common/transport/ps_group.h"

#include <fmt/format.h>

namespace tandem::transport {

std::vector<int> PsGroup::Ranks(v1::Role role) const {
  std::vector<int> out;
  for (size_t r = 0; r < roles.size(); ++r) {
    if (roles[r] == role && static_cast<int>(r) != rank) out.push_back(static_cast<int>(r));
  }
  return out;
}

bool InPsGroup(const v1::Peer& peer) {
  if (peer.role() == v1::ROLE_SERVER) return true;
  for (const auto& e : peer.endpoints()) {
    if (e.transport() == kPsEndpoint) return true;
  }
  return false;
}

Result<PsGroup> BuildPsGroup(const v1::MembershipEpoch& epoch, uint64_t self, comm::Rendezvous& rendezvous,
                             const UcxOptions& options, std::chrono::milliseconds timeout) {
  PsGroup group;
  const size_t expected = static_cast<size_t>(epoch.worker_count()) + epoch.server_count();
  if (static_cast<size_t>(epoch.peers_size()) != expected) {
    return FailedPrecondition("epoch {} lists {} members of {}: the parameter-server group needs the full peer view",
                              epoch.epoch(), epoch.peers_size(), expected);
  }
  for (const auto& peer : epoch.peers()) {
    if (!InPsGroup(peer)) continue;
    group.rank_of[peer.member_id()] = static_cast<int>(group.members.size());
    group.members.push_back(peer.member_id());
    group.roles.push_back(peer.role());
  }
  auto self_rank = group.rank_of.find(self);
  if (self_rank == group.rank_of.end()) {
    return FailedPrecondition(
        "member {} is not in the parameter-server group of epoch {} (a worker joins it by registering an endpoint "
        "with transport \"{}\")",
        self, epoch.epoch(), kPsEndpoint);
  }
  group.rank = self_rank->second;
  TANDEM_ASSIGN_OR_RETURN(group.transport, UcxTransport::Create(options));
  const std::string prefix = fmt::format("ps/{}/", epoch.epoch());
  TANDEM_RETURN_IF_ERROR(rendezvous.Put(prefix + std::to_string(self), group.transport->address()));
  std::vector<std::string> addresses(group.members.size());
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (size_t r = 0; r < group.members.size(); ++r) {
    if (static_cast<int>(r) == group.rank) continue;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    auto address =
        rendezvous.Get(prefix + std::to_string(group.members[r]), std::max(left, std::chrono::milliseconds(1)));
    if (!address.ok()) {
      return address.status().WithContext(
          fmt::format("parameter-server group of epoch {}: the address of member {}", epoch.epoch(), group.members[r]));
    }
    addresses[r] = std::move(address).value();
  }
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  Status connected = group.transport->Connect(group.rank, static_cast<int>(group.members.size()), addresses,
                                              std::max(left, std::chrono::milliseconds(1000)),
                                              [&rendezvous] { return rendezvous.cancelled(); });
  if (!connected.ok()) {
    return connected.WithContext(fmt::format("parameter-server group of epoch {}", epoch.epoch()));
  }
  return group;
}

}  // namespace tandem::transport
