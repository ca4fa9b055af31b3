// ShardLoop (server/shard_loop.h): tasks run one at a time, in the order
// handed over from any thread; an idle loop runs a deferred task on its
// caller; posted and offloaded work runs on the loop's own thread, in order
// with the rest; Run waits for its task; Stop runs what is queued and drops
// what comes after.
#include "server/shard_loop.h"

#include <atomic>
#include <map>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace tandem::server {
namespace {

TEST(ShardLoopTest, TasksRunOneAtATimeInEachSendersOrder) {
  ShardLoop loop("test-shard");
  constexpr int kSenders = 4;
  constexpr int kTasks = 2000;
  // Touched only by tasks, which never overlap: no lock.
  std::map<int, std::vector<int>> seen;
  std::atomic<int> inside{0};
  std::atomic<int> overlapped{0};
  std::vector<std::thread> senders;
  for (int s = 0; s < kSenders; ++s) {
    senders.emplace_back([&, s] {
      for (int i = 0; i < kTasks; ++i) {
        auto task = [&, s, i] {
          if (inside.fetch_add(1) != 0) overlapped.fetch_add(1);
          seen[s].push_back(i);
          inside.fetch_sub(1);
        };
        // Every third task of a sender must run on the loop's thread.
        ASSERT_TRUE(i % 3 == 0 ? loop.Post(task) : loop.Defer(task));
      }
    });
  }
  for (auto& t : senders) t.join();
  ASSERT_TRUE(loop.Run([] {}));  // everything before it has run
  EXPECT_EQ(overlapped.load(), 0);
  for (int s = 0; s < kSenders; ++s) {
    ASSERT_EQ(seen[s].size(), static_cast<size_t>(kTasks)) << "sender " << s;
    for (int i = 0; i < kTasks; ++i) ASSERT_EQ(seen[s][static_cast<size_t>(i)], i) << "sender " << s;
  }
  EXPECT_EQ(loop.tasks_run(), static_cast<uint64_t>(kSenders * kTasks + 1));
  EXPECT_GE(loop.tasks_on_thread(), static_cast<uint64_t>(kSenders * ((kTasks + 2) / 3)));
}

TEST(ShardLoopTest, AnIdleLoopRunsADeferredTaskOnItsCaller) {
  ShardLoop loop;
  std::thread::id ran_on;
  bool in_loop = false;
  ASSERT_TRUE(loop.Defer([&] {
    ran_on = std::this_thread::get_id();
    in_loop = loop.InLoop();
  }));
  EXPECT_EQ(ran_on, std::this_thread::get_id());  // done before Defer returned
  EXPECT_TRUE(in_loop);
  EXPECT_FALSE(loop.InLoop());
  EXPECT_EQ(loop.tasks_on_thread(), 0u);
}

TEST(ShardLoopTest, PostedAndOffloadedWorkRunsOnTheLoopsThreadInOrder) {
  ShardLoop loop;
  const std::thread::id caller = std::this_thread::get_id();
  std::vector<int> order;
  std::map<int, std::thread::id> where;
  std::atomic<int> done{0};
  ASSERT_TRUE(loop.Defer([&] {
    order.push_back(1);
    where[1] = std::this_thread::get_id();
    // The rest of this task's work, on the loop's thread, before the tasks
    // queued after it; two offloads keep their order.
    loop.Offload([&] {
      order.push_back(2);
      where[2] = std::this_thread::get_id();
      loop.Offload([&] { order.push_back(3); });  // on the loop's thread: at once
      order.push_back(4);
    });
    loop.Offload([&] { order.push_back(5); });
    loop.Defer([&] { order.push_back(6); });  // inside the loop: at once
  }));
  ASSERT_TRUE(loop.Defer([&] {
    order.push_back(7);
    done.fetch_add(1);
  }));
  ASSERT_TRUE(loop.Post([&] {
    order.push_back(8);
    where[8] = std::this_thread::get_id();
    done.fetch_add(1);
  }));
  ASSERT_TRUE(loop.Run([] {}));
  EXPECT_EQ(done.load(), 2);
  EXPECT_EQ(order, (std::vector<int>{1, 6, 2, 3, 4, 5, 7, 8}));
  EXPECT_EQ(where[1], caller);
  EXPECT_NE(where[2], caller);
  EXPECT_NE(where[8], caller);
  EXPECT_EQ(where[2], where[8]);  // the loop's thread
}

TEST(ShardLoopTest, RunWaitsAndRunsAtOnceInsideTheLoop) {
  ShardLoop loop;
  std::vector<int> order;
  ASSERT_TRUE(loop.Post([&] {
    order.push_back(1);
    loop.Run([&] { order.push_back(2); });  // on the loop: no wait for itself
    order.push_back(3);
  }));
  ASSERT_TRUE(loop.Run([&] { order.push_back(4); }));
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3, 4}));
}

TEST(ShardLoopTest, StopRunsWhatIsQueuedAndDropsWhatComesAfter) {
  ShardLoop loop;
  std::atomic<int> ran{0};
  // A posted task holds the loop's thread while the others queue behind it.
  std::atomic<bool> release{false};
  ASSERT_TRUE(loop.Post([&] {
    while (!release.load()) std::this_thread::yield();
    ran.fetch_add(1);
  }));
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(loop.Defer([&] { ran.fetch_add(1); }));
  std::thread stopper([&] { loop.Stop(); });
  release.store(true);
  stopper.join();
  EXPECT_EQ(ran.load(), 11);
  EXPECT_FALSE(loop.Defer([&] { ran.fetch_add(1); }));
  EXPECT_FALSE(loop.Post([&] { ran.fetch_add(1); }));
  EXPECT_FALSE(loop.Run([&] { ran.fetch_add(1); }));
  EXPECT_EQ(ran.load(), 11);
  loop.Stop();  // again: nothing
}

}  // namespace
}  // namespace tandem::server
