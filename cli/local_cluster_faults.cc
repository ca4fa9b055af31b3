// LocalCluster's supervision of its processes and the faults it injects
// (--inject, --chaos): cli/local_cluster_detail.h.
#include <signal.h>

#include <algorithm>

#include "cli/local_cluster_detail.h"
#include "common/grpc_util.h"

namespace tandem::cli::local_cluster_detail {

// --- supervision and faults ---------------------------------------------------

FaultSpace LocalCluster::SpaceOfFaults() const {
  FaultSpace space;
  for (const auto& p : supervisor_->processes()) {
    if (p->role == ProcessRole::kWorker) space.workers.push_back(p->name());
    if (p->role == ProcessRole::kServer) space.servers.push_back(p->name());
  }
  space.nodes = static_cast<int>(o_.nodes);
  space.namespaces = network_->namespaces();
  space.steps = static_cast<uint64_t>(o_.train.steps);
  // A lost worker's share comes back from the servers, or from another
  // data-parallel replica; a lost server's partitions from their backups.
  const int64_t replicas = workers_ / std::max<int64_t>(1, o_.tp * o_.pp);
  space.worker_loss = replicas >= 2 || servers_ > 0;
  space.server_loss = servers_ >= 2;
  // A node cut off takes its workers and servers with it: another node must
  // keep workers, and no two servers (maybe a partition's both copies) may
  // share the node.
  space.partition_loss = o_.tp == 1 && o_.pp == 1 && o_.nodes >= 2 && servers_ <= o_.nodes && servers_ != 1;
  for (const auto& p : supervisor_->processes()) {
    if (p->role == ProcessRole::kServer) space.server_nodes.push_back(p->node);
  }
  // Losing every server at once loses both copies of every partition: the
  // synchronous modes roll back to the latest checkpoint, when there are
  // checkpoints.
  space.rollback = servers_ > 0 && o_.train.consistency == "sync" && o_.train.checkpoint_every > 0 &&
                   !o_.train.checkpoint_dir.empty();
  return space;
}

Status LocalCluster::PlanFaults() {
  const FaultSpace space = SpaceOfFaults();
  plan_ = o_.faults;
  TANDEM_RETURN_IF_ERROR(CheckFaults(plan_, space));
  if (o_.chaos) {
    summary_.chaos = true;
    summary_.chaos_seed = o_.chaos->seed;
    for (Fault& f : DrawChaos(*o_.chaos, space)) plan_.push_back(std::move(f));
    std::string drawn;
    for (size_t i = o_.faults.size(); i < plan_.size(); ++i)
      drawn += (drawn.empty() ? "" : ",") + FormatFault(plan_[i]);
    Print(fmt::format("Chaos drill, seed {} (replay: --chaos {}:{}): {}\n", o_.chaos->seed, o_.chaos->seed,
                      o_.chaos->count, drawn));
  }
  std::stable_sort(plan_.begin(), plan_.end(), [](const Fault& a, const Fault& b) { return a.step < b.step; });
  return Status::Ok();
}

bool LocalCluster::PollCoordinator() {
  const auto now = Clock::now();
  if (now - status_at_ < std::chrono::milliseconds(250)) return false;
  status_at_ = now;
  if (!admin_) {
    auto channel = MakeChannel(coordinator_, TlsConfig{});
    if (!channel.ok()) return false;
    admin_ = v1::CoordinatorAdmin::NewStub(*channel);
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  v1::GetStatusRequest request;
  request.set_job_id("default");
  v1::GetStatusResponse response;
  if (admin_->GetStatus(&ctx, request, &response).ok()) {
    status_ = std::move(response);
    status_fresh_ = Clock::now();
    return true;
  } else {
    // Down or restarting: a new channel next time, rather than waiting out
    // the old one's reconnection back-off.
    status_.reset();
    admin_.reset();
  }
  return false;
}

void LocalCluster::FenceTheDead() {
  if (!status_) return;
  for (const auto& m : status_->members()) {
    if (m.state() != v1::MEMBER_STATE_DEAD || m.pid() == 0) continue;
    for (auto& p : supervisor_->processes()) {
      if (p->up() && p->pid() == static_cast<int>(m.pid()) &&
          (m.member_name().empty() || m.member_name() == p->name())) {
        supervisor_->Fence(*p, fmt::format("was declared dead by the coordinator (member {})", m.member_id()));
      }
    }
  }
}

bool LocalCluster::Whole() const {
  if (!supervisor_->AllUp() || !status_ || status_->active_epoch() == 0 || status_->pending_epoch() != 0) return false;
  std::set<int> active;
  for (const auto& m : status_->members()) {
    if (m.state() == v1::MEMBER_STATE_ACTIVE && m.epoch() == status_->active_epoch())
      active.insert(static_cast<int>(m.pid()));
  }
  int servers = 0;
  for (const auto& p : supervisor_->processes()) {
    if (p->role == ProcessRole::kCoordinator || !p->up()) continue;
    if (p->role == ProcessRole::kServer) ++servers;
    if (!active.count(p->pid())) return false;
  }
  if (servers >= 2) {
    for (const auto& part : status_->shard_map().partitions()) {
      if (part.backup_member_id() == 0) return false;
    }
  }
  return true;
}

void LocalCluster::MaybeInject(uint64_t last) {
  // One fault at a time: the next comes once its step is done and the
  // cluster is whole again after the one before.
  if (active_ || next_fault_ >= plan_.size() || last < plan_[next_fault_].step || reader_->finished()) return;
  if (last >= static_cast<uint64_t>(o_.train.steps) || !Whole()) return;
  Inject(plan_[next_fault_++], last);
}

void LocalCluster::Inject(const Fault& f, uint64_t last) {
  const auto now = Clock::now();
  ActiveFault a;
  a.index = summary_.injected.size();
  a.t0 = now;
  InjectedFault record;
  record.fault = f;
  record.step = last;
  record.at_seconds = Seconds(now - t_start_);
  std::string what;
  if (f.kind == FaultKind::kPartition) {
    a.node = std::stoi(f.target.substr(5));
    for (const auto& p : supervisor_->processes()) {
      if (p->node == a.node && p->up()) a.pids.insert(p->pid());
    }
    const Status s = network_->SetNodeLink(a.node, false);
    if (!s.ok()) {
      Event(fmt::format("step {}: could not inject {}: {}", last, FormatFault(f), s.message()));
      return;
    }
    a.ends = now + f.duration;
    what = fmt::format("cut node-{} off the others for {:.1f} s ({} processes)", a.node, Seconds(f.duration),
                       a.pids.size());
  } else if (f.target == "servers") {
    // Every server at once: both copies of every partition are lost, and
    // the workers roll the job back to its latest checkpoint.
    for (const auto& p : supervisor_->processes()) {
      if (p->role != ProcessRole::kServer || !p->up()) continue;
      a.pids.insert(p->pid());
      a.hit.push_back(p.get());
      (void)p->daemon.process->Signal(SIGKILL);
    }
    a.over = true;
    what = fmt::format("killed all {} servers with SIGKILL: both copies of every partition are lost", a.hit.size());
  } else {
    Supervised* p = supervisor_->Find(f.target);
    if (p == nullptr || !p->up()) return;
    a.hit.push_back(p);
    a.pids.insert(p->pid());
    switch (f.kind) {
      case FaultKind::kKill:
        (void)p->daemon.process->Signal(SIGKILL);
        a.over = true;
        what = fmt::format("killed {} (pid {}) with SIGKILL", p->name(), p->pid());
        break;
      case FaultKind::kStop:
        supervisor_->Pause(*p);
        a.over = true;
        what = fmt::format("stopped {} (pid {}) with SIGSTOP: it hangs", p->name(), p->pid());
        break;
      case FaultKind::kSlow:
        supervisor_->Pause(*p);
        a.ends = now + f.duration;
        a.next_toggle = now + std::chrono::milliseconds(300);
        what = fmt::format("slowed {} (pid {}) to a quarter of its speed for {:.1f} s", p->name(), p->pid(),
                           Seconds(f.duration));
        break;
      case FaultKind::kPartition:
        break;
    }
  }
  ++summary_.faults;
  summary_.injected.push_back(record);
  active_ = a;
  Event(fmt::format("step {}: injected {}: {}", last, FormatFault(f), what));
}

void LocalCluster::FollowFault() {
  if (!active_) return;
  ActiveFault& a = *active_;
  InjectedFault& record = summary_.injected[a.index];
  const Fault& f = record.fault;
  const auto now = Clock::now();
  if (!a.over && now >= a.ends) {
    a.over = true;
    if (f.kind == FaultKind::kPartition) {
      const Status s = network_->SetNodeLink(a.node, true);
      Event(s.ok() ? fmt::format("node-{} is connected again after {:.1f} s", a.node, Seconds(now - a.t0))
                   : "could not end the partition: " + s.message());
    } else if (a.process()->pid() == *a.pids.begin()) {
      supervisor_->Resume(*a.process());
      Event(fmt::format("{} runs at full speed again", a.process()->name()));
    }
  } else if (!a.over && f.kind == FaultKind::kSlow && now >= a.next_toggle && a.process()->pid() == *a.pids.begin()) {
    // Stopped 300 ms of every 400 ms.
    if (a.process()->stopped) {
      supervisor_->Resume(*a.process());
      a.next_toggle = now + std::chrono::milliseconds(100);
    } else {
      supervisor_->Pause(*a.process());
      a.next_toggle = now + std::chrono::milliseconds(300);
    }
  }
  if (record.detected_seconds < 0) {
    std::string seen;
    if (a.process() != nullptr && a.process()->role == ProcessRole::kCoordinator) {
      if (!a.process()->up() || a.process()->pid() != *a.pids.begin()) seen = "the supervisor saw it end";
    } else if (status_ && status_fresh_ > a.t0) {
      for (const auto& m : status_->members()) {
        if (!a.pids.count(static_cast<int>(m.pid()))) continue;
        if (m.state() == v1::MEMBER_STATE_DEAD) {
          seen = fmt::format("the coordinator declared {} dead", m.member_name().empty() ? "it" : m.member_name());
        } else if (f.kind == FaultKind::kSlow &&
                   (m.health() == v1::MEMBER_HEALTH_STRAGGLER || m.health() == v1::MEMBER_HEALTH_LATE)) {
          seen = fmt::format("the coordinator named {} {}", m.member_name().empty() ? "it" : m.member_name(),
                             m.health() == v1::MEMBER_HEALTH_STRAGGLER ? "a straggler" : "late");
        }
        if (!seen.empty()) break;
      }
    }
    if (!seen.empty()) {
      record.detected_seconds = Seconds(now - a.t0);
      record.detection = seen;
      Event(fmt::format("{} detected after {:.1f} s: {}", FormatFault(f), record.detected_seconds, seen));
    }
  }
  if (!a.settled && a.over) {
    // A process that was hit must have come back as a new incarnation.
    const bool back = f.kind == FaultKind::kSlow || std::all_of(a.hit.begin(), a.hit.end(), [&a](const Supervised* p) {
                        return p->up() && !a.pids.count(p->pid());
                      });
    if (back) a.settled = now;
  }
  // Whole again, by a status the coordinator gave after that.
  if (a.settled && status_fresh_ > *a.settled && Whole()) {
    record.recovered_seconds = Seconds(now - a.t0);
    if (record.detection.empty()) {
      record.detection = f.kind == FaultKind::kPartition ? "ridden out in the same epoch" : "not detected";
    }
    Event(fmt::format("{}: the cluster is whole again after {:.1f} s", FormatFault(f), record.recovered_seconds));
    active_.reset();
  }
}

}  // namespace tandem::cli::local_cluster_detail
