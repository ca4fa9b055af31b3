// The parameter store across membership changes: pulls waiting for
// backups, steps decided as the epoch changes, shares sent again, a primary
// dying mid-step, servers joining later, and backups that diverged.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include <gtest/gtest.h>

#include "ps_core_fixture.h"

namespace tandem::server::store_test {
namespace {

TEST_F(PsCoreTest, PullWaitsForTheStepAndForTheBackup) {
  Job job;
  Start(2, job);
  auto [b, e] = Range(0);
  auto early = Pull(PrimaryOf(0), 1, 1, 0);
  EXPECT_FALSE(early->done);  // step 1 not applied yet
  cluster_.hold_replicas = true;
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [pb, pe] = Range(p);
    for (uint32_t c = 0; c < 2; ++c) ASSERT_TRUE(Push(PrimaryOf(p), 1, 1, p, c, 2, Grad(1, c, pb, pe))->status().ok());
  }
  // Applied on the primary, not yet on the backup: not acknowledged.
  EXPECT_EQ(PrimaryOf(0).Stats({0}).partitions(0).step(), 1u);
  EXPECT_FALSE(early->done);
  EXPECT_GT(PrimaryOf(0).ReplicationLag(), 0u);
  cluster_.Release();
  EXPECT_TRUE(early->done);
  EXPECT_TRUE(early->status().ok());
  EXPECT_EQ(PrimaryOf(0).ReplicationLag(), 0u);
  (void)b;
  (void)e;
}

// A membership change (a worker left) while an update is on its way to the
// backup: the old epoch's links die with it, the update or its ack is lost,
// and the same primary and backup go on in the new epoch. The primary sends
// the whole state again, so pulls of the step (which wait for the backup)
// are answered and the replicas stay equal.
TEST_F(PsCoreTest, AnUpdateLostWithTheOldEpochIsSentAgainAsTheWholeState) {
  Job job;
  Start(2, job);
  RunStep(1, 2);
  cluster_.hold_replicas = true;
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [b, e] = Range(p);
    for (uint32_t c = 0; c < 2; ++c) ASSERT_TRUE(Push(PrimaryOf(p), 1, 2, p, c, 2, Grad(2, c, b, e))->status().ok());
  }
  EXPECT_GT(PrimaryOf(0).ReplicationLag(), 0u);
  cluster_.held.clear();  // lost with the old epoch's links
  cluster_.hold_replicas = false;
  SetEpoch(2);
  auto pull = Pull(PrimaryOf(0), 2, 2, 0);
  EXPECT_TRUE(pull->done);
  EXPECT_TRUE(pull->status().ok()) << pull->status().ToString();
  EXPECT_EQ(PrimaryOf(0).ReplicationLag(), 0u);
  std::vector<float> params;
  for (uint64_t s = 3; s <= 4; ++s) params = RunStep(s, 2);
  ExpectReplicasEqual();
  const auto reference = ReferenceRun(job, 4, 2);
  ASSERT_EQ(params.size(), reference.size());
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
}

// A worker joins while step 2 is being decided: server 101 got 102's share,
// decided and applied step 2, but its own share died with the old links.
// The workers see step 2 applied on 101 and do not push it again; 102 must
// still apply it, from the same gradients.
TEST_F(PsCoreTest, AStepDecidedOnOneServerAsTheEpochChangesIsAppliedOnEvery) {
  Job job;
  Start(2, job);
  RunStep(1, 2);
  auto push_step_2 = [&](uint64_t server) {
    for (uint32_t p = 0; p < Partitions(); ++p) {
      if (map_.partitions(static_cast<int>(p)).primary_member_id() != server) continue;
      auto [b, e] = Range(p);
      for (uint32_t c = 0; c < 2; ++c) ASSERT_TRUE(Push(PrimaryOf(p), 1, 2, p, c, 2, Grad(2, c, b, e))->status().ok());
    }
  };
  push_step_2(kFirstServer + 1);  // 102 shares with 101
  cluster_.drop_shares = true;
  push_step_2(kFirstServer);  // 101 decides; its share is lost
  cluster_.drop_shares = false;
  EXPECT_EQ(cluster_[kFirstServer].Stats({0}).partitions(0).step(), 2u);
  EXPECT_EQ(cluster_[kFirstServer + 1].Stats({1}).partitions(0).step(), 1u);
  // The joiner makes the data-parallel size 3; step 2 keeps the mean over 2.
  SetEpoch(2, /*dp=*/3);
  std::vector<float> params = PullAll(2);
  ExpectReplicasEqual();
  auto reference = ReferenceRun(job, 2, 2);
  ASSERT_EQ(params.size(), reference.size());
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
  SetEpoch(3, /*dp=*/2);
  for (uint64_t s = 3; s <= 4; ++s) params = RunStep(s, 2);
  ExpectReplicasEqual();
  reference = ReferenceRun(job, 4, 2);
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
}

// Both servers shared step 2 but every share was lost: neither decided, the
// shares sent again on the new links decide it, and the workers' new pushes
// of step 2 are duplicates.
TEST_F(PsCoreTest, SharesLostWithTheOldLinksAreSentAgain) {
  Job job;
  Start(2, job);
  RunStep(1, 2);
  cluster_.drop_shares = true;
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [b, e] = Range(p);
    for (uint32_t c = 0; c < 2; ++c) ASSERT_TRUE(Push(PrimaryOf(p), 1, 2, p, c, 2, Grad(2, c, b, e))->status().ok());
  }
  cluster_.drop_shares = false;
  EXPECT_EQ(cluster_[kFirstServer].Stats({0}).partitions(0).step(), 1u);
  SetEpoch(2);
  const uint64_t duplicates_before = cluster_[kFirstServer].counters().duplicate_pushes.load();
  std::vector<float> params;
  for (uint64_t s = 2; s <= 4; ++s) params = RunStep(s, 2);
  EXPECT_GT(cluster_[kFirstServer].counters().duplicate_pushes.load(), duplicates_before);
  ExpectReplicasEqual();
  const auto reference = ReferenceRun(job, 4, 2);
  ASSERT_EQ(params.size(), reference.size());
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
}

// A step no server had finished aggregating is discarded with the old epoch
// and pushed again from scratch.
TEST_F(PsCoreTest, AStepNotYetSharedIsPushedAgainInTheNewEpoch) {
  Job job;
  Start(2, job);
  RunStep(1, 2);
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [b, e] = Range(p);
    ASSERT_TRUE(Push(PrimaryOf(p), 1, 2, p, 0, 2, Grad(2, 0, b, e))->status().ok());
  }
  SetEpoch(2);
  std::vector<float> params;
  for (uint64_t s = 2; s <= 3; ++s) params = RunStep(s, 2);
  const auto reference = ReferenceRun(job, 3, 2);
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
}

TEST_F(PsCoreTest, PrimaryDiesMidStepBackupTakesOverAndResultMatches) {
  Job job;
  Start(3, job);
  for (uint64_t s = 1; s <= 3; ++s) RunStep(s, 2);
  // Step 4: some pushes land, then server 101 dies before the step decides.
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [b, e] = Range(p);
    Push(PrimaryOf(p), 1, 4, p, 0, 2, Grad(4, 0, b, e));
  }
  const uint64_t dead = kFirstServer;
  cluster_.nodes[dead]->alive = false;
  map_ = Reassign(map_, cluster_.Live());
  SetEpoch(2);
  // The workers push step 4 again in the new epoch and go on.
  std::vector<float> params;
  for (uint64_t s = 4; s <= 8; ++s) params = RunStep(s, 2);
  const auto reference = ReferenceRun(job, 8, 2);
  ASSERT_EQ(params.size(), reference.size());
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
  // New backups got the state and stay in step.
  ExpectReplicasEqual();
}

TEST_F(PsCoreTest, ServerDiesAfterTheDecisionStepCompletesOnce) {
  Job job;
  Start(3, job);
  RunStep(1, 2);
  // Step 2 decides everywhere while replication is held, then 102 dies: its
  // backups have not applied step 2; the retry applies it there, and the
  // partitions that kept step 2 treat the new pushes as duplicates.
  cluster_.hold_replicas = true;
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [b, e] = Range(p);
    for (uint32_t c = 0; c < 2; ++c) Push(PrimaryOf(p), 1, 2, p, c, 2, Grad(2, c, b, e));
  }
  cluster_.nodes[kFirstServer + 1]->alive = false;
  cluster_.Release();  // replicas to live backups complete; those to 102 fail
  map_ = Reassign(map_, cluster_.Live());
  SetEpoch(2);
  std::vector<float> params;
  for (uint64_t s = 2; s <= 5; ++s) params = RunStep(s, 2);
  const auto reference = ReferenceRun(job, 5, 2);
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
  ExpectReplicasEqual();
}

// A learning rate per step through failures. Step 2 is decided everywhere
// while replication is held, then a server dies: its promoted backups have
// not applied the step and apply it from the pushes sent again, which carry
// the step's rate (the partitions that applied it count them as
// duplicates). The result equals a failure-free run with the same rates, bit
// for bit, and every backup equals its primary.
TEST_F(PsCoreTest, AStepPushedAgainAfterAFailureAppliesItsLearningRate) {
  Job job;
  Start(3, job);
  RunStep(1, 2, {}, LambdaLr(1));
  cluster_.hold_replicas = true;
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [b, e] = Range(p);
    for (uint32_t c = 0; c < 2; ++c) {
      Push(PrimaryOf(p), 1, 2, p, c, 2, Grad(2, c, b, e), v1::WIRE_DTYPE_FP32, LambdaLr(2));
    }
  }
  cluster_.nodes[kFirstServer + 1]->alive = false;
  cluster_.Release();
  map_ = Reassign(map_, cluster_.Live());
  SetEpoch(2);
  std::vector<float> params;
  for (uint64_t s = 2; s <= 8; ++s) params = RunStep(s, 2, {}, LambdaLr(s));
  const auto reference = ReferenceRun(job, 8, 2, LambdaLr);
  ASSERT_EQ(params.size(), reference.size());
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
  ExpectReplicasEqual();
  // The rates mattered: the schedule's alone gives other parameters.
  EXPECT_NE(std::memcmp(params.data(), ReferenceRun(job, 8, 2).data(), params.size() * sizeof(float)), 0);
}

// A step decided on one server as the epoch changes is applied on the
// others from the aggregation they kept, with the rate its pushes carried.
TEST_F(PsCoreTest, AStepDecidedFromKeptPushesAppliesTheirLearningRate) {
  Job job;
  Start(2, job);
  RunStep(1, 2, {}, LambdaLr(1));
  auto push_step_2 = [&](uint64_t server) {
    for (uint32_t p = 0; p < Partitions(); ++p) {
      if (map_.partitions(static_cast<int>(p)).primary_member_id() != server) continue;
      auto [b, e] = Range(p);
      for (uint32_t c = 0; c < 2; ++c) {
        ASSERT_TRUE(
            Push(PrimaryOf(p), 1, 2, p, c, 2, Grad(2, c, b, e), v1::WIRE_DTYPE_FP32, LambdaLr(2))->status().ok());
      }
    }
  };
  push_step_2(kFirstServer + 1);  // 102 shares with 101
  cluster_.drop_shares = true;
  push_step_2(kFirstServer);  // 101 decides; its share is lost
  cluster_.drop_shares = false;
  EXPECT_EQ(cluster_[kFirstServer + 1].Stats({1}).partitions(0).step(), 1u);
  SetEpoch(2, /*dp=*/3);
  std::vector<float> params = PullAll(2);
  ExpectReplicasEqual();
  SetEpoch(3, /*dp=*/2);
  for (uint64_t s = 3; s <= 4; ++s) params = RunStep(s, 2, {}, LambdaLr(s));
  ExpectReplicasEqual();
  const auto reference = ReferenceRun(job, 4, 2, LambdaLr);
  ASSERT_EQ(params.size(), reference.size());
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
}

TEST_F(PsCoreTest, AServerThatJoinsLaterGetsTheJobAndTheStateOfItsBackups) {
  Job job;
  Start(3, job);
  for (uint64_t s = 1; s <= 3; ++s) RunStep(s, 2);
  // Server 104 was never initialised; the new map makes it the backup of
  // every third partition.
  const uint64_t joined = kFirstServer + 3;
  cluster_.Add(joined);
  map_.set_version(map_.version() + 1);
  for (auto& p : *map_.mutable_partitions()) {
    if (p.id() % 3 == 0) p.set_backup_member_id(joined);
  }
  SetEpoch(2);
  EXPECT_TRUE(cluster_[joined].configured());
  auto stats = cluster_[joined].Stats({});
  ASSERT_GT(stats.partitions_size(), 0);
  for (const auto& p : stats.partitions()) {
    EXPECT_EQ(p.role(), v1::REPLICA_ROLE_BACKUP);
    EXPECT_EQ(p.step(), 3u);     // the transferred state
    EXPECT_EQ(p.version(), 4u);  // three updates
  }
  std::vector<float> params;
  for (uint64_t s = 4; s <= 6; ++s) params = RunStep(s, 2);
  ExpectReplicasEqual();
  const auto reference = ReferenceRun(job, 6, 2);
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
  // Its state came by transfer: it was never initialised.
  EXPECT_GT(cluster_[joined].counters().transfers_received.load(), 0u);
}

TEST_F(PsCoreTest, ABackupThatDivergedIsSentTheWholeStateAgain) {
  Job job;
  Start(3, job);
  RunStep(1, 2);
  RunStep(2, 2);
  // Partition 0's backup loses its state (as if restored from something
  // else): the next update does not follow its version.
  auto [b, e] = Range(0);
  PartitionState stale;
  stale.id = 0;
  stale.begin = b;
  stale.end = e;
  stale.version = 1;
  stale.step = 0;
  stale.weights.assign(e - b, 0.0f);
  ASSERT_TRUE(BackupOf(0)->Replace({stale}, false).ok());
  const uint64_t sent = PrimaryOf(0).counters().transfers_sent.load();
  std::vector<float> params;
  for (uint64_t s = 3; s <= 4; ++s) params = RunStep(s, 2);
  EXPECT_GT(PrimaryOf(0).counters().transfers_sent.load(), sent);
  ExpectReplicasEqual();
  const auto reference = ReferenceRun(job, 4, 2);
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
}

// A server dies and comes back: the survivor holds every primary and the
// returned server every backup. Once the backups hold the state
// (ReplicatedEpoch), a rebalance epoch swaps primary and backup of half the
// partitions while an update the old primaries applied never reached their
// backups: the workers push that step again, every update is applied exactly
// once, and the result equals a failure-free run bit for bit.
TEST_F(PsCoreTest, APrimarySwappedWithItsInSyncBackupKeepsEveryUpdateOnce) {
  Job job;
  Start(2, job);
  const uint64_t a = kFirstServer;
  const uint64_t b = kFirstServer + 1;
  RunStep(1, 2);
  EXPECT_EQ(cluster_[a].ReplicatedEpoch(), 1u);
  EXPECT_EQ(cluster_[b].ReplicatedEpoch(), 1u);
  cluster_.nodes[b]->alive = false;
  map_ = Reassign(map_, cluster_.Live());
  SetEpoch(2);
  EXPECT_EQ(cluster_[a].ReplicatedEpoch(), 0u);  // no backups
  RunStep(2, 2);
  RunStep(3, 2);

  // b comes back empty and backs up everything; a sends it the state.
  cluster_.Add(b);
  map_.set_version(map_.version() + 1);
  for (auto& p : *map_.mutable_partitions()) {
    ASSERT_EQ(p.primary_member_id(), a);
    p.set_backup_member_id(b);
  }
  cluster_.hold_replicas = true;
  SetEpoch(3);
  EXPECT_EQ(cluster_[a].ReplicatedEpoch(), 0u);  // transfers in flight
  EXPECT_EQ(cluster_[b].ReplicatedEpoch(), 3u);  // primary of nothing
  cluster_.Release();
  EXPECT_EQ(cluster_[a].ReplicatedEpoch(), 3u);
  RunStep(4, 2);

  // Step 5 is applied on a, its updates to b held; then the rebalance.
  cluster_.hold_replicas = true;
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [begin, end] = Range(p);
    for (uint32_t c = 0; c < 2; ++c) {
      ASSERT_TRUE(AnsweredOk(Push(PrimaryOf(p), 3, 5, p, c, 2, Grad(5, c, begin, end))));
    }
  }
  map_.set_version(map_.version() + 1);
  for (auto& p : *map_.mutable_partitions()) {
    if (p.id() % 2 == 0) {
      p.set_primary_member_id(b);
      p.set_backup_member_id(a);
    }
  }
  // The updates die with the old epoch's links.
  cluster_.nodes[b]->alive = false;
  cluster_.Release();
  cluster_.nodes[b]->alive = true;
  SetEpoch(4);
  std::vector<float> params;
  for (uint64_t s = 5; s <= 7; ++s) params = RunStep(s, 2);
  const auto reference = ReferenceRun(job, 7, 2);
  ASSERT_EQ(params.size(), reference.size());
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
  ExpectReplicasEqual();
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto stats = PrimaryOf(p).Stats({p});
    ASSERT_EQ(stats.partitions_size(), 1);
    EXPECT_EQ(stats.partitions(0).step(), 7u) << "partition " << p;
  }
  EXPECT_EQ(cluster_[a].ReplicatedEpoch(), 4u);
  EXPECT_EQ(cluster_[b].ReplicatedEpoch(), 4u);

  // The same placement in a new epoch: the backups still hold the state.
  SetEpoch(5);
  EXPECT_EQ(cluster_[a].ReplicatedEpoch(), 5u);
  EXPECT_EQ(cluster_[b].ReplicatedEpoch(), 5u);
  // A restore changes a primary's state behind its backup's back.
  auto [begin, end] = Range(1);
  PartitionState restored;
  restored.id = 1;
  restored.begin = begin;
  restored.end = end;
  restored.version = 9;
  restored.step = 7;
  restored.weights.assign(end - begin, 0.5f);
  ASSERT_TRUE(PrimaryOf(1).Replace({restored}, false).ok());
  EXPECT_EQ(PrimaryOf(1).ReplicatedEpoch(), 0u);
}

// A pull or push checked against the server's epoch just before it moved
// to the next is refused there, never parked for a step no one will push in
// that epoch again: pulls and pushes of the old epoch race SetEpoch.
TEST_F(PsCoreTest, FramesRacingAnEpochChangeAreAnsweredNeverParked) {
  Job job;
  Start(2, job);
  RunStep(1, 2);
  ParameterStore& store = PrimaryOf(0);
  auto [begin, end] = Range(0);
  const auto grad = Grad(2, 0, begin, end);
  for (int i = 0; i < 300 && !HasFailure(); ++i) {
    const uint64_t e = epoch_;
    std::shared_ptr<Answer> pulled, pushed;
    // Step 2 is never complete: a pull parked in epoch e waits for it.
    std::thread puller([&] { pulled = Pull(store, e, 2, 0); });
    std::thread pusher([&] { pushed = Push(store, e, 2, 0, 0, 2, grad); });
    SetEpoch(e + 1);
    puller.join();
    pusher.join();
    ASSERT_TRUE(pulled->done) << "a pull of epoch " << e << " was parked past the change (iteration " << i << ")";
    const StatusCode code = pulled->status().code();
    EXPECT_TRUE(code == StatusCode::kAborted || code == StatusCode::kFailedPrecondition) << pulled->status().ToString();
    // The push either counted in epoch e (and its aggregation dies with it)
    // or was refused; it never counts in epoch e + 1.
    ASSERT_TRUE(pushed->done);
  }
  // Epoch e + 1 aggregates step 2 from its own pushes only.
  RunStep(2, 2);
  const auto reference = ReferenceRun(job, 2, 2);
  const auto params = PullAll(2);
  ASSERT_EQ(params.size(), reference.size());
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
}

// A step decided and applied on two servers but not on a third that died
// with it undecided: its partitions' promoted backups need the step again,
// and the workers push it again in the next epoch. A partition that applied
// it where it was then a backup (its roles swapped in that epoch) shares
// the decision it was replicated with, so the retried step is decided on
// every server and ends where a failure-free run does.
TEST_F(PsCoreTest, AStepRetriedAfterARoleSwapIsDecidedFromTheDecisionItWasReplicatedWith) {
  Job job;
  Start(3, job);
  RunStep(1, 2);
  const uint64_t a = kFirstServer, b = kFirstServer + 1, c = kFirstServer + 2;
  ASSERT_GE(Partitions(), 4u);
  ASSERT_EQ(map_.partitions(3).primary_member_id(), a);
  ASSERT_EQ(map_.partitions(3).backup_member_id(), b);
  // c hears no one's share of step 2: a and b decide it and apply it, c
  // never does, and then dies.
  cluster_.nodes[c]->alive = false;
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [begin, end] = Range(p);
    for (uint32_t k = 0; k < 2; ++k) {
      ASSERT_TRUE(AnsweredOk(Push(PrimaryOf(p), epoch_, 2, p, k, 2, Grad(2, k, begin, end))));
    }
  }
  ASSERT_EQ(PrimaryOf(3).Stats({3}).partitions(0).step(), 2u);
  map_ = Reassign(map_, {a, b});
  // And partition 3's backup, which applied step 2 by replica, becomes its primary.
  map_.mutable_partitions(3)->set_primary_member_id(b);
  map_.mutable_partitions(3)->set_backup_member_id(a);
  SetEpoch(2);
  const auto params = RunStep(2, 2);
  const auto reference = ReferenceRun(job, 2, 2);
  ASSERT_EQ(params.size(), reference.size());
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
  ExpectReplicasEqual();
}

}  // namespace
}  // namespace tandem::server::store_test
