// The coordinator core's reports: a job's status as CoordinatorAdmin.GetStatus
// (and `tandem status`) answers it, members, health, stalled collectives and
// the rendezvous, and the counters the service exports as metrics
// (TakeStats). Part of CoordinatorCore (coordinator/coordinator_core.h); they
// read the state under the core's lock and change nothing but the drained
// durations of TakeStats.
#include <algorithm>
#include <chrono>
#include <map>
#include <string>

#include "coordinator/coordinator_core.h"
#include "coordinator/coordinator_core_util.h"

namespace tandem::coordinator {
namespace {

using core_util::FromMs;
using core_util::HostKey;
using core_util::RoleName;
using core_util::StateName;
using core_util::Timestamp;
using core_util::ToMs;
using std::chrono::milliseconds;

}  // namespace

Result<v1::GetStatusResponse> CoordinatorCore::GetStatus(const v1::GetStatusRequest& request) {
  TANDEM_RETURN_IF_ERROR(CheckToken(request.token()));
  MutexLock lock(&mu_);
  TANDEM_ASSIGN_OR_RETURN(const Job* found, FindAdminJob(request.job_id()));
  const Job& job = *found;
  const auto now = clock_->Now();
  v1::GetStatusResponse response;
  *response.mutable_job_spec() = job.spec;
  if (job.latest.state() == v1::EPOCH_STATE_ACTIVE) {
    response.set_active_epoch(job.latest.epoch());
    *response.mutable_active_since() = job.latest.activated_time();
  } else if (job.latest.epoch() > 0) {
    response.set_pending_epoch(job.latest.epoch());
  }
  *response.mutable_mesh() = job.latest.mesh();
  *response.mutable_shard_map() = job.latest.shard_map();
  response.set_step(job.step);
  response.set_coordinator_incarnation(incarnation_);
  std::map<uint64_t, v1::RankAssignment> ranks;
  for (const auto& p : job.latest.peers()) {
    if (p.has_rank()) ranks[p.member_id()] = p.rank();
  }
  uint32_t waiting_workers = 0;
  uint32_t waiting_servers = 0;
  for (const auto& [id, m] : job.members) {
    FillMemberStatus(job, id, m, ranks, now, response.add_members());
    if (Alive(m) && m.record.state() == v1::MEMBER_STATE_JOINING) {
      (m.record.role() == v1::ROLE_WORKER ? waiting_workers : waiting_servers)++;
    }
  }
  AddStalledCollectives(job, ranks, response);
  response.set_waiting_reason(job.waiting_reason);
  auto* rv = response.mutable_rendezvous();
  rv->set_open(job.latest.epoch() == 0 || job.window_closes.has_value());
  rv->set_waiting_workers(waiting_workers);
  rv->set_waiting_servers(waiting_servers);
  if (job.window_closes) {
    const auto left = std::chrono::duration_cast<milliseconds>(*job.window_closes - now);
    *rv->mutable_closes_at() = Timestamp(clock_->UnixMillis() + left.count());
  }
  return response;
}

void CoordinatorCore::FillMemberStatus(const Job& job, uint64_t id, const Member& m,
                                       const std::map<uint64_t, v1::RankAssignment>& ranks, Clock::TimePoint now,
                                       v1::MemberStatus* s) const {
  s->set_member_id(id);
  s->set_role(m.record.role());
  s->set_state(m.record.state());
  if (auto r = ranks.find(id); r != ranks.end()) *s->mutable_rank() = r->second;
  *s->mutable_node() = m.record.node();
  s->set_last_step(m.last_step);
  const auto age = std::max(milliseconds(0), std::chrono::duration_cast<milliseconds>(now - m.last_heartbeat));
  *s->mutable_last_heartbeat_age() = FromMs(age);
  s->set_epoch(m.epoch_seen);
  *s->mutable_collectives() = {m.collectives.begin(), m.collectives.end()};
  s->set_control_address(m.record.control_address());
  *s->mutable_registered_time() = Timestamp(m.record.registered_unix_ms());
  s->set_capacity_bytes(m.record.capacity_bytes());
  s->set_member_name(m.record.member_name());
  s->set_incarnation(m.record.incarnation());
  s->set_pid(m.record.pid());
  if (auto h = job.hosts.find(HostKey(m.record.node())); h != job.hosts.end()) {
    s->set_host_failures(h->second.failures());
    if (h->second.held_out_until_unix_ms() > 0)
      *s->mutable_held_out_until() = Timestamp(h->second.held_out_until_unix_ms());
  }
  // The straggler score of a worker of the latest epoch (0 when the window
  // never charged it a step).
  std::optional<v1::StragglerStatus> straggler;
  if (m.record.role() == v1::ROLE_WORKER && InLatest(job, id) && job.stragglers.window_steps() > 0) {
    straggler = job.stragglers.Status(id);
    if (!straggler) {
      straggler.emplace();
      straggler->set_window_steps(job.stragglers.window_steps());
    }
    *s->mutable_straggler() = *straggler;
  }
  if (age > 2 * ToMs(job.spec.heartbeat_interval())) {
    s->set_health(v1::MEMBER_HEALTH_LATE);
  } else if (m.record.role() == v1::ROLE_WORKER && Alive(m) &&
             ((straggler && straggler->named()) ||
              (job.step > m.last_step + 2 && now - m.step_changed > 2 * ToMs(job.spec.heartbeat_interval())))) {
    // Named by the score, or stopped: more than 2 steps behind the job with
    // no step done in two heartbeat intervals (heartbeats sent at different
    // moments of fast steps differ by a few steps without anyone stopping).
    s->set_health(v1::MEMBER_HEALTH_STRAGGLER);
  } else {
    s->set_health(v1::MEMBER_HEALTH_HEALTHY);
  }
}

void CoordinatorCore::AddStalledCollectives(const Job& job, const std::map<uint64_t, v1::RankAssignment>& ranks,
                                            v1::GetStatusResponse& response) const {
  // A collective is stalled when some members of its communicator entered it
  // (and wait inside it) and others did not. Every worker belongs to "world";
  // the members of a subgroup ("node/0", "dp/3", ...) are those that report it.
  std::map<std::string, uint64_t> newest;
  for (const auto& [id, m] : job.members) {
    for (const auto& c : m.collectives) newest[c.communicator()] = std::max(newest[c.communicator()], c.last_entered());
  }
  for (const auto& [name, seq] : newest) {
    v1::StalledCollective stalled;
    stalled.set_communicator(name);
    stalled.set_sequence(seq);
    milliseconds longest{0};
    for (const auto& [id, m] : job.members) {
      if (!InLatest(job, id) || m.record.role() != v1::ROLE_WORKER) continue;
      uint64_t entered = 0;
      bool member = name == "world";
      for (const auto& c : m.collectives) {
        if (c.communicator() == name) {
          member = true;
          entered = c.last_entered();
          if (c.last_entered() == seq && c.last_completed() < seq) longest = std::max(longest, ToMs(c.in_flight()));
        }
      }
      if (member && entered < seq) {
        stalled.add_waiting_for_member_ids(id);
        if (auto r = ranks.find(id); r != ranks.end()) stalled.add_waiting_for_ranks(r->second.global_rank());
      }
    }
    // Someone must be waiting inside it: a member merely a heartbeat behind is not a stall.
    if (stalled.waiting_for_member_ids_size() > 0 && longest > milliseconds(0)) {
      *stalled.mutable_stalled_for() = FromMs(longest);
      *response.add_stalled_collectives() = std::move(stalled);
    }
  }
}

CoreStats CoordinatorCore::TakeStats() {
  MutexLock lock(&mu_);
  CoreStats out = stats_;
  stats_.rendezvous_seconds.clear();
  stats_.failure_to_epoch_seconds.clear();
  out.members.clear();
  for (const auto& [id, job] : jobs_) {
    for (const auto& [mid, m] : job.members) {
      ++out.members[{RoleName(m.record.role()), StateName(m.record.state())}];
      out.failures_by_node.try_emplace({id, RoleName(m.record.role()), HostKey(m.record.node())}, 0);
    }
    if (job.stragglers.window_steps() == 0) continue;
    for (const auto& p : job.latest.peers()) {
      if (p.role() != v1::ROLE_WORKER || !p.has_rank()) continue;
      auto m = job.members.find(p.member_id());
      const auto st = job.stragglers.Status(p.member_id());
      out.stragglers.push_back({id, m == job.members.end() ? "" : m->second.record.node().node_id(),
                                p.rank().global_rank(), st ? st->score() : 0.0, st && st->named()});
    }
  }
  return out;
}

}  // namespace tandem::coordinator
