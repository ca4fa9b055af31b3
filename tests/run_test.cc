// `tandem run` (what `make demo` runs): a whole local cluster comes up ready
// and goes down cleanly, on its own or on Ctrl-C.
#include <signal.h>

#include <gtest/gtest.h>

#include "common/process.h"
#include "test_util.h"

namespace tandem {
namespace {

using std::chrono::milliseconds;
using testing::BinDir;
using testing::RunCommand;

TEST(TandemRunTest, StartsAClusterShowsItReadyAndStopsItCleanly) {
  testing::TempDir dir;
  const auto r = RunCommand({BinDir() + "/tandem", "run", "--servers", "2", "--workers", "2", "--work-dir", dir.path()},
                            std::chrono::seconds(60));
  ASSERT_TRUE(r.exit.success()) << r.output;
  for (const std::string name : {"coordinator", "server-0", "server-1", "worker-0", "worker-1"}) {
    EXPECT_NE(r.output.find("  " + name + " "), std::string::npos) << name << "\n" << r.output;
    const std::string log = testing::ReadFile(dir.path() + "/" + name + ".log");
    EXPECT_NE(log.find("stopped cleanly"), std::string::npos) << name << ":\n" << log;
  }
  EXPECT_NE(r.output.find("All 5 processes are up and ready"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("Training is not available in this version of Tandem yet"), std::string::npos);
  EXPECT_NE(r.output.find("All processes stopped cleanly."), std::string::npos) << r.output;
}

TEST(TandemRunTest, CtrlCStopsAHeldCluster) {
  testing::TempDir dir;
  SpawnOptions options;
  options.argv = {BinDir() + "/tandem", "run", "--servers", "1", "--workers", "1", "--hold", "--work-dir", dir.path()};
  options.output_file = dir.path() + "/run.out";
  auto run = Subprocess::Spawn(options);
  ASSERT_TRUE(run.ok());
  bool holding = false;
  for (int i = 0; i < 600 && !holding; ++i) {
    holding = testing::ReadFile(options.output_file).find("Holding the cluster up") != std::string::npos;
    if (!holding) std::this_thread::sleep_for(milliseconds(50));
  }
  ASSERT_TRUE(holding) << testing::ReadFile(options.output_file);
  ASSERT_TRUE((*run)->Signal(SIGINT).ok());
  auto exit = (*run)->Wait(milliseconds(15000));
  ASSERT_TRUE(exit.ok()) << testing::ReadFile(options.output_file);
  EXPECT_TRUE(exit->success()) << testing::ReadFile(options.output_file);
  EXPECT_NE(testing::ReadFile(options.output_file).find("All processes stopped cleanly."), std::string::npos);
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
  const auto unknown = RunCommand({BinDir() + "/tandem", "frobnicate"});
  EXPECT_EQ(unknown.exit.ToString(), "exit 2");
  EXPECT_NE(unknown.output.find("unknown command 'frobnicate'"), std::string::npos);
}

}  // namespace
}  // namespace tandem
