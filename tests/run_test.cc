// `tandem run` (what `make demo` runs): a whole local cluster trains and goes
// down cleanly, on its own or on Ctrl-C; bad flags and missing binaries are
// reported.
#include <signal.h>

#include <gtest/gtest.h>

#include "common/cpus.h"
#include "common/process.h"
#include "test_util.h"

namespace tandem {
namespace {

using std::chrono::milliseconds;
using testing::BinDir;
using testing::RunCommand;

const std::vector<std::string> kSmallModel = {"--train-layers",       "1", "--train-d-model", "32",
                                              "--train-heads",        "2", "--train-context", "16",
                                              "--train-global-batch", "4"};

TEST(TandemRunTest, TrainsOnALocalClusterAndStopsItCleanly) {
  testing::TempDir dir;
  std::vector<std::string> argv = {BinDir() + "/tandem", "run",      "--nodes",   "2",
                                   "--servers",          "2",        "--steps",   "8",
                                   "--work-dir",         dir.path(), "--summary", dir.path() + "/summary.json"};
  argv.insert(argv.end(), kSmallModel.begin(), kSmallModel.end());
  const auto r = RunCommand(argv, std::chrono::seconds(90));
  ASSERT_TRUE(r.exit.success()) << r.output;
  EXPECT_NE(r.output.find("step 8/8"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("Done: 8 of 8 steps"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("the servers applied 8 updates (one per completed step)"), std::string::npos) << r.output;
  for (const std::string name : {"coordinator", "server-0", "server-1", "worker-0", "worker-1"}) {
    const std::string log = testing::ReadFile(dir.path() + "/" + name + ".log");
    EXPECT_NE(log.find("stopped cleanly"), std::string::npos) << name << ":\n" << log;
  }
  // --bind (the default): each worker on its own share of the CPUs.
  for (int i = 0; i < 2; ++i) {
    const std::string log = testing::ReadFile(dir.path() + "/worker-" + std::to_string(i) + ".log");
    const std::string cpus = FormatCpuList(ShareOfCpus(AllowedCpus(), i, 2));
    EXPECT_NE(log.find("running on CPUs " + cpus + "\n"), std::string::npos) << "worker-" << i << ":\n" << log;
  }
  const std::string summary = testing::ReadFile(dir.path() + "/summary.json");
  for (const std::string key : {"steps", "first_loss", "last_loss", "tokens_per_second", "mode", "world_size", "epochs",
                                "faults", "server_steps_applied"}) {
    EXPECT_NE(summary.find("\"" + key + "\":"), std::string::npos) << key << "\n" << summary;
  }
}

// Servers that refuse the first InitializeParameters calls with UNAVAILABLE
// (as one whose gRPC channel is still connecting on a loaded host does): the
// workers retry within the epoch instead of waiting for an epoch that never
// comes, and training completes.
TEST(TandemRunTest, WorkersRetryServersThatAreNotReadyToInitialiseYet) {
  testing::TempDir dir;
  std::vector<std::string> argv = {"/usr/bin/env",
                                   "TANDEM_FAILPOINTS=ps.initialize_unavailable=3",
                                   BinDir() + "/tandem",
                                   "run",
                                   "--nodes",
                                   "2",
                                   "--servers",
                                   "2",
                                   "--steps",
                                   "4",
                                   "--work-dir",
                                   dir.path(),
                                   "--bind=false"};
  argv.insert(argv.end(), kSmallModel.begin(), kSmallModel.end());
  const auto r = RunCommand(argv, std::chrono::seconds(90));
  ASSERT_TRUE(r.exit.success()) << r.output;
  EXPECT_NE(r.output.find("Done: 4 of 4 steps"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("membership epochs 1,"), std::string::npos) << r.output;
  std::string logs;
  for (int i = 0; i < 2; ++i) logs += testing::ReadFile(dir.path() + "/worker-" + std::to_string(i) + ".log");
  EXPECT_NE(logs.find("failpoint ps.initialize_unavailable"), std::string::npos) << logs;
  EXPECT_NE(logs.find("; retrying in 100 ms"), std::string::npos) << logs;
  EXPECT_EQ(logs.find("waiting for the next epoch"), std::string::npos) << logs;
}

TEST(TandemRunTest, CtrlCStopsAHeldCluster) {
  testing::TempDir dir;
  SpawnOptions options;
  options.argv = {BinDir() + "/tandem", "run",      "--servers",   "1", "--nodes", "1", "--steps", "2", "--hold",
                  "--work-dir",         dir.path(), "--bind=false"};
  options.argv.insert(options.argv.end(), kSmallModel.begin(), kSmallModel.end());
  options.output_file = dir.path() + "/run.out";
  auto run = Subprocess::Spawn(options);
  ASSERT_TRUE(run.ok());
  bool holding = false;
  for (int i = 0; i < 1200 && !holding; ++i) {
    holding = testing::ReadFile(options.output_file).find("holding the cluster up") != std::string::npos;
    if (!holding) std::this_thread::sleep_for(milliseconds(50));
  }
  ASSERT_TRUE(holding) << testing::ReadFile(options.output_file);
  ASSERT_TRUE((*run)->Signal(SIGINT).ok());
  auto exit = (*run)->Wait(milliseconds(20000));
  ASSERT_TRUE(exit.ok()) << testing::ReadFile(options.output_file);
  EXPECT_TRUE(exit->success()) << testing::ReadFile(options.output_file);
  EXPECT_NE(testing::ReadFile(options.output_file).find("Done: 2 of 2 steps"), std::string::npos);
  // --bind=false: the worker runs wherever the scheduler puts it.
  EXPECT_EQ(testing::ReadFile(dir.path() + "/worker-0.log").find("running on CPUs"), std::string::npos);
}

TEST(TandemRunTest, AMissingBinaryIsReportedAndNothingIsLeftRunning) {
  testing::TempDir dir;
  const auto r = RunCommand({BinDir() + "/tandem", "run", "--bin-dir", dir.path(), "--work-dir", dir.path()});
  EXPECT_EQ(r.exit.ToString(), "exit 1") << r.output;
  EXPECT_NE(r.output.find("cannot run '" + dir.path() + "/tandem-coordinator'"), std::string::npos) << r.output;
}

TEST(TandemRunTest, BadFlagsExitWithStatus2) {
  const auto r = RunCommand({BinDir() + "/tandem", "run", "--servers", "-1"});
  EXPECT_EQ(r.exit.ToString(), "exit 2");
  EXPECT_NE(r.output.find("--servers: -1 is out of range: accepted 0..64"), std::string::npos) << r.output;
  // A membership change is asked for after a step that is done: not after the last.
  for (const std::string flag : {"--kill-worker-at", "--add-worker-at"}) {
    const auto late = RunCommand({BinDir() + "/tandem", "run", "--steps", "10", flag, "10"});
    EXPECT_EQ(late.exit.ToString(), "exit 2") << late.output;
    EXPECT_NE(late.output.find(flag + ": 10 must be below --steps (10)"), std::string::npos) << late.output;
  }
  const auto unknown = RunCommand({BinDir() + "/tandem", "frobnicate"});
  EXPECT_EQ(unknown.exit.ToString(), "exit 2");
  EXPECT_NE(unknown.output.find("unknown command 'frobnicate'"), std::string::npos);
}

}  // namespace
}  // namespace tandem
