// Rank, mesh and shard-map assignment: what the coordinator computes whenever
// it forms a membership epoch (issue 3, items 2, 3 and 7).
//
// Every function here is pure and deterministic: no clocks, no I/O, no
// randomness, and the result does not depend on the order of the inputs
// (they are sorted first). The same inputs give the same epoch on every
// coordinator, also after a restart, which is what makes the coordinator's
// state reproducible from its log.
//
// Errors (common/status.h): INVALID_ARGUMENT for inputs no job could use
// (duplicate ids, absurd sizes, a tp that fits no node), FAILED_PRECONDITION
// for a valid request the current members cannot satisfy (too few workers for
// the mesh). Messages name the numbers involved so a user can fix the job
// spec.
//
// Thread safety: stateless functions on values; safe from any thread.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "tandem/v1/types.pb.h"

namespace tandem::coordinator {

// ---------------------------------------------------------------------------
// Rank and mesh assignment
// ---------------------------------------------------------------------------

// Largest value accepted for each of dp, tp and pp in a requested mesh.
inline constexpr uint32_t kMaxMeshDimension = 65536;

// One worker that may take part in the epoch being formed.
struct WorkerSlot {
  // The member's id: unique among the workers passed in, non-zero.
  uint64_t member_id = 0;
  // The node the worker runs on, non-empty (the caller resolves an empty
  // NodeIdentity.node_id to the hostname first). Workers with equal node_id
  // share a node and get contiguous ranks.
  std::string node_id;
  // The worker's global rank in the previous epoch, if it was ranked there
  // (a worker that was on standby or is new has none). Distinct among the
  // workers passed in.
  std::optional<uint32_t> previous_rank;
};

// The outcome of PlanMesh.
struct MeshPlan {
  // The resolved mesh: dp, tp and pp all >= 1, dp * tp * pp == ranked.size().
  v1::MeshShape mesh;
  // The members in the epoch and their ranks, sorted by global rank (entry i
  // has global_rank i). Every RankAssignment has all fields filled in,
  // including the mesh coordinates.
  std::vector<std::pair<uint64_t, v1::RankAssignment>> ranked;
  // Members left out of the epoch because they did not fit the mesh, in
  // placement order (node order, then position within the node): the first
  // ones are the next to be admitted if the mesh grows.
  std::vector<uint64_t> standby;
  // Why the standby members were left out, one clause per cause joined by
  // "; ", for example "node n3 has 3 workers, not a multiple of tp=2". Empty
  // when standby is empty.
  std::string standby_reason;
};

// Places workers into a dp x tp x pp mesh with topology-aware, stable ranks.
//
// requested: dp, tp and pp, each 0 to 65536. tp == 0 and pp == 0 mean 1.
// dp == 0 means "choose": dp is the elastic dimension and becomes as large
// as the workers allow. A nonzero dp is fixed: exactly dp * tp * pp workers
// are ranked and the others wait on standby.
//
// Ordering (stable across epochs):
// - Nodes are ordered by the smallest previous_rank among their members;
//   nodes none of whose members has a previous rank come after those, ordered
//   by node_id (byte-wise).
// - Within a node, members with a previous rank come first in order of it,
//   then new members in order of member_id.
// Given previous ranks from an earlier PlanMesh, this guarantees:
// - the relative order of the workers ranked in both epochs never changes;
// - workers on nodes that come before every change (every node whose ranked
//   members are exactly the same as in the previous epoch, and all nodes
//   before it likewise) keep exactly their previous global ranks.
//
// Fitting the mesh:
// - From each node the first floor(n / tp) * tp workers in the order above
//   are kept (a tp group must lie inside one node); the highest positions go
//   to standby ("node n3 has 3 workers, not a multiple of tp=2").
// - Of the K workers kept, the first T are ranked: T = dp * tp * pp for a
//   fixed dp, else T = floor(K / (tp * pp)) * tp * pp. The K - T others are
//   whole tp groups dropped from the end of the LAST nodes.
//
// Ranks (for every ranked worker):
// - global_rank: position in the order above, 0 to world_size - 1; the
//   ranks of a node are contiguous.
// - node_rank: position of the worker's node among the nodes with ranked
//   workers; node_count: how many such nodes there are.
// - local_rank: position among the ranked workers of its node, 0 to
//   local_world_size - 1.
// - mesh coordinates of global rank r: tp = r % tp, dp = (r / tp) % dp,
//   pp = r / (tp * dp). tp varies fastest, so a tp group is tp consecutive
//   ranks inside one node; pp is outermost, so pipeline stages span nodes.
//
// Errors:
// - INVALID_ARGUMENT: a requested dimension above 65536; a member id of 0
//   or used twice; an empty node_id; a previous_rank claimed twice; tp
//   larger than every node's worker count ("tp=8 is larger than any node's
//   worker count (largest: 4)"); more than 2^32 - 1 workers.
// - FAILED_PRECONDITION: no workers; fewer than tp * pp workers in whole tp
//   groups ("mesh tp=4 x pp=2 needs at least 8 workers in whole tp groups of
//   4 inside nodes; the members give 6"); a fixed dp that the workers cannot
//   fill.
Result<MeshPlan> PlanMesh(std::vector<WorkerSlot> workers, const v1::MeshShape& requested);

// ---------------------------------------------------------------------------
// Parameter-server shard map
// ---------------------------------------------------------------------------

// Largest number of partitions a shard map may have (2^20).
inline constexpr uint64_t kMaxPartitions = uint64_t{1} << 20;
// Largest parameter space a shard map may describe, in elements (2^40).
inline constexpr uint64_t kMaxParameterCount = uint64_t{1} << 40;

// Splits the flattened parameter space into fixed-size partitions and
// spreads them over the servers, each with a backup on another server.
//
// - Partition i covers [i * P, min((i + 1) * P, parameter_count)) with
//   P = partition_elements; ids are 0 to n - 1 with n =
//   ceil(parameter_count / P); together they cover [0, parameter_count)
//   exactly, in order.
// - With the servers sorted by id as s_0 .. s_{m-1}, partition i has primary
//   s_{i mod m} (round-robin: primary counts differ by at most 1) and backup
//   s_{(i + 1) mod m}, the next server in that ring, so the backup is never
//   the primary when m >= 2.
// - With a single server there is nowhere to replicate: backup_member_id is
//   0 ("no backup") for every partition.
// - parameter_count == 0 gives a map without partitions (all-reduce mode);
//   server_ids may then be empty.
// - The map's partition_size is P, its parameter_count is parameter_count,
//   its version is `version`.
//
// Errors (INVALID_ARGUMENT): partition_elements == 0; parameter_count above
// 2^40; version == 0; a server id of 0 or listed twice; no servers while
// parameter_count > 0; more than 2^20 partitions (the message names the
// partition count and the smallest partition size that would do).
Result<v1::ShardMap> BuildShardMap(uint64_t parameter_count, uint64_t partition_elements,
                                   std::vector<uint64_t> server_ids, uint64_t version);

// The outcome of ReassignShardMap. The partition id lists are sorted.
struct ShardMapChange {
  // The map for the live servers.
  v1::ShardMap map;
  // Partitions whose primary died and whose backup became the primary.
  std::vector<uint32_t> promoted;
  // Partitions whose primary and backup both died: a live server is now the
  // primary but the partition's state (weights, optimizer moments) is gone
  // and must be restored, from a checkpoint or by re-initialising.
  std::vector<uint32_t> lost;
  // Partitions that got a backup they did not have before (their backup
  // died, was promoted, or never existed); that server must copy the state
  // from the primary.
  std::vector<uint32_t> new_backups;
};

// Recomputes `previous` for a new set of live servers, moving as little as
// possible. For each partition, in id order:
// 1. A live primary stays the primary.
// 2. Otherwise a live backup is promoted to primary (listed in `promoted`).
// 3. Otherwise (both dead, or the dead primary had no backup) the partition
//    is `lost`: the live server with the fewest primaries (ties: smaller id),
//    counting assignments made so far, becomes its primary.
// 4. Then every partition whose backup is 0, dead or promoted gets the live
//    server other than its primary with the fewest backups (ties: smaller
//    id), counting surviving backups and assignments made so far; it is
//    listed in `new_backups`. A surviving backup is kept. With a single live
//    server backups are 0 ("no backup").
// Primaries never move otherwise, so servers that join take only backups and
// lost partitions (they have the fewest of both); rebalancing primaries onto
// them is a separate, deliberate step (RebalancePrimaries).
//
// Partition boundaries, partition_size and parameter_count are unchanged.
// The map's version is `version` if any primary or backup changed, else
// previous.version (an unchanged placement keeps its version).
//
// Errors:
// - INVALID_ARGUMENT: `previous` is not a valid map (partition_size 0,
//   ranges not matching the partition formula, ids not dense, a primary of 0,
//   a backup equal to its primary, version 0); version <= previous.version; a
//   live server id of 0 or listed twice.
// - FAILED_PRECONDITION: the map has partitions and no server is live.
Result<ShardMapChange> ReassignShardMap(const v1::ShardMap& previous, std::vector<uint64_t> live_server_ids,
                                        uint64_t version);

// The outcome of RebalancePrimaries.
struct PrimaryRebalance {
  // The map with the swaps made.
  v1::ShardMap map;
  // Partitions whose primary and backup swapped roles, sorted.
  std::vector<uint32_t> swapped;
};

// Evens out how many partitions each server is primary of, by swapping the
// primary and the backup of as few partitions as it takes. Used once every
// backup holds its partition's state (a server that came back after a
// failure holds only backups, see ReassignShardMap): the backup that becomes
// primary already has the state, so nothing is copied but the new backup's
// catch-up.
//
// The servers are those that hold a partition (as primary or backup). A map
// is balanced when no partition's primary is primary of at least 2 more
// partitions than its backup is; then nothing changes (no churn). Otherwise,
// repeatedly, among the (primary, backup) pairs of servers that hold
// partitions together, the pair whose primary counts differ most (ties: the
// smaller primary id, then the smaller backup id) swaps its partitions with
// the smallest ids, as many as halve the difference and no more. It ends
// when no partition could move to a server with at least 2 fewer primaries.
// With two servers the counts then differ by at most one, after exactly the
// swaps needed (8 and 0 become 4 and 4 in 4 swaps); with more, as evenly as
// swaps with each partition's own backup allow.
// Partitions without a backup never move. Boundaries, partition_size and
// parameter_count are unchanged; which servers hold each partition too.
// The map's version is `version` if a partition swapped, else map.version.
//
// Errors (INVALID_ARGUMENT): `map` is not a valid map (as for
// ReassignShardMap); version <= map.version.
Result<PrimaryRebalance> RebalancePrimaries(const v1::ShardMap& map, uint64_t version);

// The outcome of RebalanceBackups.
struct BackupMoves {
  // The map with the backups moved.
  v1::ShardMap map;
  // Partitions whose backup moved to another server, sorted.
  std::vector<uint32_t> moved;
};

// Evens out how many partitions each of `servers` holds (as primary or
// backup) by moving backups, the step before RebalancePrimaries: a server
// that holds nothing (it came back while three or more survivors kept every
// backup, or it was added to the job) gets backups, and once they hold
// their state, swaps can make it primary of its share.
//
// A map is even when no server holds at least 2 more partitions than
// another; then nothing changes. Otherwise, repeatedly, the server of
// `servers` holding the fewest (ties: smaller id; then the next fewest if
// it can take none) takes the backup of one partition from the server
// holding the most (ties: smaller id; then the next) of which it is not the
// primary: the one whose primary is primary of the most partitions (ties:
// smaller partition id), so the swaps that follow take primaries from the
// busiest. When holdings are even but the server with
// the most primaries is 2 ahead of the one with the fewest and no partition
// of the first is backed up by the second (no swap can help), two backups
// are exchanged so that such partitions exist (holdings unchanged), as many
// as half the difference. Primaries never move; a partition without a
// backup keeps none. Servers in the map but not in `servers` only give.
// The map's version is `version` if a backup moved, else map.version.
//
// Errors (INVALID_ARGUMENT): `map` is not a valid map (as for
// ReassignShardMap); version <= map.version; a server id of 0 or listed
// twice.
Result<BackupMoves> RebalanceBackups(const v1::ShardMap& map, std::vector<uint64_t> servers, uint64_t version);

}  // namespace tandem::coordinator
