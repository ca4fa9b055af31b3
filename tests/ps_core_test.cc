// The parameter store's rules, with several stores in one process linked
// directly (no transport): exactly-once sync steps across servers, the
// decision (non-finite skip, global clipping), duplicates and order,
// consistency modes, replication and promotion after a primary dies, state
// transfer to a new backup, and checkpoints restored onto other server
// counts.
#include "server/ps_core.h"

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

namespace tandem::server {
namespace {

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

v1::ShardMap MakeMap(uint64_t params, uint64_t partition_size, const std::vector<uint64_t>& servers) {
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
v1::ShardMap Reassign(v1::ShardMap map, const std::vector<uint64_t>& live) {
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

Reply Into(std::shared_ptr<Answer> a) {
  return [a](ps::Frame h, ReplyBody body) {
    a->done = true;
    a->header = h;
    a->payload = std::move(body).Take();
  };
}

ps::Frame PushHeader(uint64_t epoch, uint64_t step, uint32_t partition, uint32_t contributor, uint32_t contributors,
                     size_t bytes, v1::WireDType dtype = v1::WIRE_DTYPE_FP32) {
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
std::shared_ptr<Answer> Push(ParameterStore& store, uint64_t epoch, uint64_t step, uint32_t partition,
                             uint32_t contributor, uint32_t contributors, const std::vector<float>& grad,
                             v1::WireDType dtype = v1::WIRE_DTYPE_FP32, double lr = 0) {
  ps::Frame h = PushHeader(epoch, step, partition, contributor, contributors, grad.size() * sizeof(float), dtype);
  h.value = lr;
  auto a = std::make_shared<Answer>();
  store.Push(1, h, grad.data(), Into(a));
  return a;
}

ps::Frame PullHeader(uint64_t epoch, uint64_t step, uint32_t partition) {
  ps::Frame h;
  h.type = ps::FrameType::kPull;
  h.epoch = epoch;
  h.step = step;
  h.partition = partition;
  h.dtype = v1::WIRE_DTYPE_FP32;
  return h;
}

std::shared_ptr<Answer> Pull(ParameterStore& store, uint64_t epoch, uint64_t step, uint32_t partition,
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
::testing::AssertionResult AnsweredOk(const std::shared_ptr<Answer>& a) {
  if (!a->done) return ::testing::AssertionFailure() << "not answered (yet)";
  if (!a->status().ok()) return ::testing::AssertionFailure() << a->status().ToString();
  return ::testing::AssertionSuccess();
}
bool Duplicate(const std::shared_ptr<Answer>& a) {
  return (a->header.flags & ps::kFlagDuplicate) != 0;
}

// Deterministic gradient of (step, contributor) for a partition range.
std::vector<float> Grad(uint64_t step, uint32_t contributor, uint64_t begin, uint64_t end) {
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
double LambdaLr(uint64_t step) {
  if (step % 7 == 0) return 0;
  const double base = 2e-2;
  const double factor = step <= 3 ? static_cast<double>(step) / 3 : std::pow(0.93, static_cast<double>(step - 3));
  return base * factor;
}

// The run's parameters on one server with plain Push calls (below), the
// pushes of step s carrying lr(s) (null: 0, the schedule's).
std::vector<float> ReferenceRun(const Job& job, int steps, uint32_t contributors, const StepLr& lr = nullptr);

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

std::vector<float> ReferenceRun(const Job& job, int steps, uint32_t contributors, const StepLr& lr) {
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

TEST_F(PsCoreTest, ThreeServersEqualOneServerBitForBit) {
  Job job;
  Start(3, job);
  std::vector<float> params;
  for (uint64_t s = 1; s <= 20; ++s)
    params = RunStep(s, 3, s % 2 ? std::vector<uint32_t>{2, 0, 1} : std::vector<uint32_t>{});
  const auto reference = ReferenceRun(job, 20, 3);
  ASSERT_EQ(params.size(), reference.size());
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
  ExpectReplicasEqual();
  // The step moved the parameters.
  EXPECT_NE(params[0], job.initial[0]);
}

// An fp32 pull is answered with the partition's weights themselves, not a
// copy: a reply still being sent must keep the bytes of its step while the
// next update is applied, and after the partition is gone.
TEST_F(PsCoreTest, APullReplyStillBeingSentKeepsItsStepWhileTheNextUpdateApplies) {
  Job job;
  Start(1, job);
  RunStep(1, 2);
  auto [b, e] = Range(0);
  ps::Frame h = PullHeader(1, 1, 0);
  std::vector<ReplyBody> held;  // replies "in flight"
  for (int i = 0; i < 2; ++i) {
    PrimaryOf(0).Pull(1, h, [&held](ps::Frame r, ReplyBody body) {
      EXPECT_EQ(r.status, 0);
      held.push_back(std::move(body));
    });
  }
  ASSERT_EQ(held.size(), 2u);
  ASSERT_NE(held[0].borrowed, nullptr) << "an fp32 pull borrows the weights";
  ASSERT_EQ(held[0].size(), (e - b) * sizeof(float));
  const std::vector<char> step1(held[0].data(), held[0].data() + held[0].size());
  const auto reference1 = ReferenceRun(job, 1, 2);
  EXPECT_EQ(std::memcmp(step1.data(), reference1.data(), step1.size()), 0);

  // Step 2 updates the partition while both replies hold its weights.
  const auto params = RunStep(2, 2);
  for (const auto& body : held) EXPECT_EQ(std::memcmp(body.data(), step1.data(), step1.size()), 0);
  const auto reference2 = ReferenceRun(job, 2, 2);
  EXPECT_EQ(std::memcmp(params.data(), reference2.data(), params.size() * sizeof(float)), 0);
  EXPECT_NE(std::memcmp(params.data(), step1.data(), step1.size()), 0);

  // One reply is sent; a new one borrows the current weights; then the
  // server goes away with both still held.
  held.erase(held.begin());
  h.step = 2;
  PrimaryOf(0).Pull(1, h, [&held](ps::Frame, ReplyBody body) { held.push_back(std::move(body)); });
  ASSERT_EQ(held.size(), 2u);
  cluster_.nodes.clear();
  EXPECT_EQ(std::memcmp(held[0].data(), step1.data(), step1.size()), 0);
  EXPECT_EQ(std::memcmp(held[1].data(), params.data(), step1.size()), 0);
}

// A push that completes a step is acknowledged before the step's scan and
// update run (they follow on the same thread): a worker's push does not
// wait for the optimizer.
TEST_F(PsCoreTest, APushThatCompletesTheStepIsAnsweredBeforeTheUpdate) {
  Job job;
  Start(1, job);
  ParameterStore& store = PrimaryOf(0);
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [b, e] = Range(p);
    const auto grad = Grad(1, 0, b, e);
    const ps::Frame h = PushHeader(1, 1, p, 0, 1, grad.size() * sizeof(float));
    std::optional<uint64_t> updates_at_reply;
    store.Push(1, h, grad.data(), [&](ps::Frame r, ReplyBody) {
      EXPECT_EQ(r.status, 0);
      updates_at_reply = store.counters().updates.load();
    });
    ASSERT_TRUE(updates_at_reply.has_value());
    EXPECT_EQ(*updates_at_reply, 0u) << "partition " << p;
  }
  EXPECT_EQ(store.counters().updates.load(), Partitions());
  ExpectOneStepReference(job, PullAll(1));
}

// The scans of a step's partitions wait until every partition here has the
// step: no update is applied before the last partition's last push, and
// then all of them are.
TEST_F(PsCoreTest, TheLastPartitionsPushReleasesTheScansOfTheOthers) {
  Job job;
  job.partition = 128 * 1024;
  job.params = job.partition * 2 + 1000;  // a small last partition
  job.initial.resize(job.params, 0.5f);
  Start(1, job);
  ParameterStore& store = PrimaryOf(0);
  ASSERT_EQ(Partitions(), 3u);
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [b, e] = Range(p);
    auto a = Push(store, epoch_, 1, p, 0, 1, Grad(1, 0, b, e));
    ASSERT_TRUE(a->done);
    EXPECT_TRUE(a->status().ok()) << a->status().ToString();
    EXPECT_EQ(store.counters().updates.load(), p + 1 < Partitions() ? 0u : Partitions()) << "partition " << p;
  }
  ExpectOneStepReference(job, PullAll(1));
}

// Pushes received straight into store buffers (PushLanding, as the server's
// frame channel does): the first contribution becomes the accumulator, later
// and early ones are folded from theirs, buffers are reused across steps, and
// the result is bit for bit that of pushes from the caller's memory.
TEST_F(PsCoreTest, PushesLandedInStoreBuffersEqualCopiedPushesBitForBit) {
  Job job;
  Start(3, job);
  Landings landings(*this);
  auto landing_of = [&](uint32_t p) -> PushLanding& { return landings.Of(p); };
  std::vector<float> params;
  for (uint64_t s = 1; s <= 6; ++s) {
    const std::vector<uint32_t> order = s % 2 ? std::vector<uint32_t>{2, 0, 1} : std::vector<uint32_t>{0, 1, 2};
    for (uint32_t p = 0; p < Partitions(); ++p) {
      auto [b, e] = Range(p);
      for (uint32_t c : order) {
        const auto grad = Grad(s, c, b, e);
        const ps::Frame h = PushHeader(epoch_, s, p, c, 3, grad.size() * sizeof(float));
        const int peer = static_cast<int>(c);
        void* into = landings.Receive(p, peer, h, grad);
        ASSERT_NE(into, nullptr);
        auto a = std::make_shared<Answer>();
        std::shared_ptr<std::vector<float>> landed = landing_of(p).Take(peer, into);
        ASSERT_NE(landed, nullptr);
        PrimaryOf(p).Push(1, h, std::move(landed), Into(a));
        ASSERT_TRUE(a->done);
        ASSERT_TRUE(a->status().ok()) << a->status().ToString();
      }
    }
    params = PullAll(s);
  }
  const auto reference = ReferenceRun(job, 6, 3);
  ASSERT_EQ(params.size(), reference.size());
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
  ExpectReplicasEqual();

  // No buffer where the store could not keep it: the channel allocates.
  auto [b, e] = Range(0);
  ps::Frame h = PushHeader(epoch_, 7, 0, 0, 3, (e - b) * 2, v1::WIRE_DTYPE_BF16);
  EXPECT_EQ(PrimaryOf(0).PushBuffer(h), nullptr) << "bf16";
  h.dtype = v1::WIRE_DTYPE_FP32;
  h.payload_bytes = (e - b) * 4 + 4;
  EXPECT_EQ(PrimaryOf(0).PushBuffer(h), nullptr) << "wrong size";
  h.payload_bytes = (e - b) * 4;
  h.partition = 999;
  EXPECT_EQ(PrimaryOf(0).PushBuffer(h), nullptr) << "unknown partition";
  h.partition = 0;
  h.type = ps::FrameType::kPull;
  EXPECT_EQ(PrimaryOf(0).PushBuffer(h), nullptr) << "not a push";
  // A landed push with a wrong size is refused like any other.
  h.type = ps::FrameType::kPush;
  auto buffer = PrimaryOf(0).PushBuffer(h);
  ASSERT_NE(buffer, nullptr);
  h.payload_bytes -= 4;
  auto a = std::make_shared<Answer>();
  PrimaryOf(0).Push(1, h, buffer, Into(a));
  ASSERT_TRUE(a->done);
  EXPECT_EQ(a->status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PullAll(6), params);
}

TEST_F(PsCoreTest, DuplicatePushesAreIgnoredAndFlagged) {
  Job job;
  Start(2, job);
  auto [b, e] = Range(0);
  auto first = Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e));
  ASSERT_TRUE(first->status().ok());
  EXPECT_EQ(first->header.flags & ps::kFlagDuplicate, 0);
  auto again = Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e));
  ASSERT_TRUE(again->status().ok());
  EXPECT_NE(again->header.flags & ps::kFlagDuplicate, 0);
  // Finish the step, then push it again: a duplicate of an applied step.
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [pb, pe] = Range(p);
    for (uint32_t c = 0; c < 2; ++c) ASSERT_TRUE(Push(PrimaryOf(p), 1, 1, p, c, 2, Grad(1, c, pb, pe))->status().ok());
  }
  auto pulled = PullAll(1);
  auto late = Push(PrimaryOf(0), 1, 1, 0, 1, 2, Grad(1, 1, b, e));
  EXPECT_NE(late->header.flags & ps::kFlagDuplicate, 0);
  auto after = PullAll(1);
  EXPECT_EQ(pulled, after);
  EXPECT_EQ(PrimaryOf(0).Stats({0}).partitions(0).version(), 2u);
}

TEST_F(PsCoreTest, BadPushesGetClearErrorsAndChangeNothing) {
  Job job;
  Start(2, job);
  auto [b, e] = Range(0);
  const auto before = PrimaryOf(0).Stats({0});
  auto expect_error = [&](std::shared_ptr<Answer> a, StatusCode code, const std::string& words) {
    ASSERT_TRUE(a->done);
    EXPECT_EQ(a->status().code(), code) << a->status().ToString();
    EXPECT_NE(a->status().message().find(words), std::string::npos) << a->status().message();
  };
  expect_error(Push(PrimaryOf(0), 0, 1, 0, 0, 2, Grad(1, 0, b, e)), StatusCode::kFailedPrecondition, "stale");
  expect_error(Push(PrimaryOf(0), 2, 1, 0, 0, 2, Grad(1, 0, b, e)), StatusCode::kUnavailable, "not reached epoch 2");
  expect_error(Push(PrimaryOf(0), 1, 3, 0, 0, 2, Grad(1, 0, b, e)), StatusCode::kFailedPrecondition, "future");
  expect_error(Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e - 1)), StatusCode::kInvalidArgument, "bytes");
  expect_error(Push(PrimaryOf(0), 1, 1, 0, 2, 2, Grad(1, 0, b, e)), StatusCode::kInvalidArgument, "contributor 2");
  expect_error(Push(PrimaryOf(0), 1, 1, 99, 0, 2, Grad(1, 0, b, e)), StatusCode::kNotFound, "partition 99");
  expect_error(Push(*BackupOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e)), StatusCode::kFailedPrecondition, "not the primary");
  auto far = Pull(PrimaryOf(0), 1, 3, 0);
  ASSERT_TRUE(far->done);
  EXPECT_EQ(far->status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(far->status().message().find("future"), std::string::npos);
  auto wrong_dtype = Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e), static_cast<v1::WireDType>(9));
  expect_error(wrong_dtype, StatusCode::kInvalidArgument, "dtype");
  // A push naming another contributor count than the step's first push.
  ASSERT_TRUE(Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e))->status().ok());
  expect_error(Push(PrimaryOf(0), 1, 1, 0, 1, 3, Grad(1, 1, b, e)), StatusCode::kInvalidArgument, "contributors");
  const auto after = PrimaryOf(0).Stats({0});
  EXPECT_EQ(before.partitions(0).version(), after.partitions(0).version());
  EXPECT_EQ(before.partitions(0).step(), after.partitions(0).step());
  EXPECT_EQ(PullAll(0), job.initial);
  // Nothing refused was folded into step 1's sum: completed, it equals a
  // clean run's step (contributor 0's push of partition 0 is a duplicate).
  EXPECT_EQ(RunStep(1, 2), ReferenceRun(job, 1, 2));
  ExpectReplicasEqual();
}

// A learning rate per step (ps::Frame::value): every push of a step must
// carry the step's rate. A push that carries another one (than the step's
// first push, also one still waiting in the buffer for its turn, or the
// same contributor's) is refused with INVALID_ARGUMENT naming both rates and
// is not folded in: the step, completed by the right pushes, equals a clean
// run's bit for bit.
TEST_F(PsCoreTest, APushWhoseLearningRateDiffersFromItsStepsIsRefusedAndChangesNothing) {
  Job job;
  Start(2, job);
  auto [b, e] = Range(0);
  const auto before = PrimaryOf(0).Stats({0});
  auto expect_mismatch = [&](std::shared_ptr<Answer> a, const std::string& words) {
    ASSERT_TRUE(a->done);
    EXPECT_EQ(a->status().code(), StatusCode::kInvalidArgument) << a->status().ToString();
    EXPECT_NE(a->status().message().find(words), std::string::npos) << a->status().message();
  };
  // Contributor 2 of 3 comes first: buffered until 0 and 1 are folded in.
  ASSERT_TRUE(Push(PrimaryOf(0), 1, 1, 0, 2, 3, Grad(1, 2, b, e), v1::WIRE_DTYPE_FP32, 0.01)->status().ok());
  expect_mismatch(Push(PrimaryOf(0), 1, 1, 0, 0, 3, Grad(1, 0, b, e), v1::WIRE_DTYPE_FP32, 0.02),
                  "push of step 1 carries learning rate 0.02, but the step's other pushes carry 0.01");
  // The schedule's (0) is another rate too.
  expect_mismatch(Push(PrimaryOf(0), 1, 1, 0, 1, 3, Grad(1, 1, b, e)),
                  "carries learning rate 0, but the step's other pushes carry 0.01");
  ASSERT_TRUE(Push(PrimaryOf(0), 1, 1, 0, 0, 3, Grad(1, 0, b, e), v1::WIRE_DTYPE_FP32, 0.01)->status().ok());
  // The same contributor again with another rate: refused, not a duplicate.
  expect_mismatch(Push(PrimaryOf(0), 1, 1, 0, 0, 3, Grad(1, 0, b, e), v1::WIRE_DTYPE_FP32, 0.03),
                  "carries learning rate 0.03");
  const auto after = PrimaryOf(0).Stats({0});
  EXPECT_EQ(after.partitions(0).version(), before.partitions(0).version());
  EXPECT_EQ(after.partitions(0).step(), before.partitions(0).step());
  // Completed with the step's rate, it equals a clean run's step (the
  // pushes already taken are duplicates).
  const StepLr lr = [](uint64_t) { return 0.01; };
  const auto params = RunStep(1, 3, {}, 0.01);
  const auto reference = ReferenceRun(job, 1, 3, lr);
  ASSERT_EQ(params.size(), reference.size());
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
  ExpectReplicasEqual();
}

// A negative, NaN or infinite learning rate is refused with INVALID_ARGUMENT
// naming it, before anything else of the push is taken: it fixes neither
// the step's rate nor a contribution, so the step then completes with the
// schedule's rate (value 0) exactly as a clean run does.
TEST_F(PsCoreTest, ANegativeNanOrInfiniteLearningRateIsRefusedAndChangesNothing) {
  Job job;
  Start(2, job);
  auto [b, e] = Range(0);
  for (double lr : {-0.01, -std::numeric_limits<double>::infinity(), std::numeric_limits<double>::infinity(),
                    std::numeric_limits<double>::quiet_NaN()}) {
    auto a = Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e), v1::WIRE_DTYPE_FP32, lr);
    ASSERT_TRUE(a->done);
    EXPECT_EQ(a->status().code(), StatusCode::kInvalidArgument) << lr << ": " << a->status().ToString();
    EXPECT_NE(a->status().message().find("must be 0 (the configured schedule) or > 0 and finite"), std::string::npos)
        << a->status().message();
  }
  auto negative = Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e), v1::WIRE_DTYPE_FP32, -0.01);
  EXPECT_NE(negative->status().message().find("learning rate -0.01"), std::string::npos)
      << negative->status().message();
  EXPECT_EQ(PrimaryOf(0).Stats({0}).partitions(0).version(), 1u);
  EXPECT_EQ(RunStep(1, 2), ReferenceRun(job, 1, 2));
  ExpectReplicasEqual();
}

// A pushed learning rate replaces the schedule's, nothing else: pushing the
// rate the (constant) schedule has gives the same bits as pushing 0.
TEST_F(PsCoreTest, APushedLearningRateEqualToTheSchedulesChangesNoBit) {
  Job job;  // AdamW, lr 1e-2, constant
  Start(3, job);
  std::vector<float> params;
  for (uint64_t s = 1; s <= 4; ++s) params = RunStep(s, 2, {}, job.optimizer.adam().lr());
  const auto reference = ReferenceRun(job, 4, 2);
  ASSERT_EQ(params.size(), reference.size());
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
  ExpectReplicasEqual();
}

TEST_F(PsCoreTest, NonFiniteGradientSkipsTheStepOnEveryServer) {
  Job job;
  Start(3, job);
  auto p1 = RunStep(1, 2);
  // Step 2: one element of one partition is NaN.
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [b, e] = Range(p);
    for (uint32_t c = 0; c < 2; ++c) {
      auto g = Grad(2, c, b, e);
      if (p == 4 && c == 1) g[3] = std::nanf("");
      ASSERT_TRUE(Push(PrimaryOf(p), 1, 2, p, c, 2, g)->status().ok());
    }
  }
  auto p2 = PullAll(2);
  EXPECT_EQ(p1, p2);  // nothing changed anywhere
  for (uint64_t id : cluster_.Live()) {
    auto stats = cluster_[id].Stats({});
    for (const auto& s : stats.partitions()) {
      EXPECT_EQ(s.step(), 2u);
      EXPECT_EQ(s.version(), 2u);  // one applied update (step 1), step 2 skipped
    }
  }
  EXPECT_GE(PrimaryOf(4).Stats({}).skipped_steps(), 1u);
  // Training goes on.
  auto p3 = RunStep(3, 2);
  EXPECT_NE(p2, p3);
}

TEST_F(PsCoreTest, FailPolicyRefusesNonFinitePushes) {
  Job job;
  job.optimizer.set_non_finite_policy(v1::NON_FINITE_POLICY_FAIL);
  Start(2, job);
  auto [b, e] = Range(0);
  auto g = Grad(1, 0, b, e);
  g[0] = INFINITY;
  auto a = Push(PrimaryOf(0), 1, 1, 0, 0, 2, g);
  EXPECT_EQ(a->status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(a->status().message().find("NaN or Inf"), std::string::npos);
  EXPECT_EQ(PrimaryOf(0).Stats({0}).partitions(0).version(), 1u);
  // The refused push is as if never sent: the contributor sends a finite
  // gradient and the step completes as in a clean run.
  EXPECT_EQ(RunStep(1, 2), ReferenceRun(job, 1, 2));
  ExpectReplicasEqual();
}

TEST_F(PsCoreTest, GlobalNormClippingUsesEveryServersGradient) {
  Job job;
  job.optimizer.Clear();
  job.optimizer.mutable_sgd()->set_lr(1.0);
  job.optimizer.set_max_grad_norm(1.0);
  job.optimizer.set_reduction(v1::GRADIENT_REDUCTION_SUM);
  Start(3, job);
  // One contributor; the gradient is 1 everywhere: norm sqrt(params).
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [b, e] = Range(p);
    ASSERT_TRUE(Push(PrimaryOf(p), 1, 1, p, 0, 1, std::vector<float>(e - b, 1.0f))->status().ok());
  }
  auto params = PullAll(1);
  const double norm = std::sqrt(static_cast<double>(job.params));
  const double coef = 1.0 / (norm + 1e-6);
  for (size_t i = 0; i < params.size(); i += 97) {
    EXPECT_NEAR(params[i], job.initial[i] - coef, 1e-6) << i;
  }
}

TEST_F(PsCoreTest, PullWaitsForTheStepAndForTheBackup) {
  Job job;
  Start(2, job);
  auto [b, e] = Range(0);
  auto early = Pull(PrimaryOf(0), 1, 1, 0);
  EXPECT_FALSE(early->done);  // step 1 not applied yet
  cluster_.hold_replicas = true;
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [pb, pe] = Range(p);
    for (uint32_t c = 0; c < 2; ++c) ASSERT_TRUE(Push(PrimaryOf(p), 1, 1, p, c, 2, Grad(1, c, pb, pe))->status().ok());
  }
  // Applied on the primary, not yet on the backup: not acknowledged.
  EXPECT_EQ(PrimaryOf(0).Stats({0}).partitions(0).step(), 1u);
  EXPECT_FALSE(early->done);
  EXPECT_GT(PrimaryOf(0).ReplicationLag(), 0u);
  cluster_.Release();
  EXPECT_TRUE(early->done);
  EXPECT_TRUE(early->status().ok());
  EXPECT_EQ(PrimaryOf(0).ReplicationLag(), 0u);
  (void)b;
  (void)e;
}

// A membership change (a worker left) while an update is on its way to the
// backup: the old epoch's links die with it, the update or its ack is lost,
// and the same primary and backup go on in the new epoch. The primary sends
// the whole state again, so pulls of the step (which wait for the backup)
// are answered and the replicas stay equal.
TEST_F(PsCoreTest, AnUpdateLostWithTheOldEpochIsSentAgainAsTheWholeState) {
  Job job;
  Start(2, job);
  RunStep(1, 2);
  cluster_.hold_replicas = true;
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [b, e] = Range(p);
    for (uint32_t c = 0; c < 2; ++c) ASSERT_TRUE(Push(PrimaryOf(p), 1, 2, p, c, 2, Grad(2, c, b, e))->status().ok());
  }
  EXPECT_GT(PrimaryOf(0).ReplicationLag(), 0u);
  cluster_.held.clear();  // lost with the old epoch's links
  cluster_.hold_replicas = false;
  SetEpoch(2);
  auto pull = Pull(PrimaryOf(0), 2, 2, 0);
  EXPECT_TRUE(pull->done);
  EXPECT_TRUE(pull->status().ok()) << pull->status().ToString();
  EXPECT_EQ(PrimaryOf(0).ReplicationLag(), 0u);
  std::vector<float> params;
  for (uint64_t s = 3; s <= 4; ++s) params = RunStep(s, 2);
  ExpectReplicasEqual();
  const auto reference = ReferenceRun(job, 4, 2);
  ASSERT_EQ(params.size(), reference.size());
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
}

// A worker joins while step 2 is being decided: server 101 got 102's share,
// decided and applied step 2, but its own share died with the old links.
// The workers see step 2 applied on 101 and do not push it again; 102 must
// still apply it, from the same gradients.
TEST_F(PsCoreTest, AStepDecidedOnOneServerAsTheEpochChangesIsAppliedOnEvery) {
  Job job;
  Start(2, job);
  RunStep(1, 2);
  auto push_step_2 = [&](uint64_t server) {
    for (uint32_t p = 0; p < Partitions(); ++p) {
      if (map_.partitions(static_cast<int>(p)).primary_member_id() != server) continue;
      auto [b, e] = Range(p);
      for (uint32_t c = 0; c < 2; ++c) ASSERT_TRUE(Push(PrimaryOf(p), 1, 2, p, c, 2, Grad(2, c, b, e))->status().ok());
    }
  };
  push_step_2(kFirstServer + 1);  // 102 shares with 101
  cluster_.drop_shares = true;
  push_step_2(kFirstServer);  // 101 decides; its share is lost
  cluster_.drop_shares = false;
  EXPECT_EQ(cluster_[kFirstServer].Stats({0}).partitions(0).step(), 2u);
  EXPECT_EQ(cluster_[kFirstServer + 1].Stats({1}).partitions(0).step(), 1u);
  // The joiner makes the data-parallel size 3; step 2 keeps the mean over 2.
  SetEpoch(2, /*dp=*/3);
  std::vector<float> params = PullAll(2);
  ExpectReplicasEqual();
  auto reference = ReferenceRun(job, 2, 2);
  ASSERT_EQ(params.size(), reference.size());
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
  SetEpoch(3, /*dp=*/2);
  for (uint64_t s = 3; s <= 4; ++s) params = RunStep(s, 2);
  ExpectReplicasEqual();
  reference = ReferenceRun(job, 4, 2);
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
}

// Both servers shared step 2 but every share was lost: neither decided, the
// shares sent again on the new links decide it, and the workers' new pushes
// of step 2 are duplicates.
TEST_F(PsCoreTest, SharesLostWithTheOldLinksAreSentAgain) {
  Job job;
  Start(2, job);
  RunStep(1, 2);
  cluster_.drop_shares = true;
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [b, e] = Range(p);
    for (uint32_t c = 0; c < 2; ++c) ASSERT_TRUE(Push(PrimaryOf(p), 1, 2, p, c, 2, Grad(2, c, b, e))->status().ok());
  }
  cluster_.drop_shares = false;
  EXPECT_EQ(cluster_[kFirstServer].Stats({0}).partitions(0).step(), 1u);
  SetEpoch(2);
  const uint64_t duplicates_before = cluster_[kFirstServer].counters().duplicate_pushes.load();
  std::vector<float> params;
  for (uint64_t s = 2; s <= 4; ++s) params = RunStep(s, 2);
  EXPECT_GT(cluster_[kFirstServer].counters().duplicate_pushes.load(), duplicates_before);
  ExpectReplicasEqual();
  const auto reference = ReferenceRun(job, 4, 2);
  ASSERT_EQ(params.size(), reference.size());
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
}

// A step no server had finished aggregating is discarded with the old epoch
// and pushed again from scratch.
TEST_F(PsCoreTest, AStepNotYetSharedIsPushedAgainInTheNewEpoch) {
  Job job;
  Start(2, job);
  RunStep(1, 2);
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [b, e] = Range(p);
    ASSERT_TRUE(Push(PrimaryOf(p), 1, 2, p, 0, 2, Grad(2, 0, b, e))->status().ok());
  }
  SetEpoch(2);
  std::vector<float> params;
  for (uint64_t s = 2; s <= 3; ++s) params = RunStep(s, 2);
  const auto reference = ReferenceRun(job, 3, 2);
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
}

TEST_F(PsCoreTest, PrimaryDiesMidStepBackupTakesOverAndResultMatches) {
  Job job;
  Start(3, job);
  for (uint64_t s = 1; s <= 3; ++s) RunStep(s, 2);
  // Step 4: some pushes land, then server 101 dies before the step decides.
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [b, e] = Range(p);
    Push(PrimaryOf(p), 1, 4, p, 0, 2, Grad(4, 0, b, e));
  }
  const uint64_t dead = kFirstServer;
  cluster_.nodes[dead]->alive = false;
  map_ = Reassign(map_, cluster_.Live());
  SetEpoch(2);
  // The workers push step 4 again in the new epoch and go on.
  std::vector<float> params;
  for (uint64_t s = 4; s <= 8; ++s) params = RunStep(s, 2);
  const auto reference = ReferenceRun(job, 8, 2);
  ASSERT_EQ(params.size(), reference.size());
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
  // New backups got the state and stay in step.
  ExpectReplicasEqual();
}

TEST_F(PsCoreTest, ServerDiesAfterTheDecisionStepCompletesOnce) {
  Job job;
  Start(3, job);
  RunStep(1, 2);
  // Step 2 decides everywhere while replication is held, then 102 dies: its
  // backups have not applied step 2; the retry applies it there, and the
  // partitions that kept step 2 treat the new pushes as duplicates.
  cluster_.hold_replicas = true;
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [b, e] = Range(p);
    for (uint32_t c = 0; c < 2; ++c) Push(PrimaryOf(p), 1, 2, p, c, 2, Grad(2, c, b, e));
  }
  cluster_.nodes[kFirstServer + 1]->alive = false;
  cluster_.Release();  // replicas to live backups complete; those to 102 fail
  map_ = Reassign(map_, cluster_.Live());
  SetEpoch(2);
  std::vector<float> params;
  for (uint64_t s = 2; s <= 5; ++s) params = RunStep(s, 2);
  const auto reference = ReferenceRun(job, 5, 2);
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
  ExpectReplicasEqual();
}

// A learning rate per step through failures. Step 2 is decided everywhere
// while replication is held, then a server dies: its promoted backups have
// not applied the step and apply it from the pushes sent again, which carry
// the step's rate (the partitions that applied it count them as
// duplicates). The result equals a failure-free run with the same rates, bit
// for bit, and every backup equals its primary.
TEST_F(PsCoreTest, AStepPushedAgainAfterAFailureAppliesItsLearningRate) {
  Job job;
  Start(3, job);
  RunStep(1, 2, {}, LambdaLr(1));
  cluster_.hold_replicas = true;
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [b, e] = Range(p);
    for (uint32_t c = 0; c < 2; ++c) {
      Push(PrimaryOf(p), 1, 2, p, c, 2, Grad(2, c, b, e), v1::WIRE_DTYPE_FP32, LambdaLr(2));
    }
  }
  cluster_.nodes[kFirstServer + 1]->alive = false;
  cluster_.Release();
  map_ = Reassign(map_, cluster_.Live());
  SetEpoch(2);
  std::vector<float> params;
  for (uint64_t s = 2; s <= 8; ++s) params = RunStep(s, 2, {}, LambdaLr(s));
  const auto reference = ReferenceRun(job, 8, 2, LambdaLr);
  ASSERT_EQ(params.size(), reference.size());
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
  ExpectReplicasEqual();
  // The rates mattered: the schedule's alone gives other parameters.
  EXPECT_NE(std::memcmp(params.data(), ReferenceRun(job, 8, 2).data(), params.size() * sizeof(float)), 0);
}

// A step decided on one server as the epoch changes is applied on the
// others from the aggregation they kept, with the rate its pushes carried.
TEST_F(PsCoreTest, AStepDecidedFromKeptPushesAppliesTheirLearningRate) {
  Job job;
  Start(2, job);
  RunStep(1, 2, {}, LambdaLr(1));
  auto push_step_2 = [&](uint64_t server) {
    for (uint32_t p = 0; p < Partitions(); ++p) {
      if (map_.partitions(static_cast<int>(p)).primary_member_id() != server) continue;
      auto [b, e] = Range(p);
      for (uint32_t c = 0; c < 2; ++c) {
        ASSERT_TRUE(
            Push(PrimaryOf(p), 1, 2, p, c, 2, Grad(2, c, b, e), v1::WIRE_DTYPE_FP32, LambdaLr(2))->status().ok());
      }
    }
  };
  push_step_2(kFirstServer + 1);  // 102 shares with 101
  cluster_.drop_shares = true;
  push_step_2(kFirstServer);  // 101 decides; its share is lost
  cluster_.drop_shares = false;
  EXPECT_EQ(cluster_[kFirstServer + 1].Stats({1}).partitions(0).step(), 1u);
  SetEpoch(2, /*dp=*/3);
  std::vector<float> params = PullAll(2);
  ExpectReplicasEqual();
  SetEpoch(3, /*dp=*/2);
  for (uint64_t s = 3; s <= 4; ++s) params = RunStep(s, 2, {}, LambdaLr(s));
  ExpectReplicasEqual();
  const auto reference = ReferenceRun(job, 4, 2, LambdaLr);
  ASSERT_EQ(params.size(), reference.size());
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
}

TEST_F(PsCoreTest, AServerThatJoinsLaterGetsTheJobAndTheStateOfItsBackups) {
  Job job;
  Start(3, job);
  for (uint64_t s = 1; s <= 3; ++s) RunStep(s, 2);
  // Server 104 was never initialised; the new map makes it the backup of
  // every third partition.
  const uint64_t joined = kFirstServer + 3;
  cluster_.Add(joined);
  map_.set_version(map_.version() + 1);
  for (auto& p : *map_.mutable_partitions()) {
    if (p.id() % 3 == 0) p.set_backup_member_id(joined);
  }
  SetEpoch(2);
  EXPECT_TRUE(cluster_[joined].configured());
  auto stats = cluster_[joined].Stats({});
  ASSERT_GT(stats.partitions_size(), 0);
  for (const auto& p : stats.partitions()) {
    EXPECT_EQ(p.role(), v1::REPLICA_ROLE_BACKUP);
    EXPECT_EQ(p.step(), 3u);     // the transferred state
    EXPECT_EQ(p.version(), 4u);  // three updates
  }
  std::vector<float> params;
  for (uint64_t s = 4; s <= 6; ++s) params = RunStep(s, 2);
  ExpectReplicasEqual();
  const auto reference = ReferenceRun(job, 6, 2);
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
  // Its state came by transfer: it was never initialised.
  EXPECT_GT(cluster_[joined].counters().transfers_received.load(), 0u);
}

TEST_F(PsCoreTest, ABackupThatDivergedIsSentTheWholeStateAgain) {
  Job job;
  Start(3, job);
  RunStep(1, 2);
  RunStep(2, 2);
  // Partition 0's backup loses its state (as if restored from something
  // else): the next update does not follow its version.
  auto [b, e] = Range(0);
  PartitionState stale;
  stale.id = 0;
  stale.begin = b;
  stale.end = e;
  stale.version = 1;
  stale.step = 0;
  stale.weights.assign(e - b, 0.0f);
  ASSERT_TRUE(BackupOf(0)->Replace({stale}, false).ok());
  const uint64_t sent = PrimaryOf(0).counters().transfers_sent.load();
  std::vector<float> params;
  for (uint64_t s = 3; s <= 4; ++s) params = RunStep(s, 2);
  EXPECT_GT(PrimaryOf(0).counters().transfers_sent.load(), sent);
  ExpectReplicasEqual();
  const auto reference = ReferenceRun(job, 4, 2);
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
}

TEST_F(PsCoreTest, AsyncAppliesEachPushAndIgnoresDuplicates) {
  Job job;
  job.consistency.set_mode(v1::CONSISTENCY_MODE_ASYNC);
  Start(2, job);
  auto [b, e] = Range(0);
  auto a = Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e));
  ASSERT_TRUE(a->done);
  ASSERT_TRUE(a->status().ok());
  EXPECT_EQ(PrimaryOf(0).Stats({0}).partitions(0).version(), 2u);
  auto dup = Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e));
  EXPECT_NE(dup->header.flags & ps::kFlagDuplicate, 0);
  EXPECT_EQ(PrimaryOf(0).Stats({0}).partitions(0).version(), 2u);
  // Contributor 0 runs ahead while contributor 1 has pushed nothing.
  ASSERT_TRUE(Push(PrimaryOf(0), 1, 2, 0, 0, 2, Grad(2, 0, b, e))->status().ok());
  EXPECT_EQ(PrimaryOf(0).Stats({0}).partitions(0).version(), 3u);
  auto pulled = Pull(PrimaryOf(0), 1, 0, 0);
  EXPECT_TRUE(pulled->done);
  ExpectReplicasEqual();
  // Clipping needs whole steps.
  Job clip;
  clip.consistency.set_mode(v1::CONSISTENCY_MODE_ASYNC);
  clip.optimizer.set_max_grad_norm(1.0);
  Cluster other;
  other.Add(kFirstServer);
  other[kFirstServer].SetEpoch(1, kFirstServer, MakeMap(clip.params, clip.partition, {kFirstServer}), 1, 0);
  auto refused = other[kFirstServer].Initialize(clip.Init(1));
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("max_grad_norm"), std::string::npos);
}

// Asynchronous mode: a push or pull naming another contributor count and a
// non-finite push refused by the FAIL policy leave the partition as it was:
// weights, version, and every contributor's clock (so duplicates stay
// duplicates and a refused step can be pushed again).
TEST_F(PsCoreTest, AsyncBadPushesLeaveWeightsAndClocksAsTheyWere) {
  Job job;
  job.consistency.set_mode(v1::CONSISTENCY_MODE_ASYNC);
  job.optimizer.set_non_finite_policy(v1::NON_FINITE_POLICY_FAIL);
  Start(2, job);
  auto [b, e] = Range(0);
  // A refused first push (non-finite, naming 3 contributors) fixes nothing:
  // the epoch's pushes with 2 contributors are taken.
  auto first = Grad(1, 0, b, e);
  first[0] = NAN;
  EXPECT_EQ(Push(PrimaryOf(0), 1, 1, 0, 0, 3, first)->status().code(), StatusCode::kInvalidArgument);
  auto version = [&] { return PrimaryOf(0).Stats({0}).partitions(0).version(); };
  auto weights = [&] {
    auto a = Pull(PrimaryOf(0), 1, 0, 0);
    EXPECT_TRUE(a->done);
    return a->floats();
  };
  ASSERT_TRUE(Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e))->status().ok());
  ASSERT_EQ(version(), 2u);
  const auto before = weights();
  // Another contributor count: refused, named.
  auto other_count = Push(PrimaryOf(0), 1, 2, 0, 0, 3, Grad(2, 0, b, e));
  EXPECT_EQ(other_count->status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(other_count->status().message().find("contributors: this push says 3"), std::string::npos)
      << other_count->status().message();
  auto other_pull = Pull(PrimaryOf(0), 1, 0, 0, 0, 3);
  ASSERT_TRUE(other_pull->done);
  EXPECT_EQ(other_pull->status().code(), StatusCode::kInvalidArgument);
  // The clocks were not restarted: step 1 of contributor 0 is still a duplicate.
  auto dup = Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e));
  ASSERT_TRUE(dup->status().ok());
  EXPECT_NE(dup->header.flags & ps::kFlagDuplicate, 0);
  // Contributor 1 (nothing pushed yet) sends a non-finite step 2: refused.
  auto g = Grad(2, 1, b, e);
  g[3] = NAN;
  auto bad = Push(PrimaryOf(0), 1, 2, 0, 1, 2, g);
  EXPECT_EQ(bad->status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(version(), 2u);
  EXPECT_EQ(weights(), before);
  // Its clock is where it was (0), so its step 1 is applied, not a duplicate.
  auto late = Push(PrimaryOf(0), 1, 1, 0, 1, 2, Grad(1, 1, b, e));
  ASSERT_TRUE(late->status().ok());
  EXPECT_EQ(late->header.flags & ps::kFlagDuplicate, 0);
  EXPECT_EQ(version(), 3u);
  EXPECT_NE(weights(), before);
  ExpectReplicasEqual();
}

// Asynchronous mode applies each push on arrival with the learning rate it
// carries (0: the schedule's at the partition's update count), whatever the
// other pushes of its step carried: the weights follow the double-precision
// reference of those updates in arrival order, and every backup (which
// replays each update with the rate of its kReplica frame) equals its
// primary. A negative or NaN rate is refused and leaves the weights and the
// pusher's clock as they were.
TEST_F(PsCoreTest, AsyncAppliesEachPushWithItsOwnLearningRate) {
  Job job;
  job.consistency.set_mode(v1::CONSISTENCY_MODE_ASYNC);
  Start(2, job);
  auto made = optim::Optimizer::Create(job.Init(1).optimizer());
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  const optim::Optimizer& o = *made;
  const uint64_t split = job.params - 500;  // tensor "w", then "b" (group no_decay)
  auto reference = [&](uint64_t b, uint64_t e) {
    return optim::Reference{std::vector<double>(job.initial.begin() + b, job.initial.begin() + e),
                            std::vector<double>(e - b, 0), std::vector<double>(e - b, 0)};
  };
  optim::Reference w = reference(0, split);
  optim::Reference bias = reference(split, job.params);
  auto gradient = [&](uint64_t step, uint32_t c) {
    std::vector<float> g;
    for (uint32_t p = 0; p < Partitions(); ++p) {
      auto [b, e] = Range(p);
      const auto part = Grad(step, c, b, e);
      g.insert(g.end(), part.begin(), part.end());
    }
    return g;
  };
  struct Arrival {
    uint64_t step;
    uint32_t contributor;
    double lr;
  };
  const Arrival arrivals[] = {{1, 0, 0.03}, {1, 1, 0.01}, {2, 1, 0}, {2, 0, 0.02}, {3, 0, 0.005}};
  uint64_t updates = 0;
  for (const Arrival& a : arrivals) {
    for (uint32_t p = 0; p < Partitions(); ++p) {
      auto [b, e] = Range(p);
      auto answer = Push(PrimaryOf(p), 1, a.step, p, a.contributor, 2, Grad(a.step, a.contributor, b, e),
                         v1::WIRE_DTYPE_FP32, a.lr);
      ASSERT_TRUE(AnsweredOk(answer));
      EXPECT_FALSE(Duplicate(answer));
    }
    const auto g = gradient(a.step, a.contributor);
    w.Step(o, std::vector<float>(g.begin(), g.begin() + static_cast<ptrdiff_t>(split)), updates, o.Group(""), 0.5,
           a.lr);
    bias.Step(o, std::vector<float>(g.begin() + static_cast<ptrdiff_t>(split), g.end()), updates, o.Group("no_decay"),
              0.5, a.lr);
    ++updates;
  }
  auto weights = [&] {
    std::vector<float> all;
    for (uint32_t p = 0; p < Partitions(); ++p) {
      auto a = Pull(PrimaryOf(p), 1, 0, p);
      EXPECT_TRUE(a->done);
      auto v = a->floats();
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  };
  const auto params = weights();
  ASSERT_EQ(params.size(), job.params);
  double max_err = 0;
  for (uint64_t i = 0; i < job.params; ++i) {
    const double want = i < split ? w.w[i] : bias.w[i - split];
    max_err = std::max(max_err, std::fabs(params[i] - want) / std::max(1.0, std::fabs(want)));
  }
  EXPECT_LT(max_err, 1e-5);
  ExpectReplicasEqual();
  // Refused rates change nothing: contributor 1's step 3 is still new.
  auto [b, e] = Range(0);
  for (double lr : {-1.0, std::numeric_limits<double>::quiet_NaN()}) {
    auto refused = Push(PrimaryOf(0), 1, 3, 0, 1, 2, Grad(3, 1, b, e), v1::WIRE_DTYPE_FP32, lr);
    ASSERT_TRUE(refused->done);
    EXPECT_EQ(refused->status().code(), StatusCode::kInvalidArgument) << refused->status().ToString();
  }
  EXPECT_EQ(weights(), params);
  auto taken = Push(PrimaryOf(0), 1, 3, 0, 1, 2, Grad(3, 1, b, e), v1::WIRE_DTYPE_FP32, 0.01);
  ASSERT_TRUE(AnsweredOk(taken));
  EXPECT_FALSE(Duplicate(taken));
  EXPECT_EQ(PrimaryOf(0).Stats({0}).partitions(0).version(), updates + 2);
  ExpectReplicasEqual();
}

TEST_F(PsCoreTest, BoundedStalenessHoldsTheFastContributor) {
  Job job;
  job.consistency.set_mode(v1::CONSISTENCY_MODE_BOUNDED_STALENESS);
  job.consistency.set_staleness_bound(1);
  Start(1, job);
  auto [b, e] = Range(0);
  // Contributor 0 pushes steps 1 and 2; contributor 1 nothing yet.
  ASSERT_TRUE(Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e))->status().ok());
  ASSERT_TRUE(Push(PrimaryOf(0), 1, 2, 0, 0, 2, Grad(2, 0, b, e))->status().ok());
  // Pushing step 3 would put it 3 steps ahead of the slowest (0) with bound 1.
  auto too_far = Push(PrimaryOf(0), 1, 3, 0, 0, 2, Grad(3, 0, b, e));
  EXPECT_EQ(too_far->status().code(), StatusCode::kFailedPrecondition);
  // A pull to compute step 3 waits: the slowest has pushed 0 steps.
  auto wait = Pull(PrimaryOf(0), 1, 3, 0, 0, 2);
  EXPECT_FALSE(wait->done);
  ASSERT_TRUE(Push(PrimaryOf(0), 1, 1, 0, 1, 2, Grad(1, 1, b, e))->status().ok());
  EXPECT_TRUE(wait->done);
  EXPECT_TRUE(wait->status().ok());
}

// A pull that names its contributor and step s declares that the puller
// computes step s next: its clock moves up to s - 1. Workers that go on
// from a later step than the epoch's start_step after a membership change
// (the highest any of them completed) so start the bound from there: their
// pulls wait for one another, then their pushes of the steps after are
// applied and those before are duplicates.
TEST_F(PsCoreTest, BoundedStalenessPullsDeclareThePullersStep) {
  Job job;
  job.consistency.set_mode(v1::CONSISTENCY_MODE_BOUNDED_STALENESS);
  job.consistency.set_staleness_bound(1);
  Start(1, job);  // start_step 0
  auto [b, e] = Range(0);
  auto push = [&](uint64_t step, uint32_t contributor) {
    return Push(PrimaryOf(0), 1, step, 0, contributor, 2, Grad(step, contributor, b, e));
  };
  auto version = [&] { return PrimaryOf(0).Stats({0}).partitions(0).version(); };
  // A refused first pull (a contributor outside its count) starts no clocks:
  // the count of 2 below is still free to be taken.
  auto stranger = Pull(PrimaryOf(0), 1, 10, 0, 3, 3);
  ASSERT_TRUE(stranger->done);
  EXPECT_EQ(stranger->status().code(), StatusCode::kInvalidArgument);
  // Both contributors go on after step 9: the first pull waits for the other.
  auto first = Pull(PrimaryOf(0), 1, 10, 0, 0, 2);
  EXPECT_FALSE(first->done);
  auto second = Pull(PrimaryOf(0), 1, 10, 0, 1, 2);
  EXPECT_TRUE(AnsweredOk(first));
  EXPECT_TRUE(AnsweredOk(second));
  EXPECT_EQ(version(), 1u);
  auto old = push(9, 0);
  ASSERT_TRUE(AnsweredOk(old));
  EXPECT_TRUE(Duplicate(old));
  EXPECT_EQ(version(), 1u);
  // Steps 10 and 11 of contributor 0 are within the bound of 1 from 9.
  ASSERT_TRUE(AnsweredOk(push(10, 0)));
  ASSERT_TRUE(AnsweredOk(push(11, 0)));
  EXPECT_EQ(version(), 3u);
  EXPECT_EQ(push(12, 0)->status().code(), StatusCode::kFailedPrecondition);
  // A pull never moves a clock back.
  EXPECT_TRUE(AnsweredOk(Pull(PrimaryOf(0), 1, 3, 0, 0, 2)));
  EXPECT_EQ(push(12, 0)->status().code(), StatusCode::kFailedPrecondition);
  // Pulls of step 0, or without contributors, move no clock: contributor 1
  // is still at 9, so its step 10 is applied, not a duplicate.
  EXPECT_TRUE(AnsweredOk(Pull(PrimaryOf(0), 1, 0, 0, 1, 2)));
  EXPECT_TRUE(AnsweredOk(Pull(PrimaryOf(0), 1, 11, 0)));
  auto ten = push(10, 1);
  ASSERT_TRUE(AnsweredOk(ten));
  EXPECT_FALSE(Duplicate(ten));
  EXPECT_EQ(version(), 4u);
  ExpectReplicasEqual();
}

// Asynchronous mode (no bound): such a pull is answered at once and still
// moves its contributor's clock.
TEST_F(PsCoreTest, AsyncPullsMoveTheirContributorsClock) {
  Job async;
  async.consistency.set_mode(v1::CONSISTENCY_MODE_ASYNC);
  Start(2, async);
  auto [b, e] = Range(0);
  EXPECT_TRUE(AnsweredOk(Pull(PrimaryOf(0), 1, 10, 0, 0, 2)));
  auto dup = Push(PrimaryOf(0), 1, 9, 0, 0, 2, Grad(9, 0, b, e));
  ASSERT_TRUE(AnsweredOk(dup));
  EXPECT_TRUE(Duplicate(dup));
  auto applied = Push(PrimaryOf(0), 1, 10, 0, 0, 2, Grad(10, 0, b, e));
  ASSERT_TRUE(AnsweredOk(applied));
  EXPECT_FALSE(Duplicate(applied));
  EXPECT_EQ(PrimaryOf(0).Stats({0}).partitions(0).version(), 2u);
  ExpectReplicasEqual();
}

TEST_F(PsCoreTest, NewEpochAbortsWaitingPullsAndRefusesOldPushes) {
  Job job;
  Start(2, job);
  auto waiting = Pull(PrimaryOf(0), 1, 1, 0);
  EXPECT_FALSE(waiting->done);
  SetEpoch(2);
  ASSERT_TRUE(waiting->done);
  EXPECT_EQ(waiting->status().code(), StatusCode::kAborted);
  EXPECT_NE(waiting->status().message().find("superseded"), std::string::npos);
  auto [b, e] = Range(0);
  auto old = Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e));
  EXPECT_EQ(old->status().code(), StatusCode::kFailedPrecondition);
}

TEST_F(PsCoreTest, InitializationHappensOnceAndChecksItsInput) {
  Job job;
  Start(2, job);
  // Again with other values: ignored, said so.
  Job other = job;
  for (auto& x : other.initial) x += 1;
  auto again = cluster_[kFirstServer].Initialize(other.Init(1));
  ASSERT_TRUE(again.ok());
  for (const auto& p : again->partitions()) EXPECT_FALSE(p.newly_initialized());
  auto params = PullAll(0);
  EXPECT_EQ(params, job.initial);
  // From a checkpoint, partitions that hold state are not read again: a
  // checkpoint that is gone by now does not matter to them.
  auto from_gone = job.Init(1);
  from_gone.set_checkpoint_path("/nonexistent/tandem-checkpoint");
  auto kept = cluster_[kFirstServer].Initialize(from_gone);
  ASSERT_TRUE(kept.ok()) << kept.status().ToString();
  EXPECT_GT(kept->partitions_size(), 0);
  for (const auto& p : kept->partitions()) {
    EXPECT_FALSE(p.newly_initialized());
    EXPECT_EQ(p.version(), 1u);
  }
  // A different tensor table, optimizer, or incomplete values.
  auto bad = job.Init(1);
  bad.mutable_tensors(0)->set_name("renamed");
  EXPECT_EQ(cluster_[kFirstServer].Initialize(bad).status().code(), StatusCode::kFailedPrecondition);
  bad = job.Init(1);
  bad.mutable_optimizer()->mutable_adam()->set_lr(5);
  EXPECT_EQ(cluster_[kFirstServer].Initialize(bad).status().code(), StatusCode::kFailedPrecondition);
  Cluster fresh;
  fresh.Add(kFirstServer);
  fresh[kFirstServer].SetEpoch(1, kFirstServer, MakeMap(job.params, job.partition, {kFirstServer}), 1, 0);
  bad = job.Init(1);
  bad.mutable_values()->mutable_chunks(0)->mutable_range()->set_end(job.params - 10);
  bad.mutable_values()->mutable_chunks(0)->mutable_data()->resize((job.params - 10) * 4);
  auto incomplete = fresh[kFirstServer].Initialize(bad);
  EXPECT_EQ(incomplete.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(incomplete.status().message().find("not fully covered"), std::string::npos)
      << incomplete.status().message();
  bad = job.Init(1);
  bad.mutable_optimizer()->mutable_adam()->set_beta1(1.5);
  auto invalid = fresh[kFirstServer].Initialize(bad);
  EXPECT_EQ(invalid.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(invalid.status().message().find("beta1"), std::string::npos);
}

// Gradients pushed as fp32, bf16 and fp16 in one step are widened exactly
// and summed; a bf16 pull is the weights rounded to nearest even (as
// EncodeWire, which WireTest checks bit by bit); an fp16 pull is refused.
// Values are multiples of 1/16 of at most 8 significant bits, exact in
// every wire dtype, so the result is exact: SGD at lr 1 with a plain sum.
TEST_F(PsCoreTest, WireDTypesAreWidenedSummedAndNarrowedExactly) {
  Job job;
  job.optimizer.Clear();
  job.optimizer.mutable_sgd()->set_lr(1.0);
  job.optimizer.set_reduction(v1::GRADIENT_REDUCTION_SUM);
  for (size_t i = 0; i < job.initial.size(); ++i)
    job.initial[i] = static_cast<float>(static_cast<int>(i % 65) - 32) / 8;
  Start(2, job);
  const v1::WireDType dtypes[] = {v1::WIRE_DTYPE_FP32, v1::WIRE_DTYPE_BF16, v1::WIRE_DTYPE_FP16};
  auto grad = [](uint32_t c, size_t i) {
    return static_cast<float>(static_cast<int>((i * 7 + c * 13) % 33) - 16) / 16;
  };
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [b, e] = Range(p);
    for (uint32_t c = 0; c < 3; ++c) {
      std::vector<float> g(e - b);
      for (size_t i = 0; i < g.size(); ++i) g[i] = grad(c, b + i);
      std::vector<char> wire(optim::WireBytes(dtypes[c], g.size()));
      optim::EncodeWire(wire.data(), g.data(), dtypes[c], g.size());
      auto a = std::make_shared<Answer>();
      PrimaryOf(p).Push(1, PushHeader(epoch_, 1, p, c, 3, wire.size(), dtypes[c]), wire.data(), Into(a));
      ASSERT_TRUE(a->done);
      ASSERT_TRUE(a->status().ok()) << a->status().ToString();
    }
  }
  std::vector<float> want(job.params);
  for (size_t i = 0; i < want.size(); ++i) want[i] = job.initial[i] - (grad(0, i) + grad(1, i) + grad(2, i));
  EXPECT_EQ(PullAll(1), want);
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [b, e] = Range(p);
    ps::Frame h = PullHeader(epoch_, 1, p);
    h.dtype = v1::WIRE_DTYPE_BF16;
    auto bf16 = std::make_shared<Answer>();
    PrimaryOf(p).Pull(1, h, Into(bf16));
    ASSERT_TRUE(bf16->done);
    ASSERT_TRUE(bf16->status().ok()) << bf16->status().ToString();
    std::vector<char> expected(optim::WireBytes(v1::WIRE_DTYPE_BF16, e - b));
    optim::EncodeWire(expected.data(), want.data() + b, v1::WIRE_DTYPE_BF16, e - b);
    EXPECT_EQ(bf16->payload, expected) << "partition " << p;
    h.dtype = v1::WIRE_DTYPE_FP16;
    auto fp16 = std::make_shared<Answer>();
    PrimaryOf(p).Pull(1, h, Into(fp16));
    ASSERT_TRUE(fp16->done);
    EXPECT_EQ(fp16->status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(fp16->status().message().find("pulls return FP32 or BF16"), std::string::npos);
  }
  ExpectReplicasEqual();
}

// The checksums that ExpectReplicasEqual compares tell copies apart: two
// servers given different initial values (which PsClient never does: a
// backup only gets the values its primary kept) report different
// checksums exactly for the partitions whose values differ; stats without
// checksums carry none.
TEST_F(PsCoreTest, StateChecksumsTellDivergedReplicasApart) {
  Job job;
  cluster_.Add(kFirstServer);
  cluster_.Add(kFirstServer + 1);
  map_ = MakeMap(job.params, job.partition, cluster_.Live());
  SetEpoch(1);
  Job other = job;
  other.initial[0] += 1;
  other.initial[job.params - 1] += 1;
  ASSERT_TRUE(cluster_[kFirstServer].Initialize(job.Init(1)).ok());
  ASSERT_TRUE(cluster_[kFirstServer + 1].Initialize(other.Init(1)).ok());
  auto first = cluster_[kFirstServer].Stats({}, /*checksums=*/true);
  auto second = cluster_[kFirstServer + 1].Stats({}, /*checksums=*/true);
  ASSERT_EQ(first.partitions_size(), static_cast<int>(Partitions()));
  ASSERT_EQ(second.partitions_size(), static_cast<int>(Partitions()));
  int differ = 0;
  for (int i = 0; i < first.partitions_size(); ++i) {
    const auto& a = first.partitions(i);
    const auto& b = second.partitions(i);
    ASSERT_EQ(a.partition_id(), b.partition_id());
    ASSERT_TRUE(a.has_state_crc32c());
    EXPECT_FALSE(cluster_[kFirstServer].Stats({a.partition_id()}).partitions(0).has_state_crc32c());
    const auto [begin, end] = Range(a.partition_id());
    const bool changed = begin == 0 || end == job.params;
    EXPECT_EQ(a.state_crc32c() != b.state_crc32c(), changed) << "partition " << a.partition_id();
    differ += a.state_crc32c() != b.state_crc32c() ? 1 : 0;
  }
  EXPECT_EQ(differ, 2);
}

// Each update rule through the store (three servers with backups, two
// contributors, two tensor groups with their own hyperparameters, a warmup
// then a decay) against PyTorch's rules in double precision
// (tests/optimizer_reference.h): weights equal within float rounding after
// sixty steps, and every backup equals its primary.
struct StoreRuleCase {
  std::string name;
  v1::OptimizerConfig config;
};

void PrintTo(const StoreRuleCase& c, std::ostream* os) {
  *os << c.name;
}

class StoreMatchesReference : public PsCoreTest, public ::testing::WithParamInterface<StoreRuleCase> {
 protected:
  // Sixty steps whose pushes carry lr(step) (null: 0, the schedule's).
  void RunAgainstReference(const StepLr& lr) {
    constexpr uint64_t kSteps = 60;
    Job job;
    job.optimizer = GetParam().config;
    Start(3, job);
    auto made = optim::Optimizer::Create(job.optimizer);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    const optim::Optimizer& o = *made;
    const uint64_t split = job.params - 500;  // tensor "w", then "b" (group no_decay)
    auto reference = [&](uint64_t b, uint64_t e) {
      return optim::Reference{std::vector<double>(job.initial.begin() + b, job.initial.begin() + e),
                              std::vector<double>(e - b, 0), std::vector<double>(e - b, 0)};
    };
    optim::Reference w = reference(0, split);
    optim::Reference bias = reference(split, job.params);
    std::vector<float> params;
    for (uint64_t step = 1; step <= kSteps; ++step) {
      const double step_lr = lr ? lr(step) : 0;
      params = RunStep(step, 2, {}, step_lr);
      // The step's gradient as the store sums it: contributor 0's, plus 1's.
      std::vector<float> g;
      for (uint32_t p = 0; p < Partitions(); ++p) {
        auto [b, e] = Range(p);
        auto g0 = Grad(step, 0, b, e);
        const auto g1 = Grad(step, 1, b, e);
        for (size_t i = 0; i < g0.size(); ++i) g0[i] += g1[i];
        g.insert(g.end(), g0.begin(), g0.end());
      }
      w.Step(o, std::vector<float>(g.begin(), g.begin() + static_cast<ptrdiff_t>(split)), step - 1, o.Group(""), 0.5,
             step_lr);
      bias.Step(o, std::vector<float>(g.begin() + static_cast<ptrdiff_t>(split), g.end()), step - 1,
                o.Group("no_decay"), 0.5, step_lr);
    }
    double max_err = 0;
    double moved = 0;
    for (uint64_t i = 0; i < job.params; ++i) {
      const double want = i < split ? w.w[i] : bias.w[i - split];
      ASSERT_TRUE(std::isfinite(params[i])) << i;
      max_err = std::max(max_err, std::fabs(params[i] - want) / std::max(1.0, std::fabs(want)));
      moved += std::fabs(params[i] - job.initial[i]);
    }
    EXPECT_LT(max_err, 2e-5) << GetParam().name;
    EXPECT_GT(moved / static_cast<double>(job.params), 0.01)
        << "the weights hardly moved: the test would prove nothing";
    ExpectReplicasEqual();
  }
};

TEST_P(StoreMatchesReference, SixtyStepsMatchADoublePrecisionReference) {
  RunAgainstReference(nullptr);
}

// The same with a learning rate pushed for every step (LambdaLr: a PyTorch
// LR scheduler's sequence, every seventh step left to the schedule): the
// store applies the pushed rates, times the group's lr_scale, and the
// backups, which replay each update with its rate, stay bit-identical.
TEST_P(StoreMatchesReference, APushedLearningRatePerStepReplacesTheSchedule) {
  RunAgainstReference(LambdaLr);
}

std::vector<StoreRuleCase> StoreRuleCases() {
  auto schedule = [](v1::OptimizerConfig& c, v1::LrScheduleKind kind) {
    c.mutable_lr_schedule()->set_kind(kind);
    c.mutable_lr_schedule()->set_warmup_steps(5);
    c.mutable_lr_schedule()->set_total_steps(60);
    c.mutable_lr_schedule()->set_min_lr_ratio(0.1);
  };
  std::vector<StoreRuleCase> cases;
  {
    v1::OptimizerConfig c;
    c.mutable_sgd()->set_lr(0.05);
    c.mutable_sgd()->set_momentum(0.9);
    c.mutable_sgd()->set_nesterov(true);
    c.mutable_sgd()->set_weight_decay(0.01);
    schedule(c, v1::LR_SCHEDULE_KIND_COSINE);
    (*c.mutable_group_overrides())["no_decay"].set_weight_decay(0);
    cases.push_back({"SgdNesterovWeightDecayCosine", c});
  }
  {
    v1::OptimizerConfig c;
    c.mutable_adam()->set_lr(1e-2);
    c.mutable_adam()->set_weight_decay(0.01);  // L2, added to the gradient
    schedule(c, v1::LR_SCHEDULE_KIND_LINEAR);
    (*c.mutable_group_overrides())["no_decay"].set_weight_decay(0);
    cases.push_back({"AdamL2Linear", c});
  }
  {
    v1::OptimizerConfig c;
    c.mutable_adam()->set_lr(1e-2);
    c.mutable_adam()->set_weight_decay(0.1);
    c.mutable_adam()->set_decoupled_weight_decay(true);
    schedule(c, v1::LR_SCHEDULE_KIND_COSINE);
    auto& group = (*c.mutable_group_overrides())["no_decay"];
    group.set_weight_decay(0);
    group.set_lr_scale(0.5);
    cases.push_back({"AdamWGroupsCosine", c});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Rules, StoreMatchesReference, ::testing::ValuesIn(StoreRuleCases()),
                         [](const auto& rule) { return rule.param.name; });

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
}  // namespace tandem::server
