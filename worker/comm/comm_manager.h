// CommManager: the communicators of one worker for the current membership
// epoch, derived from the epoch's worker mesh and rebuilt on every epoch.
//
// Groups. From the epoch's worker peers (their RankAssignment and
// MeshCoordinates, used as given) a worker belongs to:
// - "world": every worker; group rank = global rank.
// - "node/<n>": the workers with node_rank n; group rank = local rank.
//   Get("node") returns the calling member's node group. The node index is in
//   the name so that every communicator name is unique within the job's
//   epoch: rendezvous keys and the coordinator's progress tracking are scoped
//   by it.
// - "node-dp/<i>": the workers of one node that are equal in tp and pp (the
//   node's part of a dp group: where gradients are summed inside a node
//   before they leave it); group rank = order by dp coordinate;
//   i = (node_rank * pp_size + pp) * tp_size + tp. Only built when tp or pp
//   is above 1 (otherwise it is the node group).
// - "dp/<i>": workers equal in tp and pp; group rank = dp coordinate;
//   i = pp * tp_size + tp.
// - "tp/<i>": workers equal in dp and pp; group rank = tp coordinate;
//   i = pp * dp_size + dp.
// - "pp/<i>": workers equal in dp and tp; group rank = pp coordinate;
//   i = dp * tp_size + tp.
// That is, i numbers the values of the other two coordinates in the order
// pp, dp, tp (slowest first) with the group's own axis left out. Groups of
// size 1 are kept (valid and cheap), so every worker has one of each kind.
// Servers in the peer table are ignored.
//
// Building. SetEpoch() first aborts the previous set with "epoch N was
// superseded by epoch M", so operations in flight on it fail promptly with
// that message, then builds the groups this member belongs to through the
// backend factory, in a fixed order (world, node, node-dp, dp, tp, pp): every member
// builds in the same order, and each kind partitions the workers, so
// factories that wait for their peers (rendezvous) cannot deadlock. If one
// fails, the ones already built are aborted and the error is returned (the
// member then reports it when acknowledging the epoch).
//
// A full peer view is needed for the groups that span nodes: MemberSession
// watches with PEER_VIEW_LOCAL (this node's workers and the servers), which is
// enough for "node", "node-dp" and "tp" only. A group whose members are not all in the
// peer table gives FAILED_PRECONDITION; choose the kinds to build with
// CommManagerOptions::kinds.
//
// Thread safety: thread-safe. SetEpoch() calls are serialised (a second one
// waits for the first); Get(), progress() and epoch() never wait for a build.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "common/rendezvous.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "tandem/v1/types.pb.h"
#include "worker/comm/communicator.h"

namespace tandem::comm {

// One group of the worker mesh.
struct Group {
  std::string name;                  // "world", "node/0", "dp/3", ...
  std::vector<int> global_ranks;     // the members' global ranks, in group-rank order
  std::vector<uint64_t> member_ids;  // the members' ids, in the same order
};

// The kinds of group, in build order.
inline const std::vector<std::string>& AllGroupKinds() {
  static const std::vector<std::string> kinds = {"world", "node", "node-dp", "dp", "tp", "pp"};
  return kinds;
}

// Pure: every group of `kinds` in the epoch's worker mesh, in build order
// (kind by kind as in AllGroupKinds, then by index). Checks that the workers'
// ranks and mesh coordinates are consistent with the mesh and worker_count
// (INVALID_ARGUMENT otherwise) and that every group is complete in the peer
// table (FAILED_PRECONDITION otherwise, for a filtered view).
Result<std::vector<Group>> DeriveGroups(const v1::MembershipEpoch& epoch,
                                        const std::vector<std::string>& kinds = AllGroupKinds());

// Pure: the groups of `kinds` that `member_id` belongs to, in build order,
// with its rank in each (index into Group::global_ranks). Only the groups of
// this member need to be complete in the peer table. NOT_FOUND if the member
// is not a worker of the epoch.
struct MemberGroup {
  Group group;
  int rank = 0;
};
Result<std::vector<MemberGroup>> DeriveMemberGroups(const v1::MembershipEpoch& epoch, uint64_t member_id,
                                                    const std::vector<std::string>& kinds = AllGroupKinds());

// Makes the communicator of one group: info (name, epoch, rank, size,
// timeout), the group's members' global ranks in group-rank order, and the
// epoch's rendezvous.
using BackendFactory = std::function<Result<std::unique_ptr<Communicator>>(
    const CommInfo& info, const std::vector<int>& global_ranks_in_group, Rendezvous& rendezvous)>;

struct CommManagerOptions {
  // The longest wait on a peer in every communicator (CommInfo::timeout).
  std::chrono::milliseconds timeout{30000};
  // The kinds of group to build (a subset of AllGroupKinds()).
  std::vector<std::string> kinds = AllGroupKinds();
};

class CommManager {
 public:
  CommManager(uint64_t member_id, BackendFactory factory, CommManagerOptions options = {});
  // Aborts the current set with "communicator manager closed".
  ~CommManager();
  CommManager(const CommManager&) = delete;
  CommManager& operator=(const CommManager&) = delete;

  // Replaces the set with the communicators of `epoch`. The same epoch again
  // is a no-op once its set is built (and not aborted); an older one is
  // FAILED_PRECONDITION. NOT_FOUND if this member is not a worker of `epoch`
  // (the old set is aborted all the same). On failure the set is empty,
  // epoch() is the new epoch, and calling again with it retries.
  // `rendezvous` is used only while this call builds (by the factory).
  Status SetEpoch(const v1::MembershipEpoch& epoch, Rendezvous& rendezvous);
  // Aborts every communicator of the current set and drops the set.
  void Abort(const std::string& reason);

  // The communicator named `name` in the current set ("node" means this
  // member's node group), or null.
  std::shared_ptr<Communicator> Get(const std::string& name) const;
  // Names of the current set, in build order.
  std::vector<std::string> names() const;
  // The epoch of the current set (0 before the first).
  uint64_t epoch() const;

  // Progress of every communicator of the current set.
  std::vector<Progress> progress() const;
  // The same for heartbeats (MemberSessionOptions::collective_progress): at
  // most 64 entries, with in_flight measured from the first time a
  // collective was seen entered but not completed.
  std::vector<v1::CollectiveProgress> CollectiveProgress();

 private:
  struct Entry {
    std::string name;
    std::shared_ptr<Communicator> comm;
  };

  const uint64_t member_id_;
  const BackendFactory factory_;
  const CommManagerOptions options_;

  Mutex set_mu_;  // serialises SetEpoch
  mutable Mutex mu_;
  uint64_t epoch_ TANDEM_GUARDED_BY(mu_) = 0;
  std::vector<Entry> set_ TANDEM_GUARDED_BY(mu_);
  bool ready_ TANDEM_GUARDED_BY(mu_) = false;       // set_ is the complete set of epoch_
  uint64_t generation_ TANDEM_GUARDED_BY(mu_) = 0;  // bumped by SetEpoch and Abort
  std::string node_name_ TANDEM_GUARDED_BY(mu_);    // this member's "node/<n>"
  // For in_flight: per communicator, the sequence seen in flight and since when.
  struct InFlight {
    uint64_t sequence = 0;
    std::chrono::steady_clock::time_point since;
  };
  std::map<std::string, InFlight> in_flight_ TANDEM_GUARDED_BY(mu_);
};

}  // namespace tandem::comm
