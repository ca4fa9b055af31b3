// The coordinator with real processes on loopback: 8 workers and 2 servers
// form an epoch; kill -9 of a worker, a new worker, a graceful leave on
// SIGTERM; kill -9 of the coordinator itself and a restart that members
// re-attach to without a new rendezvous; a restart under the same name that
// replaces the old process at once; a torn log tail; hostile requests.
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>

#include "cli/launcher.h"
#include "common/grpc_util.h"
#include "launch_util.h"
#include "tandem/config.h"
#include "tandem/v1/coordinator.grpc.pb.h"
#include "test_util.h"

namespace tandem {
namespace {

using std::chrono::milliseconds;
using testing::BinDir;

class CoordinatorProcessTest : public ::testing::Test {
 protected:
  Result<cli::LaunchedDaemon> StartCoordinator(std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"--data-dir",
                                     dir_.path() + "/state",
                                     "--job-min-workers",
                                     "8",
                                     "--job-max-workers",
                                     "16",
                                     "--job-min-servers",
                                     "2",
                                     "--job-last-call-window",
                                     "300ms",
                                     "--job-parameter-count",
                                     "50000000"};
    args.insert(args.end(), extra.begin(), extra.end());
    return Start("tandem-coordinator", "coordinator", args);
  }

  Result<cli::LaunchedDaemon> Start(const std::string& binary, const std::string& name, std::vector<std::string> args) {
    return testing::StartDaemon(binary, name, dir_.path(), std::move(args));
  }

  // Workers run without communicators here: this test times the control plane
  // (data_plane_process_test covers the data plane across epochs).
  Result<cli::LaunchedDaemon> StartMember(const std::string& binary, const std::string& name, const std::string& node) {
    std::vector<std::string> args = {"--coordinator-address", coordinator_address_, "--node-id", node};
    if (binary == "tandem-worker") args.insert(args.end(), {"--data-plane-backend", "off"});
    return Start(binary, name, args);
  }

  v1::GetStatusResponse Status_() {
    auto channel = MakeChannel(coordinator_address_, TlsConfig{});
    auto stub = v1::CoordinatorAdmin::NewStub(*channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    v1::GetStatusRequest request;
    v1::GetStatusResponse response;
    if (!stub->GetStatus(&ctx, request, &response).ok()) return v1::GetStatusResponse();
    return response;
  }

  // Waits until `pred(status)` holds; returns the status and how long it took.
  std::pair<v1::GetStatusResponse, double> WaitFor(const std::function<bool(const v1::GetStatusResponse&)>& pred,
                                                   milliseconds timeout = milliseconds(20000)) {
    const auto t0 = std::chrono::steady_clock::now();
    v1::GetStatusResponse s;
    while (std::chrono::steady_clock::now() - t0 < timeout) {
      s = Status_();
      if (pred(s)) break;
      std::this_thread::sleep_for(milliseconds(10));
    }
    return {s, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()};
  }

  // The ranked workers of the active epoch: rank -> member id.
  static std::map<uint32_t, uint64_t> Ranks(const v1::GetStatusResponse& s) {
    std::map<uint32_t, uint64_t> out;
    for (const auto& m : s.members()) {
      if (m.role() == v1::ROLE_WORKER && m.has_rank() && m.state() == v1::MEMBER_STATE_ACTIVE) {
        out[m.rank().global_rank()] = m.member_id();
      }
    }
    return out;
  }

  static bool Contiguous(const std::map<uint32_t, uint64_t>& ranks, size_t n) {
    if (ranks.size() != n) return false;
    uint32_t expect = 0;
    for (const auto& [r, id] : ranks) {
      if (r != expect++) return false;
    }
    return true;
  }

  testing::TempDir dir_;
  std::string coordinator_address_;
};

TEST_F(CoordinatorProcessTest, FormsEpochsThroughFailuresJoinsLeavesAndACoordinatorRestart) {
  auto coordinator = StartCoordinator();
  ASSERT_TRUE(coordinator.ok()) << coordinator.status().ToString();
  coordinator_address_ = coordinator->ready.grpc_address;
  std::vector<cli::LaunchedDaemon> servers;
  std::vector<cli::LaunchedDaemon> workers;
  for (int i = 0; i < 2; ++i) {
    auto s = StartMember("tandem-server", "server-" + std::to_string(i), "ps-" + std::to_string(i));
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    servers.push_back(std::move(*s));
  }
  for (int i = 0; i < 8; ++i) {
    auto w = StartMember("tandem-worker", "worker-" + std::to_string(i), "node-" + std::to_string(i / 4));
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    workers.push_back(std::move(*w));
  }

  // Epoch 1: 8 workers with contiguous ranks, 4 per node, and a shard map over 2 servers.
  auto [s1, t1] = WaitFor([](const auto& s) { return s.active_epoch() == 1; });
  ASSERT_EQ(s1.active_epoch(), 1u) << testing::ReadFile(coordinator->log_file);
  auto ranks = Ranks(s1);
  ASSERT_TRUE(Contiguous(ranks, 8));
  for (const auto& m : s1.members()) {
    if (m.role() != v1::ROLE_WORKER) continue;
    EXPECT_EQ(m.rank().node_rank(), m.rank().global_rank() / 4);  // node-0 holds ranks 0-3, node-1 ranks 4-7
    EXPECT_EQ(m.rank().local_rank(), m.rank().global_rank() % 4);
  }
  // Members describe their node when they register.
  for (const auto& m : s1.members()) {
    EXPECT_GT(m.node().cpu_cores(), 0u);
    EXPECT_GT(m.node().memory_bytes(), 0u);
    if (m.role() == v1::ROLE_WORKER && TANDEM_CUDA_ENABLED) {
      EXPECT_FALSE(m.node().capabilities().nccl_version().empty()) << "member " << m.member_id();
    }
  }
  ASSERT_GT(s1.shard_map().partitions_size(), 0);
  for (const auto& p : s1.shard_map().partitions()) EXPECT_NE(p.primary_member_id(), p.backup_member_id());

  // kill -9 a worker: the survivors see a new epoch within the deadline, ranks contiguous.
  ASSERT_TRUE(workers[5].process->Signal(SIGKILL).ok());
  auto [s2, t2] = WaitFor([](const auto& s) { return s.active_epoch() == 2; });
  ASSERT_EQ(s2.active_epoch(), 2u) << testing::ReadFile(coordinator->log_file);
  EXPECT_LT(t2, 3.5) << "detection and re-formation took " << t2 << " s";
  EXPECT_TRUE(Contiguous(Ranks(s2), 7));
  // Survivors before the failure keep their ranks.
  for (uint32_t r = 0; r < 5; ++r) EXPECT_EQ(Ranks(s2)[r], ranks[r]);

  // A new worker is admitted as the next epoch.
  auto extra = StartMember("tandem-worker", "worker-8", "node-1");
  ASSERT_TRUE(extra.ok());
  auto [s3, t3] = WaitFor([](const auto& s) { return s.active_epoch() == 3; });
  ASSERT_EQ(s3.active_epoch(), 3u);
  EXPECT_TRUE(Contiguous(Ranks(s3), 8));

  // SIGTERM: a graceful leave; the next epoch forms at once, not after a deadline.
  ASSERT_TRUE(workers[0].process->Signal(SIGTERM).ok());
  auto [s4, t4] = WaitFor([](const auto& s) { return s.active_epoch() == 4; });
  ASSERT_EQ(s4.active_epoch(), 4u);
  EXPECT_LT(t4, 1.5) << "a graceful leave took " << t4 << " s";
  EXPECT_TRUE(Contiguous(Ranks(s4), 7));
  EXPECT_TRUE(workers[0].process->Wait(milliseconds(5000)).ok());

  // kill -9 the coordinator and restart it on the same port and data: the same
  // epoch goes on, every member re-attaches, nobody re-rendezvouses.
  const auto ranks_before = Ranks(s4);
  ASSERT_TRUE(coordinator->process->Signal(SIGKILL).ok());
  ASSERT_TRUE(coordinator->process->Wait(milliseconds(5000)).ok());
  std::this_thread::sleep_for(milliseconds(500));
  auto restarted = StartCoordinator({"--listen-address", coordinator_address_});
  ASSERT_TRUE(restarted.ok()) << restarted.status().ToString();
  auto [s5, t5] = WaitFor([](const auto& s) { return s.coordinator_incarnation() == 2 && s.active_epoch() == 4; });
  EXPECT_EQ(s5.active_epoch(), 4u);
  // Members re-attach (heartbeats resume) and stay in the epoch past the old deadline.
  std::this_thread::sleep_for(milliseconds(3500));
  auto s6 = Status_();
  EXPECT_EQ(s6.active_epoch(), 4u) << testing::ReadFile(restarted->log_file);
  EXPECT_EQ(Ranks(s6), ranks_before);
  for (const auto& m : s6.members()) {
    if (m.state() == v1::MEMBER_STATE_ACTIVE) {
      EXPECT_LT(m.last_heartbeat_age().seconds(), 3) << "member " << m.member_id() << " did not re-attach";
    }
  }
  // The restarted process appends to the same log file: look at its part only.
  const std::string whole = testing::ReadFile(restarted->log_file);
  const std::string log = whole.substr(whole.rfind("starting (pid"));
  EXPECT_NE(log.find("recovered 1 job(s)"), std::string::npos) << log;
  EXPECT_EQ(log.find("rendezvous complete"), std::string::npos) << "no new rendezvous after a restart";

  for (auto& w : workers) (void)w.process->Stop(milliseconds(5000));
  (void)extra->process->Stop(milliseconds(5000));
  for (auto& s : servers) (void)s.process->Stop(milliseconds(5000));
  EXPECT_TRUE(restarted->process->Stop(milliseconds(5000)).success());
}

// Issue 28: a process that restarts under its --name replaces its old
// incarnation at once (here the old one is stopped, not dead, and the
// heartbeat deadline is long); when the old one resumes, it finds itself
// replaced and exits with status 1 instead of taking the name back.
TEST_F(CoordinatorProcessTest, ARestartUnderTheSameNameReplacesTheOldProcessWhichThenExits) {
  auto coordinator =
      StartCoordinator({"--job-min-workers", "1", "--job-min-servers", "0", "--job-heartbeat-deadline", "60s"});
  ASSERT_TRUE(coordinator.ok()) << coordinator.status().ToString();
  coordinator_address_ = coordinator->ready.grpc_address;
  // Two processes of the name "w" (their files are named apart); incarnations by default.
  const std::vector<std::string> args = {"--coordinator-address",
                                         coordinator_address_,
                                         "--node-id",
                                         "node-0",
                                         "--data-plane-backend",
                                         "off",
                                         "--name",
                                         "w"};
  auto old = Start("tandem-worker", "w-old", args);
  ASSERT_TRUE(old.ok()) << old.status().ToString();
  auto [s1, t1] = WaitFor([](const auto& s) { return s.active_epoch() == 1; });
  ASSERT_EQ(s1.active_epoch(), 1u) << testing::ReadFile(coordinator->log_file);
  ASSERT_EQ(s1.members_size(), 1);
  EXPECT_EQ(s1.members(0).member_name(), "w");
  EXPECT_EQ(s1.members(0).pid(), static_cast<uint32_t>(old->process->pid()));
  const uint64_t old_id = s1.members(0).member_id();
  const uint64_t old_incarnation = s1.members(0).incarnation();
  EXPECT_GT(old_incarnation, 0u);

  ASSERT_TRUE(old->process->Signal(SIGSTOP).ok());  // wedged: alive, silent
  auto fresh = Start("tandem-worker", "w-new", args);
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  auto [s2, t2] = WaitFor([](const auto& s) { return s.active_epoch() == 2; });
  ASSERT_EQ(s2.active_epoch(), 2u) << testing::ReadFile(coordinator->log_file);
  EXPECT_LT(t2, 20.0) << "the replacement waited " << t2 << " s (the heartbeat deadline is 60 s)";
  for (const auto& m : s2.members()) {
    if (m.member_id() == old_id) {
      EXPECT_EQ(m.state(), v1::MEMBER_STATE_DEAD);
      EXPECT_EQ(m.host_failures(), 0u);
    } else {
      EXPECT_EQ(m.member_name(), "w");
      EXPECT_GT(m.incarnation(), old_incarnation);
      EXPECT_EQ(m.pid(), static_cast<uint32_t>(fresh->process->pid()));
      EXPECT_TRUE(m.has_rank());
    }
  }
  EXPECT_NE(testing::ReadFile(coordinator->log_file).find("worker 'w' restarted"), std::string::npos);

  // The old process resumes: replaced, it exits with status 1 and says why.
  ASSERT_TRUE(old->process->Signal(SIGCONT).ok());
  auto exited = old->process->Wait(milliseconds(20000));
  ASSERT_TRUE(exited.ok()) << "the replaced process did not exit: " << testing::ReadFile(old->log_file);
  EXPECT_EQ(exited->ToString(), "exit 1") << testing::ReadFile(old->log_file);
  EXPECT_NE(testing::ReadFile(old->log_file).find("a newer incarnation of 'w' replaced this process"),
            std::string::npos)
      << testing::ReadFile(old->log_file);
  const auto s3 = Status_();
  EXPECT_EQ(s3.active_epoch(), 2u);  // the refusal changed nothing
  EXPECT_TRUE(fresh->process->Stop(milliseconds(5000)).success());
  EXPECT_TRUE(coordinator->process->Stop(milliseconds(5000)).success());
}

TEST_F(CoordinatorProcessTest, ATornLogTailIsRecoveredUpToTheLastGoodRecord) {
  auto coordinator = StartCoordinator({"--job-min-workers", "1", "--job-min-servers", "0"});
  ASSERT_TRUE(coordinator.ok()) << coordinator.status().ToString();
  coordinator_address_ = coordinator->ready.grpc_address;
  auto worker = StartMember("tandem-worker", "worker", "node-0");
  ASSERT_TRUE(worker.ok());
  auto [s1, t1] = WaitFor([](const auto& s) { return s.active_epoch() == 1; });
  ASSERT_EQ(s1.active_epoch(), 1u);
  // The status shows the activation as soon as it is decided; it is durable
  // once the member hears of it (the watch stream sends only durable
  // epochs). Kill only then, so the activation is in the log.
  const auto heard = std::chrono::steady_clock::now() + milliseconds(10000);
  while (testing::ReadFile(worker->log_file).find("epoch 1 is active") == std::string::npos &&
         std::chrono::steady_clock::now() < heard) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  ASSERT_NE(testing::ReadFile(worker->log_file).find("epoch 1 is active"), std::string::npos)
      << testing::ReadFile(worker->log_file);
  ASSERT_TRUE(coordinator->process->Signal(SIGKILL).ok());
  ASSERT_TRUE(coordinator->process->Wait(milliseconds(5000)).ok());
  // A crash mid-write leaves half a record at the end of the newest log segment.
  std::string newest;
  for (const auto& e : std::filesystem::directory_iterator(dir_.path() + "/state")) {
    if (e.path().extension() == ".tlog" && e.path().string() > newest) newest = e.path().string();
  }
  ASSERT_FALSE(newest.empty());
  std::ofstream(newest, std::ios::app | std::ios::binary) << std::string("\x54\x4c\x52\x31garbage-half-record", 23);
  auto restarted = StartCoordinator({"--listen-address", coordinator_address_, "--job-min-workers", "1"});
  ASSERT_TRUE(restarted.ok()) << restarted.status().ToString();
  auto [s2, t2] = WaitFor([](const auto& s) { return s.coordinator_incarnation() == 2; });
  EXPECT_EQ(s2.active_epoch(), 1u);
  const std::string log = testing::ReadFile(restarted->log_file);
  EXPECT_NE(log.find(" W "), std::string::npos) << log;  // a warning names the dropped tail
  EXPECT_NE(log.find("store:"), std::string::npos) << log;
  (void)worker->process->Stop(milliseconds(5000));
  EXPECT_TRUE(restarted->process->Stop(milliseconds(5000)).success());
}

TEST_F(CoordinatorProcessTest, DrainScaleAndStatusFromTheCommandLine) {
  auto coordinator = StartCoordinator({"--job-min-workers", "1", "--job-max-workers", "3", "--job-min-servers", "0"});
  ASSERT_TRUE(coordinator.ok()) << coordinator.status().ToString();
  coordinator_address_ = coordinator->ready.grpc_address;
  std::vector<cli::LaunchedDaemon> workers;
  for (int i = 0; i < 3; ++i) {
    auto w = StartMember("tandem-worker", "worker-" + std::to_string(i), "node-0");
    ASSERT_TRUE(w.ok());
    workers.push_back(std::move(*w));
  }
  auto [s1, t1] = WaitFor([](const auto& s) { return s.active_epoch() > 0 && Ranks(s).size() == 3; });
  ASSERT_EQ(Ranks(s1).size(), 3u);
  const std::string tandem = BinDir() + "/tandem";
  const uint64_t victim = Ranks(s1)[1];
  auto drain = testing::RunCommand(
      {tandem, "drain", std::to_string(victim), "--coordinator", coordinator_address_, "--reason", "maintenance"});
  EXPECT_TRUE(drain.exit.success()) << drain.output;
  auto [s2, t2] = WaitFor([](const auto& s) { return s.active_epoch() > 0 && Ranks(s).size() == 2; });
  EXPECT_TRUE(Contiguous(Ranks(s2), 2));
  auto scale = testing::RunCommand({tandem, "scale", "--max", "1", "--coordinator", coordinator_address_});
  EXPECT_TRUE(scale.exit.success()) << scale.output;
  EXPECT_NE(scale.output.find("1..1 workers"), std::string::npos) << scale.output;
  auto [s3, t3] = WaitFor([](const auto& s) { return s.active_epoch() > 0 && Ranks(s).size() == 1; });
  EXPECT_EQ(Ranks(s3).size(), 1u);
  // Drained members learn it from their next heartbeat and leave.
  WaitFor([](const auto& s) {
    for (const auto& m : s.members()) {
      if (m.state() == v1::MEMBER_STATE_LEFT) return true;
    }
    return false;
  });
  auto status = testing::RunCommand({tandem, "status", "--coordinator", coordinator_address_});
  EXPECT_TRUE(status.exit.success()) << status.output;
  EXPECT_NE(status.output.find("job default: epoch"), std::string::npos) << status.output;
  EXPECT_NE(status.output.find("left"), std::string::npos) << status.output;  // the drained member left
  auto bad = testing::RunCommand({tandem, "drain", "not-a-number", "--coordinator", coordinator_address_});
  EXPECT_EQ(bad.exit.ToString(), "exit 2");
  auto unknown = testing::RunCommand({tandem, "drain", "999999", "--coordinator", coordinator_address_});
  EXPECT_EQ(unknown.exit.ToString(), "exit 1");
  EXPECT_NE(unknown.output.find("NOT_FOUND"), std::string::npos) << unknown.output;
  for (auto& w : workers) EXPECT_TRUE(w.process->Stop(milliseconds(5000)).success());
  EXPECT_TRUE(coordinator->process->Stop(milliseconds(5000)).success());
}

TEST_F(CoordinatorProcessTest, HostileRequestsGetErrorsAndTheCoordinatorKeepsServing) {
  const std::string token_file = dir_.File("token", "correct-horse\n");
  auto coordinator = StartCoordinator({"--auth-token-file", token_file, "--max-members", "64"});
  ASSERT_TRUE(coordinator.ok()) << coordinator.status().ToString();
  coordinator_address_ = coordinator->ready.grpc_address;
  auto channel = MakeChannel(coordinator_address_, TlsConfig{});
  auto stub = v1::Coordinator::NewStub(*channel);
  const auto call = [&](v1::RegisterRequest r) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::RegisterResponse response;
    return stub->Register(&ctx, r, &response);
  };
  v1::RegisterRequest r;
  r.set_job_id("default");
  r.set_role(v1::ROLE_WORKER);
  r.mutable_node()->set_hostname("h");
  auto s = call(r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  r.set_token("wrong");
  EXPECT_EQ(call(r).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  r.set_token("correct-horse");
  r.set_job_id("unknown");
  s = call(r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(s.error_message().find("unknown job 'unknown'"), std::string::npos) << s.error_message();
  // An impossible mesh in a new job's spec.
  r.set_job_id("mesh");
  r.mutable_job_spec()->set_job_id("mesh");
  r.mutable_job_spec()->set_min_workers(2);
  r.mutable_job_spec()->mutable_mesh()->set_tp(100000);
  s = call(r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("mesh"), std::string::npos) << s.error_message();
  // Absurd sizes: a 20 MiB hostname is refused by the message limit, not by a crash.
  r.clear_job_spec();
  r.set_job_id("default");
  r.mutable_node()->set_hostname(std::string(20 << 20, 'x'));
  s = call(r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  r.mutable_node()->set_hostname(std::string(300, 'x'));
  EXPECT_EQ(call(r).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // Garbage bytes on the port.
  {
    auto hp = ParseHostPort(coordinator_address_);
    ASSERT_TRUE(hp.ok());
    const auto r2 = testing::RunCommand(
        {"/bin/bash", "-c",
         "head -c 100000 /dev/urandom > /dev/tcp/127.0.0.1/" + std::to_string(hp->port) + " || true"});
    (void)r2;
  }
  // Still serving: a proper registration works.
  r.mutable_node()->set_hostname("h");
  EXPECT_TRUE(call(r).ok());
  EXPECT_TRUE(coordinator->process->Running());
  EXPECT_TRUE(coordinator->process->Stop(milliseconds(5000)).success());
}

}  // namespace
}  // namespace tandem
