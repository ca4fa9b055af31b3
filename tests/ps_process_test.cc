// Parameter servers as processes: a coordinator and three tandem-server
// daemons on loopback, and two workers (member sessions with a PsClient each,
// in this process) training a synthetic job in synchronous mode. One server
// is killed with SIGKILL in the middle of a step: the coordinator publishes a
// new epoch, the dead server's backups are promoted, new backups get the
// state, the workers push the interrupted step again, and training goes on.
// The final parameters must equal, bit for bit, those of a run without the
// failure (a single in-process parameter store fed the same gradients), and
// every backup must hold the same version as its primary. The pushes carry a
// learning rate per step (a PyTorch LR scheduler's, over the wire in
// ps::Frame::value; every fourth step leaves it to the servers' schedule),
// the step pushed again after the kill too. Then a checkpoint is saved
// through the gRPC control service and restored.
#include <signal.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <functional>
#include <latch>
#include <optional>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "launch_util.h"
#include "ps_test_util.h"
#include "server/ps_core.h"
#include "worker/ps/ps_client.h"

namespace tandem {
namespace {

using std::chrono::milliseconds;

constexpr uint64_t kPartitionElements = 4096;  // 16 KiB partitions
constexpr uint64_t kParams = 13 * kPartitionElements - 100;
constexpr uint32_t kWorkers = 2;
constexpr uint64_t kSteps = 12;
constexpr uint64_t kKillStep = 6;
constexpr uint64_t kSaveStep = 9;

v1::OptimizerConfig Optimizer() {
  v1::OptimizerConfig o;
  auto* adam = o.mutable_adam();
  adam->set_lr(1e-2);
  adam->set_weight_decay(0.01);
  adam->set_decoupled_weight_decay(true);
  return o;
}

std::vector<float> Initial() {
  std::vector<float> v(kParams);
  std::mt19937 rng(11);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (auto& x : v) x = dist(rng);
  return v;
}

// The learning rate the pushes of a step carry in the kill test (0: the
// servers' schedule).
double KillTestLr(uint64_t step) {
  return step % 4 == 0 ? 0 : 2e-2 / static_cast<double>(step);
}

// The parameters after `steps` steps without any failure: one in-process
// store holding every partition, the pushes of step s carrying lr(s) (null:
// 0, the schedule's).
std::vector<float> Reference(uint64_t steps, const std::function<double(uint64_t)>& lr = nullptr) {
  class NoLinks : public server::ServerLinks {
    void SendShare(uint64_t, uint64_t, const std::vector<ps::ShareEntry>&) override {}
    void SendToBackup(uint64_t, const ps::Frame&, std::shared_ptr<const std::vector<float>>,
                      std::function<void(const Status&)> done) override {
      done(Status::Ok());
    }
    void SendJob(uint64_t, std::shared_ptr<const std::string>) override {}
  } links;
  server::ParameterStore store(server::StoreOptions{1}, &links);
  v1::ShardMap map;
  map.set_partition_size(kPartitionElements);
  map.set_parameter_count(kParams);
  map.set_version(1);
  const uint32_t parts = static_cast<uint32_t>((kParams + kPartitionElements - 1) / kPartitionElements);
  for (uint32_t p = 0; p < parts; ++p) {
    auto* e = map.add_partitions();
    e->set_id(p);
    e->mutable_range()->set_begin(p * kPartitionElements);
    e->mutable_range()->set_end(std::min(kParams, (p + 1) * kPartitionElements));
    e->set_primary_member_id(1);
  }
  store.SetEpoch(1, 1, map, kWorkers, 0);
  v1::InitializeParametersRequest init;
  init.set_job_id("ps-test");
  init.set_epoch(1);
  *init.mutable_tensors() = testing::FlatTensors(kParams);
  *init.mutable_optimizer() = Optimizer();
  const auto initial = Initial();
  auto* chunk = init.mutable_values()->add_chunks();
  chunk->mutable_range()->set_end(kParams);
  chunk->set_dtype(v1::DTYPE_FLOAT32);
  chunk->set_data(reinterpret_cast<const char*>(initial.data()), kParams * sizeof(float));
  EXPECT_TRUE(store.Initialize(init).ok());
  std::vector<float> params(kParams);
  for (uint64_t s = 1; s <= steps; ++s) {
    for (uint32_t p = 0; p < parts; ++p) {
      const auto& r = map.partitions(static_cast<int>(p)).range();
      for (uint32_t c = 0; c < kWorkers; ++c) {
        auto g = testing::Gradient(s, c, r.begin(), r.end());
        ps::Frame h;
        h.type = ps::FrameType::kPush;
        h.epoch = 1;
        h.step = s;
        h.partition = p;
        h.contributor = c;
        h.contributors = kWorkers;
        h.dtype = v1::WIRE_DTYPE_FP32;
        h.payload_bytes = g.size() * sizeof(float);
        h.value = lr ? lr(s) : 0;
        store.Push(0, h, g.data(), [](ps::Frame reply, server::ReplyBody) { EXPECT_EQ(reply.status, 0); });
      }
    }
    for (uint32_t p = 0; p < parts; ++p) {
      const auto& r = map.partitions(static_cast<int>(p)).range();
      ps::Frame h;
      h.type = ps::FrameType::kPull;
      h.epoch = 1;
      h.step = s;
      h.partition = p;
      h.dtype = v1::WIRE_DTYPE_FP32;
      store.Pull(0, h, [&](ps::Frame reply, server::ReplyBody body) {
        EXPECT_EQ(reply.status, 0);
        std::memcpy(params.data() + r.begin(), body.data(), body.size());
      });
    }
  }
  return params;
}

// A coordinator of `job` (kWorkers workers, at least min(n, 2) servers,
// kParams elements in 16 KiB partitions, `extra` flags on top) and `n`
// tandem-server daemons registered with it; log names start with `prefix`.
struct PsCluster {
  std::optional<cli::LaunchedDaemon> coordinator;
  std::vector<cli::LaunchedDaemon> servers;
  std::string address;
};
void StartCluster(const testing::TempDir& dir, const std::string& job, int n, const std::vector<std::string>& extra,
                  PsCluster* out, const std::string& prefix = "") {
  std::vector<std::string> args = {"--job-id",
                                   job,
                                   "--job-min-workers",
                                   std::to_string(kWorkers),
                                   "--job-max-workers",
                                   std::to_string(kWorkers),
                                   "--job-min-servers",
                                   std::to_string(std::min(n, 2)),
                                   "--job-parameter-count",
                                   std::to_string(kParams),
                                   "--job-partition-size",
                                   "16KiB"};
  args.insert(args.end(), extra.begin(), extra.end());
  auto coordinator = testing::StartDaemon("tandem-coordinator", prefix + "coordinator", dir.path(), args);
  ASSERT_TRUE(coordinator.ok()) << coordinator.status().ToString();
  out->coordinator = std::move(*coordinator);
  out->address = out->coordinator->ready.grpc_address;
  for (int i = 0; i < n; ++i) {
    auto s = testing::StartDaemon("tandem-server", prefix + "server-" + std::to_string(i), dir.path(),
                                  {"--coordinator-address", out->address, "--job-id", job, "--node-id",
                                   "node-s" + std::to_string(i), "--server-threads", "1", "--server-timeout", "20s"});
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    out->servers.push_back(std::move(*s));
  }
  for (auto& s : out->servers) {
    ASSERT_TRUE(testing::WaitRegistered(s, milliseconds(20000))) << testing::ReadFile(s.log_file);
  }
}

// One story told in order (about 250 lines, on purpose): three servers and
// two workers train, a primary is killed mid-step while a checkpoint is
// being saved, and the survivors are checked in turn (parameters equal to
// a failure-free run, replicas bit-identical, the checkpoint restorable,
// the metrics, a pull after a restore). Each check depends on the state the
// ones before it left; split into helpers, it would be harder to follow
// which phase a failure belongs to.
TEST(PsProcessTest, KillPrimaryMidStepTrainingGoesOnAndMatchesAFailureFreeRun) {
  testing::TempDir dir;
  PsCluster cluster;
  StartCluster(dir, "ps-test", 3,
               {"--job-last-call-window", "500ms", "--job-heartbeat-interval", "200ms", "--job-heartbeat-deadline",
                "3s", "--job-stream-grace", "300ms"},
               &cluster);
  if (::testing::Test::HasFatalFailure()) return;
  auto& coordinator = cluster.coordinator;
  auto& servers = cluster.servers;
  const std::string address = cluster.address;
  std::vector<std::unique_ptr<testing::PsWorker>> workers;
  for (uint32_t w = 0; w < kWorkers; ++w)
    workers.push_back(std::make_unique<testing::PsWorker>(address, "ps-test", w, kWorkers));
  for (auto& w : workers) {
    ASSERT_TRUE(w->WaitEpochAfter(0, milliseconds(30000))) << testing::ReadFile(servers[0].log_file);
  }
  ASSERT_EQ(workers[0]->client().shard_map().partitions_size(), 13);
  // Every worker initialises; each partition is initialised once.
  const auto initial = Initial();
  int initialized = 0;
  for (auto& w : workers) {
    auto n =
        w->client().Initialize(testing::FlatTensors(kParams), Optimizer(), v1::ConsistencyConfig(), initial.data());
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    initialized += *n;
  }
  EXPECT_EQ(initialized, 26);  // 13 primaries and 13 backups, each once

  // Which server to kill: the primary of partition 0.
  const uint64_t victim_member = workers[0]->client().shard_map().partitions(0).primary_member_id();
  std::map<uint64_t, v1::GetStatsResponse> stats0;
  {
    auto stats = workers[0]->client().Stats();
    ASSERT_TRUE(stats.ok()) << stats.status().ToString();
    stats0 = *stats;
  }
  ASSERT_EQ(stats0.size(), 3u);
  size_t victim = 3;
  for (size_t i = 0; i < servers.size(); ++i) {
    const std::string log = testing::ReadFile(servers[i].log_file);
    if (log.find("(member " + std::to_string(victim_member) + ")") != std::string::npos) victim = i;
  }
  ASSERT_LT(victim, servers.size());

  std::vector<std::vector<float>> params(kWorkers, std::vector<float>(kParams));
  const std::string ckpt = dir.path() + "/checkpoints";
  std::thread saver;
  Result<std::vector<v1::CheckpointInfo>> mid_save = Unavailable("not run");
  std::latch pushed(1);
  std::vector<Status> results(kWorkers);
  std::vector<std::thread> threads;
  for (uint32_t w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      for (uint64_t s = 1; s <= kSteps; ++s) {
        std::function<void()> after;
        if (s == kKillStep && w == 0) {
          // Worker 0 has pushed step 6 everywhere; kill the victim before
          // worker 1 pushes (the step cannot complete in this epoch).
          after = [&] {
            EXPECT_TRUE(servers[victim].process->Signal(SIGKILL).ok());
            pushed.count_down();
          };
        }
        if (s == kKillStep && w == 1) pushed.wait();
        if (s == kSaveStep - 1 && w == 0) {
          // An asynchronous save of a later step while training runs.
          saver = std::thread([&] { mid_save = workers[0]->client().SaveCheckpoint(ckpt, kSaveStep, "mid", true); });
        }
        Status st = workers[w]->Step(s, params[w], after, KillTestLr(s));
        if (!st.ok()) {
          results[w] = st;
          if (s == kKillStep && w == 0) pushed.count_down();
          return;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  if (saver.joinable()) saver.join();
  for (uint32_t w = 0; w < kWorkers; ++w) {
    if (results[w].ok()) continue;
    std::string logs;
    for (size_t i = 0; i < servers.size(); ++i) {
      if (i != victim) logs += "\nserver " + std::to_string(i) + ":\n" + testing::ReadFile(servers[i].log_file);
    }
    FAIL() << "worker " << w << ": " << results[w].ToString() << "\nthe surviving servers' logs:" << logs
           << "\nthe coordinator's log:\n"
           << testing::ReadFile(coordinator->log_file);
  }
  EXPECT_GE(workers[0]->retries() + workers[1]->retries(), 1);
  EXPECT_GE(workers[0]->client().epoch(), 2u);
  // The kill leaves one survivor primary of 9 partitions and the other of 4:
  // once the new backups hold their state, a rebalance epoch swaps two of
  // them (7 and 6). What follows runs in that epoch, with this worker's group
  // for it ready.
  std::vector<int> primaries;
  EXPECT_TRUE(testing::WaitUntil(
      [&] {
        auto st = workers[0]->client().Stats();
        if (!st.ok()) return false;
        primaries.clear();
        for (auto& [member, s] : *st) {
          if (s.epoch() != workers[0]->client().epoch()) return false;
          int n = 0;
          for (const auto& p : s.partitions()) n += p.role() == v1::REPLICA_ROLE_PRIMARY ? 1 : 0;
          primaries.push_back(n);
        }
        std::sort(primaries.begin(), primaries.end());
        return primaries == std::vector<int>{6, 7};
      },
      milliseconds(20000)))
      << "primaries per server: " << ::testing::PrintToString(primaries);
  // What the workers' push and pull metrics count: every answered push and
  // pull (retries included), with its bytes, by server (ranks among 3, then 2).
  for (const auto& w : workers) {
    const auto pushes = w->pushes();
    const auto pulls = w->pulls();
    EXPECT_GE(pushes.count, kSteps * 13);
    EXPECT_GE(pushes.bytes, kSteps * kParams * sizeof(float));
    EXPECT_GE(pulls.count, kSteps * 13);
    EXPECT_GE(pulls.bytes, kSteps * kParams * sizeof(float));
    EXPECT_EQ(pushes.servers, (std::set<uint32_t>{0, 1, 2}));
    EXPECT_EQ(pulls.servers, (std::set<uint32_t>{0, 1, 2}));
    EXPECT_EQ(pushes.negative_seconds + pulls.negative_seconds, 0u);
  }

  // Both workers hold the same parameters, equal to a run without failure.
  const auto reference = Reference(kSteps, KillTestLr);
  EXPECT_EQ(std::memcmp(params[0].data(), params[1].data(), kParams * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(params[0].data(), reference.data(), kParams * sizeof(float)), 0);
  EXPECT_NE(params[0][0], initial[0]);

  // Every partition: primary and backup on the two survivors, same version
  // (kSteps updates) and bit-identical state (weights and moments, by
  // checksum: the promoted backups and the ones built by transfer alike),
  // and the promotion and the transfer are in the logs.
  auto stats = workers[0]->client().Stats(/*checksums=*/true);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  ASSERT_EQ(stats->size(), 2u);
  std::map<uint32_t, std::vector<uint64_t>> versions;
  std::map<uint32_t, std::set<uint32_t>> checksums;
  for (auto& [member, s] : *stats) {
    for (const auto& p : s.partitions()) {
      versions[p.partition_id()].push_back(p.version());
      EXPECT_EQ(p.step(), kSteps);
      ASSERT_TRUE(p.has_state_crc32c());
      checksums[p.partition_id()].insert(p.state_crc32c());
    }
  }
  ASSERT_EQ(versions.size(), 13u);
  for (auto& [id, v] : versions) {
    EXPECT_EQ(v.size(), 2u) << "partition " << id << " has no backup";
    for (uint64_t x : v) EXPECT_EQ(x, kSteps + 1) << "partition " << id;
    EXPECT_EQ(checksums[id].size(), 1u) << "partition " << id << ": primary and backup hold different state";
  }
  std::string survivors_log;
  for (size_t i = 0; i < servers.size(); ++i) {
    if (i != victim) survivors_log += testing::ReadFile(servers[i].log_file);
  }
  EXPECT_NE(survivors_log.find("promoted to primary"), std::string::npos) << survivors_log;
  EXPECT_NE(survivors_log.find("received its state from member"), std::string::npos) << survivors_log;

  auto pull_all = [&] {
    std::vector<float> out(kParams);
    const Status pulled = workers[0]->Pull(0, out, milliseconds(20000));
    if (!pulled.ok()) {
      std::string logs;
      for (size_t i = 0; i < servers.size(); ++i) {
        if (i != victim) logs += "\nserver " + std::to_string(i) + ":\n" + testing::ReadFile(servers[i].log_file);
      }
      ADD_FAILURE() << pulled.ToString() << logs;
    }
    return out;
  };
  // The asynchronous save of step 9 taken while training ran: complete on
  // every server, and restoring it gives the parameters of step 9.
  ASSERT_TRUE(mid_save.ok()) << mid_save.status().ToString();
  for (const auto& info : *mid_save) {
    EXPECT_EQ(info.step(), kSaveStep);
    EXPECT_NE(info.state(), v1::CHECKPOINT_STATE_FAILED) << info.error();
  }
  EXPECT_TRUE(testing::WaitUntil(
      [&] {
        auto st = workers[0]->client().Stats();
        if (!st.ok()) return false;
        for (auto& [member, s] : *st) {
          if (s.last_checkpoint().checkpoint_id() != "mid" ||
              s.last_checkpoint().state() != v1::CHECKPOINT_STATE_COMPLETE) {
            return false;
          }
        }
        return true;
      },
      milliseconds(20000)))
      << [&] {
           auto st = workers[0]->client().Stats();
           std::string out = st.status().ToString();
           if (st.ok()) {
             for (auto& [member, s] : *st) out += "\n" + s.last_checkpoint().ShortDebugString();
           }
           return out;
         }();
  // A synchronous checkpoint of the end state, then a restore.
  auto saved = workers[0]->client().SaveCheckpoint(ckpt, kSteps, "", false);
  ASSERT_TRUE(saved.ok()) << saved.status().ToString();
  for (const auto& info : *saved) {
    EXPECT_EQ(info.state(), v1::CHECKPOINT_STATE_COMPLETE);
    EXPECT_EQ(info.step(), kSteps);
  }
  const std::string path =
      ckpt + "/step-" + std::string(10 - std::to_string(kSteps).size(), '0') + std::to_string(kSteps);
  EXPECT_TRUE(std::filesystem::exists(path)) << path;
  auto again = workers[0]->client().SaveCheckpoint(ckpt, kSteps, "", false);
  EXPECT_EQ(again.status().code(), StatusCode::kAlreadyExists) << again.status().ToString();

  // The survivors' metrics (refreshed every second): what they served after
  // the kill at least, the updates and their time, the transfers to new
  // backups, no replication lag left, the last checkpoint.
  std::vector<const cli::LaunchedDaemon*> survivors;
  for (size_t i = 0; i < servers.size(); ++i) {
    if (i != victim) survivors.push_back(&servers[i]);
  }
  auto sum = [&](const std::string& name) {
    double total = 0;
    for (const auto* s : survivors) total += std::max(0.0, testing::Metric(*s, name));
    return total;
  };
  EXPECT_TRUE(testing::WaitUntil(
      [&] {
        for (const auto* s : survivors) {
          if (testing::Metric(*s, "tandem_server_checkpoint_duration_seconds") <= 0) return false;
          if (testing::Metric(*s, "tandem_server_step") != static_cast<double>(kSteps)) return false;
          if (testing::Metric(*s, "tandem_server_replication_lag_steps") != 0) return false;
        }
        return true;
      },
      milliseconds(10000)));
  const double after_kill = static_cast<double>(kSteps - kKillStep);
  EXPECT_GE(sum("tandem_server_pushes_total"), after_kill * kWorkers * 13);
  EXPECT_GE(sum("tandem_server_push_bytes_total"), after_kill * kWorkers * kParams * sizeof(float));
  EXPECT_GE(sum("tandem_server_pulls_total"), after_kill * kWorkers * 13);
  EXPECT_GE(sum("tandem_server_pull_bytes_total"), after_kill * kWorkers * kParams * sizeof(float));
  EXPECT_GE(sum("tandem_server_updates_total"), after_kill * 13);
  EXPECT_GT(sum("tandem_server_update_seconds_total"), 0);
  EXPECT_GT(sum("tandem_server_aggregation_wait_seconds_total"), 0);
  EXPECT_GE(sum("tandem_server_state_transfers_total"), 1);
  EXPECT_EQ(sum("tandem_server_replication_lag_steps"), 0);
  EXPECT_GT(sum("tandem_server_checkpoint_bytes"), kParams * sizeof(float));
  EXPECT_EQ(sum("tandem_server_state_bytes"), 2 * 3 * kParams * sizeof(float));  // two copies of weights and moments
  EXPECT_TRUE(workers[0]->client().RestoreCheckpoint(path, false).ok());
  // A pull after the restore returns the saved parameters.
  EXPECT_EQ(pull_all(), params[0]);
  ASSERT_TRUE(workers[0]->client().RestoreCheckpoint(ckpt + "/mid", false).ok());
  const auto at_save = pull_all();
  const auto reference_at_save = Reference(kSaveStep, KillTestLr);
  EXPECT_EQ(std::memcmp(at_save.data(), reference_at_save.data(), kParams * sizeof(float)), 0);

  workers.clear();
  for (size_t i = 0; i < servers.size(); ++i) {
    if (i == victim) continue;
    ASSERT_TRUE(servers[i].process->Signal(SIGTERM).ok());
    auto exit = servers[i].process->Wait(milliseconds(10000));
    ASSERT_TRUE(exit.ok());
    EXPECT_EQ(exit->code, 0) << testing::ReadFile(servers[i].log_file);
  }
}

// Two workers initialise at the same moment with different values. Each
// partition keeps one worker's values, the same on its primary and its
// backup (checksums of the whole state agree), every copy is initialised
// exactly once, and two steps later the copies still agree.
TEST(PsProcessTest, WorkersInitialisingAtOnceWithDifferentValuesLeaveBothCopiesAlike) {
  testing::TempDir dir;
  PsCluster cluster;
  StartCluster(dir, "ps-init", 2, {"--job-last-call-window", "300ms"}, &cluster);
  if (::testing::Test::HasFatalFailure()) return;
  const std::string address = cluster.address;
  std::vector<std::unique_ptr<testing::PsWorker>> workers;
  for (uint32_t w = 0; w < kWorkers; ++w)
    workers.push_back(std::make_unique<testing::PsWorker>(address, "ps-init", w, kWorkers));
  for (auto& w : workers) ASSERT_TRUE(w->WaitEpochAfter(0, milliseconds(30000)));
  const v1::ShardMap map = workers[0]->client().shard_map();
  ASSERT_EQ(map.partitions_size(), 13);

  std::vector<std::vector<float>> values(kWorkers, Initial());
  for (float& x : values[1]) x += 1.0f;
  std::latch go(kWorkers);
  std::vector<Result<int>> initialized(kWorkers, Unavailable("not run"));
  std::vector<std::thread> threads;
  for (uint32_t w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      go.arrive_and_wait();
      initialized[w] = workers[w]->client().Initialize(testing::FlatTensors(kParams), Optimizer(),
                                                       v1::ConsistencyConfig(), values[w].data());
    });
  }
  for (auto& t : threads) t.join();
  int total = 0;
  for (auto& n : initialized) {
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    total += *n;
  }
  EXPECT_EQ(total, 26);  // 13 primaries and 13 backups, each once

  auto expect_copies_alike = [&](uint64_t version) {
    auto stats = workers[0]->client().Stats(/*checksums=*/true);
    ASSERT_TRUE(stats.ok()) << stats.status().ToString();
    std::map<uint32_t, std::set<uint32_t>> checksums;
    std::map<uint32_t, int> copies;
    for (auto& [member, s] : *stats) {
      for (const auto& p : s.partitions()) {
        EXPECT_EQ(p.version(), version) << "partition " << p.partition_id();
        ASSERT_TRUE(p.has_state_crc32c());
        checksums[p.partition_id()].insert(p.state_crc32c());
        ++copies[p.partition_id()];
      }
    }
    ASSERT_EQ(checksums.size(), 13u);
    for (auto& [id, c] : checksums) {
      EXPECT_EQ(copies[id], 2) << "partition " << id;
      EXPECT_EQ(c.size(), 1u) << "partition " << id << ": primary and backup hold different state";
    }
  };
  expect_copies_alike(1);
  // Each partition holds one worker's values, whole.
  std::vector<float> params(kParams);
  ASSERT_TRUE(workers[0]->Pull(0, params).ok());
  for (const auto& p : map.partitions()) {
    const size_t b = p.range().begin(), n = p.range().end() - b;
    const bool first = std::memcmp(params.data() + b, values[0].data() + b, n * sizeof(float)) == 0;
    const bool second = std::memcmp(params.data() + b, values[1].data() + b, n * sizeof(float)) == 0;
    EXPECT_TRUE(first || second) << "partition " << p.id() << " holds neither worker's values";
  }
  // Two steps later (an update applied on each copy), still alike.
  std::vector<std::vector<float>> after(kWorkers, std::vector<float>(kParams));
  threads.clear();
  std::vector<Status> results(kWorkers);
  for (uint32_t w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      for (uint64_t s = 1; s <= 2 && results[w].ok(); ++s) results[w] = workers[w]->Step(s, after[w]);
    });
  }
  for (auto& t : threads) t.join();
  for (auto& r : results) ASSERT_TRUE(r.ok()) << r.ToString();
  EXPECT_EQ(after[0], after[1]);
  expect_copies_alike(3);
}

// A checkpoint that two servers saved through the gRPC control service,
// restored as the start of new jobs on three servers and on one: the
// parameters are the saved ones, the next step equals the failure-free
// reference bit for bit (so the Adam moments and the versions, which bias
// correction counts, came back exactly), and both copies of every
// partition agree.
TEST(PsProcessTest, ACheckpointOfTwoServersStartsJobsOnThreeAndOnOne) {
  testing::TempDir dir;
  const std::string ckpt = dir.path() + "/checkpoints";
  constexpr uint64_t kSaved = 3;
  // Both workers run steps first..last, each on its own thread.
  auto train = [](std::vector<std::unique_ptr<testing::PsWorker>>& workers, uint64_t first, uint64_t last,
                  std::vector<std::vector<float>>& params) {
    std::vector<Status> results(kWorkers);
    std::vector<std::thread> threads;
    for (uint32_t w = 0; w < kWorkers; ++w) {
      threads.emplace_back([&, w] {
        for (uint64_t s = first; s <= last && results[w].ok(); ++s) results[w] = workers[w]->Step(s, params[w]);
      });
    }
    for (auto& t : threads) t.join();
    for (auto& r : results) EXPECT_TRUE(r.ok()) << r.ToString();
  };
  auto join = [](const PsCluster& cluster, const std::string& job) {
    std::vector<std::unique_ptr<testing::PsWorker>> workers;
    for (uint32_t w = 0; w < kWorkers; ++w)
      workers.push_back(std::make_unique<testing::PsWorker>(cluster.address, job, w, kWorkers));
    for (auto& w : workers) EXPECT_TRUE(w->WaitEpochAfter(0, milliseconds(30000)));
    return workers;
  };
  std::vector<std::vector<float>> saved(kWorkers, std::vector<float>(kParams));
  std::string path;
  {
    PsCluster cluster;
    StartCluster(dir, "ps-save", 2, {"--job-last-call-window", "300ms"}, &cluster, "save-");
    if (::testing::Test::HasFatalFailure()) return;
    auto workers = join(cluster, "ps-save");
    const auto initial = Initial();
    for (auto& w : workers) {
      ASSERT_TRUE(w->client()
                      .Initialize(testing::FlatTensors(kParams), Optimizer(), v1::ConsistencyConfig(), initial.data())
                      .ok());
    }
    train(workers, 1, kSaved, saved);
    ASSERT_FALSE(::testing::Test::HasFailure());
    auto infos = workers[0]->client().SaveCheckpoint(ckpt, kSaved, "saved", false);
    ASSERT_TRUE(infos.ok()) << infos.status().ToString();
    ASSERT_EQ(infos->size(), 2u);
    for (const auto& info : *infos) EXPECT_EQ(info.state(), v1::CHECKPOINT_STATE_COMPLETE) << info.error();
    path = ckpt + "/saved";
  }  // the daemons are killed here
  const auto reference = Reference(kSaved + 1);
  for (int n : {3, 1}) {
    SCOPED_TRACE(fmt::format("restored on {} server(s)", n));
    const std::string job = fmt::format("ps-restore-{}", n);
    PsCluster cluster;
    StartCluster(dir, job, n, {"--job-last-call-window", "300ms"}, &cluster, fmt::format("restore{}-", n));
    if (::testing::Test::HasFatalFailure()) return;
    auto workers = join(cluster, job);
    int initialized = 0;
    for (auto& w : workers) {
      auto r = w->client().InitializeFromCheckpoint(testing::FlatTensors(kParams), Optimizer(), v1::ConsistencyConfig(),
                                                    path);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      initialized += *r;
    }
    EXPECT_EQ(initialized, n > 1 ? 26 : 13);  // every copy once
    std::vector<float> pulled(kParams);
    ASSERT_TRUE(workers[0]->Pull(0, pulled).ok());
    EXPECT_EQ(pulled, saved[0]);
    std::vector<std::vector<float>> next(kWorkers, std::vector<float>(kParams));
    train(workers, kSaved + 1, kSaved + 1, next);
    EXPECT_EQ(std::memcmp(next[0].data(), reference.data(), kParams * sizeof(float)), 0);
    EXPECT_EQ(next[0], next[1]);
    auto stats = workers[0]->client().Stats(/*checksums=*/true);
    ASSERT_TRUE(stats.ok()) << stats.status().ToString();
    std::map<uint32_t, std::set<uint32_t>> checksums;
    for (auto& [member, s] : *stats) {
      for (const auto& p : s.partitions()) {
        EXPECT_EQ(p.version(), kSaved + 2) << "partition " << p.partition_id();
        checksums[p.partition_id()].insert(p.state_crc32c());
      }
    }
    EXPECT_EQ(checksums.size(), 13u);
    for (auto& [id, c] : checksums) EXPECT_EQ(c.size(), 1u) << "partition " << id;
  }
}

// tandem-worker daemons join the epoch's parameter-server group by
// themselves (workers without a data plane are left out, so nobody waits for
// them: coordinator_process_test runs servers beside such workers). The
// servers report their partitions, and a server killed with SIGKILL leaves
// its partitions promoted on the survivor.
TEST(PsProcessTest, WorkerDaemonsJoinTheServersGroupEveryEpoch) {
  testing::TempDir dir;
  auto coordinator = testing::StartDaemon(
      "tandem-coordinator", "coordinator", dir.path(),
      {"--job-min-workers", "2", "--job-max-workers", "2", "--job-min-servers", "1", "--job-last-call-window", "800ms",
       "--job-parameter-count", "100000", "--job-partition-size", "64KiB", "--job-stream-grace", "300ms"});
  ASSERT_TRUE(coordinator.ok()) << coordinator.status().ToString();
  const std::string address = coordinator->ready.grpc_address;
  std::vector<cli::LaunchedDaemon> servers;
  for (int i = 0; i < 2; ++i) {
    auto s = testing::StartDaemon("tandem-server", "server-" + std::to_string(i), dir.path(),
                                  {"--coordinator-address", address, "--node-id", "s" + std::to_string(i)});
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    servers.push_back(std::move(*s));
  }
  for (auto& s : servers) {
    ASSERT_TRUE(testing::WaitRegistered(s, milliseconds(20000))) << testing::ReadFile(s.log_file);
  }
  std::vector<cli::LaunchedDaemon> workers;
  for (int i = 0; i < 2; ++i) {
    std::vector<std::string> args = {"--coordinator-address", address, "--data-plane-timeout", "15s"};
    auto w = testing::StartDaemon("tandem-worker", "worker-" + std::to_string(i), dir.path(), args);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    workers.push_back(std::move(*w));
  }
  for (auto& s : servers) {
    // The group (two servers and the two workers with a data plane), and the epoch gauge, which the metrics
    // loop refreshes on its own schedule.
    EXPECT_TRUE(testing::WaitUntil(
        [&] {
          return testing::ReadFile(s.log_file).find("parameter-server group of 4 members ready") != std::string::npos;
        },
        milliseconds(30000)))
        << testing::ReadFile(s.log_file);
    EXPECT_TRUE(
        testing::WaitUntil([&] { return testing::Metric(s, "tandem_server_epoch") >= 1; }, milliseconds(10000)));
  }
  EXPECT_TRUE(testing::WaitUntil(
      [&] {
        return testing::Metric(servers[0], "tandem_server_primary_partitions") +
                   testing::Metric(servers[1], "tandem_server_primary_partitions") ==
               7;
      },
      milliseconds(30000)));
  EXPECT_EQ(testing::Metric(servers[0], "tandem_server_backup_partitions"),
            testing::Metric(servers[1], "tandem_server_primary_partitions"));
  // SIGKILL one server: the survivor holds every partition as primary.
  ASSERT_TRUE(servers[1].process->Signal(SIGKILL).ok());
  EXPECT_TRUE(testing::WaitUntil([&] { return testing::Metric(servers[0], "tandem_server_primary_partitions") == 7; },
                                 milliseconds(30000)))
      << testing::ReadFile(servers[0].log_file);
  EXPECT_EQ(testing::Metric(servers[0], "tandem_server_backup_partitions"), 0);
  EXPECT_TRUE(testing::WaitUntil(
      [&] {
        const std::string log = testing::ReadFile(servers[0].log_file);
        return log.find("parameter-server group of 3 members ready") != std::string::npos;
      },
      milliseconds(30000)))
      << testing::ReadFile(servers[0].log_file);
  ASSERT_TRUE(servers[0].process->Signal(SIGTERM).ok());
  auto exit = servers[0].process->Wait(milliseconds(10000));
  ASSERT_TRUE(exit.ok());
  EXPECT_EQ(exit->code, 0) << testing::ReadFile(servers[0].log_file);
}

}  // namespace
}  // namespace tandem
