// The rules of transport.h for operations with a completion (SendAsync,
// RecvAsync), checked the same way on every transport (UCX on each path in
// ucx_transport_test, the in-process fabric in ps_concurrency_test).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/transport/transport.h"

namespace tandem::testing {

// Counts completions and waits for them.
class Completions {
 public:
  transport::Transport::Completion Record(std::function<void(const Status&)> also = nullptr) {
    return [this, also = std::move(also)](const Status& status) {
      if (also) also(status);
      std::lock_guard lock(mu_);
      statuses_.push_back(status);
      if (std::this_thread::get_id() == caller_) inside_caller_ = true;
      cv_.notify_all();
    };
  }
  // Waits for `n` completions in all (up to 10 s).
  bool WaitFor(size_t n) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(10), [&] { return statuses_.size() >= n; });
  }
  std::vector<Status> statuses() {
    std::lock_guard lock(mu_);
    return statuses_;
  }
  // Whether a completion ran on the thread that built this object (the one
  // posting): completions never run inside the posting call.
  bool ranOnCaller() {
    std::lock_guard lock(mu_);
    return inside_caller_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Status> statuses_;
  const std::thread::id caller_ = std::this_thread::get_id();
  bool inside_caller_ = false;
};

// `a` and `b` are ranks 0 and 1 of one group; `kill_a` makes rank 0 die (or
// close) as seen from `b`, as the last check.
inline void CheckAsyncCompletions(transport::Transport* a, transport::Transport* b,
                                  const std::function<void()>& kill_a) {
  using transport::Request;
  // A chain: each receive's completion posts the next one and drops its own
  // request, as the frame channel does; messages arrive in order.
  {
    constexpr int kCount = 20;
    struct Chain {
      std::mutex mu;
      std::unique_ptr<Request> current;
      int64_t value = -1;
      std::vector<int64_t> got;
      std::condition_variable cv;
    } chain;
    std::function<void()> post;
    post = [&] {
      // Called with chain.mu held and chain.current empty.
      chain.current = b->RecvAsync(0, 11, &chain.value, sizeof(chain.value), [&](const Status& status) {
        EXPECT_TRUE(status.ok()) << status.ToString();
        std::unique_ptr<Request> mine;  // this receive's request: destroyed last, outside the lock
        std::lock_guard lock(chain.mu);
        chain.got.push_back(chain.value);
        if (chain.got.size() < kCount) {
          mine = std::move(chain.current);
          post();
        }
        chain.cv.notify_all();
      });
    };
    {
      std::lock_guard lock(chain.mu);
      post();
    }
    Completions sent;
    std::vector<int64_t> values(kCount);
    std::vector<std::unique_ptr<Request>> sends;
    for (int i = 0; i < kCount; ++i) {
      values[static_cast<size_t>(i)] = 1000 + i;
      sends.push_back(a->SendAsync(1, 11, &values[static_cast<size_t>(i)], sizeof(int64_t), sent.Record()));
    }
    ASSERT_TRUE(sent.WaitFor(kCount));
    for (const Status& s : sent.statuses()) EXPECT_TRUE(s.ok()) << s.ToString();
    EXPECT_FALSE(sent.ranOnCaller());
    for (auto& s : sends) EXPECT_TRUE(s->Wait(std::chrono::milliseconds(0)).ok());  // also waitable
    std::unique_lock lock(chain.mu);
    ASSERT_TRUE(chain.cv.wait_for(lock, std::chrono::seconds(10), [&] { return chain.got.size() == kCount; }));
    for (int i = 0; i < kCount; ++i) EXPECT_EQ(chain.got[static_cast<size_t>(i)], 1000 + i);
    std::unique_ptr<Request> last = std::move(chain.current);
    lock.unlock();
  }
  // A size mismatch fails the receive's completion, naming both sizes.
  {
    Completions done;
    int64_t small = 0;
    char big[16] = {};
    auto recv = b->RecvAsync(0, 12, &small, sizeof(small), done.Record());
    auto send = a->SendAsync(1, 12, big, sizeof(big), nullptr);
    ASSERT_TRUE(done.WaitFor(1));
    const Status s = done.statuses()[0];
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find("16"), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find("8"), std::string::npos) << s.ToString();
  }
  // A receive dropped before its message: its completion has run, with
  // CANCELLED, when the drop returns; the message goes to the next receive.
  {
    Completions done;
    int64_t value = 0;
    auto recv = b->RecvAsync(0, 13, &value, sizeof(value), done.Record());
    recv.reset();
    ASSERT_EQ(done.statuses().size(), 1u);
    EXPECT_EQ(done.statuses()[0].code(), StatusCode::kCancelled) << done.statuses()[0].ToString();
    const int64_t sent = 77;
    Completions next;
    auto send = a->SendAsync(1, 13, &sent, sizeof(sent), nullptr);
    auto again = b->RecvAsync(0, 13, &value, sizeof(value), next.Record());
    ASSERT_TRUE(next.WaitFor(1));
    EXPECT_TRUE(next.statuses()[0].ok()) << next.statuses()[0].ToString();
    EXPECT_EQ(value, 77);
  }
  // A peer that goes away fails a pending receive's completion.
  {
    Completions done;
    int64_t value = 0;
    auto recv = b->RecvAsync(0, 14, &value, sizeof(value), done.Record());
    kill_a();
    ASSERT_TRUE(done.WaitFor(1));
    EXPECT_EQ(done.statuses()[0].code(), StatusCode::kUnavailable) << done.statuses()[0].ToString();
    EXPECT_NE(done.statuses()[0].message().find("rank 0"), std::string::npos) << done.statuses()[0].ToString();
    EXPECT_FALSE(done.ranOnCaller());
  }
}

}  // namespace tandem::testing
