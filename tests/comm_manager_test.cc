// CommManager: the groups of the worker mesh (pure derivation, checked against
// the coordinator's own placement), building a member's communicators, and an
// epoch change aborting operations in flight with the "superseded" message.
// CoordinatorRendezvous and MemberSession's collective progress against an
// in-process coordinator over gRPC on loopback.
#include "worker/comm/comm_manager.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <google/protobuf/util/time_util.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <prometheus/registry.h>

#include "common/clock.h"
#include "common/coordinator_rendezvous.h"
#include "common/member_session.h"
#include "common/mutex.h"
#include "coordinator/assignment.h"
#include "coordinator/coordinator_core.h"
#include "coordinator/coordinator_service.h"
#include "coordinator/store.h"

namespace tandem::comm {
namespace {

using google::protobuf::util::TimeUtil;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------
// Epochs
// ---------------------------------------------------------------------------

// An epoch of dp x tp x pp workers, `per_node` to a node, laid out as the
// coordinator does (tp fastest, then dp, then pp), member ids 100 + rank,
// listed in reverse order, plus one server.
v1::MembershipEpoch MakeEpoch(uint64_t number, uint32_t dp, uint32_t tp, uint32_t pp, uint32_t per_node) {
  v1::MembershipEpoch e;
  e.set_epoch(number);
  e.set_job_id("j");
  e.mutable_mesh()->set_dp(dp);
  e.mutable_mesh()->set_tp(tp);
  e.mutable_mesh()->set_pp(pp);
  const uint32_t n = dp * tp * pp;
  e.set_worker_count(n);
  e.set_server_count(1);
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t r = n - 1 - i;
    auto* p = e.add_peers();
    p->set_member_id(100 + r);
    p->set_role(v1::ROLE_WORKER);
    p->mutable_node()->set_hostname(fmt::format("n{}", r / per_node));
    auto* a = p->mutable_rank();
    a->set_global_rank(r);
    a->set_node_rank(r / per_node);
    a->set_local_rank(r % per_node);
    a->set_world_size(n);
    a->set_local_world_size(per_node);
    a->set_node_count(n / per_node);
    a->mutable_mesh()->set_tp(r % tp);
    a->mutable_mesh()->set_dp(r / tp % dp);
    a->mutable_mesh()->set_pp(r / (tp * dp));
  }
  auto* server = e.add_peers();
  server->set_member_id(999);
  server->set_role(v1::ROLE_SERVER);
  server->mutable_rank()->set_world_size(1);
  server->mutable_rank()->set_local_world_size(1);
  return e;
}

std::map<std::string, std::vector<int>> ByName(const std::vector<Group>& groups) {
  std::map<std::string, std::vector<int>> out;
  for (const auto& g : groups) {
    EXPECT_EQ(g.global_ranks.size(), g.member_ids.size());
    for (size_t i = 0; i < g.global_ranks.size(); ++i) {
      EXPECT_EQ(g.member_ids[i], 100u + static_cast<uint64_t>(g.global_ranks[i])) << g.name;
    }
    EXPECT_TRUE(out.emplace(g.name, g.global_ranks).second) << "duplicate group " << g.name;
  }
  return out;
}

TEST(DeriveGroupsTest, TwoByTwoByTwoMeshOverTwoNodes) {
  const auto epoch = MakeEpoch(3, 2, 2, 2, 4);
  auto groups = DeriveGroups(epoch);
  ASSERT_TRUE(groups.ok()) << groups.status().ToString();
  const std::map<std::string, std::vector<int>> want = {
      {"world", {0, 1, 2, 3, 4, 5, 6, 7}},
      {"node/0", {0, 1, 2, 3}},
      {"node/1", {4, 5, 6, 7}},
      // node-dp/<(node * pp_size + pp) * tp_size + tp>: one node, equal tp
      // and pp, ordered by dp.
      {"node-dp/0", {0, 2}},
      {"node-dp/1", {1, 3}},
      {"node-dp/6", {4, 6}},
      {"node-dp/7", {5, 7}},
      // dp/<pp * tp_size + tp>: equal tp and pp, ordered by dp.
      {"dp/0", {0, 2}},
      {"dp/1", {1, 3}},
      {"dp/2", {4, 6}},
      {"dp/3", {5, 7}},
      // tp/<pp * dp_size + dp>: equal dp and pp, ordered by tp.
      {"tp/0", {0, 1}},
      {"tp/1", {2, 3}},
      {"tp/2", {4, 5}},
      {"tp/3", {6, 7}},
      // pp/<dp * tp_size + tp>: equal dp and tp, ordered by stage.
      {"pp/0", {0, 4}},
      {"pp/1", {1, 5}},
      {"pp/2", {2, 6}},
      {"pp/3", {3, 7}},
  };
  EXPECT_EQ(ByName(*groups), want);
  // Build order: kind by kind, then by index.
  std::vector<std::string> order;
  for (const auto& g : *groups) order.push_back(g.name);
  EXPECT_EQ(order.front(), "world");
  EXPECT_EQ(order[1], "node/0");
  EXPECT_EQ(order.back(), "pp/3");

  // Member 105 (global rank 5: node 1, local rank 1, dp 0, tp 1, pp 1).
  auto mine = DeriveMemberGroups(epoch, 105);
  ASSERT_TRUE(mine.ok()) << mine.status().ToString();
  std::vector<std::pair<std::string, int>> got;
  for (const auto& mg : *mine) got.emplace_back(mg.group.name, mg.rank);
  const std::vector<std::pair<std::string, int>> want_mine = {{"world", 5}, {"node/1", 1}, {"node-dp/7", 0},
                                                              {"dp/3", 0},  {"tp/2", 1},   {"pp/1", 1}};
  EXPECT_EQ(got, want_mine);
  for (const auto& mg : *mine) {
    EXPECT_EQ(mg.group.global_ranks[static_cast<size_t>(mg.rank)], 5) << mg.group.name;
    EXPECT_EQ(mg.group.global_ranks, want.at(mg.group.name));
  }
}

// Three nodes of two workers in two pipeline stages of three: the middle
// node holds the last worker of stage 0 and the first of stage 1, so its
// node-dp groups split it by stage.
TEST(DeriveGroupsTest, NodeDpGroupsSplitANodeThatHoldsTwoStages) {
  const auto epoch = MakeEpoch(4, 3, 1, 2, 2);
  auto groups = DeriveGroups(epoch, {"node-dp", "dp"});
  ASSERT_TRUE(groups.ok()) << groups.status().ToString();
  const std::map<std::string, std::vector<int>> want = {
      {"node-dp/0", {0, 1}}, {"node-dp/2", {2}},  {"node-dp/3", {3}},
      {"node-dp/5", {4, 5}}, {"dp/0", {0, 1, 2}}, {"dp/1", {3, 4, 5}},
  };
  EXPECT_EQ(ByName(*groups), want);
  // With tp = pp = 1 the node-dp group is the node group, and is not built.
  auto flat = DeriveGroups(MakeEpoch(5, 4, 1, 1, 2), {"node", "node-dp"});
  ASSERT_TRUE(flat.ok()) << flat.status().ToString();
  ASSERT_EQ(flat->size(), 2u);
  EXPECT_EQ((*flat)[0].name, "node/0");
  EXPECT_EQ((*flat)[1].name, "node/1");
}

TEST(DeriveGroupsTest, MatchesTheCoordinatorsPlacement) {
  // The coordinator places the workers; the groups come from the coordinates
  // it hands out, whatever its layout.
  std::vector<coordinator::WorkerSlot> slots;
  for (uint64_t id = 1; id <= 12; ++id) {
    coordinator::WorkerSlot s;
    s.member_id = id;
    s.node_id = fmt::format("node-{}", (id - 1) / 6);
    slots.push_back(s);
  }
  v1::MeshShape shape;
  shape.set_dp(3);
  shape.set_tp(2);
  shape.set_pp(2);
  auto plan = coordinator::PlanMesh(slots, shape);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  v1::MembershipEpoch epoch;
  epoch.set_epoch(1);
  *epoch.mutable_mesh() = plan->mesh;
  epoch.set_worker_count(static_cast<uint32_t>(plan->ranked.size()));
  for (const auto& [id, rank] : plan->ranked) {
    auto* p = epoch.add_peers();
    p->set_member_id(id);
    p->set_role(v1::ROLE_WORKER);
    *p->mutable_rank() = rank;
  }
  auto groups = DeriveGroups(epoch);
  ASSERT_TRUE(groups.ok()) << groups.status().ToString();
  std::map<std::string, size_t> sizes;
  std::map<int, std::map<std::string, int>> member_of;  // global rank -> kind -> count
  for (const auto& g : *groups) {
    sizes[g.name] = g.global_ranks.size();
    const std::string kind = g.name.substr(0, g.name.find('/'));
    for (int r : g.global_ranks) ++member_of[r][kind];
  }
  // world, 2 nodes, 4 node-dp (each node holds one stage), 4 dp, 6 tp, 6 pp
  EXPECT_EQ(groups->size(), 1u + 2u + 4u + 4u + 6u + 6u);
  EXPECT_EQ(sizes["world"], 12u);
  EXPECT_EQ(sizes["node/1"], 6u);
  EXPECT_EQ(sizes["node-dp/7"], 3u);  // node 1, pp 1, tp 1
  EXPECT_EQ(sizes["dp/3"], 3u);
  EXPECT_EQ(sizes["tp/5"], 2u);
  EXPECT_EQ(sizes["pp/5"], 2u);
  // Every worker is in exactly one group of each kind, and tp stays in a node.
  for (int r = 0; r < 12; ++r) {
    for (const auto& kind : AllGroupKinds()) EXPECT_EQ(member_of[r][kind], 1) << r << " " << kind;
  }
  for (const auto& g : *groups) {
    if (!g.name.starts_with("tp/")) continue;
    EXPECT_EQ(g.global_ranks[0] / 6, g.global_ranks[1] / 6) << g.name;
  }
}

TEST(DeriveGroupsTest, SizeOneGroupsAreKept) {
  const auto epoch = MakeEpoch(1, 4, 1, 1, 4);
  auto mine = DeriveMemberGroups(epoch, 102);
  ASSERT_TRUE(mine.ok()) << mine.status().ToString();
  ASSERT_EQ(mine->size(), 5u);
  EXPECT_EQ((*mine)[2].group.name, "dp/0");
  EXPECT_EQ((*mine)[2].group.global_ranks, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ((*mine)[3].group.name, "tp/2");
  EXPECT_EQ((*mine)[3].group.global_ranks, std::vector<int>{2});
  EXPECT_EQ((*mine)[4].group.name, "pp/2");
  EXPECT_EQ((*mine)[4].rank, 0);
}

TEST(DeriveGroupsTest, FilteredViewBuildsOnlyNodeLocalGroups) {
  auto epoch = MakeEpoch(2, 2, 2, 2, 4);
  // PEER_VIEW_LOCAL: this node's workers (node 0) and the servers.
  v1::MembershipEpoch local = epoch;
  local.clear_peers();
  for (const auto& p : epoch.peers()) {
    if (p.role() != v1::ROLE_WORKER || p.rank().node_rank() == 0) *local.add_peers() = p;
  }
  auto all = DeriveMemberGroups(local, 101);
  EXPECT_EQ(all.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(all.status().message().find("world"), std::string::npos) << all.status().ToString();
  auto some = DeriveMemberGroups(local, 101, {"tp", "node"});
  ASSERT_TRUE(some.ok()) << some.status().ToString();
  ASSERT_EQ(some->size(), 2u);
  EXPECT_EQ((*some)[0].group.name, "node/0");  // build order, whatever the order asked
  EXPECT_EQ((*some)[1].group.name, "tp/0");
  EXPECT_EQ((*some)[1].group.global_ranks, (std::vector<int>{0, 1}));
}

TEST(DeriveGroupsTest, RejectsInconsistentEpochs) {
  auto epoch = MakeEpoch(1, 2, 2, 1, 4);
  EXPECT_EQ(DeriveMemberGroups(epoch, 42).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(DeriveMemberGroups(epoch, 999).status().code(), StatusCode::kNotFound);  // a server
  EXPECT_EQ(DeriveGroups(epoch, {"world", "ep"}).status().code(), StatusCode::kInvalidArgument);

  auto twice = epoch;
  *twice.mutable_peers(0)->mutable_rank()->mutable_mesh() = twice.peers(1).rank().mesh();
  EXPECT_EQ(DeriveGroups(twice).status().code(), StatusCode::kInvalidArgument);

  auto outside = epoch;
  outside.mutable_peers(0)->mutable_rank()->mutable_mesh()->set_tp(2);
  EXPECT_EQ(DeriveGroups(outside).status().code(), StatusCode::kInvalidArgument);

  auto wrong_mesh = epoch;
  wrong_mesh.mutable_mesh()->set_dp(3);
  EXPECT_EQ(DeriveGroups(wrong_mesh).status().code(), StatusCode::kInvalidArgument);

  auto same_rank = epoch;
  same_rank.mutable_peers(0)->mutable_rank()->set_global_rank(same_rank.peers(1).rank().global_rank());
  EXPECT_EQ(DeriveGroups(same_rank).status().code(), StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------
// A test-only communicator (AllReduce and Barrier): each collective is an
// exchange of every rank's input through a table shared by the group's
// threads. Honours timeouts and Abort().
// ---------------------------------------------------------------------------

struct Table {
  explicit Table(int n) : size(n) {}
  const int size;
  Mutex mu;
  CondVar cv;
  struct Slot {
    std::vector<std::optional<std::string>> blobs;
    int taken = 0;
  };
  std::map<uint64_t, Slot> slots TANDEM_GUARDED_BY(mu);
};

class TestComm : public Communicator {
 public:
  TestComm(CommInfo info, std::shared_ptr<Table> table) : Communicator(std::move(info)), table_(std::move(table)) {}
  std::string backend() const override { return "test"; }

 protected:
  Status DoAllReduce(uint64_t seq, const void* in, void* out, size_t count, DType dtype, ReduceOp op) override {
    const size_t bytes = count * collectives::SizeOf(dtype);
    TANDEM_ASSIGN_OR_RETURN(auto blobs, Exchange(seq, std::string(static_cast<const char*>(in), bytes)));
    std::string acc = blobs[0];
    for (size_t r = 1; r < blobs.size(); ++r) collectives::Reduce(acc.data(), blobs[r].data(), count, dtype, op);
    if (op == ReduceOp::kAvg) collectives::Divide(acc.data(), count, dtype, size());
    std::memcpy(out, acc.data(), bytes);
    return Status::Ok();
  }
  Status DoBarrier(uint64_t seq) override { return Exchange(seq, "").status(); }
  Status DoReduceScatter(uint64_t, const void*, void*, size_t, DType, ReduceOp) override { return Unsupported(); }
  Status DoAllGather(uint64_t, const void*, void*, size_t, DType) override { return Unsupported(); }
  Status DoBroadcast(uint64_t, void*, size_t, DType, int) override { return Unsupported(); }
  Status DoReduce(uint64_t, const void*, void*, size_t, DType, ReduceOp, int) override { return Unsupported(); }
  Status DoSend(int, const void*, size_t) override { return Unsupported(); }
  Status DoRecv(int, void*, size_t) override { return Unsupported(); }
  void OnAbort() override {
    MutexLock lock(&table_->mu);
    table_->cv.NotifyAll();
  }

 private:
  static Status Unsupported() { return Unimplemented("not in the test communicator"); }

  Result<std::vector<std::string>> Exchange(uint64_t seq, std::string blob) {
    MutexLock lock(&table_->mu);
    auto& slot = table_->slots[seq];
    if (slot.blobs.empty()) slot.blobs.resize(static_cast<size_t>(size()));
    slot.blobs[static_cast<size_t>(rank())] = std::move(blob);
    table_->cv.NotifyAll();
    const auto deadline = Clock::now() + timeout();
    while (true) {
      if (aborted()) return health();
      if (std::all_of(slot.blobs.begin(), slot.blobs.end(), [](const auto& b) { return b.has_value(); })) break;
      if (!table_->cv.WaitUntil(lock, deadline) && Clock::now() >= deadline) {
        return DeadlineExceeded("collective {} of {} timed out", seq, name());
      }
    }
    std::vector<std::string> out;
    for (const auto& b : slot.blobs) out.push_back(*b);
    if (++slot.taken == size()) table_->slots.erase(seq);
    return out;
  }

  std::shared_ptr<Table> table_;
};

// Makes TestComms; the members of a group agree on its member list through
// the rendezvous (rank 0 publishes it, the others check it), then share one
// table per (epoch, group).
class TestBackend {
 public:
  BackendFactory Factory() {
    return [this](const CommInfo& info, const std::vector<int>& ranks,
                  Rendezvous& rendezvous) -> Result<std::unique_ptr<Communicator>> {
      if (fail_group == info.name) return Unavailable("injected: cannot build {}", info.name);
      const std::string key = fmt::format("test/{}/{}", info.epoch, info.name);
      std::string list;
      for (int r : ranks) list += std::to_string(r) + ",";
      if (info.rank == 0) {
        TANDEM_RETURN_IF_ERROR(rendezvous.Put(key, list));
      } else {
        TANDEM_ASSIGN_OR_RETURN(std::string published, rendezvous.Get(key, milliseconds(10000)));
        if (published != list) return InvalidArgument("group {}: members {} vs {}", info.name, published, list);
      }
      std::shared_ptr<Table> table;
      {
        MutexLock lock(&mu_);
        auto& t = tables_[key];
        if (t == nullptr) t = std::make_shared<Table>(info.size);
        table = t;
        ++built_;
      }
      return std::unique_ptr<Communicator>(std::make_unique<TestComm>(info, table));
    };
  }
  int built() {
    MutexLock lock(&mu_);
    return built_;
  }
  std::string fail_group;  // set before building

 private:
  Mutex mu_;
  std::map<std::string, std::shared_ptr<Table>> tables_ TANDEM_GUARDED_BY(mu_);
  int built_ TANDEM_GUARDED_BY(mu_) = 0;
};

template <typename Fn>
void ForEachMember(int n, Fn fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([&fn, r] { fn(r); });
  for (auto& t : threads) t.join();
}

TEST(CommManagerTest, BuildsTheGroupsAndAbortsInFlightOperationsOnANewEpoch) {
  constexpr int kWorkers = 8;
  TestBackend backend;
  MemoryRendezvous rendezvous;  // one per job here; keys carry the epoch
  std::vector<std::unique_ptr<CommManager>> managers;
  CommManagerOptions options;
  options.timeout = milliseconds(30000);
  for (int r = 0; r < kWorkers; ++r) {
    managers.push_back(std::make_unique<CommManager>(100 + static_cast<uint64_t>(r), backend.Factory(), options));
  }
  const auto e1 = MakeEpoch(1, 2, 2, 2, 4);
  ForEachMember(kWorkers, [&](int r) { ASSERT_TRUE(managers[static_cast<size_t>(r)]->SetEpoch(e1, rendezvous).ok()); });
  // world, node, node-dp, dp, tp and pp.
  EXPECT_EQ(backend.built(), kWorkers * 6);
  for (int r = 0; r < kWorkers; ++r) {
    auto& m = *managers[static_cast<size_t>(r)];
    EXPECT_EQ(m.epoch(), 1u);
    EXPECT_EQ(m.names().size(), 6u);
    ASSERT_NE(m.Get("node"), nullptr);
    EXPECT_EQ(m.Get("node"), m.Get(fmt::format("node/{}", r / 4)));
    EXPECT_EQ(m.Get("node")->rank(), r % 4);
    EXPECT_EQ(m.Get("world")->rank(), r);
    EXPECT_EQ(m.Get("world")->epoch(), 1u);
    EXPECT_EQ(m.Get("dp/0") != nullptr, r == 0 || r == 2);
    EXPECT_EQ(m.Get("nope"), nullptr);
  }
  // The same epoch again is a no-op.
  ASSERT_TRUE(managers[0]->SetEpoch(e1, rendezvous).ok());
  EXPECT_EQ(backend.built(), kWorkers * 6);

  // Workers 0..6 enter an allreduce on "world"; worker 7 never does.
  std::vector<std::thread> in_flight;
  std::vector<Status> results(kWorkers - 1);
  std::vector<Clock::duration> took(kWorkers - 1);
  for (int r = 0; r < kWorkers - 1; ++r) {
    in_flight.emplace_back([&, r] {
      auto world = managers[static_cast<size_t>(r)]->Get("world");
      float x = 1.0f;
      const auto start = Clock::now();
      results[static_cast<size_t>(r)] = world->AllReduce(&x, &x, 1, DType::kFloat32, ReduceOp::kSum);
      took[static_cast<size_t>(r)] = Clock::now() - start;
    });
  }
  std::this_thread::sleep_for(milliseconds(100));
  // Heartbeat progress shows the collective in flight.
  auto progress = managers[0]->CollectiveProgress();
  ASSERT_EQ(progress.size(), 6u);
  EXPECT_EQ(progress[0].communicator(), "world");
  EXPECT_EQ(progress[0].last_entered(), 1u);
  EXPECT_EQ(progress[0].last_completed(), 0u);
  EXPECT_EQ(progress[0].last_op(), "allreduce");
  std::this_thread::sleep_for(milliseconds(30));
  progress = managers[0]->CollectiveProgress();
  EXPECT_GE(TimeUtil::DurationToMilliseconds(progress[0].in_flight()), 30);
  EXPECT_EQ(managers[7]->progress()[0].last_entered, 0u);

  // Epoch 2 (same workers, another mesh) supersedes it.
  const auto e2 = MakeEpoch(2, 4, 2, 1, 4);
  const auto start = Clock::now();
  ForEachMember(kWorkers, [&](int r) { ASSERT_TRUE(managers[static_cast<size_t>(r)]->SetEpoch(e2, rendezvous).ok()); });
  for (auto& t : in_flight) t.join();
  EXPECT_LT(Clock::now() - start, milliseconds(5000));
  for (int r = 0; r < kWorkers - 1; ++r) {
    const Status& s = results[static_cast<size_t>(r)];
    EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
    EXPECT_NE(s.message().find("epoch 1 was superseded by epoch 2"), std::string::npos) << s.ToString();
    EXPECT_LT(took[static_cast<size_t>(r)], milliseconds(5000));
  }
  // An older epoch is refused.
  EXPECT_EQ(managers[0]->SetEpoch(e1, rendezvous).code(), StatusCode::kFailedPrecondition);

  // The new set works.
  ForEachMember(kWorkers, [&](int r) {
    auto& m = *managers[static_cast<size_t>(r)];
    EXPECT_EQ(m.epoch(), 2u);
    auto world = m.Get("world");
    ASSERT_NE(world, nullptr);
    EXPECT_EQ(world->epoch(), 2u);
    int64_t x = r;
    ASSERT_TRUE(world->AllReduce(&x, &x, 1, DType::kInt64, ReduceOp::kSum).ok());
    EXPECT_EQ(x, 28);
    // dp groups of epoch 2: the four workers with the same tp index.
    auto dp = m.Get(fmt::format("dp/{}", r % 2));
    ASSERT_NE(dp, nullptr);
    EXPECT_EQ(dp->size(), 4);
    int64_t y = r;
    ASSERT_TRUE(dp->AllReduce(&y, &y, 1, DType::kInt64, ReduceOp::kMax).ok());
    EXPECT_EQ(y, r % 2 == 0 ? 6 : 7);
    ASSERT_TRUE(m.Get("pp/" + std::to_string(r)) != nullptr);  // size-1 pipeline groups
    EXPECT_TRUE(m.Get("pp/" + std::to_string(r))->Barrier().ok());
  });
  auto p = managers[3]->CollectiveProgress();
  EXPECT_EQ(p[0].last_completed(), 1u);
  EXPECT_EQ(TimeUtil::DurationToMilliseconds(p[0].in_flight()), 0);
}

TEST(CommManagerTest, AFailedBuildLeavesNoSetAndCanBeRetried) {
  TestBackend backend;
  MemoryRendezvous rendezvous;
  CommManager manager(100, backend.Factory());
  const auto epoch = MakeEpoch(5, 1, 1, 1, 1);
  backend.fail_group = "dp/0";
  const Status s = manager.SetEpoch(epoch, rendezvous);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_NE(s.message().find("building communicator dp/0 of epoch 5"), std::string::npos) << s.ToString();
  EXPECT_EQ(manager.epoch(), 5u);
  EXPECT_EQ(manager.Get("world"), nullptr);
  EXPECT_TRUE(manager.names().empty());
  backend.fail_group.clear();
  ASSERT_TRUE(manager.SetEpoch(epoch, rendezvous).ok());
  EXPECT_EQ(manager.names(), (std::vector<std::string>{"world", "node/0", "dp/0", "tp/0", "pp/0"}));
  auto world = manager.Get("world");
  manager.Abort("shutting down");
  EXPECT_EQ(manager.Get("world"), nullptr);
  EXPECT_EQ(world->Barrier().code(), StatusCode::kAborted);
}

// ---------------------------------------------------------------------------
// An in-process coordinator over gRPC on loopback.
// ---------------------------------------------------------------------------

class TestCoordinator {
 public:
  TestCoordinator() {
    store_ = std::make_unique<coordinator::MemoryStore>();
    core_ =
        std::make_unique<coordinator::CoordinatorCore>(coordinator::CoreOptions{}, store_.get(), SystemClock::Get());
    EXPECT_TRUE(core_->Recover().ok());
    service_ =
        std::make_unique<coordinator::CoordinatorService>(core_.get(), store_.get(), registry_, milliseconds(10));
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_->coordinator());
    builder.RegisterService(service_->admin());
    server_ = builder.BuildAndStart();
    service_->Start();
    channel_ = grpc::CreateChannel(fmt::format("127.0.0.1:{}", port), grpc::InsecureChannelCredentials());
    stub_ = v1::Coordinator::NewStub(channel_);
  }
  ~TestCoordinator() {
    service_->Stop();
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    server_->Wait();
  }

  static v1::JobSpec Spec(const std::string& job, uint32_t workers) {
    v1::JobSpec spec;
    spec.set_job_id(job);
    spec.set_min_workers(workers);
    spec.set_max_workers(workers);
    *spec.mutable_heartbeat_interval() = TimeUtil::MillisecondsToDuration(20);
    *spec.mutable_heartbeat_deadline() = TimeUtil::MillisecondsToDuration(60000);
    *spec.mutable_stream_grace() = TimeUtil::MillisecondsToDuration(60000);
    return spec;
  }

  struct Member {
    uint64_t id = 0;
    uint64_t session = 0;
  };
  Member Register(const std::string& job, const std::string& host) {
    v1::RegisterRequest r;
    r.set_job_id(job);
    r.set_role(v1::ROLE_WORKER);
    r.mutable_node()->set_hostname(host);
    r.mutable_node()->mutable_capabilities()->add_transports("shm");
    auto* e = r.add_endpoints();
    e->set_transport("shm");
    grpc::ClientContext ctx;
    v1::RegisterResponse response;
    const grpc::Status s = stub_->Register(&ctx, r, &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return {response.member_id(), response.session_id()};
  }

  // The newest epoch of `job`, once there is one (0 if none within 5 s).
  uint64_t WaitEpoch(const std::string& job, uint64_t after = 0) {
    const auto deadline = Clock::now() + milliseconds(5000);
    while (Clock::now() < deadline) {
      v1::GetStatusRequest r;
      r.set_job_id(job);
      auto s = core_->GetStatus(r);
      if (s.ok()) {
        const uint64_t e = std::max(s->active_epoch(), s->pending_epoch());
        if (e > after) return e;
      }
      std::this_thread::sleep_for(milliseconds(5));
    }
    return 0;
  }

  coordinator::CoordinatorCore& core() { return *core_; }
  std::shared_ptr<grpc::Channel> channel() { return channel_; }
  v1::Coordinator::Stub& stub() { return *stub_; }

 private:
  prometheus::Registry registry_;
  std::unique_ptr<coordinator::MemoryStore> store_;
  std::unique_ptr<coordinator::CoordinatorCore> core_;
  std::unique_ptr<coordinator::CoordinatorService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

TEST(CoordinatorRendezvousTest, PutAndGetThroughTheCoordinator) {
  TestCoordinator coordinator;
  ASSERT_TRUE(coordinator.core().CreateJob(TestCoordinator::Spec("r", 2)).ok());
  const auto a = coordinator.Register("r", "host-a");
  const auto b = coordinator.Register("r", "host-b");
  const uint64_t epoch = coordinator.WaitEpoch("r");
  ASSERT_NE(epoch, 0u);
  auto options = [&](const TestCoordinator::Member& m) {
    CoordinatorRendezvousOptions o;
    o.job_id = "r";
    o.member_id = m.id;
    o.session_id = m.session;
    o.epoch = epoch;
    return o;
  };
  CoordinatorRendezvous ra(coordinator.channel(), options(a));
  CoordinatorRendezvous rb(coordinator.channel(), options(b));

  ASSERT_TRUE(ra.Put("nccl/world", "unique-id").ok());
  auto got = rb.Get("nccl/world", milliseconds(2000));
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, "unique-id");
  // Same value again: fine; another value: ALREADY_EXISTS.
  EXPECT_TRUE(ra.Put("nccl/world", "unique-id").ok());
  EXPECT_EQ(rb.Put("nccl/world", "other").code(), StatusCode::kAlreadyExists);
  // Binary values up to 64 KiB.
  std::string big(64 << 10, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 31);
  ASSERT_TRUE(ra.Put("shm/segment", big).ok());
  auto got_big = rb.Get("shm/segment", milliseconds(2000));
  ASSERT_TRUE(got_big.ok());
  EXPECT_EQ(*got_big, big);

  // Limits are checked before any call.
  EXPECT_EQ(ra.Put(std::string(257, 'k'), "v").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ra.Put("", "v").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ra.Put("k", std::string((64 << 10) + 1, 'v')).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(rb.Get(std::string(257, 'k'), milliseconds(10)).status().code(), StatusCode::kInvalidArgument);

  // A Get waits for a key published later, and returns soon after.
  Result<std::string> late = Status(StatusCode::kUnknown, "not run");
  Clock::time_point returned;
  std::thread waiter([&] {
    late = rb.Get("ucx/world/0", milliseconds(10000));
    returned = Clock::now();
  });
  std::this_thread::sleep_for(milliseconds(200));
  const auto put_at = Clock::now();
  ASSERT_TRUE(ra.Put("ucx/world/0", "address").ok());
  waiter.join();
  ASSERT_TRUE(late.ok()) << late.status().ToString();
  EXPECT_EQ(*late, "address");
  EXPECT_LT(returned - put_at, milliseconds(1000));

  // A key that never comes: DEADLINE_EXCEEDED naming it, after the timeout.
  const auto start = Clock::now();
  auto missing = rb.Get("never/there", milliseconds(300));
  const auto waited = Clock::now() - start;
  EXPECT_EQ(missing.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(missing.status().message().find("never/there"), std::string::npos) << missing.status().ToString();
  EXPECT_GE(waited, milliseconds(300));
  EXPECT_LT(waited, milliseconds(3000));

  // A member with a stale session is refused at once (no polling until the timeout).
  auto stranger_options = options(a);
  stranger_options.session_id += 1;
  CoordinatorRendezvous stranger(coordinator.channel(), stranger_options);
  const auto asked = Clock::now();
  const Status refused = stranger.Get("nccl/world", milliseconds(5000)).status();
  EXPECT_TRUE(refused.code() == StatusCode::kNotFound || refused.code() == StatusCode::kFailedPrecondition)
      << refused.ToString();
  EXPECT_NE(refused.message().find("nccl/world"), std::string::npos) << refused.ToString();
  EXPECT_LT(Clock::now() - asked, milliseconds(2000));

  // Cancel (a worker shutting down) fails a waiting Get promptly, and every later call.
  {
    CoordinatorRendezvous rc(coordinator.channel(), options(b));
    Result<std::string> cancelled = Status(StatusCode::kUnknown, "not run");
    std::thread waiter3([&] { cancelled = rc.Get("never/published", milliseconds(20000)); });
    std::this_thread::sleep_for(milliseconds(100));
    const auto cancel_at = Clock::now();
    rc.Cancel("the worker is shutting down");
    waiter3.join();
    EXPECT_LT(Clock::now() - cancel_at, milliseconds(1000));
    EXPECT_EQ(cancelled.status().code(), StatusCode::kCancelled) << cancelled.status().ToString();
    EXPECT_NE(cancelled.status().message().find("the worker is shutting down"), std::string::npos)
        << cancelled.status().ToString();
    EXPECT_EQ(rc.Put("late/key", "v").code(), StatusCode::kCancelled);
    EXPECT_EQ(rc.Get("nccl/world", milliseconds(1000)).status().code(), StatusCode::kCancelled);
  }

  // When the epoch is superseded (a leaves), a waiting Get fails promptly.
  Result<std::string> aborted = Status(StatusCode::kUnknown, "not run");
  Clock::time_point aborted_at;
  std::thread waiter2([&] {
    aborted = rb.Get("never/published", milliseconds(20000));
    aborted_at = Clock::now();
  });
  std::this_thread::sleep_for(milliseconds(100));
  v1::LeaveRequest leave;
  leave.set_job_id("r");
  leave.set_member_id(a.id);
  leave.set_session_id(a.session);
  grpc::ClientContext ctx;
  v1::LeaveResponse left;
  ASSERT_TRUE(coordinator.stub().Leave(&ctx, leave, &left).ok());
  const auto left_at = Clock::now();
  waiter2.join();
  EXPECT_EQ(aborted.status().code(), StatusCode::kAborted) << aborted.status().ToString();
  EXPECT_LT(aborted_at - left_at, milliseconds(3000));
  EXPECT_EQ(rb.Put("nccl/late", "x").code(), StatusCode::kAborted);
}

// A worker's session options on `host`, with a shared-memory endpoint.
MemberSessionOptions WorkerSessionOptions(const std::string& job, const std::string& host) {
  MemberSessionOptions options;
  options.job_id = job;
  options.node.set_hostname(host);
  options.node.mutable_capabilities()->add_transports("shm");
  v1::Endpoint endpoint;
  endpoint.set_transport("shm");
  options.endpoints.push_back(endpoint);
  return options;
}

TEST(MemberSessionProgressTest, HeartbeatsCarryCollectiveProgress) {
  TestCoordinator coordinator;
  ASSERT_TRUE(coordinator.core().CreateJob(TestCoordinator::Spec("s", 1)).ok());
  MemberSessionOptions options = WorkerSessionOptions("s", "host-s");
  std::atomic<int> calls{0};
  options.collective_progress = [&calls] {
    ++calls;
    std::vector<v1::CollectiveProgress> out;
    for (int i = 0; i < 70; ++i) {  // more than a heartbeat carries
      v1::CollectiveProgress p;
      p.set_communicator(i == 0 ? "world" : fmt::format("dp/{}", i));
      p.set_last_entered(7);
      p.set_last_completed(6);
      p.set_last_op("allreduce");
      *p.mutable_in_flight() = TimeUtil::MillisecondsToDuration(250);
      out.push_back(std::move(p));
    }
    return out;
  };
  MemberSession session(coordinator.channel(), options);
  ASSERT_TRUE(session.WaitActive(milliseconds(5000)));
  const auto deadline = Clock::now() + milliseconds(5000);
  v1::MemberStatus seen;
  while (Clock::now() < deadline) {
    v1::GetStatusRequest r;
    r.set_job_id("s");
    auto status = coordinator.core().GetStatus(r);
    ASSERT_TRUE(status.ok());
    if (status->members_size() == 1 && status->members(0).collectives_size() > 0) {
      seen = status->members(0);
      break;
    }
    std::this_thread::sleep_for(milliseconds(10));
  }
  ASSERT_EQ(seen.collectives_size(), 64);
  EXPECT_EQ(seen.collectives(0).communicator(), "world");
  EXPECT_EQ(seen.collectives(0).last_entered(), 7u);
  EXPECT_EQ(seen.collectives(0).last_completed(), 6u);
  EXPECT_EQ(seen.collectives(0).last_op(), "allreduce");
  EXPECT_EQ(TimeUtil::DurationToMilliseconds(seen.collectives(0).in_flight()), 250);
  EXPECT_GT(calls.load(), 0);
}

// A member whose on_epoch is stuck (building communicators with peers that
// moved on) cannot read the newer epoch from its watch stream: its
// heartbeats tell it, through on_newer_epoch, so that it can give up.
TEST(MemberSessionProgressTest, AMemberStuckInAnEpochHearsOfTheNewerOneFromItsHeartbeats) {
  TestCoordinator coordinator;
  v1::JobSpec spec = TestCoordinator::Spec("n", 1);
  spec.set_max_workers(2);
  ASSERT_TRUE(coordinator.core().CreateJob(spec).ok());
  Mutex mu;
  CondVar cv;
  uint64_t newer = 0;
  std::vector<uint64_t> handled;
  MemberSessionOptions options = WorkerSessionOptions("n", "host-a");
  options.on_epoch = [&](const v1::MembershipEpoch& epoch) {
    MutexLock lock(&mu);
    handled.push_back(epoch.epoch());
    cv.NotifyAll();
    if (handled.size() == 1) {
      // Stuck until told of a newer epoch (or 20 s, which fails the test).
      cv.WaitFor(lock, std::chrono::seconds(20), [&] { return newer > epoch.epoch(); });
      return Cancelled("epoch {} was superseded", epoch.epoch());
    }
    return Status::Ok();
  };
  options.on_newer_epoch = [&](uint64_t latest) {
    MutexLock lock(&mu);
    newer = std::max(newer, latest);
    cv.NotifyAll();
  };
  MemberSession session(coordinator.channel(), options);
  {
    MutexLock lock(&mu);
    ASSERT_TRUE(cv.WaitFor(lock, std::chrono::seconds(5), [&] { return !handled.empty(); }));
  }
  const uint64_t first = coordinator.WaitEpoch("n");
  ASSERT_NE(first, 0u);
  // A second worker joins: a newer epoch, which the stuck member hears of.
  const auto joined_at = Clock::now();
  coordinator.Register("n", "host-b");
  MutexLock lock(&mu);
  ASSERT_TRUE(cv.WaitFor(lock, std::chrono::seconds(10), [&] { return handled.size() >= 2; }))
      << "newer epoch heard: " << newer;
  EXPECT_GT(newer, first);
  EXPECT_GT(handled.back(), first);
  EXPECT_LT(Clock::now() - joined_at, std::chrono::seconds(5));
}

}  // namespace
}  // namespace tandem::comm
