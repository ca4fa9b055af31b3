#include "coordinator/assignment.h"

#include <algorithm>
#include <deque>
#include <limits>
#include <map>
#include <set>
#include <string_view>
#include <tuple>

#include <fmt/format.h>

namespace tandem::coordinator {
namespace {

// "1 worker", "3 workers".
std::string Workers(uint64_t n) {
  return n == 1 ? std::string("1 worker") : fmt::format("{} workers", n);
}

// A node and the workers on it, in placement order.
struct Node {
  std::string id;
  std::optional<uint32_t> first_previous;  // smallest previous_rank among its workers
  std::vector<const WorkerSlot*> members;
  size_t kept = 0;  // the first `kept` members are ranked
};

Status CheckDimension(std::string_view name, uint32_t value) {
  if (value > kMaxMeshDimension) {
    return InvalidArgument("mesh {}={} is out of range: dp, tp and pp must each be at most {} (0 means choose)", name,
                           value, kMaxMeshDimension);
  }
  return Status::Ok();
}

Status CheckWorkers(std::vector<WorkerSlot>& workers) {
  if (workers.size() > std::numeric_limits<uint32_t>::max()) {
    return InvalidArgument("{} workers are more than ranks can count (at most {})", workers.size(),
                           std::numeric_limits<uint32_t>::max());
  }
  std::sort(workers.begin(), workers.end(),
            [](const WorkerSlot& a, const WorkerSlot& b) { return a.member_id < b.member_id; });
  std::vector<std::pair<uint32_t, uint64_t>> previous;  // (previous_rank, member_id)
  for (size_t i = 0; i < workers.size(); ++i) {
    const WorkerSlot& w = workers[i];
    if (w.member_id == 0) return InvalidArgument("worker member_id 0 is not a valid id (ids start at 1)");
    if (i > 0 && workers[i - 1].member_id == w.member_id) {
      return InvalidArgument("worker member_id {} is listed more than once", w.member_id);
    }
    if (w.node_id.empty()) return InvalidArgument("worker {} has an empty node_id", w.member_id);
    if (w.previous_rank.has_value()) previous.emplace_back(*w.previous_rank, w.member_id);
  }
  std::sort(previous.begin(), previous.end());
  for (size_t i = 1; i < previous.size(); ++i) {
    if (previous[i - 1].first == previous[i].first) {
      return InvalidArgument("previous rank {} is claimed by both worker {} and worker {}", previous[i].first,
                             previous[i - 1].second, previous[i].second);
    }
  }
  return Status::Ok();
}

// Groups the (validated, id-sorted) workers by node and orders nodes and
// members as PlanMesh documents.
std::vector<Node> OrderNodes(const std::vector<WorkerSlot>& workers) {
  std::map<std::string_view, size_t> index;
  std::vector<Node> nodes;
  for (const WorkerSlot& w : workers) {
    auto [it, inserted] = index.try_emplace(w.node_id, nodes.size());
    if (inserted) nodes.push_back(Node{w.node_id, std::nullopt, {}, 0});
    Node& node = nodes[it->second];
    node.members.push_back(&w);
    if (w.previous_rank.has_value() && (!node.first_previous.has_value() || *w.previous_rank < *node.first_previous)) {
      node.first_previous = w.previous_rank;
    }
  }
  // Members with a previous rank by it, then new members by id (the input is
  // sorted by id and the sort is stable).
  for (Node& node : nodes) {
    std::stable_sort(node.members.begin(), node.members.end(), [](const WorkerSlot* a, const WorkerSlot* b) {
      if (a->previous_rank.has_value() != b->previous_rank.has_value()) return a->previous_rank.has_value();
      return a->previous_rank.value_or(0) < b->previous_rank.value_or(0);
    });
  }
  std::sort(nodes.begin(), nodes.end(), [](const Node& a, const Node& b) {
    if (a.first_previous.has_value() != b.first_previous.has_value()) return a.first_previous.has_value();
    if (a.first_previous != b.first_previous) return a.first_previous < b.first_previous;
    return a.id < b.id;
  });
  return nodes;
}

}  // namespace

Result<MeshPlan> PlanMesh(std::vector<WorkerSlot> workers, const v1::MeshShape& requested) {
  TANDEM_RETURN_IF_ERROR(CheckDimension("dp", requested.dp()));
  TANDEM_RETURN_IF_ERROR(CheckDimension("tp", requested.tp()));
  TANDEM_RETURN_IF_ERROR(CheckDimension("pp", requested.pp()));
  const uint64_t tp = std::max<uint32_t>(requested.tp(), 1);
  const uint64_t pp = std::max<uint32_t>(requested.pp(), 1);
  const uint64_t fixed_dp = requested.dp();
  if (workers.empty()) return FailedPrecondition("no workers to place in the mesh");
  TANDEM_RETURN_IF_ERROR(CheckWorkers(workers));

  std::vector<Node> nodes = OrderNodes(workers);
  size_t largest = 0;
  for (const Node& node : nodes) largest = std::max(largest, node.members.size());
  if (tp > largest) return InvalidArgument("tp={} is larger than any node's worker count (largest: {})", tp, largest);

  // A tp group lies inside one node: each node contributes whole tp groups.
  std::vector<std::string> reasons;
  uint64_t fit = 0;
  for (Node& node : nodes) {
    node.kept = node.members.size() / tp * tp;
    fit += node.kept;
    if (node.kept != node.members.size()) {
      reasons.push_back(
          fmt::format("node {} has {}, not a multiple of tp={}", node.id, Workers(node.members.size()), tp));
    }
  }

  const uint64_t step = tp * pp;  // the mesh grows in steps of one dp slice
  uint64_t world = 0;
  if (fixed_dp != 0) {
    world = fixed_dp * step;
    if (fit < world) {
      return FailedPrecondition(
          "mesh dp={} x tp={} x pp={} needs {} workers in whole tp groups of {} inside nodes; the members give {}",
          fixed_dp, tp, pp, world, tp, fit);
    }
  } else {
    if (fit < step) {
      return FailedPrecondition(
          "mesh tp={} x pp={} needs at least {} workers in whole tp groups of {} inside nodes; the members give {}", tp,
          pp, step, tp, fit);
    }
    world = fit / step * step;
  }

  // Drop the surplus (whole tp groups, since fit and world are multiples of
  // tp) from the end of the last nodes.
  if (const uint64_t surplus = fit - world; surplus > 0) {
    if (fixed_dp != 0) {
      reasons.push_back(
          fmt::format("mesh dp={} x tp={} x pp={} takes exactly {}, so the last {} of the {} in whole tp "
                      "groups wait",
                      fixed_dp, tp, pp, Workers(world), surplus, fit));
    } else {
      reasons.push_back(
          fmt::format("the mesh grows in steps of tp x pp = {} workers, so the last {} of the {} in "
                      "whole tp groups wait",
                      step, surplus, fit));
    }
    uint64_t left = surplus;
    for (auto it = nodes.rbegin(); it != nodes.rend() && left > 0; ++it) {
      const uint64_t take = std::min<uint64_t>(left, it->kept);
      it->kept -= take;
      left -= take;
    }
  }

  MeshPlan plan;
  const auto dp = static_cast<uint32_t>(world / step);
  plan.mesh.set_dp(dp);
  plan.mesh.set_tp(static_cast<uint32_t>(tp));
  plan.mesh.set_pp(static_cast<uint32_t>(pp));
  const auto node_count =
      static_cast<uint32_t>(std::count_if(nodes.begin(), nodes.end(), [](const Node& n) { return n.kept > 0; }));
  plan.ranked.reserve(world);
  uint32_t node_rank = 0;
  for (const Node& node : nodes) {
    for (size_t local = 0; local < node.kept; ++local) {
      const auto rank = static_cast<uint32_t>(plan.ranked.size());
      v1::RankAssignment a;
      a.set_global_rank(rank);
      a.set_node_rank(node_rank);
      a.set_local_rank(static_cast<uint32_t>(local));
      a.set_world_size(static_cast<uint32_t>(world));
      a.set_local_world_size(static_cast<uint32_t>(node.kept));
      a.set_node_count(node_count);
      a.mutable_mesh()->set_tp(static_cast<uint32_t>(rank % tp));
      a.mutable_mesh()->set_dp(static_cast<uint32_t>(rank / tp % dp));
      a.mutable_mesh()->set_pp(static_cast<uint32_t>(rank / (tp * dp)));
      plan.ranked.emplace_back(node.members[local]->member_id, std::move(a));
    }
    if (node.kept > 0) ++node_rank;
    for (size_t i = node.kept; i < node.members.size(); ++i) plan.standby.push_back(node.members[i]->member_id);
  }
  for (const std::string& reason : reasons) {
    if (!plan.standby_reason.empty()) plan.standby_reason += "; ";
    plan.standby_reason += reason;
  }
  return plan;
}

// ---------------------------------------------------------------------------
// Shard map
// ---------------------------------------------------------------------------

namespace {

// Sorts the ids and rejects 0 and duplicates.
Status CheckServerIds(std::vector<uint64_t>& ids) {
  std::sort(ids.begin(), ids.end());
  if (!ids.empty() && ids.front() == 0) return InvalidArgument("server member id 0 is not a valid id (ids start at 1)");
  if (auto dup = std::adjacent_find(ids.begin(), ids.end()); dup != ids.end()) {
    return InvalidArgument("server member id {} is listed more than once", *dup);
  }
  return Status::Ok();
}

uint64_t PartitionCount(uint64_t parameter_count, uint64_t partition_size) {
  return parameter_count / partition_size + (parameter_count % partition_size != 0 ? 1 : 0);
}

void SetRange(v1::Partition& p, uint64_t id, uint64_t parameter_count, uint64_t partition_size) {
  p.mutable_range()->set_begin(id * partition_size);
  p.mutable_range()->set_end(std::min((id + 1) * partition_size, parameter_count));
}

Status CheckPreviousMap(const v1::ShardMap& map) {
  if (map.version() == 0) return InvalidArgument("previous shard map has version 0 (it was never computed)");
  if (map.partition_size() == 0) return InvalidArgument("previous shard map has partition_size 0");
  if (map.parameter_count() > kMaxParameterCount) {
    return InvalidArgument("previous shard map has parameter_count {}, more than the limit of {}",
                           map.parameter_count(), kMaxParameterCount);
  }
  const uint64_t n = PartitionCount(map.parameter_count(), map.partition_size());
  if (static_cast<uint64_t>(map.partitions_size()) != n) {
    return InvalidArgument("previous shard map has {} partitions, but {} elements in partitions of {} make {}",
                           map.partitions_size(), map.parameter_count(), map.partition_size(), n);
  }
  for (uint64_t i = 0; i < n; ++i) {
    const v1::Partition& p = map.partitions(static_cast<int>(i));
    const uint64_t begin = i * map.partition_size();
    const uint64_t end = std::min(begin + map.partition_size(), map.parameter_count());
    if (p.id() != i) return InvalidArgument("previous shard map: partition at index {} has id {}", i, p.id());
    if (p.range().begin() != begin || p.range().end() != end) {
      return InvalidArgument("previous shard map: partition {} covers [{}, {}) but should cover [{}, {})", i,
                             p.range().begin(), p.range().end(), begin, end);
    }
    if (p.primary_member_id() == 0) return InvalidArgument("previous shard map: partition {} has no primary", i);
    if (p.backup_member_id() == p.primary_member_id()) {
      return InvalidArgument("previous shard map: partition {} has server {} as both primary and backup", i,
                             p.primary_member_id());
    }
  }
  return Status::Ok();
}

}  // namespace

Result<v1::ShardMap> BuildShardMap(uint64_t parameter_count, uint64_t partition_elements,
                                   std::vector<uint64_t> server_ids, uint64_t version) {
  if (partition_elements == 0) return InvalidArgument("partition size must be at least 1 element, got 0");
  if (parameter_count > kMaxParameterCount) {
    return InvalidArgument("parameter count {} is more than the limit of {} (2^40) elements", parameter_count,
                           kMaxParameterCount);
  }
  if (version == 0) return InvalidArgument("shard map version must be at least 1, got 0");
  TANDEM_RETURN_IF_ERROR(CheckServerIds(server_ids));
  const uint64_t n = PartitionCount(parameter_count, partition_elements);
  if (n > kMaxPartitions) {
    return InvalidArgument(
        "{} parameters in partitions of {} elements make {} partitions, more than the limit of {}; the partition size "
        "is too small, use at least {} elements",
        parameter_count, partition_elements, n, kMaxPartitions, PartitionCount(parameter_count, kMaxPartitions));
  }
  if (n > 0 && server_ids.empty()) {
    return InvalidArgument("{} parameters in {} partitions need at least one server; none were given", parameter_count,
                           n);
  }

  v1::ShardMap map;
  map.set_partition_size(partition_elements);
  map.set_parameter_count(parameter_count);
  map.set_version(version);
  map.mutable_partitions()->Reserve(static_cast<int>(n));
  const uint64_t m = server_ids.size();
  for (uint64_t i = 0; i < n; ++i) {
    v1::Partition* p = map.add_partitions();
    p->set_id(static_cast<uint32_t>(i));
    SetRange(*p, i, parameter_count, partition_elements);
    p->set_primary_member_id(server_ids[i % m]);
    // With one server there is nowhere to replicate: 0 means no backup.
    p->set_backup_member_id(m >= 2 ? server_ids[(i + 1) % m] : 0);
  }
  return map;
}

Result<ShardMapChange> ReassignShardMap(const v1::ShardMap& previous, std::vector<uint64_t> live_server_ids,
                                        uint64_t version) {
  TANDEM_RETURN_IF_ERROR(CheckPreviousMap(previous));
  if (version <= previous.version()) {
    return InvalidArgument("new shard map version {} must be greater than the previous version {}", version,
                           previous.version());
  }
  TANDEM_RETURN_IF_ERROR(CheckServerIds(live_server_ids));
  const auto& live = live_server_ids;
  if (previous.partitions_size() > 0 && live.empty()) {
    return FailedPrecondition("no live server to hold the {} partitions of the shard map", previous.partitions_size());
  }

  // Loads indexed like `live`.
  auto index_of = [&live](uint64_t id) -> std::optional<size_t> {
    if (id == 0) return std::nullopt;
    auto it = std::lower_bound(live.begin(), live.end(), id);
    if (it == live.end() || *it != id) return std::nullopt;
    return static_cast<size_t>(it - live.begin());
  };
  std::vector<uint64_t> primaries(live.size(), 0);
  std::vector<uint64_t> backups(live.size(), 0);

  ShardMapChange change;
  change.map = previous;
  auto& parts = *change.map.mutable_partitions();

  // 1-2. Keep live primaries, promote live backups; note the lost.
  for (v1::Partition& p : parts) {
    const std::optional<size_t> primary = index_of(p.primary_member_id());
    const std::optional<size_t> backup = index_of(p.backup_member_id());
    if (primary.has_value()) {
      ++primaries[*primary];
      if (backup.has_value()) {
        ++backups[*backup];
      } else {
        p.set_backup_member_id(0);
      }
    } else if (backup.has_value()) {
      ++primaries[*backup];
      p.set_primary_member_id(p.backup_member_id());
      p.set_backup_member_id(0);
      change.promoted.push_back(p.id());
    } else {
      p.set_primary_member_id(0);
      p.set_backup_member_id(0);
      change.lost.push_back(p.id());
    }
  }

  // 3. Lost partitions go to the live server with the fewest primaries.
  std::set<std::pair<uint64_t, uint64_t>> by_primaries;  // (load, id)
  for (size_t i = 0; i < live.size(); ++i) by_primaries.emplace(primaries[i], live[i]);
  for (uint32_t id : change.lost) {
    auto least = by_primaries.begin();
    auto [load, server] = *least;
    by_primaries.erase(least);
    by_primaries.emplace(load + 1, server);
    parts[static_cast<int>(id)].set_primary_member_id(server);
  }

  // 4. Missing backups go to the live server, other than the primary, with
  // the fewest backups.
  if (live.size() >= 2) {
    std::set<std::pair<uint64_t, uint64_t>> by_backups;  // (load, id)
    for (size_t i = 0; i < live.size(); ++i) by_backups.emplace(backups[i], live[i]);
    for (v1::Partition& p : parts) {
      if (p.backup_member_id() != 0) continue;
      auto least = by_backups.begin();
      if (least->second == p.primary_member_id()) ++least;
      auto [load, server] = *least;
      by_backups.erase(least);
      by_backups.emplace(load + 1, server);
      p.set_backup_member_id(server);
      change.new_backups.push_back(p.id());
    }
  }

  bool changed = false;
  for (int i = 0; i < parts.size() && !changed; ++i) {
    changed = parts[i].primary_member_id() != previous.partitions(i).primary_member_id() ||
              parts[i].backup_member_id() != previous.partitions(i).backup_member_id();
  }
  change.map.set_version(changed ? version : previous.version());
  return change;
}

Result<PrimaryRebalance> RebalancePrimaries(const v1::ShardMap& map, uint64_t version) {
  TANDEM_RETURN_IF_ERROR(CheckPreviousMap(map));
  if (version <= map.version()) {
    return InvalidArgument("new shard map version {} must be greater than the previous version {}", version,
                           map.version());
  }
  PrimaryRebalance result;
  result.map = map;
  // Primary counts by server, and the partitions of each (primary, backup)
  // pair, by id.
  std::map<uint64_t, uint64_t> primaries;
  std::map<std::pair<uint64_t, uint64_t>, std::deque<uint32_t>> pairs;
  for (const v1::Partition& p : map.partitions()) {
    ++primaries[p.primary_member_id()];
    if (p.backup_member_id() == 0) continue;
    primaries.try_emplace(p.backup_member_id(), 0);
    pairs[{p.primary_member_id(), p.backup_member_id()}].push_back(p.id());
  }
  for (;;) {
    // The pair whose primary counts differ most (ties: in pair order).
    const std::pair<uint64_t, uint64_t>* best = nullptr;
    uint64_t best_gap = 1;
    for (const auto& [pair, ids] : pairs) {
      if (ids.empty()) continue;
      const uint64_t from = primaries[pair.first];
      const uint64_t to = primaries[pair.second];
      if (from > to + best_gap) {
        best = &pair;
        best_gap = from - to;
      }
    }
    if (best == nullptr) break;
    const auto [from, to] = *best;
    // A partition swaps once: it does not join the reverse pair (swapping
    // it back later would undo a move for nothing).
    auto& ids = pairs[{from, to}];
    const uint64_t moves = std::min<uint64_t>(ids.size(), best_gap / 2);
    for (uint64_t k = 0; k < moves; ++k) {
      const uint32_t id = ids.front();
      ids.pop_front();
      v1::Partition& p = (*result.map.mutable_partitions())[static_cast<int>(id)];
      p.set_primary_member_id(to);
      p.set_backup_member_id(from);
      result.swapped.push_back(id);
    }
    primaries[from] -= moves;
    primaries[to] += moves;
  }
  std::sort(result.swapped.begin(), result.swapped.end());
  result.map.set_version(result.swapped.empty() ? map.version() : version);
  return result;
}

Result<BackupMoves> RebalanceBackups(const v1::ShardMap& map, std::vector<uint64_t> servers, uint64_t version) {
  TANDEM_RETURN_IF_ERROR(CheckPreviousMap(map));
  if (version <= map.version()) {
    return InvalidArgument("new shard map version {} must be greater than the previous version {}", version,
                           map.version());
  }
  std::sort(servers.begin(), servers.end());
  for (size_t i = 0; i < servers.size(); ++i) {
    if (servers[i] == 0) return InvalidArgument("server id 0 is not a valid member id");
    if (i > 0 && servers[i] == servers[i - 1]) return InvalidArgument("server {} is listed twice", servers[i]);
  }
  BackupMoves result;
  result.map = map;
  auto& parts = *result.map.mutable_partitions();
  std::map<uint64_t, uint64_t> holdings;   // by server: partitions held as primary or backup
  std::map<uint64_t, uint64_t> primaries;  // by server
  for (uint64_t id : servers) holdings.try_emplace(id, 0);
  for (const v1::Partition& p : parts) {
    ++holdings[p.primary_member_id()];
    ++primaries[p.primary_member_id()];
    if (p.backup_member_id() != 0) ++holdings[p.backup_member_id()];
  }
  for (;;) {
    if (servers.empty()) break;
    // Takers from the fewest held up, givers from the most held down (ties:
    // smaller id), for the first pair 2 or more apart with a backup to move.
    auto order = [&holdings](std::vector<uint64_t> ids, bool most_first) {
      std::stable_sort(ids.begin(), ids.end(), [&](uint64_t a, uint64_t b) {
        return most_first ? holdings[a] > holdings[b] : holdings[a] < holdings[b];
      });
      return ids;
    };
    std::vector<uint64_t> all;
    for (const auto& [id, n] : holdings) all.push_back(id);
    const std::vector<uint64_t> takers = order(servers, false);
    const std::vector<uint64_t> givers = order(all, true);
    v1::Partition* chosen = nullptr;
    uint64_t to = 0;
    for (uint64_t taker : takers) {
      for (uint64_t from : givers) {
        if (holdings[from] < holdings[taker] + 2) break;
        for (v1::Partition& p : parts) {
          if (p.backup_member_id() != from || p.primary_member_id() == taker) continue;
          if (chosen == nullptr || primaries[p.primary_member_id()] > primaries[chosen->primary_member_id()]) {
            chosen = &p;
          }
        }
        if (chosen != nullptr) break;
      }
      if (chosen != nullptr) {
        to = taker;
        break;
      }
    }
    if (chosen == nullptr) break;
    --holdings[chosen->backup_member_id()];
    ++holdings[to];
    chosen->set_backup_member_id(to);
    result.moved.push_back(chosen->id());
  }
  // Holdings even, primaries not, and no partition links the server with
  // the most primaries (H) to the one with the fewest (L), so no swap can
  // help: exchange two backups so that one does. H's partition p backed up
  // by X is backed up by L instead, and a partition q backed up by L (whose
  // primary is not X) by X: every server holds as many as before.
  if (result.moved.empty()) {
    // Pairs (H, L) 2 or more primaries apart, the widest first (ties: by ids).
    std::vector<std::tuple<uint64_t, uint64_t, uint64_t>> uneven;  // (gap, h, l)
    for (const auto& [h, nh] : holdings) {
      for (const auto& [l, nl] : holdings) {
        if (primaries[h] >= primaries[l] + 2) uneven.emplace_back(primaries[h] - primaries[l], h, l);
      }
    }
    std::sort(uneven.begin(), uneven.end(), [](const auto& a, const auto& b) {
      return std::get<0>(a) != std::get<0>(b) ? std::get<0>(a) > std::get<0>(b) : a < b;
    });
    for (const auto& [gap, h, l] : uneven) {
      const bool linked = std::any_of(parts.begin(), parts.end(), [&, h = h, l = l](const v1::Partition& p) {
        return p.primary_member_id() == h && p.backup_member_id() == l;
      });
      if (linked) break;  // a swap helps: RebalancePrimaries
      for (uint64_t k = 0; k < gap / 2; ++k) {
        v1::Partition* from_h = nullptr;
        v1::Partition* from_l = nullptr;
        for (v1::Partition& p : parts) {
          if (p.primary_member_id() != h || p.backup_member_id() == 0 || p.backup_member_id() == l) continue;
          for (v1::Partition& q : parts) {
            if (q.backup_member_id() == l && q.primary_member_id() != p.backup_member_id()) {
              from_h = &p;
              from_l = &q;
              break;
            }
          }
          if (from_h != nullptr) break;
        }
        if (from_h == nullptr) break;
        from_l->set_backup_member_id(from_h->backup_member_id());
        from_h->set_backup_member_id(l);
        result.moved.push_back(from_h->id());
        result.moved.push_back(from_l->id());
      }
      if (!result.moved.empty()) break;
    }
  }
  std::sort(result.moved.begin(), result.moved.end());
  result.map.set_version(result.moved.empty() ? map.version() : version);
  return result;
}

}  // namespace tandem::coordinator
