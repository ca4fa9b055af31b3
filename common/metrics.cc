#include "common/metrics.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>
#include <prometheus/text_serializer.h>

#include "common/config.h"
#include "common/proc_stat.h"
#include "tandem/config.h"

namespace tandem {
namespace {

prometheus::MetricFamily Family(std::string name, std::string help, prometheus::MetricType type, double value) {
  prometheus::MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = type;
  prometheus::ClientMetric m;
  if (type == prometheus::MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  f.metric.push_back(std::move(m));
  return f;
}

int CountOpenFds() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int n = 0;
  while (readdir(dir) != nullptr) ++n;
  closedir(dir);
  return n - 3;  // ".", ".." and the directory's own descriptor
}

class ProcessCollector : public prometheus::Collectable {
 public:
  explicit ProcessCollector(std::string daemon) : daemon_(std::move(daemon)) {
    const auto stat = ReadProcStat();
    start_time_ = stat ? stat->start_unix_seconds
                       : std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  }

  std::vector<prometheus::MetricFamily> Collect() const override {
    using prometheus::MetricType;
    std::vector<prometheus::MetricFamily> out;
    if (const auto stat = ReadProcStat()) {
      out.push_back(Family("tandem_process_cpu_seconds_total", "CPU time used by this process (user and system).",
                           MetricType::Counter, stat->cpu_seconds));
      out.push_back(Family("tandem_process_resident_memory_bytes", "Resident memory of this process.",
                           MetricType::Gauge, stat->resident_bytes));
      out.push_back(Family("tandem_process_virtual_memory_bytes", "Virtual memory size of this process.",
                           MetricType::Gauge, stat->virtual_bytes));
      out.push_back(Family("tandem_process_threads", "Threads in this process.", MetricType::Gauge, stat->threads));
    }
    out.push_back(
        Family("tandem_process_open_fds", "Open file descriptors of this process.", MetricType::Gauge, CountOpenFds()));
    out.push_back(Family("tandem_process_start_time_seconds", "When this process started, in Unix seconds.",
                         MetricType::Gauge, start_time_));
    auto info =
        Family("tandem_build_info", "Always 1; the labels say which daemon and build this is.", MetricType::Gauge, 1);
    info.metric[0].label = {
        {"cuda", TANDEM_CUDA_ENABLED ? "true" : "false"}, {"daemon", daemon_}, {"version", TANDEM_VERSION}};
    out.push_back(std::move(info));
    return out;
  }

 private:
  std::string daemon_;
  double start_time_;
};

}  // namespace

std::shared_ptr<prometheus::Collectable> MakeProcessCollector(std::string daemon) {
  return std::make_shared<ProcessCollector>(std::move(daemon));
}

Result<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& address, std::string daemon,
                                                            std::shared_ptr<prometheus::Registry> registry) {
  auto hp = ParseHostPort(address);
  if (!hp.ok()) return hp.status().WithContext("metrics_address");
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  server->registry_ = std::move(registry);
  server->process_ = MakeProcessCollector(std::move(daemon));

  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(hp->port);
  if (const int rc = getaddrinfo(hp->host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return Unavailable("cannot serve metrics on {}: {}", address, gai_strerror(rc));
  }
  std::string error = "no usable address";
  for (addrinfo* ai = res; ai != nullptr && server->listen_fd_ < 0; ai = ai->ai_next) {
    const int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 64) != 0) {
      error = std::strerror(errno);
      close(fd);
      continue;
    }
    server->listen_fd_ = fd;
  }
  freeaddrinfo(res);
  if (server->listen_fd_ < 0) return Unavailable("cannot serve metrics on {}: {}", address, error);
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  getsockname(server->listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
  const int bound_port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                           : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  const bool v6 = hp->host.find(':') != std::string::npos;
  server->address_ = v6 ? fmt::format("[{}]:{}", hp->host, bound_port) : fmt::format("{}:{}", hp->host, bound_port);
  server->wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (server->wake_fd_ < 0) return Internal("metrics: eventfd: {}", std::strerror(errno));
  server->thread_ = std::thread([s = server.get()] { s->Serve(); });
  return server;
}

MetricsServer::~MetricsServer() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
    thread_.join();
  }
  if (listen_fd_ >= 0) close(listen_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

std::string MetricsServer::RenderMetrics() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  for (auto& f : process_->Collect()) families.push_back(std::move(f));
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, families);
  return out.str();
}

void MetricsServer::Serve() {
  while (true) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) continue;
    HandleConnection(fd);
    close(fd);
  }
}

void MetricsServer::HandleConnection(int fd) {
  constexpr size_t kMaxRequest = 16 * 1024;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  const auto left_ms = [&] {
    return static_cast<int>(std::max<int64_t>(
        0, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count()));
  };
  // Read the request head (up to the blank line).
  std::string request;
  while (request.find("\r\n\r\n") == std::string::npos && request.find("\n\n") == std::string::npos) {
    if (left_ms() == 0) return;
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, left_ms()) <= 0) return;
    char buf[4096];
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return;
    request.append(buf, static_cast<size_t>(n));
    if (request.size() > kMaxRequest) return;
  }
  const std::string line = request.substr(0, request.find_first_of("\r\n"));
  std::string status = "200 OK";
  std::string type = "text/plain; charset=utf-8";
  std::string body;
  if (line.rfind("GET ", 0) != 0 && line.rfind("HEAD ", 0) != 0) {
    status = "405 Method Not Allowed";
    body = "only GET is served here\n";
  } else {
    const size_t path_start = line.find(' ') + 1;
    const std::string path = line.substr(path_start, line.find(' ', path_start) - path_start);
    if (path == "/metrics" || path.rfind("/metrics?", 0) == 0) {
      body = RenderMetrics();
      type = "text/plain; version=0.0.4; charset=utf-8";  // the Prometheus text format
    } else if (path == "/") {
      body = "Tandem metrics: see /metrics\n";
    } else {
      status = "404 Not Found";
      body = "not found: the metrics are at /metrics\n";
    }
  }
  const size_t length = body.size();
  if (line.rfind("HEAD ", 0) == 0) body.clear();  // same headers as GET, no body
  const std::string response =
      fmt::format("HTTP/1.0 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}", status, type,
                  length, body);
  size_t sent = 0;
  while (sent < response.size() && left_ms() > 0) {
    pollfd p{fd, POLLOUT, 0};
    if (poll(&p, 1, left_ms()) <= 0) return;
    const ssize_t n = send(fd, response.data() + sent, response.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return;
    sent += static_cast<size_t>(n);
  }
}

}  // namespace tandem
