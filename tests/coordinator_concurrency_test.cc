// The coordinator's state machine and its file store under many threads at
// once: registrations, heartbeats, acknowledgements, watchers and the timer
// all race, as they do behind the gRPC service. Runs under ThreadSanitizer in
// `make test-tsan` (label "concurrency"); no gRPC is involved, so every
// report would be about Tandem's own code.
#include <atomic>
#include <thread>

#include <gtest/gtest.h>

#include "coordinator/coordinator_core.h"
#include "test_util.h"

namespace tandem::coordinator {
namespace {

using std::chrono::milliseconds;

TEST(CoordinatorConcurrencyTest, MembersTimersAndWatchersRaceWithoutLosingAnything) {
  testing::TempDir dir;
  auto store = FileStore::Open(dir.path() + "/state");
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  CoreOptions options;
  options.snapshot_every_records = 200;  // snapshots while everything else runs
  CoordinatorCore core(options, store->get(), SystemClock::Get());
  ASSERT_TRUE(core.Recover().ok());
  std::atomic<int> notifications{0};
  core.SetChangeListener([&](bool) { ++notifications; });
  v1::JobSpec spec;
  spec.set_job_id("j");
  constexpr int kMembers = 64;
  spec.set_min_workers(kMembers);
  spec.set_max_workers(kMembers);
  ASSERT_TRUE(core.CreateJob(spec).ok());

  std::atomic<bool> stop{false};
  std::thread ticker([&] {
    while (!stop) {
      core.Tick();
      std::this_thread::sleep_for(milliseconds(2));
    }
  });
  std::vector<std::thread> members;
  std::atomic<int> active{0};
  for (int t = 0; t < 8; ++t) {
    members.emplace_back([&, t] {
      struct Sim {
        v1::WatchMembershipRequest watch;
        WatchPosition pos;
        bool acked = false;
        bool active = false;
      };
      std::vector<Sim> mine;
      for (int i = t; i < kMembers; i += 8) {
        v1::RegisterRequest r;
        r.set_job_id("j");
        r.set_role(v1::ROLE_WORKER);
        r.mutable_node()->set_hostname("h");
        r.mutable_node()->set_node_id("n" + std::to_string(i / 4));
        auto reg = core.Register(r);
        ASSERT_TRUE(reg.ok()) << reg.status().ToString();
        ASSERT_TRUE((*store)->WaitDurable(reg->durable_after).ok());
        Sim sim;
        sim.watch.set_job_id("j");
        sim.watch.set_member_id(reg->response.member_id());
        sim.watch.set_session_id(reg->response.session_id());
        ASSERT_TRUE(core.AttachStream(sim.watch).ok());
        mine.push_back(std::move(sim));
      }
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      size_t done = 0;
      while (done < mine.size() && std::chrono::steady_clock::now() < deadline) {
        for (auto& sim : mine) {
          if (sim.active) continue;
          v1::HeartbeatRequest hb;
          hb.set_job_id("j");
          hb.set_member_id(sim.watch.member_id());
          hb.set_session_id(sim.watch.session_id());
          hb.set_epoch(sim.pos.epoch);
          ASSERT_TRUE(core.Heartbeat(hb).ok());
          auto update = core.NextUpdate(sim.watch, sim.pos);
          ASSERT_TRUE(update.ok()) << update.status().ToString();
          if (sim.pos.epoch > 0 && !sim.acked) {
            v1::AckEpochRequest ack;
            ack.set_job_id("j");
            ack.set_member_id(sim.watch.member_id());
            ack.set_session_id(sim.watch.session_id());
            ack.set_epoch(sim.pos.epoch);
            auto acked = core.AckEpoch(ack);
            ASSERT_TRUE(acked.ok()) << acked.status().ToString();
            ASSERT_TRUE((*store)->WaitDurable(acked->durable_after).ok());
            sim.acked = true;
          }
          if (sim.pos.state == v1::EPOCH_STATE_ACTIVE) {
            sim.active = true;
            ++done;
            ++active;
          }
        }
        std::this_thread::sleep_for(milliseconds(1));
      }
    });
  }
  for (auto& m : members) m.join();
  stop = true;
  ticker.join();
  EXPECT_EQ(active, kMembers);
  EXPECT_GT(notifications, 0);
  v1::GetStatusRequest status;
  status.set_job_id("j");
  auto s = core.GetStatus(status);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->active_epoch(), 1u);
  EXPECT_EQ(s->members_size(), kMembers);
}

}  // namespace
}  // namespace tandem::coordinator
