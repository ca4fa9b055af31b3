// Workers build their communicators for every epoch: a coordinator and three
// workers on loopback; each worker builds its communicators for epoch 1 and
// checks them; a worker killed with SIGKILL makes epoch 2, for which the
// survivors abort the old communicators and build new ones.
#include <signal.h>

#include <thread>

#include <gtest/gtest.h>

#include "common/grpc_util.h"
#include "launch_util.h"
#include "ps_test_util.h"
#include "tandem/v1/coordinator.grpc.pb.h"

namespace tandem {
namespace {

using std::chrono::milliseconds;

TEST(DataPlaneProcessTest, WorkersBuildCommunicatorsForEveryEpoch) {
  testing::TempDir dir;
  auto coordinator =
      testing::StartDaemon("tandem-coordinator", "coordinator", dir.path(),
                           {"--job-min-workers", "2", "--job-max-workers", "3", "--job-last-call-window", "300ms"});
  ASSERT_TRUE(coordinator.ok()) << coordinator.status().ToString();
  std::vector<cli::LaunchedDaemon> workers;
  for (int i = 0; i < 3; ++i) {
    auto w =
        testing::StartDaemon("tandem-worker", "worker-" + std::to_string(i), dir.path(),
                             {"--coordinator-address", coordinator->ready.grpc_address, "--data-plane-timeout", "10s"});
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    workers.push_back(std::move(*w));
  }
  // Epoch 1: every worker built and checked world, node, dp, tp and pp.
  for (auto& w : workers) {
    EXPECT_TRUE(testing::WaitUntil([&] { return testing::Metric(w, "tandem_worker_data_plane_epoch") == 1; },
                                   milliseconds(20000)))
        << testing::ReadFile(w.log_file);
    EXPECT_EQ(testing::Metric(w, "tandem_worker_communicators"), 5);
    const std::string log = testing::ReadFile(w.log_file);
    EXPECT_NE(log.find("epoch 1: data plane ready"), std::string::npos) << log;
    EXPECT_NE(log.find("self-check passed: world (shm"), std::string::npos) << log;
    EXPECT_NE(log.find("of 3)"), std::string::npos) << log;
  }

  // SIGKILL one worker: the survivors rebuild for epoch 2 with two ranks.
  ASSERT_TRUE(workers[2].process->Signal(SIGKILL).ok());
  for (int i = 0; i < 2; ++i) {
    auto& w = workers[static_cast<size_t>(i)];
    EXPECT_TRUE(testing::WaitUntil([&] { return testing::Metric(w, "tandem_worker_data_plane_epoch") == 2; },
                                   milliseconds(20000)))
        << testing::ReadFile(w.log_file);
    const std::string log = testing::ReadFile(w.log_file);
    EXPECT_NE(log.find("epoch 2: data plane ready"), std::string::npos) << log;
    EXPECT_NE(log.find("of 2)"), std::string::npos) << log;
    EXPECT_EQ(log.find("could not be built"), std::string::npos) << log;
  }
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(workers[static_cast<size_t>(i)].process->Signal(SIGTERM).ok());
    auto exit = workers[static_cast<size_t>(i)].process->Wait(milliseconds(5000));
    ASSERT_TRUE(exit.ok());
    EXPECT_EQ(exit->code, 0);
  }
}

// Workers on two (simulated) nodes: groups inside a node use shared memory,
// groups across nodes UCX.
TEST(DataPlaneProcessTest, GroupsAcrossNodesUseUcx) {
  testing::TempDir dir;
  auto coordinator = testing::StartDaemon("tandem-coordinator", "coordinator", dir.path(),
                                          {"--job-min-workers", "2", "--job-max-workers", "2"});
  ASSERT_TRUE(coordinator.ok()) << coordinator.status().ToString();
  std::vector<cli::LaunchedDaemon> workers;
  for (const char* node : {"node-a", "node-b"}) {
    auto w = testing::StartDaemon("tandem-worker", std::string("worker-") + node, dir.path(),
                                  {"--coordinator-address", coordinator->ready.grpc_address, "--node-id", node});
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    workers.push_back(std::move(*w));
  }
  for (auto& w : workers) {
    EXPECT_TRUE(testing::WaitUntil([&] { return testing::Metric(w, "tandem_worker_data_plane_epoch") == 1; },
                                   milliseconds(20000)))
        << testing::ReadFile(w.log_file);
    const std::string log = testing::ReadFile(w.log_file);
    EXPECT_NE(log.find("world (ucx, rank"), std::string::npos) << log;
    EXPECT_NE(log.find(" (shm, rank 0 of 1)"), std::string::npos) << log;
  }
}

}  // namespace
}  // namespace tandem
