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

Result<PsGroup> BuildPsGroup(const v1::MembershipEpoch& epoch, uint64_t self, comm::Rendezvous& rendezvous,
                             const UcxOptions& options, std::chrono::milliseconds timeout) {
  PsGroup group;
  for (const auto& peer : epoch.peers()) {
    group.rank_of[peer.member_id()] = static_cast<int>(group.members.size());
    group.members.push_back(peer.member_id());
    group.roles.push_back(peer.role());
  }
  const size_t expected = static_cast<size_t>(epoch.worker_count()) + epoch.server_count();
  if (group.members.size() != expected) {
    return FailedPrecondition("epoch {} lists {} members of {}: the parameter-server group needs the full peer view",
                              epoch.epoch(), group.members.size(), expected);
  }
  auto self_rank = group.rank_of.find(self);
  if (self_rank == group.rank_of.end()) {
    return FailedPrecondition("member {} is not part of epoch {}", self, epoch.epoch());
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
                                              std::max(left, std::chrono::milliseconds(1000)));
  if (!connected.ok()) {
    return connected.WithContext(fmt::format("parameter-server group of epoch {}", epoch.epoch()));
  }
  return group;
}

}  // namespace tandem::transport
