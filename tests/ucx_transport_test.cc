// UcxTransport (common/transport/ucx_transport.h): what is particular to UCX.
// The rules of transport.h every transport keeps (matching, sizes, timeouts,
// drops, a peer that closes, completions, the CPU collectives) are checked
// on each UCX path by the shared suite, transport_test.cc; here: options,
// addresses and the handshake, path summaries, the tag layout, and on each
// path (copy through shared memory, cma rendezvous, TCP on lo) refused
// operations, WaitPosted, a close during a completion and Progress run by
// callers. Ranks are threads of this process, each with its own UCX contexts
// and workers, addresses exchanged in memory. A network send dropped before
// the peer takes it fails the peer. A peer that is SIGKILLed runs as a child
// process (this binary, re-run with a filter). As root, two child processes
// in two network namespaces (joined by a veth pair) check that such peers
// use the network and are woken at once (the test skips without root or
// `ip netns`).
//
// With TANDEM_UCX_BENCH=1, UcxBench.CopyVersusCma prints the bandwidth of
// large messages through posix/sysv segments and through cma.
#include "common/transport/ucx_transport.h"

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include "common/process.h"
#include "common/transport/ucx/net_device.h"
#include "tests/test_util.h"
#include "tests/transport_suite.h"
#include "worker/collectives/collectives.h"

namespace tandem::transport {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr milliseconds kWait = testing::kUcxWait;

UcxOptions TestOptions(const std::string& tls = "", bool prefer_copy_shm = true) {
  return testing::UcxTestOptions(tls, prefer_copy_shm);
}

using Group = testing::UcxGroup;

// n connected transports (empty, with test failures, if that fails); rank r
// uses options[r], or options[0] for all.
Group Connected(int n, const std::vector<UcxOptions>& options) {
  return testing::ConnectedUcx(n, options);
}

Group Connected(int n, const UcxOptions& options) {
  return testing::ConnectedUcx(n, options);
}

using testing::Pattern;

double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// ---------------------------------------------------------------------------
// Options, addresses, Connect.

TEST(UcxOptionsTest, BadOptionsNameTheOption) {
  struct Case {
    std::function<void(UcxOptions&)> set;
    const char* option;
  };
  const std::vector<Case> cases = {
      {[](UcxOptions& o) { o.tls = "posix,warp_drive"; }, "tls"},
      {[](UcxOptions& o) { o.tls = "all,tcp"; }, "tls"},
      {[](UcxOptions& o) { o.net_devices = "nosuchdev0"; }, "net_devices"},
      {[](UcxOptions& o) { o.net_devices = "lo;rm"; }, "net_devices"},
      {[](UcxOptions& o) { o.net_devices = "auto"; }, "net_devices"},  // the daemons resolve it
      {[](UcxOptions& o) { o.liveness_interval = milliseconds(0); }, "liveness_interval"},
      {[](UcxOptions& o) { o.keepalive_interval = milliseconds(1); }, "keepalive_interval"},
      {[](UcxOptions& o) { o.abandon_timeout = milliseconds(0); }, "abandon_timeout"},
      {[](UcxOptions& o) { o.close_timeout = milliseconds(-1); }, "close_timeout"},
      {[](UcxOptions& o) { o.hostname = "a b"; }, "hostname"},
      {[](UcxOptions& o) { o.progress = static_cast<UcxProgressMode>(7); }, "progress"},
  };
  for (const auto& c : cases) {
    UcxOptions o = TestOptions();
    c.set(o);
    auto t = UcxTransport::Create(o);
    ASSERT_FALSE(t.ok()) << c.option;
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << t.status().ToString();
    EXPECT_EQ(t.status().message().rfind(c.option, 0), 0u) << t.status().ToString();
  }
}

// The daemons' default net devices: the interface that carries the listen
// address (ucx/net_device.h).
TEST(UcxNetDeviceTest, InterfaceCarryingAnAddress) {
  using ucx::InterfaceCarrying;
  EXPECT_EQ(InterfaceCarrying("127.0.0.1"), "lo");
  EXPECT_EQ(InterfaceCarrying("127.0.0.2"), "lo");  // all of 127/8 is routed to lo
  EXPECT_EQ(InterfaceCarrying("::ffff:127.0.0.1"), "lo");
  if (!InterfaceCarrying("::1").empty()) {  // unless IPv6 is off
    EXPECT_EQ(InterfaceCarrying("::1"), "lo");
  }
  EXPECT_EQ(InterfaceCarrying("203.0.113.77"), "");  // TEST-NET-3: on no interface
  EXPECT_EQ(InterfaceCarrying("2001:db8::77"), "");
  EXPECT_EQ(InterfaceCarrying("0.0.0.0"), "");
  EXPECT_EQ(InterfaceCarrying("localhost"), "");  // numeric addresses only
  EXPECT_EQ(InterfaceCarrying(""), "");
}

TEST(UcxNetDeviceTest, AutoChoosesTheInterfaceOfTheListenAddress) {
  testing::TempDir sysfs;  // no RDMA devices
  for (const std::string setting : {"auto", "", " auto "}) {
    const auto c = ucx::ChooseNetDevices(setting, "127.0.0.1", "", sysfs.path());
    EXPECT_EQ(c.devices, "lo") << setting;
    EXPECT_FALSE(c.fallback);
    EXPECT_NE(c.why.find("lo carries the listen address 127.0.0.1"), std::string::npos) << c.why;
  }
  EXPECT_EQ(ucx::ChooseNetDevices("auto", "localhost", "", sysfs.path()).devices, "lo");  // a name is resolved
  EXPECT_EQ(ucx::ChooseNetDevices("auto", "127.0.0.1", "tcp", sysfs.path()).devices, "lo");
  EXPECT_EQ(ucx::ResolveNetDevices("auto", "127.0.0.1:0", "", "test.ucx_net_devices"), "lo");
  // Given devices, and all, stay as they are.
  for (const std::string setting : {"all", "eth0", "mlx5_0:1,mlx5_1:1"}) {
    const auto c = ucx::ChooseNetDevices(setting, "127.0.0.1", "", sysfs.path());
    EXPECT_EQ(c.devices, setting);
    EXPECT_FALSE(c.fallback);
  }
}

TEST(UcxNetDeviceTest, WildcardsAndAddressesOnNoInterfaceFallBackToAll) {
  for (const std::string host : {"0.0.0.0", "::", "::ffff:0.0.0.0"}) {
    const auto c = ucx::ChooseNetDevices("auto", host);
    EXPECT_EQ(c.devices, "all") << host;
    EXPECT_TRUE(c.fallback);
    EXPECT_FALSE(c.warn);  // the daemons' default listen address: said at info
    EXPECT_NE(c.why.find("wildcard"), std::string::npos) << c.why;
  }
  EXPECT_EQ(ucx::ResolveNetDevices("auto", "[::]:7600", "", "test.ucx_net_devices"), "all");
  EXPECT_EQ(ucx::ResolveNetDevices("", "0.0.0.0:7600", "", "test.ucx_net_devices"), "all");
  for (const std::string host : {"203.0.113.77", "2001:db8::77", "no-such-host.invalid"}) {
    const auto c = ucx::ChooseNetDevices("auto", host);
    EXPECT_EQ(c.devices, "all") << host;
    EXPECT_TRUE(c.fallback);
    EXPECT_TRUE(c.warn);
    EXPECT_NE(c.why.find(host), std::string::npos) << c.why;
  }
}

// A sysfs of RDMA devices: RoCE ports with GIDs on interfaces, an IPoIB
// interface, ports that are down.
TEST(UcxNetDeviceTest, RdmaPortsBoundToTheInterfaceJoinIt) {
  testing::TempDir sysfs;
  namespace fs = std::filesystem;
  auto port = [&](const std::string& dev, int p, const std::string& state, const std::vector<std::string>& ndevs) {
    const fs::path dir = fs::path(sysfs.path()) / "class/infiniband" / dev / "ports" / std::to_string(p);
    fs::create_directories(dir / "gid_attrs/ndevs");
    std::ofstream(dir / "state") << state << "\n";
    for (size_t i = 0; i < ndevs.size(); ++i) std::ofstream(dir / "gid_attrs/ndevs" / std::to_string(i)) << ndevs[i];
  };
  port("mlx5_0", 1, "4: ACTIVE", {"lo", "lo"});
  port("mlx5_1", 1, "1: DOWN", {"lo"});
  port("mlx5_2", 1, "4: ACTIVE", {"eth8"});
  port("mlx5_3", 1, "4: ACTIVE", {});
  port("mlx5_3", 2, "4: ACTIVE", {});
  const fs::path ib0 = fs::path(sysfs.path()) / "class/net/ib0";
  fs::create_directories(ib0 / "device/infiniband/mlx5_3");
  std::ofstream(ib0 / "type") << "32\n";
  std::ofstream(ib0 / "dev_port") << "1\n";  // port 2

  EXPECT_EQ(ucx::RdmaPortsOf("lo", sysfs.path()), std::vector<std::string>{"mlx5_0:1"});
  EXPECT_EQ(ucx::RdmaPortsOf("eth8", sysfs.path()), std::vector<std::string>{"mlx5_2:1"});
  EXPECT_EQ(ucx::RdmaPortsOf("ib0", sysfs.path()), std::vector<std::string>{"mlx5_3:2"});
  EXPECT_TRUE(ucx::RdmaPortsOf("eth9", sysfs.path()).empty());

  // Only the devices the transports can use: UCX warns of a named device
  // that none of them opens.
  EXPECT_EQ(ucx::ChooseNetDevices("auto", "127.0.0.1", "", sysfs.path()).devices, "lo,mlx5_0:1");
  EXPECT_EQ(ucx::ChooseNetDevices("auto", "127.0.0.1", "rc,sm", sysfs.path()).devices, "mlx5_0:1");
  EXPECT_EQ(ucx::ChooseNetDevices("auto", "127.0.0.1", "tcp", sysfs.path()).devices, "lo");
  EXPECT_EQ(ucx::ChooseNetDevices("auto", "127.0.0.1", "^ib", sysfs.path()).devices, "lo");
  EXPECT_EQ(ucx::ChooseNetDevices("auto", "127.0.0.1", "^cma", sysfs.path()).devices, "lo,mlx5_0:1");
  // Verbs only, and no port on the interface: all devices, with a warning.
  testing::TempDir none;
  const auto c = ucx::ChooseNetDevices("auto", "127.0.0.1", "rc", none.path());
  EXPECT_EQ(c.devices, "all");
  EXPECT_TRUE(c.warn);
}

TEST(UcxConnectTest, ChecksArgumentsAndAddresses) {
  auto t = UcxTransport::Create(TestOptions());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  UcxTransport& u = **t;
  EXPECT_FALSE(u.address().empty());
  EXPECT_LE(u.address().size(), 4096u);  // the coordinator's Endpoint.address limit
  EXPECT_EQ(u.rank(), -1);
  char byte = 0;
  EXPECT_EQ(u.Send(1, 0, &byte, 1)->Wait(milliseconds(0)).code(), StatusCode::kFailedPrecondition);

  Status s = u.Connect(0, 2, {u.address(), "garbage"}, milliseconds(1000));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s.ToString();
  // Connect is once only, even after a failure.
  EXPECT_EQ(u.Connect(0, 1, {u.address()}, milliseconds(1000)).code(), StatusCode::kFailedPrecondition);

  auto t2 = UcxTransport::Create(TestOptions());
  ASSERT_TRUE(t2.ok());
  EXPECT_EQ((*t2)->Connect(2, 2, {"", ""}, milliseconds(100)).code(), StatusCode::kInvalidArgument);
  auto t3 = UcxTransport::Create(TestOptions());
  ASSERT_TRUE(t3.ok());
  EXPECT_EQ((*t3)->Connect(0, 3, {"", ""}, milliseconds(100)).code(), StatusCode::kInvalidArgument);
}

TEST(UcxConnectTest, SingleRankGroup) {
  auto t = UcxTransport::Create(TestOptions());
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*t)->Connect(0, 1, {(*t)->address()}, milliseconds(1000)).ok());
  EXPECT_EQ((*t)->size(), 1);
  EXPECT_TRUE((*t)->PathSummary().empty());
  char b = 0;
  EXPECT_EQ((*t)->Send(0, 1, &b, 1)->Wait(milliseconds(0)).code(), StatusCode::kInvalidArgument);
}

TEST(UcxConnectTest, HandshakeTimeoutNamesThePeer) {
  // Rank 1 never connects: rank 0's handshake times out naming it.
  auto a = UcxTransport::Create(TestOptions());
  auto b = UcxTransport::Create(TestOptions());
  ASSERT_TRUE(a.ok() && b.ok());
  const auto start = Clock::now();
  Status s = (*a)->Connect(0, 2, {(*a)->address(), (*b)->address()}, milliseconds(300));
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s.ToString();
  EXPECT_LT(Seconds(Clock::now() - start), 3.0);
}

TEST(UcxPathSummaryTest, DescribesSharedMemoryAndTcp) {
  {
    Group g = Connected(2, TestOptions());
    ASSERT_EQ(g.size(), 2u);
    const auto lines = g[0]->PathSummary();
    ASSERT_EQ(lines.size(), 1u);
    EXPECT_NE(lines[0].find("rank 0 -> rank 1"), std::string::npos) << lines[0];
    EXPECT_NE(lines[0].find("(shared memory)"), std::string::npos) << lines[0];
    EXPECT_NE(lines[0].find("at every size"), std::string::npos) << lines[0];  // eager through segments
    EXPECT_NE(lines[0].find("pid check"), std::string::npos) << lines[0];
    EXPECT_EQ(lines[0].find("tcp"), std::string::npos) << lines[0];
  }
  {
    Group g = Connected(2, TestOptions("", /*prefer_copy_shm=*/false));
    ASSERT_EQ(g.size(), 2u);
    const auto line = g[1]->PathSummary().at(0);
    EXPECT_NE(line.find("rank 1 -> rank 0"), std::string::npos) << line;
    EXPECT_NE(line.find("cma/memory"), std::string::npos) << line;
  }
  {
    Group g = Connected(2, TestOptions("tcp"));
    ASSERT_EQ(g.size(), 2u);
    const auto line = g[0]->PathSummary().at(0);
    EXPECT_NE(line.find("tcp/lo (TCP)"), std::string::npos) << line;
    EXPECT_NE(line.find("rendezvous"), std::string::npos) << line;
    EXPECT_NE(line.find("UCX error handling"), std::string::npos) << line;
  }
}

TEST(UcxPathSummaryTest, PeersOnOtherHostsUseTheNetworkWorker) {
  // Rank 2 says it is on another host: ranks 0 and 1 share memory, and reach
  // rank 2 over TCP with UCX's failure handling; one collective uses both.
  std::vector<UcxOptions> options(3, TestOptions());
  options[0].hostname = options[1].hostname = "node-a";
  options[2].hostname = "node-b";
  Group g = Connected(3, options);
  ASSERT_EQ(g.size(), 3u);
  const auto lines = g[0]->PathSummary();
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[0].find("rank 0 -> rank 1 (same host, shared memory)"), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find("rank 0 -> rank 2 (host node-b)"), std::string::npos) << lines[1];
  EXPECT_NE(lines[1].find("tcp/lo (TCP)"), std::string::npos) << lines[1];
  EXPECT_NE(lines[1].find("UCX error handling"), std::string::npos) << lines[1];
  EXPECT_EQ(lines[1].find("pid check"), std::string::npos) << lines[1];  // not on this host

  std::vector<Status> results(3);
  std::vector<std::vector<int64_t>> data(3, std::vector<int64_t>(300000));
  std::vector<std::thread> threads;
  threads.reserve(3);
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      auto& d = data[static_cast<size_t>(r)];
      std::iota(d.begin(), d.end(), int64_t{r});
      collectives::CollectiveOptions o;
      o.timeout = kWait;
      results[static_cast<size_t>(r)] = collectives::AllReduce(
          *g[static_cast<size_t>(r)], d.data(), d.size(), collectives::DType::kInt64, collectives::ReduceOp::kSum, o);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(results[static_cast<size_t>(r)].ok()) << results[static_cast<size_t>(r)].ToString();
    for (size_t i = 0; i < data[0].size(); i += 997) {
      ASSERT_EQ(data[static_cast<size_t>(r)][i], static_cast<int64_t>(3 * i + 3)) << "rank " << r << " element " << i;
    }
  }
}

TEST(UcxTagTest, TagsOutsideTheLayoutAreRejected) {
  Group g = Connected(2, TestOptions());
  ASSERT_EQ(g.size(), 2u);
  char b = 0;
  Status s = g[0]->Send(1, uint64_t{1} << 40, &b, 1)->Wait(milliseconds(0));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_EQ(g[0]->Recv(1, uint64_t{1} << 62, &b, 1)->Wait(milliseconds(0)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g[0]->Send(2, 0, &b, 1)->Wait(milliseconds(0)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g[0]->Send(0, 0, &b, 1)->Wait(milliseconds(0)).code(), StatusCode::kInvalidArgument);
  // Bit 63 with the low 40 bits is fine, and distinct from the same low bits without it.
  const uint64_t high = UcxTransport::kTagHighBit | UcxTransport::kMaxUserTag;
  int x = 1, y = 2, rx = 0, ry = 0;
  auto r1 = g[1]->Recv(0, high, &rx, sizeof(rx));
  auto r2 = g[1]->Recv(0, UcxTransport::kMaxUserTag, &ry, sizeof(ry));
  ASSERT_TRUE(g[0]->Send(1, UcxTransport::kMaxUserTag, &y, sizeof(y))->Wait(kWait).ok());
  ASSERT_TRUE(g[0]->Send(1, high, &x, sizeof(x))->Wait(kWait).ok());
  ASSERT_TRUE(r1->Wait(kWait).ok());
  ASSERT_TRUE(r2->Wait(kWait).ok());
  EXPECT_EQ(rx, 1);
  EXPECT_EQ(ry, 2);
}

// ---------------------------------------------------------------------------
// What UCX adds, on each path, to the rules of transport.h (the rules
// themselves are checked on every path by the shared suite,
// transport_test.cc): refused operations complete on the progress thread,
// WaitPosted, a send started inside the last completion before a close, and
// Progress run by callers.

using PathConfig = testing::UcxPath;

class UcxPathTest : public ::testing::TestWithParam<PathConfig> {
 protected:
  UcxOptions Options() const { return TestOptions(GetParam().tls, GetParam().prefer_copy_shm); }
};

TEST_P(UcxPathTest, RefusedOperationsStillCompleteOnTheProgressThread) {
  Group g = Connected(2, Options());
  ASSERT_EQ(g.size(), 2u);
  testing::Completions done;
  int64_t value = 0;
  auto bad_peer = g[0]->SendAsync(5, 1, &value, sizeof(value), done.Record());
  auto bad_tag = g[0]->RecvAsync(1, uint64_t{1} << 50, &value, sizeof(value), done.Record());
  ASSERT_TRUE(done.WaitFor(2));
  for (const Status& s : done.statuses()) EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_FALSE(done.ranOnCaller());
  EXPECT_EQ(bad_peer->Wait(kWait).code(), StatusCode::kInvalidArgument);
}

// WaitPosted returns once the operations posted before it are started by
// the progress thread: a refused one is finished right there, so its
// completion has run by then. From the progress thread itself (a
// completion) it returns at once instead of waiting for itself.
TEST_P(UcxPathTest, WaitPostedReturnsOnceEarlierOperationsAreStarted) {
  Group g = Connected(2, Options());
  ASSERT_EQ(g.size(), 2u);
  g[0]->WaitPosted();  // nothing posted
  int64_t value = 0;
  for (int i = 0; i < 50; ++i) {
    std::atomic<bool> finished{false};
    auto request = g[0]->SendAsync(5, 1, &value, sizeof(value), [&](const Status&) { finished.store(true); });
    g[0]->WaitPosted();
    EXPECT_TRUE(finished.load()) << "iteration " << i;
    EXPECT_EQ(request->Wait(kWait).code(), StatusCode::kInvalidArgument);
  }
  std::atomic<bool> inside{false};
  const auto start = std::chrono::steady_clock::now();
  auto request = g[0]->SendAsync(5, 1, &value, sizeof(value), [&](const Status&) {
    g[0]->WaitPosted();
    inside.store(true);
  });
  (void)request->Wait(kWait);
  request.reset();  // returns once the completion has run
  EXPECT_TRUE(inside.load());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(500))
      << "WaitPosted on the progress thread waited for itself";
}

// Inside a completion, WaitPosted starts what the completion posted at once,
// in order, so that a reply does not wait for the work its sender goes on
// with: the peer receives it while the completion still runs. The sends'
// own completions run after that completion returns, never inside it.
thread_local bool t_in_outer_completion = false;

TEST_P(UcxPathTest, WaitPostedInsideACompletionStartsItsSendsBeforeItReturns) {
  Group g = Connected(2, Options());
  ASSERT_EQ(g.size(), 2u);
  for (int round = 0; round < 20; ++round) {
    std::atomic<int> arrived{0};
    int64_t header = -1;
    std::vector<char> body(256, 0);
    auto on_arrival = [&](const Status& s) {
      EXPECT_TRUE(s.ok()) << s.ToString();
      arrived.fetch_add(1);
    };
    auto recv_header = g[1]->RecvAsync(0, 11, &header, sizeof(header), on_arrival);
    auto recv_body = g[1]->RecvAsync(0, 12, body.data(), body.size(), on_arrival);
    const int64_t sent_header = round;
    std::vector<char> sent_body(256, static_cast<char>('a' + round));
    std::unique_ptr<Request> send_header, send_body;
    std::atomic<int> sends_done{0}, sends_done_inside{0};
    std::atomic<bool> arrived_inside{false}, returned{false};
    auto on_sent = [&](const Status& s) {
      EXPECT_TRUE(s.ok()) << s.ToString();
      if (t_in_outer_completion) sends_done_inside.fetch_add(1);
      sends_done.fetch_add(1);
    };
    int64_t trigger = 0;
    auto request = g[0]->RecvAsync(1, 10, &trigger, sizeof(trigger), [&](const Status& s) {
      EXPECT_TRUE(s.ok()) << s.ToString();
      t_in_outer_completion = true;
      send_header = g[0]->SendAsync(1, 11, &sent_header, sizeof(sent_header), on_sent);
      send_body = g[0]->SendAsync(1, 12, sent_body.data(), sent_body.size(), on_sent);
      g[0]->WaitPosted();
      // Rank 1's own progress thread receives them meanwhile.
      const auto until = Clock::now() + std::chrono::seconds(5);
      while (arrived.load() < 2 && Clock::now() < until) std::this_thread::yield();
      arrived_inside.store(arrived.load() == 2);
      t_in_outer_completion = false;
      returned.store(true);
    });
    const int64_t go = 1;
    ASSERT_TRUE(g[1]->Send(0, 10, &go, sizeof(go))->Wait(kWait).ok());
    const auto deadline = Clock::now() + kWait;
    while ((!returned.load() || sends_done.load() < 2 || arrived.load() < 2) && Clock::now() < deadline) {
      std::this_thread::sleep_for(milliseconds(1));
    }
    ASSERT_TRUE(returned.load()) << "round " << round;
    EXPECT_TRUE(arrived_inside.load()) << "round " << round << ": the sends waited for the completion to return";
    EXPECT_EQ(sends_done.load(), 2) << "round " << round;
    EXPECT_EQ(sends_done_inside.load(), 0) << "round " << round << ": a send's completion ran inside another one";
    EXPECT_EQ(header, round);
    EXPECT_EQ(body, sent_body) << "round " << round;
    request.reset();
    send_header.reset();
    send_body.reset();
  }
}

// A send started inside the last completion before the transport closes
// (WaitPosted) and ended at once still has its completion run, by the close.
TEST_P(UcxPathTest, SendsStartedInsideTheLastCompletionCompleteAtClose) {
  Group g = Connected(2, Options());
  ASSERT_EQ(g.size(), 2u);
  std::atomic<bool> entered{false}, sent_done{false};
  std::atomic<int> sent_code{-1};
  int64_t trigger = 0, value = 7, got = 0;
  std::unique_ptr<Request> send;
  auto recv_got = g[1]->Recv(0, 21, &got, sizeof(got));
  auto request = g[0]->RecvAsync(1, 20, &trigger, sizeof(trigger), [&](const Status& s) {
    EXPECT_TRUE(s.ok()) << s.ToString();
    send = g[0]->SendAsync(1, 21, &value, sizeof(value), [&](const Status& st) {
      sent_code.store(static_cast<int>(st.code()));
      sent_done.store(true);
    });
    g[0]->WaitPosted();
    entered.store(true);
    std::this_thread::sleep_for(milliseconds(200));  // the transport starts closing meanwhile
  });
  const int64_t go = 1;
  ASSERT_TRUE(g[1]->Send(0, 20, &go, sizeof(go))->Wait(kWait).ok());
  const auto deadline = Clock::now() + kWait;
  while (!entered.load() && Clock::now() < deadline) std::this_thread::sleep_for(milliseconds(1));
  ASSERT_TRUE(entered.load());
  g[0].reset();  // returns once the progress thread has closed the transport
  EXPECT_TRUE(sent_done.load()) << "the send's completion never ran";
  EXPECT_EQ(sent_code.load(), static_cast<int>(StatusCode::kOk));
  EXPECT_TRUE(recv_got->Wait(kWait).ok());
  EXPECT_EQ(got, 7);
  if (!sent_done.load()) (void)send.release();  // dropping it would wait for ever
}

// A caller may run the progress loop itself (Progress): completions then run
// on it, never on a thread that is neither the progress thread nor inside
// Progress, and never two at once, while two callers and the progress thread
// compete for the role.
thread_local bool t_in_progress_call = false;

TEST_P(UcxPathTest, ProgressRunsCompletionsOnTheCallingThreadOneAtATime) {
  using Progressed = Transport::Progressed;
  {
    auto unconnected = UcxTransport::Create(TestOptions());
    ASSERT_TRUE(unconnected.ok()) << unconnected.status().ToString();
    EXPECT_EQ(unconnected.value()->Progress(), Progressed::kBusy);  // nothing to drive before Connect
  }
  Group g = Connected(2, Options());
  ASSERT_EQ(g.size(), 2u);
  constexpr int kMessages = 300;
  std::vector<int64_t> in(kMessages, -1);
  std::atomic<int> running{0}, overlaps{0}, on_caller{0}, on_progress_thread{0}, elsewhere{0}, nested_not_busy{0};
  std::atomic<int> received{0};
  std::vector<std::unique_ptr<Request>> recvs;
  for (int i = 0; i < kMessages; ++i) {
    recvs.push_back(g[1]->RecvAsync(0, 100 + static_cast<uint64_t>(i), &in[static_cast<size_t>(i)], sizeof(int64_t),
                                    [&](const Status& s) {
                                      EXPECT_TRUE(s.ok()) << s.ToString();
                                      if (running.fetch_add(1) != 0) overlaps.fetch_add(1);
                                      char name[16] = {};
                                      pthread_getname_np(pthread_self(), name, sizeof(name));
                                      if (t_in_progress_call) {
                                        on_caller.fetch_add(1);
                                      } else if (std::string(name) == "tandem-ucx") {
                                        on_progress_thread.fetch_add(1);
                                      } else {
                                        elsewhere.fetch_add(1);
                                      }
                                      if (g[1]->Progress() != Progressed::kBusy) nested_not_busy.fetch_add(1);
                                      running.fetch_sub(1);
                                      received.fetch_add(1);
                                    }));
  }
  const auto deadline = Clock::now() + kWait;
  auto drive = [&] {
    while (received.load() < kMessages && Clock::now() < deadline) {
      t_in_progress_call = true;
      (void)g[1]->Progress();
      t_in_progress_call = false;
    }
  };
  std::thread other(drive);
  std::vector<int64_t> out(kMessages);
  std::vector<std::unique_ptr<Request>> sends;
  for (int i = 0; i < kMessages; ++i) {
    out[static_cast<size_t>(i)] = i * 7;
    sends.push_back(g[0]->Send(1, 100 + static_cast<uint64_t>(i), &out[static_cast<size_t>(i)], sizeof(int64_t)));
  }
  drive();
  other.join();
  for (auto& send : sends) EXPECT_TRUE(send->Wait(kWait).ok());
  ASSERT_EQ(received.load(), kMessages);
  for (int i = 0; i < kMessages; ++i) EXPECT_EQ(in[static_cast<size_t>(i)], i * 7) << "message " << i;
  EXPECT_EQ(overlaps.load(), 0) << "completions ran concurrently";
  EXPECT_EQ(elsewhere.load(), 0) << "a completion ran outside the progress thread and Progress";
  EXPECT_EQ(nested_not_busy.load(), 0) << "Progress inside a completion must do nothing";
  EXPECT_EQ(on_caller.load() + on_progress_thread.load(), kMessages);
  // A completion that drives another transport keeps its own role: a request
  // of its transport dropped there afterwards does not wait (it would wait
  // for itself).
  Group other_group = Connected(2, Options());
  ASSERT_EQ(other_group.size(), 2u);
  std::atomic<bool> nested_done{false};
  int64_t nested_value = 0, unused = 0;
  auto nested = g[1]->RecvAsync(0, 5, &nested_value, sizeof(nested_value), [&](const Status& s) {
    EXPECT_TRUE(s.ok()) << s.ToString();
    (void)other_group[1]->Progress();
    auto pending = g[1]->RecvAsync(0, 6, &unused, sizeof(unused), [](const Status&) {});
    pending.reset();  // must not wait for this thread's own round
    nested_done.store(true);
  });
  const int64_t five = 5;
  EXPECT_TRUE(g[0]->Send(1, 5, &five, sizeof(five))->Wait(kWait).ok());
  const auto nested_deadline = Clock::now() + kWait;
  while (!nested_done.load() && Clock::now() < nested_deadline) std::this_thread::sleep_for(milliseconds(1));
  EXPECT_TRUE(nested_done.load()) << "a dropped request waited inside a completion";
  EXPECT_EQ(nested_value, 5);
  // A request waited on the usual way still completes while callers drive.
  int64_t value = 42, got = 0;
  auto recv = g[1]->Recv(0, 7, &got, sizeof(got));
  std::thread driver([&] {
    for (int i = 0; i < 1000; ++i) (void)g[1]->Progress();
  });
  EXPECT_TRUE(g[0]->Send(1, 7, &value, sizeof(value))->Wait(kWait).ok());
  EXPECT_TRUE(recv->Wait(kWait).ok());
  driver.join();
  EXPECT_EQ(got, 42);
}

INSTANTIATE_TEST_SUITE_P(Paths, UcxPathTest, ::testing::ValuesIn(testing::UcxPaths()),
                         [](const ::testing::TestParamInfo<PathConfig>& param_info) { return param_info.param.name; });

// ---------------------------------------------------------------------------
// Dropped sends on the network.

TEST(UcxDropTest, DroppedNetworkSendThatThePeerNeverTakesFailsThePeer) {
  UcxOptions o = TestOptions("tcp");
  o.abandon_timeout = milliseconds(300);
  Group g = Connected(2, o);
  ASSERT_EQ(g.size(), 2u);
  {
    const auto big = Pattern(size_t{8} << 20, 5);  // rendezvous: waits for rank 1's receive
    auto send = g[0]->Send(1, 77, big.data(), big.size());
    EXPECT_EQ(send->Wait(milliseconds(50)).code(), StatusCode::kDeadlineExceeded);
    const auto start = Clock::now();
    send.reset();  // returns once UCX has let go of `big`
    EXPECT_LT(Seconds(Clock::now() - start), 3.0);
  }
  char b = 0;
  Status s = g[0]->Send(1, 1, &b, 1)->Wait(kWait);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("dropped"), std::string::npos) << s.ToString();
}

// ---------------------------------------------------------------------------
// A peer process that is SIGKILLed.

constexpr char kChildDirEnv[] = "TANDEM_UCX_TEST_CHILD_DIR";
constexpr char kChildTlsEnv[] = "TANDEM_UCX_TEST_CHILD_TLS";

bool WriteFileAtomically(const std::string& path, const std::string& contents) {
  {
    std::ofstream out(path + ".tmp", std::ios::binary);
    out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
    if (!out) return false;
  }
  return std::rename((path + ".tmp").c_str(), path.c_str()) == 0;
}

std::string WaitForFile(const std::string& path, milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (std::filesystem::exists(path)) return testing::ReadFile(path);
    std::this_thread::sleep_for(milliseconds(10));
  }
  return "";
}

// Rank 1 of UcxPeerDeathTest, in a child process; skipped when run directly.
TEST(UcxChild, Peer) {
  const char* dir = std::getenv(kChildDirEnv);
  if (dir == nullptr) GTEST_SKIP() << "runs only as the child process of UcxPeerDeathTest";
  const char* tls = std::getenv(kChildTlsEnv);
  auto t = UcxTransport::Create(TestOptions(tls != nullptr ? tls : ""));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_TRUE(WriteFileAtomically(std::string(dir) + "/child.addr", (*t)->address()));
  const std::string parent = testing::ReadFile(std::string(dir) + "/parent.addr");
  ASSERT_TRUE((*t)->Connect(1, 2, {parent, (*t)->address()}, kWait).ok());
  const int ready = 1;
  ASSERT_TRUE((*t)->Send(0, 1, &ready, sizeof(ready))->Wait(kWait).ok());
  // Wait to be killed (bounded: the parent kills within seconds).
  int never = 0;
  (void)(*t)->Recv(0, 99, &never, sizeof(never))->Wait(seconds(30));
}

class UcxPeerDeathTest : public ::testing::TestWithParam<PathConfig> {};

TEST_P(UcxPeerDeathTest, KilledPeerFailsPendingAndLaterOperationsNamingIt) {
  testing::TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  auto t = UcxTransport::Create(TestOptions(GetParam().tls));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  UcxTransport& u = **t;
  ASSERT_TRUE(WriteFileAtomically(dir.path() + "/parent.addr", u.address()));

  SpawnOptions spawn;
  spawn.argv = {std::filesystem::read_symlink("/proc/self/exe").string(), "--gtest_filter=UcxChild.Peer"};
  spawn.extra_env = {std::string(kChildDirEnv) + "=" + dir.path(), std::string(kChildTlsEnv) + "=" + GetParam().tls};
  spawn.output_file = dir.path() + "/child.log";
  auto child = Subprocess::Spawn(spawn);
  ASSERT_TRUE(child.ok()) << child.status().ToString();

  const std::string child_address = WaitForFile(dir.path() + "/child.addr", kWait);
  ASSERT_FALSE(child_address.empty()) << testing::ReadFile(spawn.output_file);
  ASSERT_TRUE(u.Connect(0, 2, {u.address(), child_address}, kWait).ok()) << testing::ReadFile(spawn.output_file);
  int ready = 0;
  ASSERT_TRUE(u.Recv(1, 1, &ready, sizeof(ready))->Wait(kWait).ok());
  const auto lines = u.PathSummary();
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find(std::string(GetParam().tls).empty() ? "pid check" : "UCX error handling"), std::string::npos)
      << lines[0];

  int64_t got = 0;
  auto pending = u.Recv(1, 5, &got, sizeof(got));
  const auto big = Pattern(size_t{8} << 20, 9);
  auto pending_send = u.Send(1, 6, big.data(), big.size());  // not received by the child
  ASSERT_TRUE((*child)->Signal(SIGKILL).ok());               // left unreaped for now: a zombie
  const auto start = Clock::now();
  Status s = pending->Wait(kWait);
  const double elapsed = Seconds(Clock::now() - start);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s.ToString();
  EXPECT_LT(elapsed, 1.5) << s.ToString();
  std::printf("peer death (%s) detected after %.0f ms: %s\n", GetParam().name, elapsed * 1000, s.message().c_str());
  Status sent = pending_send->Wait(kWait);  // completed before the kill (eager) or failed with the peer
  EXPECT_TRUE(sent.ok() || sent.code() == StatusCode::kUnavailable) << sent.ToString();
  Status later = u.Send(1, 7, &got, sizeof(got))->Wait(kWait);
  EXPECT_EQ(later.code(), StatusCode::kUnavailable) << later.ToString();
  EXPECT_NE(later.message().find("rank 1"), std::string::npos) << later.ToString();
  EXPECT_EQ(u.Recv(1, 8, &got, sizeof(got))->Wait(kWait).code(), StatusCode::kUnavailable);
  auto exit = (*child)->Wait(kWait);
  ASSERT_TRUE(exit.ok());
  EXPECT_EQ(exit->signal, SIGKILL);
}

INSTANTIATE_TEST_SUITE_P(Paths, UcxPeerDeathTest,
                         ::testing::Values(PathConfig{"SharedMemory", "", true}, PathConfig{"Tcp", "tcp", true}),
                         [](const ::testing::TestParamInfo<PathConfig>& param_info) { return param_info.param.name; });

// ---------------------------------------------------------------------------
// Peers in different network namespaces (the simulated nodes of `tandem run`).

constexpr char kNetnsDirEnv[] = "TANDEM_UCX_TEST_NETNS_DIR";
constexpr char kNetnsRankEnv[] = "TANDEM_UCX_TEST_NETNS_RANK";
// A wake-up that is lost costs a whole liveness_interval: make that obvious.
constexpr milliseconds kNetnsLiveness{2000};

std::string IpProgram() {
  for (const char* p : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (access(p, X_OK) == 0) return p;
  }
  return "";
}

// Two network namespaces joined by a veth pair (10.213.255.1/30 and .2, which
// exist only inside them); removed again by the destructor.
class NamespacePair {
 public:
  NamespacePair() : ip_(IpProgram()) {
    const std::string base = fmt::format("tux{}", getpid() % 10000000);
    names_ = {base + "a", base + "b"};
  }
  ~NamespacePair() {
    for (const auto& name : names_) Ip({"netns", "del", name});  // takes its end of the veth along
  }
  // Empty on success, else why it failed.
  std::string Create() {
    if (geteuid() != 0) return "network namespaces need root";
    if (ip_.empty()) return "no `ip` program (iproute2)";
    for (const auto& name : names_) {
      if (std::string out; !Ip({"netns", "add", name}, &out)) return "`ip netns add` does not work here: " + out;
    }
    std::string out;
    bool ok = Ip(
        {"link", "add", names_[0], "netns", names_[0], "type", "veth", "peer", "name", names_[1], "netns", names_[1]},
        &out);
    for (int i = 0; ok && i < 2; ++i) {
      const std::string& ns = names_[static_cast<size_t>(i)];
      ok = Ip({"-n", ns, "addr", "add", fmt::format("10.213.255.{}/30", i + 1), "dev", ns}, &out) &&
           Ip({"-n", ns, "link", "set", ns, "up"}, &out) && Ip({"-n", ns, "link", "set", "lo", "up"}, &out);
    }
    if (!ok) return "cannot wire the namespaces: " + out;
    // UCX only uses interfaces that are operational, which veths become a moment after `up`.
    const auto deadline = Clock::now() + seconds(10);
    for (const auto& ns : names_) {
      while (Ip({"-n", ns, "-o", "link", "show", ns}, &out) && out.find("state UP") == std::string::npos) {
        if (Clock::now() > deadline) return "the veth did not come up: " + out;
        std::this_thread::sleep_for(milliseconds(10));
      }
    }
    return "";
  }
  // argv that runs `argv` in namespace i.
  std::vector<std::string> In(int i, std::vector<std::string> argv) const {
    argv.insert(argv.begin(), {ip_, "netns", "exec", names_.at(static_cast<size_t>(i))});
    return argv;
  }

 private:
  bool Ip(std::vector<std::string> args, std::string* output = nullptr) const {
    args.insert(args.begin(), ip_);
    const auto result = testing::RunCommand(args, seconds(10));
    if (output != nullptr) *output = fmt::format("{}: {}", fmt::join(args, " "), result.output);
    return result.exit.success();
  }
  std::string ip_;
  std::vector<std::string> names_;
};

// One rank of UcxNetnsTest, in a child process in its own network namespace;
// skipped when run directly. Rank 0 writes the path summary and the slowest
// round trip after an idle pause to files in the shared directory.
TEST(UcxNetnsChild, Rank) {
  const char* dir_env = std::getenv(kNetnsDirEnv);
  const char* rank_env = std::getenv(kNetnsRankEnv);
  if (dir_env == nullptr || rank_env == nullptr) GTEST_SKIP() << "runs only as a child process of UcxNetnsTest";
  const std::string dir = dir_env;
  const int rank = std::atoi(rank_env);
  const int peer = 1 - rank;
  UcxOptions o = TestOptions();
  o.net_devices = "";  // the namespace's own: lo and its end of the veth
  o.liveness_interval = kNetnsLiveness;
  auto t = UcxTransport::Create(o);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  UcxTransport& u = **t;
  ASSERT_TRUE(WriteFileAtomically(fmt::format("{}/rank{}.addr", dir, rank), u.address()));
  std::vector<std::string> addresses(2);
  addresses[static_cast<size_t>(rank)] = u.address();
  addresses[static_cast<size_t>(peer)] = WaitForFile(fmt::format("{}/rank{}.addr", dir, peer), kWait);
  ASSERT_FALSE(addresses[static_cast<size_t>(peer)].empty());
  ASSERT_TRUE(u.Connect(rank, 2, addresses, kWait).ok());
  if (rank == 0) {
    ASSERT_TRUE(WriteFileAtomically(dir + "/summary", u.PathSummary().at(0)));
  }

  // Ping-pong after idle pauses long enough for both progress threads to sleep.
  double slowest_ms = 0;
  for (size_t bytes : {size_t{8}, size_t{4} << 20}) {
    std::vector<char> out = Pattern(bytes, rank), in(bytes);
    for (int i = 0; i < 4; ++i) {
      if (rank == 0) {
        std::this_thread::sleep_for(milliseconds(50));
        const auto start = Clock::now();
        auto recv = u.Recv(peer, 2, in.data(), bytes);
        ASSERT_TRUE(u.Send(peer, 1, out.data(), bytes)->Wait(kWait).ok());
        ASSERT_TRUE(recv->Wait(kWait).ok());
        slowest_ms = std::max(slowest_ms, Seconds(Clock::now() - start) * 1000);
      } else {
        ASSERT_TRUE(u.Recv(peer, 1, in.data(), bytes)->Wait(kWait).ok());
        ASSERT_TRUE(u.Send(peer, 2, out.data(), bytes)->Wait(kWait).ok());
      }
      ASSERT_EQ(in, Pattern(bytes, peer));
    }
  }
  if (rank == 0) {
    ASSERT_TRUE(WriteFileAtomically(dir + "/slowest_ms", std::to_string(slowest_ms)));
  }
}

TEST(UcxNetnsTest, PeerInAnotherNetworkNamespaceUsesTheNetworkAndIsWokenAtOnce) {
  NamespacePair namespaces;
  if (const std::string why = namespaces.Create(); !why.empty()) GTEST_SKIP() << why;
  testing::TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  std::vector<std::unique_ptr<Subprocess>> children;
  for (int rank = 0; rank < 2; ++rank) {
    SpawnOptions spawn;
    spawn.argv = namespaces.In(rank, {self, "--gtest_filter=UcxNetnsChild.Rank"});
    spawn.extra_env = {std::string(kNetnsDirEnv) + "=" + dir.path(), fmt::format("{}={}", kNetnsRankEnv, rank)};
    spawn.output_file = fmt::format("{}/rank{}.log", dir.path(), rank);
    auto child = Subprocess::Spawn(spawn);
    ASSERT_TRUE(child.ok()) << child.status().ToString();
    children.push_back(std::move(child).value());
  }
  for (int rank = 0; rank < 2; ++rank) {
    auto exit = children[static_cast<size_t>(rank)]->Wait(3 * kWait);
    const std::string log = testing::ReadFile(fmt::format("{}/rank{}.log", dir.path(), rank));
    ASSERT_TRUE(exit.ok()) << "rank " << rank << " did not finish: " << log;
    EXPECT_TRUE(exit->success()) << "rank " << rank << ": " << exit->ToString() << "\n" << log;
  }
  const std::string summary = testing::ReadFile(dir.path() + "/summary");
  EXPECT_NE(summary.find("same host, network: it runs in another network namespace"), std::string::npos) << summary;
  EXPECT_NE(summary.find("tcp/tux"), std::string::npos) << summary;  // over the veth, not lo
  // Before peers in other network namespaces were kept off shared memory, every
  // round trip here waited for a timed wake-up: about kNetnsLiveness.
  const std::string slowest = testing::ReadFile(dir.path() + "/slowest_ms");
  ASSERT_FALSE(slowest.empty());
  EXPECT_LT(std::stod(slowest), 500.0) << "a round trip after an idle pause took " << slowest << " ms: " << summary;
  std::printf("network namespaces: slowest round trip after an idle pause %s ms: %s\n", slowest.c_str(),
              summary.c_str());
}

// ---------------------------------------------------------------------------
// Bandwidth of large messages, copy through segments versus cma (manual).

TEST(UcxBench, CopyVersusCma) {
  if (std::getenv("TANDEM_UCX_BENCH") == nullptr) GTEST_SKIP() << "set TANDEM_UCX_BENCH=1 to run";
  for (size_t bytes : {size_t{16} << 20, size_t{64} << 20}) {
    for (int rep = 0; rep < 3; ++rep) {
      for (bool copy : {true, false}) {
        UcxOptions o = TestOptions("", copy);
        if (std::getenv("TANDEM_UCX_BENCH_BUSY") != nullptr) o.progress = UcxProgressMode::kBusyPoll;
        Group g = Connected(2, o);
        ASSERT_EQ(g.size(), 2u);
        std::vector<char> a(bytes, 1), b(bytes, 2);
        const int iters = bytes > (32u << 20) ? 10 : 30;
        auto pingpong = [&](int n) {
          for (int i = 0; i < n; ++i) {
            auto r1 = g[1]->Recv(0, 1, b.data(), bytes);
            ASSERT_TRUE(g[0]->Send(1, 1, a.data(), bytes)->Wait(kWait).ok());
            ASSERT_TRUE(r1->Wait(kWait).ok());
            auto r0 = g[0]->Recv(1, 2, a.data(), bytes);
            ASSERT_TRUE(g[1]->Send(0, 2, b.data(), bytes)->Wait(kWait).ok());
            ASSERT_TRUE(r0->Wait(kWait).ok());
          }
        };
        pingpong(2);  // warm-up
        const auto start = Clock::now();
        pingpong(iters);
        const double gbps = 2.0 * iters * static_cast<double>(bytes) / Seconds(Clock::now() - start) / 1e9;
        std::printf("ucx bench: %3zu MiB %-22s %6.2f GB/s  [%s]\n", bytes >> 20,
                    copy ? "copy (posix/sysv)" : "single-copy (cma)", gbps, g[0]->PathSummary().at(0).c_str());
      }
    }
  }
}

}  // namespace
}  // namespace tandem::transport
