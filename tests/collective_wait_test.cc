// Whom a collective waited for (Communicator::last_wait), the input of the
// straggler score: the shared-memory backend names the rank that entered
// last on every rank, with how much after the next-to-last; the transport
// backend names it on its ring neighbours, clock-free, and the other ranks
// name no one. Ranks are threads; one enters 80 ms after the others.
#include <chrono>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "comm_backends.h"

namespace tandem {
namespace {

using std::chrono::milliseconds;

constexpr int kWorld = 4;
constexpr int kLate = 2;
constexpr double kDelay = 0.08;

// Every rank runs one reduce-scatter, rank kLate 80 ms after the others.
std::vector<comm::Wait> RunWithALateRank(const comm_test::Backend& backend, const std::string& name) {
  comm::CommInfo base;
  base.name = name;
  base.epoch = 1;
  base.timeout = milliseconds(10000);
  base.member_ids = {11, 12, 13, 14};
  auto group = backend.make_group(kWorld, base);
  EXPECT_TRUE(group.ok()) << group.status().ToString();
  if (!group.ok()) return {};
  std::vector<comm::Wait> waits(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      comm::Communicator& c = *group->comms[static_cast<size_t>(r)];
      std::vector<float> in(64 * kWorld, 1.0f), out(64);
      // A first collective lines the ranks up.
      ASSERT_TRUE(c.Barrier().ok());
      if (r == kLate) std::this_thread::sleep_for(std::chrono::duration<double>(kDelay));
      ASSERT_TRUE(c.ReduceScatter(in.data(), out.data(), 64, comm::DType::kFloat32, comm::ReduceOp::kSum).ok());
      waits[static_cast<size_t>(r)] = c.last_wait();
      EXPECT_EQ(out[0], static_cast<float>(kWorld));
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(group->comms[kLate]->member_id(kLate), 13u);
  return waits;
}

TEST(CollectiveWaitTest, SharedMemoryNamesTheRankThatEnteredLastOnEveryRank) {
  const auto waits = RunWithALateRank(comm_test::ShmBackend(), "wait-shm");
  ASSERT_EQ(waits.size(), static_cast<size_t>(kWorld));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(waits[static_cast<size_t>(r)].rank, kLate) << "rank " << r;
    // After the next-to-last rank: the delay, give or take the threads' start.
    EXPECT_GT(waits[static_cast<size_t>(r)].seconds, kDelay * 0.7) << "rank " << r;
    EXPECT_LT(waits[static_cast<size_t>(r)].seconds, kDelay * 3) << "rank " << r;
  }
}

TEST(CollectiveWaitTest, TransportNeighboursNameTheLateRankItselfAndTheOthersNoOne) {
  const auto waits = RunWithALateRank(comm_test::LocalBackend(), "wait-local");
  ASSERT_EQ(waits.size(), static_cast<size_t>(kWorld));
  // Ranks 1 and 3 are rank 2's ring neighbours: they waited for it at entry.
  for (int r : {kLate - 1, kLate + 1}) {
    EXPECT_EQ(waits[static_cast<size_t>(r)].rank, kLate) << "rank " << r;
    EXPECT_GT(waits[static_cast<size_t>(r)].seconds, kDelay * 0.7) << "rank " << r;
  }
  // Rank 0's neighbours (3 and 1) entered with it: whoever it names, it
  // waited little for them (it waited for rank 2 inside the ring).
  EXPECT_NE(waits[0].rank, kLate);
  EXPECT_LT(waits[0].seconds, kDelay * 0.5);
  // The late rank waited for no one.
  EXPECT_LT(waits[kLate].seconds, kDelay * 0.5);
}

TEST(CollectiveWaitTest, AGroupOfOneWaitsForNoOne) {
  comm::CommInfo base;
  base.name = "wait-one";
  auto group = comm_test::LocalBackend().make_group(1, base);
  ASSERT_TRUE(group.ok());
  ASSERT_TRUE(group->comms[0]->Barrier().ok());
  EXPECT_EQ(group->comms[0]->last_wait().rank, -1);
  EXPECT_EQ(group->comms[0]->member_id(0), 0u) << "no member ids given";
}

}  // namespace
}  // namespace tandem
