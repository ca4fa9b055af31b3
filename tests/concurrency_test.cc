// Tandem's own threads under contention: the shutdown signal and the metrics
// endpoint. These run under ThreadSanitizer in `make test-tsan` (label
// "concurrency"). Tests that cross gRPC are not in this label: Debian's gRPC
// is not built with ThreadSanitizer, and its internal locks (absl, futex
// based) are invisible to it, so it reports races that are not there.
#include <atomic>
#include <thread>

#include <gtest/gtest.h>
#include <prometheus/counter.h>

#include "common/health.h"
#include "common/metrics.h"
#include "common/shutdown.h"

namespace tandem {
namespace {

using std::chrono::milliseconds;

TEST(ShutdownSignalTest, RequestShutdownWakesEveryWaiter) {
  ShutdownSignal shutdown;
  EXPECT_EQ(shutdown.WaitFor(milliseconds(10)), -1);
  std::atomic<int> woken{0};
  std::vector<std::thread> waiters;
  for (int i = 0; i < 4; ++i) {
    waiters.emplace_back([&] {
      EXPECT_EQ(shutdown.Wait(), 0);
      ++woken;
    });
  }
  std::thread requester([&] { shutdown.RequestShutdown(); });
  requester.join();
  for (auto& t : waiters) t.join();
  EXPECT_EQ(woken, 4);
  EXPECT_TRUE(shutdown.requested());
}

TEST(MetricsServerTest, ConcurrentScrapesSeeUpdatesAndStopIsPrompt) {
  auto registry = std::make_shared<prometheus::Registry>();
  auto& counter = prometheus::BuildCounter()
                      .Name("tandem_test_events_total")
                      .Help("Events counted by the test.")
                      .Register(*registry)
                      .Add({});
  auto server = MetricsServer::Start("127.0.0.1:0", "test", registry);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  const std::string address = (*server)->address();
  std::atomic<bool> stop{false};
  std::atomic<int> pages{0};
  std::vector<std::thread> scrapers;
  for (int i = 0; i < 3; ++i) {
    scrapers.emplace_back([&] {
      while (!stop) {
        auto page = HttpGet(address, "/metrics", milliseconds(5000));
        if (page.ok() && page->find("tandem_test_events_total") != std::string::npos) ++pages;
      }
    });
  }
  for (int i = 0; i < 2000; ++i) counter.Increment();
  while (pages < 20) std::this_thread::sleep_for(milliseconds(1));
  auto page = HttpGet(address, "/metrics", milliseconds(5000));
  ASSERT_TRUE(page.ok());
  EXPECT_NE(page->find("tandem_test_events_total 2000"), std::string::npos) << *page;
  // Stopping while scrapes are in flight returns promptly.
  const auto t0 = std::chrono::steady_clock::now();
  server->reset();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
  stop = true;
  for (auto& t : scrapers) t.join();
}

}  // namespace
}  // namespace tandem
