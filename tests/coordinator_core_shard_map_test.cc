// The coordinator core's shard map: balanced over the servers, backups
// promoted when a server dies, and rebalancing (backups moved onto a server
// that holds too little, then primaries swapped) once every backup holds its
// state.
#include <gtest/gtest.h>

#include "coordinator_core_fixture.h"

namespace tandem::coordinator::core_test {
namespace {

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
  const M back = RestartServer(s2, "s2", w);
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
  const M back = RestartServer(s1, "s1", w);
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

}  // namespace
}  // namespace tandem::coordinator::core_test
