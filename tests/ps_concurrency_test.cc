// The parameter-server data path under concurrency (label "concurrency", so
// ThreadSanitizer runs it): FrameChannel request/response between ranks of
// an in-process transport, with many threads sending at once, payloads
// received straight into caller buffers, a peer that dies, and Stop while
// traffic flows; pulls handled on the completion thread beside pushes on the
// receiver threads; and a ParameterStore whose pushes and pulls arrive from many
// threads at once, as they do from the channel's threads. The in-process
// transport's own rules are checked, with every other transport's, by the
// shared transport suite (transport_test.cc).
#include <atomic>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <thread>

#include <gtest/gtest.h>

#include "common/mutex.h"
#include "common/transport/frame_channel.h"
#include "common/transport/local_transport.h"
#include "server/ps_core.h"

namespace tandem {
namespace {

using std::chrono::milliseconds;
using transport::FrameChannel;

// Rank 0 echoes every frame's payload back, incremented by one per byte.
TEST(FrameChannelTest, ManyThreadsRequestAndReplyInOrderPerPeer) {
  auto fabric = transport::LocalFabric::Create(3);
  auto t0 = fabric->Connect(0);
  auto t1 = fabric->Connect(1);
  auto t2 = fabric->Connect(2);
  std::unique_ptr<FrameChannel> server;
  FrameChannel::Handler sh;
  sh.on_frame = [&server](int peer, const ps::Frame& h, void* payload, std::vector<char>& owned) {
    std::vector<char> body(static_cast<const char*>(payload), static_cast<const char*>(payload) + h.payload_bytes);
    for (auto& c : body) c = static_cast<char>(c + 1);
    (void)owned;
    ps::Frame r = ps::ReplyTo(h, ps::FrameType::kPullReply);
    server->Send(peer, r, std::move(body));
  };
  server = std::make_unique<FrameChannel>(t0.get(), std::vector<int>{1, 2}, sh);

  struct Client {
    std::unique_ptr<FrameChannel> channel;
    Mutex mu;
    std::map<uint64_t, std::vector<char>> buffers TANDEM_GUARDED_BY(mu);  // request id -> destination
    std::atomic<int> answered{0};
  };
  Client clients[2];
  for (int c = 0; c < 2; ++c) {
    Client* cl = &clients[c];
    FrameChannel::Handler h;
    h.payload_buffer = [cl](int, const ps::Frame& f) -> void* {
      MutexLock lock(&cl->mu);
      return cl->buffers.at(f.request_id).data();
    };
    h.on_frame = [cl](int, const ps::Frame& f, void* payload, std::vector<char>&) {
      MutexLock lock(&cl->mu);
      EXPECT_EQ(payload, cl->buffers.at(f.request_id).data());  // straight into the caller's buffer
      cl->answered.fetch_add(1);
    };
    cl->channel = std::make_unique<FrameChannel>(c == 0 ? t1.get() : t2.get(), std::vector<int>{0}, h);
  }
  constexpr int kThreads = 4, kPerThread = 50;
  std::vector<std::thread> threads;
  std::atomic<uint64_t> next{1};
  for (int c = 0; c < 2; ++c) {
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, c] {
        for (int i = 0; i < kPerThread; ++i) {
          const uint64_t id = next.fetch_add(1);
          const size_t n = 1 + (id * 37) % 3000;
          std::vector<char> data(n, static_cast<char>(id));
          {
            MutexLock lock(&clients[c].mu);
            clients[c].buffers[id].assign(n, 0);
          }
          ps::Frame f;
          f.type = ps::FrameType::kPull;
          f.request_id = id;
          clients[c].channel->Send(0, f, std::move(data));
        }
      });
    }
  }
  for (auto& t : threads) t.join();
  for (auto& c : clients) {
    const auto deadline = std::chrono::steady_clock::now() + milliseconds(10000);
    while (c.answered.load() < kThreads * kPerThread && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(milliseconds(5));
    }
    EXPECT_EQ(c.answered.load(), kThreads * kPerThread);
    MutexLock lock(&c.mu);
    for (auto& [id, buf] : c.buffers) {
      for (char x : buf) ASSERT_EQ(x, static_cast<char>(static_cast<char>(id) + 1)) << "request " << id;
    }
  }
  // A peer that dies: the other side is told once, and later sends fail.
  std::atomic<int> failures{0};
  Status reported;
  Mutex mu;
  FrameChannel::Handler h;
  h.on_frame = [](int, const ps::Frame&, void*, std::vector<char>&) {};
  h.on_peer_failed = [&](int peer, const Status& s) {
    EXPECT_EQ(peer, 2);
    MutexLock lock(&mu);
    reported = s;
    failures.fetch_add(1);
  };
  clients[1].channel->Stop();
  server->Stop();
  server = std::make_unique<FrameChannel>(t0.get(), std::vector<int>{2}, h);
  fabric->Kill(2);
  const auto deadline = std::chrono::steady_clock::now() + milliseconds(5000);
  while (failures.load() == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(milliseconds(5));
  EXPECT_EQ(failures.load(), 1);
  {
    MutexLock lock(&mu);
    EXPECT_EQ(reported.code(), StatusCode::kUnavailable) << reported.ToString();
  }
  Status sent;
  server->Send(2, ps::Frame{}, std::vector<char>(8), [&](const Status& s) { sent = s; });
  EXPECT_FALSE(sent.ok());
  server->Stop();
  clients[0].channel->Stop();
}

// Stop returns only once every send's `done` has returned, also the `done`
// of a send that failed (its owner may be gone right after Stop).
TEST(FrameChannelTest, StopWaitsForTheDoneOfAFailedSend) {
  auto fabric = transport::LocalFabric::Create(2);
  auto t0 = fabric->Connect(0);
  auto t1 = fabric->Connect(1);
  FrameChannel::Handler h;
  h.on_frame = [](int, const ps::Frame&, void*, std::vector<char>&) {};
  FrameChannel channel(t1.get(), std::vector<int>{0}, h, /*start=*/false);
  fabric->Kill(0);
  std::atomic<bool> entered{false}, finished{false};
  Status status;
  channel.Send(0, ps::Frame{}, std::vector<char>(16), [&](const Status& s) {
    status = s;
    entered.store(true);
    std::this_thread::sleep_for(milliseconds(100));
    finished.store(true);
  });
  const auto deadline = std::chrono::steady_clock::now() + milliseconds(5000);
  while (!entered.load() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(milliseconds(1));
  ASSERT_TRUE(entered.load());
  channel.Stop();
  EXPECT_TRUE(finished.load());
  EXPECT_EQ(status.code(), StatusCode::kUnavailable) << status.ToString();
  EXPECT_EQ(channel.PeerStatus(0).code(), StatusCode::kUnavailable);  // the failed send failed the peer
}

thread_local bool t_inline = false;  // on_frame called from try_inline

// Most pulls and some pushes are handled where they arrive (try_inline), the
// other frames on the receiver thread, some of them slowly: each peer's
// frames are still handled one at a time and in the order sent, and both
// threads are used.
// Then Stop while frames flow: every send's `done` runs, and no handler
// after Stop.
TEST(FrameChannelTest, InlineAndThreadedFramesKeepEachPeersOrder) {
  auto fabric = transport::LocalFabric::Create(3);
  auto t0 = fabric->Connect(0);
  auto t1 = fabric->Connect(1);
  auto t2 = fabric->Connect(2);
  Mutex mu;
  std::map<int, std::vector<uint64_t>> handled;  // peer -> request ids
  std::set<std::thread::id> inline_threads, receiver_threads;
  std::atomic<int> in_handler[3] = {0, 0, 0};  // per peer
  std::atomic<int> overlapped{0};
  std::atomic<bool> stopped{false};
  std::atomic<int> after_stop{0};
  FrameChannel::Handler sh;
  sh.on_frame = [&](int peer, const ps::Frame& h, void* payload, std::vector<char>&) {
    if (stopped.load()) after_stop.fetch_add(1);
    if (in_handler[peer].fetch_add(1) > 0) overlapped.fetch_add(1);  // one frame of a peer at a time
    if (h.payload_bytes > 0) {
      EXPECT_EQ(static_cast<const char*>(payload)[0], static_cast<char>(h.request_id));
    }
    {
      MutexLock lock(&mu);
      handled[peer].push_back(h.request_id);
      (t_inline ? inline_threads : receiver_threads).insert(std::this_thread::get_id());
    }
    if (h.type == ps::FrameType::kPush && h.request_id % 7 == 0) std::this_thread::sleep_for(milliseconds(1));
    in_handler[peer].fetch_sub(1);
  };
  // Every third pull declines and goes to the receiver thread like most
  // pushes; pushes whose id is a multiple of 5 are taken inline.
  sh.try_inline = [&](int peer, const ps::Frame& h, void* payload, std::vector<char>& owned) {
    const bool push_inline = h.type == ps::FrameType::kPush && h.request_id % 5 == 0;
    if (!push_inline && (h.type != ps::FrameType::kPull || h.request_id % 3 == 1)) return false;
    t_inline = true;
    sh.on_frame(peer, h, payload, owned);
    t_inline = false;
    return true;
  };
  FrameChannel server(t0.get(), std::vector<int>{1, 2}, sh);
  FrameChannel::Handler ch;
  ch.on_frame = [](int, const ps::Frame&, void*, std::vector<char>&) {};
  FrameChannel c1(t1.get(), std::vector<int>{0}, ch);
  FrameChannel c2(t2.get(), std::vector<int>{0}, ch);
  constexpr uint64_t kFrames = 300;
  std::atomic<int> sent{0};
  auto send_all = [&](FrameChannel& c) {
    for (uint64_t id = 1; id <= kFrames; ++id) {
      ps::Frame f;
      f.type = id % 3 == 0 ? ps::FrameType::kPush : ps::FrameType::kPull;
      f.request_id = id;
      c.Send(0, f, std::vector<char>(1 + id % 5, static_cast<char>(id)), [&](const Status& s) {
        EXPECT_TRUE(s.ok()) << s.ToString();
        sent.fetch_add(1);
      });
    }
  };
  std::thread a([&] { send_all(c1); });
  std::thread b([&] { send_all(c2); });
  a.join();
  b.join();
  const auto deadline = std::chrono::steady_clock::now() + milliseconds(10000);
  auto total = [&] {
    MutexLock lock(&mu);
    return handled[1].size() + handled[2].size();
  };
  while (total() < 2 * kFrames && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(2));
  }
  {
    MutexLock lock(&mu);
    for (int peer : {1, 2}) {
      ASSERT_EQ(handled[peer].size(), kFrames) << "peer " << peer;
      for (uint64_t i = 0; i < kFrames; ++i) ASSERT_EQ(handled[peer][i], i + 1) << "peer " << peer;
    }
    EXPECT_FALSE(inline_threads.empty());
    EXPECT_FALSE(receiver_threads.empty());
    for (const auto& id : inline_threads) EXPECT_EQ(receiver_threads.count(id), 0u);
  }
  EXPECT_EQ(overlapped.load(), 0);
  EXPECT_EQ(sent.load(), static_cast<int>(2 * kFrames));

  // Stop while a client keeps sending.
  std::atomic<bool> go{true};
  std::atomic<int> done_calls{0}, posted{0};
  std::thread flood([&] {
    for (uint64_t id = 1; go.load(); ++id) {
      ps::Frame f;
      f.type = id % 2 == 0 ? ps::FrameType::kPush : ps::FrameType::kPull;
      f.request_id = id;
      posted.fetch_add(1);
      c1.Send(0, f, std::vector<char>(64, static_cast<char>(id)), [&](const Status&) { done_calls.fetch_add(1); });
    }
  });
  std::this_thread::sleep_for(milliseconds(20));
  server.Stop();
  stopped.store(true);
  std::this_thread::sleep_for(milliseconds(20));
  go.store(false);
  flood.join();
  c1.Stop();
  EXPECT_EQ(after_stop.load(), 0);
  EXPECT_EQ(done_calls.load(), posted.load());  // every send's done ran, by the time Stop returned
  c2.Stop();
}

class NoLinks : public server::ServerLinks {
 public:
  void SendShare(uint64_t, uint64_t, const std::vector<ps::ShareEntry>&) override {}
  void SendToBackup(uint64_t, const ps::Frame&, std::shared_ptr<const std::vector<float>>,
                    std::function<void(const Status&)> done) override {
    done(Status::Ok());
  }
  void SendJob(uint64_t, std::shared_ptr<const std::string>) override {}
};

// Contributors push from their own threads while pullers wait: every step is
// applied exactly once and the result equals pushes made one at a time.
TEST(ParameterStoreConcurrencyTest, ConcurrentPushesAndPullsGiveTheSequentialResult) {
  constexpr uint64_t kParams = 8192 + 500, kPartition = 1024;
  constexpr uint32_t kContributors = 4;
  constexpr uint64_t kSteps = 15;
  auto make = [&](NoLinks* links) {
    auto store = std::make_unique<server::ParameterStore>(server::StoreOptions{2}, links);
    v1::ShardMap map;
    map.set_partition_size(kPartition);
    map.set_parameter_count(kParams);
    map.set_version(1);
    for (uint32_t p = 0; p * kPartition < kParams; ++p) {
      auto* e = map.add_partitions();
      e->set_id(p);
      e->mutable_range()->set_begin(p * kPartition);
      e->mutable_range()->set_end(std::min(kParams, (p + 1) * kPartition));
      e->set_primary_member_id(1);
    }
    store->SetEpoch(1, 1, map, kContributors, 0);
    store->LinksReady(1);
    v1::InitializeParametersRequest init;
    init.set_job_id("job");
    init.set_epoch(1);
    auto* t = init.add_tensors();
    t->set_name("w");
    t->add_shape(static_cast<int64_t>(kParams));
    t->set_dtype(v1::DTYPE_FLOAT32);
    init.mutable_optimizer()->mutable_sgd()->set_lr(0.1);
    init.mutable_optimizer()->mutable_sgd()->set_momentum(0.9);
    auto* chunk = init.mutable_values()->add_chunks();
    chunk->mutable_range()->set_end(kParams);
    chunk->set_dtype(v1::DTYPE_FLOAT32);
    chunk->set_data(std::string(kParams * sizeof(float), '\0'));
    EXPECT_TRUE(store->Initialize(init).ok());
    return std::make_pair(std::move(store), map);
  };
  auto grad = [](uint64_t step, uint32_t c, uint32_t p, size_t n) {
    std::vector<float> g(n);
    std::mt19937 rng(static_cast<uint32_t>(step * 131 + c * 17 + p));
    std::uniform_real_distribution<float> d(-1, 1);
    for (auto& x : g) x = d(rng);
    return g;
  };
  auto push = [&](server::ParameterStore& store, const v1::ShardMap& map, uint64_t s, uint32_t c, uint32_t p) {
    const auto& r = map.partitions(static_cast<int>(p)).range();
    auto g = grad(s, c, p, r.end() - r.begin());
    ps::Frame h;
    h.type = ps::FrameType::kPush;
    h.epoch = 1;
    h.step = s;
    h.partition = p;
    h.contributor = c;
    h.contributors = kContributors;
    h.payload_bytes = g.size() * sizeof(float);
    std::atomic<bool> ok{false};
    store.Push(0, h, g.data(), [&ok](ps::Frame reply, server::ReplyBody) { ok = reply.status == 0; });
    EXPECT_TRUE(ok.load());
  };
  auto pull = [](server::ParameterStore& store, uint64_t s, uint32_t p, std::vector<float>* out,
                 std::atomic<int>* done) {
    ps::Frame h;
    h.type = ps::FrameType::kPull;
    h.epoch = 1;
    h.step = s;
    h.partition = p;
    store.Pull(0, h, [out, done](ps::Frame r, server::ReplyBody body) {
      EXPECT_EQ(r.status, 0);
      out->resize(body.size() / sizeof(float));
      std::memcpy(out->data(), body.data(), body.size());
      done->fetch_add(1);
    });
  };
  NoLinks links_a, links_b;
  // Not structured bindings: clang 14 cannot capture those in the lambdas below.
  auto made_a = make(&links_a);
  auto made_b = make(&links_b);
  auto& concurrent = made_a.first;
  auto& map = made_a.second;
  auto& sequential = made_b.first;
  auto& map_b = made_b.second;
  const uint32_t parts = static_cast<uint32_t>(map.partitions_size());
  std::vector<float> got, want;
  for (uint64_t s = 1; s <= kSteps; ++s) {
    // Pulls first (they wait), then every contributor pushes from its thread.
    std::vector<std::vector<float>> pulled(parts);
    std::atomic<int> done{0};
    std::thread puller([&] {
      for (uint32_t p = 0; p < parts; ++p) pull(*concurrent, s, p, &pulled[p], &done);
    });
    std::vector<std::thread> pushers;
    for (uint32_t c = 0; c < kContributors; ++c) {
      pushers.emplace_back([&, c] {
        for (uint32_t i = 0; i < parts; ++i) push(*concurrent, map, s, c, (i + c * 3) % parts);
      });
    }
    for (auto& t : pushers) t.join();
    puller.join();
    const auto deadline = std::chrono::steady_clock::now() + milliseconds(10000);
    while (done.load() < static_cast<int>(parts) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(milliseconds(1));
    }
    ASSERT_EQ(done.load(), static_cast<int>(parts)) << "step " << s;
    got.clear();
    for (auto& v : pulled) got.insert(got.end(), v.begin(), v.end());
    // The same step, one push at a time in contributor order.
    std::vector<std::vector<float>> seq(parts);
    std::atomic<int> seq_done{0};
    for (uint32_t p = 0; p < parts; ++p) {
      for (uint32_t c = 0; c < kContributors; ++c) push(*sequential, map_b, s, c, p);
    }
    for (uint32_t p = 0; p < parts; ++p) pull(*sequential, s, p, &seq[p], &seq_done);
    want.clear();
    for (auto& v : seq) want.insert(want.end(), v.begin(), v.end());
    ASSERT_EQ(got, want) << "step " << s;
  }
  EXPECT_EQ(concurrent->counters().updates.load(), kSteps * parts);
}

}  // namespace
}  // namespace tandem
