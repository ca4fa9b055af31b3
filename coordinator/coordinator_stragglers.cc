// The coordinator core's side of the straggler score
// (coordinator/stragglers.h): heartbeats' step_waits go into the job's
// tracker, which is evaluated at most every 100 ms; a worker named a
// straggler or cleared is logged (and, with CoreOptions::drain_stragglers,
// drained once it has stayed named for a window more). Part of
// CoordinatorCore (coordinator/coordinator_core.h), under the core's lock.
#include <chrono>
#include <string>

#include <spdlog/spdlog.h>

#include "coordinator/coordinator_core.h"

namespace tandem::coordinator {

std::optional<StragglerIdentity> CoordinatorCore::StragglerWho(const Job& job, uint64_t member_id) const {
  auto m = job.members.find(member_id);
  if (m == job.members.end()) return std::nullopt;
  StragglerIdentity who;
  who.node_id = m->second.record.node().node_id();
  who.name = m->second.record.member_name();
  if (auto i = job.latest_index.find(member_id); i != job.latest_index.end()) {
    const auto& peer = job.latest.peers(i->second);
    if (peer.role() == v1::ROLE_WORKER && peer.has_rank()) who.rank = static_cast<int>(peer.rank().global_rank());
  }
  return who;
}

void CoordinatorCore::NoteStepWaits(Job& job, const Member& member,
                                    const google::protobuf::RepeatedPtrField<v1::StepWait>& waits) {
  if (!job.stragglers_configured) {
    job.stragglers = StragglerTracker(options_.stragglers);
    job.stragglers_configured = true;
  }
  for (const auto& w : waits) job.stragglers.Add(member.record.node().node_id(), w);
  const auto now = clock_->Now();
  if (now - job.stragglers_evaluated < std::chrono::milliseconds(100)) return;
  job.stragglers_evaluated = now;
  const auto resolve = [this, &job](uint64_t id) TANDEM_NO_THREAD_SAFETY_ANALYSIS { return StragglerWho(job, id); };
  for (const StragglerChange& c : job.stragglers.Evaluate(resolve, job.step)) {
    const auto& st = c.status;
    const std::string name = c.who.name.empty() ? "" : fmt::format("'{}', ", c.who.name);
    if (c.named) {
      spdlog::warn(
          "job '{}': straggler: rank {} on node {} ({}member {}) held up {} of the last {} steps, by {:.0f} ms "
          "on average: the job spends {:.0f}% of its step time waiting for it (score {:.2f}, step {})",
          job.spec.job_id(), c.who.rank, c.who.node_id, name, c.member_id, st.late_steps(), st.window_steps(),
          st.mean_late_seconds() * 1e3, st.score() * 100, st.score(), job.step);
    } else {
      spdlog::info(
          "job '{}': rank {} on node {} ({}member {}) is no longer a straggler (score {:.2f}, late in {} of the last "
          "{} "
          "steps)",
          job.spec.job_id(), c.who.rank, c.who.node_id, name, c.member_id, st.score(), st.late_steps(),
          st.window_steps());
    }
  }
  if (!options_.drain_stragglers) return;
  // Drain a worker named for a whole window more, one at a time, while the
  // job keeps more workers than its minimum.
  uint32_t workers = 0;
  for (const auto& p : job.latest.peers()) workers += p.role() == v1::ROLE_WORKER ? 1 : 0;
  if (workers <= job.spec.min_workers() || job.latest.state() != v1::EPOCH_STATE_ACTIVE) return;
  for (const auto& [id, st] : job.stragglers.statuses()) {
    if (!st.named() || job.step < st.named_at_step() + job.stragglers.options().window) continue;
    auto m = job.members.find(id);
    if (m == job.members.end() || !Alive(m->second) || m->second.record.state() == v1::MEMBER_STATE_DRAINING ||
        !InLatest(job, id)) {
      continue;
    }
    const auto who = StragglerWho(job, id);
    const std::string detail =
        fmt::format("drained: a straggler since step {} (rank {} on node {}, score {:.2f}); the job keeps {} workers",
                    st.named_at_step(), who ? who->rank : -1, who ? who->node_id : "", st.score(), workers - 1);
    spdlog::warn("job '{}': member {} {}", job.spec.job_id(), id, detail);
    SetMemberState(m->second, v1::MEMBER_STATE_DRAINING, detail);
    ++stats_.stragglers_drained;
    PublishEpoch(job, v1::EPOCH_CAUSE_ADMIN, fmt::format("member {} drained as a straggler", id));
    return;
  }
}

}  // namespace tandem::coordinator
