// CPU lists and pinning (common/cpus.h): what `tandem run --bind` and a
// worker's `cpus` option rely on.
#include "common/cpus.h"

#include <sched.h>

#include <atomic>
#include <thread>

#include <gtest/gtest.h>

namespace tandem {
namespace {

std::vector<int> AffinityOf(pid_t tid) {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(sched_getaffinity(tid, sizeof(set), &set), 0);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

TEST(CpuListTest, ParsesNumbersAndRangesIntoSortedDistinctCpus) {
  EXPECT_EQ(*ParseCpuList("3"), (std::vector<int>{3}));
  EXPECT_EQ(*ParseCpuList("0-3,8,10-11"), (std::vector<int>{0, 1, 2, 3, 8, 10, 11}));
  EXPECT_EQ(*ParseCpuList("5,1-2,2,0"), (std::vector<int>{0, 1, 2, 5}));
  EXPECT_EQ(*ParseCpuList("4-4"), (std::vector<int>{4}));
}

TEST(CpuListTest, BadListsNameWhatIsWrong) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "empty"},
      {"a", "'a' is not a CPU number"},
      {"1,", "'' is not a CPU number"},
      {"3-1", "ends before"},
      {"-2", "'-2' is not"},
      {"0-x", "'0-x' is not"},
      {"99999", "above the largest"},
      {"1 ,2", "'1 ' is not"},
  };
  for (const auto& [text, want] : cases) {
    auto r = ParseCpuList(text);
    ASSERT_FALSE(r.ok()) << "'" << text << "'";
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << text;
    EXPECT_NE(r.status().message().find(want), std::string::npos) << text << ": " << r.status().message();
  }
}

TEST(CpuListTest, FormatsTheShortestListAndRoundTrips) {
  EXPECT_EQ(FormatCpuList({}), "");
  EXPECT_EQ(FormatCpuList({7}), "7");
  EXPECT_EQ(FormatCpuList({3, 0, 1, 2, 8, 10, 11, 11}), "0-3,8,10-11");
  for (const std::string text : {"0", "0-1", "0,2,4", "0-3,8,10-11", "1-2,5-9"}) {
    EXPECT_EQ(FormatCpuList(*ParseCpuList(text)), text);
  }
}

TEST(CpuShareTest, EveryCpuGoesToExactlyOneProcessWhenThereAreEnough) {
  const std::vector<int> allowed = {0, 1, 2, 3, 4, 5, 6, 8, 9, 10};
  for (int count = 1; count <= 10; ++count) {
    std::vector<int> seen;
    for (int i = 0; i < count; ++i) {
      const auto share = ShareOfCpus(allowed, i, count);
      ASSERT_FALSE(share.empty());
      // Shares differ by at most one CPU.
      EXPECT_LE(share.size(), allowed.size() / static_cast<size_t>(count) + 1);
      EXPECT_GE(share.size(), allowed.size() / static_cast<size_t>(count));
      seen.insert(seen.end(), share.begin(), share.end());
    }
    EXPECT_EQ(seen, allowed) << count << " processes";
  }
  EXPECT_EQ(ShareOfCpus({0, 1}, 0, 2), (std::vector<int>{0}));
  EXPECT_EQ(ShareOfCpus({0, 1}, 1, 2), (std::vector<int>{1}));
  EXPECT_EQ(ShareOfCpus({0, 1, 2, 3, 4}, 0, 2), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(ShareOfCpus({0, 1, 2, 3, 4}, 1, 2), (std::vector<int>{3, 4}));
}

TEST(CpuShareTest, MoreProcessesThanCpusShareThemRoundRobin) {
  const std::vector<int> allowed = {2, 5};
  EXPECT_EQ(ShareOfCpus(allowed, 0, 4), (std::vector<int>{2}));
  EXPECT_EQ(ShareOfCpus(allowed, 1, 4), (std::vector<int>{5}));
  EXPECT_EQ(ShareOfCpus(allowed, 2, 4), (std::vector<int>{2}));
  EXPECT_EQ(ShareOfCpus(allowed, 3, 4), (std::vector<int>{5}));
  // A process past the count (one added later) gets a valid share too.
  EXPECT_EQ(ShareOfCpus(allowed, 4, 2), (std::vector<int>{2}));
  EXPECT_TRUE(ShareOfCpus({}, 0, 2).empty());
  EXPECT_TRUE(ShareOfCpus(allowed, 0, 0).empty());
}

// Pinning is for good (a process may not widen its set past what it may use
// now), so it runs in a child process of its own.
void PinAndCheck() {
  const std::vector<int> all = AllowedCpus();
  if (all.empty()) _exit(2);
  std::atomic<bool> stop{false};
  std::atomic<pid_t> running_tid{0};
  std::thread running([&] {
    running_tid = static_cast<pid_t>(gettid());
    while (!stop) std::this_thread::yield();
  });
  while (running_tid.load() == 0) std::this_thread::yield();
  const std::vector<int> one = {all.back()};
  if (!BindProcess(one).ok()) _exit(3);
  if (AffinityOf(0) != one) _exit(4);
  if (AffinityOf(running_tid.load()) != one) _exit(5);  // a thread that already ran
  std::vector<int> later;
  std::thread([&] { later = AffinityOf(0); }).join();
  if (later != one) _exit(6);  // a thread started afterwards
  stop = true;
  running.join();
  _exit(0);
}

TEST(BindProcessTest, PinsThreadsThatExistAndThreadsStartedLater) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(PinAndCheck(), ::testing::ExitedWithCode(0), "");
}

TEST(BindProcessTest, CpusThisProcessMayNotUseAreRefusedAndChangeNothing) {
  const std::vector<int> all = AllowedCpus();
  const int missing = CPU_SETSIZE - 1;
  auto s = BindProcess({all.front(), missing});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find(std::to_string(missing) + " are not available"), std::string::npos) << s.message();
  EXPECT_EQ(AllowedCpus(), all);
  EXPECT_EQ(BindProcess({}).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem
