// The simulated nodes' network (cli/node_network.h): as root, each node is a
// network namespace on a bridge, daemons started in one are reachable across
// the bridge and nowhere else, and everything is gone afterwards; otherwise
// (and when asked) every node is 127.0.0.1. The namespace tests skip without
// root or working namespaces.
#include "cli/node_network.h"

#include <sys/stat.h>
#include <unistd.h>

#include <optional>

#include <gtest/gtest.h>

#include "cli/launcher.h"
#include "common/grpc_util.h"
#include "common/health.h"
#include "test_util.h"

namespace tandem {
namespace {

using cli::NodeNetwork;
using std::chrono::milliseconds;
using testing::BinDir;
using testing::RunCommand;

std::string IpProgram() {
  for (const char* p : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (access(p, X_OK) == 0) return p;
  }
  return "";
}

// Why network namespaces cannot be tested here, or "" if they can.
std::string WhyNoNamespaces() {
  if (geteuid() != 0) return "network namespaces need root";
  const std::string ip = IpProgram();
  if (ip.empty()) return "no `ip` program (iproute2)";
  const std::string probe = fmt::format("tndprobe{}", getpid());
  const auto add = RunCommand({ip, "netns", "add", probe}, std::chrono::seconds(10));
  if (!add.exit.success()) return "`ip netns add` does not work here: " + add.output;
  RunCommand({ip, "netns", "del", probe}, std::chrono::seconds(10));
  return "";
}

#define SKIP_WITHOUT_NAMESPACES()                                  \
  do {                                                             \
    if (const std::string why = WhyNoNamespaces(); !why.empty()) { \
      GTEST_SKIP() << why;                                         \
    }                                                              \
  } while (false)

bool NamespaceExists(const std::string& name) {
  const auto list = RunCommand({IpProgram(), "netns", "list"}, std::chrono::seconds(10));
  return list.output.find(name) != std::string::npos;
}

bool LinkExists(const std::string& name) {
  return RunCommand({IpProgram(), "link", "show", name}, std::chrono::seconds(10)).exit.success();
}

std::string Health(const std::string& address, const std::string& service = "") {
  auto channel = MakeChannel(address, TlsConfig{});
  if (!channel.ok()) return channel.status().ToString();
  auto r = CheckHealth(*channel, service, milliseconds(2000));
  return r.ok() ? *r : r.status().ToString();
}

cli::LaunchSpec Spec(const std::string& binary, const std::string& name, const std::string& dir) {
  cli::LaunchSpec spec;
  spec.binary = BinDir() + "/" + binary;
  spec.name = name;
  spec.work_dir = dir;
  spec.startup_timeout = milliseconds(15000);
  return spec;
}

std::string Port(const std::string& address) {
  return address.substr(address.rfind(':') + 1);
}

TEST(NodeNetworkTest, LoopbackModeIsLocalhostWithoutAPrefix) {
  auto network = NodeNetwork::Create(3, "loopback");
  ASSERT_TRUE(network.ok()) << network.status().ToString();
  const NodeNetwork& net = **network;
  EXPECT_FALSE(net.namespaces());
  EXPECT_EQ(net.nodes(), 3);
  EXPECT_EQ(net.host_address(), "127.0.0.1");
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(net.node_address(k), "127.0.0.1");
    EXPECT_TRUE(net.exec_prefix(k).empty());
    EXPECT_EQ(net.namespace_name(k), "");
  }
  EXPECT_EQ(net.bridge_name(), "");
  EXPECT_EQ(net.Describe(), "loopback: every node on 127.0.0.1 (requested)");
}

TEST(NodeNetworkTest, BadModesAndNodeCountsAreRefused) {
  auto bad_mode = NodeNetwork::Create(2, "bridge");
  ASSERT_FALSE(bad_mode.ok());
  EXPECT_EQ(bad_mode.status().ToString(),
            "INVALID_ARGUMENT: network mode must be auto, netns or loopback, got 'bridge'");
  auto no_nodes = NodeNetwork::Create(0, "auto");
  ASSERT_FALSE(no_nodes.ok());
  EXPECT_EQ(no_nodes.status().code(), StatusCode::kInvalidArgument);
  auto too_many = NodeNetwork::Create(NodeNetwork::kMaxNamespaceNodes + 1, "auto");
  ASSERT_TRUE(too_many.ok()) << too_many.status().ToString();
  EXPECT_FALSE((*too_many)->namespaces());  // auto falls back to loopback
}

TEST(NodeNetworkTest, NotRootMeansLoopbackForAutoAndAnErrorForNetns) {
  if (geteuid() == 0) GTEST_SKIP() << "running as root";
  auto automatic = NodeNetwork::Create(2, "auto");
  ASSERT_TRUE(automatic.ok()) << automatic.status().ToString();
  EXPECT_FALSE((*automatic)->namespaces());
  EXPECT_EQ((*automatic)->Describe(), "loopback: every node on 127.0.0.1 (not running as root)");
  auto netns = NodeNetwork::Create(2, "netns");
  ASSERT_FALSE(netns.ok());
  EXPECT_EQ(netns.status().code(), StatusCode::kPermissionDenied);
}

TEST(NodeNetworkTest, NodesInNamespacesTalkAcrossTheBridgeAndEverythingIsRemovedAfterwards) {
  SKIP_WITHOUT_NAMESPACES();
  testing::TempDir dir;
  std::vector<std::string> names;
  std::string bridge, veth0;
  {
    auto network = NodeNetwork::Create(2, "netns");
    ASSERT_TRUE(network.ok()) << network.status().ToString();
    const NodeNetwork& net = **network;
    ASSERT_TRUE(net.namespaces());
    names = {net.namespace_name(0), net.namespace_name(1)};
    bridge = net.bridge_name();
    veth0 = bridge.substr(0, bridge.size() - 2) + "v0";
    const std::string pid = std::to_string(getpid());
    EXPECT_EQ(names[0], "tnd" + pid + "n0");
    EXPECT_EQ(names[1], "tnd" + pid + "n1");
    EXPECT_EQ(bridge, "tnd" + pid + "br");
    EXPECT_LE(bridge.size(), 15u);  // IFNAMSIZ
    EXPECT_TRUE(NamespaceExists(names[0]) && NamespaceExists(names[1]));
    EXPECT_TRUE(LinkExists(bridge));
    EXPECT_TRUE(LinkExists(veth0));
    EXPECT_NE(net.host_address(), "127.0.0.1");
    EXPECT_NE(net.node_address(0), net.node_address(1));
    const std::vector<std::string> prefix0 = net.exec_prefix(0);
    ASSERT_EQ(prefix0.size(), 4u);
    EXPECT_EQ(prefix0[0], IpProgram());
    EXPECT_EQ(std::vector<std::string>(prefix0.begin() + 1, prefix0.end()),
              (std::vector<std::string>{"netns", "exec", names[0]}));
    EXPECT_NE(net.Describe().find("2 network namespaces " + names[0] + "..1 on bridge " + bridge), std::string::npos)
        << net.Describe();

    // The coordinator in the root namespace, on the host address.
    cli::LaunchSpec cspec = Spec("tandem-coordinator", "coordinator", dir.path());
    cspec.listen_host = net.host_address();
    auto coordinator = cli::Launch(cspec);
    ASSERT_TRUE(coordinator.ok()) << coordinator.status().ToString();
    EXPECT_EQ(coordinator->ready.grpc_address.rfind(net.host_address() + ":", 0), 0u)
        << coordinator->ready.grpc_address;

    // A parameter server on node 1: in its namespace, on its address, with its own PID.
    cli::LaunchSpec wspec = Spec("tandem-server", "server", dir.path());
    wspec.listen_host = net.node_address(1);
    wspec.exec_prefix = net.exec_prefix(1);
    wspec.args = {"--coordinator-address", coordinator->ready.grpc_address};
    auto server = cli::Launch(wspec);
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    const std::string address = server->ready.grpc_address;
    EXPECT_EQ(address.rfind(net.node_address(1) + ":", 0), 0u) << address;
    EXPECT_EQ(server->ready.pid, server->process->pid());
    struct stat in_process {
    }, in_namespace{};
    ASSERT_EQ(stat(fmt::format("/proc/{}/ns/net", server->process->pid()).c_str(), &in_process), 0);
    ASSERT_EQ(stat(("/run/netns/" + names[1]).c_str(), &in_namespace), 0);
    EXPECT_EQ(in_process.st_ino, in_namespace.st_ino) << "the server is not in " << names[1];

    // Root namespace -> node 1 (asking), node 1 -> host address (the server is
    // ready once it has reached the coordinator).
    std::string ready;
    for (int i = 0; i < 200 && ready != "SERVING"; ++i) {
      ready = Health(address, kReadyService);
      if (ready != "SERVING") std::this_thread::sleep_for(milliseconds(50));
    }
    EXPECT_EQ(ready, "SERVING") << testing::ReadFile(server->log_file);

    // Node 0 -> node 1 across the bridge.
    std::vector<std::string> health = prefix0;
    health.insert(health.end(), {BinDir() + "/tandem", "health", address, "--timeout", "5s"});
    const auto across = RunCommand(health, std::chrono::seconds(20));
    EXPECT_TRUE(across.exit.success()) << across.exit.ToString() << ": " << across.output;
    EXPECT_NE(across.output.find("SERVING"), std::string::npos) << across.output;

    // Node 0's loopback is its own: the server is not on it.
    health = prefix0;
    health.insert(health.end(), {BinDir() + "/tandem", "health", "127.0.0.1:" + Port(address), "--timeout", "1s"});
    const auto local = RunCommand(health, std::chrono::seconds(20));
    EXPECT_EQ(local.exit.ToString(), "exit 1") << local.output;

    // Stopped (SIGTERM, then SIGKILL) before the network goes; how they exit is daemon_process_test's business.
    const pid_t server_pid = server->process->pid(), coordinator_pid = coordinator->process->pid();
    server->process->Stop(milliseconds(5000));
    coordinator->process->Stop(milliseconds(5000));
    EXPECT_TRUE(testing::ProcessGroupGone(server_pid));
    EXPECT_TRUE(testing::ProcessGroupGone(coordinator_pid));
  }
  EXPECT_FALSE(NamespaceExists(names[0]));
  EXPECT_FALSE(NamespaceExists(names[1]));
  EXPECT_FALSE(LinkExists(bridge));
  EXPECT_FALSE(LinkExists(veth0));
}

TEST(NodeNetworkTest, StaleLeftoversOfTheSameNamesAreReplaced) {
  SKIP_WITHOUT_NAMESPACES();
  const std::string pid = std::to_string(getpid());
  const std::string ns = "tnd" + pid + "n0", bridge = "tnd" + pid + "br";
  ASSERT_TRUE(RunCommand({IpProgram(), "netns", "add", ns}).exit.success());
  ASSERT_TRUE(RunCommand({IpProgram(), "link", "add", bridge, "type", "bridge"}).exit.success());
  {
    auto network = NodeNetwork::Create(1, "netns");
    ASSERT_TRUE(network.ok()) << network.status().ToString();
    EXPECT_EQ((*network)->namespace_name(0), ns);
    EXPECT_EQ((*network)->bridge_name(), bridge);
    EXPECT_NE((*network)->Describe().find("1 network namespace " + ns + " on bridge " + bridge), std::string::npos)
        << (*network)->Describe();
  }
  EXPECT_FALSE(NamespaceExists(ns));
  EXPECT_FALSE(LinkExists(bridge));
}

TEST(NodeNetworkTest, OneNamespaceNetworkPerProcessAtATime) {
  SKIP_WITHOUT_NAMESPACES();
  auto first = NodeNetwork::Create(1, "auto");
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_TRUE((*first)->namespaces()) << (*first)->Describe();
  auto second = NodeNetwork::Create(1, "netns");
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  auto fallback = NodeNetwork::Create(1, "auto");
  ASSERT_TRUE(fallback.ok());
  EXPECT_FALSE((*fallback)->namespaces());
  EXPECT_TRUE(LinkExists((*first)->bridge_name()));  // the refused ones touched nothing
  first->reset();
  auto again = NodeNetwork::Create(1, "netns");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_TRUE((*again)->namespaces());
}

}  // namespace
}  // namespace tandem
