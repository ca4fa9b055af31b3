// ShardLoop (server/shard_loop.h): tasks run on one thread, in the order
// handed over from any thread; a task that defers more work runs it at once;
// Run waits for its task; Stop runs what is queued and drops what comes
// after.
#include "server/shard_loop.h"

#include <atomic>
#include <map>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace tandem::server {
namespace {

TEST(ShardLoopTest, TasksRunOnOneThreadInEachSendersOrder) {
  ShardLoop loop("test-shard");
  constexpr int kSenders = 4;
  constexpr int kTasks = 2000;
  // Touched only by tasks: the loop is their one thread, so no lock.
  std::map<int, std::vector<int>> seen;
  std::thread::id loop_thread;
  std::atomic<int> other_threads{0};
  std::vector<std::thread> senders;
  for (int s = 0; s < kSenders; ++s) {
    senders.emplace_back([&, s] {
      for (int i = 0; i < kTasks; ++i) {
        ASSERT_TRUE(loop.Defer([&, s, i] {
          if (loop_thread == std::thread::id()) loop_thread = std::this_thread::get_id();
          if (std::this_thread::get_id() != loop_thread) other_threads.fetch_add(1);
          seen[s].push_back(i);
        }));
      }
    });
  }
  for (auto& t : senders) t.join();
  ASSERT_TRUE(loop.Run([] {}));  // everything before it has run
  EXPECT_EQ(other_threads.load(), 0);
  EXPECT_NE(loop_thread, std::this_thread::get_id());
  for (int s = 0; s < kSenders; ++s) {
    ASSERT_EQ(seen[s].size(), static_cast<size_t>(kTasks)) << "sender " << s;
    for (int i = 0; i < kTasks; ++i) ASSERT_EQ(seen[s][static_cast<size_t>(i)], i) << "sender " << s;
  }
  EXPECT_EQ(loop.tasks_run(), static_cast<uint64_t>(kSenders * kTasks + 1));
}

TEST(ShardLoopTest, DeferOnTheLoopRunsAtOnceAndRunWaits) {
  ShardLoop loop;
  std::vector<int> order;
  bool in_loop = false;
  ASSERT_TRUE(loop.Run([&] {
    in_loop = loop.InLoop();
    order.push_back(1);
    loop.Defer([&] { order.push_back(2); });  // before the rest of this task
    loop.Run([&] { order.push_back(3); });    // on the loop: at once, no wait for itself
    order.push_back(4);
  }));
  EXPECT_TRUE(in_loop);
  EXPECT_FALSE(loop.InLoop());
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3, 4}));
}

TEST(ShardLoopTest, StopRunsWhatIsQueuedAndDropsWhatComesAfter) {
  ShardLoop loop;
  std::atomic<int> ran{0};
  // The first task holds the loop while the others queue behind it.
  std::atomic<bool> release{false};
  ASSERT_TRUE(loop.Defer([&] {
    while (!release.load()) std::this_thread::yield();
    ran.fetch_add(1);
  }));
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(loop.Defer([&] { ran.fetch_add(1); }));
  std::thread stopper([&] { loop.Stop(); });
  release.store(true);
  stopper.join();
  EXPECT_EQ(ran.load(), 11);
  EXPECT_FALSE(loop.Defer([&] { ran.fetch_add(1); }));
  EXPECT_FALSE(loop.Run([&] { ran.fetch_add(1); }));
  EXPECT_EQ(ran.load(), 11);
  loop.Stop();  // again: nothing
}

}  // namespace
}  // namespace tandem::server
