// ParameterStore, membership: adopting an epoch's shard map, the links
// to the other servers, and what this server holds.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

#include <google/protobuf/util/message_differencer.h>
#include <spdlog/spdlog.h>

#include "common/crc32c.h"
#include "common/failpoint.h"
#include "common/optimizer/gradient.h"
#include "server/checkpoint/checkpoint.h"
#include "server/ps_core.h"
#include "server/ps_core_internal.h"

namespace tandem::server {

using namespace store_internal;  // NOLINT(google-build-using-namespace)

std::vector<ParameterStore::Segment> ParameterStore::SegmentsFor(uint64_t begin, uint64_t end) const {
  std::vector<Segment> segments;
  if (!configured_) return segments;
  // The first tensor that ends after `begin`.
  auto it = std::upper_bound(tensor_offsets_.begin(), tensor_offsets_.end(), begin);
  size_t t = static_cast<size_t>(it - tensor_offsets_.begin());
  t = t == 0 ? 0 : t - 1;
  uint64_t at = begin;
  while (at < end && t < static_cast<size_t>(tensors_.size())) {
    const uint64_t t_end = tensor_offsets_[t] + TensorElements(tensors_[static_cast<int>(t)]);
    const uint64_t seg_end = std::min(end, t_end);
    if (seg_end > at) {
      GroupParams group = optimizer_->Group(tensors_[static_cast<int>(t)].group());
      if (!segments.empty() && segments.back().group.lr_scale == group.lr_scale &&
          segments.back().group.weight_decay == group.weight_decay &&
          segments.back().group.in_grad_norm == group.in_grad_norm &&
          segments.back().offset + segments.back().count == at - begin) {
        segments.back().count += seg_end - at;
      } else {
        segments.push_back(Segment{at - begin, seg_end - at, group});
      }
      at = seg_end;
    }
    ++t;
  }
  return segments;
}

optim::GradScan ParameterStore::ScanForNorm(const float* g, size_t n, const std::vector<Segment>& segments) {
  GradScan scan = ScanGradient(g, n);
  if (std::all_of(segments.begin(), segments.end(), [](const Segment& s) { return s.group.in_grad_norm; })) {
    return scan;
  }
  scan.sum_squares = 0;
  for (const Segment& s : segments) {
    if (s.group.in_grad_norm) scan.sum_squares += ScanGradient(g + s.offset, s.count).sum_squares;
  }
  return scan;
}

void ParameterStore::SetEpoch(uint64_t epoch, uint64_t member_id, const v1::ShardMap& map, uint32_t dp_size,
                              uint64_t start_step) {
  Actions actions;
  {
    MutexLock lock(&mu_);
    if (epoch <= epoch_) return;
    const uint64_t previous = epoch_;
    epoch_ = epoch;
    member_id_ = member_id;
    map_ = map;
    dp_size_ = std::max<uint32_t>(1, dp_size);
    start_step_ = start_step;
    // A round this server shared may have been decided by another server
    // before the change: keep it until it decides here too.
    for (auto it = rounds_.begin(); it != rounds_.end();) {
      const bool kept = it->second.shared && !it->second.decided;
      it = it->first.first < epoch && !kept ? rounds_.erase(it) : std::next(it);
    }
    primaries_ = 0;
    other_servers_ = false;
    const Status superseded = Superseded(previous, epoch);
    std::set<uint32_t> held;
    size_t unsynced = 0;  // primaries whose backup does not hold the state yet
    for (const auto& p : map.partitions()) {
      v1::ReplicaRole role = v1::REPLICA_ROLE_UNSPECIFIED;
      if (p.primary_member_id() == member_id) role = v1::REPLICA_ROLE_PRIMARY;
      if (p.backup_member_id() == member_id) role = v1::REPLICA_ROLE_BACKUP;
      if (p.primary_member_id() != member_id) other_servers_ = true;
      if (role == v1::REPLICA_ROLE_UNSPECIFIED) continue;
      held.insert(p.id());
      if (role == v1::REPLICA_ROLE_PRIMARY) ++primaries_;
      auto& slot = parts_[p.id()];
      if (!slot) {
        slot = std::make_shared<Part>();
        MutexLock plock(&slot->mu);
        slot->state.id = p.id();
        slot->state.begin = p.range().begin();
        slot->state.end = p.range().end();
        slot->elements.store(slot->state.size(), std::memory_order_relaxed);
        slot->segments = SegmentsFor(p.range().begin(), p.range().end());
      }
      Part& part = *slot;
      MutexLock plock(&part.mu);
      part.epoch = epoch;
      if (part.state.begin != p.range().begin() || part.state.end != p.range().end()) {
        // A different partitioning (not produced by the coordinator, which
        // never moves boundaries): start the partition over.
        spdlog::error("partition {} changed its range from [{}, {}) to [{}, {}); its state is dropped", p.id(),
                      part.state.begin, part.state.end, p.range().begin(), p.range().end());
        UnlendLocked(part, /*keep_values=*/false);
        part.state = PartitionState{};
        part.state.id = p.id();
        part.state.begin = p.range().begin();
        part.state.end = p.range().end();
        part.elements.store(part.state.size(), std::memory_order_relaxed);
        part.segments = SegmentsFor(p.range().begin(), p.range().end());
      }
      const bool was_primary = part.role == v1::REPLICA_ROLE_PRIMARY;
      const uint64_t old_backup = part.backup;
      if (role == v1::REPLICA_ROLE_PRIMARY && !was_primary && part.role == v1::REPLICA_ROLE_BACKUP) {
        spdlog::info("partition {}: promoted to primary in epoch {} (version {}, step {})", p.id(), epoch,
                     part.state.version, part.state.step);
      }
      part.role = role;
      part.primary = p.primary_member_id();
      part.backup = p.backup_member_id();
      // A new backup needs the whole state; so does the same backup when an
      // update it was sent in the old epoch is still unacknowledged: the ack
      // (or the update itself) died with the old epoch's links, and pulls
      // wait for the backup to cover the primary's step.
      part.needs_transfer = role == v1::REPLICA_ROLE_PRIMARY && part.backup != 0 && part.state.version > 0 &&
                            (!was_primary || part.backup != old_backup || part.safe_step < part.state.step);
      part.links_ready = false;
      // The backup still holds the state if it did in the previous epoch,
      // stays the backup, and has nothing unacknowledged; otherwise it holds
      // it once it acknowledges a transfer or an update in this one.
      const bool still_in_sync = role == v1::REPLICA_ROLE_PRIMARY && was_primary && part.backup != 0 &&
                                 part.backup == old_backup && part.state.version > 0 && !part.needs_transfer &&
                                 part.safe_step >= part.state.step && part.in_sync_epoch == previous && previous != 0;
      part.in_sync_epoch = still_in_sync ? epoch : 0;
      if (role == v1::REPLICA_ROLE_PRIMARY && !still_in_sync) ++unsynced;
      // A finished aggregation stays while the partition stays here as
      // primary: its step may be decided (or already be, with the update
      // not yet applied) from the old epoch's shares. New pushes of the step
      // replace it.
      if (!(part.ready && role == v1::REPLICA_ROLE_PRIMARY && was_primary)) {
        part.agg_epoch = 0;
        part.ready = false;
      }
      SetScanPending(part, false);
      part.early.clear();
      part.clocks.clear();
      if (role == v1::REPLICA_ROLE_PRIMARY && part.backup == 0) part.safe_step = part.state.step;
      if (role == v1::REPLICA_ROLE_BACKUP) part.safe_step = part.state.step;
      for (auto& pull : part.pulls) {
        std::vector<char> payload;
        ps::Frame reply = ErrorReply(pull.header, ps::FrameType::kPullReply, superseded, &payload);
        actions.push_back([r = std::move(pull.reply), reply, payload = std::move(payload)]() mutable {
          r(reply, std::move(payload));
        });
      }
      part.pulls.clear();
      for (auto& [target, ack] : part.push_acks) {
        ps::Frame request;
        request.step = target;
        request.partition = p.id();
        std::vector<char> payload;
        ps::Frame reply = ErrorReply(request, ps::FrameType::kPushReply, superseded, &payload);
        actions.push_back(
            [r = std::move(ack), reply, payload = std::move(payload)]() mutable { r(reply, std::move(payload)); });
      }
      part.push_acks.clear();
    }
    for (auto it = parts_.begin(); it != parts_.end();) {
      if (held.count(it->first) == 0) {
        // Kept past the erase: the partition dies (if it does) after its lock is released.
        std::shared_ptr<Part> gone = it->second;
        MutexLock plock(&gone->mu);
        gone->epoch = epoch;
        SetScanPending(*gone, false);
        for (auto& pull : gone->pulls) {
          std::vector<char> payload;
          ps::Frame reply = ErrorReply(
              pull.header, ps::FrameType::kPullReply,
              FailedPrecondition("partition {} moved to another server in epoch {}", it->first, epoch), &payload);
          actions.push_back([r = std::move(pull.reply), reply, payload = std::move(payload)]() mutable {
            r(reply, std::move(payload));
          });
        }
        it = parts_.erase(it);
      } else {
        ++it;
      }
    }
    // A checkpoint waiting for a step survives the change when this server
    // still holds (as primary or backup, whose state is the same) every
    // partition it waits for, none of them past the step: a rebalance swaps
    // roles and moves nothing. A partition that left fails it.
    for (auto& capture : captures_) {
      if (!capture->failed.ok()) continue;
      for (uint32_t id : capture->expected) {
        if (capture->Captured(id)) continue;
        if (held.count(id) == 0) {
          capture->failed = Aborted(
              "partition {} moved to another server in epoch {} (superseding epoch {}) before the checkpoint's step",
              id, epoch, previous);
          break;
        }
        const auto& part = parts_.at(id);
        MutexLock plock(&part->mu);
        if (part->state.step > capture->step) {
          capture->failed =
              FailedPrecondition("partition {} moved past step {} before it could be captured", id, capture->step);
          break;
        }
      }
    }
    {
      MutexLock slock(&sync_mu_);
      sync_epoch_ = epoch;
      unsynced_ = unsynced;
      replicated_epoch_.store(unsynced == 0 ? epoch : 0, std::memory_order_release);
    }
    spdlog::info("epoch {}: this server (member {}) holds {} partition(s), {} as primary", epoch, member_id,
                 held.size(), primaries_);
  }
  changed_.NotifyAll();
  Run(actions);
}

void ParameterStore::LinksReady(uint64_t epoch) {
  Actions actions;
  std::vector<std::shared_ptr<Part>> parts;
  {
    MutexLock lock(&mu_);
    if (epoch != epoch_) return;
    for (auto& [id, part] : parts_) parts.push_back(part);
    // The last share of the old epoch may have died with its links while a
    // server that had not decided the step yet still waits for it.
    if (other_servers_ && last_shared_.epoch != 0 && last_shared_.epoch < epoch) {
      actions.push_back([this, sent = last_shared_] { links_->SendShare(sent.epoch, sent.step, sent.entries); });
    }
  }
  for (auto& part : parts) {
    MutexLock plock(&part->mu);
    if (part->role != v1::REPLICA_ROLE_PRIMARY) continue;
    part->links_ready = true;
    if (part->needs_transfer) SendTransferLocked(*part, actions);
  }
  Run(actions);
}

std::vector<uint32_t> ParameterStore::Held(bool primary_only) const {
  std::vector<uint32_t> ids;
  MutexLock lock(&mu_);
  for (const auto& p : map_.partitions()) {
    if (p.primary_member_id() == member_id_ || (!primary_only && p.backup_member_id() == member_id_)) {
      ids.push_back(p.id());
    }
  }
  return ids;
}

Result<std::pair<uint64_t, uint64_t>> ParameterStore::RangeOf(uint32_t partition) const {
  MutexLock lock(&mu_);
  if (partition >= static_cast<uint32_t>(map_.partitions_size())) {
    return NotFound("partition {} does not exist (the shard map of epoch {} has {})", partition, epoch_,
                    map_.partitions_size());
  }
  const auto& r = map_.partitions(static_cast<int>(partition)).range();
  return std::make_pair(r.begin(), r.end());
}

}  // namespace tandem::server
