// The Transport contract (common/transport/transport.h), one suite run over
// every transport of transport_suite.h: the in-process fabric and UCX on each
// path (shared memory copying through segments, shared memory with cma
// rendezvous, TCP on lo). Ranks are threads of this process.
//
// Blocking operations (Send/Recv): ordered matching per (sender, receiver,
// tag) with mixed sizes and many threads, zero-byte to 8 MiB messages with
// the receive posted before or after, size mismatches naming both sizes,
// Wait timing out naming the peer and waitable again, dropped receives, a
// peer that goes away, and the CPU collectives over the transport.
// Operations with a completion (SendAsync/RecvAsync): completions run once,
// never inside the posting call and never two at once; they may post further
// operations and drop their own request; the same sizes, mismatches,
// timeouts and drops as above; a peer that goes away fails pending and later
// ones; Progress inside a completion does nothing; WaitPosted does not wait
// for itself.
//
// Label "concurrency": the TSan job runs it.
#include "common/transport/transport.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "common/mutex.h"
#include "tests/transport_suite.h"
#include "worker/collectives/collectives.h"

namespace tandem::testing {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using transport::Request;
using transport::Transport;

constexpr milliseconds kWait{10000};

double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

class TransportSuite : public ::testing::TestWithParam<TransportBackend> {
 protected:
  // n connected transports of this backend (null, with test failures, if
  // that fails).
  std::unique_ptr<TransportGroup> Connect(int n) { return GetParam().make_group(n); }
};

// ---------------------------------------------------------------------------
// Blocking operations.

TEST_P(TransportSuite, RanksKnowTheirRankAndTheGroupSize) {
  auto g = Connect(3);
  ASSERT_NE(g, nullptr);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ((*g)[r].rank(), r);
    EXPECT_EQ((*g)[r].size(), 3);
  }
}

TEST_P(TransportSuite, MessagesMatchInOrderPerSenderAndTag) {
  auto g = Connect(3);
  ASSERT_NE(g, nullptr);
  constexpr int kCount = 120;
  // Ranks 0 and 2 both send to rank 1 on tags 7 and 8, interleaved; every
  // 40th message is large (rendezvous on TCP), so protocols mix within a tag.
  auto size_of = [](int i) { return i % 40 == 39 ? size_t{300000} : sizeof(int64_t) * 4; };
  std::vector<std::vector<char>> out, in;
  std::vector<std::unique_ptr<Request>> sends, recvs;
  std::vector<std::tuple<int, uint64_t, int, size_t>> expect;  // sender, tag, index, slot
  // Receives for tag 8 first, then tag 7: matching is per tag.
  for (uint64_t tag : {8, 7}) {
    for (int sender : {0, 2}) {
      for (int i = 0; i < kCount; ++i) {
        in.emplace_back(size_of(i));
        recvs.push_back((*g)[1].Recv(sender, tag, in.back().data(), in.back().size()));
        expect.emplace_back(sender, tag, i, in.size() - 1);
      }
    }
  }
  std::vector<std::thread> senders;
  std::vector<std::vector<std::unique_ptr<Request>>> per_sender(3);
  std::vector<std::vector<std::vector<char>>> buffers(3);
  for (int sender : {0, 2}) {
    senders.emplace_back([&, sender] {
      auto& bufs = buffers[static_cast<size_t>(sender)];
      bufs.reserve(size_t{2} * kCount);
      for (int i = 0; i < kCount; ++i) {
        for (uint64_t tag : {7, 8}) {
          bufs.push_back(Pattern(size_of(i), sender * 1000 + static_cast<int>(tag) * 100 + i));
          std::memcpy(bufs.back().data(), &i, sizeof(i));
          per_sender[static_cast<size_t>(sender)].push_back(
              (*g)[sender].Send(1, tag, bufs.back().data(), bufs.back().size()));
        }
      }
      for (auto& r : per_sender[static_cast<size_t>(sender)]) EXPECT_TRUE(r->Wait(kWait).ok());
    });
  }
  for (auto& r : recvs) ASSERT_TRUE(r->Wait(kWait).ok());
  for (auto& t : senders) t.join();
  for (const auto& [sender, tag, i, slot] : expect) {
    int got = -1;
    std::memcpy(&got, in[slot].data(), sizeof(got));
    ASSERT_EQ(got, i) << "sender " << sender << " tag " << tag;
    auto want = Pattern(size_of(i), sender * 1000 + static_cast<int>(tag) * 100 + i);
    ASSERT_EQ(std::memcmp(in[slot].data() + sizeof(int), want.data() + sizeof(int), want.size() - sizeof(int)), 0);
  }
}

TEST_P(TransportSuite, ManyConcurrentTagsFromManyThreads) {
  constexpr int kRanks = 3;
  constexpr int kTags = 48;
  auto g = Connect(kRanks);
  ASSERT_NE(g, nullptr);
  auto bytes_of = [](int tag) { return static_cast<size_t>((tag * 997) % 20000 + 1); };
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    // One thread receives (tags in reverse order), one sends.
    threads.emplace_back([&, r] {
      std::vector<std::vector<char>> bufs;
      std::vector<std::unique_ptr<Request>> reqs;
      std::vector<std::pair<int, int>> what;
      bufs.reserve(static_cast<size_t>(kRanks) * kTags);
      for (int tag = kTags - 1; tag >= 0; --tag) {
        for (int p = 0; p < kRanks; ++p) {
          if (p == r) continue;
          bufs.emplace_back(bytes_of(tag));
          reqs.push_back((*g)[r].Recv(p, static_cast<uint64_t>(tag), bufs.back().data(), bufs.back().size()));
          what.emplace_back(p, tag);
        }
      }
      for (size_t i = 0; i < reqs.size(); ++i) {
        Status s = reqs[i]->Wait(kWait);
        if (!s.ok() || bufs[i] != Pattern(bytes_of(what[i].second), what[i].first * 100 + r * 10000 + what[i].second)) {
          ADD_FAILURE() << "rank " << r << " from " << what[i].first << " tag " << what[i].second << ": "
                        << s.ToString();
          ++failures;
        }
      }
    });
    threads.emplace_back([&, r] {
      std::vector<std::vector<char>> bufs;
      std::vector<std::unique_ptr<Request>> reqs;
      bufs.reserve(static_cast<size_t>(kRanks) * kTags);
      for (int tag = 0; tag < kTags; ++tag) {
        for (int p = 0; p < kRanks; ++p) {
          if (p == r) continue;
          bufs.push_back(Pattern(bytes_of(tag), r * 100 + p * 10000 + tag));
          reqs.push_back((*g)[r].Send(p, static_cast<uint64_t>(tag), bufs.back().data(), bufs.back().size()));
        }
      }
      for (auto& req : reqs) {
        Status s = req->Wait(kWait);
        if (!s.ok()) {
          ADD_FAILURE() << s.ToString();
          ++failures;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST_P(TransportSuite, ZeroOneAndEightMebibyteMessages) {
  auto g = Connect(2);
  ASSERT_NE(g, nullptr);
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{8} << 20}) {
    for (bool receive_first : {true, false}) {
      SCOPED_TRACE(::testing::Message() << bytes << " bytes, receive posted " << (receive_first ? "first" : "later"));
      const auto data = Pattern(bytes, static_cast<int>(bytes % 1000));
      std::vector<char> got(bytes, 0);
      std::unique_ptr<Request> recv;
      if (receive_first) recv = (*g)[1].Recv(0, 42, bytes ? got.data() : nullptr, bytes);
      auto send = (*g)[0].Send(1, 42, bytes ? data.data() : nullptr, bytes);
      if (!receive_first) {
        std::this_thread::sleep_for(milliseconds(20));  // the message arrives unexpected (or as a rendezvous offer)
        recv = (*g)[1].Recv(0, 42, bytes ? got.data() : nullptr, bytes);
      }
      ASSERT_TRUE(recv->Wait(kWait).ok());
      ASSERT_TRUE(send->Wait(kWait).ok());
      EXPECT_TRUE(got == data);
    }
  }
}

TEST_P(TransportSuite, SizeMismatchNamesBothSizes) {
  auto g = Connect(2);
  ASSERT_NE(g, nullptr);
  const std::vector<std::pair<size_t, size_t>> cases = {{32, 16},
                                                        {32, 64},
                                                        {0, 8},
                                                        {8, 0},
                                                        {100000, 50000},
                                                        {size_t{8} << 20, size_t{4} << 20},
                                                        {size_t{4} << 20, size_t{8} << 20}};
  uint64_t tag = 100;
  for (const auto& [sent, expected] : cases) {
    SCOPED_TRACE(::testing::Message() << "sent " << sent << ", expected " << expected);
    const auto data = Pattern(sent, 1);
    std::vector<char> got(expected);
    auto recv = (*g)[1].Recv(0, tag, got.data(), expected);
    auto send = (*g)[0].Send(1, tag, data.data(), sent);
    Status s = recv->Wait(kWait);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find("rank 0 sent " + std::to_string(sent) + " bytes"), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find("expected " + std::to_string(expected)), std::string::npos) << s.ToString();
    EXPECT_TRUE(send->Wait(kWait).ok());
    ++tag;
  }
  // The pair still works.
  int v = 7, w = 0;
  auto recv = (*g)[1].Recv(0, 1, &w, sizeof(w));
  ASSERT_TRUE((*g)[0].Send(1, 1, &v, sizeof(v))->Wait(kWait).ok());
  ASSERT_TRUE(recv->Wait(kWait).ok());
  EXPECT_EQ(w, 7);
}

TEST_P(TransportSuite, WaitTimesOutNamingThePeerAndCanWaitAgain) {
  auto g = Connect(2);
  ASSERT_NE(g, nullptr);
  int64_t got = 0;
  auto recv = (*g)[0].Recv(1, 5, &got, sizeof(got));
  const auto start = Clock::now();
  Status s = recv->Wait(milliseconds(50));
  EXPECT_GE(Seconds(Clock::now() - start), 0.045);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s.ToString();
  EXPECT_EQ(recv->Wait(milliseconds(10)).code(), StatusCode::kDeadlineExceeded);
  const int64_t value = 0x1234567890;
  ASSERT_TRUE((*g)[1].Send(0, 5, &value, sizeof(value))->Wait(kWait).ok());
  EXPECT_TRUE(recv->Wait(kWait).ok());
  EXPECT_TRUE(recv->Wait(milliseconds(0)).ok());  // done stays done
  EXPECT_EQ(got, value);
}

TEST_P(TransportSuite, DroppedReceivesAreCancelled) {
  auto g = Connect(2);
  ASSERT_NE(g, nullptr);
  const auto start = Clock::now();
  for (size_t bytes : {size_t{64}, size_t{8} << 20}) {
    auto buf = std::make_unique<char[]>(bytes);
    auto recv = (*g)[0].Recv(1, 3, buf.get(), bytes);
    recv.reset();  // cancelled: the transport no longer holds buf
    buf.reset();
  }
  EXPECT_LT(Seconds(Clock::now() - start), 2.0);
  // The message goes to the next receive, not to a dropped one.
  const auto data = Pattern(64, 3);
  std::vector<char> got(64);
  auto send = (*g)[1].Send(0, 3, data.data(), data.size());
  ASSERT_TRUE((*g)[0].Recv(1, 3, got.data(), got.size())->Wait(kWait).ok());
  EXPECT_TRUE(send->Wait(kWait).ok());
  EXPECT_TRUE(got == data);
}

TEST_P(TransportSuite, PeerThatClosesFailsPendingAndLaterOperations) {
  auto g = Connect(2);
  ASSERT_NE(g, nullptr);
  // Data sent before the close is still delivered.
  const int64_t last = 99;
  ASSERT_TRUE((*g)[1].Send(0, 4, &last, sizeof(last))->Wait(kWait).ok());
  int64_t got = 0;
  auto pending = (*g)[0].Recv(1, 9, &got, sizeof(got));
  const auto start = Clock::now();
  g->Close(1);
  Status s = pending->Wait(kWait);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s.ToString();
  EXPECT_LT(Seconds(Clock::now() - start), 3.0);
  int64_t before = 0;
  EXPECT_TRUE((*g)[0].Recv(1, 4, &before, sizeof(before))->Wait(kWait).ok());
  EXPECT_EQ(before, 99);
  Status later = (*g)[0].Send(1, 9, &got, sizeof(got))->Wait(kWait);
  EXPECT_EQ(later.code(), StatusCode::kUnavailable) << later.ToString();
  EXPECT_NE(later.message().find("rank 1"), std::string::npos) << later.ToString();
  EXPECT_EQ((*g)[0].Recv(1, 10, &got, sizeof(got))->Wait(kWait).code(), StatusCode::kUnavailable);
}

TEST_P(TransportSuite, CpuCollectives) {
  for (int n : {2, 3}) {
    SCOPED_TRACE(::testing::Message() << "world size " << n);
    auto g = Connect(n);
    ASSERT_NE(g, nullptr);
    std::vector<Status> results(static_cast<size_t>(n) * 5);
    std::vector<std::thread> threads;
    threads.reserve(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        auto& t = (*g)[r];
        auto result = [&](int i) -> Status& { return results[static_cast<size_t>(r) * 5 + static_cast<size_t>(i)]; };
        collectives::CollectiveOptions o;
        o.timeout = kWait;
        o.chunk_bytes = 256 << 10;
        // Large all-reduce (ring) and small (recursive doubling).
        for (size_t count : {size_t{1} << 20, size_t{5}}) {
          std::vector<float> data(count);
          for (size_t i = 0; i < count; ++i) data[i] = static_cast<float>((r + 1) * (i % 100));
          Status s = collectives::AllReduce(t, data.data(), count, collectives::DType::kFloat32,
                                            collectives::ReduceOp::kSum, o);
          const int sum_of_ranks = n * (n + 1) / 2;  // of (rank + 1) over the ranks
          const auto ranks_sum = static_cast<float>(sum_of_ranks);
          for (size_t i = 0; s.ok() && i < count; ++i) {
            if (data[i] != ranks_sum * static_cast<float>(i % 100)) {
              s = Internal("all-reduce element {} is {}, expected {}", i, data[i],
                           ranks_sum * static_cast<float>(i % 100));
            }
          }
          result(count == 5 ? 1 : 0) = s;
          o.tag++;
        }
        {
          const size_t count = 100000;
          std::vector<int32_t> in(count, r), out(count * static_cast<size_t>(n), -1);
          Status s = collectives::AllGather(t, in.data(), out.data(), count, collectives::DType::kInt32, o);
          for (size_t i = 0; s.ok() && i < out.size(); ++i) {
            if (out[i] != static_cast<int32_t>(i / count)) s = Internal("all-gather element {} is {}", i, out[i]);
          }
          result(2) = s;
          o.tag++;
        }
        {
          std::vector<int64_t> data(300000, r == n - 1 ? 42 : 0);
          Status s = collectives::Broadcast(t, data.data(), data.size(), collectives::DType::kInt64, n - 1, o);
          for (size_t i = 0; s.ok() && i < data.size(); ++i) {
            if (data[i] != 42) s = Internal("broadcast element {} is {}", i, data[i]);
          }
          result(3) = s;
          o.tag++;
        }
        result(4) = collectives::Barrier(t, o);
      });
    }
    for (auto& th : threads) th.join();
    for (size_t i = 0; i < results.size(); ++i)
      EXPECT_TRUE(results[i].ok()) << "rank " << i / 5 << " step " << i % 5 << ": " << results[i].ToString();
  }
}

// ---------------------------------------------------------------------------
// Operations with a completion.

// A chain: each receive's completion posts the next one and drops its own
// request, as the frame channel does; messages arrive in order. The sends'
// completions run once each, off the posting thread, and their requests can
// be waited on as well.
TEST_P(TransportSuite, CompletionsPostTheNextReceiveAndDropTheirOwnRequest) {
  auto g = Connect(2);
  ASSERT_NE(g, nullptr);
  Transport* a = g->get(0);
  Transport* b = g->get(1);
  constexpr int kCount = 20;
  struct Chain {
    Mutex mu;
    std::unique_ptr<Request> current TANDEM_GUARDED_BY(mu);
    int64_t value = -1;
    std::vector<int64_t> got TANDEM_GUARDED_BY(mu);
    CondVar cv;
  } chain;
  std::atomic<int> running{0}, overlaps{0};
  std::function<void()> post;
  post = [&]() TANDEM_REQUIRES(chain.mu) {
    // chain.current is empty.
    chain.current = b->RecvAsync(0, 11, &chain.value, sizeof(chain.value), [&](const Status& status) {
      EXPECT_TRUE(status.ok()) << status.ToString();
      if (running.fetch_add(1) != 0) overlaps.fetch_add(1);
      std::unique_ptr<Request> mine;  // this receive's request: destroyed last, outside the lock
      MutexLock lock(&chain.mu);
      chain.got.push_back(chain.value);
      if (chain.got.size() < kCount) {
        mine = std::move(chain.current);
        post();
      }
      chain.cv.NotifyAll();
      running.fetch_sub(1);
    });
  };
  {
    MutexLock lock(&chain.mu);
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
  EXPECT_FALSE(sent.overlapped());
  for (auto& s : sends) EXPECT_TRUE(s->Wait(milliseconds(0)).ok());  // also waitable
  MutexLock lock(&chain.mu);
  ASSERT_TRUE(chain.cv.WaitFor(lock, std::chrono::seconds(10),
                               [&]() TANDEM_REQUIRES(chain.mu) { return chain.got.size() == kCount; }));
  for (int i = 0; i < kCount; ++i) EXPECT_EQ(chain.got[static_cast<size_t>(i)], 1000 + i);
  EXPECT_EQ(overlaps.load(), 0);
  std::unique_ptr<Request> last = std::move(chain.current);
  lock.Unlock();
}

TEST_P(TransportSuite, AsyncZeroOneAndEightMebibyteMessages) {
  auto g = Connect(2);
  ASSERT_NE(g, nullptr);
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{8} << 20}) {
    for (bool receive_first : {true, false}) {
      SCOPED_TRACE(::testing::Message() << bytes << " bytes, receive posted " << (receive_first ? "first" : "later"));
      const auto data = Pattern(bytes, static_cast<int>(bytes % 1000) + 1);
      std::vector<char> got(bytes, 0);
      Completions received, sent;
      std::unique_ptr<Request> recv;
      if (receive_first) recv = (*g)[1].RecvAsync(0, 43, bytes ? got.data() : nullptr, bytes, received.Record());
      auto send = (*g)[0].SendAsync(1, 43, bytes ? data.data() : nullptr, bytes, sent.Record());
      if (!receive_first) {
        std::this_thread::sleep_for(milliseconds(20));
        recv = (*g)[1].RecvAsync(0, 43, bytes ? got.data() : nullptr, bytes, received.Record());
      }
      ASSERT_TRUE(received.WaitFor(1));
      ASSERT_TRUE(sent.WaitFor(1));
      EXPECT_TRUE(received.statuses()[0].ok()) << received.statuses()[0].ToString();
      EXPECT_TRUE(sent.statuses()[0].ok()) << sent.statuses()[0].ToString();
      EXPECT_TRUE(recv->Wait(kWait).ok());
      EXPECT_TRUE(send->Wait(kWait).ok());
      EXPECT_FALSE(received.ranOnCaller());
      EXPECT_FALSE(sent.ranOnCaller());
      EXPECT_TRUE(got == data);
    }
  }
}

// A size mismatch fails the receive's completion, naming both sizes.
TEST_P(TransportSuite, AsyncSizeMismatchFailsTheCompletionNamingBothSizes) {
  auto g = Connect(2);
  ASSERT_NE(g, nullptr);
  Completions done;
  int64_t small = 0;
  char big[16] = {};
  auto recv = (*g)[1].RecvAsync(0, 12, &small, sizeof(small), done.Record());
  auto send = (*g)[0].SendAsync(1, 12, big, sizeof(big), nullptr);
  ASSERT_TRUE(done.WaitFor(1));
  const Status s = done.statuses()[0];
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("16"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("8"), std::string::npos) << s.ToString();
  EXPECT_EQ(recv->Wait(kWait).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(send->Wait(kWait).ok());
}

TEST_P(TransportSuite, AsyncWaitTimesOutNamingThePeerAndCanWaitAgain) {
  auto g = Connect(2);
  ASSERT_NE(g, nullptr);
  Completions done;
  int64_t got = 0;
  auto recv = (*g)[0].RecvAsync(1, 6, &got, sizeof(got), done.Record());
  Status s = recv->Wait(milliseconds(50));
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s.ToString();
  EXPECT_TRUE(done.statuses().empty());
  const int64_t value = 0x1234567890;
  ASSERT_TRUE((*g)[1].Send(0, 6, &value, sizeof(value))->Wait(kWait).ok());
  EXPECT_TRUE(recv->Wait(kWait).ok());
  ASSERT_TRUE(done.WaitFor(1));
  EXPECT_TRUE(done.statuses()[0].ok()) << done.statuses()[0].ToString();
  EXPECT_EQ(got, value);
}

// A receive dropped before its message: its completion has run, with
// CANCELLED, when the drop returns; the message goes to the next receive.
TEST_P(TransportSuite, DroppedAsyncReceiveIsCancelledBeforeTheDropReturns) {
  auto g = Connect(2);
  ASSERT_NE(g, nullptr);
  Completions done;
  int64_t value = 0;
  auto recv = (*g)[1].RecvAsync(0, 13, &value, sizeof(value), done.Record());
  recv.reset();
  ASSERT_EQ(done.statuses().size(), 1u);
  EXPECT_EQ(done.statuses()[0].code(), StatusCode::kCancelled) << done.statuses()[0].ToString();
  EXPECT_FALSE(done.ranOnCaller());
  const int64_t sent = 77;
  Completions next;
  auto send = (*g)[0].SendAsync(1, 13, &sent, sizeof(sent), nullptr);
  auto again = (*g)[1].RecvAsync(0, 13, &value, sizeof(value), next.Record());
  ASSERT_TRUE(next.WaitFor(1));
  EXPECT_TRUE(next.statuses()[0].ok()) << next.statuses()[0].ToString();
  EXPECT_EQ(value, 77);
}

// A send whose request is dropped: the drop returns once its completion has
// run. One already handed to the network (WaitPosted) runs to completion; one
// dropped at once either did or was cancelled before it started.
TEST_P(TransportSuite, DroppedAsyncSendCompletesBeforeTheDropReturns) {
  auto g = Connect(2);
  ASSERT_NE(g, nullptr);
  for (bool started : {true, false}) {
    SCOPED_TRACE(started ? "started (WaitPosted) before the drop" : "dropped at once");
    const uint64_t tag = started ? 14 : 15;
    int64_t got = 0;
    const int64_t value = started ? 14 : 15;
    Completions received, sent;
    auto recv = (*g)[1].RecvAsync(0, tag, &got, sizeof(got), received.Record());
    auto send = (*g)[0].SendAsync(1, tag, &value, sizeof(value), sent.Record());
    if (started) (*g)[0].WaitPosted();
    send.reset();
    ASSERT_EQ(sent.statuses().size(), 1u);
    const Status s = sent.statuses()[0];
    if (started) {
      EXPECT_TRUE(s.ok()) << s.ToString();
    } else {
      EXPECT_TRUE(s.ok() || s.code() == StatusCode::kCancelled) << s.ToString();
    }
    if (s.ok()) {
      ASSERT_TRUE(received.WaitFor(1));
      EXPECT_TRUE(received.statuses()[0].ok()) << received.statuses()[0].ToString();
      EXPECT_EQ(got, value);
    }
  }
}

// A peer that goes away fails a pending receive's completion, and the
// completions of later operations with it.
TEST_P(TransportSuite, PeerThatClosesFailsPendingAndLaterAsyncOperations) {
  auto g = Connect(2);
  ASSERT_NE(g, nullptr);
  {
    Completions done;
    int64_t value = 0;
    auto recv = (*g)[1].RecvAsync(0, 14, &value, sizeof(value), done.Record());
    g->Close(0);
    ASSERT_TRUE(done.WaitFor(1));
    EXPECT_EQ(done.statuses()[0].code(), StatusCode::kUnavailable) << done.statuses()[0].ToString();
    EXPECT_NE(done.statuses()[0].message().find("rank 0"), std::string::npos) << done.statuses()[0].ToString();
    EXPECT_FALSE(done.ranOnCaller());
  }
  Completions later;
  int64_t value = 5;
  auto send = (*g)[1].SendAsync(0, 15, &value, sizeof(value), later.Record());
  auto recv = (*g)[1].RecvAsync(0, 16, &value, sizeof(value), later.Record());
  ASSERT_TRUE(later.WaitFor(2));
  for (const Status& s : later.statuses()) {
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
    EXPECT_NE(s.message().find("rank 0"), std::string::npos) << s.ToString();
  }
  EXPECT_FALSE(later.ranOnCaller());
  EXPECT_EQ(send->Wait(kWait).code(), StatusCode::kUnavailable);
  EXPECT_EQ(recv->Wait(kWait).code(), StatusCode::kUnavailable);
}

// Progress from outside runs completions (or says kBusy), never two at once;
// inside a completion it does nothing. WaitPosted with nothing posted, and
// inside a completion, returns at once.
TEST_P(TransportSuite, ProgressAndWaitPostedNeverRunCompletionsInsideOneAnother) {
  using Progressed = Transport::Progressed;
  auto g = Connect(2);
  ASSERT_NE(g, nullptr);
  (*g)[1].WaitPosted();  // nothing posted
  constexpr int kMessages = 100;
  std::vector<int64_t> in(kMessages, -1), out(kMessages);
  std::atomic<int> nested_not_busy{0};
  Completions done;
  std::vector<std::unique_ptr<Request>> recvs;
  for (int i = 0; i < kMessages; ++i) {
    recvs.push_back(
        (*g)[1].RecvAsync(0, 200, &in[static_cast<size_t>(i)], sizeof(int64_t), done.Record([&](const Status&) {
          if ((*g)[1].Progress() != Progressed::kBusy) nested_not_busy.fetch_add(1);
          (*g)[1].WaitPosted();
        })));
  }
  std::atomic<bool> stop{false};
  std::thread driver([&] {
    while (!stop.load()) (void)(*g)[1].Progress();
  });
  std::vector<std::unique_ptr<Request>> sends;
  for (int i = 0; i < kMessages; ++i) {
    out[static_cast<size_t>(i)] = i * 7;
    sends.push_back((*g)[0].Send(1, 200, &out[static_cast<size_t>(i)], sizeof(int64_t)));
  }
  const bool all = done.WaitFor(kMessages);
  stop.store(true);
  driver.join();
  ASSERT_TRUE(all);
  for (auto& send : sends) EXPECT_TRUE(send->Wait(kWait).ok());
  for (const Status& s : done.statuses()) EXPECT_TRUE(s.ok()) << s.ToString();
  for (int i = 0; i < kMessages; ++i) EXPECT_EQ(in[static_cast<size_t>(i)], i * 7) << "message " << i;
  EXPECT_FALSE(done.overlapped()) << "completions ran concurrently";
  EXPECT_EQ(nested_not_busy.load(), 0) << "Progress inside a completion must do nothing";
}

INSTANTIATE_TEST_SUITE_P(Transports, TransportSuite, ::testing::ValuesIn(AllTransportBackends()),
                         [](const ::testing::TestParamInfo<TransportBackend>& param_info) {
                           return param_info.param.name;
                         });

}  // namespace
}  // namespace tandem::testing
