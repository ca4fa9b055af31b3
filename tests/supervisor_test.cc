// The supervisor of `tandem run` (cli/supervisor.h) over stand-in daemons
// (a shell that writes its ready file and sleeps), and the fault plans of
// cli/faults.h: parsing, checking against a cluster, and the seeded drill.
#include "cli/supervisor.h"

#include <signal.h>

#include <set>
#include <thread>

#include <gtest/gtest.h>

#include "cli/faults.h"
#include "test_util.h"

namespace tandem::cli {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// A daemon that serves at once and runs until killed.
LaunchSpec StandIn(const std::string& dir, const std::string& name) {
  LaunchSpec spec;
  spec.name = name;
  spec.work_dir = dir;
  spec.startup_timeout = milliseconds(10000);
  spec.command = [](const std::vector<std::string>& flags) {
    std::vector<std::string> argv = {"/bin/sh", "-c",
                                     "while [ $# -gt 0 ]; do [ \"$1\" = --ready-file ] && ready=$2; shift; done; "
                                     "printf '{\"name\":\"x\",\"role\":\"worker\",\"pid\":%d,\"grpc_address\":"
                                     "\"127.0.0.1:7\",\"metrics_address\":\"127.0.0.1:8\"}' $$ > \"$ready.tmp\" && "
                                     "mv \"$ready.tmp\" \"$ready\" && exec sleep 60",
                                     "stand-in"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    return argv;
  };
  return spec;
}

class SupervisorTest : public ::testing::Test {
 protected:
  SupervisorTest() : supervisor_(Policy(), [this](const std::string& e) { events_.push_back(e); }) {}
  static RestartPolicy Policy() {
    RestartPolicy p;
    p.restarts = 2;
    p.delay = milliseconds(50);
    return p;
  }
  // Polls until `done` or 10 s.
  bool PollUntil(const std::function<bool()>& done, bool restart = true) {
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (Clock::now() < deadline) {
      supervisor_.Poll([restart](const Supervised&, const Result<ExitInfo>&) { return restart; });
      if (done()) return true;
      std::this_thread::sleep_for(milliseconds(5));
    }
    return false;
  }
  std::string Events() const {
    std::string all;
    for (const auto& e : events_) all += e + "\n";
    return all;
  }

  testing::TempDir dir_;
  std::vector<std::string> events_;
  Supervisor supervisor_;
};

TEST_F(SupervisorTest, AProcessThatDiesIsRestartedUnderItsNameAfterADelayThatDoubles) {
  ASSERT_TRUE(supervisor_.Launch(StandIn(dir_.path(), "worker-0"), ProcessRole::kWorker, 0).ok());
  Supervised& p = *supervisor_.Find("worker-0");
  std::set<int> pids = {p.pid()};
  std::vector<double> gaps;
  for (int i = 0; i < 2; ++i) {
    const int old = p.pid();
    ASSERT_TRUE(p.daemon.process->Signal(SIGKILL).ok());
    const auto t0 = Clock::now();
    ASSERT_TRUE(PollUntil([&] { return p.up() && p.pid() != old; })) << Events();
    gaps.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    pids.insert(p.pid());
  }
  EXPECT_EQ(pids.size(), 3u);
  EXPECT_EQ(p.restarts, 2);
  EXPECT_EQ(p.name(), "worker-0");
  EXPECT_GE(gaps[0], 0.05);
  EXPECT_GE(gaps[1], 0.1);  // doubled
  EXPECT_EQ(supervisor_.restarts().at("worker"), 2);
  EXPECT_NE(Events().find("worker-0 (pid"), std::string::npos);
  EXPECT_NE(Events().find("was killed by SIGKILL; restarting it in 0.1 s (restart 2 of 2)"), std::string::npos)
      << Events();
  EXPECT_NE(Events().find("worker-0 is up again"), std::string::npos) << Events();

  // The third death is one too many: it stays down.
  ASSERT_TRUE(p.daemon.process->Signal(SIGKILL).ok());
  ASSERT_TRUE(PollUntil([&] { return p.state == Supervised::State::kDown; })) << Events();
  EXPECT_NE(Events().find("it has no restarts left (2 used): it stays down"), std::string::npos) << Events();
  EXPECT_FALSE(supervisor_.AllUp());
}

TEST_F(SupervisorTest, AFencedProcessIsKilledAndRestartedSayingWhy) {
  ASSERT_TRUE(supervisor_.Launch(StandIn(dir_.path(), "server-1"), ProcessRole::kServer, 1).ok());
  Supervised& p = *supervisor_.Find("server-1");
  const int old = p.pid();
  supervisor_.Pause(p);  // a hung process
  EXPECT_TRUE(p.stopped);
  supervisor_.Fence(p, "was declared dead by the coordinator (member 4)");
  ASSERT_TRUE(PollUntil([&] { return p.up() && p.pid() != old; })) << Events();
  EXPECT_FALSE(p.stopped);
  EXPECT_NE(Events().find("server-1 (pid " + std::to_string(old) + ") was declared dead by the coordinator (member 4)"),
            std::string::npos)
      << Events();
  EXPECT_NE(Events().find("killed by the supervisor: the coordinator had declared it dead"), std::string::npos)
      << Events();
  EXPECT_EQ(supervisor_.restarts().at("server"), 1);
}

TEST_F(SupervisorTest, AProcessThatSaysTheJobCannotGoOnIsNotRestarted) {
  LaunchSpec spec = StandIn(dir_.path(), "worker-0");
  const auto serve = spec.command;
  spec.command = [serve](const std::vector<std::string>& flags) {
    auto argv = serve(flags);
    // Serve, then exit with kExitCannotGoOn instead of sleeping.
    argv[2].replace(argv[2].find("exec sleep 60"), 13, "sleep 0.2; exit 3");
    return argv;
  };
  ASSERT_TRUE(supervisor_.Launch(spec, ProcessRole::kWorker, 0).ok());
  Supervised& p = *supervisor_.Find("worker-0");
  ASSERT_TRUE(PollUntil([&] { return p.state == Supervised::State::kDown; })) << Events();
  EXPECT_TRUE(p.final);
  EXPECT_EQ(p.restarts, 0);
  EXPECT_NE(Events().find("exited with status 3: the job cannot go on, and a restart would not help"),
            std::string::npos)
      << Events();
}

TEST_F(SupervisorTest, ARetiredOrVetoedProcessIsNotRestarted) {
  ASSERT_TRUE(supervisor_.Launch(StandIn(dir_.path(), "worker-0"), ProcessRole::kWorker, 0).ok());
  ASSERT_TRUE(supervisor_.Launch(StandIn(dir_.path(), "worker-1"), ProcessRole::kWorker, 0).ok());
  Supervised& retired = *supervisor_.Find("worker-0");
  Supervised& done = *supervisor_.Find("worker-1");
  supervisor_.Retire(retired);
  ASSERT_TRUE(done.daemon.process->Signal(SIGTERM).ok());
  ASSERT_TRUE(PollUntil([&] { return done.state == Supervised::State::kRetired; }, /*restart=*/false));
  EXPECT_EQ(retired.state, Supervised::State::kRetired);
  EXPECT_EQ(supervisor_.restarts().at("worker"), 0);
  EXPECT_TRUE(supervisor_.AllUp());  // retired processes are not missing
}

TEST_F(SupervisorTest, TheCoordinatorComesBackOnItsPortAndStopAllStopsEvenAStoppedProcess) {
  ASSERT_TRUE(supervisor_.Launch(StandIn(dir_.path(), "coordinator"), ProcessRole::kCoordinator, -1).ok());
  ASSERT_TRUE(supervisor_.Launch(StandIn(dir_.path(), "worker-0"), ProcessRole::kWorker, 0).ok());
  EXPECT_EQ(supervisor_.Find("coordinator")->spec.grpc_port, 7);  // from its ready file
  supervisor_.Pause(*supervisor_.Find("worker-0"));
  const std::string unclean = supervisor_.StopAll([](const Supervised& p, const Result<ExitInfo>& exit) {
    return p.name() + (exit.ok() ? " " + DescribeExit(*exit) : " ended");
  });
  // sh ends of SIGTERM with a signal, which StopAll reports: both stopped.
  EXPECT_NE(unclean.find("worker-0 was killed by SIGTERM"), std::string::npos) << unclean;
  EXPECT_NE(unclean.find("coordinator was killed by SIGTERM"), std::string::npos) << unclean;
  EXPECT_EQ(unclean.find("did not stop"), std::string::npos) << unclean;
}

// --- fault plans ---------------------------------------------------------------

FaultSpace Cluster() {
  FaultSpace space;
  space.workers = {"worker-0", "worker-1", "worker-2", "worker-3"};
  space.servers = {"server-0", "server-1"};
  space.nodes = 2;
  space.namespaces = true;
  space.steps = 100;
  space.server_nodes = {0};  // node-1 has workers only
  return space;
}

TEST(FaultsTest, ParsesAndFormatsEveryKind) {
  auto faults = ParseFaults(
      "kill:worker-1@20,stop:server-0@30,partition:node-1@40/4s,slow:worker-0@50/1500ms,kill:coordinator@60");
  ASSERT_TRUE(faults.ok()) << faults.status().ToString();
  ASSERT_EQ(faults->size(), 5u);
  EXPECT_EQ((*faults)[2].kind, FaultKind::kPartition);
  EXPECT_EQ((*faults)[2].target, "node-1");
  EXPECT_EQ((*faults)[2].step, 40u);
  EXPECT_EQ((*faults)[2].duration, milliseconds(4000));
  EXPECT_EQ((*faults)[3].duration, milliseconds(1500));
  std::string again;
  for (const Fault& f : *faults) again += (again.empty() ? "" : ",") + FormatFault(f);
  auto reparsed = ParseFaults(again);
  ASSERT_TRUE(reparsed.ok()) << again;
  EXPECT_EQ(reparsed->size(), 5u);
  EXPECT_EQ((*reparsed)[3].duration, milliseconds(1500));
  EXPECT_TRUE(CheckFaults(*faults, Cluster()).ok()) << CheckFaults(*faults, Cluster()).ToString();
}

TEST(FaultsTest, BadFaultsAreRefusedNamingWhatIsWrong) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"explode:worker-1@2", "unknown kind 'explode'"},
      {"kill:worker-1", "expected KIND:TARGET@STEP"},
      {"kill:@3", "no target"},
      {"kill:worker-1@0", "at least 1"},
      {"kill:worker-1@x", "'x' is not a whole number"},
      {"kill:worker-1@3/2s", "a kill has no duration"},
      {"partition:node-1@3", "needs a duration"},
      {"slow:worker-0@3/0s", "above 0"},
      {"", "no fault given"},
  };
  for (const auto& [text, why] : bad) {
    auto f = ParseFaults(text);
    ASSERT_FALSE(f.ok()) << text;
    EXPECT_EQ(f.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(f.status().message().find(why), std::string::npos) << text << ": " << f.status().message();
  }
  const auto check = [](const std::string& text, const FaultSpace& space) {
    auto f = ParseFaults(text);
    EXPECT_TRUE(f.ok()) << text;
    return CheckFaults(*f, space).message();
  };
  EXPECT_NE(check("kill:worker-9@3", Cluster()).find("no process 'worker-9'"), std::string::npos);
  EXPECT_NE(check("stop:coordinator@3", Cluster()).find("can only be killed"), std::string::npos);
  EXPECT_NE(check("kill:worker-0@100", Cluster()).find("below --steps (100)"), std::string::npos);
  EXPECT_NE(check("partition:node-2@3/1s", Cluster()).find("node-0 .. node-1"), std::string::npos);
  EXPECT_NE(check("partition:worker-0@3/1s", Cluster()).find("a partition's target is a node"), std::string::npos);
  // A node with a server is only cut off for less than the heartbeat
  // deadline, unless the job can roll back to a checkpoint.
  EXPECT_NE(check("partition:node-0@3/2s", Cluster()).find("node-0 holds a server"), std::string::npos);
  EXPECT_EQ(check("partition:node-0@3/1500ms", Cluster()), "");
  FaultSpace rolls_back = Cluster();
  rolls_back.rollback = true;
  EXPECT_EQ(check("partition:node-0@3/5s", rolls_back), "");
  FaultSpace loopback = Cluster();
  loopback.namespaces = false;
  EXPECT_NE(check("partition:node-1@3/1s", loopback).find("network namespaces"), std::string::npos);
  FaultSpace one_server = Cluster();
  one_server.servers = {"server-0"};
  one_server.server_loss = false;
  EXPECT_NE(check("kill:server-0@3", one_server).find("at least two"), std::string::npos);
  EXPECT_EQ(check("slow:worker-0@3/1s", one_server), "");  // a slow process is lost to no one
  EXPECT_NE(check("kill:servers@3", Cluster()).find("only a synchronous server mode that writes checkpoints"),
            std::string::npos);
  EXPECT_NE(check("stop:servers@3", Cluster()).find("can only be killed"), std::string::npos);
  FaultSpace checkpointed = Cluster();
  checkpointed.rollback = true;
  EXPECT_EQ(check("kill:servers@3", checkpointed), "");
  FaultSpace one_replica = Cluster();
  one_replica.worker_loss = false;
  EXPECT_NE(check("stop:worker-0@3", one_replica).find("losing a worker"), std::string::npos);

  EXPECT_FALSE(ParseChaos("x").ok());
  EXPECT_FALSE(ParseChaos("7:0").ok());
  EXPECT_FALSE(ParseChaos("7:65").ok());
  EXPECT_EQ(ParseChaos("7")->count, 3);
  EXPECT_EQ(ParseChaos("7:5")->count, 5);
}

TEST(FaultsTest, AChaosDrillIsTheSeedsAloneAndOnlyWhatTheJobSurvives) {
  const FaultSpace space = Cluster();
  std::set<std::string> drills;
  std::set<FaultKind> kinds;
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    const auto drill = DrawChaos({seed, 4}, space);
    ASSERT_EQ(drill.size(), 4u);
    std::string text;
    uint64_t previous = 0;
    for (const Fault& f : drill) {
      text += FormatFault(f) + ",";
      kinds.insert(f.kind);
      if (f.kind == FaultKind::kPartition && f.target == "node-0") {
        EXPECT_LE(f.duration, kShortPartition);
      }
      EXPECT_GE(f.step, 10u);
      EXPECT_LE(f.step, 80u);
      EXPECT_GE(f.step, previous);
      previous = f.step;
    }
    EXPECT_TRUE(CheckFaults(drill, space).ok()) << text;
    EXPECT_EQ(text, [&] {
      std::string again;
      for (const Fault& f : DrawChaos({seed, 4}, space)) again += FormatFault(f) + ",";
      return again;
    }());
    drills.insert(text);
  }
  EXPECT_EQ(drills.size(), 40u);
  EXPECT_EQ(kinds.size(), 4u);  // every kind is drawn
  // With checkpoints, every server at once too (a rollback).
  FaultSpace checkpointed = space;
  checkpointed.rollback = true;
  // and a node holding a server cut off for longer than the heartbeat deadline.
  bool all_servers = false, long_server_partition = false;
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    const auto drill = DrawChaos({seed, 4}, checkpointed);
    EXPECT_TRUE(CheckFaults(drill, checkpointed).ok());
    for (const Fault& f : drill) {
      all_servers |= f.target == "servers";
      long_server_partition |= f.kind == FaultKind::kPartition && f.target == "node-0" && f.duration > kShortPartition;
    }
  }
  EXPECT_TRUE(all_servers);
  EXPECT_TRUE(long_server_partition);
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    for (const Fault& f : DrawChaos({seed, 4}, space)) EXPECT_NE(f.target, "servers");
  }

  // Without namespaces, a second server or a second replica, those faults are not drawn.
  FaultSpace narrow = space;
  narrow.namespaces = false;
  narrow.servers = {"server-0"};
  narrow.server_loss = false;
  narrow.workers = {"worker-0"};
  narrow.worker_loss = false;
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    for (const Fault& f : DrawChaos({seed, 3}, narrow)) {
      EXPECT_TRUE(f.target == "coordinator" || f.kind == FaultKind::kSlow) << FormatFault(f);
    }
    EXPECT_TRUE(CheckFaults(DrawChaos({seed, 3}, narrow), narrow).ok());
  }
}

}  // namespace
}  // namespace tandem::cli
