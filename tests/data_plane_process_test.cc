// Workers build their communicators for every epoch: a coordinator and three
// workers on loopback; each worker builds its communicators for epoch 1 and
// checks them; a worker killed with SIGKILL makes epoch 2, for which the
// survivors abort the old communicators and build new ones. The metrics
// follow: each worker's job, node and rank (one series, the newest rank) and
// the self-check's collectives by op, group and backend. The rendezvous closes
// as soon as the third worker registers; its long last-call window only keeps
// a slow start (a sanitizer build) from leaving the third worker out of epoch 1.
#include <signal.h>

#include <regex>
#include <set>
#include <thread>

#include <gtest/gtest.h>

#include "common/grpc_util.h"
#include "launch_util.h"
#include "ps_test_util.h"
#include "tandem/v1/coordinator.grpc.pb.h"

namespace tandem {
namespace {

using std::chrono::milliseconds;

std::string Page(const cli::LaunchedDaemon& daemon) {
  auto body = HttpGet(daemon.ready.metrics_address, "/metrics", milliseconds(2000));
  return body.ok() ? *body : "";
}

// The ranks in the page's tandem_member_info series (one per series).
std::vector<int> InfoRanks(const std::string& page) {
  std::vector<int> ranks;
  const std::regex info(R"re(\ntandem_member_info\{job_id="default",node_id="[^"]+",rank="([0-9]+)"\} 1(?=\n))re");
  for (std::sregex_iterator it(page.begin(), page.end(), info), end; it != end; ++it) {
    ranks.push_back(std::stoi((*it)[1].str()));
  }
  return ranks;
}

// The value of a labelled sample, or -1.
double Sample(const std::string& page, const std::string& series) {
  const size_t at = page.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::stod(page.substr(at + series.size() + 2));
}

TEST(DataPlaneProcessTest, WorkersBuildCommunicatorsForEveryEpoch) {
  testing::TempDir dir;
  auto coordinator =
      testing::StartDaemon("tandem-coordinator", "coordinator", dir.path(),
                           {"--job-min-workers", "2", "--job-max-workers", "3", "--job-last-call-window", "30s"});
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
  std::set<int> ranks;
  for (auto& w : workers) {
    EXPECT_TRUE(testing::WaitUntil([&] { return testing::Metric(w, "tandem_worker_data_plane_epoch") == 1; },
                                   milliseconds(20000)))
        << testing::ReadFile(w.log_file);
    EXPECT_EQ(testing::Metric(w, "tandem_worker_communicators"), 5);
    const std::string page = Page(w);
    const auto info = InfoRanks(page);
    ASSERT_EQ(info.size(), 1u) << page;
    ranks.insert(info[0]);
    // The self-check: one barrier and one allreduce of one int64 over world (shared memory: one node).
    EXPECT_EQ(Sample(page, R"(tandem_worker_collectives_total{backend="shm",group="world",op="barrier"})"), 1) << page;
    EXPECT_EQ(Sample(page, R"(tandem_worker_collectives_total{backend="shm",group="world",op="allreduce"})"), 1)
        << page;
    EXPECT_EQ(Sample(page, R"(tandem_worker_collective_bytes_total{backend="shm",group="world",op="allreduce"})"), 8)
        << page;
    EXPECT_GT(Sample(page, R"(tandem_worker_collective_seconds_total{backend="shm",group="world",op="allreduce"})"), 0)
        << page;
    const std::string log = testing::ReadFile(w.log_file);
    EXPECT_NE(log.find("epoch 1: data plane ready"), std::string::npos) << log;
    EXPECT_NE(log.find("self-check passed: world (shm"), std::string::npos) << log;
    EXPECT_NE(log.find("of 3)"), std::string::npos) << log;
  }

  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2}));

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
    // One series, with the rank of epoch 2; the counters go on across epochs.
    const std::string page = Page(w);
    const auto info = InfoRanks(page);
    ASSERT_EQ(info.size(), 1u) << page;
    EXPECT_LT(info[0], 2) << page;
    EXPECT_EQ(Sample(page, R"(tandem_worker_collectives_total{backend="shm",group="world",op="allreduce"})"), 2)
        << page;
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

// A worker told to stop while it builds an epoch whose peer never publishes
// its address (the peer is frozen with SIGSTOP: alive to the coordinator)
// stops at once, not after the data plane's timeout.
TEST(DataPlaneProcessTest, AWorkerStoppedWhileItWaitsForAPeerStopsPromptly) {
  testing::TempDir dir;
  auto coordinator = testing::StartDaemon("tandem-coordinator", "coordinator", dir.path(),
                                          {"--job-min-workers", "2", "--job-max-workers", "2",
                                           "--job-heartbeat-deadline", "60s", "--job-stream-grace", "60s"});
  ASSERT_TRUE(coordinator.ok()) << coordinator.status().ToString();
  const std::vector<std::string> args = {
      "--coordinator-address", coordinator->ready.grpc_address, "--node-id", "node-a", "--data-plane-timeout", "60s"};
  auto frozen = testing::StartDaemon("tandem-worker", "worker-frozen", dir.path(), args);
  ASSERT_TRUE(frozen.ok()) << frozen.status().ToString();
  // Frozen once it has registered (it serves gRPC before it registers).
  ASSERT_TRUE(testing::WaitUntil(
      [&] { return testing::ReadFile(frozen->log_file).find("registered with the coordinator") != std::string::npos; },
      milliseconds(20000)))
      << testing::ReadFile(frozen->log_file);
  ASSERT_TRUE(frozen->process->Signal(SIGSTOP).ok());
  auto waiting = testing::StartDaemon("tandem-worker", "worker-waiting", dir.path(), args);
  ASSERT_TRUE(waiting.ok()) << waiting.status().ToString();
  // Epoch 1 forms, and the running worker starts building it.
  ASSERT_TRUE(testing::WaitUntil(
      [&] {
        return testing::ReadFile(waiting->log_file).find("epoch 1: building the data plane") != std::string::npos;
      },
      milliseconds(20000)))
      << testing::ReadFile(waiting->log_file);
  std::this_thread::sleep_for(milliseconds(200));
  ASSERT_TRUE(waiting->process->Signal(SIGTERM).ok());
  const auto stopped = std::chrono::steady_clock::now();
  auto exit = waiting->process->Wait(milliseconds(20000));
  ASSERT_TRUE(exit.ok());
  EXPECT_EQ(exit->code, 0);
  EXPECT_LT(std::chrono::steady_clock::now() - stopped, milliseconds(5000)) << testing::ReadFile(waiting->log_file);
  EXPECT_NE(testing::ReadFile(waiting->log_file).find("building the data plane stopped: the worker is shutting down"),
            std::string::npos)
      << testing::ReadFile(waiting->log_file);
  ASSERT_TRUE(frozen->process->Signal(SIGKILL).ok());
  (void)frozen->process->Wait(milliseconds(5000));
}

}  // namespace
}  // namespace tandem
