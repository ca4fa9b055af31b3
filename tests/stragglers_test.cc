// The coordinator's straggler score (coordinator/stragglers.h): how steps
// are charged from the servers' and the workers' reports, the score, and
// the hysteresis of naming and clearing, with seeded noise.
#include "coordinator/stragglers.h"

#include <map>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace tandem::coordinator {
namespace {

// A job of `nodes` x `per_node` workers (member ids 1.., global rank id - 1)
// and two servers (ids 100, 101).
struct Job {
  int nodes = 2;
  int per_node = 2;
  StragglerTracker tracker;

  std::string Node(uint64_t id) const { return "node-" + std::to_string((id - 1) / per_node); }
  StragglerTracker::Resolve Resolve() const {
    return [this](uint64_t id) -> std::optional<StragglerIdentity> {
      if (id >= 100) return StragglerIdentity{-1, "node-s", ""};
      if (id == 0 || id > static_cast<uint64_t>(nodes * per_node)) return std::nullopt;
      return StragglerIdentity{static_cast<int>(id - 1), Node(id), "worker-" + std::to_string(id - 1)};
    };
  }
  static v1::StepWait Wait(uint64_t step, uint64_t late, double seconds, const std::string& scope,
                           double step_seconds) {
    v1::StepWait w;
    w.set_step(step);
    w.set_late_member_id(late);
    w.set_late_seconds(seconds);
    w.set_scope(scope);
    w.set_step_seconds(step_seconds);
    return w;
  }
  // One hybrid step as the members report it: every node's workers report
  // the last of them to enter the node's reduce-scatters (node_late, by
  // node_seconds), and each server the pusher that came last (a worker of
  // the late node) by server_seconds.
  void HybridStep(uint64_t step, double step_seconds, const std::vector<std::pair<uint64_t, double>>& node_late,
                  uint64_t late_node, double server_seconds) {
    for (int n = 0; n < nodes; ++n) {
      for (int w = 0; w < per_node; ++w) {
        const uint64_t id = static_cast<uint64_t>(n * per_node + w + 1);
        const auto& [late, seconds] = node_late[static_cast<size_t>(n)];
        // A group of one reports only its step time.
        tracker.Add(Node(id), per_node > 1 ? Wait(step, late, seconds, "node/" + std::to_string(n), step_seconds)
                                           : Wait(step, 0, 0, "", step_seconds));
      }
    }
    // The pusher of a partition: one of the late node's workers.
    const uint64_t pusher = late_node * static_cast<uint64_t>(per_node) + 1 + step % per_node;
    tracker.Add("node-s", Wait(step, pusher, server_seconds, "server", 0));
    tracker.Add("node-s", Wait(step, pusher, server_seconds * 0.9, "server", 0));
  }
  std::vector<StragglerChange> Evaluate(uint64_t step) { return tracker.Evaluate(Resolve(), step); }
};

TEST(StragglersTest, AServerReportChargesTheWorkerThatHeldItsNodeUp) {
  Job job;
  // Node 1 came 30 ms after node 0; inside node 1, worker 4 (rank 3) entered
  // 40 ms after worker 3. The step is charged to rank 3 by the smaller delay.
  job.HybridStep(1, 0.1, {{1, 0.002}, {4, 0.040}}, 1, 0.030);
  job.Evaluate(1);
  auto st = job.tracker.Status(4);
  ASSERT_TRUE(st.has_value());
  EXPECT_NEAR(st->score(), 0.3, 1e-9);
  EXPECT_EQ(st->late_steps(), 1u);
  EXPECT_EQ(st->window_steps(), 1u);
  EXPECT_NEAR(st->mean_late_seconds(), 0.030, 1e-9);
  EXPECT_FALSE(job.tracker.Status(1).has_value()) << "node 0 did not hold the step up";
}

TEST(StragglersTest, WithoutGroupReportsTheLatePusherIsCharged) {
  // One worker per node (ps mode or hybrid with a worker a node): the server's late pusher.
  Job job;
  job.per_node = 1;
  job.tracker.Add("node-0", Job::Wait(1, 0, 0, "", 0.2));
  job.tracker.Add("node-1", Job::Wait(1, 0, 0, "", 0.2));
  job.tracker.Add("node-s", Job::Wait(1, 2, 0.05, "server", 0));
  job.Evaluate(1);
  ASSERT_TRUE(job.tracker.Status(2).has_value());
  EXPECT_NEAR(job.tracker.Status(2)->score(), 0.25, 1e-9);
}

TEST(StragglersTest, WithoutServersTheLargestGroupReportIsCharged) {
  // Allreduce mode: the dp group's reports (a transport ring: only the late
  // rank's neighbours name it, the others report less).
  Job job;
  job.tracker.Add("node-0", Job::Wait(1, 3, 0.001, "world", 0.1));
  job.tracker.Add("node-0", Job::Wait(1, 3, 0.050, "world", 0.1));
  job.tracker.Add("node-1", Job::Wait(1, 2, 0.002, "world", 0.1));
  job.tracker.Add("node-1", Job::Wait(1, 3, 0.049, "world", 0.1));
  job.Evaluate(1);
  ASSERT_TRUE(job.tracker.Status(3).has_value());
  EXPECT_NEAR(job.tracker.Status(3)->score(), 0.5, 1e-9);
  EXPECT_FALSE(job.tracker.Status(2).has_value());
}

TEST(StragglersTest, WithServersAStepCountsOnceTheirReportIsIn) {
  Job job;
  job.HybridStep(1, 0.1, {{1, 0.001}, {4, 0.001}}, 0, 0.001);
  // Step 2: the workers' reports are in, the servers' not yet.
  for (uint64_t id = 1; id <= 2; ++id) job.tracker.Add(job.Node(id), Job::Wait(2, 1, 0.001, "node/0", 0.1));
  for (uint64_t id = 3; id <= 4; ++id) job.tracker.Add(job.Node(id), Job::Wait(2, 4, 0.05, "node/1", 0.1));
  job.Evaluate(2);
  EXPECT_EQ(job.tracker.window_steps(), 1u);
  job.tracker.Add("node-s", Job::Wait(2, 3, 0.05, "server", 0));
  job.Evaluate(2);
  EXPECT_EQ(job.tracker.window_steps(), 2u);
  ASSERT_TRUE(job.tracker.Status(4).has_value());
  EXPECT_EQ(job.tracker.Status(4)->late_steps(), 1u);
}

// A job with one worker 1.5 times slower than the others from step `from`:
// it enters its node's reduce-scatter a third of a step late (~50 ms of a
// 150 ms step), plus noise for everyone. Returns the step at which it was
// named (0: never) and every change.
struct SimulatedRun {
  uint64_t named_at = 0;
  std::vector<StragglerChange> changes;
};
SimulatedRun Simulate(Job& job, uint64_t steps, uint64_t from, uint64_t slow, uint64_t seed, double noise) {
  std::mt19937_64 random(seed);
  std::exponential_distribution<double> jitter(1.0 / noise);  // mean `noise` seconds
  std::uniform_int_distribution<int> pick(0, job.per_node - 1);
  std::uniform_int_distribution<int> pick_node(0, job.nodes - 1);
  SimulatedRun run;
  for (uint64_t step = 1; step <= steps; ++step) {
    const bool slowed = slow != 0 && step >= from;
    const double delay = slowed ? 0.050 : 0.0;
    const double step_seconds = 0.1 + delay + jitter(random);
    std::vector<std::pair<uint64_t, double>> node_late;
    for (int n = 0; n < job.nodes; ++n) {
      uint64_t late = static_cast<uint64_t>(n * job.per_node + pick(random) + 1);
      double seconds = jitter(random);
      if (slowed && job.Node(slow) == "node-" + std::to_string(n)) {
        late = slow;
        seconds += delay;
      }
      node_late.emplace_back(late, seconds);
    }
    uint64_t late_node = static_cast<uint64_t>(pick_node(random));
    double server_seconds = jitter(random);
    if (slowed) {
      late_node = (slow - 1) / static_cast<uint64_t>(job.per_node);
      server_seconds += delay;
    }
    job.HybridStep(step, step_seconds, node_late, late_node, server_seconds);
    for (auto& c : job.Evaluate(step)) {
      if (c.named && run.named_at == 0) run.named_at = step;
      run.changes.push_back(std::move(c));
    }
  }
  return run;
}

TEST(StragglersTest, AWorkerOneAndAHalfTimesSlowerIsNamedWithinTwentySteps) {
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    Job job;
    const SimulatedRun run = Simulate(job, 80, 30, /*slow=*/3, seed, /*noise=*/0.01);
    ASSERT_FALSE(run.changes.empty()) << "seed " << seed;
    const StragglerChange& first = run.changes.front();
    EXPECT_TRUE(first.named);
    EXPECT_EQ(first.member_id, 3u) << "seed " << seed;
    EXPECT_EQ(first.who.rank, 2);
    EXPECT_EQ(first.who.node_id, "node-1");
    EXPECT_GE(run.named_at, 30u) << "seed " << seed;
    EXPECT_LT(run.named_at, 30u + 20) << "seed " << seed;
    EXPECT_EQ(run.changes.size(), 1u) << "named once, and it stays named while it is slow (seed " << seed << ")";
    const auto st = job.tracker.Status(3);
    ASSERT_TRUE(st.has_value());
    EXPECT_TRUE(st->named());
    EXPECT_EQ(st->named_at_step(), run.named_at);
    // Late by 50 ms of steps of about 155 ms: a third of the time.
    EXPECT_GT(st->score(), 0.25);
    EXPECT_LT(st->score(), 0.4);
    EXPECT_NEAR(st->mean_late_seconds(), 0.055, 0.01);
  }
}

TEST(StragglersTest, NoOneIsNamedInNoisyRunsWithoutAStraggler) {
  // Noise as on a loaded two-core machine: each step someone comes last,
  // on average by 20% of the step, sometimes by far more.
  for (int nodes : {1, 2}) {
    for (int per_node : {1, 2, 4}) {
      if (nodes * per_node < 2) continue;
      for (uint64_t seed = 1; seed <= 25; ++seed) {
        Job job;
        job.nodes = nodes;
        job.per_node = per_node;
        const SimulatedRun run = Simulate(job, 300, 0, /*slow=*/0, seed, /*noise=*/0.02);
        EXPECT_TRUE(run.changes.empty()) << nodes << " x " << per_node << ", seed " << seed << ": member "
                                         << run.changes.front().member_id << " named at step " << run.named_at;
      }
    }
  }
}

TEST(StragglersTest, AStragglerThatRecoversIsClearedAfterItsLateStepsFallBelowTheClearingShare) {
  Job job;
  std::mt19937_64 random(7);
  std::uniform_real_distribution<double> small(0, 0.003);
  uint64_t named = 0, cleared = 0;
  for (uint64_t step = 1; step <= 80; ++step) {
    const bool slow = step <= 40;
    job.HybridStep(step, slow ? 0.15 : 0.1, {{1, small(random)}, {slow ? 4u : 3u, slow ? 0.05 : small(random)}},
                   slow ? 1 : step % 2, slow ? 0.05 : small(random));
    for (const auto& c : job.Evaluate(step)) (c.named ? named : cleared) = step;
  }
  EXPECT_GT(named, 0u);
  EXPECT_GT(cleared, 40u);
  // Cleared once fewer than 40% of the last 20 steps were late: 13 steps after the last slow one.
  EXPECT_EQ(cleared, 40u + 13);
  // Not charged any more: no status (a score of 0), or one not named.
  const auto st = job.tracker.Status(4);
  EXPECT_TRUE(!st.has_value() || !st->named());
}

TEST(StragglersTest, ItStaysNamedThroughAFewFastSteps) {
  // Hysteresis: named at 75% of the window, cleared below 40%.
  Job job;
  uint64_t changes = 0;
  for (uint64_t step = 1; step <= 60; ++step) {
    const bool slow = step % 3 != 0;  // two slow steps in three: 67%, below the naming bar
    job.HybridStep(step, 0.15, {{1, 0.001}, {slow ? 4u : 3u, slow ? 0.05 : 0.001}}, 1, slow ? 0.05 : 0.001);
    changes += job.Evaluate(step).size();
  }
  EXPECT_EQ(changes, 0u) << "67% is not enough to be named";
  for (uint64_t step = 61; step <= 90; ++step) {
    job.HybridStep(step, 0.15, {{1, 0.001}, {4, 0.05}}, 1, 0.05);
    changes += job.Evaluate(step).size();
  }
  EXPECT_EQ(changes, 1u);
  for (uint64_t step = 91; step <= 150; ++step) {
    const bool slow = step % 3 != 0;
    job.HybridStep(step, 0.15, {{1, 0.001}, {slow ? 4u : 3u, slow ? 0.05 : 0.001}}, 1, slow ? 0.05 : 0.001);
    changes += job.Evaluate(step).size();
  }
  EXPECT_EQ(changes, 1u) << "67% is enough to stay named";
  ASSERT_TRUE(job.tracker.Status(4).has_value());
  EXPECT_TRUE(job.tracker.Status(4)->named());
}

TEST(StragglersTest, AWorkerThatLeftIsNeitherScoredNorNamed) {
  Job job;
  for (uint64_t step = 1; step <= 20; ++step) job.HybridStep(step, 0.15, {{1, 0.001}, {4, 0.05}}, 1, 0.05);
  ASSERT_EQ(job.Evaluate(20).size(), 1u);
  job.per_node = 1;  // members 3 and 4 are gone from the epoch (Resolve knows ids 1 and 2)
  EXPECT_TRUE(job.Evaluate(20).empty()) << "a worker that left is dropped, not cleared";
  EXPECT_FALSE(job.tracker.Status(4).has_value());
}

TEST(StragglersTest, ARollbackForgetsTheStepsAboveIt) {
  Job job;
  for (uint64_t step = 1; step <= 80; ++step) job.HybridStep(step, 0.15, {{1, 0.001}, {4, 0.05}}, 1, 0.05);
  ASSERT_EQ(job.Evaluate(80).size(), 1u);
  // Back to step 10 (a checkpoint): the steps above it are trained again, by a fast rank 3.
  for (uint64_t step = 11; step <= 40; ++step) job.HybridStep(step, 0.1, {{1, 0.001}, {3, 0.002}}, 1, 0.001);
  const auto changes = job.Evaluate(40);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_FALSE(changes[0].named);
  EXPECT_EQ(job.tracker.window_steps(), 20u);
}

}  // namespace
}  // namespace tandem::coordinator
