#include "worker/comm/comm_manager.h"

#include <algorithm>
#include <set>
#include <tuple>
#include <utility>

#include <google/protobuf/util/time_util.h>
#include <spdlog/spdlog.h>

namespace tandem::comm {
namespace {

using google::protobuf::util::TimeUtil;

constexpr size_t kMaxProgressEntries = 64;  // HeartbeatRequest.collectives
constexpr size_t kMaxNameBytes = 128;       // CollectiveProgress.communicator
constexpr size_t kMaxOpBytes = 32;          // CollectiveProgress.last_op

// The validated worker table of an epoch.
struct Mesh {
  uint32_t dp = 1;
  uint32_t tp = 1;
  uint32_t pp = 1;
  uint32_t workers = 0;                  // worker_count
  std::vector<const v1::Peer*> visible;  // the worker peers listed
  // "node-dp": each listed worker's rank and group size (the listed workers
  // of its node with its pp and tp, by dp coordinate).
  std::map<uint64_t, std::pair<uint32_t, uint32_t>> node_dp;
};

Result<Mesh> ReadMesh(const v1::MembershipEpoch& epoch) {
  Mesh m;
  m.dp = epoch.mesh().dp();
  m.tp = epoch.mesh().tp();
  m.pp = epoch.mesh().pp();
  if (m.dp == 0 || m.tp == 0 || m.pp == 0) {
    return InvalidArgument("epoch {}: mesh dp={} tp={} pp={} has a zero dimension", epoch.epoch(), m.dp, m.tp, m.pp);
  }
  for (const auto& p : epoch.peers()) {
    if (p.role() == v1::ROLE_WORKER) m.visible.push_back(&p);
  }
  m.workers = epoch.worker_count() != 0 ? epoch.worker_count() : static_cast<uint32_t>(m.visible.size());
  const uint64_t product = uint64_t{m.dp} * m.tp * m.pp;
  if (product != m.workers) {
    return InvalidArgument("epoch {}: mesh dp={} x tp={} x pp={} = {} does not match its {} workers", epoch.epoch(),
                           m.dp, m.tp, m.pp, product, m.workers);
  }
  if (m.visible.size() > m.workers) {
    return InvalidArgument("epoch {}: {} worker peers listed for {} workers", epoch.epoch(), m.visible.size(),
                           m.workers);
  }
  std::set<uint32_t> ranks;
  std::set<std::tuple<uint32_t, uint32_t, uint32_t>> coordinates;
  for (const v1::Peer* p : m.visible) {
    if (!p->has_rank()) return InvalidArgument("epoch {}: worker {} has no rank", epoch.epoch(), p->member_id());
    const auto& r = p->rank();
    const auto& c = r.mesh();
    if (r.global_rank() >= m.workers || !ranks.insert(r.global_rank()).second) {
      return InvalidArgument("epoch {}: worker {} has global rank {}, out of range or taken (of {} workers)",
                             epoch.epoch(), p->member_id(), r.global_rank(), m.workers);
    }
    if (c.dp() >= m.dp || c.tp() >= m.tp || c.pp() >= m.pp) {
      return InvalidArgument("epoch {}: worker {} has mesh coordinates dp={} tp={} pp={} outside dp={} tp={} pp={}",
                             epoch.epoch(), p->member_id(), c.dp(), c.tp(), c.pp(), m.dp, m.tp, m.pp);
    }
    if (!coordinates.emplace(c.dp(), c.tp(), c.pp()).second) {
      return InvalidArgument("epoch {}: worker {} has mesh coordinates dp={} tp={} pp={} of another worker",
                             epoch.epoch(), p->member_id(), c.dp(), c.tp(), c.pp());
    }
    if (r.local_world_size() == 0 || r.local_rank() >= r.local_world_size()) {
      return InvalidArgument("epoch {}: worker {} has local rank {} of {}", epoch.epoch(), p->member_id(),
                             r.local_rank(), r.local_world_size());
    }
  }
  // A node's workers are all listed in every peer view, so the node-dp
  // groups are complete.
  std::map<std::tuple<uint32_t, uint32_t, uint32_t>, std::vector<const v1::Peer*>> node_dp;
  for (const v1::Peer* p : m.visible) {
    node_dp[{p->rank().node_rank(), p->rank().mesh().pp(), p->rank().mesh().tp()}].push_back(p);
  }
  for (auto& [key, peers] : node_dp) {
    std::sort(peers.begin(), peers.end(),
              [](const v1::Peer* a, const v1::Peer* b) { return a->rank().mesh().dp() < b->rank().mesh().dp(); });
    for (size_t i = 0; i < peers.size(); ++i) {
      m.node_dp[peers[i]->member_id()] = {static_cast<uint32_t>(i), static_cast<uint32_t>(peers.size())};
    }
  }
  return m;
}

// Where a worker sits in a group kind: the group's index, its rank in it,
// and the group's size.
struct Place {
  uint32_t index = 0;
  uint32_t rank = 0;
  uint32_t size = 1;
};

Result<Place> PlaceOf(const std::string& kind, const Mesh& m, const v1::Peer& p) {
  const auto& r = p.rank();
  const auto& c = r.mesh();
  if (kind == "world") return Place{0, r.global_rank(), m.workers};
  if (kind == "node") return Place{r.node_rank(), r.local_rank(), r.local_world_size()};
  if (kind == "node-dp") {
    const auto [rank, size] = m.node_dp.at(p.member_id());
    return Place{(r.node_rank() * m.pp + c.pp()) * m.tp + c.tp(), rank, size};
  }
  if (kind == "dp") return Place{c.pp() * m.tp + c.tp(), c.dp(), m.dp};
  if (kind == "tp") return Place{c.pp() * m.dp + c.dp(), c.tp(), m.tp};
  if (kind == "pp") return Place{c.dp() * m.tp + c.tp(), c.pp(), m.pp};
  return InvalidArgument("unknown communicator group kind \"{}\" (expected world, node, node-dp, dp, tp or pp)", kind);
}

std::string NameOf(const std::string& kind, uint32_t index) {
  return kind == "world" ? kind : fmt::format("{}/{}", kind, index);
}

// The members of group (kind, index) in rank order, checked complete.
Result<Group> Collect(const v1::MembershipEpoch& epoch, const Mesh& m, const std::string& kind, uint32_t index,
                      uint32_t size) {
  Group g;
  g.name = NameOf(kind, index);
  std::vector<const v1::Peer*> slots(size, nullptr);
  for (const v1::Peer* p : m.visible) {
    TANDEM_ASSIGN_OR_RETURN(const Place place, PlaceOf(kind, m, *p));
    if (place.index != index) continue;
    if (place.size != size || place.rank >= size) {
      return InvalidArgument("epoch {}: worker {} has rank {} in a group {} of {}, but the group has {} workers",
                             epoch.epoch(), p->member_id(), place.rank, g.name, place.size, size);
    }
    if (slots[place.rank] != nullptr) {
      return InvalidArgument("epoch {}: workers {} and {} both have rank {} in group {}", epoch.epoch(),
                             slots[place.rank]->member_id(), p->member_id(), place.rank, g.name);
    }
    slots[place.rank] = p;
  }
  for (uint32_t i = 0; i < size; ++i) {
    if (slots[i] == nullptr) {
      return FailedPrecondition(
          "epoch {}: rank {} of group {} (of {} workers) is not in the peer table; a filtered peer view has only "
          "this node's workers: watch with PEER_VIEW_FULL or build only the node and tp groups",
          epoch.epoch(), i, g.name, size);
    }
    g.global_ranks.push_back(static_cast<int>(slots[i]->rank().global_rank()));
    g.member_ids.push_back(slots[i]->member_id());
  }
  return g;
}

Status CheckKinds(const std::vector<std::string>& kinds) {
  for (const auto& k : kinds) {
    if (std::find(AllGroupKinds().begin(), AllGroupKinds().end(), k) == AllGroupKinds().end()) {
      return InvalidArgument("unknown communicator group kind \"{}\" (expected world, node, node-dp, dp, tp or pp)", k);
    }
  }
  return Status::Ok();
}

// The kinds in build order, whatever order they were given in. "node-dp"
// is the node group itself when tp = pp = 1, and is then left out.
std::vector<std::string> Ordered(const std::vector<std::string>& kinds, const Mesh& m) {
  std::vector<std::string> out;
  for (const auto& k : AllGroupKinds()) {
    if (k == "node-dp" && m.tp == 1 && m.pp == 1) continue;
    if (std::find(kinds.begin(), kinds.end(), k) != kinds.end()) out.push_back(k);
  }
  return out;
}

}  // namespace

Result<std::vector<Group>> DeriveGroups(const v1::MembershipEpoch& epoch, const std::vector<std::string>& kinds) {
  TANDEM_RETURN_IF_ERROR(CheckKinds(kinds));
  TANDEM_ASSIGN_OR_RETURN(const Mesh m, ReadMesh(epoch));
  std::vector<Group> out;
  for (const auto& kind : Ordered(kinds, m)) {
    std::map<uint32_t, uint32_t> sizes;  // index -> size, of the groups with a listed member
    for (const v1::Peer* p : m.visible) {
      TANDEM_ASSIGN_OR_RETURN(const Place place, PlaceOf(kind, m, *p));
      sizes.emplace(place.index, place.size);
    }
    for (const auto& [index, size] : sizes) {
      TANDEM_ASSIGN_OR_RETURN(Group g, Collect(epoch, m, kind, index, size));
      out.push_back(std::move(g));
    }
  }
  return out;
}

Result<std::vector<MemberGroup>> DeriveMemberGroups(const v1::MembershipEpoch& epoch, uint64_t member_id,
                                                    const std::vector<std::string>& kinds) {
  TANDEM_RETURN_IF_ERROR(CheckKinds(kinds));
  TANDEM_ASSIGN_OR_RETURN(const Mesh m, ReadMesh(epoch));
  const v1::Peer* me = nullptr;
  for (const v1::Peer* p : m.visible) {
    if (p->member_id() == member_id) me = p;
  }
  if (me == nullptr) return NotFound("member {} is not a worker of epoch {}", member_id, epoch.epoch());
  std::vector<MemberGroup> out;
  for (const auto& kind : Ordered(kinds, m)) {
    TANDEM_ASSIGN_OR_RETURN(const Place place, PlaceOf(kind, m, *me));
    MemberGroup mg;
    TANDEM_ASSIGN_OR_RETURN(mg.group, Collect(epoch, m, kind, place.index, place.size));
    mg.rank = static_cast<int>(place.rank);
    out.push_back(std::move(mg));
  }
  return out;
}

CommManager::CommManager(uint64_t member_id, BackendFactory factory, CommManagerOptions options)
    : member_id_(member_id), factory_(std::move(factory)), options_(std::move(options)) {}

CommManager::~CommManager() {
  Abort("communicator manager closed");
}

Status CommManager::SetEpoch(const v1::MembershipEpoch& epoch, Rendezvous& rendezvous) {
  MutexLock build(&set_mu_);
  std::vector<Entry> old;
  uint64_t old_epoch = 0;
  uint64_t generation = 0;
  {
    MutexLock lock(&mu_);
    if (epoch.epoch() == epoch_ && ready_) return Status::Ok();
    if (epoch.epoch() < epoch_) {
      return FailedPrecondition("epoch {} is older than the current epoch {}", epoch.epoch(), epoch_);
    }
    old.swap(set_);
    old_epoch = epoch_;
    epoch_ = epoch.epoch();
    ready_ = false;
    generation = ++generation_;
    node_name_.clear();
    in_flight_.clear();
  }
  // Operations in flight on the old set fail now, not after their timeout.
  const std::string reason = fmt::format("epoch {} was superseded by epoch {}", old_epoch, epoch.epoch());
  for (auto& e : old) e.comm->Abort(reason);
  old.clear();

  TANDEM_ASSIGN_OR_RETURN(auto groups, DeriveMemberGroups(epoch, member_id_, options_.kinds));
  std::vector<Entry> built;
  std::string node_name;
  auto fail = [&](const Status& error) {
    for (auto& e : built) e.comm->Abort(error.message());
    return error;
  };
  for (auto& mg : groups) {
    CommInfo info;
    info.name = mg.group.name;
    info.epoch = epoch.epoch();
    info.rank = mg.rank;
    info.size = static_cast<int>(mg.group.global_ranks.size());
    info.timeout = options_.timeout;
    info.member_ids = mg.group.member_ids;
    auto comm = factory_(info, mg.group.global_ranks, rendezvous);
    if (!comm.ok()) {
      return fail(comm.status().WithContext(fmt::format("building communicator {} of epoch {} (rank {} of {})",
                                                        info.name, info.epoch, info.rank, info.size)));
    }
    if (*comm == nullptr || (*comm)->rank() != info.rank || (*comm)->size() != info.size) {
      return fail(Internal("the backend built communicator {} of epoch {} as something else than rank {} of {}",
                           info.name, info.epoch, info.rank, info.size));
    }
    if (info.name.starts_with("node/")) node_name = info.name;
    built.push_back({info.name, std::shared_ptr<Communicator>(std::move(*comm))});
  }
  {
    MutexLock lock(&mu_);
    if (generation_ == generation) {
      set_ = std::move(built);
      node_name_ = std::move(node_name);
      ready_ = true;
      spdlog::info("epoch {}: {} communicators ready", epoch_, set_.size());
      return Status::Ok();
    }
  }
  // Abort() ran meanwhile: the new set is not wanted either.
  return fail(Aborted("the communicators of epoch {} were aborted while being built", epoch.epoch()));
}

void CommManager::Abort(const std::string& reason) {
  std::vector<Entry> old;
  {
    MutexLock lock(&mu_);
    old.swap(set_);
    node_name_.clear();
    in_flight_.clear();
    ready_ = false;
    ++generation_;
  }
  for (auto& e : old) e.comm->Abort(reason);
}

std::shared_ptr<Communicator> CommManager::Get(const std::string& name) const {
  MutexLock lock(&mu_);
  const std::string& wanted = name == "node" ? node_name_ : name;
  for (const auto& e : set_) {
    if (e.name == wanted) return e.comm;
  }
  return nullptr;
}

std::vector<std::string> CommManager::names() const {
  MutexLock lock(&mu_);
  std::vector<std::string> out;
  for (const auto& e : set_) out.push_back(e.name);
  return out;
}

uint64_t CommManager::epoch() const {
  MutexLock lock(&mu_);
  return epoch_;
}

std::vector<Progress> CommManager::progress() const {
  MutexLock lock(&mu_);
  std::vector<Progress> out;
  out.reserve(set_.size());
  for (const auto& e : set_) out.push_back(e.comm->progress());
  return out;
}

std::vector<v1::CollectiveProgress> CommManager::CollectiveProgress() {
  const auto now = std::chrono::steady_clock::now();
  MutexLock lock(&mu_);
  std::vector<v1::CollectiveProgress> out;
  for (const auto& e : set_) {
    if (out.size() == kMaxProgressEntries) break;
    const Progress p = e.comm->progress();
    v1::CollectiveProgress c;
    c.set_communicator(p.communicator.substr(0, kMaxNameBytes));
    c.set_last_entered(p.last_entered);
    c.set_last_completed(std::min(p.last_completed, p.last_entered));
    c.set_last_op(p.last_kind.substr(0, kMaxOpBytes));
    if (p.last_completed < p.last_entered) {
      auto [it, inserted] = in_flight_.try_emplace(e.name, InFlight{p.last_entered, now});
      if (!inserted && it->second.sequence != p.last_entered) it->second = {p.last_entered, now};
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - it->second.since).count();
      *c.mutable_in_flight() = TimeUtil::MillisecondsToDuration(ms);
    } else {
      in_flight_.erase(e.name);
    }
    out.push_back(std::move(c));
  }
  return out;
}

}  // namespace tandem::comm
