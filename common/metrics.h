// Prometheus metrics: a registry per process, served over HTTP at /metrics.
//
// Every daemon owns one MetricsServer. Components add their metric families
// to registry(); names start with `tandem_` and are listed in docs/metrics.md.
// Labels stay bounded (job, rank, node, shard; never per step or tensor), and
// none is named `role`: Prometheus would rename it when the target carries a
// `role` label (the daemon kind is the `daemon` label of tandem_build_info).
//
// The endpoint is a small HTTP/1.0 server on one thread (poll-based, requests
// up to 16 KiB, 2 s to send one): scrapes are rare and small, and it stops at
// once, which keeps shutdown on SIGTERM fast.
//
// Thread safety: registry() and the metrics in it are thread-safe (prometheus-cpp).
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include <prometheus/registry.h>

#include "common/status.h"

namespace tandem {

class MetricsServer {
 public:
  // Serves `registry` and the process metrics (CPU, memory, threads, open
  // files, start time, build info) at http://ADDRESS/metrics. Port 0 picks a
  // free port; address() tells which.
  static Result<std::unique_ptr<MetricsServer>> Start(const std::string& address, std::string daemon,
                                                      std::shared_ptr<prometheus::Registry> registry);
  ~MetricsServer();

  // host:port actually bound.
  const std::string& address() const { return address_; }
  prometheus::Registry& registry() { return *registry_; }

 private:
  MetricsServer() = default;
  void Serve();
  void HandleConnection(int fd);
  std::string RenderMetrics() const;

  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd written by the destructor to stop Serve()
  std::thread thread_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<prometheus::Collectable> process_;
  std::string address_;
};

// Metrics of this process, read from /proc when scraped:
// tandem_process_cpu_seconds_total, tandem_process_resident_memory_bytes,
// tandem_process_virtual_memory_bytes, tandem_process_threads,
// tandem_process_open_fds, tandem_process_start_time_seconds and
// tandem_build_info{daemon,version,cuda}.
std::shared_ptr<prometheus::Collectable> MakeProcessCollector(std::string daemon);

}  // namespace tandem
