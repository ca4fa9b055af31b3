// ParameterStore, replication: updates and whole-state transfers sent to
// a partition's backup, and the backup's side of them.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

#include <google/protobuf/util/message_differencer.h>
#include <spdlog/spdlog.h>

#include "common/crc32c.h"
#include "common/failpoint.h"
#include "common/optimizer/gradient.h"
#include "common/trace.h"
#include "server/checkpoint/checkpoint.h"
#include "server/ps_core.h"
#include "server/ps_core_internal.h"

namespace tandem::server {

using namespace store_internal;  // NOLINT(google-build-using-namespace)

void ParameterStore::ReplicateLocked(Part& part, ps::Frame header, std::shared_ptr<const std::vector<float>> grad,
                                     Actions& actions) {
  if (part.backup == 0) {
    part.safe_step = part.state.step;
    ServePullsLocked(part, actions);
    return;
  }
  if (part.needs_transfer || !part.links_ready) {
    // The backup has not got the state yet, or this epoch's links are not up
    // (an update decided as the epoch changed): the transfer, sent when the
    // links are ready, carries this update.
    part.needs_transfer = true;
    if (part.links_ready) SendTransferLocked(part, actions);
    return;
  }
  ++part.replicating;
  const uint32_t id = part.state.id;
  const uint64_t step = header.step;
  const uint64_t epoch = header.epoch;
  const uint64_t backup = part.backup;
  const int64_t trace_start = trace::StepOn(step) ? trace::Now() : 0;
  actions.push_back([this, backup, header, grad = std::move(grad), id, step, epoch, trace_start] {
    links_->SendToBackup(backup, header, grad, [this, id, step, epoch, backup, trace_start](const Status& status) {
      if (trace_start != 0) {  // on the partition's track, from the send to the backup's answer
        trace::CompleteOnTrack("partition", id, "replicate", "ps", trace_start, trace::Now(), step,
                               {{"partition", id}, {"backup", static_cast<int64_t>(backup)}, {"ok", status.ok()}});
      }
      OnReplicated(id, step, epoch, status, false);
    });
  });
}

void ParameterStore::SendTransferLocked(Part& part, Actions& actions) {
  part.needs_transfer = false;
  auto blob = std::make_shared<std::vector<float>>();
  blob->reserve(part.state.size() * 3);
  blob->insert(blob->end(), part.state.weights.begin(), part.state.weights.end());
  blob->insert(blob->end(), part.state.state0.begin(), part.state.state0.end());
  blob->insert(blob->end(), part.state.state1.begin(), part.state.state1.end());
  ps::Frame header;
  header.type = ps::FrameType::kTransfer;
  header.partition = part.state.id;
  header.step = part.state.step;
  header.version = part.state.version;
  if (part.decided_step == part.state.step) {
    header.flags = ps::kFlagDecided | (part.decided_skip ? ps::kFlagSkip : 0);
    header.value = part.decided_coef;
  }
  header.contributors =
      static_cast<uint32_t>((part.state.state0.empty() ? 0 : 1) + (part.state.state1.empty() ? 0 : 1));
  ++part.replicating;
  counters_.transfers_sent.fetch_add(1);
  const uint32_t id = part.state.id;
  const uint64_t step = part.state.step;
  const uint64_t backup = part.backup;
  spdlog::info("partition {}: sending its state (version {}, step {}) to its new backup, member {}", id,
               part.state.version, step, backup);
  actions.push_back([this, backup, header, blob = std::move(blob), id, step]() mutable {
    uint64_t epoch;
    auto job = std::make_shared<std::string>();
    {
      MutexLock lock(&mu_);
      epoch = epoch_;
      v1::InitializeParametersRequest request;
      request.set_job_id(job_id_);
      request.set_epoch(epoch_);
      *request.mutable_tensors() = tensors_;
      *request.mutable_optimizer() = optimizer_config_;
      *request.mutable_consistency() = consistency_;
      request.SerializeToString(job.get());
    }
    links_->SendJob(backup, std::move(job));
    header.epoch = epoch;
    links_->SendToBackup(backup, header, std::move(blob), [this, id, step, epoch](const Status& status) {
      OnReplicated(id, step, epoch, status, true);
    });
  });
}

void ParameterStore::OnReplicated(uint32_t partition, uint64_t step, uint64_t epoch, const Status& status,
                                  bool transfer) {
  auto part = Find(partition);
  if (!part) return;
  const bool current = epoch == this->epoch();  // before the partition's lock (lock order)
  Actions actions;
  {
    MutexLock plock(&part->mu);
    if (part->replicating > 0) --part->replicating;
    if (status.ok()) {
      counters_.replicas_applied.fetch_add(1);
      part->safe_step = std::max(part->safe_step, step);
      MarkInSyncLocked(*part, epoch);
      ServePullsLocked(*part, actions);
    } else if (!transfer && part->role == v1::REPLICA_ROLE_PRIMARY && part->backup != 0 &&
               part->safe_step < part->state.step) {
      // The backup refused the update (it diverged), or the update did not
      // reach it as the epoch changed: it gets the whole state, now or on
      // the new epoch's links.
      if (status.code() == StatusCode::kFailedPrecondition && current) {
        spdlog::warn("partition {}: the backup refused an update ({}); sending it the whole state", partition,
                     status.message());
      } else {
        spdlog::info("partition {}: step {} did not reach the backup ({}); sending it the whole state", partition, step,
                     status.message());
      }
      part->needs_transfer = true;
      if (part->links_ready) SendTransferLocked(*part, actions);
    } else {
      spdlog::warn("partition {}: replicating step {} failed: {} (waiting for the next epoch)", partition, step,
                   status.ToString());
    }
  }
  Run(actions);
}

void ParameterStore::MarkInSyncLocked(Part& part, uint64_t epoch) {
  if (part.role != v1::REPLICA_ROLE_PRIMARY || part.backup == 0 || part.state.version == 0 ||
      epoch <= part.in_sync_epoch) {
    return;
  }
  part.in_sync_epoch = epoch;
  MutexLock lock(&sync_mu_);
  // An acknowledgement from an older epoch counts for nothing now.
  if (epoch != sync_epoch_ || unsynced_ == 0) return;
  if (--unsynced_ == 0) replicated_epoch_.store(epoch, std::memory_order_release);
}

void ParameterStore::ClearInSyncLocked(Part& part) {
  const uint64_t was = part.in_sync_epoch;
  part.in_sync_epoch = 0;
  if (part.role != v1::REPLICA_ROLE_PRIMARY || was == 0) return;
  MutexLock lock(&sync_mu_);
  if (was != sync_epoch_) return;
  ++unsynced_;
  replicated_epoch_.store(0, std::memory_order_release);
}

void ParameterStore::Replica(uint64_t from, const ps::Frame& h, const void* payload, Reply reply) {
  auto answer = [&](const Status& status) {
    std::vector<char> body;
    ps::Frame r = ps::ReplyTo(h, ps::FrameType::kReplicaReply);
    if (!status.ok()) body = ps::ErrorPayload(r, status);
    reply(r, std::move(body));
  };
  std::shared_ptr<Part> part;
  double divisor = 1.0;  // the grad scale's, to record the decision's coefficient
  {
    MutexLock lock(&mu_);
    if (h.epoch != epoch_) return answer(Aborted("update from epoch {}, this backup is at epoch {}", h.epoch, epoch_));
    if (optimizer_.has_value() && optimizer_->reduction() != v1::GRADIENT_REDUCTION_SUM) {
      divisor = static_cast<double>(std::max<uint32_t>(1, dp_size_));
    }
    auto it = parts_.find(h.partition);
    if (it == parts_.end()) return answer(NotFound("partition {} is not held here", h.partition));
    part = it->second;
  }
  MutexLock plock(&part->mu);
  if (part->role != v1::REPLICA_ROLE_BACKUP || part->primary != from) {
    plock.Unlock();
    return answer(FailedPrecondition("this server is not the backup of partition {} for member {}", h.partition, from));
  }
  if (part->state.version == 0 || part->state.version != h.version || part->state.step + 1 != h.step) {
    const Status diverged = FailedPrecondition(
        "backup of partition {} is at version {} step {}, the update follows version {} and makes step {}", h.partition,
        part->state.version, part->state.step, h.version, h.step);
    plock.Unlock();
    return answer(diverged);
  }
  if ((h.flags & ps::kFlagSkip) == 0) {
    if (const size_t expected = part->state.size() * sizeof(float); h.payload_bytes != expected) {
      plock.Unlock();
      return answer(
          InvalidArgument("update of partition {} is {} bytes, expected {}", h.partition, h.payload_bytes, expected));
    }
    const double lr = ps::ReplicaLearningRate(h);
    if (Status valid = Optimizer::CheckStepLearningRate(lr); !valid.ok()) {
      plock.Unlock();
      return answer(valid.WithContext(fmt::format("update of partition {} step {}", h.partition, h.step)));
    }
    ApplyLocked(*part, static_cast<const float*>(payload), h.value, lr);
  }
  part->state.step = h.step;
  part->safe_step = h.step;
  part->decided_step = h.step;
  part->decided_coef = h.value * divisor;
  part->decided_skip = (h.flags & ps::kFlagSkip) != 0;
  plock.Unlock();
  answer(Status::Ok());
  StepCompleted(h.partition, h.step);
}

void ParameterStore::Transfer(uint64_t from, const ps::Frame& h, const void* payload, Reply reply) {
  auto answer = [&](const Status& status) {
    std::vector<char> body;
    ps::Frame r = ps::ReplyTo(h, ps::FrameType::kTransferReply);
    if (!status.ok()) body = ps::ErrorPayload(r, status);
    reply(r, std::move(body));
  };
  std::shared_ptr<Part> part;
  int buffers = 0;
  {
    MutexLock lock(&mu_);
    if (h.epoch != epoch_) return answer(Aborted("state from epoch {}, this backup is at epoch {}", h.epoch, epoch_));
    if (!configured_) return answer(FailedPrecondition("the job is not configured on this backup yet"));
    buffers = optimizer_->state_buffers();
    auto it = parts_.find(h.partition);
    if (it == parts_.end()) return answer(NotFound("partition {} is not held here", h.partition));
    part = it->second;
  }
  MutexLock plock(&part->mu);
  if (part->role != v1::REPLICA_ROLE_BACKUP || part->primary != from) {
    plock.Unlock();
    return answer(FailedPrecondition("this server is not the backup of partition {} for member {}", h.partition, from));
  }
  const size_t n = part->state.size();
  if (static_cast<int>(h.contributors) != buffers || h.payload_bytes != n * (1 + buffers) * sizeof(float)) {
    plock.Unlock();
    return answer(InvalidArgument("state of partition {} is {} bytes with {} buffers, expected {} with {}", h.partition,
                                  h.payload_bytes, h.contributors, n * (1 + buffers) * sizeof(float), buffers));
  }
  const float* src = static_cast<const float*>(payload);
  UnlendLocked(*part, /*keep_values=*/false);
  part->state.weights.assign(src, src + n);
  part->state.state0.assign(buffers >= 1 ? src + n : src, buffers >= 1 ? src + 2 * n : src);
  part->state.state1.assign(buffers >= 2 ? src + 2 * n : src, buffers >= 2 ? src + 3 * n : src);
  part->state.version = h.version;
  part->state.step = h.step;
  part->safe_step = h.step;
  part->decided_step = (h.flags & ps::kFlagDecided) != 0 ? h.step : 0;
  part->decided_coef = h.value;
  part->decided_skip = (h.flags & ps::kFlagSkip) != 0;
  counters_.transfers_received.fetch_add(1);
  spdlog::info("partition {}: received its state from member {} (version {}, step {})", h.partition, from,
               part->state.version, h.step);
  plock.Unlock();
  answer(Status::Ok());
  StepCompleted(h.partition, h.step);
}

}  // namespace tandem::server
