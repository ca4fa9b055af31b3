#include "cli/node_network.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include <spdlog/spdlog.h>

namespace tandem::cli {
namespace {

// Names derive from the PID, so one NodeNetwork with namespaces per process.
std::atomic<bool> g_namespaces_in_use{false};

constexpr int kFirstSubnet = 213;  // 10.213.0.0/16, then 10.214.0.0/16, ...
constexpr int kLastSubnet = 254;
constexpr const char* kNodeInterface = "eth0";  // the veth end inside each namespace
constexpr const char* kLockFile = "/run/lock/tandem-node-network.lock";
constexpr int kConnectTimeoutMs = 3000;

std::string Join(const std::vector<std::string>& words) {
  std::string out;
  for (const auto& w : words) out += (out.empty() ? "" : " ") + w;
  return out;
}

std::string Trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\r')) s.pop_back();
  return s;
}

// True if the path names anything, a dangling symbolic link included.
bool PathExists(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0;
}

// The `ip` program: the usual places, then $PATH. Empty if none.
std::string FindIp() {
  std::vector<std::string> candidates = {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"};
  if (const char* path = std::getenv("PATH"); path != nullptr) {
    std::stringstream dirs(path);
    for (std::string dir; std::getline(dirs, dir, ':');) {
      if (!dir.empty()) candidates.push_back(dir + "/ip");
    }
  }
  for (const auto& c : candidates) {
    if (access(c.c_str(), X_OK) == 0) return c;
  }
  return "";
}

struct CommandOutput {
  bool success = false;
  std::string how;     // "exit 2", "killed by signal 9"
  std::string output;  // stdout and stderr together
};

// Runs argv (argv[0] an absolute path) with stdin from /dev/null, stdout and
// stderr captured, and waits for it. No shell is involved.
Result<CommandOutput> RunCapture(const std::vector<std::string>& argv) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return Internal("pipe: {}", std::strerror(errno));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDERR_FILENO);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);  // not the caller's mask (ShutdownSignal blocks some)
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, args[0], &actions, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  close(fds[1]);
  if (rc != 0) {
    close(fds[0]);
    return NotFound("cannot run '{}': {}", argv[0], std::strerror(rc));
  }
  CommandOutput out;
  char buf[4096];
  while (true) {
    const ssize_t n = read(fds[0], buf, sizeof(buf));
    if (n > 0) {
      out.output.append(buf, static_cast<size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      break;
    }
  }
  close(fds[0]);
  int status = 0;
  pid_t r;
  do {
    r = waitpid(pid, &status, 0);
  } while (r < 0 && errno == EINTR);
  if (r != pid) return Internal("waitpid({}): {}", pid, std::strerror(errno));
  if (WIFEXITED(status)) {
    out.success = WEXITSTATUS(status) == 0;
    out.how = fmt::format("exit {}", WEXITSTATUS(status));
  } else {
    out.how = fmt::format("killed by signal {}", WTERMSIG(status));
  }
  out.output = Trim(out.output);
  return out;
}

struct Prefix {
  uint32_t address = 0;  // host byte order
  int length = 32;
};

// Every IPv4 address or prefix in `text` ("10.1.2.3", "10.1.0.0/16").
std::vector<Prefix> PrefixesIn(const std::string& text) {
  std::vector<Prefix> out;
  std::stringstream words(text);
  for (std::string word; words >> word;) {
    Prefix p;
    const auto slash = word.find('/');
    const std::string ip = word.substr(0, slash);
    in_addr addr{};
    if (inet_pton(AF_INET, ip.c_str(), &addr) != 1) continue;
    p.address = ntohl(addr.s_addr);
    if (slash != std::string::npos) {
      const char* begin = word.data() + slash + 1;
      const char* end = word.data() + word.size();
      if (std::from_chars(begin, end, p.length).ec != std::errc() || p.length < 0 || p.length > 32) continue;
    }
    if (p.length == 0 || p.address == 0) continue;  // a default route is no collision
    out.push_back(p);
  }
  return out;
}

bool Overlap(const Prefix& a, const Prefix& b) {
  const int length = std::min(a.length, b.length);
  const uint32_t mask = length == 0 ? 0 : ~uint32_t{0} << (32 - length);
  return (a.address & mask) == (b.address & mask);
}

// Holds an exclusive flock while it lives, so that concurrent runs pick distinct subnets.
class FileLock {
 public:
  explicit FileLock(const char* path) : fd_(open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600)) {
    if (fd_ >= 0) {
      while (flock(fd_, LOCK_EX) != 0 && errno == EINTR) {
      }
    }
  }
  ~FileLock() {
    if (fd_ >= 0) close(fd_);
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  int fd_;
};

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

sockaddr_in SocketAddress(const std::string& ip, int port) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, ip.c_str(), &sa.sin_addr);
  return sa;
}

// A listening TCP socket on ip:0 in the calling thread's network namespace; sets *port.
Result<int> Listen(const std::string& ip, int* port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Internal("socket: {}", std::strerror(errno));
  sockaddr_in sa = SocketAddress(ip, 0);
  socklen_t len = sizeof(sa);
  if (bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 || listen(fd, 4) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
    const int e = errno;
    close(fd);
    return Unavailable("cannot listen on {}: {}", ip, std::strerror(e));
  }
  *port = ntohs(sa.sin_port);
  return fd;
}

// A TCP connection to ip:port from the calling thread's network namespace, within the timeout.
Status Connect(const std::string& ip, int port) {
  Fd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (fd.get() < 0) return Internal("socket: {}", std::strerror(errno));
  const sockaddr_in sa = SocketAddress(ip, port);
  if (connect(fd.get(), reinterpret_cast<const sockaddr*>(&sa), sizeof(sa)) == 0) return Status::Ok();
  if (errno != EINPROGRESS) return Unavailable("connect to {}:{}: {}", ip, port, std::strerror(errno));
  pollfd p{fd.get(), POLLOUT, 0};
  int n;
  do {
    n = poll(&p, 1, kConnectTimeoutMs);
  } while (n < 0 && errno == EINTR);
  if (n == 0) return Unavailable("connect to {}:{}: no answer within {} ms", ip, port, kConnectTimeoutMs);
  int error = 0;
  socklen_t len = sizeof(error);
  if (n < 0 || getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &len) != 0) error = errno;
  if (error != 0) return Unavailable("connect to {}:{}: {}", ip, port, std::strerror(error));
  return Status::Ok();
}

// Moves the calling thread into the network namespace at `path`.
Status EnterNamespace(const std::string& path) {
  Fd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return Internal("open {}: {}", path, std::strerror(errno));
  if (setns(fd.get(), CLONE_NEWNET) != 0) return Internal("setns({}): {}", path, std::strerror(errno));
  return Status::Ok();
}

std::string BridgeFilterHint() {
  std::ifstream in("/proc/sys/net/bridge/bridge-nf-call-iptables");
  std::string value;
  if (in >> value && value == "1") {
    return " (bridged traffic goes through iptables here, net.bridge.bridge-nf-call-iptables=1: "
           "does a FORWARD rule or policy drop it, as Docker sets up? Use --network loopback)";
  }
  return "";
}

}  // namespace

NodeNetwork::NodeNetwork(int nodes, std::string loopback_reason)
    : nodes_(nodes), loopback_reason_(std::move(loopback_reason)) {}

Result<std::unique_ptr<NodeNetwork>> NodeNetwork::Create(int nodes, const std::string& mode) {
  if (mode != "auto" && mode != "netns" && mode != "loopback") {
    return InvalidArgument("network mode must be auto, netns or loopback, got '{}'", mode);
  }
  if (nodes < 1) return InvalidArgument("a cluster needs at least 1 node, got {}", nodes);
  const auto loopback = [nodes](std::string reason) {
    return std::unique_ptr<NodeNetwork>(new NodeNetwork(nodes, std::move(reason)));
  };
  if (mode == "loopback") return loopback("requested");

  // Whether namespaces are possible at all: `netns` says why not, `auto` falls back quietly.
  std::string why_not;
  Status error;
  const std::string ip = FindIp();
  if (geteuid() != 0) {
    why_not = "not running as root";
    error = PermissionDenied("network namespaces need root (running as uid {})", geteuid());
  } else if (ip.empty()) {
    why_not = "no `ip` program (iproute2)";
    error = FailedPrecondition(
        "network namespaces need the `ip` program (iproute2), found in neither /usr/sbin, "
        "/sbin, /usr/bin, /bin nor $PATH");
  } else if (nodes > kMaxNamespaceNodes) {
    why_not = fmt::format("more than {} nodes", kMaxNamespaceNodes);
    error = InvalidArgument("network namespaces support at most {} nodes, got {}", kMaxNamespaceNodes, nodes);
  } else if (g_namespaces_in_use.exchange(true)) {
    why_not = "another node network is in use in this process";
    error = FailedPrecondition(
        "another NodeNetwork with namespaces is alive in this process (names derive from the "
        "PID, {})",
        getpid());
  }
  if (!why_not.empty()) {
    if (mode == "netns") return error;
    return loopback(why_not);
  }

  std::unique_ptr<NodeNetwork> network(new NodeNetwork(nodes, ""));
  network->ip_ = ip;
  network->prefix_ = fmt::format("tnd{}", getpid());
  network->namespaces_ = true;
  Status status = network->SetUp();
  if (status.ok()) status = network->CheckConnectivity();
  if (status.ok()) return network;

  network->TearDown();
  network->namespaces_ = false;
  g_namespaces_in_use = false;
  status = status.WithContext("cannot set up network namespaces for the nodes");
  if (mode == "netns") return status;
  spdlog::warn("{}; the nodes run on loopback instead", status.message());
  network->loopback_reason_ = "network namespaces failed, see the warning above";
  return network;
}

NodeNetwork::~NodeNetwork() {
  try {
    if (namespaces_) {
      TearDown();
      g_namespaces_in_use = false;
    }
  } catch (...) {  // never throw from a destructor (bad_alloc while formatting)
  }
}

Result<std::string> NodeNetwork::Ip(const std::vector<std::string>& args) const {
  std::vector<std::string> argv = {ip_};
  argv.insert(argv.end(), args.begin(), args.end());
  auto out = RunCapture(argv);
  if (!out.ok()) return out.status().WithContext(fmt::format("`ip {}`", Join(args)));
  if (!out->success) {
    return Unavailable("`ip {}` failed ({}): {}", Join(args), out->how,
                       out->output.empty() ? std::string("no output") : out->output);
  }
  return out->output;
}

Status NodeNetwork::SetUp() {
  // Leftovers of an earlier run with the same PID (killed before it could clean up).
  const auto veth = [this](int k) { return fmt::format("{}v{}", prefix_, k); };
  for (int k = 0; k < nodes_; ++k) {
    if (PathExists("/sys/class/net/" + veth(k))) {
      spdlog::warn("removing the stale link {}", veth(k));
      TANDEM_RETURN_IF_ERROR(Ip({"link", "del", veth(k)}).status());
    }
    if (PathExists("/run/netns/" + namespace_name(k))) {
      spdlog::warn("removing the stale network namespace {}", namespace_name(k));
      TANDEM_RETURN_IF_ERROR(Ip({"netns", "del", namespace_name(k)}).status());
    }
  }
  const std::string bridge = bridge_name();
  if (PathExists("/sys/class/net/" + bridge)) {
    spdlog::warn("removing the stale bridge {}", bridge);
    TANDEM_RETURN_IF_ERROR(Ip({"link", "del", bridge}).status());
  }

  // Concurrent runs must not pick the same subnet: pick it and claim it (the
  // bridge's address) under a machine-wide lock.
  FileLock lock(kLockFile);
  std::vector<Prefix> used;
  for (const std::vector<std::string>& args : {std::vector<std::string>{"-4", "-o", "addr", "show"},
                                               std::vector<std::string>{"-4", "route", "show", "table", "all"}}) {
    TANDEM_ASSIGN_OR_RETURN(const std::string text, Ip(args));
    const auto found = PrefixesIn(text);
    used.insert(used.end(), found.begin(), found.end());
  }
  for (int x = kFirstSubnet; x <= kLastSubnet && subnet_ == 0; ++x) {
    const Prefix candidate{(10u << 24) | (static_cast<uint32_t>(x) << 16), 16};
    bool free = true;
    for (const auto& u : used) free = free && !Overlap(candidate, u);
    if (free) subnet_ = x;
  }
  if (subnet_ == 0) {
    return ResourceExhausted("every subnet 10.{}.0.0/16 .. 10.{}.0.0/16 overlaps an address or route of this machine",
                             kFirstSubnet, kLastSubnet);
  }

  TANDEM_RETURN_IF_ERROR(Ip({"link", "add", bridge, "type", "bridge"}).status());
  created_.push_back({false, bridge});
  TANDEM_RETURN_IF_ERROR(Ip({"addr", "add", host_address() + "/16", "dev", bridge}).status());
  TANDEM_RETURN_IF_ERROR(Ip({"link", "set", bridge, "up"}).status());
  for (int k = 0; k < nodes_; ++k) {
    const std::string ns = namespace_name(k);
    TANDEM_RETURN_IF_ERROR(Ip({"netns", "add", ns}).status());
    created_.push_back({true, ns});
    TANDEM_RETURN_IF_ERROR(Ip({"-n", ns, "link", "set", "lo", "up"}).status());
    TANDEM_RETURN_IF_ERROR(
        Ip({"link", "add", veth(k), "type", "veth", "peer", "name", kNodeInterface, "netns", ns}).status());
    created_.push_back({false, veth(k)});
    TANDEM_RETURN_IF_ERROR(Ip({"link", "set", veth(k), "master", bridge, "up"}).status());
    TANDEM_RETURN_IF_ERROR(Ip({"-n", ns, "addr", "add", node_address(k) + "/16", "dev", kNodeInterface}).status());
    TANDEM_RETURN_IF_ERROR(Ip({"-n", ns, "link", "set", kNodeInterface, "up"}).status());
    // Everything of the cluster is on-link; the default route lets a node also
    // reach the machine's other addresses through the bridge.
    TANDEM_RETURN_IF_ERROR(Ip({"-n", ns, "route", "add", "default", "via", host_address()}).status());
  }
  spdlog::debug("node network: {}", Describe());
  return Status::Ok();
}

// Proves the wiring with TCP connections: node 0 -> host, host -> node 0 and,
// with two nodes or more, the last node -> node 0 across the bridge. A helper
// thread moves between namespaces (a thread's network namespace is its own).
Status NodeNetwork::CheckConnectivity() const {
  Status result;
  std::thread probe([this, &result] {
    const auto run = [this]() -> Status {
      const std::string self = "/proc/thread-self/ns/net";
      Fd root(open(self.c_str(), O_RDONLY | O_CLOEXEC));
      if (root.get() < 0) return Internal("open {}: {}", self, std::strerror(errno));
      int host_port = 0, node0_port = 0;
      TANDEM_ASSIGN_OR_RETURN(const int host_fd, Listen(host_address(), &host_port));
      Fd host_listener(host_fd);
      TANDEM_RETURN_IF_ERROR(EnterNamespace("/run/netns/" + namespace_name(0)));
      TANDEM_ASSIGN_OR_RETURN(const int node0_fd, Listen(node_address(0), &node0_port));
      Fd node0_listener(node0_fd);
      if (Status s = Connect(host_address(), host_port); !s.ok()) {
        return s.WithContext(
            fmt::format("node 0 ({} in {}) cannot reach the host address", node_address(0), namespace_name(0)));
      }
      if (nodes_ > 1) {
        const int last = nodes_ - 1;
        TANDEM_RETURN_IF_ERROR(EnterNamespace("/run/netns/" + namespace_name(last)));
        if (Status s = Connect(node_address(0), node0_port); !s.ok()) {
          return s.WithContext(fmt::format("node {} ({} in {}) cannot reach node 0 across bridge {}", last,
                                           node_address(last), namespace_name(last), bridge_name()));
        }
      }
      if (setns(root.get(), CLONE_NEWNET) != 0) return Internal("setns back: {}", std::strerror(errno));
      if (Status s = Connect(node_address(0), node0_port); !s.ok()) {
        return s.WithContext(
            fmt::format("the host namespace cannot reach node 0 ({} in {})", node_address(0), namespace_name(0)));
      }
      return Status::Ok();
    };
    result = run();
  });
  probe.join();
  if (!result.ok()) return Unavailable("{}{}", result.message(), BridgeFilterHint());
  return result;
}

void NodeNetwork::TearDown() {
  // Processes still in a namespace keep it alive after `ip netns del`; say so.
  for (const auto& c : created_) {
    if (!c.is_namespace) continue;
    auto pids = Ip({"netns", "pids", c.name});
    if (pids.ok() && !pids->empty()) {
      std::string list = *pids;
      std::replace(list.begin(), list.end(), '\n', ' ');
      spdlog::warn("processes {} still run in network namespace {}; it stays until they exit", list, c.name);
    }
  }
  for (auto it = created_.rbegin(); it != created_.rend(); ++it) {
    const bool present = PathExists((it->is_namespace ? "/run/netns/" : "/sys/class/net/") + it->name);
    if (!present) continue;  // already gone (removed by hand, or with its namespace)
    auto r = it->is_namespace ? Ip({"netns", "del", it->name}) : Ip({"link", "del", it->name});
    if (!r.ok()) spdlog::warn("could not remove {}: {}", it->name, r.status().message());
  }
  created_.clear();
}

std::string NodeNetwork::host_address() const {
  return namespaces_ ? fmt::format("10.{}.0.1", subnet_) : "127.0.0.1";
}

std::string NodeNetwork::node_address(int node) const {
  return namespaces_ ? fmt::format("10.{}.{}.2", subnet_, node + 1) : "127.0.0.1";
}

std::vector<std::string> NodeNetwork::exec_prefix(int node) const {
  if (!namespaces_) return {};
  return {ip_, "netns", "exec", namespace_name(node)};
}

std::string NodeNetwork::namespace_name(int node) const {
  return namespaces_ ? fmt::format("{}n{}", prefix_, node) : "";
}

std::string NodeNetwork::bridge_name() const {
  return namespaces_ ? prefix_ + "br" : "";
}

std::string NodeNetwork::Describe() const {
  if (!namespaces_) return fmt::format("loopback: every node on 127.0.0.1 ({})", loopback_reason_);
  const std::string names = nodes_ == 1 ? namespace_name(0) : fmt::format("{}..{}", namespace_name(0), nodes_ - 1);
  return fmt::format("{} network namespace{} {} on bridge {} (10.{}.0.0/16: host {}, node k 10.{}.<k+1>.2)", nodes_,
                     nodes_ == 1 ? "" : "s", names, bridge_name(), subnet_, host_address(), subnet_);
}

Status NodeNetwork::SetNodeLink(int node, bool up) {
  if (!namespaces_) return FailedPrecondition("a network partition needs network namespaces (--network netns)");
  if (node < 0 || node >= nodes_) return InvalidArgument("node {}: there are nodes 0..{}", node, nodes_ - 1);
  return Ip({"link", "set", fmt::format("{}v{}", prefix_, node), up ? "up" : "down"})
      .status()
      .WithContext(fmt::format("setting node {}'s link {}", node, up ? "up" : "down"));
}

}  // namespace tandem::cli
