// The coordinator core's durability: every decision is a record appended to
// the store's log and applied to the in-memory state (Commit, Apply), the
// state is snapshotted so the log stays short (PrepareSnapshot,
// WriteSnapshot), and a restarted coordinator rebuilds it from the newest
// snapshot and the records after it (Recover). See coordinator_core.h.
#include <algorithm>

#include <spdlog/spdlog.h>

#include "coordinator/coordinator_core.h"
#include "coordinator/coordinator_core_util.h"

namespace tandem::coordinator {

using core_util::HostKey;
using core_util::ToMs;

uint64_t CoordinatorCore::Commit(internal::Record record) {
  std::string payload;
  record.SerializeToString(&payload);
  last_sequence_ = store_->Append(std::move(payload));
  ++stats_.records_appended;
  Apply(record, /*live=*/true);
  return last_sequence_;
}

void CoordinatorCore::Apply(const internal::Record& record, bool live) {
  switch (record.change_case()) {
    case internal::Record::kJob: {
      Job& job = jobs_[record.job().job_id()];
      job.spec = record.job();
      break;
    }
    case internal::Record::kMember: {
      const auto& m = record.member();
      Job& job = jobs_[m.job_id()];
      Member& member = job.members[m.member_id()];
      member.record = m;
      next_member_id_ = std::max(next_member_id_, m.member_id() + 1);
      if (!live) {
        // After a restart members get recovery_grace to re-attach: their last
        // heartbeat counts as if it happened then, minus the usual deadline.
        member.last_heartbeat = clock_->Now() + options_.recovery_grace - ToMs(job.spec.heartbeat_deadline());
        member.joined = clock_->Now();
      }
      break;
    }
    case internal::Record::kEpoch: {
      Job& job = jobs_[record.epoch().job_id()];
      const bool new_epoch = record.epoch().epoch() != job.latest.epoch();
      if (new_epoch) {
        job.acked.clear();
        job.values.clear();
      }
      job.latest = record.epoch();
      job.latest_header = job.latest;
      job.latest_header.clear_peers();
      job.latest_index.clear();
      job.latest_by_node.clear();
      job.latest_servers.clear();
      for (int i = 0; i < job.latest.peers_size(); ++i) {
        const auto& p = job.latest.peers(i);
        job.latest_index[p.member_id()] = i;
        if (p.role() == v1::ROLE_SERVER) {
          job.latest_servers.push_back(i);
        } else {
          job.latest_by_node[HostKey(p.node())].push_back(i);
        }
      }
      if (new_epoch) job.pending_acks = static_cast<size_t>(job.latest.peers_size());
      job.latest_sequence = last_sequence_;
      stats_.max_epoch = std::max(stats_.max_epoch, job.latest.epoch());
      break;
    }
    case internal::Record::kHost: {
      jobs_[record.host().job_id()].hosts[record.host().host()] = record.host();
      break;
    }
    case internal::Record::kStep: {
      Job& job = jobs_[record.step().job_id()];
      job.step = std::max(job.step, record.step().step());
      break;
    }
    case internal::Record::kIncarnation:
      incarnation_ = std::max(incarnation_, record.incarnation());
      break;
    case internal::Record::CHANGE_NOT_SET:
      break;
  }
  // Watchers care about epochs and about members that leave or die (their
  // streams end); registrations and progress need not wake them.
  if (live && (record.has_epoch() || (record.has_member() && record.member().state() != v1::MEMBER_STATE_JOINING &&
                                      record.member().state() != v1::MEMBER_STATE_ACTIVE))) {
    NotifyLater(true);
  }
}

std::optional<std::pair<uint64_t, std::string>> CoordinatorCore::PrepareSnapshot() {
  if (snapshot_running_ || last_sequence_ - snapshot_sequence_ < options_.snapshot_every_records) return std::nullopt;
  internal::Snapshot snapshot;
  snapshot.set_format(1);
  snapshot.set_incarnation(incarnation_);
  snapshot.set_next_member_id(next_member_id_);
  snapshot.add_records()->set_incarnation(incarnation_);
  for (const auto& [id, job] : jobs_) {
    *snapshot.add_records()->mutable_job() = job.spec;
    for (const auto& [host, record] : job.hosts) *snapshot.add_records()->mutable_host() = record;
    for (const auto& [member_id, member] : job.members) *snapshot.add_records()->mutable_member() = member.record;
    if (job.latest.epoch() > 0) *snapshot.add_records()->mutable_epoch() = job.latest;
    auto* step = snapshot.add_records()->mutable_step();
    step->set_job_id(id);
    step->set_step(job.step);
  }
  std::string payload;
  snapshot.SerializeToString(&payload);
  snapshot_running_ = true;
  // Every record up to last_sequence_ is in memory; the snapshot stands for them.
  return std::make_pair(last_sequence_, std::move(payload));
}

void CoordinatorCore::WriteSnapshot(uint64_t sequence, std::string payload) {
  // Called without the lock: the store waits for durability and fsyncs.
  const Status s = store_->WriteSnapshot(sequence, std::move(payload));
  MutexLock lock(&mu_);
  snapshot_running_ = false;
  if (!s.ok()) {
    spdlog::error("cannot write a snapshot: {}", s.message());
    return;
  }
  snapshot_sequence_ = sequence;
}

Status CoordinatorCore::Recover() {
  TANDEM_ASSIGN_OR_RETURN(Recovery recovery, store_->Recover());
  MutexLock lock(&mu_);
  for (const auto& w : recovery.warnings) spdlog::warn("store: {}", w);
  if (recovery.snapshot_sequence > 0) {
    internal::Snapshot snapshot;
    if (!snapshot.ParseFromString(recovery.snapshot)) {
      return DataLoss("snapshot {} cannot be parsed", recovery.snapshot_sequence);
    }
    if (snapshot.format() != 1) {
      return DataLoss("snapshot {} has format {}; this coordinator reads format 1", recovery.snapshot_sequence,
                      snapshot.format());
    }
    last_sequence_ = recovery.snapshot_sequence;
    next_member_id_ = std::max(next_member_id_, snapshot.next_member_id());
    for (const auto& r : snapshot.records()) Apply(r, /*live=*/false);
    snapshot_sequence_ = recovery.snapshot_sequence;
  }
  for (const auto& [sequence, payload] : recovery.records) {
    internal::Record record;
    if (!record.ParseFromString(payload)) return DataLoss("log record {} cannot be parsed", sequence);
    last_sequence_ = sequence;
    Apply(record, /*live=*/false);
  }
  // A crash between a member's death record and the epoch without it leaves
  // an epoch naming a dead member, which could never settle: re-form it now.
  for (auto& [id, job] : jobs_) {
    std::vector<uint64_t> gone;
    for (const auto& p : job.latest.peers()) {
      auto m = job.members.find(p.member_id());
      if (m == job.members.end() || !Alive(m->second) || m->second.record.state() == v1::MEMBER_STATE_DRAINING) {
        gone.push_back(p.member_id());
      }
    }
    if (!gone.empty()) {
      spdlog::warn("job '{}': epoch {} names {} member(s) that are gone; re-forming it", id, job.latest.epoch(),
                   gone.size());
      PublishEpoch(job, v1::EPOCH_CAUSE_FAILURE, "re-formed after a restart");
    }
  }
  // Epochs published before the restart are durable (the log says so); their
  // acknowledgements were not kept, so a pending epoch waits for members to
  // acknowledge again when they re-attach.
  internal::Record incarnation;
  incarnation.set_incarnation(incarnation_ + 1);
  const uint64_t seq = Commit(incarnation);
  size_t members = 0;
  for (const auto& [id, job] : jobs_) members += job.members.size();
  spdlog::info("recovered {} job(s), {} member(s), {} record(s) after snapshot {}; incarnation {}", jobs_.size(),
               members, recovery.records.size(), recovery.snapshot_sequence, incarnation_);
  lock.Unlock();
  return store_->WaitDurable(seq);
}

}  // namespace tandem::coordinator
