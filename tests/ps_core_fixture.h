// What the parameter store's tests share (ps_core_test.cc and the files
// beside it, one binary): a cluster of stores whose links call each other
// directly (no transport), a job, answers to pushes and pulls, and the
// PsCoreTest fixture with its reference runs.
#pragma once

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

#include <gtest/gtest.h>

#include "common/optimizer/gradient.h"
#include "optimizer_reference.h"
#include "server/checkpoint/checkpoint.h"
#include "server/ps_core.h"

namespace tandem::server::store_test {

constexpr uint64_t kFirstServer = 101;

// A cluster of stores whose links call each other directly.
class Cluster : public ServerLinks {
 public:
  struct Node;
  class NodeLinks : public ServerLinks {
   public:
    NodeLinks(Cluster* cluster, uint64_t self) : cluster_(cluster), self_(self) {}
    void SendShare(uint64_t epoch, uint64_t step, const std::vector<ps::ShareEntry>& entries) override {
      ps::Frame h;
      h.type = ps::FrameType::kShare;
      h.epoch = epoch;
      h.step = step;
      h.contributors = static_cast<uint32_t>(entries.size());
      h.payload_bytes = entries.size() * sizeof(ps::ShareEntry);
      if (cluster_->drop_shares) return;  // lost with the links
      for (auto& [id, node] : cluster_->nodes) {
        if (id != self_ && node->alive) node->store->Share(self_, h, entries.data());
      }
    }
    void SendToBackup(uint64_t backup, const ps::Frame& header, std::shared_ptr<const std::vector<float>> payload,
                      std::function<void(const Status&)> done) override {
      auto it = cluster_->nodes.find(backup);
      if (it == cluster_->nodes.end() || !it->second->alive || !cluster_->nodes[self_]->alive) {
        return done(Unavailable("member {} is dead", backup));
      }
      if (cluster_->hold_replicas) {
        cluster_->held.push_back([=, this] { SendToBackup(backup, header, payload, done); });
        return;
      }
      ps::Frame h = header;
      h.payload_bytes = payload ? payload->size() * sizeof(float) : 0;
      auto reply = [done](ps::Frame r, ReplyBody body) { done(ps::ReplyStatus(r, body.data())); };
      if (h.type == ps::FrameType::kTransfer) {
        it->second->store->Transfer(self_, h, payload ? payload->data() : nullptr, reply);
      } else {
        it->second->store->Replica(self_, h, payload ? payload->data() : nullptr, reply);
      }
    }
    void SendJob(uint64_t server, std::shared_ptr<const std::string> job) override {
      auto it = cluster_->nodes.find(server);
      if (it != cluster_->nodes.end() && it->second->alive) it->second->store->Job(self_, job->data(), job->size());
    }

   private:
    Cluster* cluster_;
    uint64_t self_;
  };
  struct Node {
    std::unique_ptr<NodeLinks> links;
    std::unique_ptr<ParameterStore> store;
    bool alive = true;
  };

  void SendShare(uint64_t, uint64_t, const std::vector<ps::ShareEntry>&) override {}
  void SendToBackup(uint64_t, const ps::Frame&, std::shared_ptr<const std::vector<float>>,
                    std::function<void(const Status&)>) override {}
  void SendJob(uint64_t, std::shared_ptr<const std::string>) override {}

  void Add(uint64_t id) {
    auto node = std::make_unique<Node>();
    node->links = std::make_unique<NodeLinks>(this, id);
    node->store = std::make_unique<ParameterStore>(StoreOptions{2}, node->links.get());
    nodes[id] = std::move(node);
  }
  ParameterStore& operator[](uint64_t id) { return *nodes.at(id)->store; }
  std::vector<uint64_t> Live() const {
    std::vector<uint64_t> ids;
    for (auto& [id, n] : nodes) {
      if (n->alive) ids.push_back(id);
    }
    return ids;
  }
  void Release() {
    hold_replicas = false;
    auto pending = std::move(held);
    held.clear();
    for (auto& f : pending) f();
  }

  std::map<uint64_t, std::unique_ptr<Node>> nodes;
  bool drop_shares = false;
  bool hold_replicas = false;
  std::vector<std::function<void()>> held;
};

inline v1::ShardMap MakeMap(uint64_t params, uint64_t partition_size, const std::vector<uint64_t>& servers) {
  v1::ShardMap map;
  map.set_partition_size(partition_size);
  map.set_parameter_count(params);
  map.set_version(1);
  const uint64_t n = (params + partition_size - 1) / partition_size;
  for (uint64_t i = 0; i < n; ++i) {
    auto* p = map.add_partitions();
    p->set_id(static_cast<uint32_t>(i));
    p->mutable_range()->set_begin(i * partition_size);
    p->mutable_range()->set_end(std::min(params, (i + 1) * partition_size));
    p->set_primary_member_id(servers[i % servers.size()]);
    p->set_backup_member_id(servers.size() > 1 ? servers[(i + 1) % servers.size()] : 0);
  }
  return map;
}

// The map after servers died: a dead primary's backup is promoted; a
// partition without a live backup gets the next live server.
inline v1::ShardMap Reassign(v1::ShardMap map, const std::vector<uint64_t>& live) {
  auto is_live = [&](uint64_t id) { return std::find(live.begin(), live.end(), id) != live.end(); };
  map.set_version(map.version() + 1);
  for (auto& p : *map.mutable_partitions()) {
    if (!is_live(p.primary_member_id())) {
      p.set_primary_member_id(p.backup_member_id());
      p.set_backup_member_id(0);
    }
    if (p.backup_member_id() == 0 || !is_live(p.backup_member_id())) {
      p.set_backup_member_id(0);
      for (uint64_t id : live) {
        if (id != p.primary_member_id()) {
          p.set_backup_member_id(id);
          break;
        }
      }
    }
  }
  return map;
}

struct Job {
  uint64_t params = 5500;
  uint64_t partition = 1000;
  v1::OptimizerConfig optimizer;
  v1::ConsistencyConfig consistency;
  std::vector<float> initial;

  Job() {
    auto* adam = optimizer.mutable_adam();
    adam->set_lr(1e-2);
    adam->set_weight_decay(0.01);
    adam->set_decoupled_weight_decay(true);
    std::mt19937 rng(7);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    initial.resize(params);
    for (auto& x : initial) x = dist(rng);
  }
  v1::InitializeParametersRequest Init(uint64_t epoch) const {
    v1::InitializeParametersRequest r;
    r.set_job_id("job");
    r.set_epoch(epoch);
    auto* a = r.add_tensors();
    a->set_name("w");
    a->add_shape(static_cast<int64_t>(params - 500));
    a->set_dtype(v1::DTYPE_FLOAT32);
    auto* b = r.add_tensors();
    b->set_name("b");
    b->add_shape(500);
    b->set_dtype(v1::DTYPE_FLOAT32);
    b->set_group("no_decay");
    *r.mutable_optimizer() = optimizer;
    (*r.mutable_optimizer()->mutable_group_overrides())["no_decay"].set_weight_decay(0);
    *r.mutable_consistency() = consistency;
    auto* chunk = r.mutable_values()->add_chunks();
    chunk->mutable_range()->set_begin(0);
    chunk->mutable_range()->set_end(params);
    chunk->set_dtype(v1::DTYPE_FLOAT32);
    chunk->set_data(std::string(reinterpret_cast<const char*>(initial.data()), params * sizeof(float)));
    return r;
  }
};

struct Answer {
  bool done = false;
  ps::Frame header;
  std::vector<char> payload;
  Status status() const { return ps::ReplyStatus(header, payload.data()); }
  std::vector<float> floats() const {
    std::vector<float> v(payload.size() / sizeof(float));
    std::memcpy(v.data(), payload.data(), v.size() * sizeof(float));
    return v;
  }
};

inline Reply Into(std::shared_ptr<Answer> a) {
  return [a](ps::Frame h, ReplyBody body) {
    a->done = true;
    a->header = h;
    a->payload = std::move(body).Take();
  };
}

inline ps::Frame PushHeader(uint64_t epoch, uint64_t step, uint32_t partition, uint32_t contributor,
                            uint32_t contributors, size_t bytes, v1::WireDType dtype = v1::WIRE_DTYPE_FP32) {
  ps::Frame h;
  h.type = ps::FrameType::kPush;
  h.epoch = epoch;
  h.step = step;
  h.partition = partition;
  h.contributor = contributor;
  h.contributors = contributors;
  h.dtype = static_cast<uint16_t>(dtype);
  h.payload_bytes = bytes;
  return h;
}

// `lr`: the step's learning rate the push carries (0: the schedule's).
inline std::shared_ptr<Answer> Push(ParameterStore& store, uint64_t epoch, uint64_t step, uint32_t partition,
                                    uint32_t contributor, uint32_t contributors, const std::vector<float>& grad,
                                    v1::WireDType dtype = v1::WIRE_DTYPE_FP32, double lr = 0) {
  ps::Frame h = PushHeader(epoch, step, partition, contributor, contributors, grad.size() * sizeof(float), dtype);
  h.value = lr;
  auto a = std::make_shared<Answer>();
  store.Push(1, h, grad.data(), Into(a));
  return a;
}

inline ps::Frame PullHeader(uint64_t epoch, uint64_t step, uint32_t partition) {
  ps::Frame h;
  h.type = ps::FrameType::kPull;
  h.epoch = epoch;
  h.step = step;
  h.partition = partition;
  h.dtype = v1::WIRE_DTYPE_FP32;
  return h;
}

inline std::shared_ptr<Answer> Pull(ParameterStore& store, uint64_t epoch, uint64_t step, uint32_t partition,
                                    uint32_t contributor = 0, uint32_t contributors = 0) {
  ps::Frame h = PullHeader(epoch, step, partition);
  h.contributor = contributor;
  h.contributors = contributors;
  auto a = std::make_shared<Answer>();
  store.Pull(1, h, Into(a));
  return a;
}

// A request answered at once with OK; for a push, whether it was counted
// as a duplicate.
inline ::testing::AssertionResult AnsweredOk(const std::shared_ptr<Answer>& a) {
  if (!a->done) return ::testing::AssertionFailure() << "not answered (yet)";
  if (!a->status().ok()) return ::testing::AssertionFailure() << a->status().ToString();
  return ::testing::AssertionSuccess();
}
inline bool Duplicate(const std::shared_ptr<Answer>& a) {
  return (a->header.flags & ps::kFlagDuplicate) != 0;
}

// Deterministic gradient of (step, contributor) for a partition range.
inline std::vector<float> Grad(uint64_t step, uint32_t contributor, uint64_t begin, uint64_t end) {
  std::vector<float> g(end - begin);
  std::mt19937 rng(static_cast<uint32_t>(step * 7919 + contributor * 104729 + begin));
  std::normal_distribution<float> dist(0.0f, 0.5f);
  for (auto& x : g) x = dist(rng);
  return g;
}

// A step's learning rate for the pushes (0: the schedule's).
using StepLr = std::function<double(uint64_t step)>;

// A LambdaLR-like sequence of learning rates: a short warmup, then an
// exponential decay, with every seventh step left to the configured
// schedule (0), so that the servers' schedule and pushed rates alternate.
inline double LambdaLr(uint64_t step) {
  if (step % 7 == 0) return 0;
  const double base = 2e-2;
  const double factor = step <= 3 ? static_cast<double>(step) / 3 : std::pow(0.93, static_cast<double>(step - 3));
  return base * factor;
}

// The run's parameters on one server with plain Push calls (below), the
// pushes of step s carrying lr(s) (null: 0, the schedule's).
inline std::vector<float> ReferenceRun(const Job& job, int steps, uint32_t contributors, const StepLr& lr = nullptr);

class PsCoreTest : public ::testing::Test {
 protected:
  void Start(int servers, const Job& job) {
    for (int i = 0; i < servers; ++i) cluster_.Add(kFirstServer + static_cast<uint64_t>(i));
    map_ = MakeMap(job.params, job.partition, cluster_.Live());
    SetEpoch(1);
    for (uint64_t id : cluster_.Live()) {
      auto r = cluster_[id].Initialize(job.Init(1));
      ASSERT_TRUE(r.ok()) << r.status().ToString();
    }
  }
  void SetEpoch(uint64_t epoch, uint32_t dp = 2, uint64_t start_step = 0) {
    epoch_ = epoch;
    for (uint64_t id : cluster_.Live()) cluster_[id].SetEpoch(epoch, id, map_, dp, start_step);
    for (uint64_t id : cluster_.Live()) cluster_[id].LinksReady(epoch);
  }
  ParameterStore& PrimaryOf(uint32_t partition) {
    return cluster_[map_.partitions(static_cast<int>(partition)).primary_member_id()];
  }
  ParameterStore* BackupOf(uint32_t partition) {
    const uint64_t id = map_.partitions(static_cast<int>(partition)).backup_member_id();
    return id == 0 ? nullptr : &cluster_[id];
  }
  std::pair<uint64_t, uint64_t> Range(uint32_t partition) const {
    const auto& r = map_.partitions(static_cast<int>(partition)).range();
    return {r.begin(), r.end()};
  }
  uint32_t Partitions() const { return static_cast<uint32_t>(map_.partitions_size()); }

  // Every contributor pushes every partition of `step` (contributors in
  // `order`), each push carrying the learning rate `lr`, then pulls: returns
  // the whole parameter vector.
  std::vector<float> RunStep(uint64_t step, uint32_t contributors, std::vector<uint32_t> order = {}, double lr = 0) {
    if (order.empty()) {
      for (uint32_t c = 0; c < contributors; ++c) order.push_back(c);
    }
    for (uint32_t p = 0; p < Partitions(); ++p) {
      auto [b, e] = Range(p);
      for (uint32_t c : order) {
        auto a = Push(PrimaryOf(p), epoch_, step, p, c, contributors, Grad(step, c, b, e), v1::WIRE_DTYPE_FP32, lr);
        EXPECT_TRUE(a->done);
        EXPECT_TRUE(a->status().ok()) << a->status().ToString();
      }
    }
    return PullAll(step);
  }
  std::vector<float> PullAll(uint64_t step) {
    std::vector<float> all;
    for (uint32_t p = 0; p < Partitions(); ++p) {
      auto a = Pull(PrimaryOf(p), epoch_, step, p);
      EXPECT_TRUE(a->done) << "pull of partition " << p << " step " << step << " did not complete";
      EXPECT_TRUE(a->status().ok()) << a->status().ToString();
      EXPECT_EQ(a->header.step, step);
      auto v = a->floats();
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  }
  // Primary and backup hold bit-identical state for every partition: same
  // version and step, and the same checksum of weights and optimizer state.
  void ExpectReplicasEqual() {
    for (uint32_t p = 0; p < Partitions(); ++p) {
      ParameterStore* backup = BackupOf(p);
      if (backup == nullptr) continue;
      auto primary_stats = PrimaryOf(p).Stats({p}, /*checksums=*/true);
      auto backup_stats = backup->Stats({p}, /*checksums=*/true);
      ASSERT_EQ(primary_stats.partitions_size(), 1);
      ASSERT_EQ(backup_stats.partitions_size(), 1);
      const auto& a = primary_stats.partitions(0);
      const auto& b = backup_stats.partitions(0);
      EXPECT_EQ(a.version(), b.version()) << "partition " << p;
      EXPECT_EQ(a.step(), b.step()) << "partition " << p;
      EXPECT_EQ(b.role(), v1::REPLICA_ROLE_BACKUP);
      ASSERT_TRUE(a.has_state_crc32c() && b.has_state_crc32c());
      EXPECT_EQ(a.state_crc32c(), b.state_crc32c()) << "partition " << p << ": the backup's state differs";
    }
  }

  // A PushLanding per server (three peers each), as the servers' frame
  // channels have.
  struct Landings {
    explicit Landings(PsCoreTest& test) : t(test) {
      for (uint64_t id : t.cluster_.Live()) all.emplace_back(&t.cluster_[id], 3);
    }
    // The landing of the partition's primary.
    PushLanding& Of(uint32_t p) {
      const uint64_t id = t.map_.partitions(static_cast<int>(p)).primary_member_id();
      return all[static_cast<size_t>(id - kFirstServer)];
    }
    // Receives `grad` as a push frame `h` from `peer` into the buffer the
    // partition's landing gives (null when it gives none).
    void* Receive(uint32_t p, int peer, const ps::Frame& h, const std::vector<float>& grad) {
      void* into = Of(p).PayloadBuffer(peer, h);
      if (into != nullptr) std::memcpy(into, grad.data(), h.payload_bytes);
      return into;
    }
    PsCoreTest& t;
    std::vector<PushLanding> all;
  };

  // The parameters after one step of one contributor equal a one-server
  // run's, bit for bit.
  static void ExpectOneStepReference(const Job& job, const std::vector<float>& params) {
    const auto reference = ReferenceRun(job, 1, 1);
    ASSERT_EQ(params.size(), reference.size());
    EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
  }

  Cluster cluster_;
  v1::ShardMap map_;
  uint64_t epoch_ = 0;
};

inline std::vector<float> ReferenceRun(const Job& job, int steps, uint32_t contributors, const StepLr& lr) {
  // One server holding everything.
  Cluster cluster;
  cluster.Add(kFirstServer);
  v1::ShardMap map = MakeMap(job.params, job.partition, {kFirstServer});
  cluster[kFirstServer].SetEpoch(1, kFirstServer, map, 2, 0);
  cluster[kFirstServer].LinksReady(1);
  EXPECT_TRUE(cluster[kFirstServer].Initialize(job.Init(1)).ok());
  std::vector<float> all;
  for (int s = 1; s <= steps; ++s) {
    all.clear();
    for (int p = 0; p < map.partitions_size(); ++p) {
      const auto& r = map.partitions(p).range();
      for (uint32_t c = 0; c < contributors; ++c) {
        EXPECT_TRUE(Push(cluster[kFirstServer], 1, static_cast<uint64_t>(s), static_cast<uint32_t>(p), c, contributors,
                         Grad(static_cast<uint64_t>(s), c, r.begin(), r.end()), v1::WIRE_DTYPE_FP32,
                         lr ? lr(static_cast<uint64_t>(s)) : 0)
                        ->status()
                        .ok());
      }
    }
    for (int p = 0; p < map.partitions_size(); ++p) {
      auto a = Pull(cluster[kFirstServer], 1, static_cast<uint64_t>(s), static_cast<uint32_t>(p));
      auto v = a->floats();
      all.insert(all.end(), v.begin(), v.end());
    }
  }
  return all;
}

}  // namespace tandem::server::store_test
