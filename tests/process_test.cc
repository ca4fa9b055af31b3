#include "common/process.h"

#include <signal.h>

#include <gtest/gtest.h>

#include "test_util.h"

namespace tandem {
namespace {

using std::chrono::milliseconds;

Result<std::unique_ptr<Subprocess>> Spawn(std::vector<std::string> argv) {
  SpawnOptions options;
  options.argv = std::move(argv);
  return Subprocess::Spawn(options);
}

TEST(SubprocessTest, ReportsExitCodes) {
  auto ok = Spawn({"/bin/sh", "-c", "exit 0"});
  ASSERT_TRUE(ok.ok());
  auto exit = (*ok)->Wait(milliseconds(10000));
  ASSERT_TRUE(exit.ok());
  EXPECT_TRUE(exit->success());
  auto three = Spawn({"/bin/sh", "-c", "exit 3"});
  ASSERT_TRUE(three.ok());
  auto e3 = (*three)->Wait(milliseconds(10000));
  ASSERT_TRUE(e3.ok());
  EXPECT_EQ(e3->ToString(), "exit 3");
}

TEST(SubprocessTest, MissingProgramIsAClearError) {
  auto r = Spawn({"/nonexistent/tandem-server"});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("/nonexistent/tandem-server"), std::string::npos);
}

TEST(SubprocessTest, OutputGoesToTheFile) {
  testing::TempDir dir;
  SpawnOptions options;
  options.argv = {"/bin/sh", "-c", "echo out; echo err >&2"};
  options.output_file = dir.path() + "/log";
  auto p = Subprocess::Spawn(options);
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE((*p)->Wait(milliseconds(10000)).ok());
  EXPECT_EQ(testing::ReadFile(options.output_file), "out\nerr\n");
}

TEST(SubprocessTest, WaitTimesOutAndStopEscalatesToSigkill) {
  // The child ignores SIGTERM, so Stop must fall back to SIGKILL after the grace.
  auto p = Spawn({"/bin/sh", "-c", "trap '' TERM; sleep 30"});
  ASSERT_TRUE(p.ok());
  auto w = (*p)->Wait(milliseconds(50));
  EXPECT_EQ(w.status().code(), StatusCode::kDeadlineExceeded);
  const ExitInfo e = (*p)->Stop(milliseconds(200));
  EXPECT_FALSE(e.exited);
  EXPECT_EQ(e.signal, SIGKILL);
  EXPECT_EQ(e.ToString(), "killed by SIGKILL");
  EXPECT_FALSE((*p)->Signal(SIGTERM).ok());  // already reaped
}

TEST(SubprocessTest, DestructorKillsAndReapsTheChild) {
  pid_t pid = 0;
  {
    auto p = Spawn({"/bin/sleep", "30"});
    ASSERT_TRUE(p.ok());
    pid = (*p)->pid();
    EXPECT_TRUE((*p)->Running());
  }
  EXPECT_TRUE(testing::ProcessGroupGone(pid));
}

}  // namespace
}  // namespace tandem
