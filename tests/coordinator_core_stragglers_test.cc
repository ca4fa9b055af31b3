// The coordinator core's straggler score, fed by heartbeats: named in status
// and stats, the "stopped" rule, and draining.
#include <gtest/gtest.h>

#include "coordinator_core_fixture.h"

namespace tandem::coordinator::core_test {
namespace {

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
}  // namespace tandem::coordinator::core_test
