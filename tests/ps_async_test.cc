// The parameter store's asynchronous and bounded-staleness modes, and a new
// epoch's effect on waiting pulls and old pushes.
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

#include <gtest/gtest.h>

#include "ps_core_fixture.h"

namespace tandem::server::store_test {
namespace {

TEST_F(PsCoreTest, AsyncAppliesEachPushAndIgnoresDuplicates) {
  Job job;
  job.consistency.set_mode(v1::CONSISTENCY_MODE_ASYNC);
  Start(2, job);
  auto [b, e] = Range(0);
  auto a = Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e));
  ASSERT_TRUE(a->done);
  ASSERT_TRUE(a->status().ok());
  EXPECT_EQ(PrimaryOf(0).Stats({0}).partitions(0).version(), 2u);
  auto dup = Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e));
  EXPECT_NE(dup->header.flags & ps::kFlagDuplicate, 0);
  EXPECT_EQ(PrimaryOf(0).Stats({0}).partitions(0).version(), 2u);
  // Contributor 0 runs ahead while contributor 1 has pushed nothing.
  ASSERT_TRUE(Push(PrimaryOf(0), 1, 2, 0, 0, 2, Grad(2, 0, b, e))->status().ok());
  EXPECT_EQ(PrimaryOf(0).Stats({0}).partitions(0).version(), 3u);
  auto pulled = Pull(PrimaryOf(0), 1, 0, 0);
  EXPECT_TRUE(pulled->done);
  ExpectReplicasEqual();
  // Clipping needs whole steps.
  Job clip;
  clip.consistency.set_mode(v1::CONSISTENCY_MODE_ASYNC);
  clip.optimizer.set_max_grad_norm(1.0);
  Cluster other;
  other.Add(kFirstServer);
  other[kFirstServer].SetEpoch(1, kFirstServer, MakeMap(clip.params, clip.partition, {kFirstServer}), 1, 0);
  auto refused = other[kFirstServer].Initialize(clip.Init(1));
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("max_grad_norm"), std::string::npos);
}

// Asynchronous mode: a push or pull naming another contributor count and a
// non-finite push refused by the FAIL policy leave the partition as it was:
// weights, version, and every contributor's clock (so duplicates stay
// duplicates and a refused step can be pushed again).
TEST_F(PsCoreTest, AsyncBadPushesLeaveWeightsAndClocksAsTheyWere) {
  Job job;
  job.consistency.set_mode(v1::CONSISTENCY_MODE_ASYNC);
  job.optimizer.set_non_finite_policy(v1::NON_FINITE_POLICY_FAIL);
  Start(2, job);
  auto [b, e] = Range(0);
  // A refused first push (non-finite, naming 3 contributors) fixes nothing:
  // the epoch's pushes with 2 contributors are taken.
  auto first = Grad(1, 0, b, e);
  first[0] = NAN;
  EXPECT_EQ(Push(PrimaryOf(0), 1, 1, 0, 0, 3, first)->status().code(), StatusCode::kInvalidArgument);
  auto version = [&] { return PrimaryOf(0).Stats({0}).partitions(0).version(); };
  auto weights = [&] {
    auto a = Pull(PrimaryOf(0), 1, 0, 0);
    EXPECT_TRUE(a->done);
    return a->floats();
  };
  ASSERT_TRUE(Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e))->status().ok());
  ASSERT_EQ(version(), 2u);
  const auto before = weights();
  // Another contributor count: refused, named.
  auto other_count = Push(PrimaryOf(0), 1, 2, 0, 0, 3, Grad(2, 0, b, e));
  EXPECT_EQ(other_count->status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(other_count->status().message().find("contributors: this push says 3"), std::string::npos)
      << other_count->status().message();
  auto other_pull = Pull(PrimaryOf(0), 1, 0, 0, 0, 3);
  ASSERT_TRUE(other_pull->done);
  EXPECT_EQ(other_pull->status().code(), StatusCode::kInvalidArgument);
  // The clocks were not restarted: step 1 of contributor 0 is still a duplicate.
  auto dup = Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e));
  ASSERT_TRUE(dup->status().ok());
  EXPECT_NE(dup->header.flags & ps::kFlagDuplicate, 0);
  // Contributor 1 (nothing pushed yet) sends a non-finite step 2: refused.
  auto g = Grad(2, 1, b, e);
  g[3] = NAN;
  auto bad = Push(PrimaryOf(0), 1, 2, 0, 1, 2, g);
  EXPECT_EQ(bad->status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(version(), 2u);
  EXPECT_EQ(weights(), before);
  // Its clock is where it was (0), so its step 1 is applied, not a duplicate.
  auto late = Push(PrimaryOf(0), 1, 1, 0, 1, 2, Grad(1, 1, b, e));
  ASSERT_TRUE(late->status().ok());
  EXPECT_EQ(late->header.flags & ps::kFlagDuplicate, 0);
  EXPECT_EQ(version(), 3u);
  EXPECT_NE(weights(), before);
  ExpectReplicasEqual();
}

// Asynchronous mode applies each push on arrival with the learning rate it
// carries (0: the schedule's at the partition's update count), whatever the
// other pushes of its step carried: the weights follow the double-precision
// reference of those updates in arrival order, and every backup (which
// replays each update with the rate of its kReplica frame) equals its
// primary. A negative or NaN rate is refused and leaves the weights and the
// pusher's clock as they were.
TEST_F(PsCoreTest, AsyncAppliesEachPushWithItsOwnLearningRate) {
  Job job;
  job.consistency.set_mode(v1::CONSISTENCY_MODE_ASYNC);
  Start(2, job);
  auto made = optim::Optimizer::Create(job.Init(1).optimizer());
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  const optim::Optimizer& o = *made;
  const uint64_t split = job.params - 500;  // tensor "w", then "b" (group no_decay)
  auto reference = [&](uint64_t b, uint64_t e) {
    return optim::Reference{std::vector<double>(job.initial.begin() + b, job.initial.begin() + e),
                            std::vector<double>(e - b, 0), std::vector<double>(e - b, 0)};
  };
  optim::Reference w = reference(0, split);
  optim::Reference bias = reference(split, job.params);
  auto gradient = [&](uint64_t step, uint32_t c) {
    std::vector<float> g;
    for (uint32_t p = 0; p < Partitions(); ++p) {
      auto [b, e] = Range(p);
      const auto part = Grad(step, c, b, e);
      g.insert(g.end(), part.begin(), part.end());
    }
    return g;
  };
  struct Arrival {
    uint64_t step;
    uint32_t contributor;
    double lr;
  };
  const Arrival arrivals[] = {{1, 0, 0.03}, {1, 1, 0.01}, {2, 1, 0}, {2, 0, 0.02}, {3, 0, 0.005}};
  uint64_t updates = 0;
  for (const Arrival& a : arrivals) {
    for (uint32_t p = 0; p < Partitions(); ++p) {
      auto [b, e] = Range(p);
      auto answer = Push(PrimaryOf(p), 1, a.step, p, a.contributor, 2, Grad(a.step, a.contributor, b, e),
                         v1::WIRE_DTYPE_FP32, a.lr);
      ASSERT_TRUE(AnsweredOk(answer));
      EXPECT_FALSE(Duplicate(answer));
    }
    const auto g = gradient(a.step, a.contributor);
    w.Step(o, std::vector<float>(g.begin(), g.begin() + static_cast<ptrdiff_t>(split)), updates, o.Group(""), 0.5,
           a.lr);
    bias.Step(o, std::vector<float>(g.begin() + static_cast<ptrdiff_t>(split), g.end()), updates, o.Group("no_decay"),
              0.5, a.lr);
    ++updates;
  }
  auto weights = [&] {
    std::vector<float> all;
    for (uint32_t p = 0; p < Partitions(); ++p) {
      auto a = Pull(PrimaryOf(p), 1, 0, p);
      EXPECT_TRUE(a->done);
      auto v = a->floats();
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  };
  const auto params = weights();
  ASSERT_EQ(params.size(), job.params);
  double max_err = 0;
  for (uint64_t i = 0; i < job.params; ++i) {
    const double want = i < split ? w.w[i] : bias.w[i - split];
    max_err = std::max(max_err, std::fabs(params[i] - want) / std::max(1.0, std::fabs(want)));
  }
  EXPECT_LT(max_err, 1e-5);
  ExpectReplicasEqual();
  // Refused rates change nothing: contributor 1's step 3 is still new.
  auto [b, e] = Range(0);
  for (double lr : {-1.0, std::numeric_limits<double>::quiet_NaN()}) {
    auto refused = Push(PrimaryOf(0), 1, 3, 0, 1, 2, Grad(3, 1, b, e), v1::WIRE_DTYPE_FP32, lr);
    ASSERT_TRUE(refused->done);
    EXPECT_EQ(refused->status().code(), StatusCode::kInvalidArgument) << refused->status().ToString();
  }
  EXPECT_EQ(weights(), params);
  auto taken = Push(PrimaryOf(0), 1, 3, 0, 1, 2, Grad(3, 1, b, e), v1::WIRE_DTYPE_FP32, 0.01);
  ASSERT_TRUE(AnsweredOk(taken));
  EXPECT_FALSE(Duplicate(taken));
  EXPECT_EQ(PrimaryOf(0).Stats({0}).partitions(0).version(), updates + 2);
  ExpectReplicasEqual();
}

TEST_F(PsCoreTest, BoundedStalenessHoldsTheFastContributor) {
  Job job;
  job.consistency.set_mode(v1::CONSISTENCY_MODE_BOUNDED_STALENESS);
  job.consistency.set_staleness_bound(1);
  Start(1, job);
  auto [b, e] = Range(0);
  // Contributor 0 pushes steps 1 and 2; contributor 1 nothing yet.
  ASSERT_TRUE(Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e))->status().ok());
  ASSERT_TRUE(Push(PrimaryOf(0), 1, 2, 0, 0, 2, Grad(2, 0, b, e))->status().ok());
  // Pushing step 3 would put it 3 steps ahead of the slowest (0) with bound 1.
  auto too_far = Push(PrimaryOf(0), 1, 3, 0, 0, 2, Grad(3, 0, b, e));
  EXPECT_EQ(too_far->status().code(), StatusCode::kFailedPrecondition);
  // A pull to compute step 3 waits: the slowest has pushed 0 steps.
  auto wait = Pull(PrimaryOf(0), 1, 3, 0, 0, 2);
  EXPECT_FALSE(wait->done);
  ASSERT_TRUE(Push(PrimaryOf(0), 1, 1, 0, 1, 2, Grad(1, 1, b, e))->status().ok());
  EXPECT_TRUE(wait->done);
  EXPECT_TRUE(wait->status().ok());
}

// A pull that names its contributor and step s declares that the puller
// computes step s next: its clock moves up to s - 1. Workers that go on
// from a later step than the epoch's start_step after a membership change
// (the highest any of them completed) so start the bound from there: their
// pulls wait for one another, then their pushes of the steps after are
// applied and those before are duplicates.
TEST_F(PsCoreTest, BoundedStalenessPullsDeclareThePullersStep) {
  Job job;
  job.consistency.set_mode(v1::CONSISTENCY_MODE_BOUNDED_STALENESS);
  job.consistency.set_staleness_bound(1);
  Start(1, job);  // start_step 0
  // Not a structured binding: clang 14 cannot capture one in a lambda.
  const auto range = Range(0);
  const auto b = range.first, e = range.second;
  auto push = [&](uint64_t step, uint32_t contributor) {
    return Push(PrimaryOf(0), 1, step, 0, contributor, 2, Grad(step, contributor, b, e));
  };
  auto version = [&] { return PrimaryOf(0).Stats({0}).partitions(0).version(); };
  // A refused first pull (a contributor outside its count) starts no clocks:
  // the count of 2 below is still free to be taken.
  auto stranger = Pull(PrimaryOf(0), 1, 10, 0, 3, 3);
  ASSERT_TRUE(stranger->done);
  EXPECT_EQ(stranger->status().code(), StatusCode::kInvalidArgument);
  // Both contributors go on after step 9: the first pull waits for the other.
  auto first = Pull(PrimaryOf(0), 1, 10, 0, 0, 2);
  EXPECT_FALSE(first->done);
  auto second = Pull(PrimaryOf(0), 1, 10, 0, 1, 2);
  EXPECT_TRUE(AnsweredOk(first));
  EXPECT_TRUE(AnsweredOk(second));
  EXPECT_EQ(version(), 1u);
  auto old = push(9, 0);
  ASSERT_TRUE(AnsweredOk(old));
  EXPECT_TRUE(Duplicate(old));
  EXPECT_EQ(version(), 1u);
  // Steps 10 and 11 of contributor 0 are within the bound of 1 from 9.
  ASSERT_TRUE(AnsweredOk(push(10, 0)));
  ASSERT_TRUE(AnsweredOk(push(11, 0)));
  EXPECT_EQ(version(), 3u);
  EXPECT_EQ(push(12, 0)->status().code(), StatusCode::kFailedPrecondition);
  // A pull never moves a clock back.
  EXPECT_TRUE(AnsweredOk(Pull(PrimaryOf(0), 1, 3, 0, 0, 2)));
  EXPECT_EQ(push(12, 0)->status().code(), StatusCode::kFailedPrecondition);
  // Pulls of step 0, or without contributors, move no clock: contributor 1
  // is still at 9, so its step 10 is applied, not a duplicate.
  EXPECT_TRUE(AnsweredOk(Pull(PrimaryOf(0), 1, 0, 0, 1, 2)));
  EXPECT_TRUE(AnsweredOk(Pull(PrimaryOf(0), 1, 11, 0)));
  auto ten = push(10, 1);
  ASSERT_TRUE(AnsweredOk(ten));
  EXPECT_FALSE(Duplicate(ten));
  EXPECT_EQ(version(), 4u);
  ExpectReplicasEqual();
}

// Asynchronous mode (no bound): such a pull is answered at once and still
// moves its contributor's clock.
TEST_F(PsCoreTest, AsyncPullsMoveTheirContributorsClock) {
  Job async;
  async.consistency.set_mode(v1::CONSISTENCY_MODE_ASYNC);
  Start(2, async);
  auto [b, e] = Range(0);
  EXPECT_TRUE(AnsweredOk(Pull(PrimaryOf(0), 1, 10, 0, 0, 2)));
  auto dup = Push(PrimaryOf(0), 1, 9, 0, 0, 2, Grad(9, 0, b, e));
  ASSERT_TRUE(AnsweredOk(dup));
  EXPECT_TRUE(Duplicate(dup));
  auto applied = Push(PrimaryOf(0), 1, 10, 0, 0, 2, Grad(10, 0, b, e));
  ASSERT_TRUE(AnsweredOk(applied));
  EXPECT_FALSE(Duplicate(applied));
  EXPECT_EQ(PrimaryOf(0).Stats({0}).partitions(0).version(), 2u);
  ExpectReplicasEqual();
}

TEST_F(PsCoreTest, NewEpochAbortsWaitingPullsAndRefusesOldPushes) {
  Job job;
  Start(2, job);
  auto waiting = Pull(PrimaryOf(0), 1, 1, 0);
  EXPECT_FALSE(waiting->done);
  SetEpoch(2);
  ASSERT_TRUE(waiting->done);
  EXPECT_EQ(waiting->status().code(), StatusCode::kAborted);
  EXPECT_NE(waiting->status().message().find("superseded"), std::string::npos);
  auto [b, e] = Range(0);
  auto old = Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e));
  EXPECT_EQ(old->status().code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace tandem::server::store_test
