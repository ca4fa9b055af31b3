// The operator commands for the parameter servers' checkpoints and
// statistics, end to end: a coordinator and two tandem-server daemons on
// loopback, one worker in this process (a member session and a PsClient)
// that initialises the job and trains a few steps, and `tandem checkpoint
// save | verify | restore` and `tandem ps stats` run as the real binary
// against them.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "launch_util.h"
#include "ps_test_util.h"
#include "worker/ps/ps_client.h"

namespace tandem {
namespace {

using std::chrono::milliseconds;

constexpr const char* kJob = "ckpt-test";
constexpr uint64_t kParams = 20000;  // 5 partitions of 16 KiB (4096 elements), the last one smaller

v1::OptimizerConfig Optimizer() {
  v1::OptimizerConfig o;
  o.mutable_adam()->set_lr(1e-2);
  o.mutable_adam()->set_decoupled_weight_decay(true);
  return o;
}

testing::CommandResult Tandem(std::vector<std::string> args) {
  args.insert(args.begin(), testing::BinDir() + "/tandem");
  return testing::RunCommand(args, std::chrono::seconds(60));
}

std::vector<std::string> PartitionFiles(const std::string& dir) {
  std::vector<std::string> files;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (e.path().extension() == ".tpc") files.push_back(e.path().filename().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + what.size())) ++n;
  return n;
}

TEST(CheckpointCliTest, SaveVerifyStatsAndRestoreAgainstRunningServers) {
  testing::TempDir dir;
  auto coordinator = testing::StartDaemon("tandem-coordinator", "coordinator", dir.path(),
                                          {"--job-id",
                                           kJob,
                                           "--job-min-workers",
                                           "1",
                                           "--job-max-workers",
                                           "1",
                                           "--job-min-servers",
                                           "2",
                                           "--job-last-call-window",
                                           "300ms",
                                           "--job-parameter-count",
                                           std::to_string(kParams),
                                           "--job-partition-size",
                                           "16KiB",
                                           "--job-heartbeat-interval",
                                           "200ms",
                                           "--job-heartbeat-deadline",
                                           "3s",
                                           "--job-stream-grace",
                                           "300ms"});
  ASSERT_TRUE(coordinator.ok()) << coordinator.status().ToString();
  const std::string address = coordinator->ready.grpc_address;
  std::vector<cli::LaunchedDaemon> servers;
  for (int i = 0; i < 2; ++i) {
    auto s = testing::StartDaemon("tandem-server", "server-" + std::to_string(i), dir.path(),
                                  {"--coordinator-address", address, "--job-id", kJob, "--node-id",
                                   "node-s" + std::to_string(i), "--server-threads", "1", "--server-timeout", "20s"});
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    servers.push_back(std::move(*s));
  }
  for (auto& s : servers) {
    ASSERT_TRUE(testing::WaitRegistered(s, milliseconds(20000))) << testing::ReadFile(s.log_file);
  }
  auto worker = std::make_unique<testing::PsWorker>(address, kJob, 0, 1);
  ASSERT_TRUE(worker->WaitEpochAfter(0, milliseconds(30000))) << testing::ReadFile(servers[0].log_file);
  ASSERT_EQ(worker->client().shard_map().partitions_size(), 5);
  std::vector<float> params(kParams);
  for (size_t i = 0; i < params.size(); ++i) params[i] = static_cast<float>(i % 97) * 0.01f;
  auto initialized =
      worker->client().Initialize(testing::FlatTensors(kParams), Optimizer(), v1::ConsistencyConfig(), params.data());
  ASSERT_TRUE(initialized.ok()) << initialized.status().ToString();
  for (uint64_t step = 1; step <= 2; ++step) ASSERT_TRUE(worker->Step(step, params).ok());
  const std::vector<float> at_step2 = params;

  // A synchronous save at step 2: one line per server, both complete.
  const std::string ckpt = dir.path() + "/checkpoints";
  auto r = Tandem({"checkpoint", "save", "--coordinator", address, "--dir", ckpt, "--step", "2", "--id", "c1"});
  ASSERT_EQ(r.exit.ToString(), "exit 0") << r.output;
  EXPECT_EQ(Count(r.output, " complete "), 2u) << r.output;
  EXPECT_NE(r.output.find("saved checkpoint 'c1' at step 2 on 2 server(s)"), std::string::npos) << r.output;
  EXPECT_EQ(PartitionFiles(ckpt + "/c1").size(), 5u);

  // The same id again: every server refuses, and the command says which.
  r = Tandem({"checkpoint", "save", "--coordinator", address, "--dir", ckpt, "--step", "2", "--id", "c1"});
  EXPECT_EQ(r.exit.ToString(), "exit 1") << r.output;
  EXPECT_NE(r.output.find("ALREADY_EXISTS"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("failed: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("checkpoint 'c1' is incomplete"), std::string::npos) << r.output;

  // Bad input: a relative directory, an unknown job, a step training has
  // not reached (the servers wait for it, up to --timeout).
  r = Tandem({"checkpoint", "save", "--coordinator", address, "--dir", "relative/dir"});
  EXPECT_EQ(r.exit.ToString(), "exit 2") << r.output;
  EXPECT_NE(r.output.find("--dir: must be an absolute path"), std::string::npos) << r.output;
  r = Tandem({"checkpoint", "save", "--coordinator", address, "--job", "nope", "--dir", ckpt});
  EXPECT_EQ(r.exit.ToString(), "exit 1") << r.output;
  EXPECT_NE(r.output.find("unknown job 'nope'"), std::string::npos) << r.output;
  r = Tandem({"checkpoint", "save", "--coordinator", address, "--dir", ckpt, "--step", "5", "--id", "future",
              "--timeout", "1s"});
  EXPECT_EQ(r.exit.ToString(), "exit 1") << r.output;
  EXPECT_NE(r.output.find("DEADLINE_EXCEEDED"), std::string::npos) << r.output;

  // An asynchronous save, followed to the end, as JSON.
  r = Tandem({"checkpoint", "save", "--coordinator", address, "--dir", ckpt, "--id", "c2", "--async", "--json",
              "--poll-interval", "50ms"});
  ASSERT_EQ(r.exit.ToString(), "exit 0") << r.output;
  EXPECT_NE(r.output.find("\"complete\": true"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("2/2 servers complete"), std::string::npos) << r.output;
  EXPECT_EQ(PartitionFiles(ckpt + "/c2").size(), 5u);

  // Offline verification: complete and intact.
  r = Tandem({"checkpoint", "verify", ckpt + "/c1"});
  EXPECT_EQ(r.exit.ToString(), "exit 0") << r.output;
  for (const std::string line : {"job         ckpt-test", "id          c1", "step        2", "parameters  20000",
                                 "optimizer   adamw", "files       5", "coverage    complete", "checksums   ok"}) {
    EXPECT_NE(r.output.find(line), std::string::npos) << line << "\n" << r.output;
  }
  r = Tandem({"checkpoint", "verify", ckpt + "/c1", "--json"});
  EXPECT_EQ(r.exit.ToString(), "exit 0") << r.output;
  EXPECT_NE(r.output.find("\"ok\": true"), std::string::npos) << r.output;

  // One flipped byte in one file of c2: verify fails and names the file.
  const std::vector<std::string> c2_files = PartitionFiles(ckpt + "/c2");
  ASSERT_FALSE(c2_files.empty());
  const std::string victim = ckpt + "/c2/" + c2_files[1];
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(f.good());
    f.seekg(-10, std::ios::end);
    char byte = 0;
    f.read(&byte, 1);
    f.seekp(-10, std::ios::end);
    byte = static_cast<char>(byte ^ 0x40);
    f.write(&byte, 1);
  }
  r = Tandem({"checkpoint", "verify", ckpt + "/c2"});
  EXPECT_EQ(r.exit.ToString(), "exit 1") << r.output;
  EXPECT_NE(r.output.find("DATA_LOSS"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(c2_files[1]), std::string::npos) << r.output;
  // A copy of c1 without one file: incomplete.
  std::filesystem::copy(ckpt + "/c1", dir.path() + "/partial");
  std::filesystem::remove(dir.path() + "/partial/" + PartitionFiles(ckpt + "/c1")[2]);
  r = Tandem({"checkpoint", "verify", dir.path() + "/partial"});
  EXPECT_EQ(r.exit.ToString(), "exit 1") << r.output;
  EXPECT_NE(r.output.find("INCOMPLETE"), std::string::npos) << r.output;
  r = Tandem({"checkpoint", "verify", dir.path() + "/nothing-here"});
  EXPECT_EQ(r.exit.ToString(), "exit 1") << r.output;
  EXPECT_NE(r.output.find("does not exist"), std::string::npos) << r.output;

  // Statistics: both servers, their partitions, the last checkpoint.
  r = Tandem({"ps", "stats", "--coordinator", address});
  EXPECT_EQ(r.exit.ToString(), "exit 0") << r.output;
  EXPECT_EQ(Count(r.output, "adamw"), 2u) << r.output;
  EXPECT_EQ(Count(r.output, "c2 complete (step 2"), 2u) << r.output;
  EXPECT_NE(r.output.find("5 partitions of 4096 elements"), std::string::npos) << r.output;
  r = Tandem({"ps", "stats", "--coordinator", address, "--partitions"});
  EXPECT_EQ(r.exit.ToString(), "exit 0") << r.output;
  EXPECT_EQ(Count(r.output, " primary "), 5u) << r.output;
  EXPECT_EQ(Count(r.output, " backup "), 5u) << r.output;
  EXPECT_NE(r.output.find("[16384, 20000)"), std::string::npos) << r.output;
  r = Tandem({"ps", "stats", "--coordinator", address, "--json"});
  EXPECT_EQ(r.exit.ToString(), "exit 0") << r.output;
  EXPECT_NE(r.output.find("\"ok\": true"), std::string::npos) << r.output;
  EXPECT_EQ(Count(r.output, "\"step\": 2"), 4u) << r.output;  // each server's step and its last checkpoint's
  // Both copies of every partition hold the same state.
  r = Tandem({"ps", "stats", "--coordinator", address, "--verify-replicas"});
  EXPECT_EQ(r.exit.ToString(), "exit 0") << r.output;
  EXPECT_NE(r.output.find("replicas: 5 partition(s) with both copies alike, 0 differ, 0 with the backup behind, 0 "
                          "without a backup"),
            std::string::npos)
      << r.output;
  r = Tandem({"ps", "stats", "--coordinator", address, "--verify-replicas", "--partitions", "--json"});
  EXPECT_EQ(r.exit.ToString(), "exit 0") << r.output;
  EXPECT_NE(r.output.find("\"replicas\": {\"agree\": 5, \"differ\": [], \"behind\": [], \"without_backup\": [], "
                          "\"uninitialized\": []}"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(Count(r.output, "\"state_crc32c\": null"), 0u) << r.output;
  EXPECT_EQ(Count(r.output, "\"state_crc32c\": "), 10u) << r.output;

  // Train on, then restore: the corrupt checkpoint is refused, the good one
  // brings back the parameters of step 2.
  ASSERT_TRUE(worker->Step(3, params).ok());
  ASSERT_NE(params, at_step2);
  r = Tandem({"checkpoint", "restore", "--coordinator", address, "--path", ckpt + "/c2"});
  EXPECT_EQ(r.exit.ToString(), "exit 1") << r.output;
  EXPECT_NE(r.output.find("DATA_LOSS"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("failed: "), std::string::npos) << r.output;
  r = Tandem({"checkpoint", "restore", "--coordinator", address, "--path", "c1"});
  EXPECT_EQ(r.exit.ToString(), "exit 2") << r.output;
  r = Tandem({"checkpoint", "restore", "--coordinator", address, "--path", ckpt + "/c1"});
  ASSERT_EQ(r.exit.ToString(), "exit 0") << r.output;
  EXPECT_NE(r.output.find("restored checkpoint 'c1' (step 2) on 2 server(s): 10 partition replica(s)"),
            std::string::npos)
      << r.output;
  std::vector<float> restored(kParams);
  const Status pulled = worker->Pull(0, restored, milliseconds(20000));
  ASSERT_TRUE(pulled.ok()) << pulled.ToString() << "\nserver-0:\n"
                           << testing::ReadFile(servers[0].log_file) << "\nserver-1:\n"
                           << testing::ReadFile(servers[1].log_file);
  EXPECT_EQ(restored, at_step2);

  worker.reset();
  for (auto& s : servers) {
    ASSERT_TRUE(s.process->Signal(SIGTERM).ok());
    auto exit = s.process->Wait(milliseconds(10000));
    ASSERT_TRUE(exit.ok());
    EXPECT_EQ(exit->code, 0) << testing::ReadFile(s.log_file);
  }
}

}  // namespace
}  // namespace tandem
