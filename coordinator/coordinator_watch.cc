// The coordinator core's side of the membership watch streams: attaching
// and detaching a member's stream, the view of an epoch a member asked for,
// and the next update a stream sends. Part of CoordinatorCore
// (coordinator/coordinator_core.h); the streams themselves are the
// service's (coordinator/coordinator_service.cc).
#include <optional>
#include <string>

#include "coordinator/coordinator_core.h"
#include "coordinator/coordinator_core_util.h"

namespace tandem::coordinator {
namespace {

using core_util::HostKey;
using core_util::StateName;

}  // namespace

Result<uint64_t> CoordinatorCore::AttachStream(const v1::WatchMembershipRequest& request) {
  TANDEM_RETURN_IF_ERROR(CheckToken(request.token()));
  MutexLock lock(&mu_);
  TANDEM_ASSIGN_OR_RETURN(Job * job, FindJob(request.job_id()));
  TANDEM_ASSIGN_OR_RETURN(Member * member, FindMember(*job, request.member_id(), request.session_id()));
  member->stream_broken = false;
  member->last_heartbeat = clock_->Now();
  return ++member->stream_generation;
}

void CoordinatorCore::DetachStream(const std::string& job_id, uint64_t member_id, uint64_t session_id,
                                   uint64_t generation) {
  MutexLock lock(&mu_);
  auto job = jobs_.find(job_id);
  if (job == jobs_.end()) return;
  auto m = job->second.members.find(member_id);
  if (m == job->second.members.end() || m->second.record.session_id() != session_id ||
      m->second.stream_generation != generation) {
    return;
  }
  m->second.stream_broken = true;
  m->second.stream_broken_at = clock_->Now();
}

v1::MembershipEpoch CoordinatorCore::View(const Job& job, uint64_t member_id, v1::PeerView view) const {
  if (view == v1::PEER_VIEW_FULL || view == v1::PEER_VIEW_UNSPECIFIED) return job.latest;
  v1::MembershipEpoch out = job.latest_header;  // no peers: partial views cost O(their size)
  auto self = job.latest_index.find(member_id);
  if (view == v1::PEER_VIEW_SELF) {
    if (self != job.latest_index.end()) *out.add_peers() = job.latest.peers(self->second);
    return out;
  }
  // PEER_VIEW_LOCAL: the workers of this member's node, and the servers.
  if (self != job.latest_index.end() && job.latest.peers(self->second).role() == v1::ROLE_WORKER) {
    auto node = job.latest_by_node.find(HostKey(job.latest.peers(self->second).node()));
    if (node != job.latest_by_node.end()) {
      for (int i : node->second) *out.add_peers() = job.latest.peers(i);
    }
  }
  for (int i : job.latest_servers) *out.add_peers() = job.latest.peers(i);
  return out;
}

Result<std::optional<v1::WatchMembershipResponse>> CoordinatorCore::NextUpdate(
    const v1::WatchMembershipRequest& request, WatchPosition& position) {
  MutexLock lock(&mu_);
  TANDEM_ASSIGN_OR_RETURN(Job * job, FindJob(request.job_id()));
  auto m = job->members.find(request.member_id());
  if (m == job->members.end() || m->second.record.session_id() != request.session_id()) {
    return NotFound("member {} is no longer known; register again", request.member_id());
  }
  if (!Alive(m->second)) {
    if (m->second.record.state() == v1::MEMBER_STATE_LEFT && m->second.record.detail().rfind("rendezvous", 0) == 0) {
      return DeadlineExceeded("{}", m->second.record.detail());
    }
    return FailedPrecondition("member {} is {}: {}", request.member_id(), StateName(m->second.record.state()),
                              m->second.record.detail());
  }
  if (job->latest.epoch() == 0 || store_->durable_sequence() < job->latest_sequence)
    return std::optional<v1::WatchMembershipResponse>();
  v1::WatchMembershipResponse response;
  if (job->latest.epoch() > position.epoch) {
    *response.mutable_epoch() = View(*job, request.member_id(), request.peer_view());
  } else if (job->latest.epoch() == position.epoch && job->latest.state() != position.state) {
    auto* change = response.mutable_state_change();
    change->set_epoch(job->latest.epoch());
    change->set_state(job->latest.state());
    *change->mutable_time() =
        job->latest.state() == v1::EPOCH_STATE_ACTIVE ? job->latest.activated_time() : job->latest.created_time();
  } else {
    return std::optional<v1::WatchMembershipResponse>();
  }
  position.epoch = job->latest.epoch();
  position.state = job->latest.state();
  return std::optional<v1::WatchMembershipResponse>(std::move(response));
}

}  // namespace tandem::coordinator
