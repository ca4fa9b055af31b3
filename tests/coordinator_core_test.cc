// The coordinator's state machine with a fake clock and an in-memory store:
// rendezvous, epochs and acknowledgements, liveness, elastic joins and leaves,
// the shard map, host hold-out, validation, and recovery after a restart.
#include "coordinator/coordinator_core.h"

#include <tuple>

#include <google/protobuf/util/time_util.h>
#include <gtest/gtest.h>

#include "common/member_session.h"
#include "tandem/config.h"
#include "test_util.h"

namespace tandem::coordinator {
namespace {

using google::protobuf::util::TimeUtil;
using std::chrono::milliseconds;

struct M {
  uint64_t id = 0;
  uint64_t session = 0;
};

class CoreTest : public ::testing::Test {
 protected:
  void Open(CoreOptions options = {}) {
    // The fake clock jumps seconds between ticks on purpose: not a stall.
    options.stall_threshold = std::chrono::hours(24);
    core_.reset();
    store_ = std::make_unique<MemoryStore>(backing_);
    core_ = std::make_unique<CoordinatorCore>(options, store_.get(), &clock_);
    ASSERT_TRUE(core_->Recover().ok());
  }

  static v1::JobSpec Spec(uint32_t min_workers, uint32_t max_workers, uint32_t min_servers = 0) {
    v1::JobSpec spec;
    spec.set_job_id("j");
    spec.set_min_workers(min_workers);
    spec.set_max_workers(max_workers);
    spec.set_min_servers(min_servers);
    *spec.mutable_last_call_window() = TimeUtil::MillisecondsToDuration(500);
    *spec.mutable_join_timeout() = TimeUtil::MillisecondsToDuration(10000);
    return spec;
  }

  Result<M> TryJoin(const std::string& node, v1::Role role = v1::ROLE_WORKER, const std::string& token = "") {
    v1::RegisterRequest r;
    r.set_job_id("j");
    r.set_role(role);
    r.mutable_node()->set_hostname(node);
    r.mutable_node()->set_node_id(node);
    r.set_token(token);
    auto reply = core_->Register(r);
    if (!reply.ok()) return reply.status();
    return M{reply->response.member_id(), reply->response.session_id()};
  }

  // A registration under a member name (RegisterRequest.member_name) with its incarnation and pid.
  Result<M> TryJoinAs(const std::string& node, const std::string& name, uint64_t incarnation, uint32_t pid,
                      v1::Role role = v1::ROLE_WORKER) {
    v1::RegisterRequest r;
    r.set_job_id("j");
    r.set_role(role);
    r.mutable_node()->set_hostname(node);
    r.mutable_node()->set_node_id(node);
    r.set_member_name(name);
    r.set_incarnation(incarnation);
    r.set_pid(pid);
    auto reply = core_->Register(r);
    if (!reply.ok()) return reply.status();
    const M m{reply->response.member_id(), reply->response.session_id()};
    members_.push_back(m);
    return m;
  }

  const v1::MemberStatus* FindStatus(const v1::GetStatusResponse& s, uint64_t id) {
    for (const auto& m : s.members()) {
      if (m.member_id() == id) return &m;
    }
    return nullptr;
  }

  M Join(const std::string& node, v1::Role role = v1::ROLE_WORKER) {
    auto m = TryJoin(node, role);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    if (m.ok()) members_.push_back(*m);
    return m.ok() ? *m : M{};
  }

  void Tick(milliseconds d) {
    clock_.Advance(d);
    for (const M& m : members_) (void)Beat(m);
    core_->Tick();
  }

  // Moves time without heartbeats from `silent` members.
  void TickWithout(milliseconds d, const std::vector<uint64_t>& silent) {
    clock_.Advance(d);
    for (const M& m : members_) {
      if (std::find(silent.begin(), silent.end(), m.id) == silent.end()) (void)Beat(m);
    }
    core_->Tick();
  }

  Status Beat(const M& m, uint64_t step = 0) {
    v1::HeartbeatRequest r;
    r.set_job_id("j");
    r.set_member_id(m.id);
    r.set_session_id(m.session);
    r.set_step(step);
    if (auto it = replicated_.find(m.id); it != replicated_.end()) r.set_replicated_epoch(it->second);
    return core_->Heartbeat(r).status();
  }

  v1::GetStatusResponse Status_() {
    v1::GetStatusRequest r;
    r.set_job_id("j");
    auto s = core_->GetStatus(r);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? *s : v1::GetStatusResponse();
  }

  // The newest epoch as member `m` would receive it.
  v1::MembershipEpoch Latest(const M& m) {
    v1::WatchMembershipRequest r;
    r.set_job_id("j");
    r.set_member_id(m.id);
    r.set_session_id(m.session);
    WatchPosition pos;
    auto u = core_->NextUpdate(r, pos);
    if (!u.ok() || !u->has_value()) return v1::MembershipEpoch();
    return (*u)->epoch();
  }

  Status Ack(const M& m, uint64_t epoch) {
    v1::AckEpochRequest r;
    r.set_job_id("j");
    r.set_member_id(m.id);
    r.set_session_id(m.session);
    r.set_epoch(epoch);
    return core_->AckEpoch(r).status();
  }

  void AckAll(const v1::MembershipEpoch& epoch) {
    for (const auto& p : epoch.peers()) {
      for (const M& m : members_) {
        if (m.id == p.member_id()) {
          EXPECT_TRUE(Ack(m, epoch.epoch()).ok());
        }
      }
    }
  }

  std::map<uint64_t, uint32_t> Ranks(const v1::MembershipEpoch& e) {
    std::map<uint64_t, uint32_t> out;
    for (const auto& p : e.peers()) {
      if (p.has_rank()) out[p.member_id()] = p.rank().global_rank();
    }
    return out;
  }

  FakeClock clock_;
  std::shared_ptr<MemoryStoreBacking> backing_ = std::make_shared<MemoryStoreBacking>();
  std::unique_ptr<MemoryStore> store_;
  std::unique_ptr<CoordinatorCore> core_;
  std::vector<M> members_;
  // HeartbeatRequest.replicated_epoch each member reports (absent: 0).
  std::map<uint64_t, uint64_t> replicated_;
};

TEST_F(CoreTest, RendezvousWaitsForMinimumThenTheLastCallWindow) {
  Open();
  ASSERT_TRUE(core_->CreateJob(Spec(2, 4)).ok());
  const M a = Join("n0");
  Tick(milliseconds(1000));
  EXPECT_EQ(Latest(a).epoch(), 0u);  // one of two
  const M b = Join("n0");
  Tick(milliseconds(400));
  EXPECT_EQ(Latest(a).epoch(), 0u);  // last call: the window is still open
  const M c = Join("n1");            // joins inside the window
  Tick(milliseconds(200));
  const auto e = Latest(a);
  ASSERT_EQ(e.epoch(), 1u);
  EXPECT_EQ(e.state(), v1::EPOCH_STATE_PENDING);
  EXPECT_EQ(e.worker_count(), 3u);
  EXPECT_EQ(e.cause(), v1::EPOCH_CAUSE_INITIAL);
  auto ranks = Ranks(e);
  EXPECT_EQ(ranks[a.id], 0u);  // node n0 first, contiguous
  EXPECT_EQ(ranks[b.id], 1u);
  EXPECT_EQ(ranks[c.id], 2u);
  ASSERT_TRUE(Ack(a, 1).ok());
  ASSERT_TRUE(Ack(b, 1).ok());
  EXPECT_EQ(Latest(a).state(), v1::EPOCH_STATE_PENDING);
  ASSERT_TRUE(Ack(c, 1).ok());
  EXPECT_EQ(Latest(a).state(), v1::EPOCH_STATE_ACTIVE);
  EXPECT_EQ(Status_().active_epoch(), 1u);
}

TEST_F(CoreTest, SpecDurationsReplaceTheDefaultsWhole) {
  Open();
  auto spec = Spec(1, 1);
  *spec.mutable_heartbeat_interval() = TimeUtil::MillisecondsToDuration(400);  // default 1 s: not 1.4 s
  *spec.mutable_heartbeat_deadline() = TimeUtil::MillisecondsToDuration(1200);
  ASSERT_TRUE(core_->CreateJob(spec).ok());
  EXPECT_EQ(TimeUtil::DurationToMilliseconds(Status_().job_spec().heartbeat_interval()), 400);
}

TEST_F(CoreTest, ReachingMaxWorkersClosesTheRendezvousAtOnce) {
  Open();
  ASSERT_TRUE(core_->CreateJob(Spec(1, 2)).ok());
  const M a = Join("n0");
  Join("n0");
  EXPECT_EQ(Latest(a).epoch(), 1u);
}

TEST_F(CoreTest, MissedHeartbeatsMakeANewEpochWithoutTheDeadMember) {
  Open();
  ASSERT_TRUE(core_->CreateJob(Spec(3, 3)).ok());
  const M a = Join("n0");
  const M b = Join("n0");
  const M c = Join("n1");
  AckAll(Latest(a));
  TickWithout(milliseconds(2000), {b.id});
  EXPECT_EQ(Latest(a).epoch(), 1u);  // 2 s: within the 3 s deadline
  TickWithout(milliseconds(1100), {b.id});
  const auto e = Latest(a);
  ASSERT_EQ(e.epoch(), 2u);
  EXPECT_EQ(e.cause(), v1::EPOCH_CAUSE_FAILURE);
  EXPECT_EQ(e.worker_count(), 2u);
  auto ranks = Ranks(e);
  EXPECT_EQ(ranks[a.id], 0u);  // survivors stay contiguous and ordered
  EXPECT_EQ(ranks[c.id], 1u);
  EXPECT_FALSE(ranks.count(b.id));
  // The dead member is told so and must register again.
  const Status s = Beat(b);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("no heartbeat for"), std::string::npos) << s.message();
}

// Heartbeat progress names the members that never entered a collective the
// others wait in; members of other subgroups and members merely a heartbeat
// behind are not reported.
TEST_F(CoreTest, StalledCollectivesNameTheMembersThatNeverEnteredThem) {
  Open();
  ASSERT_TRUE(core_->CreateJob(Spec(4, 4)).ok());
  const M a = Join("n0");
  const M b = Join("n0");
  const M c = Join("n1");
  const M d = Join("n1");
  const auto epoch = Latest(a);
  AckAll(epoch);
  const auto ranks = Ranks(epoch);
  auto beat = [&](const M& m, std::vector<std::tuple<std::string, uint64_t, uint64_t, int64_t>> progress) {
    v1::HeartbeatRequest r;
    r.set_job_id("j");
    r.set_member_id(m.id);
    r.set_session_id(m.session);
    for (const auto& [name, entered, completed, in_flight_ms] : progress) {
      auto* p = r.add_collectives();
      p->set_communicator(name);
      p->set_last_entered(entered);
      p->set_last_completed(completed);
      p->set_last_op("allreduce");
      *p->mutable_in_flight() = TimeUtil::MillisecondsToDuration(in_flight_ms);
    }
    ASSERT_TRUE(core_->Heartbeat(r).ok());
  };
  // world: a, b and c wait inside allreduce 5; d never entered it. node/0
  // (a, b) is fine; node/1 has only c and d, both done with seq 2.
  beat(a, {{"world", 5, 4, 9000}, {"node/0", 3, 3, 0}});
  beat(b, {{"world", 5, 4, 9000}, {"node/0", 3, 3, 0}});
  beat(c, {{"world", 5, 4, 8000}, {"node/1", 2, 2, 0}});
  beat(d, {{"world", 4, 4, 0}, {"node/1", 2, 2, 0}});
  auto status = Status_();
  ASSERT_EQ(status.stalled_collectives_size(), 1) << status.DebugString();
  const auto& stalled = status.stalled_collectives(0);
  EXPECT_EQ(stalled.communicator(), "world");
  EXPECT_EQ(stalled.sequence(), 5u);
  ASSERT_EQ(stalled.waiting_for_member_ids_size(), 1);
  EXPECT_EQ(stalled.waiting_for_member_ids(0), d.id);
  EXPECT_EQ(stalled.waiting_for_ranks(0), ranks.at(d.id));
  EXPECT_EQ(TimeUtil::DurationToMilliseconds(stalled.stalled_for()), 9000);
  // A member a heartbeat ahead, with nobody waiting inside: not a stall.
  beat(d, {{"world", 5, 5, 0}, {"node/1", 3, 3, 0}});
  beat(a, {{"world", 5, 5, 0}, {"node/0", 3, 3, 0}});
  beat(b, {{"world", 5, 5, 0}, {"node/0", 3, 3, 0}});
  beat(c, {{"world", 5, 5, 0}, {"node/1", 2, 2, 0}});
  EXPECT_EQ(Status_().stalled_collectives_size(), 0) << Status_().DebugString();
}

TEST_F(CoreTest, ABrokenStreamThatDoesNotComeBackIsAFailure) {
  Open();
  ASSERT_TRUE(core_->CreateJob(Spec(2, 2)).ok());
  const M a = Join("n0");
  const M b = Join("n0");
  v1::WatchMembershipRequest w;
  w.set_job_id("j");
  w.set_member_id(b.id);
  w.set_session_id(b.session);
  auto generation = core_->AttachStream(w);
  ASSERT_TRUE(generation.ok());
  core_->DetachStream("j", b.id, b.session, *generation);
  Tick(milliseconds(400));  // within the 500 ms grace (and heartbeats keep coming)
  EXPECT_EQ(Latest(a).epoch(), 1u);
  Tick(milliseconds(200));
  EXPECT_EQ(Latest(a).epoch(), 2u);
  EXPECT_EQ(Latest(a).worker_count(), 1u);
}

TEST_F(CoreTest, TheLateEndOfAReplacedStreamDoesNotKillTheMember) {
  Open();
  ASSERT_TRUE(core_->CreateJob(Spec(1, 1)).ok());
  const M a = Join("n0");
  v1::WatchMembershipRequest w;
  w.set_job_id("j");
  w.set_member_id(a.id);
  w.set_session_id(a.session);
  auto old_stream = core_->AttachStream(w);
  auto new_stream = core_->AttachStream(w);  // the member re-attached on a new connection
  ASSERT_TRUE(old_stream.ok() && new_stream.ok());
  core_->DetachStream("j", a.id, a.session, *old_stream);  // the old one ends late
  Tick(milliseconds(2000));
  EXPECT_EQ(Latest(a).epoch(), 1u);
  EXPECT_TRUE(Beat(a).ok());
}

TEST_F(CoreTest, StandbyWorkersDoNotCauseEpochsThatChangeNothing) {
  Open();
  auto spec = Spec(2, 8);
  spec.mutable_mesh()->set_tp(2);
  ASSERT_TRUE(core_->CreateJob(spec).ok());
  const M a = Join("n0");
  Join("n0");
  Join("n1");  // alone on its node: cannot fill a tp group of 2
  Tick(milliseconds(600));
  auto e = Latest(a);
  ASSERT_EQ(e.epoch(), 1u);
  EXPECT_EQ(e.worker_count(), 2u);
  AckAll(e);
  for (int i = 0; i < 10; ++i) Tick(milliseconds(600));
  EXPECT_EQ(Latest(a).epoch(), 1u);  // not republished every window
  Join("n1");                        // now n1 has a whole tp group
  Tick(milliseconds(600));
  EXPECT_EQ(Latest(a).epoch(), 2u);
  EXPECT_EQ(Latest(a).worker_count(), 4u);
}

TEST_F(CoreTest, ANodeFailureIsOneEpochAndOneHostFailure) {
  CoreOptions options;
  options.host_failures_before_holdout = 2;
  Open(options);
  ASSERT_TRUE(core_->CreateJob(Spec(1, 8)).ok());
  const M a = Join("n0");
  std::vector<uint64_t> node1;
  for (int i = 0; i < 4; ++i) node1.push_back(Join("n1").id);
  Tick(milliseconds(600));
  AckAll(Latest(a));
  const uint64_t before = Latest(a).epoch();
  TickWithout(milliseconds(3100), node1);  // the whole node goes silent
  EXPECT_EQ(Latest(a).epoch(), before + 1);
  EXPECT_EQ(Latest(a).worker_count(), 1u);
  EXPECT_TRUE(TryJoin("n1").ok());  // one incident: not yet held out
}

// The failures by node that tandem_coordinator_member_failures_total exports:
// every known (job, kind, node) from the start at 0, each death counted once
// on its member's node.
TEST_F(CoreTest, FailuresAreCountedByJobKindAndNode) {
  Open();
  ASSERT_TRUE(core_->CreateJob(Spec(3, 3, 1)).ok());
  const M a = Join("n0");
  const M b = Join("n1");
  Join("n1");
  Join("n2", v1::ROLE_SERVER);
  using Key = std::tuple<std::string, std::string, std::string>;
  auto stats = core_->TakeStats();
  EXPECT_EQ(stats.failures_by_node,
            (std::map<Key, uint64_t>{
                {Key{"j", "server", "n2"}, 0}, {Key{"j", "worker", "n0"}, 0}, {Key{"j", "worker", "n1"}, 0}}));
  Tick(milliseconds(600));
  AckAll(Latest(a));
  TickWithout(milliseconds(3100), {b.id});
  ASSERT_EQ(Latest(a).cause(), v1::EPOCH_CAUSE_FAILURE);
  stats = core_->TakeStats();
  EXPECT_EQ(stats.failures_detected, 1u);
  EXPECT_EQ(stats.failures_by_node[Key("j", "worker", "n1")], 1u);
  EXPECT_EQ(stats.failures_by_node[Key("j", "worker", "n0")], 0u);
  EXPECT_EQ(stats.failures_by_node[Key("j", "server", "n2")], 0u);
  // Counters: a second look does not count the death again.
  EXPECT_EQ(core_->TakeStats().failures_by_node[Key("j", "worker", "n1")], 1u);
}

// Servers have no RankAssignment; metrics name them by ServerRank: their
// order by member id among the epoch's servers, renumbered when one leaves.
TEST_F(CoreTest, ServerRanksFollowMemberIdsAmongTheEpochsServers) {
  Open();
  ASSERT_TRUE(core_->CreateJob(Spec(1, 1, 3)).ok());
  const M w = Join("n0");
  const M s0 = Join("n1", v1::ROLE_SERVER);
  const M s1 = Join("n2", v1::ROLE_SERVER);
  const M s2 = Join("n3", v1::ROLE_SERVER);
  Tick(milliseconds(600));
  auto e = Latest(w);
  ASSERT_EQ(e.server_count(), 3u);
  EXPECT_EQ(ServerRank(e, s0.id), 0u);
  EXPECT_EQ(ServerRank(e, s1.id), 1u);
  EXPECT_EQ(ServerRank(e, s2.id), 2u);
  EXPECT_FALSE(ServerRank(e, w.id).has_value());  // a worker
  EXPECT_FALSE(ServerRank(e, 999).has_value());   // not in the epoch
  AckAll(e);
  TickWithout(milliseconds(3100), {s1.id});
  e = Latest(w);
  ASSERT_EQ(e.server_count(), 2u);
  EXPECT_EQ(ServerRank(e, s0.id), 0u);
  EXPECT_EQ(ServerRank(e, s2.id), 1u);
}

TEST_F(CoreTest, MemberIdsAreNeverReusedAcrossSnapshotsAndRestarts) {
  CoreOptions options;
  options.snapshot_every_records = 1;
  Open(options);
  ASSERT_TRUE(core_->CreateJob(Spec(1, 4)).ok());
  Join("n0");
  const M b = Join("n1");
  Tick(milliseconds(600));
  TickWithout(milliseconds(3100), {b.id});
  clock_.Advance(milliseconds(700000));  // long enough for the dead member to be forgotten
  Tick(milliseconds(10));
  Open(options);
  const M c = Join("n2");
  EXPECT_GT(c.id, b.id);
}

TEST_F(CoreTest, JoinersAreAdmittedAsANewEpochAndLeaversAtOnce) {
  Open();
  ASSERT_TRUE(core_->CreateJob(Spec(2, 8)).ok());
  const M a = Join("n0");
  const M b = Join("n0");
  Tick(milliseconds(600));
  AckAll(Latest(a));
  const M c = Join("n1");
  Tick(milliseconds(100));
  EXPECT_EQ(Latest(a).epoch(), 1u);  // joins are batched over the window
  Tick(milliseconds(500));
  auto e = Latest(a);
  ASSERT_EQ(e.epoch(), 2u);
  EXPECT_EQ(e.cause(), v1::EPOCH_CAUSE_JOIN);
  EXPECT_EQ(Ranks(e)[c.id], 2u);
  EXPECT_EQ(Ranks(e)[a.id], 0u);
  EXPECT_EQ(Ranks(e)[b.id], 1u);
  v1::LeaveRequest leave;
  leave.set_job_id("j");
  leave.set_member_id(a.id);
  leave.set_session_id(a.session);
  auto left = core_->Leave(leave);
  ASSERT_TRUE(left.ok());
  EXPECT_EQ(left->response.next_epoch(), 3u);
  e = Latest(b);
  EXPECT_EQ(e.cause(), v1::EPOCH_CAUSE_LEAVE);
  EXPECT_EQ(Ranks(e)[b.id], 0u);
  EXPECT_EQ(Ranks(e)[c.id], 1u);
}

TEST_F(CoreTest, ShardMapBalancesOverServersAndPromotesBackupsWhenOneDies) {
  Open();
  auto spec = Spec(1, 1, 2);
  spec.set_parameter_count(10'000'000);
  spec.set_partition_size_bytes(4u << 20);  // 1 Mi elements per partition: 10 partitions
  ASSERT_TRUE(core_->CreateJob(spec).ok());
  const M s0 = Join("s0", v1::ROLE_SERVER);
  const M s1 = Join("s1", v1::ROLE_SERVER);
  const M w = Join("n0");
  auto e = Latest(w);
  ASSERT_EQ(e.epoch(), 1u);
  ASSERT_EQ(e.shard_map().partitions_size(), 10);
  std::map<uint64_t, int> primaries;
  for (const auto& p : e.shard_map().partitions()) {
    ++primaries[p.primary_member_id()];
    EXPECT_NE(p.backup_member_id(), p.primary_member_id());
    EXPECT_NE(p.backup_member_id(), 0u);
  }
  EXPECT_EQ(primaries[s0.id], 5);
  EXPECT_EQ(primaries[s1.id], 5);
  AckAll(e);
  TickWithout(milliseconds(3100), {s1.id});
  e = Latest(w);
  ASSERT_EQ(e.epoch(), 2u);
  for (const auto& p : e.shard_map().partitions()) EXPECT_EQ(p.primary_member_id(), s0.id);
  EXPECT_GT(e.shard_map().version(), 1u);
}

TEST_F(CoreTest, PrimariesAreRebalancedOnceEveryServerReportsItsBackupsInSync) {
  Open();
  auto spec = Spec(1, 1, 2);
  spec.set_parameter_count(8 << 20);
  spec.set_partition_size_bytes(4u << 20);  // 1 Mi elements per partition: 8 partitions
  ASSERT_TRUE(core_->CreateJob(spec).ok());
  const M s0 = Join("s0", v1::ROLE_SERVER);
  const M s1 = Join("s1", v1::ROLE_SERVER);
  const M w = Join("n0");
  auto e = Latest(w);
  ASSERT_EQ(e.epoch(), 1u);
  AckAll(e);
  replicated_[s0.id] = replicated_[s1.id] = 1;
  Tick(milliseconds(100));
  EXPECT_EQ(Latest(w).epoch(), 1u);  // balanced: no rebalance
  TickWithout(milliseconds(3100), {s1.id});
  e = Latest(w);
  ASSERT_EQ(e.epoch(), 2u);
  AckAll(e);
  const M back = Join("s1", v1::ROLE_SERVER);
  Tick(milliseconds(600));  // the join window closes
  e = Latest(w);
  ASSERT_EQ(e.epoch(), 3u);
  ASSERT_EQ(e.cause(), v1::EPOCH_CAUSE_JOIN);
  for (const auto& p : e.shard_map().partitions()) {
    EXPECT_EQ(p.primary_member_id(), s0.id);
    EXPECT_EQ(p.backup_member_id(), back.id);
  }
  AckAll(e);
  ASSERT_EQ(Latest(w).state(), v1::EPOCH_STATE_ACTIVE);
  const uint64_t version = e.shard_map().version();

  // Not until every server reports its backups in sync in epoch 3.
  replicated_[s0.id] = 2;
  replicated_[back.id] = 3;
  Tick(milliseconds(100));
  EXPECT_EQ(Latest(w).epoch(), 3u);
  replicated_[s0.id] = 3;
  Tick(milliseconds(100));
  e = Latest(w);
  ASSERT_EQ(e.epoch(), 4u);
  EXPECT_EQ(e.cause(), v1::EPOCH_CAUSE_REBALANCE);
  EXPECT_NE(e.cause_detail().find("primaries rebalanced"), std::string::npos) << e.cause_detail();
  EXPECT_EQ(e.shard_map().version(), version + 1);
  std::map<uint64_t, int> primaries;
  for (const auto& p : e.shard_map().partitions()) {
    ++primaries[p.primary_member_id()];
    EXPECT_EQ(p.backup_member_id(), p.primary_member_id() == s0.id ? back.id : s0.id);
  }
  EXPECT_EQ(primaries[s0.id], 4);
  EXPECT_EQ(primaries[back.id], 4);
  // Only the shard map changed: the same workers with the same ranks.
  EXPECT_EQ(Ranks(e), Ranks(Latest(s0)));
  EXPECT_EQ(e.worker_count(), 1u);
  EXPECT_EQ(e.server_count(), 2u);

  // Exactly one: not while it is pending, nor once balanced.
  Tick(milliseconds(100));
  EXPECT_EQ(Latest(w).epoch(), 4u);
  AckAll(e);
  replicated_[s0.id] = replicated_[back.id] = 4;
  Tick(milliseconds(100));
  Tick(milliseconds(100));
  EXPECT_EQ(Latest(w).epoch(), 4u);
  EXPECT_EQ(Latest(w).state(), v1::EPOCH_STATE_ACTIVE);
}

TEST_F(CoreTest, AServerBackAmongThreeGetsBackupsThenPrimaries) {
  Open();
  auto spec = Spec(1, 1, 3);
  spec.set_parameter_count(12 << 20);
  spec.set_partition_size_bytes(4u << 20);  // 12 partitions
  ASSERT_TRUE(core_->CreateJob(spec).ok());
  const M s0 = Join("s0", v1::ROLE_SERVER);
  const M s1 = Join("s1", v1::ROLE_SERVER);
  const M s2 = Join("s2", v1::ROLE_SERVER);
  const M w = Join("n0");
  AckAll(Latest(w));
  TickWithout(milliseconds(3100), {s2.id});
  AckAll(Latest(w));
  const M back = Join("s2", v1::ROLE_SERVER);
  Tick(milliseconds(600));
  auto e = Latest(w);
  ASSERT_EQ(e.cause(), v1::EPOCH_CAUSE_JOIN);
  auto held = [](const v1::ShardMap& map, uint64_t id) {
    int primaries = 0, backups = 0;
    for (const auto& p : map.partitions()) {
      primaries += p.primary_member_id() == id ? 1 : 0;
      backups += p.backup_member_id() == id ? 1 : 0;
    }
    return std::pair{primaries, backups};
  };
  // The survivors kept every primary and backup: the returning server holds nothing.
  EXPECT_EQ(held(e.shard_map(), back.id), (std::pair{0, 0}));
  AckAll(e);
  replicated_[s0.id] = replicated_[s1.id] = replicated_[back.id] = e.epoch();
  Tick(milliseconds(100));
  // First its share of backups (the primaries stay)...
  const auto before = e;
  e = Latest(w);
  ASSERT_EQ(e.epoch(), before.epoch() + 1);
  EXPECT_EQ(e.cause(), v1::EPOCH_CAUSE_REBALANCE);
  EXPECT_NE(e.cause_detail().find("backups moved"), std::string::npos) << e.cause_detail();
  EXPECT_EQ(held(e.shard_map(), back.id), (std::pair{0, 8}));
  for (int i = 0; i < e.shard_map().partitions_size(); ++i) {
    EXPECT_EQ(e.shard_map().partitions(i).primary_member_id(), before.shard_map().partitions(i).primary_member_id());
  }
  EXPECT_EQ(Ranks(e), Ranks(before));
  AckAll(e);
  // ...then, once they hold their state, a third of the primaries.
  Tick(milliseconds(100));
  EXPECT_EQ(Latest(w).epoch(), e.epoch());
  replicated_[s0.id] = replicated_[s1.id] = replicated_[back.id] = e.epoch();
  Tick(milliseconds(100));
  const auto moved = e;
  e = Latest(w);
  ASSERT_EQ(e.epoch(), moved.epoch() + 1);
  EXPECT_EQ(e.cause(), v1::EPOCH_CAUSE_REBALANCE);
  EXPECT_NE(e.cause_detail().find("primaries rebalanced"), std::string::npos) << e.cause_detail();
  for (uint64_t id : {s0.id, s1.id, back.id}) EXPECT_EQ(held(e.shard_map(), id), (std::pair{4, 4})) << id;
  // Even: no more.
  AckAll(e);
  replicated_[s0.id] = replicated_[s1.id] = replicated_[back.id] = e.epoch();
  Tick(milliseconds(100));
  Tick(milliseconds(100));
  EXPECT_EQ(Latest(w).epoch(), e.epoch());
}

TEST_F(CoreTest, NoRebalanceWhileAMemberJoins) {
  Open();
  auto spec = Spec(1, 1, 2);
  spec.set_parameter_count(8 << 20);
  spec.set_partition_size_bytes(4u << 20);
  ASSERT_TRUE(core_->CreateJob(spec).ok());
  const M s0 = Join("s0", v1::ROLE_SERVER);
  const M s1 = Join("s1", v1::ROLE_SERVER);
  const M w = Join("n0");
  AckAll(Latest(w));
  TickWithout(milliseconds(3100), {s1.id});
  AckAll(Latest(w));
  const M back = Join("s1", v1::ROLE_SERVER);
  Tick(milliseconds(600));
  auto e = Latest(w);
  ASSERT_EQ(e.epoch(), 3u);
  AckAll(e);
  // Both report their backups in sync, but a third server is joining: its
  // join epoch comes first, and no rebalance while its window is open.
  replicated_[s0.id] = replicated_[back.id] = 3;
  const M s2 = Join("s2", v1::ROLE_SERVER);
  Tick(milliseconds(100));
  EXPECT_EQ(Latest(w).epoch(), 3u);
  Tick(milliseconds(500));
  e = Latest(w);
  ASSERT_EQ(e.epoch(), 4u);
  EXPECT_EQ(e.cause(), v1::EPOCH_CAUSE_JOIN);
  // Active, but the new server has not reported epoch 4 yet: still none.
  AckAll(e);
  replicated_[s0.id] = replicated_[back.id] = 4;
  Tick(milliseconds(100));
  EXPECT_EQ(Latest(w).epoch(), 4u);
  replicated_[s2.id] = 4;
  Tick(milliseconds(100));
  e = Latest(w);
  ASSERT_EQ(e.epoch(), 5u);
  EXPECT_EQ(e.cause(), v1::EPOCH_CAUSE_REBALANCE);
}

TEST_F(CoreTest, RestartRecoversTheSameEpochAndMembersReattach) {
  Open();
  ASSERT_TRUE(core_->CreateJob(Spec(2, 2)).ok());
  const M a = Join("n0");
  const M b = Join("n1");
  AckAll(Latest(a));
  const uint64_t first_incarnation = core_->incarnation();
  // "kill -9": drop the core without any shutdown; a new one reads the same store.
  Open();
  EXPECT_EQ(core_->incarnation(), first_incarnation + 1);
  auto e = Latest(a);
  EXPECT_EQ(e.epoch(), 1u);  // same epoch, no new rendezvous
  EXPECT_EQ(e.state(), v1::EPOCH_STATE_ACTIVE);
  EXPECT_TRUE(Beat(a).ok());  // old sessions still valid
  EXPECT_TRUE(Beat(b).ok());
  // A member re-attaching keeps its id.
  v1::RegisterRequest r;
  r.set_job_id("j");
  r.set_role(v1::ROLE_WORKER);
  r.mutable_node()->set_hostname("n0");
  r.set_resume_member_id(a.id);
  r.set_resume_session_id(a.session);
  auto again = core_->Register(r);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->response.resumed());
  EXPECT_EQ(again->response.member_id(), a.id);
  // Epoch numbers keep growing after the restart.
  TickWithout(milliseconds(3100), {b.id});
  EXPECT_EQ(Latest(a).epoch(), 2u);
  // And a member registered after the restart gets a fresh id.
  const M c = Join("n2");
  EXPECT_GT(c.id, b.id);
}

TEST_F(CoreTest, ACrashBetweenADeathAndItsEpochIsRepairedOnRecovery) {
  Open();
  ASSERT_TRUE(core_->CreateJob(Spec(2, 2)).ok());
  const M a = Join("n0");
  const M b = Join("n1");
  AckAll(Latest(a));
  // The log ends with b's death record but not the epoch without it, as if
  // the coordinator was killed between the two appends.
  core_.reset();
  store_.reset();
  {
    MemoryStore raw(backing_);
    ASSERT_TRUE(raw.Recover().ok());
    internal::Record r;
    auto* m = r.mutable_member();
    m->set_job_id("j");
    m->set_member_id(b.id);
    m->set_session_id(b.session);
    m->set_role(v1::ROLE_WORKER);
    m->mutable_node()->set_hostname("n1");
    m->mutable_node()->set_node_id("n1");
    m->set_state(v1::MEMBER_STATE_DEAD);
    ASSERT_TRUE(raw.WaitDurable(raw.Append(r.SerializeAsString())).ok());
  }
  Open();
  const auto e = Latest(a);
  EXPECT_EQ(e.epoch(), 2u);  // re-formed without b at once
  EXPECT_EQ(e.worker_count(), 1u);
  AckAll(e);
  EXPECT_EQ(Latest(a).state(), v1::EPOCH_STATE_ACTIVE);
}

TEST_F(CoreTest, RestartFromASnapshotAndTheLogAfterIt) {
  CoreOptions options;
  options.snapshot_every_records = 5;  // snapshot often
  Open(options);
  ASSERT_TRUE(core_->CreateJob(Spec(4, 4)).ok());
  std::vector<M> ms;
  for (int i = 0; i < 4; ++i) ms.push_back(Join("n" + std::to_string(i / 2)));
  AckAll(Latest(ms[0]));
  TickWithout(milliseconds(3100), {ms[3].id});
  const auto before = Latest(ms[0]);
  Open(options);
  const auto after = Latest(ms[0]);
  EXPECT_EQ(after.SerializeAsString(), before.SerializeAsString());
  EXPECT_EQ(Status_().members_size(), Status_().members_size());
}

TEST_F(CoreTest, AJobThatCannotFormItsMeshWaitsAndSaysWhy) {
  Open();
  auto spec = Spec(2, 2);
  spec.mutable_mesh()->set_tp(4);
  ASSERT_TRUE(core_->CreateJob(spec).ok());
  const M a = Join("n0");
  Join("n1");
  EXPECT_EQ(Latest(a).epoch(), 0u);
  // The reason shows in the members' status detail only as waiting; the log names the mesh.
  EXPECT_EQ(Status_().active_epoch(), 0u);
}

TEST_F(CoreTest, RendezvousTimeoutFailsTheWaitingMembersWithAClearError) {
  Open();
  ASSERT_TRUE(core_->CreateJob(Spec(3, 3)).ok());
  const M a = Join("n0");
  Tick(milliseconds(10100));
  v1::WatchMembershipRequest w;
  w.set_job_id("j");
  w.set_member_id(a.id);
  w.set_session_id(a.session);
  WatchPosition pos;
  auto u = core_->NextUpdate(w, pos);
  ASSERT_FALSE(u.ok());
  EXPECT_EQ(u.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(u.status().message().find("1 of 3 workers"), std::string::npos) << u.status().message();
}

TEST_F(CoreTest, AHostThatKeepsFailingIsHeldOutWithBackoff) {
  CoreOptions options;
  options.host_failures_before_holdout = 2;
  options.host_backoff_base = milliseconds(5000);
  Open(options);
  ASSERT_TRUE(core_->CreateJob(Spec(1, 4)).ok());
  Join("good");
  for (int round = 0; round < 2; ++round) {
    const M bad = Join("flaky");
    TickWithout(milliseconds(3100), {bad.id});
  }
  auto refused = TryJoin("flaky");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("host 'flaky' is held out after 2 failures"), std::string::npos)
      << refused.status().message();
  clock_.Advance(milliseconds(5100));
  EXPECT_TRUE(TryJoin("flaky").ok());
}

TEST_F(CoreTest, HostileRequestsGetErrorsNamingTheField) {
  CoreOptions options;
  options.token = "s3cret";
  Open(options);
  ASSERT_TRUE(core_->CreateJob(Spec(1, 2)).ok());
  EXPECT_EQ(TryJoin("n0", v1::ROLE_WORKER, "").status().code(), StatusCode::kUnauthenticated);
  EXPECT_EQ(TryJoin("n0", v1::ROLE_WORKER, "s3cres").status().code(), StatusCode::kUnauthenticated);
  v1::RegisterRequest r;
  r.set_token("s3cret");
  r.set_role(v1::ROLE_WORKER);
  r.mutable_node()->set_hostname("n0");
  r.set_job_id("no such job");
  EXPECT_EQ(core_->Register(r).status().code(), StatusCode::kInvalidArgument);  // bad characters
  r.set_job_id("nosuchjob");
  EXPECT_EQ(core_->Register(r).status().code(), StatusCode::kNotFound);
  r.set_job_id("j");
  r.set_role(v1::ROLE_UNSPECIFIED);
  EXPECT_NE(core_->Register(r).status().message().find("role"), std::string::npos);
  r.set_role(v1::ROLE_WORKER);
  for (int i = 0; i < 17; ++i) r.add_endpoints()->set_transport("tcp");
  auto too_many = core_->Register(r);
  EXPECT_EQ(too_many.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(too_many.status().message().find("endpoints: 17 given, at most 16"), std::string::npos);
  r.clear_endpoints();
  r.set_control_address("nonsense");
  EXPECT_NE(core_->Register(r).status().message().find("control_address"), std::string::npos);
  // A job spec that cannot work.
  v1::RegisterRequest create;
  create.set_token("s3cret");
  create.set_job_id("k");
  create.set_role(v1::ROLE_WORKER);
  create.mutable_node()->set_hostname("n0");
  *create.mutable_job_spec() = Spec(1, 1);
  create.mutable_job_spec()->set_job_id("k");
  create.mutable_job_spec()->set_max_workers(1'000'000);
  auto absurd = core_->Register(create);
  EXPECT_EQ(absurd.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(absurd.status().message().find("max_workers"), std::string::npos) << absurd.status().message();
  // Member calls with a wrong session, or from the future.
  v1::HeartbeatRequest hb;
  hb.set_job_id("j");
  hb.set_token("s3cret");
  hb.set_member_id(12345);
  EXPECT_EQ(core_->Heartbeat(hb).status().code(), StatusCode::kNotFound);
  options.token.clear();
}

TEST_F(CoreTest, ACoordinatorStallDoesNotKillMembers) {
  // Built directly: Open() turns stall detection off for the other tests.
  CoreOptions options;
  options.stall_threshold = milliseconds(1000);
  store_ = std::make_unique<MemoryStore>(backing_);
  core_ = std::make_unique<CoordinatorCore>(options, store_.get(), &clock_);
  ASSERT_TRUE(core_->Recover().ok());
  ASSERT_TRUE(core_->CreateJob(Spec(1, 1)).ok());
  const M a = Join("n0");
  core_->Tick();
  clock_.Advance(milliseconds(10000));  // nobody, the coordinator included, ran for 10 s
  core_->Tick();
  EXPECT_TRUE(Beat(a).ok());
  EXPECT_EQ(Latest(a).epoch(), 1u);
}

TEST_F(CoreTest, DrainAndScaleDown) {
  Open();
  ASSERT_TRUE(core_->CreateJob(Spec(1, 3)).ok());
  const M a = Join("n0");
  const M b = Join("n0");
  const M c = Join("n0");
  AckAll(Latest(a));
  v1::DrainRequest drain;
  drain.set_job_id("j");
  drain.set_member_id(b.id);
  ASSERT_TRUE(core_->Drain(drain).ok());
  auto e = Latest(a);
  EXPECT_EQ(e.worker_count(), 2u);
  EXPECT_FALSE(Ranks(e).count(b.id));
  v1::HeartbeatRequest hb;
  hb.set_job_id("j");
  hb.set_member_id(b.id);
  hb.set_session_id(b.session);
  EXPECT_EQ(core_->Heartbeat(hb)->command(), v1::MEMBER_COMMAND_DRAIN);
  v1::ScaleRequest scale;
  scale.set_job_id("j");
  scale.set_max_workers(1);
  auto scaled = core_->Scale(scale);
  ASSERT_TRUE(scaled.ok());
  EXPECT_EQ(scaled->response.drained_member_ids_size(), 1);
  EXPECT_EQ(scaled->response.drained_member_ids(0), c.id);  // the highest rank goes
  EXPECT_EQ(Latest(a).worker_count(), 1u);
  scale.set_min_workers(5);
  scale.set_max_workers(2);
  EXPECT_EQ(core_->Scale(scale).status().code(), StatusCode::kInvalidArgument);
}

// Raising min_workers above the workers a job has pauses training: an epoch
// with the same members and `paused`; later epochs stay paused while the job
// is below the minimum, and the epoch that admits enough joiners resumes it.
// A failure below the minimum alone does not pause (survivors go on).
TEST_F(CoreTest, ScalingTheMinimumAboveTheWorkersPausesTrainingUntilJoins) {
  Open();
  ASSERT_TRUE(core_->CreateJob(Spec(2, 4)).ok());
  const M a = Join("n0");
  const M b = Join("n1");
  const M c = Join("n2");
  Tick(milliseconds(600));
  auto e = Latest(a);
  ASSERT_EQ(e.worker_count(), 3u);
  EXPECT_FALSE(e.paused());
  AckAll(e);
  // c dies: 2 workers, at the minimum; then the minimum is raised to 2 (no change) and 3.
  TickWithout(milliseconds(3100), {c.id});
  e = Latest(a);
  ASSERT_EQ(e.cause(), v1::EPOCH_CAUSE_FAILURE);
  ASSERT_EQ(e.worker_count(), 2u);
  EXPECT_FALSE(e.paused());
  AckAll(e);
  const uint64_t before = e.epoch();
  v1::ScaleRequest scale;
  scale.set_job_id("j");
  scale.set_min_workers(2);
  ASSERT_TRUE(core_->Scale(scale).ok());
  EXPECT_EQ(Latest(a).epoch(), before);  // nothing to pause
  scale.set_min_workers(4);
  auto scaled = core_->Scale(scale);
  ASSERT_TRUE(scaled.ok()) << scaled.status().ToString();
  EXPECT_EQ(scaled->response.workers(), 2u);
  e = Latest(a);
  EXPECT_EQ(e.epoch(), before + 1);
  EXPECT_EQ(e.cause(), v1::EPOCH_CAUSE_ADMIN);
  EXPECT_EQ(e.worker_count(), 2u);
  EXPECT_TRUE(e.paused());
  EXPECT_NE(Status_().waiting_reason().find("training paused: 2 of the 4 workers"), std::string::npos)
      << Status_().waiting_reason();
  AckAll(e);
  // A second raise while paused publishes nothing new.
  scale.set_min_workers(3);
  ASSERT_TRUE(core_->Scale(scale).ok());
  EXPECT_EQ(Latest(a).epoch(), before + 1);
  // One joiner: 3 of 3, training resumes.
  const M d = Join("n3");
  Tick(milliseconds(600));
  e = Latest(a);
  EXPECT_EQ(e.epoch(), before + 2);
  EXPECT_EQ(e.cause(), v1::EPOCH_CAUSE_JOIN);
  EXPECT_EQ(e.worker_count(), 3u);
  EXPECT_FALSE(e.paused());
  EXPECT_TRUE(Ranks(e).count(d.id));
  AckAll(e);
  // Raised again, then lowered: paused, then resumed with the same members.
  scale.set_min_workers(4);
  ASSERT_TRUE(core_->Scale(scale).ok());
  EXPECT_TRUE(Latest(a).paused());
  AckAll(Latest(a));
  scale.set_min_workers(1);
  ASSERT_TRUE(core_->Scale(scale).ok());
  e = Latest(a);
  EXPECT_EQ(e.epoch(), before + 4);
  EXPECT_FALSE(e.paused());
  EXPECT_EQ(e.worker_count(), 3u);
  (void)b;
}

TEST_F(CoreTest, EpochValuesArePerEpochAndSetOnce) {
  Open();
  ASSERT_TRUE(core_->CreateJob(Spec(1, 1)).ok());
  const M a = Join("n0");
  v1::PutEpochValueRequest put;
  put.set_job_id("j");
  put.set_member_id(a.id);
  put.set_session_id(a.session);
  put.set_epoch(1);
  put.set_key("nccl/world");
  put.set_value("id-1");
  ASSERT_TRUE(core_->PutEpochValue(put).ok());
  ASSERT_TRUE(core_->PutEpochValue(put).ok());  // same value: fine
  put.set_value("id-2");
  EXPECT_EQ(core_->PutEpochValue(put).code(), StatusCode::kAlreadyExists);
  v1::GetEpochValuesRequest get;
  get.set_job_id("j");
  get.set_member_id(a.id);
  get.set_session_id(a.session);
  get.set_epoch(1);
  get.add_keys("nccl/world");
  get.add_keys("missing");
  auto got = core_->GetEpochValues(get);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->values().at("nccl/world"), "id-1");
  ASSERT_EQ(got->missing_keys_size(), 1);
  get.set_epoch(7);
  EXPECT_EQ(core_->GetEpochValues(get).status().code(), StatusCode::kAborted);
}

// Issue 28: a restarted process (a Kubernetes pod keeps its name) replaces
// its old incarnation at once instead of waiting out its heartbeat deadline.
TEST_F(CoreTest, ARestartReplacesItsOldIncarnationAtOnceWithoutBlamingTheHost) {
  CoreOptions options;
  options.host_failures_before_holdout = 1;  // one counted failure would refuse the replacement
  Open(options);
  ASSERT_TRUE(core_->CreateJob(Spec(2, 2)).ok());
  auto a = TryJoinAs("n0", "w-0", 100, 41);
  auto old = TryJoinAs("n1", "w-1", 100, 42);
  ASSERT_TRUE(a.ok() && old.ok());
  AckAll(Latest(*a));
  ASSERT_EQ(Latest(*a).state(), v1::EPOCH_STATE_ACTIVE);
  // The process of w-1 restarts: the clock does not move, no deadline passes.
  auto fresh = TryJoinAs("n1", "w-1", 200, 43);
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  const auto e = Latest(*a);
  ASSERT_EQ(e.epoch(), 2u);  // one epoch: without the old member, with the new one
  EXPECT_EQ(e.cause(), v1::EPOCH_CAUSE_FAILURE);
  EXPECT_NE(e.cause_detail().find("replaced by incarnation 200 of 'w-1'"), std::string::npos) << e.cause_detail();
  auto ranks = Ranks(e);
  EXPECT_EQ(ranks.count(old->id), 0u);
  EXPECT_EQ(ranks.count(fresh->id), 1u);
  EXPECT_EQ(ranks.size(), 2u);
  const auto status = Status_();
  const v1::MemberStatus* gone = FindStatus(status, old->id);
  ASSERT_NE(gone, nullptr);
  EXPECT_EQ(gone->state(), v1::MEMBER_STATE_DEAD);
  EXPECT_EQ(gone->host_failures(), 0u);  // a restart says nothing against the host
  EXPECT_FALSE(gone->has_held_out_until());
  const v1::MemberStatus* now = FindStatus(status, fresh->id);
  ASSERT_NE(now, nullptr);
  EXPECT_EQ(now->member_name(), "w-1");
  EXPECT_EQ(now->incarnation(), 200u);
  EXPECT_EQ(now->pid(), 43u);
  // The old process, if it still runs, learns why; registering again with
  // its own incarnation, it is refused: it must not take the name back.
  const Status beat = Beat(*old);
  EXPECT_EQ(beat.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(beat.message().find("replaced by incarnation 200 of 'w-1'"), std::string::npos) << beat.message();
  auto stale = TryJoinAs("n1", "w-1", 100, 42);
  ASSERT_FALSE(stale.ok());
  EXPECT_EQ(stale.status().code(), StatusCode::kAlreadyExists);
  EXPECT_NE(stale.status().message().find("member_name 'w-1' is held by worker"), std::string::npos)
      << stale.status().message();
  EXPECT_NE(stale.status().message().find("incarnation 200"), std::string::npos) << stale.status().message();
  EXPECT_NE(stale.status().message().find("incarnation 100 is not newer"), std::string::npos)
      << stale.status().message();
  EXPECT_EQ(Latest(*a).epoch(), 2u);  // the refusal changed nothing
}

TEST_F(CoreTest, AnIncarnationNoNewerThanTheHoldersIsRefusedUnlessItIsTheSameProcess) {
  Open();
  ASSERT_TRUE(core_->CreateJob(Spec(1, 4)).ok());
  auto holder = TryJoinAs("n0", "w-0", 5, 10);
  ASSERT_TRUE(holder.ok());
  EXPECT_EQ(TryJoinAs("n0", "w-0", 4, 11).status().code(), StatusCode::kAlreadyExists);  // older
  EXPECT_EQ(TryJoinAs("n0", "w-0", 5, 11).status().code(), StatusCode::kAlreadyExists);  // a second process
  EXPECT_EQ(TryJoinAs("n0", "w-0", 0, 11).status().code(), StatusCode::kAlreadyExists);  // unknown: not newer
  EXPECT_EQ(TryJoinAs("n1", "w-0", 5, 10).status().code(), StatusCode::kAlreadyExists);  // same pid, other node
  EXPECT_TRUE(Beat(*holder).ok());                                                       // the holder keeps its place
  // The same process registering again (the reply to its first registration
  // was lost) replaces its earlier registration.
  auto again = TryJoinAs("n0", "w-0", 5, 10);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_NE(again->id, holder->id);
  const auto status = Status_();
  ASSERT_NE(FindStatus(status, holder->id), nullptr);
  EXPECT_EQ(FindStatus(status, holder->id)->state(), v1::MEMBER_STATE_DEAD);
  // A holder that registered without an incarnation yields to one that has one.
  ASSERT_TRUE(TryJoinAs("n2", "w-9", 0, 20).ok());
  EXPECT_TRUE(TryJoinAs("n2", "w-9", 1, 21).ok());
  // Without a name, nothing is replaced or refused.
  EXPECT_TRUE(TryJoinAs("n3", "", 0, 30).ok());
  EXPECT_TRUE(TryJoinAs("n3", "", 0, 30).ok());
}

TEST_F(CoreTest, TheSameNameInAnotherRoleIsNoReplacement) {
  Open();
  ASSERT_TRUE(core_->CreateJob(Spec(1, 4)).ok());
  auto worker = TryJoinAs("n0", "pod-0", 1, 10, v1::ROLE_WORKER);
  auto server = TryJoinAs("n0", "pod-0", 2, 11, v1::ROLE_SERVER);
  ASSERT_TRUE(worker.ok() && server.ok());
  const auto status = Status_();
  ASSERT_EQ(status.members_size(), 2);
  for (const auto& m : status.members()) EXPECT_NE(m.state(), v1::MEMBER_STATE_DEAD) << m.member_id();
}

TEST_F(CoreTest, MemberNamesAreValidated) {
  Open();
  ASSERT_TRUE(core_->CreateJob(Spec(1, 4)).ok());
  auto spaced = TryJoinAs("n0", "worker 1", 1, 10);
  EXPECT_EQ(spaced.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(spaced.status().message().find("member_name 'worker 1'"), std::string::npos) << spaced.status().message();
  auto long_name = TryJoinAs("n0", std::string(129, 'w'), 1, 10);
  EXPECT_EQ(long_name.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(long_name.status().message().find("member_name: 129 bytes"), std::string::npos)
      << long_name.status().message();
  EXPECT_TRUE(TryJoinAs("n0", std::string(128, 'w'), 1, 10).ok());
  EXPECT_TRUE(TryJoinAs("n0", "tandem-workers-0_1.a", 1, 10).ok());
}

TEST_F(CoreTest, AMemberOfAnotherMajorVersionIsRefusedNamingBoth) {
  Open();
  ASSERT_TRUE(core_->CreateJob(Spec(1, 4)).ok());
  auto join = [&](const std::string& version) {
    v1::RegisterRequest r;
    r.set_job_id("j");
    r.set_role(v1::ROLE_WORKER);
    r.mutable_node()->set_hostname("n0");
    r.set_version(version);
    return core_->Register(r).status();
  };
  EXPECT_TRUE(join(TANDEM_VERSION).ok());
  EXPECT_TRUE(join("").ok());  // no version: not checked
  EXPECT_TRUE(join(std::to_string(TANDEM_VERSION_MAJOR) + ".999.1-dev").ok());
  const Status other = join(std::to_string(TANDEM_VERSION_MAJOR + 1) + ".0.0");
  EXPECT_EQ(other.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(other.message().find(std::string("this coordinator ") + TANDEM_VERSION), std::string::npos)
      << other.message();
  for (const std::string& bad : std::vector<std::string>{"x.1", ".1", "1x", std::string(65, '1')}) {
    EXPECT_EQ(join(bad).code(), StatusCode::kInvalidArgument) << bad;
  }
}

TEST_F(CoreTest, NamesIncarnationsAndPidsSurviveARestart) {
  Open();
  ASSERT_TRUE(core_->CreateJob(Spec(1, 1)).ok());
  auto a = TryJoinAs("n0", "w-0", 7, 1234);
  ASSERT_TRUE(a.ok());
  AckAll(Latest(*a));
  Open();  // "kill -9" and a new core on the same store
  const auto status = Status_();
  const v1::MemberStatus* m = FindStatus(status, a->id);
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->member_name(), "w-0");
  EXPECT_EQ(m->incarnation(), 7u);
  EXPECT_EQ(m->pid(), 1234u);
  // A process that restarted meanwhile replaces the recovered member at
  // once, rather than after the recovery grace.
  auto fresh = TryJoinAs("n0", "w-0", 8, 1300);
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  const auto e = Latest(*fresh);
  EXPECT_EQ(e.epoch(), 2u);
  EXPECT_EQ(Ranks(e).count(fresh->id), 1u);
  // And a stale one is still refused.
  EXPECT_EQ(TryJoinAs("n0", "w-0", 7, 1234).status().code(), StatusCode::kAlreadyExists);
}

TEST_F(CoreTest, NoHostIsHeldOutWhenFailuresBeforeHoldoutIsZero) {
  CoreOptions options;
  options.host_failures_before_holdout = 0;
  options.host_backoff_base = milliseconds(5000);
  Open(options);
  ASSERT_TRUE(core_->CreateJob(Spec(1, 4)).ok());
  Join("good");
  for (int round = 0; round < 3; ++round) {
    auto bad = TryJoin("flaky");
    ASSERT_TRUE(bad.ok()) << "round " << round << ": " << bad.status().ToString();
    members_.push_back(*bad);
    TickWithout(milliseconds(3100), {bad->id});
  }
  EXPECT_TRUE(TryJoin("flaky").ok());
}

// The straggler score from heartbeats: three workers (two on n0, one on
// n1) whose node-0 group reports, step after step, that its second worker
// entered the step's reduce-scatters 50 ms after the first (of 150 ms
// steps). It is named within the window: health `straggler`, its score in
// GetStatus and in the stats the metrics come from; the others score 0.
// With drain_stragglers it is drained once named for a window more.
class StragglerCoreTest : public CoreTest {
 protected:
  // A job of 3 workers, a_ and b_ on n0, c_ on n1, in an active epoch 1.
  void Start(CoreOptions options, uint32_t min_workers) {
    Open(options);
    ASSERT_TRUE(core_->CreateJob(Spec(min_workers, 3)).ok());
    a_ = Join("n0");
    b_ = Join("n0");
    c_ = Join("n1");
    clock_.Advance(milliseconds(600));
    core_->Tick();
    AckAll(Latest(a_));
    ASSERT_EQ(Latest(a_).worker_count(), 3u);
  }
  // Steps [from, to]: every worker reports its step (the n0 pair naming b_).
  void Steps(uint64_t from, uint64_t to) {
    for (uint64_t step = from; step <= to; ++step) {
      clock_.Advance(milliseconds(150));
      for (const M& m : {a_, b_, c_}) {
        v1::HeartbeatRequest r;
        r.set_job_id("j");
        r.set_member_id(m.id);
        r.set_session_id(m.session);
        r.set_epoch(1);
        r.set_step(step);
        auto* w = r.add_step_waits();
        w->set_step(step);
        w->set_step_seconds(0.15);
        if (m.id != c_.id) {
          w->set_late_member_id(b_.id);
          w->set_late_seconds(0.05);
          w->set_scope("node/0");
        }
        auto reply = core_->Heartbeat(r);
        ASSERT_TRUE(reply.ok()) << reply.status().ToString();
      }
      core_->Tick();
    }
  }
  M a_, b_, c_;
};

TEST_F(StragglerCoreTest, StepWaitsNameAStragglerInStatusAndStats) {
  Start({}, 1);
  Steps(1, 6);
  EXPECT_EQ(FindStatus(Status_(), b_.id)->health(), v1::MEMBER_HEALTH_HEALTHY) << "too few steps to name anyone";
  Steps(7, 14);
  const auto status = Status_();
  const v1::MemberStatus* sb = FindStatus(status, b_.id);
  ASSERT_NE(sb, nullptr);
  EXPECT_EQ(sb->health(), v1::MEMBER_HEALTH_STRAGGLER);
  EXPECT_TRUE(sb->straggler().named());
  EXPECT_GE(sb->straggler().named_at_step(), 10u);
  EXPECT_NEAR(sb->straggler().score(), 1.0 / 3, 0.01);
  EXPECT_NEAR(sb->straggler().mean_late_seconds(), 0.05, 1e-9);
  EXPECT_EQ(sb->straggler().window_steps(), 14u);
  EXPECT_EQ(sb->straggler().late_steps(), 14u);
  for (const M& m : {a_, c_}) {
    const v1::MemberStatus* s = FindStatus(status, m.id);
    EXPECT_EQ(s->health(), v1::MEMBER_HEALTH_HEALTHY);
    EXPECT_TRUE(s->has_straggler());
    EXPECT_EQ(s->straggler().score(), 0);
    EXPECT_EQ(s->straggler().window_steps(), 14u);
  }
  const CoreStats stats = core_->TakeStats();
  ASSERT_EQ(stats.stragglers.size(), 3u);
  for (const auto& s : stats.stragglers) {
    EXPECT_EQ(s.job_id, "j");
    EXPECT_EQ(s.named, s.rank == 1) << s.rank;
    EXPECT_EQ(s.node_id, s.rank == 2 ? "n1" : "n0");
  }
  // Without drain_stragglers it stays in the job.
  Steps(15, 60);
  EXPECT_EQ(Latest(a_).worker_count(), 3u);
  EXPECT_EQ(core_->TakeStats().stragglers_drained, 0u);
}

// Without step_waits, a worker is a straggler when it stopped: more than 2
// steps behind the job and no step done for two heartbeat intervals (1 s
// each here). One merely a few steps behind in its last heartbeat, as
// workers of fast steps are, is healthy.
TEST_F(StragglerCoreTest, AWorkerThatStoppedIsAStragglerOneAFewStepsBehindIsNot) {
  Start({}, 1);
  ASSERT_TRUE(Beat(a_, 10).ok());
  ASSERT_TRUE(Beat(b_, 10).ok());
  ASSERT_TRUE(Beat(c_, 6).ok());
  EXPECT_EQ(FindStatus(Status_(), c_.id)->health(), v1::MEMBER_HEALTH_HEALTHY) << "its step changed just now";
  clock_.Advance(milliseconds(900));
  ASSERT_TRUE(Beat(a_, 20).ok());
  ASSERT_TRUE(Beat(b_, 20).ok());
  ASSERT_TRUE(Beat(c_, 16).ok());
  clock_.Advance(milliseconds(900));
  ASSERT_TRUE(Beat(a_, 30).ok());
  ASSERT_TRUE(Beat(b_, 30).ok());
  ASSERT_TRUE(Beat(c_, 16).ok());  // stopped at 16
  EXPECT_EQ(FindStatus(Status_(), c_.id)->health(), v1::MEMBER_HEALTH_HEALTHY) << "for less than two intervals";
  clock_.Advance(milliseconds(1200));
  ASSERT_TRUE(Beat(a_, 30).ok());
  ASSERT_TRUE(Beat(b_, 30).ok());
  ASSERT_TRUE(Beat(c_, 16).ok());
  EXPECT_EQ(FindStatus(Status_(), c_.id)->health(), v1::MEMBER_HEALTH_STRAGGLER);
  EXPECT_EQ(FindStatus(Status_(), a_.id)->health(), v1::MEMBER_HEALTH_HEALTHY);
}

TEST_F(StragglerCoreTest, DrainStragglersDrainsOneNamedForAWindowMore) {
  CoreOptions options;
  options.drain_stragglers = true;
  Start(options, 2);
  Steps(1, 20);
  const uint64_t named_at = FindStatus(Status_(), b_.id)->straggler().named_at_step();
  ASSERT_GT(named_at, 0u);
  Steps(21, named_at + 19);
  EXPECT_EQ(Latest(a_).worker_count(), 3u) << "named for less than a window more";
  Steps(named_at + 20, named_at + 21);
  const auto e = Latest(a_);
  EXPECT_EQ(e.worker_count(), 2u);
  EXPECT_FALSE(Ranks(e).count(b_.id));
  EXPECT_EQ(FindStatus(Status_(), b_.id)->state(), v1::MEMBER_STATE_DRAINING);
  v1::HeartbeatRequest hb;
  hb.set_job_id("j");
  hb.set_member_id(b_.id);
  hb.set_session_id(b_.session);
  EXPECT_EQ(core_->Heartbeat(hb)->command(), v1::MEMBER_COMMAND_DRAIN);
  EXPECT_EQ(core_->TakeStats().stragglers_drained, 1u);
}

TEST_F(StragglerCoreTest, DrainStragglersKeepsTheJobsMinimum) {
  CoreOptions options;
  options.drain_stragglers = true;
  Start(options, 3);
  Steps(1, 80);
  EXPECT_TRUE(FindStatus(Status_(), b_.id)->straggler().named());
  EXPECT_EQ(Latest(a_).worker_count(), 3u) << "three workers is the job's minimum";
}

}  // namespace
}  // namespace tandem::coordinator
