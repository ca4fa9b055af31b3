// The coordinator's state machine with a fake clock and an in-memory store:
// rendezvous, epochs and acknowledgements, liveness, elastic joins and leaves,
// host hold-out, validation, incarnations, and recovery after a restart. The
// shard map and rebalancing are in coordinator_core_shard_map_test.cc, the
// straggler score in coordinator_core_stragglers_test.cc.
#include "coordinator/coordinator_core.h"

#include <tuple>

#include <google/protobuf/util/time_util.h>
#include <gtest/gtest.h>

#include "common/member_session.h"
#include "coordinator_core_fixture.h"
#include "tandem/config.h"

namespace tandem::coordinator::core_test {
namespace {

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

}  // namespace
}  // namespace tandem::coordinator::core_test
