// Tests of rank, mesh and shard-map assignment (coordinator/assignment.h).
//
// The example tests at the top read as documentation of the rules. The
// property tests below them run hundreds of random topologies each, from a
// seeded std::mt19937_64; a failure prints "seed N". To replay one case, run
// the test with TANDEM_ASSIGNMENT_SEED=N: the first case then uses seed N.
#include "coordinator/assignment.h"

#include <stdlib.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

namespace tandem::coordinator {
namespace {

constexpr int kCases = 500;

uint64_t BaseSeed() {
  const char* env = std::getenv("TANDEM_ASSIGNMENT_SEED");
  return env != nullptr ? std::strtoull(env, nullptr, 10) : 20240601;
}

v1::MeshShape Mesh(uint32_t dp, uint32_t tp, uint32_t pp) {
  v1::MeshShape m;
  m.set_dp(dp);
  m.set_tp(tp);
  m.set_pp(pp);
  return m;
}

WorkerSlot Worker(uint64_t id, std::string node, std::optional<uint32_t> previous = std::nullopt) {
  return WorkerSlot{id, std::move(node), previous};
}

// Member ids by global rank.
std::vector<uint64_t> RankedIds(const MeshPlan& plan) {
  std::vector<uint64_t> ids;
  for (const auto& [id, rank] : plan.ranked) ids.push_back(id);
  return ids;
}

// "global/node/local tp,dp,pp" for compact expectations.
std::string Describe(const v1::RankAssignment& a) {
  return std::to_string(a.global_rank()) + "/" + std::to_string(a.node_rank()) + "/" + std::to_string(a.local_rank()) +
         " " + std::to_string(a.mesh().tp()) + "," + std::to_string(a.mesh().dp()) + "," +
         std::to_string(a.mesh().pp());
}

// ===========================================================================
// Examples: rank and mesh assignment
// ===========================================================================

TEST(PlanMeshExample, TwoNodesOfFourWithTensorAndPipelineParallelism) {
  // tp=2 pairs up neighbours inside a node; pp=2 puts stage 0 on the first
  // node and stage 1 on the second; dp (0: choose) becomes 8 / (2 * 2) = 2.
  auto plan = PlanMesh({Worker(11, "a"), Worker(12, "a"), Worker(13, "a"), Worker(14, "a"), Worker(21, "b"),
                        Worker(22, "b"), Worker(23, "b"), Worker(24, "b")},
                       Mesh(0, 2, 2));
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->mesh.dp(), 2u);
  EXPECT_EQ(plan->mesh.tp(), 2u);
  EXPECT_EQ(plan->mesh.pp(), 2u);
  EXPECT_EQ(RankedIds(*plan), (std::vector<uint64_t>{11, 12, 13, 14, 21, 22, 23, 24}));
  // global/node/local  tp,dp,pp
  const std::vector<std::string> expected = {"0/0/0 0,0,0", "1/0/1 1,0,0", "2/0/2 0,1,0", "3/0/3 1,1,0",
                                             "4/1/0 0,0,1", "5/1/1 1,0,1", "6/1/2 0,1,1", "7/1/3 1,1,1"};
  for (size_t r = 0; r < plan->ranked.size(); ++r) {
    const v1::RankAssignment& a = plan->ranked[r].second;
    EXPECT_EQ(Describe(a), expected[r]);
    EXPECT_EQ(a.world_size(), 8u);
    EXPECT_EQ(a.local_world_size(), 4u);
    EXPECT_EQ(a.node_count(), 2u);
  }
  EXPECT_TRUE(plan->standby.empty());
  EXPECT_EQ(plan->standby_reason, "");
}

TEST(PlanMeshExample, DefaultsArePlainDataParallelism) {
  // An all-zero request means tp=1, pp=1 and dp = every worker.
  auto plan = PlanMesh({Worker(3, "x"), Worker(1, "y"), Worker(2, "x")}, Mesh(0, 0, 0));
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->mesh.dp(), 3u);
  EXPECT_EQ(plan->mesh.tp(), 1u);
  EXPECT_EQ(plan->mesh.pp(), 1u);
  // No previous ranks: nodes by node_id, members by id.
  EXPECT_EQ(RankedIds(*plan), (std::vector<uint64_t>{2, 3, 1}));
  EXPECT_EQ(plan->ranked[2].second.node_rank(), 1u);
  EXPECT_EQ(plan->ranked[2].second.local_rank(), 0u);
}

TEST(PlanMeshExample, AWorkerThatCompletesNoTensorGroupWaitsOnStandby) {
  auto plan =
      PlanMesh({Worker(1, "n1"), Worker(2, "n1"), Worker(3, "n2"), Worker(4, "n2"), Worker(5, "n2")}, Mesh(0, 2, 1));
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->mesh.dp(), 2u);
  EXPECT_EQ(RankedIds(*plan), (std::vector<uint64_t>{1, 2, 3, 4}));
  EXPECT_EQ(plan->standby, (std::vector<uint64_t>{5}));
  EXPECT_EQ(plan->standby_reason, "node n2 has 3 workers, not a multiple of tp=2");
}

TEST(PlanMeshExample, AFixedDataParallelDegreeLeavesTheSurplusOfTheLastNodesOnStandby) {
  auto plan = PlanMesh(
      {Worker(1, "a"), Worker(2, "a"), Worker(3, "b"), Worker(4, "b"), Worker(5, "c"), Worker(6, "c"), Worker(7, "c")},
      Mesh(2, 2, 1));
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(RankedIds(*plan), (std::vector<uint64_t>{1, 2, 3, 4}));
  EXPECT_EQ(plan->standby, (std::vector<uint64_t>{5, 6, 7}));
  EXPECT_EQ(plan->standby_reason,
            "node c has 3 workers, not a multiple of tp=2; mesh dp=2 x tp=2 x pp=1 takes exactly 4 workers, so the "
            "last 2 of the 6 in whole tp groups wait");
  EXPECT_EQ(plan->ranked.back().second.node_count(), 2u);
}

TEST(PlanMeshExample, AnElasticPipelineGrowsInWholeStages) {
  // tp=1 x pp=2: 5 workers give dp=2 and the last one waits.
  auto plan = PlanMesh({Worker(1, "a"), Worker(2, "a"), Worker(3, "a"), Worker(4, "b"), Worker(5, "b")}, Mesh(0, 1, 2));
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->mesh.dp(), 2u);
  EXPECT_EQ(plan->standby, (std::vector<uint64_t>{5}));
  EXPECT_EQ(plan->standby_reason,
            "the mesh grows in steps of tp x pp = 2 workers, so the last 1 of the 5 in whole tp groups wait");
}

TEST(PlanMeshExample, SurvivorsKeepTheirOrderAndUnchangedLeadingNodesKeepTheirRanks) {
  // Epoch 1: three nodes, no history.
  auto e1 = PlanMesh({Worker(1, "a"), Worker(2, "a"), Worker(3, "b"), Worker(4, "b"), Worker(5, "c"), Worker(6, "c")},
                     Mesh(0, 1, 1));
  ASSERT_TRUE(e1.ok());
  EXPECT_EQ(RankedIds(*e1), (std::vector<uint64_t>{1, 2, 3, 4, 5, 6}));

  // Epoch 2: member 3 died and member 9 joined on a new node "0" (whose
  // name sorts first). Node a precedes every change and keeps ranks 0 and 1;
  // the others close up in order; the new node comes last.
  auto e2 = PlanMesh(
      {Worker(1, "a", 0), Worker(2, "a", 1), Worker(4, "b", 3), Worker(5, "c", 4), Worker(6, "c", 5), Worker(9, "0")},
      Mesh(0, 1, 1));
  ASSERT_TRUE(e2.ok());
  EXPECT_EQ(RankedIds(*e2), (std::vector<uint64_t>{1, 2, 4, 5, 6, 9}));

  // Epoch 3: member 10 joins node b: it follows b's survivor, so c and the
  // new node move up by one, still in the same order.
  auto e3 = PlanMesh({Worker(1, "a", 0), Worker(2, "a", 1), Worker(4, "b", 2), Worker(5, "c", 3), Worker(6, "c", 4),
                      Worker(9, "0", 5), Worker(10, "b")},
                     Mesh(0, 1, 1));
  ASSERT_TRUE(e3.ok());
  EXPECT_EQ(RankedIds(*e3), (std::vector<uint64_t>{1, 2, 4, 10, 5, 6, 9}));
  EXPECT_EQ(e3->ranked[3].second.local_rank(), 1u);
  EXPECT_EQ(e3->ranked[3].second.local_world_size(), 2u);
}

TEST(PlanMeshExample, ImpossibleMeshesSayWhy) {
  const std::vector<WorkerSlot> workers = {Worker(1, "a"), Worker(2, "a"), Worker(3, "a"), Worker(4, "a"),
                                           Worker(5, "b"), Worker(6, "b"), Worker(7, "b")};
  auto too_wide = PlanMesh(workers, Mesh(0, 8, 1));
  EXPECT_EQ(too_wide.status(), InvalidArgument("tp=8 is larger than any node's worker count (largest: 4)"));

  auto too_few = PlanMesh(workers, Mesh(0, 4, 2));
  EXPECT_EQ(too_few.status(), FailedPrecondition("mesh tp=4 x pp=2 needs at least 8 workers in whole tp groups of 4 "
                                                 "inside nodes; the members give 4"));

  auto fixed = PlanMesh(workers, Mesh(4, 2, 1));
  EXPECT_EQ(fixed.status(), FailedPrecondition("mesh dp=4 x tp=2 x pp=1 needs 8 workers in whole tp groups of 2 "
                                               "inside nodes; the members give 6"));

  auto absurd = PlanMesh(workers, Mesh(0, 1, 70000));
  EXPECT_EQ(absurd.status(), InvalidArgument("mesh pp=70000 is out of range: dp, tp and pp must each be at most "
                                             "65536 (0 means choose)"));

  EXPECT_EQ(PlanMesh({}, Mesh(0, 0, 0)).status(), FailedPrecondition("no workers to place in the mesh"));
  EXPECT_EQ(PlanMesh({Worker(7, "a"), Worker(7, "b")}, Mesh(0, 0, 0)).status(),
            InvalidArgument("worker member_id 7 is listed more than once"));
  EXPECT_EQ(PlanMesh({Worker(0, "a")}, Mesh(0, 0, 0)).status(),
            InvalidArgument("worker member_id 0 is not a valid id (ids start at 1)"));
  EXPECT_EQ(PlanMesh({Worker(1, "")}, Mesh(0, 0, 0)).status(), InvalidArgument("worker 1 has an empty node_id"));
  EXPECT_EQ(PlanMesh({Worker(1, "a", 4), Worker(2, "b", 4)}, Mesh(0, 0, 0)).status(),
            InvalidArgument("previous rank 4 is claimed by both worker 1 and worker 2"));
}

// ===========================================================================
// Properties: rank and mesh assignment
// ===========================================================================

// A random job: 1 to 10 nodes of 1 to 8 workers, ids with gaps, node names
// that do not sort in creation order, and (optionally) distinct previous
// ranks on a random subset of the workers.
std::vector<WorkerSlot> RandomWorkers(std::mt19937_64& rng, bool with_history) {
  std::uniform_int_distribution<int> node_count(1, 10), per_node(1, 8), gap(1, 5);
  std::vector<WorkerSlot> workers;
  uint64_t id = std::uniform_int_distribution<uint64_t>(1, 1000)(rng);
  const int nodes = node_count(rng);
  for (int n = 0; n < nodes; ++n) {
    const std::string node =
        "node-" + std::to_string(std::uniform_int_distribution<int>(0, 99)(rng)) + "-" + std::to_string(n);
    for (int k = per_node(rng); k > 0; --k) {
      workers.push_back(Worker(id, node));
      id += static_cast<uint64_t>(gap(rng));
    }
  }
  if (with_history) {
    std::vector<uint32_t> ranks(workers.size());
    for (size_t i = 0; i < ranks.size(); ++i) ranks[i] = static_cast<uint32_t>(i);
    std::shuffle(ranks.begin(), ranks.end(), rng);
    for (size_t i = 0; i < workers.size(); ++i) {
      if (std::bernoulli_distribution(0.6)(rng)) workers[i].previous_rank = ranks[i];
    }
  }
  std::shuffle(workers.begin(), workers.end(), rng);
  return workers;
}

v1::MeshShape RandomMesh(std::mt19937_64& rng) {
  static constexpr uint32_t kTp[] = {0, 1, 1, 2, 2, 3, 4, 8, 9};
  const uint32_t tp = kTp[std::uniform_int_distribution<size_t>(0, std::size(kTp) - 1)(rng)];
  const uint32_t pp = std::uniform_int_distribution<uint32_t>(0, 3)(rng);
  const uint32_t dp = std::bernoulli_distribution(0.3)(rng) ? std::uniform_int_distribution<uint32_t>(1, 8)(rng) : 0;
  return Mesh(dp, tp, pp);
}

// An independent model of the rules in assignment.h: the nodes in placement
// order, each with its members in placement order and how many are ranked.
struct ModelNode {
  std::string id;
  std::vector<uint64_t> members;
  size_t kept = 0;
};
struct Model {
  StatusCode code = StatusCode::kOk;
  std::vector<ModelNode> nodes;
  uint64_t fit = 0;    // workers in whole tp groups
  uint64_t world = 0;  // workers ranked
};

Model ModelPlan(const std::vector<WorkerSlot>& workers, const v1::MeshShape& requested) {
  Model model;
  const uint64_t tp = std::max<uint32_t>(requested.tp(), 1), pp = std::max<uint32_t>(requested.pp(), 1);
  std::map<std::string, std::vector<const WorkerSlot*>> by_node;
  for (const WorkerSlot& w : workers) by_node[w.node_id].push_back(&w);
  // Key: (has no previous rank, previous rank, id) for members, likewise for nodes.
  using Key = std::tuple<bool, uint32_t, std::string>;
  std::vector<std::pair<Key, ModelNode>> keyed;
  for (auto& [node, members] : by_node) {
    std::sort(members.begin(), members.end(), [](const WorkerSlot* a, const WorkerSlot* b) {
      return std::make_tuple(!a->previous_rank, a->previous_rank.value_or(0), a->member_id) <
             std::make_tuple(!b->previous_rank, b->previous_rank.value_or(0), b->member_id);
    });
    ModelNode m{node, {}, 0};
    for (const WorkerSlot* w : members) m.members.push_back(w->member_id);
    const WorkerSlot* first = members.front();
    keyed.emplace_back(Key{!first->previous_rank, first->previous_rank.value_or(0), node}, std::move(m));
  }
  std::sort(keyed.begin(), keyed.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  size_t largest = 0;
  for (auto& [key, node] : keyed) {
    largest = std::max(largest, node.members.size());
    node.kept = node.members.size() / tp * tp;
    model.fit += node.kept;
    model.nodes.push_back(std::move(node));
  }
  if (tp > largest) {
    model.code = StatusCode::kInvalidArgument;
    return model;
  }
  model.world = requested.dp() != 0 ? requested.dp() * tp * pp : model.fit / (tp * pp) * (tp * pp);
  if (model.world == 0 || model.world > model.fit) {
    model.code = StatusCode::kFailedPrecondition;
    return model;
  }
  uint64_t surplus = model.fit - model.world;
  for (auto it = model.nodes.rbegin(); it != model.nodes.rend(); ++it) {
    const uint64_t take = std::min<uint64_t>(surplus, it->kept);
    it->kept -= take;
    surplus -= take;
  }
  return model;
}

// The properties every plan has, whatever the input.
void CheckPlan(const std::vector<WorkerSlot>& workers, const v1::MeshShape& requested, const MeshPlan& plan) {
  const uint32_t tp = plan.mesh.tp(), dp = plan.mesh.dp(), pp = plan.mesh.pp();
  ASSERT_GE(tp, 1u);
  ASSERT_GE(dp, 1u);
  ASSERT_GE(pp, 1u);
  EXPECT_EQ(tp, std::max<uint32_t>(requested.tp(), 1));
  EXPECT_EQ(pp, std::max<uint32_t>(requested.pp(), 1));
  if (requested.dp() != 0) {
    EXPECT_EQ(dp, requested.dp());
  }
  ASSERT_EQ(uint64_t{dp} * tp * pp, plan.ranked.size());

  // Every worker is either ranked or on standby, exactly once.
  std::map<uint64_t, std::string> node_of;
  for (const WorkerSlot& w : workers) node_of[w.member_id] = w.node_id;
  std::multiset<uint64_t> seen(plan.standby.begin(), plan.standby.end());
  for (const auto& [id, rank] : plan.ranked) seen.insert(id);
  EXPECT_EQ(seen.size(), workers.size());
  for (const auto& [id, node] : node_of) EXPECT_EQ(seen.count(id), 1u) << "member " << id;
  EXPECT_EQ(plan.standby.empty(), plan.standby_reason.empty());

  // Ranks: contiguous per node, local ranks 0..k-1, node ranks in order.
  std::map<std::string, uint32_t> first_rank, count;
  for (const auto& [id, a] : plan.ranked) {
    ++count[node_of[id]];
    first_rank.try_emplace(node_of[id], a.global_rank());
  }
  std::set<std::string> finished;
  std::string current;
  uint32_t node_rank = 0;
  for (size_t r = 0; r < plan.ranked.size(); ++r) {
    const auto& [id, a] = plan.ranked[r];
    const std::string& node = node_of[id];
    if (r > 0 && node != current) {
      EXPECT_TRUE(finished.insert(current).second);
      ++node_rank;
    }
    EXPECT_EQ(finished.count(node), 0u) << "the ranks of node " << node << " are not contiguous";
    current = node;
    EXPECT_EQ(a.global_rank(), r);
    EXPECT_EQ(a.world_size(), plan.ranked.size());
    EXPECT_EQ(a.node_rank(), node_rank);
    EXPECT_EQ(a.node_count(), count.size());
    EXPECT_EQ(a.local_rank(), r - first_rank[node]);
    EXPECT_EQ(a.local_world_size(), count[node]);
    EXPECT_LT(a.local_rank(), a.local_world_size());
    // Mesh coordinates: tp fastest, pp outermost.
    EXPECT_EQ(a.mesh().tp(), r % tp);
    EXPECT_EQ(a.mesh().dp(), r / tp % dp);
    EXPECT_EQ(a.mesh().pp(), r / (uint64_t{tp} * dp));
    EXPECT_LT(a.mesh().tp(), tp);
    EXPECT_LT(a.mesh().dp(), dp);
    EXPECT_LT(a.mesh().pp(), pp);
    // A tp group lies inside one node.
    EXPECT_EQ(node, node_of[plan.ranked[r / tp * tp].first]) << "tp group of rank " << r << " spans nodes";
  }
  for (const auto& [node, n] : count) EXPECT_EQ(n % tp, 0u) << "node " << node;

  // Every node with a remainder says so.
  std::map<std::string, size_t> workers_on;
  for (const WorkerSlot& w : workers) ++workers_on[w.node_id];
  for (const auto& [node, n] : workers_on) {
    if (n % tp != 0) {
      const std::string clause = "node " + node + " has " + std::to_string(n) + (n == 1 ? " worker" : " workers") +
                                 ", not a multiple of tp=" + std::to_string(tp);
      EXPECT_NE(plan.standby_reason.find(clause), std::string::npos) << plan.standby_reason;
    }
  }

  // The exact placement the rules in the header describe.
  const Model model = ModelPlan(workers, requested);
  ASSERT_EQ(model.code, StatusCode::kOk);
  std::vector<uint64_t> ranked, standby;
  for (const ModelNode& node : model.nodes) {
    ranked.insert(ranked.end(), node.members.begin(), node.members.begin() + static_cast<ptrdiff_t>(node.kept));
    standby.insert(standby.end(), node.members.begin() + static_cast<ptrdiff_t>(node.kept), node.members.end());
  }
  EXPECT_EQ(RankedIds(plan), ranked);
  EXPECT_EQ(plan.standby, standby);
}

TEST(PlanMeshProperty, RandomTopologiesGiveValidMeshesOrTheRightError) {
  int planned = 0, rejected = 0;
  for (int i = 0; i < kCases && !HasFailure(); ++i) {
    const uint64_t seed = BaseSeed() + static_cast<uint64_t>(i);
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    const std::vector<WorkerSlot> workers = RandomWorkers(rng, std::bernoulli_distribution(0.5)(rng));
    const v1::MeshShape requested = RandomMesh(rng);
    auto plan = PlanMesh(workers, requested);
    const Model model = ModelPlan(workers, requested);
    ASSERT_EQ(plan.status().code(), model.code) << plan.status().ToString();
    if (!plan.ok()) {
      ++rejected;
      EXPECT_FALSE(plan.status().message().empty());
      continue;
    }
    ++planned;
    CheckPlan(workers, requested, *plan);

    // The order of the input does not matter.
    std::vector<WorkerSlot> shuffled = workers;
    std::shuffle(shuffled.begin(), shuffled.end(), rng);
    auto again = PlanMesh(shuffled, requested);
    ASSERT_TRUE(again.ok());
    ASSERT_EQ(again->ranked.size(), plan->ranked.size());
    for (size_t r = 0; r < plan->ranked.size(); ++r) {
      EXPECT_EQ(again->ranked[r].first, plan->ranked[r].first);
      EXPECT_EQ(again->ranked[r].second.SerializeAsString(), plan->ranked[r].second.SerializeAsString());
    }
    EXPECT_EQ(again->standby, plan->standby);
    EXPECT_EQ(again->standby_reason, plan->standby_reason);
  }
  // Both outcomes were exercised.
  EXPECT_GT(planned, kCases / 4);
  EXPECT_GT(rejected, 10);
}

TEST(PlanMeshProperty, ImpossibleMeshesAreRejectedWithTheNumbers) {
  for (int i = 0; i < kCases && !HasFailure(); ++i) {
    const uint64_t seed = BaseSeed() + 100000 + static_cast<uint64_t>(i);
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    const std::vector<WorkerSlot> workers = RandomWorkers(rng, false);
    std::map<std::string, size_t> per_node;
    for (const WorkerSlot& w : workers) ++per_node[w.node_id];
    size_t largest = 0;
    for (const auto& [node, n] : per_node) largest = std::max(largest, n);

    // A tp wider than every node.
    const auto wide = static_cast<uint32_t>(largest + 1 + rng() % 4);
    EXPECT_EQ(PlanMesh(workers, Mesh(0, wide, 1)).status(),
              InvalidArgument("tp={} is larger than any node's worker count (largest: {})", wide, largest));

    // More pipeline stages than whole tp groups.
    const auto tp = static_cast<uint32_t>(1 + rng() % largest);
    uint64_t fit = 0;
    for (const auto& [node, n] : per_node) fit += n / tp * tp;
    const auto pp = static_cast<uint32_t>(fit / tp + 1);
    EXPECT_EQ(PlanMesh(workers, Mesh(0, tp, pp)).status(),
              FailedPrecondition("mesh tp={} x pp={} needs at least {} workers in whole tp groups of {} inside nodes; "
                                 "the members give {}",
                                 tp, pp, uint64_t{tp} * pp, tp, fit));

    // A fixed dp one slice too large.
    const auto dp = static_cast<uint32_t>(fit / tp + 1);
    EXPECT_EQ(PlanMesh(workers, Mesh(dp, tp, 1)).status(),
              FailedPrecondition("mesh dp={} x tp={} x pp=1 needs {} workers in whole tp groups of {} inside nodes; "
                                 "the members give {}",
                                 dp, tp, uint64_t{dp} * tp, tp, fit));
  }
}

// The next epoch: each worker leaves with probability `leave`, 0 to 4 new
// workers join (on existing or new nodes); ranked survivors carry their rank
// as previous_rank, standby survivors carry none.
std::vector<WorkerSlot> NextEpoch(std::mt19937_64& rng, const std::vector<WorkerSlot>& workers, const MeshPlan& plan,
                                  uint64_t& next_id) {
  std::map<uint64_t, uint32_t> rank_of;
  for (const auto& [id, a] : plan.ranked) rank_of[id] = a.global_rank();
  const double leave = std::uniform_real_distribution<double>(0.0, 0.3)(rng);
  std::vector<WorkerSlot> next;
  std::vector<std::string> nodes;
  for (const WorkerSlot& w : workers) {
    nodes.push_back(w.node_id);
    if (std::bernoulli_distribution(leave)(rng)) continue;
    WorkerSlot s = w;
    s.previous_rank = rank_of.count(w.member_id) != 0 ? std::optional<uint32_t>(rank_of[w.member_id]) : std::nullopt;
    next.push_back(std::move(s));
  }
  for (int k = std::uniform_int_distribution<int>(0, 4)(rng); k > 0; --k) {
    std::string node = std::bernoulli_distribution(0.5)(rng)
                           ? nodes[std::uniform_int_distribution<size_t>(0, nodes.size() - 1)(rng)]
                           : "new-" + std::to_string(next_id);
    next.push_back(Worker(next_id++, std::move(node)));
  }
  std::shuffle(next.begin(), next.end(), rng);
  return next;
}

// Ranked members per node, by node rank.
std::vector<std::pair<std::string, std::vector<uint64_t>>> RankedByNode(const std::vector<WorkerSlot>& workers,
                                                                        const MeshPlan& plan) {
  std::map<uint64_t, std::string> node_of;
  for (const WorkerSlot& w : workers) node_of[w.member_id] = w.node_id;
  std::vector<std::pair<std::string, std::vector<uint64_t>>> nodes;
  for (const auto& [id, a] : plan.ranked) {
    if (nodes.empty() || nodes.back().first != node_of[id]) nodes.emplace_back(node_of[id], std::vector<uint64_t>{});
    nodes.back().second.push_back(id);
  }
  return nodes;
}

TEST(PlanMeshProperty, RanksAreStableAcrossEpochs) {
  int epochs = 0, kept_exactly = 0;
  for (int i = 0; i < kCases && !HasFailure(); ++i) {
    const uint64_t seed = BaseSeed() + 200000 + static_cast<uint64_t>(i);
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    std::vector<WorkerSlot> workers = RandomWorkers(rng, false);
    static constexpr uint32_t kTp[] = {1, 1, 2, 4};
    const v1::MeshShape requested = Mesh(0, kTp[rng() % 4], static_cast<uint32_t>(1 + rng() % 2));
    auto plan = PlanMesh(workers, requested);
    if (!plan.ok()) continue;
    uint64_t next_id = 100000;
    for (int e = 0; e < 6 && !HasFailure(); ++e) {
      std::vector<WorkerSlot> next = NextEpoch(rng, workers, *plan, next_id);
      auto next_plan = PlanMesh(next, requested);
      if (!next_plan.ok()) break;  // too few left for the mesh
      ++epochs;
      CheckPlan(next, requested, *next_plan);

      // Survivors (ranked in both epochs) keep their relative order.
      std::map<uint64_t, uint32_t> before;
      for (const auto& [id, a] : plan->ranked) before[id] = a.global_rank();
      std::vector<uint32_t> previous_ranks_in_new_order;
      for (const auto& [id, a] : next_plan->ranked) {
        if (before.count(id) != 0) previous_ranks_in_new_order.push_back(before[id]);
      }
      EXPECT_TRUE(std::is_sorted(previous_ranks_in_new_order.begin(), previous_ranks_in_new_order.end()));

      // Survivors on nodes before the first change keep their exact ranks.
      const auto old_nodes = RankedByNode(workers, *plan);
      const auto new_nodes = RankedByNode(next, *next_plan);
      std::map<uint64_t, uint32_t> after;
      for (const auto& [id, a] : next_plan->ranked) after[id] = a.global_rank();
      for (size_t n = 0; n < old_nodes.size() && n < new_nodes.size() && old_nodes[n] == new_nodes[n]; ++n) {
        for (uint64_t id : old_nodes[n].second) {
          EXPECT_EQ(after[id], before[id]) << "member " << id << " on unchanged node " << old_nodes[n].first;
          ++kept_exactly;
        }
      }
      workers = std::move(next);
      plan = std::move(next_plan);
    }
  }
  EXPECT_GT(epochs, kCases);
  EXPECT_GT(kept_exactly, kCases);
}

// ===========================================================================
// Examples: shard map
// ===========================================================================

// "primary/backup" of every partition.
std::vector<std::string> Placement(const v1::ShardMap& map) {
  std::vector<std::string> out;
  for (const v1::Partition& p : map.partitions()) {
    out.push_back(std::to_string(p.primary_member_id()) + "/" + std::to_string(p.backup_member_id()));
  }
  return out;
}

TEST(ShardMapExample, PartitionsAreFixedSizeRoundRobinWithTheNextServerAsBackup) {
  auto map = BuildShardMap(10, 4, {30, 10, 20}, 1);
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  EXPECT_EQ(map->partition_size(), 4u);
  EXPECT_EQ(map->parameter_count(), 10u);
  EXPECT_EQ(map->version(), 1u);
  ASSERT_EQ(map->partitions_size(), 3);
  EXPECT_EQ(map->partitions(0).range().begin(), 0u);
  EXPECT_EQ(map->partitions(0).range().end(), 4u);
  EXPECT_EQ(map->partitions(2).range().begin(), 8u);
  EXPECT_EQ(map->partitions(2).range().end(), 10u);  // the last one is short
  EXPECT_EQ(Placement(*map), (std::vector<std::string>{"10/20", "20/30", "30/10"}));
}

TEST(ShardMapExample, OneServerMeansNoBackupAndNoParametersMeansNoPartitions) {
  auto single = BuildShardMap(8, 4, {5}, 1);
  ASSERT_TRUE(single.ok());
  EXPECT_EQ(Placement(*single), (std::vector<std::string>{"5/0", "5/0"}));

  auto empty = BuildShardMap(0, 4, {}, 1);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->partitions_size(), 0);
}

TEST(ShardMapExample, BadRequestsSayWhy) {
  EXPECT_EQ(BuildShardMap(10, 0, {1}, 1).status(), InvalidArgument("partition size must be at least 1 element, got 0"));
  EXPECT_EQ(BuildShardMap(10, 4, {}, 1).status(),
            InvalidArgument("10 parameters in 3 partitions need at least one server; none were given"));
  EXPECT_EQ(BuildShardMap((1u << 21) + 1, 2, {1}, 1).status(),
            InvalidArgument("2097153 parameters in partitions of 2 elements make 1048577 partitions, more than the "
                            "limit of 1048576; the partition size is too small, use at least 3 elements"));
  EXPECT_EQ(BuildShardMap(10, 4, {1, 2, 1}, 1).status(),
            InvalidArgument("server member id 1 is listed more than once"));
  EXPECT_EQ(BuildShardMap(10, 4, {0, 2}, 1).status(),
            InvalidArgument("server member id 0 is not a valid id (ids start at 1)"));
  EXPECT_EQ(BuildShardMap(10, 4, {1}, 0).status(), InvalidArgument("shard map version must be at least 1, got 0"));
  EXPECT_EQ(BuildShardMap((uint64_t{1} << 40) + 1, 1u << 30, {1}, 1).status(),
            InvalidArgument("parameter count 1099511627777 is more than the limit of 1099511627776 (2^40) elements"));
}

TEST(ShardMapExample, ADeadServersPartitionsMoveToTheirBackups) {
  auto map = BuildShardMap(60, 10, {1, 2, 3}, 1);
  ASSERT_TRUE(map.ok());
  EXPECT_EQ(Placement(*map), (std::vector<std::string>{"1/2", "2/3", "3/1", "1/2", "2/3", "3/1"}));

  // Server 2 dies: its partitions 1 and 4 are served by their backup 3; every
  // partition that lost its backup gets one on the other live server.
  auto change = ReassignShardMap(*map, {1, 3}, 2);
  ASSERT_TRUE(change.ok()) << change.status().ToString();
  EXPECT_EQ(Placement(change->map), (std::vector<std::string>{"1/3", "3/1", "3/1", "1/3", "3/1", "3/1"}));
  EXPECT_EQ(change->promoted, (std::vector<uint32_t>{1, 4}));
  EXPECT_TRUE(change->lost.empty());
  EXPECT_EQ(change->new_backups, (std::vector<uint32_t>{0, 1, 3, 4}));
  EXPECT_EQ(change->map.version(), 2u);
}

TEST(ShardMapExample, AJoiningServerTakesNoPrimariesButTheNextBackups) {
  auto map = BuildShardMap(30, 10, {1, 2}, 1);
  ASSERT_TRUE(map.ok());
  EXPECT_EQ(Placement(*map), (std::vector<std::string>{"1/2", "2/1", "1/2"}));

  // Server 3 joins: nothing moves, so the version stays.
  auto joined = ReassignShardMap(*map, {1, 2, 3}, 2);
  ASSERT_TRUE(joined.ok());
  EXPECT_EQ(Placement(joined->map), Placement(*map));
  EXPECT_EQ(joined->map.version(), 1u);
  EXPECT_TRUE(joined->promoted.empty() && joined->lost.empty() && joined->new_backups.empty());

  // Server 1 dies: its partitions go to server 2, and server 3 (fewest
  // backups) takes the new backups.
  auto failed = ReassignShardMap(joined->map, {2, 3}, 3);
  ASSERT_TRUE(failed.ok());
  EXPECT_EQ(Placement(failed->map), (std::vector<std::string>{"2/3", "2/3", "2/3"}));
  EXPECT_EQ(failed->promoted, (std::vector<uint32_t>{0, 2}));
  EXPECT_EQ(failed->new_backups, (std::vector<uint32_t>{0, 1, 2}));
  EXPECT_EQ(failed->map.version(), 3u);
}

TEST(ShardMapExample, PartitionsWhoseServersBothDiedAreLost) {
  auto map = BuildShardMap(20, 10, {1, 2}, 1);
  ASSERT_TRUE(map.ok());
  auto change = ReassignShardMap(*map, {5, 6}, 2);
  ASSERT_TRUE(change.ok());
  EXPECT_EQ(change->lost, (std::vector<uint32_t>{0, 1}));
  EXPECT_EQ(Placement(change->map), (std::vector<std::string>{"5/6", "6/5"}));

  EXPECT_EQ(ReassignShardMap(*map, {}, 2).status(),
            FailedPrecondition("no live server to hold the 2 partitions of the shard map"));
  EXPECT_EQ(ReassignShardMap(*map, {1, 2}, 1).status(),
            InvalidArgument("new shard map version 1 must be greater than the previous version 1"));
  v1::ShardMap broken = *map;
  broken.mutable_partitions(1)->mutable_range()->set_end(19);
  EXPECT_EQ(ReassignShardMap(broken, {1, 2}, 2).status(),
            InvalidArgument("previous shard map: partition 1 covers [10, 19) but should cover [10, 20)"));
}

// Primary counts by server, over the servers that hold a partition.
std::map<uint64_t, int> PrimaryCounts(const v1::ShardMap& map) {
  std::map<uint64_t, int> counts;
  for (const auto& p : map.partitions()) {
    ++counts[p.primary_member_id()];
    if (p.backup_member_id() != 0) counts.try_emplace(p.backup_member_id(), 0);
  }
  return counts;
}

TEST(RebalancePrimariesExample, ABalancedMapIsLeftAsItIs) {
  for (const std::vector<uint64_t>& servers : {std::vector<uint64_t>{1, 2}, std::vector<uint64_t>{1, 2, 3}}) {
    auto map = BuildShardMap(70, 10, servers, 1);
    ASSERT_TRUE(map.ok());
    auto same = RebalancePrimaries(*map, 2);
    ASSERT_TRUE(same.ok()) << same.status().ToString();
    EXPECT_EQ(same->map.SerializeAsString(), map->SerializeAsString());
    EXPECT_TRUE(same->swapped.empty());
    EXPECT_EQ(same->map.version(), 1u);
  }
}

TEST(RebalancePrimariesExample, ARestartedServerGetsHalfThePrimariesBackInTheFewestSwaps) {
  auto map = BuildShardMap(80, 10, {1, 2}, 1);
  ASSERT_TRUE(map.ok());
  // Server 1 dies and comes back: server 2 is primary of all 8, server 1 backs them up.
  auto failed = ReassignShardMap(*map, {2}, 2);
  ASSERT_TRUE(failed.ok());
  auto back = ReassignShardMap(failed->map, {1, 2}, 3);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(Placement(back->map), std::vector<std::string>(8, "2/1"));

  auto rebalanced = RebalancePrimaries(back->map, 4);
  ASSERT_TRUE(rebalanced.ok()) << rebalanced.status().ToString();
  EXPECT_EQ(Placement(rebalanced->map),
            (std::vector<std::string>{"1/2", "1/2", "1/2", "1/2", "2/1", "2/1", "2/1", "2/1"}));
  EXPECT_EQ(rebalanced->swapped, (std::vector<uint32_t>{0, 1, 2, 3}));
  EXPECT_EQ(rebalanced->map.version(), 4u);

  // Balanced now: no churn.
  auto again = RebalancePrimaries(rebalanced->map, 5);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->swapped.empty());
  EXPECT_EQ(again->map.SerializeAsString(), rebalanced->map.SerializeAsString());
}

TEST(RebalancePrimariesExample, UnevenCountsEndWithinOneOfEachOther) {
  // Seven partitions over three servers, primaries 5, 2 and 0.
  auto map = BuildShardMap(70, 10, {1, 2, 3}, 1);
  ASSERT_TRUE(map.ok());
  const std::vector<std::pair<uint64_t, uint64_t>> placement = {{1, 3}, {1, 2}, {1, 3}, {1, 2}, {1, 3}, {2, 3}, {2, 3}};
  for (auto& p : *map->mutable_partitions()) {
    p.set_primary_member_id(placement[p.id()].first);
    p.set_backup_member_id(placement[p.id()].second);
  }
  EXPECT_EQ(PrimaryCounts(*map), (std::map<uint64_t, int>{{1, 5}, {2, 2}, {3, 0}}));

  // Server 1 is 5 apart from server 3, which backs up 0, 2 and 4: two of
  // them swap, the fewest that bring every count within one of the others.
  auto rebalanced = RebalancePrimaries(*map, 2);
  ASSERT_TRUE(rebalanced.ok()) << rebalanced.status().ToString();
  EXPECT_EQ(PrimaryCounts(rebalanced->map), (std::map<uint64_t, int>{{1, 3}, {2, 2}, {3, 2}}));
  EXPECT_EQ(rebalanced->swapped, (std::vector<uint32_t>{0, 2}));
  EXPECT_EQ(Placement(rebalanced->map), (std::vector<std::string>{"3/1", "1/2", "3/1", "1/2", "1/3", "2/3", "2/3"}));
  EXPECT_EQ(rebalanced->map.version(), 2u);
}

TEST(RebalancePrimariesExample, APartitionWithoutABackupNeverMoves) {
  auto map = BuildShardMap(60, 10, {1, 2}, 1);
  ASSERT_TRUE(map.ok());
  // Server 1 is primary of all six; only partitions 4 and 5 have a backup.
  for (auto& p : *map->mutable_partitions()) {
    p.set_primary_member_id(1);
    p.set_backup_member_id(p.id() >= 4 ? 2 : 0);
  }
  auto rebalanced = RebalancePrimaries(*map, 2);
  ASSERT_TRUE(rebalanced.ok()) << rebalanced.status().ToString();
  EXPECT_EQ(Placement(rebalanced->map), (std::vector<std::string>{"1/0", "1/0", "1/0", "1/0", "2/1", "2/1"}));
  EXPECT_EQ(rebalanced->swapped, (std::vector<uint32_t>{4, 5}));

  // No backups at all (a single server): nothing moves.
  auto single = BuildShardMap(60, 10, {1}, 1);
  ASSERT_TRUE(single.ok());
  auto same = RebalancePrimaries(*single, 2);
  ASSERT_TRUE(same.ok());
  EXPECT_TRUE(same->swapped.empty());
  EXPECT_EQ(same->map.version(), 1u);
}

TEST(RebalancePrimariesExample, BadRequestsSayWhy) {
  auto map = BuildShardMap(20, 10, {1, 2}, 3);
  ASSERT_TRUE(map.ok());
  EXPECT_EQ(RebalancePrimaries(*map, 3).status(),
            InvalidArgument("new shard map version 3 must be greater than the previous version 3"));
  v1::ShardMap broken = *map;
  broken.mutable_partitions(0)->set_backup_member_id(1);
  EXPECT_EQ(RebalancePrimaries(broken, 4).status(),
            InvalidArgument("previous shard map: partition 0 has server 1 as both primary and backup"));
}

// Partitions held (as primary or backup) by server, over `servers` and the
// servers that hold a partition.
std::map<uint64_t, int> Holdings(const v1::ShardMap& map, const std::vector<uint64_t>& servers) {
  std::map<uint64_t, int> counts;
  for (uint64_t id : servers) counts[id] = 0;
  for (const auto& p : map.partitions()) {
    ++counts[p.primary_member_id()];
    if (p.backup_member_id() != 0) ++counts[p.backup_member_id()];
  }
  return counts;
}

TEST(RebalanceBackupsExample, AServerBackAmongThreeGetsBackupsThenPrimaries) {
  auto map = BuildShardMap(120, 10, {1, 2, 3}, 1);
  ASSERT_TRUE(map.ok());
  auto same = RebalanceBackups(*map, {1, 2, 3}, 2);
  ASSERT_TRUE(same.ok()) << same.status().ToString();
  EXPECT_TRUE(same->moved.empty());
  EXPECT_EQ(same->map.SerializeAsString(), map->SerializeAsString());

  // Server 3 dies and comes back: 1 and 2 keep every primary and backup
  // between them, and 3 holds nothing.
  auto failed = ReassignShardMap(*map, {1, 2}, 2);
  ASSERT_TRUE(failed.ok());
  auto back = ReassignShardMap(failed->map, {1, 2, 3}, 3);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(Holdings(back->map, {1, 2, 3}), (std::map<uint64_t, int>{{1, 12}, {2, 12}, {3, 0}}));
  // Swapping alone cannot help it.
  auto no_swap = RebalancePrimaries(back->map, 4);
  ASSERT_TRUE(no_swap.ok());
  EXPECT_EQ(PrimaryCounts(no_swap->map)[3], 0);

  // Backups move to it first: 8 of the 24 holdings.
  auto moved = RebalanceBackups(back->map, {1, 2, 3}, 4);
  ASSERT_TRUE(moved.ok()) << moved.status().ToString();
  EXPECT_EQ(moved->moved.size(), 8u);
  EXPECT_EQ(moved->map.version(), 4u);
  EXPECT_EQ(Holdings(moved->map, {1, 2, 3}), (std::map<uint64_t, int>{{1, 8}, {2, 8}, {3, 8}}));
  for (int i = 0; i < back->map.partitions_size(); ++i) {
    EXPECT_EQ(moved->map.partitions(i).primary_member_id(), back->map.partitions(i).primary_member_id());
  }
  // Once they hold their state, swaps give it a third of the primaries.
  auto swapped = RebalancePrimaries(moved->map, 5);
  ASSERT_TRUE(swapped.ok());
  EXPECT_EQ(PrimaryCounts(swapped->map), (std::map<uint64_t, int>{{1, 4}, {2, 4}, {3, 4}}));
  EXPECT_EQ(Holdings(swapped->map, {1, 2, 3}), (std::map<uint64_t, int>{{1, 8}, {2, 8}, {3, 8}}));
  // Even: neither step changes anything more.
  auto settled = RebalanceBackups(swapped->map, {1, 2, 3}, 6);
  ASSERT_TRUE(settled.ok());
  EXPECT_TRUE(settled->moved.empty());
  EXPECT_TRUE(RebalancePrimaries(swapped->map, 6)->swapped.empty());
}

TEST(RebalanceBackupsExample, AServerAddedToTheJobTakesItsShare) {
  auto map = BuildShardMap(120, 10, {1, 2, 3}, 1);
  ASSERT_TRUE(map.ok());
  auto moved = RebalanceBackups(*map, {1, 2, 3, 4}, 2);
  ASSERT_TRUE(moved.ok()) << moved.status().ToString();
  EXPECT_EQ(Holdings(moved->map, {1, 2, 3, 4}), (std::map<uint64_t, int>{{1, 6}, {2, 6}, {3, 6}, {4, 6}}));
  auto swapped = RebalancePrimaries(moved->map, 3);
  ASSERT_TRUE(swapped.ok());
  EXPECT_EQ(PrimaryCounts(swapped->map), (std::map<uint64_t, int>{{1, 3}, {2, 3}, {3, 3}, {4, 3}}));
}

TEST(RebalanceBackupsExample, BadRequestsSayWhy) {
  auto map = BuildShardMap(20, 10, {1, 2}, 3);
  ASSERT_TRUE(map.ok());
  EXPECT_EQ(RebalanceBackups(*map, {1, 2}, 3).status(),
            InvalidArgument("new shard map version 3 must be greater than the previous version 3"));
  EXPECT_EQ(RebalanceBackups(*map, {1, 0}, 4).status(), InvalidArgument("server id 0 is not a valid member id"));
  EXPECT_EQ(RebalanceBackups(*map, {2, 1, 2}, 4).status(), InvalidArgument("server 2 is listed twice"));
}

// ===========================================================================
// Properties: shard map
// ===========================================================================

std::vector<uint64_t> RandomServers(std::mt19937_64& rng, uint64_t& next_id, int min, int max) {
  std::vector<uint64_t> ids;
  for (int k = std::uniform_int_distribution<int>(min, max)(rng); k > 0; --k) {
    next_id += 1 + rng() % 7;
    ids.push_back(next_id);
  }
  std::shuffle(ids.begin(), ids.end(), rng);
  return ids;
}

// Partitions cover [0, parameter_count) exactly, in order.
void CheckCoverage(const v1::ShardMap& map, uint64_t parameter_count, uint64_t partition_size) {
  EXPECT_EQ(map.parameter_count(), parameter_count);
  EXPECT_EQ(map.partition_size(), partition_size);
  ASSERT_EQ(static_cast<uint64_t>(map.partitions_size()), (parameter_count + partition_size - 1) / partition_size);
  uint64_t next = 0;
  for (int i = 0; i < map.partitions_size(); ++i) {
    const v1::Partition& p = map.partitions(i);
    EXPECT_EQ(p.id(), static_cast<uint32_t>(i));
    EXPECT_EQ(p.range().begin(), next);
    EXPECT_EQ(p.range().end(), std::min(next + partition_size, parameter_count));
    EXPECT_LT(p.range().begin(), p.range().end());
    next = p.range().end();
  }
  EXPECT_EQ(next, parameter_count);
}

TEST(ShardMapProperty, NewMapsCoverTheSpaceAndBalancePrimariesAndBackups) {
  for (int i = 0; i < kCases && !HasFailure(); ++i) {
    const uint64_t seed = BaseSeed() + 300000 + static_cast<uint64_t>(i);
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    uint64_t next_id = 0;
    const std::vector<uint64_t> servers = RandomServers(rng, next_id, 1, 9);
    const uint64_t size = 1 + rng() % 5000;
    const uint64_t count = std::bernoulli_distribution(0.2)(rng) ? size * (rng() % 40) : rng() % 200000;
    const uint64_t version = 1 + rng() % 100;
    auto map = BuildShardMap(count, size, servers, version);
    ASSERT_TRUE(map.ok()) << map.status().ToString();
    EXPECT_EQ(map->version(), version);
    CheckCoverage(*map, count, size);

    std::vector<uint64_t> sorted = servers;
    std::sort(sorted.begin(), sorted.end());
    std::map<uint64_t, int> primaries, backups;
    for (uint64_t s : servers) primaries[s] = backups[s] = 0;
    for (const v1::Partition& p : map->partitions()) {
      ++primaries[p.primary_member_id()];
      const size_t at =
          static_cast<size_t>(std::find(sorted.begin(), sorted.end(), p.primary_member_id()) - sorted.begin());
      ASSERT_LT(at, sorted.size()) << "unknown primary " << p.primary_member_id();
      if (sorted.size() == 1) {
        EXPECT_EQ(p.backup_member_id(), 0u);
      } else {
        EXPECT_NE(p.backup_member_id(), p.primary_member_id());
        EXPECT_EQ(p.backup_member_id(), sorted[(at + 1) % sorted.size()]);
        ++backups[p.backup_member_id()];
      }
    }
    auto spread = [](const std::map<uint64_t, int>& load) {
      auto [lo, hi] = std::minmax_element(load.begin(), load.end(),
                                          [](const auto& a, const auto& b) { return a.second < b.second; });
      return hi->second - lo->second;
    };
    EXPECT_LE(spread(primaries), 1);
    if (sorted.size() >= 2) {
      EXPECT_LE(spread(backups), 1);
    }
  }
}

TEST(ShardMapProperty, FailoverKeepsLivePrimariesPromotesBackupsAndLosesOnlyWhatBothServersHeld) {
  int promoted = 0, lost = 0;
  for (int i = 0; i < kCases && !HasFailure(); ++i) {
    const uint64_t seed = BaseSeed() + 400000 + static_cast<uint64_t>(i);
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    uint64_t next_id = 0;
    std::vector<uint64_t> servers = RandomServers(rng, next_id, 1, 8);
    const uint64_t size = 1 + rng() % 100;
    auto built = BuildShardMap(rng() % 5000, size, servers, 1);
    ASSERT_TRUE(built.ok());
    v1::ShardMap map = *built;
    for (int e = 0; e < 6 && !HasFailure(); ++e) {
      // Each server survives with probability 0.7; 0 to 3 join; at least one is live.
      std::vector<uint64_t> live;
      for (uint64_t s : servers) {
        if (std::bernoulli_distribution(0.7)(rng)) live.push_back(s);
      }
      for (uint64_t s : RandomServers(rng, next_id, live.empty() ? 1 : 0, 3)) live.push_back(s);
      const std::set<uint64_t> alive(live.begin(), live.end());
      const uint64_t version = map.version() + 1 + rng() % 3;
      auto change = ReassignShardMap(map, live, version);
      ASSERT_TRUE(change.ok()) << change.status().ToString();
      const v1::ShardMap& next = change->map;
      CheckCoverage(next, map.parameter_count(), map.partition_size());
      const std::set<uint32_t> promoted_set(change->promoted.begin(), change->promoted.end());
      const std::set<uint32_t> lost_set(change->lost.begin(), change->lost.end());
      const std::set<uint32_t> new_backup_set(change->new_backups.begin(), change->new_backups.end());
      EXPECT_TRUE(std::is_sorted(change->promoted.begin(), change->promoted.end()));
      EXPECT_TRUE(std::is_sorted(change->lost.begin(), change->lost.end()));
      EXPECT_TRUE(std::is_sorted(change->new_backups.begin(), change->new_backups.end()));
      EXPECT_EQ(promoted_set.size(), change->promoted.size());
      EXPECT_EQ(lost_set.size(), change->lost.size());
      EXPECT_EQ(new_backup_set.size(), change->new_backups.size());

      bool changed = false;
      for (int k = 0; k < next.partitions_size(); ++k) {
        const v1::Partition& was = map.partitions(k);
        const v1::Partition& now = next.partitions(k);
        const auto id = static_cast<uint32_t>(k);
        const bool primary_alive = alive.count(was.primary_member_id()) != 0;
        const bool backup_alive = was.backup_member_id() != 0 && alive.count(was.backup_member_id()) != 0;
        if (primary_alive) {
          EXPECT_EQ(now.primary_member_id(), was.primary_member_id()) << "partition " << k;
        } else if (backup_alive) {
          EXPECT_EQ(now.primary_member_id(), was.backup_member_id()) << "partition " << k;
        }
        EXPECT_EQ(promoted_set.count(id) != 0, !primary_alive && backup_alive) << "partition " << k;
        EXPECT_EQ(lost_set.count(id) != 0, !primary_alive && !backup_alive) << "partition " << k;
        // Every partition has a live primary and, with two live servers or
        // more, a live backup on another server.
        EXPECT_EQ(alive.count(now.primary_member_id()), 1u) << "partition " << k;
        if (alive.size() >= 2) {
          EXPECT_EQ(alive.count(now.backup_member_id()), 1u) << "partition " << k;
          EXPECT_NE(now.backup_member_id(), now.primary_member_id()) << "partition " << k;
        } else {
          EXPECT_EQ(now.backup_member_id(), 0u) << "partition " << k;
        }
        // Surviving backups stay; every other backup is new.
        if (primary_alive && backup_alive) {
          EXPECT_EQ(now.backup_member_id(), was.backup_member_id());
        }
        EXPECT_EQ(new_backup_set.count(id) != 0,
                  now.backup_member_id() != 0 && (now.backup_member_id() != was.backup_member_id() || !primary_alive))
            << "partition " << k;
        changed = changed || now.primary_member_id() != was.primary_member_id() ||
                  now.backup_member_id() != was.backup_member_id();
      }
      EXPECT_EQ(next.version(), changed ? version : map.version());
      promoted += static_cast<int>(change->promoted.size());
      lost += static_cast<int>(change->lost.size());

      // Deterministic whatever the order of the live ids.
      std::vector<uint64_t> shuffled = live;
      std::shuffle(shuffled.begin(), shuffled.end(), rng);
      auto again = ReassignShardMap(map, shuffled, version);
      ASSERT_TRUE(again.ok());
      EXPECT_EQ(again->map.SerializeAsString(), next.SerializeAsString());

      // Reassigning to the same live servers changes nothing.
      auto same = ReassignShardMap(next, live, version + 1);
      ASSERT_TRUE(same.ok());
      EXPECT_EQ(Placement(same->map), Placement(next));
      EXPECT_EQ(same->map.version(), next.version());
      EXPECT_TRUE(same->promoted.empty() && same->lost.empty() && same->new_backups.empty());

      map = next;
      servers = live;
    }
  }
  EXPECT_GT(promoted, 0);
  EXPECT_GT(lost, 0);
}

TEST(RebalancePrimariesProperty, SwapsOnlyPrimaryAndBackupAndLeavesNoMoveThatWouldHelp) {
  for (int i = 0; i < kCases && !HasFailure(); ++i) {
    const uint64_t seed = BaseSeed() + 500000 + static_cast<uint64_t>(i);
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    uint64_t next_id = 0;
    const std::vector<uint64_t> servers = RandomServers(rng, next_id, 2, 6);
    const uint64_t partitions = 1 + rng() % 40;
    auto built = BuildShardMap(partitions * 4, 4, servers, 1);
    ASSERT_TRUE(built.ok());
    v1::ShardMap map = *built;
    // Random placements: any primary, a backup on another server or none.
    for (auto& p : *map.mutable_partitions()) {
      const uint64_t primary = servers[rng() % servers.size()];
      uint64_t backup = rng() % 5 == 0 ? 0 : servers[rng() % servers.size()];
      if (backup == primary) backup = 0;
      p.set_primary_member_id(primary);
      p.set_backup_member_id(backup);
    }
    auto result = RebalancePrimaries(map, 2);
    ASSERT_TRUE(result.ok()) << result.status().ToString();
    const v1::ShardMap& next = result->map;
    CheckCoverage(next, partitions * 4, 4);
    std::set<uint32_t> swapped(result->swapped.begin(), result->swapped.end());
    EXPECT_EQ(swapped.size(), result->swapped.size());
    for (int k = 0; k < map.partitions_size(); ++k) {
      const auto& was = map.partitions(k);
      const auto& now = next.partitions(k);
      if (swapped.count(was.id())) {
        EXPECT_NE(was.backup_member_id(), 0u);
        EXPECT_EQ(now.primary_member_id(), was.backup_member_id());
        EXPECT_EQ(now.backup_member_id(), was.primary_member_id());
      } else {
        EXPECT_EQ(now.primary_member_id(), was.primary_member_id());
        EXPECT_EQ(now.backup_member_id(), was.backup_member_id());
      }
    }
    // Each swap moves a primary to a server with fewer: the spread never grows.
    const auto before = PrimaryCounts(map);
    const auto counts = PrimaryCounts(next);
    auto spread = [](const std::map<uint64_t, int>& c) {
      auto [lo, hi] = std::minmax_element(c.begin(), c.end(), [](auto& a, auto& b) { return a.second < b.second; });
      return hi->second - lo->second;
    };
    EXPECT_LE(spread(counts), spread(before));
    // No partition could still move to a server with at least 2 fewer primaries.
    for (const auto& p : next.partitions()) {
      if (p.backup_member_id() == 0) continue;
      EXPECT_LT(counts.at(p.primary_member_id()), counts.at(p.backup_member_id()) + 2) << "partition " << p.id();
    }
    EXPECT_EQ(next.version(), swapped.empty() ? map.version() : 2u);
    // Balanced now: a second pass changes nothing.
    auto again = RebalancePrimaries(next, 3);
    ASSERT_TRUE(again.ok());
    EXPECT_TRUE(again->swapped.empty());
    EXPECT_EQ(again->map.SerializeAsString(), next.SerializeAsString());
  }
}

TEST(RebalanceBackupsProperty, ServersThatLeftAndCameBackOrJoinedEndWithTheirShare) {
  for (int i = 0; i < kCases && !HasFailure(); ++i) {
    const uint64_t seed = BaseSeed() + 600000 + static_cast<uint64_t>(i);
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    uint64_t next_id = 0;
    std::vector<uint64_t> servers = RandomServers(rng, next_id, 2, 6);
    const uint64_t partitions = 1 + rng() % 40;
    auto built = BuildShardMap(partitions * 4, 4, servers, 1);
    ASSERT_TRUE(built.ok());
    v1::ShardMap map = *built;
    uint64_t version = 1;
    // Servers die and come back, or join, the survivors keeping the map
    // (ReassignShardMap); then rounds of backups then swaps, as the
    // coordinator runs them, until neither changes anything.
    for (int event = 0; event < 3; ++event) {
      std::vector<uint64_t> live = servers;
      if (live.size() > 2 && rng() % 2 == 0) {
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(rng() % live.size()));
        auto failed = ReassignShardMap(map, live, ++version);
        ASSERT_TRUE(failed.ok());
        map = failed->map;
      } else {
        servers.push_back(++next_id + 1000);
      }
      auto back = ReassignShardMap(map, servers, ++version);
      ASSERT_TRUE(back.ok());
      map = back->map;
    }
    for (int round = 0; round < 8; ++round) {
      const v1::ShardMap before = map;
      auto moved = RebalanceBackups(map, servers, version + 1);
      ASSERT_TRUE(moved.ok()) << moved.status().ToString();
      CheckCoverage(moved->map, partitions * 4, 4);
      for (int k = 0; k < map.partitions_size(); ++k) {
        const auto& was = map.partitions(k);
        const auto& now = moved->map.partitions(k);
        EXPECT_EQ(now.primary_member_id(), was.primary_member_id());
        EXPECT_NE(now.backup_member_id(), now.primary_member_id());
        EXPECT_EQ(now.backup_member_id() == 0, was.backup_member_id() == 0);
      }
      if (!moved->moved.empty()) {
        map = moved->map;
        ++version;
        continue;  // the swaps wait until the new backups hold their state
      }
      auto swapped = RebalancePrimaries(map, version + 1);
      ASSERT_TRUE(swapped.ok());
      if (swapped->swapped.empty()) break;
      map = swapped->map;
      ++version;
      ASSERT_NE(map.SerializeAsString(), before.SerializeAsString());
    }
    // Every server holds its share, within one, and so many primaries.
    const auto holdings = Holdings(map, servers);
    auto spread = [](const std::map<uint64_t, int>& c) {
      auto [lo, hi] = std::minmax_element(c.begin(), c.end(), [](auto& a, auto& b) { return a.second < b.second; });
      return hi->second - lo->second;
    };
    EXPECT_LE(spread(holdings), 1) << ::testing::PrintToString(holdings);
    std::map<uint64_t, int> primaries;
    for (uint64_t id : servers) primaries[id] = 0;
    for (const auto& p : map.partitions()) ++primaries[p.primary_member_id()];
    EXPECT_LE(spread(primaries), 1) << ::testing::PrintToString(primaries) << ::testing::PrintToString(Placement(map));
  }
}

}  // namespace
}  // namespace tandem::coordinator
