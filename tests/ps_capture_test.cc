// The parameter store's checkpoints: capture at a step, stopping, and
// restoring onto other server counts bit for bit.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include <gtest/gtest.h>

#include "ps_core_fixture.h"

namespace tandem::server::store_test {
namespace {

// Polls `done` for up to 10 s.
bool Eventually(const std::function<bool()>& done) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

TEST_F(PsCoreTest, StoppingFailsAWaitingCaptureAtOnceAndEveryLaterOne) {
  Job job;
  Start(2, job);
  RunStep(1, 2);
  const uint64_t id = cluster_.Live().front();
  // Step 3 is never reached: the capture would wait for its whole timeout.
  std::promise<Status> waited;
  std::thread saver([&] { waited.set_value(cluster_[id].CaptureAt(3, std::chrono::minutes(10)).status()); });
  auto result = waited.get_future();
  EXPECT_EQ(result.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout);
  cluster_[id].StopCaptures();
  ASSERT_EQ(result.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  const Status s = result.get();
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  saver.join();
  EXPECT_EQ(cluster_[id].CaptureAt(1, std::chrono::seconds(1)).status().code(), StatusCode::kUnavailable);
}

TEST_F(PsCoreTest, ACaptureWaitingForAStepSurvivesARebalanceAndFailsWhenAPartitionLeaves) {
  Job job;
  Start(3, job);
  RunStep(1, 2);
  const std::vector<uint64_t> ids = cluster_.Live();
  ASSERT_EQ(ids.size(), 3u);
  // Every server waits for step 3 of its primaries.
  std::vector<std::future<Result<Capture>>> waits;
  for (uint64_t id : ids) {
    waits.push_back(
        std::async(std::launch::async, [this, id] { return cluster_[id].CaptureAt(3, std::chrono::seconds(30)); }));
  }
  for (uint64_t id : ids) {
    ASSERT_TRUE(Eventually([&] { return cluster_[id].WaitingCaptures() == 1; }));
  }
  // A rebalance: primary and backup swap roles on the even partitions.
  map_.set_version(map_.version() + 1);
  for (auto& p : *map_.mutable_partitions()) {
    if (p.id() % 2 == 0) {
      const uint64_t primary = p.primary_member_id();
      p.set_primary_member_id(p.backup_member_id());
      p.set_backup_member_id(primary);
    }
  }
  SetEpoch(2);
  for (uint64_t id : ids) EXPECT_EQ(cluster_[id].WaitingCaptures(), 1u);
  RunStep(2, 2);
  const std::vector<float> at3 = RunStep(3, 2);
  // Each server saved the partitions it was primary of when asked (as a
  // backup now, for half of them), at step 3, and together they are the
  // parameters of step 3.
  std::map<uint32_t, PartitionState> saved;
  for (auto& w : waits) {
    auto capture = w.get();
    ASSERT_TRUE(capture.ok()) << capture.status().ToString();
    EXPECT_EQ(capture->step, 3u);
    for (auto& p : capture->partitions) {
      EXPECT_EQ(p.step, 3u) << p.id;
      EXPECT_TRUE(saved.emplace(p.id, p).second) << "partition " << p.id << " saved twice";
    }
  }
  ASSERT_EQ(saved.size(), Partitions());
  for (const auto& [id, p] : saved) {
    ASSERT_EQ(std::memcmp(p.weights.data(), at3.data() + p.begin, p.size() * sizeof(float)), 0) << id;
  }

  // A partition leaving a server fails that server's wait, naming it.
  const uint64_t owner = map_.partitions(1).primary_member_id();
  std::future<Result<Capture>> lost =
      std::async(std::launch::async, [&] { return cluster_[owner].CaptureAt(5, std::chrono::seconds(30)); });
  ASSERT_TRUE(Eventually([&] { return cluster_[owner].WaitingCaptures() == 1; }));
  map_.set_version(map_.version() + 1);
  auto* moved = map_.mutable_partitions(1);
  for (uint64_t id : ids) {
    if (id != owner && id != moved->backup_member_id()) moved->set_primary_member_id(id);
  }
  SetEpoch(3);
  const auto result = lost.get();
  EXPECT_EQ(result.status().code(), StatusCode::kAborted) << result.status().ToString();
  EXPECT_NE(result.status().message().find("partition 1 moved to another server"), std::string::npos)
      << result.status().ToString();
}

class CheckpointRoundTrip : public PsCoreTest, public ::testing::WithParamInterface<int> {};

TEST_P(CheckpointRoundTrip, RestoreOnAnotherServerCountIsBitIdentical) {
  Job job;
  Start(3, job);
  for (uint64_t s = 1; s <= 4; ++s) RunStep(s, 2);
  const auto dir = std::filesystem::temp_directory_path() /
                   ("tandem-ps-core-" + std::to_string(::getpid()) + "-" + std::to_string(GetParam()));
  std::filesystem::remove_all(dir);
  // Every server saves its primaries at step 4.
  std::map<uint32_t, PartitionState> saved;
  for (uint64_t id : cluster_.Live()) {
    auto capture = cluster_[id].CaptureAt(4, std::chrono::milliseconds(1000));
    ASSERT_TRUE(capture.ok()) << capture.status().ToString();
    auto identity = cluster_[id].Identity();
    ASSERT_TRUE(identity.ok());
    CheckpointMeta meta;
    meta.job_id = "job";
    meta.checkpoint_id = "step-4";
    meta.step = 4;
    meta.parameter_count = identity->parameter_count;
    meta.tensor_fingerprint = identity->fingerprint;
    meta.optimizer = identity->optimizer;
    meta.state_buffers = static_cast<uint32_t>(identity->state_buffers);
    std::vector<const PartitionState*> parts;
    for (auto& p : capture->partitions) {
      parts.push_back(&p);
      saved[p.id] = p;
    }
    uint64_t bytes = 0;
    ASSERT_TRUE(WriteCheckpointFiles((dir / "step-4").string(), meta, parts, nullptr, &bytes).ok());
  }
  ASSERT_EQ(saved.size(), Partitions());
  // A new cluster of GetParam() servers restores it.
  Cluster restored;
  std::vector<uint64_t> ids;
  for (int i = 0; i < GetParam(); ++i) {
    restored.Add(200 + static_cast<uint64_t>(i));
    ids.push_back(200 + static_cast<uint64_t>(i));
  }
  auto map = MakeMap(job.params, job.partition, ids);
  for (uint64_t id : ids) restored[id].SetEpoch(1, id, map, 2, 4);
  for (uint64_t id : ids) {
    auto init = job.Init(1);
    init.set_checkpoint_path((dir / "step-4").string());
    auto r = restored[id].Initialize(init);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
  }
  for (uint64_t id : ids) {
    auto capture = restored[id].CaptureAt(0, std::chrono::milliseconds(100));
    ASSERT_TRUE(capture.ok()) << capture.status().ToString();
    EXPECT_EQ(capture->step, 4u);
    for (const auto& p : capture->partitions) {
      const auto& want = saved.at(p.id);
      EXPECT_EQ(p.weights, want.weights) << p.id;
      EXPECT_EQ(p.state0, want.state0) << p.id;
      EXPECT_EQ(p.state1, want.state1) << p.id;
      EXPECT_EQ(p.version, want.version);
    }
  }
  // A corrupted file is refused.
  for (const auto& entry : std::filesystem::directory_iterator(dir / "step-4")) {
    std::FILE* f = std::fopen(entry.path().c_str(), "r+b");
    ASSERT_NE(f, nullptr);
    std::fseek(f, 4096, SEEK_SET);
    int c = std::fgetc(f);
    std::fseek(f, 4096, SEEK_SET);
    std::fputc(c ^ 0x20, f);
    std::fclose(f);
    break;
  }
  Cluster broken;
  broken.Add(300);
  broken[300].SetEpoch(1, 300, MakeMap(job.params, job.partition, {300}), 2, 4);
  auto init = job.Init(1);
  init.set_checkpoint_path((dir / "step-4").string());
  auto refused = broken[300].Initialize(init);
  EXPECT_EQ(refused.status().code(), StatusCode::kDataLoss) << refused.status().ToString();
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Servers, CheckpointRoundTrip, ::testing::Values(1, 2, 5));

}  // namespace
}  // namespace tandem::server::store_test
