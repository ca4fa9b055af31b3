#include "common/health.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/config.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace tandem {

Result<std::string> CheckHealth(const std::shared_ptr<grpc::Channel>& channel, const std::string& service,
                                std::chrono::milliseconds timeout) {
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status s = stub->Check(&ctx, request, &response);
  if (s.error_code() == grpc::StatusCode::NOT_FOUND) return std::string("SERVICE_UNKNOWN");
  if (!s.ok()) return Status::FromGrpc(s).WithContext("health check");
  return grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
}

namespace {

// A connected TCP socket to host:port, or an error; bounded by `deadline`.
Result<int> Connect(const HostPort& hp, std::chrono::steady_clock::time_point deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(hp.port);
  if (const int rc = getaddrinfo(hp.host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return Unavailable("cannot resolve '{}': {}", hp.host, gai_strerror(rc));
  }
  Status last = Unavailable("no address for '{}'", hp.host);
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    const int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0 && errno != EINPROGRESS) {
      last = Unavailable("connect to {}:{}: {}", hp.host, hp.port, std::strerror(errno));
      close(fd);
      continue;
    }
    pollfd p{fd, POLLOUT, 0};
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    int err = 0;
    socklen_t len = sizeof(err);
    if (poll(&p, 1, static_cast<int>(std::max<int64_t>(left.count(), 0))) != 1 ||
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
      last = Unavailable("connect to {}:{}: {}", hp.host, hp.port, err != 0 ? std::strerror(err) : "timed out");
      close(fd);
      continue;
    }
    freeaddrinfo(res);
    return fd;
  }
  freeaddrinfo(res);
  return last;
}

}  // namespace

Result<std::string> HttpGet(const std::string& host_port, const std::string& path, std::chrono::milliseconds timeout) {
  auto hp = ParseHostPort(host_port);
  if (!hp.ok()) return hp.status();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  TANDEM_ASSIGN_OR_RETURN(const int fd, Connect(*hp, deadline));
  const std::string request =
      fmt::format("GET {} HTTP/1.0\r\nHost: {}\r\nAccept: text/plain\r\nConnection: close\r\n\r\n", path, host_port);
  std::string response;
  Status status;
  size_t sent = 0;
  while (status.ok()) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      status = DeadlineExceeded("GET http://{}{}: no complete answer within {} ms", host_port, path, timeout.count());
      break;
    }
    pollfd p{fd, static_cast<short>(sent < request.size() ? POLLOUT : POLLIN), 0};
    if (poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    if (sent < request.size()) {
      const ssize_t n = send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
      if (n < 0 && errno != EAGAIN) status = Unavailable("GET http://{}{}: {}", host_port, path, std::strerror(errno));
      if (n > 0) sent += static_cast<size_t>(n);
      continue;
    }
    char buf[65536];
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n == 0) break;
    if (n < 0 && errno != EAGAIN) status = Unavailable("GET http://{}{}: {}", host_port, path, std::strerror(errno));
    if (n > 0) response.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  TANDEM_RETURN_IF_ERROR(status);
  const size_t header_end = response.find("\r\n\r\n");
  if (response.rfind("HTTP/1.", 0) != 0 || header_end == std::string::npos) {
    return Unavailable("GET http://{}{}: not an HTTP answer", host_port, path);
  }
  const std::string status_line = response.substr(0, response.find("\r\n"));
  if (status_line.find(" 200 ") == std::string::npos) {
    return Unavailable("GET http://{}{}: {}", host_port, path, status_line);
  }
  return response.substr(header_end + 4);
}

}  // namespace tandem
