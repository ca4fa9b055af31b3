// Each daemon as a real process: it starts on free ports, serves the gRPC
// health service and a /metrics page that promtool accepts, refuses bad flags
// and configuration with a clear message, survives garbage on its ports, and
// exits 0 within 5 s of SIGTERM leaving no process behind.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>

#include <gtest/gtest.h>

#include "cli/launcher.h"
#include "common/config.h"
#include "common/grpc_util.h"
#include "common/health.h"
#include "launch_util.h"
#include "test_util.h"

namespace tandem {
namespace {

using std::chrono::milliseconds;
using testing::BinDir;
using testing::RunCommand;
using testing::TempDir;

Result<cli::LaunchedDaemon> Start(const std::string& binary, const TempDir& dir, std::vector<std::string> args = {}) {
  return testing::StartDaemon(binary, binary, dir.path(), std::move(args));
}

std::string Health(const std::string& address, const std::string& service = "") {
  auto channel = MakeChannel(address, TlsConfig{});
  if (!channel.ok()) return channel.status().ToString();
  auto r = CheckHealth(*channel, service, milliseconds(5000));
  return r.ok() ? *r : r.status().ToString();
}

// SIGTERM, then: exit 0 within 5 s and nothing left in the process group.
void ExpectCleanStop(cli::LaunchedDaemon& d) {
  const pid_t pid = d.process->pid();
  ASSERT_TRUE(d.process->Signal(SIGTERM).ok());
  const auto t0 = std::chrono::steady_clock::now();
  auto exit = d.process->Wait(milliseconds(5000));
  ASSERT_TRUE(exit.ok()) << d.name << " still running 5 s after SIGTERM\n" << testing::ReadFile(d.log_file);
  EXPECT_TRUE(exit->success()) << exit->ToString() << "\n" << testing::ReadFile(d.log_file);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_TRUE(testing::ProcessGroupGone(pid));
  EXPECT_NE(testing::ReadFile(d.log_file).find("stopped cleanly"), std::string::npos);
}

class DaemonTest : public ::testing::TestWithParam<std::string> {};

TEST_P(DaemonTest, ServesHealthAndValidMetricsAndStopsCleanlyOnSigterm) {
  TempDir dir;
  // Members follow a coordinator; give them one so they report ready.
  std::optional<cli::LaunchedDaemon> coordinator;
  std::vector<std::string> args;
  if (GetParam() != "tandem-coordinator") {
    auto c = Start("tandem-coordinator", dir);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    coordinator = std::move(*c);
    args = {"--coordinator-address", coordinator->ready.grpc_address};
  }
  auto d = Start(GetParam(), dir, args);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(Health(d->ready.grpc_address), "SERVING");
  // Readiness comes once the coordinator is reached (members) or at once (coordinator).
  std::string ready;
  for (int i = 0; i < 200 && ready != "SERVING"; ++i) {
    ready = Health(d->ready.grpc_address, kReadyService);
    if (ready != "SERVING") std::this_thread::sleep_for(milliseconds(25));
  }
  EXPECT_EQ(ready, "SERVING");

  auto page = HttpGet(d->ready.metrics_address, "/metrics", milliseconds(5000));
  ASSERT_TRUE(page.ok()) << page.status().ToString();
  EXPECT_NE(page->find("tandem_build_info{"), std::string::npos);
  EXPECT_NE(page->find("tandem_process_resident_memory_bytes"), std::string::npos);
  if (coordinator) {
    EXPECT_NE(page->find("tandem_coordinator_reachable 1"), std::string::npos) << *page;
  }
  const std::string metrics_file = dir.File("metrics.txt", *page);
  const auto promtool = RunCommand({"/bin/sh", "-c", "promtool check metrics < " + metrics_file});
  EXPECT_TRUE(promtool.exit.success()) << "promtool check metrics failed:\n" << promtool.output << "\n" << *page;

  // The ready file goes away with the daemon.
  const std::string ready_file = dir.path() + "/" + GetParam() + ".ready.json";
  EXPECT_EQ(access(ready_file.c_str(), F_OK), 0);
  ExpectCleanStop(*d);
  EXPECT_NE(access(ready_file.c_str(), F_OK), 0);
  if (coordinator) ExpectCleanStop(*coordinator);
}

TEST_P(DaemonTest, HelpAndVersion) {
  const auto help = RunCommand({BinDir() + "/" + GetParam(), "--help"});
  EXPECT_TRUE(help.exit.success()) << help.output;
  EXPECT_NE(help.output.find("--listen-address HOST:PORT"), std::string::npos) << help.output;
  EXPECT_NE(help.output.find("--metrics-address HOST:PORT"), std::string::npos);
  EXPECT_NE(help.output.find("--config FILE"), std::string::npos);
  EXPECT_NE(help.output.find("--tls-cert-file"), std::string::npos);
  const auto version = RunCommand({BinDir() + "/" + GetParam(), "--version"});
  EXPECT_TRUE(version.exit.success());
  EXPECT_EQ(version.output.rfind(GetParam() + " 0.", 0), 0u) << version.output;
}

TEST_P(DaemonTest, BadFlagsAndConfigurationExitWithStatus2AndSayWhy) {
  TempDir dir;
  const std::string bin = BinDir() + "/" + GetParam();
  const auto flag = RunCommand({bin, "--listen-adress", "127.0.0.1:0"});
  EXPECT_EQ(flag.exit.ToString(), "exit 2");
  EXPECT_NE(flag.output.find("unknown flag --listen-adress (did you mean --listen-address?)"), std::string::npos)
      << flag.output;
  const auto value = RunCommand({bin, "--shutdown-grace", "forever"});
  EXPECT_EQ(value.exit.ToString(), "exit 2");
  EXPECT_NE(value.output.find("--shutdown-grace: expected a duration"), std::string::npos) << value.output;
  const std::string file = dir.File("bad.yaml", "metrics_address: 127.0.0.1:0\nlisten_adress: 127.0.0.1:0\n");
  const auto config = RunCommand({bin, "--config", file});
  EXPECT_EQ(config.exit.ToString(), "exit 2");
  EXPECT_NE(config.output.find(file + ":2:1: unknown key 'listen_adress' (did you mean 'listen_address'?)"),
            std::string::npos)
      << config.output;
}

TEST_P(DaemonTest, ExampleConfigurationLoads) {
  const std::string role = GetParam().substr(std::string("tandem-").size());
  const std::string file = testing::SourceDir() + "/deploy/config/" + role + ".yaml";
  const auto r = RunCommand({BinDir() + "/" + GetParam(), "--config", file, "--check-config"});
  EXPECT_TRUE(r.exit.success()) << r.output;
  EXPECT_NE(r.output.find("listen_address:"), std::string::npos) << r.output;
}

TEST_P(DaemonTest, AnAddressInUseIsAClearStartupFailure) {
  TempDir dir;
  std::vector<std::string> args;
  if (GetParam() != "tandem-coordinator") args = {"--coordinator-address", "127.0.0.1:1"};
  auto first = Start(GetParam(), dir, args);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  std::vector<std::string> argv = {BinDir() + "/" + GetParam(), "--listen-address", first->ready.grpc_address,
                                   "--metrics-address", "127.0.0.1:0"};
  const auto second = RunCommand(argv);
  EXPECT_EQ(second.exit.ToString(), "exit 1") << second.output;
  EXPECT_NE(second.output.find("cannot serve gRPC on " + first->ready.grpc_address), std::string::npos)
      << second.output;
  ExpectCleanStop(*first);
}

// UCX settings are checked against this host when a daemon starts, not at
// its first epoch (--check-config only reads them: a configuration rendered
// for other hosts names their devices).
TEST(DaemonRobustnessTest, UcxDevicesAndTransportsThisHostLacksStopTheStart) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"tandem-worker", {"--data-plane-ucx-net-devices", "nosuchdev0"}},
      {"tandem-worker", {"--data-plane-ucx-tls", "tcp,bogus"}},
      {"tandem-server", {"--server-ucx-net-devices", "nosuchdev0"}},
      {"tandem-server", {"--server-ucx-tls", "bogus"}},
  };
  for (const auto& [binary, flags] : cases) {
    std::vector<std::string> argv = {
        BinDir() + "/" + binary, "--coordinator-address", "127.0.0.1:1", "--listen-address",
        "127.0.0.1:0",           "--metrics-address",     "127.0.0.1:0"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    const auto r = RunCommand(argv, std::chrono::seconds(20));
    EXPECT_EQ(r.exit.ToString(), "exit 1") << binary << " " << flags[0] << ": " << r.output;
    const std::string named =
        flags[1] == "nosuchdev0" ? "this host has no network device 'nosuchdev0'" : "unknown UCX transport 'bogus'";
    EXPECT_NE(r.output.find(named), std::string::npos) << r.output;
    auto check = argv;
    check.push_back("--check-config");
    EXPECT_TRUE(RunCommand(check, std::chrono::seconds(20)).exit.success()) << binary << " " << flags[0];
  }
}

TEST(DaemonRobustnessTest, AWorkerCpuListThatIsWrongOrNotAllowedStopsTheStart) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"0,a", "cpus '0,a': 'a' is not a CPU number"},
      {"3-1", "cpus '3-1': the range '3-1' ends before it starts"},
      {"1023", "cpus '1023': CPU(s) 1023 are not available to this process"},
  };
  for (const auto& [cpus, named] : cases) {
    const std::vector<std::string> argv = {BinDir() + "/tandem-worker",
                                           "--coordinator-address",
                                           "127.0.0.1:1",
                                           "--listen-address",
                                           "127.0.0.1:0",
                                           "--metrics-address",
                                           "127.0.0.1:0",
                                           "--cpus",
                                           cpus};
    const auto r = RunCommand(argv, std::chrono::seconds(20));
    EXPECT_EQ(r.exit.ToString(), "exit 1") << cpus << ": " << r.output;
    EXPECT_NE(r.output.find(named), std::string::npos) << r.output;
  }
}

INSTANTIATE_TEST_SUITE_P(Daemons, DaemonTest, ::testing::Values("tandem-coordinator", "tandem-server", "tandem-worker"),
                         [](const auto& p) { return p.param.substr(7); });

// Sends raw bytes to host:port and closes.
void SendGarbage(const std::string& address, const std::string& bytes) {
  auto hp = ParseHostPort(address);
  ASSERT_TRUE(hp.ok());
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(hp->port));
  inet_pton(AF_INET, hp->host.c_str(), &sa.sin_addr);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  (void)!send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  close(fd);
}

TEST(DaemonRobustnessTest, GarbageOnBothPortsLeavesTheDaemonServing) {
  TempDir dir;
  auto d = Start("tandem-coordinator", dir);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  std::string junk(70000, '\0');
  for (size_t i = 0; i < junk.size(); ++i) junk[i] = static_cast<char>((i * 7919) % 251);
  for (int i = 0; i < 5; ++i) {
    SendGarbage(d->ready.grpc_address, junk);
    SendGarbage(d->ready.metrics_address, junk);
    SendGarbage(d->ready.metrics_address, "POST /metrics HTTP/1.0\r\n\r\n");
  }
  EXPECT_FALSE(HttpGet(d->ready.metrics_address, "/nope", milliseconds(5000)).ok());  // 404
  EXPECT_EQ(Health(d->ready.grpc_address), "SERVING");
  EXPECT_TRUE(HttpGet(d->ready.metrics_address, "/metrics", milliseconds(5000)).ok());
  EXPECT_TRUE(d->process->Running());
  ExpectCleanStop(*d);
}

TEST(DaemonRobustnessTest, MemberWaitsForAnAbsentCoordinatorInsteadOfExiting) {
  TempDir dir;
  auto w = Start("tandem-worker", dir, {"--coordinator-address", "127.0.0.1:1"});
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  std::this_thread::sleep_for(milliseconds(300));
  EXPECT_TRUE(w->process->Running());
  EXPECT_EQ(Health(w->ready.grpc_address), "SERVING");                     // alive
  EXPECT_EQ(Health(w->ready.grpc_address, kReadyService), "NOT_SERVING");  // not ready
  auto page = HttpGet(w->ready.metrics_address, "/metrics", milliseconds(5000));
  ASSERT_TRUE(page.ok());
  EXPECT_NE(page->find("tandem_coordinator_reachable 0"), std::string::npos);
  EXPECT_NE(testing::ReadFile(w->log_file).find("coordinator at 127.0.0.1:1 is not reachable"), std::string::npos);
  ExpectCleanStop(*w);
}

TEST(DaemonRobustnessTest, SigintAlsoStopsCleanly) {
  TempDir dir;
  auto d = Start("tandem-server", dir, {"--coordinator-address", "127.0.0.1:1"});
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  ASSERT_TRUE(d->process->Signal(SIGINT).ok());
  auto exit = d->process->Wait(milliseconds(5000));
  ASSERT_TRUE(exit.ok());
  EXPECT_TRUE(exit->success()) << exit->ToString();
}

}  // namespace
}  // namespace tandem
