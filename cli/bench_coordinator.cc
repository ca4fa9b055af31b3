// tandem bench coordinator: N simulated members against a real coordinator
// process on loopback, over real gRPC.
//
// Phases: (1) rendezvous: every member registers, opens its membership stream
// and acknowledges epoch 1; the time is from the first registration until
// every member has seen epoch 1 become active. (2) heartbeats: every member
// heartbeats at --heartbeat-interval for --duration; the coordinator's CPU
// and memory are read from /proc meanwhile. (3) with --kill K: K members
// vanish at once (their streams are cancelled and their heartbeats stop, as
// with kill -9); detection is the time until the survivors receive the epoch
// without them, re-formation the time from there until that epoch is active
// at every survivor.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <deque>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <google/protobuf/util/time_util.h>

#include "cli/commands.h"
#include "cli/launcher.h"
#include "common/config.h"
#include "common/grpc_util.h"
#include "common/mutex.h"
#include "common/proc_stat.h"
#include "tandem/v1/coordinator.grpc.pb.h"

namespace tandem::cli {
namespace {

using Clock = std::chrono::steady_clock;
using google::protobuf::util::TimeUtil;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct Member {
  std::atomic<uint64_t> id{0};  // 0 until registered
  std::atomic<uint64_t> session{0};
  std::atomic<uint64_t> epoch{0};         // newest epoch received (it is part of)
  std::atomic<uint64_t> active_epoch{0};  // newest epoch seen active
  std::atomic<bool> killed{false};
};

class Sim;

// One member's membership stream, on gRPC's callback client API.
class Watch final : public grpc::ClientReadReactor<v1::WatchMembershipResponse> {
 public:
  Watch(Sim* sim, size_t index) : sim_(sim), index_(index) {}
  void Start(v1::Coordinator::Stub* stub, const v1::WatchMembershipRequest& request) {
    request_ = request;
    stub->async()->WatchMembership(&context_, &request_, this);
    StartRead(&response_);
    StartCall();
  }
  void Cancel() { context_.TryCancel(); }
  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

 private:
  Sim* const sim_;  // outlives the stream (Sim waits for every OnDone)
  const size_t index_;
  grpc::ClientContext context_;
  v1::WatchMembershipRequest request_;
  v1::WatchMembershipResponse response_;
};

class Sim {
 public:
  Sim(const std::string& address, size_t n, int channels) : members_(n), watches_(n) {
    for (int i = 0; i < channels; ++i) {
      grpc::ChannelArguments args;
      args.SetInt("tandem.bench.channel", i);  // distinct channels, distinct connections
      stubs_.push_back(
          v1::Coordinator::NewStub(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args)));
    }
  }
  ~Sim() { Shutdown(); }

  v1::Coordinator::Stub* stub(size_t i) { return stubs_[i % stubs_.size()].get(); }
  Member& member(size_t i) { return members_[i]; }
  size_t size() const { return members_.size(); }

  Status RegisterAll(int threads) {
    std::atomic<size_t> next{0};
    Mutex mu;
    Status failure;
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&] {
        for (size_t i = next++; i < size(); i = next++) {
          v1::RegisterRequest r;
          r.set_job_id("default");
          r.set_role(v1::ROLE_WORKER);
          r.mutable_node()->set_hostname("sim");
          r.mutable_node()->set_node_id("sim-" + std::to_string(i / 8));  // 8 workers a node
          grpc::ClientContext ctx;
          ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
          v1::RegisterResponse response;
          const grpc::Status s = stub(i)->Register(&ctx, r, &response);
          if (!s.ok()) {
            MutexLock lock(&mu);
            failure = Status::FromGrpc(s).WithContext("register");
            return;
          }
          members_[i].session = response.session_id();
          members_[i].id = response.member_id();  // last: a non-zero id means registered
          StartWatch(i);
        }
      });
    }
    for (auto& t : pool) t.join();
    return failure;
  }

  void StartWatch(size_t i) {
    auto* w = new Watch(this, i);  // owned by watches_, destroyed after its OnDone
    {
      MutexLock lock(&mu_);
      watches_[i].reset(w);
      ++open_;
    }
    v1::WatchMembershipRequest r;
    r.set_job_id("default");
    r.set_member_id(members_[i].id);
    r.set_session_id(members_[i].session);
    r.set_peer_view(v1::PEER_VIEW_SELF);
    w->Start(stub(i), r);
  }

  void OnUpdate(size_t i, const v1::WatchMembershipResponse& u) {
    Member& m = members_[i];
    if (u.has_epoch()) {
      bool mine = false;
      for (const auto& p : u.epoch().peers()) mine |= p.member_id() == m.id;
      if (!mine) return;
      m.epoch = u.epoch().epoch();
      if (u.epoch().state() == v1::EPOCH_STATE_ACTIVE) m.active_epoch = u.epoch().epoch();
      MutexLock lock(&mu_);
      acks_.emplace_back(i, u.epoch().epoch());
      first_seen_.try_emplace(u.epoch().epoch(), Clock::now());
      cv_.NotifyAll();
    } else if (u.has_state_change() && u.state_change().state() == v1::EPOCH_STATE_ACTIVE) {
      m.active_epoch = u.state_change().epoch();
      MutexLock lock(&mu_);
      cv_.NotifyAll();
    }
  }

  void OnStreamDone() {
    MutexLock lock(&mu_);
    --open_;
    cv_.NotifyAll();
  }

  // Threads that acknowledge epochs as members receive them.
  void StartAckers(int threads) {
    for (int t = 0; t < threads; ++t) {
      ackers_.emplace_back([this] {
        MutexLock lock(&mu_);
        while (true) {
          cv_.Wait(lock, [this]() TANDEM_REQUIRES(mu_) { return stop_ || !acks_.empty(); });
          if (stop_) return;
          auto [i, epoch] = acks_.front();
          acks_.pop_front();
          lock.Unlock();
          if (!members_[i].killed) {
            v1::AckEpochRequest r;
            r.set_job_id("default");
            r.set_member_id(members_[i].id);
            r.set_session_id(members_[i].session);
            r.set_epoch(epoch);
            grpc::ClientContext ctx;
            ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
            v1::AckEpochResponse response;
            (void)stub(i)->AckEpoch(&ctx, r, &response);
          }
          lock.Lock();
        }
      });
    }
  }

  // Waits until every live member has seen epoch `epoch` active; false on timeout.
  bool WaitAllActive(uint64_t epoch, std::chrono::milliseconds timeout) {
    MutexLock lock(&mu_);
    return cv_.WaitFor(lock, timeout, [&]() TANDEM_REQUIRES(mu_) {
      for (const auto& m : members_) {
        if (!m.killed && m.active_epoch < epoch) return false;
      }
      return true;
    });
  }

  // Waits until the first live member receives an epoch newer than `epoch`.
  std::optional<Clock::time_point> WaitNewEpoch(uint64_t epoch, std::chrono::milliseconds timeout) {
    MutexLock lock(&mu_);
    std::optional<Clock::time_point> when;
    cv_.WaitFor(lock, timeout, [&]() TANDEM_REQUIRES(mu_) {
      for (const auto& [e, t] : first_seen_) {
        if (e > epoch) {
          when = t;
          return true;
        }
      }
      return false;
    });
    return when;
  }

  uint64_t NewestEpoch() {
    uint64_t e = 0;
    for (const auto& m : members_) {
      if (!m.killed) e = std::max<uint64_t>(e, m.epoch);
    }
    return e;
  }

  // Heartbeats every live member at `interval` for `duration`; returns the
  // heartbeats answered per second within that window.
  double Heartbeats(std::chrono::milliseconds interval, std::chrono::milliseconds duration, int threads) {
    std::atomic<uint64_t> sent{0};
    std::vector<std::thread> pool;
    const auto t0 = Clock::now();
    const auto end = t0 + duration;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        auto next = Clock::now();
        while (Clock::now() < end && !background_stop_) {
          for (size_t i = static_cast<size_t>(t); i < size() && Clock::now() < end; i += static_cast<size_t>(threads)) {
            if (members_[i].killed || members_[i].id == 0) continue;
            v1::HeartbeatRequest r;
            r.set_job_id("default");
            r.set_member_id(members_[i].id);
            r.set_session_id(members_[i].session);
            r.set_epoch(members_[i].epoch);
            grpc::ClientContext ctx;
            ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
            v1::HeartbeatResponse response;
            if (stub(i)->Heartbeat(&ctx, r, &response).ok()) ++sent;
          }
          next += interval;
          std::this_thread::sleep_until(std::min(next, end));
        }
      });
    }
    for (auto& t : pool) t.join();
    return static_cast<double>(sent) / std::chrono::duration<double>(duration).count();
  }

  // Starts background heartbeats (for the kill phase); stopped by StopBackground.
  void StartBackgroundHeartbeats(std::chrono::milliseconds interval, int threads) {
    background_ = std::thread([this, interval, threads] {
      while (!background_stop_) Heartbeats(interval, interval * 4, threads);
    });
  }
  void StopBackground() {
    background_stop_ = true;
    if (background_.joinable()) background_.join();
    background_stop_ = false;
  }

  void Kill(size_t i) {
    members_[i].killed = true;
    MutexLock lock(&mu_);
    if (watches_[i]) watches_[i]->Cancel();
  }

  void Shutdown() {
    StopBackground();
    {
      MutexLock lock(&mu_);
      if (shut_) return;
      shut_ = true;
      for (auto& w : watches_) {
        if (w) w->Cancel();
      }
    }
    MutexLock lock(&mu_);
    cv_.WaitFor(lock, std::chrono::seconds(30), [this]() TANDEM_REQUIRES(mu_) { return open_ == 0; });
    stop_ = true;
    cv_.NotifyAll();
    lock.Unlock();
    for (auto& t : ackers_) t.join();
  }

 private:
  std::vector<std::unique_ptr<v1::Coordinator::Stub>> stubs_;
  std::vector<Member> members_;
  Mutex mu_;
  CondVar cv_;
  std::vector<std::unique_ptr<Watch>> watches_ TANDEM_GUARDED_BY(mu_);  // by member index
  std::deque<std::pair<size_t, uint64_t>> acks_ TANDEM_GUARDED_BY(mu_);
  std::map<uint64_t, Clock::time_point> first_seen_ TANDEM_GUARDED_BY(mu_);
  size_t open_ TANDEM_GUARDED_BY(mu_) = 0;
  bool stop_ TANDEM_GUARDED_BY(mu_) = false;
  bool shut_ TANDEM_GUARDED_BY(mu_) = false;
  std::vector<std::thread> ackers_;
  std::thread background_;
  std::atomic<bool> background_stop_{false};
};

void Watch::OnReadDone(bool ok) {
  if (!ok) return;
  sim_->OnUpdate(index_, response_);
  StartRead(&response_);
}

void Watch::OnDone(const grpc::Status& /*status*/) {
  sim_->OnStreamDone();
}

}  // namespace

int BenchCoordinatorCommand(int argc, char** argv) {
  int64_t workers = 1024;
  int64_t kill = 0;
  bool json = false;
  std::chrono::milliseconds interval{1000};
  std::chrono::milliseconds duration{5000};
  std::string bin_dir = ExecutableDir();
  OptionSet options("tandem bench coordinator",
                    "simulate members registering and heartbeating against a real coordinator on loopback");
  options.Int("workers", &workers, "simulated members", 1, 65536);
  options.Int("kill", &kill, "members to kill at once after the heartbeat phase (0: none)", 0, 65535);
  options.Duration("heartbeat_interval", &interval, "how often each member heartbeats", std::chrono::milliseconds(10),
                   std::chrono::milliseconds(60000));
  options.Duration("duration", &duration, "length of the heartbeat phase", std::chrono::milliseconds(500),
                   std::chrono::milliseconds(600000));
  options.Bool("json", &json, "print one JSON object instead of a table");
  options.String("bin_dir", &bin_dir, "where tandem-coordinator is");
  if (int rc = ParseOrExit(options, argc, argv); rc >= 0) return rc;
  if (kill >= workers) {
    fmt::print(stderr, "tandem bench coordinator: --kill must be below --workers\n");
    return 2;
  }
  std::string tmpl = "/tmp/tandem-bench-XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) {
    fmt::print(stderr, "tandem bench coordinator: cannot create a work directory\n");
    return 1;
  }
  const auto say = [&](const std::string& line) {
    if (!json) fmt::print("{}\n", line);
  };
  LaunchSpec spec;
  spec.binary = bin_dir + "/tandem-coordinator";
  spec.name = "coordinator";
  spec.work_dir = tmpl;
  spec.args = {"--data-dir",
               tmpl + "/state",
               "--job-min-workers",
               std::to_string(workers),
               "--job-max-workers",
               std::to_string(workers),
               "--job-last-call-window",
               "0s",
               "--job-heartbeat-interval",
               FormatDuration(interval),
               "--job-heartbeat-deadline",
               FormatDuration(interval * 3),
               "--max-members",
               std::to_string(workers + 16),
               "--log-level",
               "warn",
               "--max-message-bytes",
               "256MiB"};
  auto coordinator = Launch(spec);
  if (!coordinator.ok()) {
    fmt::print(stderr, "tandem bench coordinator: {}\n", coordinator.status().message());
    return 1;
  }
  const pid_t pid = coordinator->process->pid();
  say(fmt::format("coordinator pid {} on {}; {} simulated members", pid, coordinator->ready.grpc_address, workers));

  Sim sim(coordinator->ready.grpc_address, static_cast<size_t>(workers), 8);
  sim.StartAckers(16);
  // (1) rendezvous; members heartbeat from the moment they are registered, as real ones do.
  sim.StartBackgroundHeartbeats(interval, 8);
  const auto t0 = Clock::now();
  if (Status s = sim.RegisterAll(32); !s.ok()) {
    fmt::print(stderr, "tandem bench coordinator: {}\n", s.ToString());
    return 1;
  }
  const bool formed = sim.WaitAllActive(1, std::chrono::seconds(120));
  const double rendezvous = Since(t0);
  if (!formed) {
    fmt::print(stderr, "tandem bench coordinator: epoch 1 did not become active within 120 s\n{}",
               TailOfFile(coordinator->log_file, 10));
    return 1;
  }
  say(fmt::format("rendezvous: {} members registered and saw epoch 1 active in {:.3f} s", workers, rendezvous));
  // (2) heartbeats
  sim.StopBackground();
  const auto usage0 = ReadProcStat(pid).value_or(ProcStat{});
  const auto h0 = Clock::now();
  const double rate = sim.Heartbeats(interval, duration, 8);
  const auto usage1 = ReadProcStat(pid).value_or(ProcStat{});
  const double cores = (usage1.cpu_seconds - usage0.cpu_seconds) / Since(h0);
  const double rss1 = usage1.resident_bytes;
  say(fmt::format("heartbeats: {:.0f}/s for {:.1f} s; coordinator CPU {:.3f} cores, RSS {:.1f} MiB", rate,
                  duration.count() / 1000.0, cores, rss1 / 1048576.0));
  // (3) failures
  std::optional<double> detect;
  std::optional<double> reform;
  if (kill > 0) {
    sim.StartBackgroundHeartbeats(interval, 8);
    std::this_thread::sleep_for(interval);
    const uint64_t before = sim.NewestEpoch();
    const auto tk = Clock::now();
    for (size_t i = static_cast<size_t>(workers - kill); i < static_cast<size_t>(workers); ++i) sim.Kill(i);
    // Wait for the epoch without all of them: epochs may come one per victim.
    uint64_t target = before;
    std::optional<Clock::time_point> seen;
    while (true) {
      auto next = sim.WaitNewEpoch(target, std::chrono::seconds(30));
      if (!next) break;
      seen = next;
      target = sim.NewestEpoch();
      // Stop once the newest epoch has workers - kill members (checked by its size below).
      if (sim.WaitAllActive(target, std::chrono::seconds(30))) {
        // Are all victims out? Survivors received `target`; killed ones never ack.
        break;
      }
    }
    if (seen) {
      detect = std::chrono::duration<double>(*seen - tk).count();
      reform = Since(*seen);
      // WaitAllActive returned once every survivor saw `target` active; measure to that moment.
    }
    sim.StopBackground();
    if (detect) {
      say(
          fmt::format("failure: {} member(s) killed; detected after {:.3f} s, epoch {} active at every survivor "
                      "{:.3f} s later",
                      kill, *detect, target, *reform));
    } else {
      say("failure: no new epoch within 30 s");
    }
  }
  sim.Shutdown();
  const ExitInfo exit = coordinator->process->Stop(std::chrono::milliseconds(5000));
  std::error_code ec;
  std::filesystem::remove_all(tmpl, ec);
  if (json) {
    fmt::print(
        "{{\"workers\": {}, \"rendezvous_seconds\": {:.4f}, \"heartbeats_per_second\": {:.1f}, "
        "\"coordinator_cpu_cores\": {:.4f}, \"coordinator_rss_bytes\": {:.0f}, \"detect_seconds\": {}, "
        "\"reform_seconds\": {}}}\n",
        workers, rendezvous, rate, cores, rss1, detect ? fmt::format("{:.4f}", *detect) : "null",
        reform ? fmt::format("{:.4f}", *reform) : "null");
  }
  if (!exit.success()) {
    fmt::print(stderr, "tandem bench coordinator: the coordinator ended with {}\n", exit.ToString());
    return 1;
  }
  return 0;
}

}  // namespace tandem::cli
