// ParameterStore, the data plane's push side: checking frames, receiving
// pushes into store buffers, aggregation in contributor order, the step's
// scan, shares and decision, and applying the update.
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

Result<std::shared_ptr<ParameterStore::Part>> ParameterStore::CheckDataFrame(const ps::Frame& h, bool primary) const {
  MutexLock lock(&mu_);
  if (!configured_) return FailedPrecondition("the job has not been initialised on this server (InitializeParameters)");
  if (h.epoch < epoch_) {
    return FailedPrecondition("epoch {} is stale: this server is at epoch {}; rebuild with the current shard map",
                              h.epoch, epoch_);
  }
  if (h.epoch > epoch_)
    return Unavailable("this server has not reached epoch {} yet (it is at {}); retry", h.epoch, epoch_);
  auto it = parts_.find(h.partition);
  if (it == parts_.end()) {
    if (h.partition >= static_cast<uint32_t>(map_.partitions_size())) {
      return NotFound("partition {} does not exist (the job has {})", h.partition, map_.partitions_size());
    }
    return FailedPrecondition("partition {} is not held by this server (member {}) in epoch {}", h.partition,
                              member_id_, epoch_);
  }
  Part& part = *it->second;
  MutexLock plock(&part.mu);
  if (primary && part.role != v1::REPLICA_ROLE_PRIMARY) {
    return FailedPrecondition("this server (member {}) is not the primary of partition {} in epoch {} (member {} is)",
                              member_id_, h.partition, epoch_, part.primary);
  }
  if (part.state.version == 0) {
    return FailedPrecondition(
        "partition {} has no state on this server: it was never initialised, or its primary and backup were both "
        "lost (restore it from a checkpoint)",
        h.partition);
  }
  return it->second;
}

std::shared_ptr<std::vector<float>> ParameterStore::Buffer(size_t n) {
  std::unique_ptr<std::vector<float>> v;
  {
    MutexLock lock(&spares_->mu);
    auto& free = spares_->free;
    auto it = std::find_if(free.begin(), free.end(), [n](const auto& b) { return b->size() == n; });
    if (it != free.end()) {
      v = std::move(*it);
      free.erase(it);
      spares_->bytes -= n * sizeof(float);
    }
  }
  if (!v) v = std::make_unique<std::vector<float>>(n);
  return std::shared_ptr<std::vector<float>>(v.release(), [home = std::weak_ptr<Spares>(spares_)](auto* p) {
    std::unique_ptr<std::vector<float>> buffer(p);
    auto spares = home.lock();
    if (!spares) return;
    const size_t bytes = buffer->size() * sizeof(float);
    MutexLock lock(&spares->mu);
    if (spares->bytes + bytes > kMaxSpareBytes || spares->free.size() >= kMaxSpares) return;
    spares->bytes += bytes;
    spares->free.push_back(std::move(buffer));
  });
}

std::shared_ptr<std::vector<float>> ParameterStore::PushBuffer(const ps::Frame& h) {
  if (h.type != ps::FrameType::kPush) return nullptr;
  if (!Fp32Wire(h.dtype)) return nullptr;
  // Called on the transport's completion thread: never waits for the store's
  // lock (a step being shared holds it while it waits for partitions that
  // updates hold); without a buffer the push is received and copied.
  std::shared_ptr<Part> part;
  {
    if (!mu_.TryLock()) return nullptr;
    MutexLock lock(&mu_, std::adopt_lock);
    auto it = parts_.find(h.partition);
    if (it != parts_.end()) part = it->second;
  }
  if (!part) return nullptr;
  // Without the partition's lock: an update may hold it for a while, and
  // the payload should arrive meanwhile.
  const uint64_t n = part->elements.load(std::memory_order_relaxed);
  if (n == 0 || h.payload_bytes != n * sizeof(float)) return nullptr;
  return Buffer(n);
}

void ParameterStore::FoldLocked(Part& part, uint16_t dtype, const void* data,
                                std::shared_ptr<std::vector<float>>& buffer) {
  if (part.folded == 0 && Keepable(buffer, data, dtype, part.state.size())) {
    part.acc = std::move(buffer);  // the gradient is already where it belongs
  } else {
    AccumulateWire(part.acc->data(), data, Wire(dtype), part.acc->size(), part.folded == 0);
  }
  ++part.folded;
  while (!part.early.empty() && part.early.begin()->first == part.folded) {
    auto node = part.early.extract(part.early.begin());
    AccumulateWire(part.acc->data(), node.mapped().second.data(), Wire(node.mapped().first), part.acc->size(), false);
    ++part.folded;
  }
}

void ParameterStore::Push(uint64_t from, const ps::Frame& h, const void* payload, Reply reply) {
  std::shared_ptr<std::vector<float>> none;
  PushImpl(from, h, payload, none, reply);
}

void ParameterStore::Push(uint64_t from, const ps::Frame& h, std::shared_ptr<std::vector<float>> buffer, Reply reply) {
  const void* payload = buffer ? buffer->data() : nullptr;
  PushImpl(from, h, payload, buffer, reply);
}

void ParameterStore::Offload(std::function<void()> work) {
  if (options_.offload) return options_.offload(std::move(work));
  work();
}

bool ParameterStore::StepFitsHereLocked() const {
  uint64_t elements = 0;
  for (const auto& [id, part] : parts_) elements += part->elements.load(std::memory_order_relaxed);
  return elements * sizeof(float) <= kInlineStepBytes;
}

bool ParameterStore::StepFitsHere() const {
  MutexLock lock(&mu_);
  return StepFitsHereLocked();
}

bool ParameterStore::Light(const ps::Frame& h) const {
  switch (h.type) {
    case ps::FrameType::kPull:
    case ps::FrameType::kShare:
    case ps::FrameType::kReplicaReply:
    case ps::FrameType::kTransferReply:
      return true;
    case ps::FrameType::kPush:
      return h.payload_bytes <= kLightPushBytes &&
             (mode_.load() == v1::CONSISTENCY_MODE_SYNC || mode_.load() == v1::CONSISTENCY_MODE_UNSPECIFIED);
    default:
      return false;
  }
}

void ParameterStore::ShareStep(uint64_t epoch, uint64_t step) {
  Actions actions;
  MaybeShare(epoch, step, actions);
  Run(actions);
}

void ParameterStore::PushImpl(uint64_t from, const ps::Frame& h, const void* payload,
                              std::shared_ptr<std::vector<float>>& buffer, Reply& reply) {
  auto checked = CheckDataFrame(h, /*primary=*/true);
  v1::ConsistencyConfig consistency;
  v1::NonFinitePolicy policy;
  uint32_t dp;
  uint64_t epoch, start_step;
  {
    MutexLock lock(&mu_);
    consistency = consistency_;
    policy = optimizer_->non_finite_policy();
    dp = dp_size_;
    epoch = epoch_;
    start_step = start_step_;
  }
  counters_.pushes.fetch_add(1);
  counters_.push_bytes.fetch_add(h.payload_bytes);
  if (!checked.ok()) {
    counters_.rejected_pushes.fetch_add(1);
    std::vector<char> body;
    ps::Frame r = Refusal(h, checked.status(), &body);
    return reply(r, std::move(body));
  }
  PushIn in{from, h, payload, buffer, reply, epoch, *checked};
  if (IsSync(consistency)) return PushSync(in, **checked, policy);
  PushAsync(in, **checked, consistency, policy, dp, start_step);
}

Status ParameterStore::TakePushLocked(Part& part, const ps::Frame& h) {
  if (h.epoch != part.epoch) return Superseded(h.epoch, part.epoch);
  if (!ValidWireDType(h.dtype)) return InvalidArgument("dtype {} is not a wire dtype", h.dtype);
  if (h.contributors == 0 || h.contributors > kMaxContributors) {
    return InvalidArgument("contributors: {} must be 1 to {}", h.contributors, kMaxContributors);
  }
  if (h.contributor >= h.contributors) {
    return InvalidArgument("contributor {} is not below contributors ({})", h.contributor, h.contributors);
  }
  if (h.step == 0) return InvalidArgument("step: must be >= 1 (step 1 is the first update)");
  TANDEM_RETURN_IF_ERROR(Optimizer::CheckStepLearningRate(h.value));
  const size_t n = part.state.size();
  if (h.payload_bytes != WireBytes(Wire(h.dtype), n)) {
    return InvalidArgument("payload is {} bytes, partition {} needs {} ({} elements of {})", h.payload_bytes,
                           h.partition, WireBytes(Wire(h.dtype), n), n, v1::WireDType_Name(Wire(h.dtype)));
  }
  part.pushes++;
  part.bytes_pushed += h.payload_bytes;
  return Status::Ok();
}

void ParameterStore::RefusePush(PushIn& in, const Status& status) {
  counters_.rejected_pushes.fetch_add(1);
  std::vector<char> body;
  ps::Frame r = Refusal(in.h, status, &body);
  in.reply(r, std::move(body));
}

void ParameterStore::PushSync(PushIn& in, Part& part, v1::NonFinitePolicy policy) {
  const uint64_t from = in.from;
  const ps::Frame& h = in.h;
  // Taking the push in (folding it, acknowledging it) on the server's timeline.
  trace::Span span("push", "ps", h.step);
  span.Add("partition", h.partition);
  span.Add("contributor", h.contributor);
  span.Add("corr", static_cast<int64_t>(ps::Correlation(h)));
  MutexLock plock(&part.mu);
  Reply& reply = in.reply;
  const uint64_t epoch = in.epoch;
  const size_t n = part.state.size();
  ps::Frame ok = ps::ReplyTo(h, ps::FrameType::kPushReply);
  const void* payload = in.payload;
  std::shared_ptr<std::vector<float>>& buffer = in.buffer;
  // The lambda releases the lock the analysis sees held until the end.
  auto refuse = [&](const Status& status) TANDEM_NO_THREAD_SAFETY_ANALYSIS {
    plock.Unlock();
    RefusePush(in, status);
  };
  if (Status taken = TakePushLocked(part, h); !taken.ok()) return refuse(taken);
  if (h.step <= part.state.step) {
    counters_.duplicate_pushes.fetch_add(1);
    ok.flags = ps::kFlagDuplicate;
    const bool retried = h.step == part.state.step;
    plock.Unlock();
    reply(ok, {});
    // A step retried in a new epoch that this partition already applied:
    // its share is still needed by the servers that did not.
    if (retried) ShareStep(epoch, h.step);
    return;
  }
  if (h.step > part.state.step + 1) {
    return refuse(FailedPrecondition("step {} is from the future: partition {} has completed step {}, the next is {}",
                                     h.step, h.partition, part.state.step, part.state.step + 1));
  }
  if (part.agg_epoch != epoch || part.agg_step != h.step) {
    part.agg_epoch = epoch;
    part.agg_step = h.step;
    part.contributors = h.contributors;
    part.folded = 0;
    part.seen.assign(h.contributors, false);
    part.early.clear();
    part.ready = false;
    SetScanPending(part, false);
    // Still read by a replication in flight: the next step gets its own.
    // (The first contribution overwrites it, or becomes it.)
    if (!part.acc || part.acc.use_count() > 1 || part.acc->size() != n) part.acc = Buffer(n);
    part.first_push = std::chrono::steady_clock::now();
    part.last_pusher = 0;
  }
  if (h.contributors != part.contributors) {
    return refuse(InvalidArgument("contributors: this push says {}, earlier pushes of the step said {}", h.contributors,
                                  part.contributors));
  }
  // The step's learning rate is the first taken push's; every other push
  // of the step (a contributor's second one too) must carry it.
  if (part.folded == 0 && part.early.empty()) {
    part.agg_lr = h.value;
  } else if (h.value != part.agg_lr) {
    return refuse(InvalidArgument("push of step {} carries learning rate {}, but the step's other pushes carry {}",
                                  h.step, h.value, part.agg_lr));
  }
  if (part.seen[h.contributor]) {
    counters_.duplicate_pushes.fetch_add(1);
    ok.flags = ps::kFlagDuplicate;
    plock.Unlock();
    reply(ok, {});
    return;
  }
  if (policy == v1::NON_FINITE_POLICY_FAIL) {
    std::vector<float> widened(n);
    AccumulateWire(widened.data(), payload, Wire(h.dtype), n, true);
    if (!ScanGradient(widened.data(), n).finite) {
      spdlog::error(
          "partition {} step {}: contributor {} (member {}) pushed NaN or Inf; the step is refused "
          "(non_finite_policy FAIL): training stops until an operator intervenes",
          h.partition, h.step, h.contributor, from);
      return refuse(InvalidArgument("the gradient contains NaN or Inf (non_finite_policy FAIL refuses the step)"));
    }
  }
  part.seen[h.contributor] = true;
  const auto arrived = std::chrono::steady_clock::now();
  part.previous_push = part.last_pusher == 0 ? arrived : part.last_push;
  part.last_push = arrived;
  part.last_pusher = from;
  if (h.contributor == part.folded) {
    FoldLocked(part, h.dtype, payload, buffer);
  } else {
    const auto* bytes = static_cast<const char*>(payload);
    part.early.emplace(h.contributor, std::make_pair(h.dtype, std::vector<char>(bytes, bytes + h.payload_bytes)));
  }
  const bool complete = part.folded == part.contributors;
  if (!complete) {
    plock.Unlock();
    reply(ok, {});
    return;
  }
  if (trace::StepOn(h.step)) {
    // The aggregation's wait, from the first contribution to this, the last,
    // on the partition's own track (aggregations of partitions overlap).
    trace::CompleteOnTrack("partition", h.partition, "aggregation", "ps", trace::FromSteady(part.first_push),
                           trace::Now(), h.step,
                           {{"partition", h.partition},
                            {"last_contributor", h.contributor},
                            {"contributors", h.contributors},
                            {"last_member", static_cast<int64_t>(from)}});
  }
  // The push is in: it is acknowledged before the step's scan and update,
  // which follow on this thread (the reply leaves first: SendReply). The
  // scans wait until every partition here has the step (ScanStep), so that
  // they do not hold up the pushes of the others; until its scan is done a
  // partition is not ready, so nothing shares or decides the step.
  const std::shared_ptr<std::vector<float>> acc = part.acc;
  plock.Unlock();
  reply(ok, {});
  auto finish = [this, keep = in.keep, acc, epoch, step = h.step] { FinishAggregation(*keep, acc, epoch, step); };
  if (StepFitsHere()) return finish();
  Offload(std::move(finish));
}

void ParameterStore::PushAsync(PushIn& in, Part& part, const v1::ConsistencyConfig& consistency,
                               v1::NonFinitePolicy policy, uint32_t dp, uint64_t start_step) {
  const ps::Frame& h = in.h;
  // Taking the push in (and applying it, in these modes) on the server's timeline.
  trace::Span span("push", "ps", h.step);
  span.Add("partition", h.partition);
  span.Add("contributor", h.contributor);
  span.Add("corr", static_cast<int64_t>(ps::Correlation(h)));
  MutexLock plock(&part.mu);
  Reply& reply = in.reply;
  const uint64_t epoch = in.epoch;
  const size_t n = part.state.size();
  Actions actions;
  ps::Frame ok = ps::ReplyTo(h, ps::FrameType::kPushReply);
  const void* payload = in.payload;
  std::shared_ptr<std::vector<float>>& buffer = in.buffer;
  // The lambda releases the lock the analysis sees held until the end.
  auto refuse = [&](const Status& status) TANDEM_NO_THREAD_SAFETY_ANALYSIS {
    plock.Unlock();
    RefusePush(in, status);
  };
  if (Status taken = TakePushLocked(part, h); !taken.ok()) return refuse(taken);
  // Asynchronous and bounded staleness: apply now. The contributors'
  // clocks start with the epoch's first push or pull; a push that names
  // another count is refused rather than restarting them (which would let
  // duplicates in again and lose the staleness bound).
  const bool first_clocks = part.clocks.empty();
  if (first_clocks) part.clocks.assign(h.contributors, start_step);
  if (part.clocks.size() != h.contributors) {
    return refuse(InvalidArgument("contributors: this push says {}, earlier pushes and pulls of epoch {} said {}",
                                  h.contributors, epoch, part.clocks.size()));
  }
  // A refused push leaves no clocks behind, so it cannot fix the epoch's
  // contributor count either.
  auto refuse_async = [&](const Status& status) TANDEM_REQUIRES(part.mu) {
    if (first_clocks) part.clocks.clear();
    return refuse(status);
  };
  if (h.step <= part.clocks[h.contributor]) {
    counters_.duplicate_pushes.fetch_add(1);
    ok.flags = ps::kFlagDuplicate;
    plock.Unlock();
    reply(ok, {});
    return;
  }
  const uint64_t slowest = *std::min_element(part.clocks.begin(), part.clocks.end());
  if (consistency.mode() == v1::CONSISTENCY_MODE_BOUNDED_STALENESS &&
      h.step > slowest + consistency.staleness_bound() + 1) {
    return refuse_async(FailedPrecondition(
        "step {} is from the future: the slowest contributor has pushed step {} and the staleness bound is {}", h.step,
        slowest, consistency.staleness_bound()));
  }
  std::shared_ptr<std::vector<float>> grad;
  if (Keepable(buffer, payload, h.dtype, n)) {
    grad = std::move(buffer);
  } else {
    grad = Buffer(n);
    AccumulateWire(grad->data(), payload, Wire(h.dtype), n, true);
  }
  const uint64_t clock_before = part.clocks[h.contributor];
  part.clocks[h.contributor] = h.step;
  counters_.staleness_last.store(part.state.step > h.step - 1 ? part.state.step - (h.step - 1) : 0);
  const GradScan scan = ScanForNorm(grad->data(), n, part.segments);
  ps::Frame rep;
  rep.type = ps::FrameType::kReplica;
  rep.partition = h.partition;
  rep.epoch = epoch;
  rep.version = part.state.version;
  if (!scan.finite) {
    if (policy == v1::NON_FINITE_POLICY_FAIL) {
      part.clocks[h.contributor] = clock_before;  // refused: as if it never came
      return refuse_async(InvalidArgument("the gradient contains NaN or Inf (non_finite_policy FAIL refuses it)"));
    }
    counters_.skipped_steps.fetch_add(1);
    rep.flags = ps::kFlagSkip;
    part.state.step += 1;
    grad.reset();
    ok.flags = ps::kFlagSkip;
  } else {
    rep.value = opt_.load()->reduction() == v1::GRADIENT_REDUCTION_SUM ? 1.0 : 1.0 / dp;
    ps::SetReplicaLearningRate(rep, h.value);
    ApplyLocked(part, grad->data(), rep.value, h.value);
    part.state.step += 1;
  }
  rep.step = part.state.step;
  ok.step = part.state.step;
  ok.version = part.state.version;
  part.push_acks.emplace_back(part.state.step, [reply, ok](ps::Frame r, ReplyBody body) {
    if (r.status == 0) r = ok;
    reply(r, std::move(body));
  });
  ReplicateLocked(part, rep, grad, actions);
  ServePullsLocked(part, actions);
  const uint64_t completed = part.state.step;
  plock.Unlock();
  Run(actions);
  StepCompleted(h.partition, completed);
}

void ParameterStore::FinishAggregation(Part& part, const std::shared_ptr<std::vector<float>>& acc, uint64_t epoch,
                                       uint64_t step) {
  {
    MutexLock plock(&part.mu);
    // Replaced meanwhile (a new epoch dropped the step's pushes: its
    // contributors retry the step there).
    if (!Complete(part, epoch, step) || part.acc != acc) return;
    SetScanPending(part, true);
  }
  ScanStep(epoch, step);
}

void ParameterStore::SetScanPending(Part& part, bool pending) {
  if (part.scan_pending == pending) return;
  part.scan_pending = pending;
  scans_pending_.fetch_add(pending ? 1 : -1);
}

bool ParameterStore::Complete(const Part& part, uint64_t epoch, uint64_t step) {
  return part.agg_epoch == epoch && part.agg_step == step && !part.ready && part.folded == part.contributors &&
         part.acc != nullptr;
}

void ParameterStore::ScanStep(uint64_t epoch, uint64_t step) {
  struct Claim {
    std::shared_ptr<Part> part;
    std::shared_ptr<std::vector<float>> acc;
    std::vector<Segment> segments;
    GradScan scan;
  };
  std::vector<Claim> claims;
  {
    MutexLock lock(&mu_);
    if (epoch != epoch_) return;
    // Once every primary partition here has the step (or applied it
    // before), whoever gets here first claims the scans.
    for (auto& [id, part] : parts_) {
      MutexLock plock(&part->mu);
      if (part->role != v1::REPLICA_ROLE_PRIMARY) continue;
      const bool has_step = part->state.step >= step || (part->agg_epoch == epoch && part->agg_step == step &&
                                                         (part->ready || Complete(*part, epoch, step)));
      if (!has_step) return;  // the push that completes the last one scans
    }
    for (auto& [id, part] : parts_) {
      MutexLock plock(&part->mu);
      if (part->role != v1::REPLICA_ROLE_PRIMARY || !part->scan_pending || !Complete(*part, epoch, step)) continue;
      SetScanPending(*part, false);
      claims.push_back(Claim{part, part->acc, part->segments, {}});
    }
  }
  if (claims.empty()) return;  // claimed by another thread, which shares the step
  // Nothing writes a complete aggregation's buffer (a new aggregation gets a
  // buffer of its own while this one is held), so it is read unlocked.
  for (Claim& c : claims) c.scan = ScanForNorm(c.acc->data(), c.acc->size(), c.segments);
  for (Claim& c : claims) {
    MutexLock plock(&c.part->mu);
    if (!Complete(*c.part, epoch, step) || c.part->acc != c.acc) continue;  // a new epoch dropped it
    c.part->ready = true;
    c.part->last_share = ps::ShareEntry{c.part->state.id, c.scan.finite ? 1u : 0u, c.scan.sum_squares};
  }
  ShareStep(epoch, step);
}

void ParameterStore::ApplyLocked(Part& part, const float* grad, double grad_scale, double lr) {
  // The optimizer's update of the partition (of the step after the partition's last).
  trace::Span span("update", "ps", part.state.step + 1);
  span.Add("partition", part.state.id);
  span.Add("elements", static_cast<int64_t>(part.state.size()));
  span.Add("backup", part.role == v1::REPLICA_ROLE_BACKUP);
  const auto start = std::chrono::steady_clock::now();
  UnlendLocked(part, /*keep_values=*/true);
  const uint64_t update_index = part.state.version - 1;
  float* w = part.state.weights.data();
  float* s0 = part.state.state0.empty() ? nullptr : part.state.state0.data();
  float* s1 = part.state.state1.empty() ? nullptr : part.state.state1.data();
  const Optimizer* opt = opt_.load();
  for (const Segment& seg : part.segments) {
    pool_->ParallelFor(seg.count, kApplyGrain, [&](size_t b, size_t e) {
      const size_t o = seg.offset + b;
      opt->Apply(w + o, s0 ? s0 + o : nullptr, s1 ? s1 + o : nullptr, grad + o, e - b, update_index, seg.group,
                 grad_scale, lr);
    });
  }
  part.state.version += 1;
  counters_.updates.fetch_add(1);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  counters_.update_seconds.fetch_add(seconds);
}

void ParameterStore::MaybeShare(uint64_t epoch, uint64_t step, Actions& actions) {
  MutexLock lock(&mu_);
  if (epoch != epoch_) return;
  auto found = rounds_.find({epoch, step});
  if (found != rounds_.end() && found->second.shared) return;
  std::vector<ps::ShareEntry> entries;
  for (auto& [id, part] : parts_) {
    MutexLock plock(&part->mu);
    if (part->role != v1::REPLICA_ROLE_PRIMARY) continue;
    const bool decided_before = part->state.step == step;  // share it again
    const bool aggregated =
        part->state.step + 1 == step && part->agg_epoch == epoch && part->agg_step == step && part->ready;
    if (!decided_before && !aggregated) return;  // still aggregating
    if (decided_before) {
      // Applied before (here or, as a backup then, by its primary): the
      // decision itself, which every server applies to what it has left.
      if (part->decided_step != step) {
        spdlog::warn("partition {}: step {} was applied without a known decision; sharing it as finite and unclipped",
                     part->state.id, step);
      }
      const bool known = part->decided_step == step;
      entries.push_back(ps::ShareEntry{part->state.id,
                                       ps::kShareDecided | (known && part->decided_skip ? 0u : ps::kShareFinite),
                                       known ? part->decided_coef : 1.0});
    } else {
      entries.push_back(part->last_share);
    }
  }
  Round& round = rounds_[{epoch, step}];
  round.shared = true;
  round.dp = dp_size_;
  for (const auto& e : entries) round.entries.emplace(e.partition, e);
  last_shared_ = SentShare{epoch, step, entries};
  if (other_servers_) {
    actions.push_back([this, epoch, step, entries = std::move(entries)] { links_->SendShare(epoch, step, entries); });
  }
  MaybeDecide(epoch, step, actions);
}

void ParameterStore::Share(uint64_t from, const ps::Frame& h, const void* payload) {
  const size_t n = h.contributors;
  if (h.payload_bytes != n * sizeof(ps::ShareEntry)) {
    spdlog::warn("member {} sent a step share of {} bytes for {} entries; ignored", from, h.payload_bytes, n);
    return;
  }
  std::vector<ps::ShareEntry> entries(n);
  if (n > 0) std::memcpy(entries.data(), payload, n * sizeof(ps::ShareEntry));
  Actions actions;
  {
    MutexLock lock(&mu_);
    if (h.epoch < epoch_) {
      // Only a round kept from an old epoch still takes its shares.
      auto it = rounds_.find({h.epoch, h.step});
      if (it == rounds_.end() || it->second.decided) return;
      for (const auto& e : entries) it->second.entries.emplace(e.partition, e);
      MaybeDecide(h.epoch, h.step, actions);
    } else {
      Round& round = rounds_[{h.epoch, h.step}];
      for (const auto& e : entries) round.entries.emplace(e.partition, e);
      if (h.epoch == epoch_) MaybeDecide(h.epoch, h.step, actions);
    }
  }
  Run(actions);
}

void ParameterStore::MaybeDecide(uint64_t epoch, uint64_t step, Actions& actions) {
  auto it = rounds_.find({epoch, step});
  if (it == rounds_.end() || it->second.decided || !it->second.shared) return;
  if (it->second.entries.size() < static_cast<size_t>(map_.partitions_size())) return;
  it->second.decided = true;
  Decide(epoch, step, it->second, actions);
  rounds_.erase(it);
  // Older rounds of this epoch can no longer matter.
  for (auto r = rounds_.begin(); r != rounds_.end();) {
    r = (r->first.first == epoch && r->first.second < step) ? rounds_.erase(r) : std::next(r);
  }
}

void ParameterStore::Decide(uint64_t epoch, uint64_t step, const Round& round, Actions& actions) {
  trace::Span span("decide", "ps", step);
  span.Add("epoch", static_cast<int64_t>(epoch));
  double total = 0;
  bool finite = true;
  const ps::ShareEntry* decided = nullptr;  // a partition that applied the step before
  for (const auto& [id, e] : round.entries) {
    if ((e.finite & ps::kShareDecided) != 0) {
      decided = &e;
      continue;
    }
    total += e.sum_squares;
    finite = finite && (e.finite & ps::kShareFinite) != 0;
  }
  finite = finite && std::isfinite(total);
  const double divisor = optimizer_->reduction() == v1::GRADIENT_REDUCTION_SUM
                             ? 1.0
                             : static_cast<double>(std::max<uint32_t>(1, round.dp));
  double coef = 1.0;
  const double max_norm = optimizer_->max_grad_norm();
  const double norm = std::sqrt(total) / divisor;
  if (finite && max_norm > 0 && norm > max_norm) coef = max_norm / (norm + 1e-6);
  if (decided != nullptr) {
    // The step was decided before (a retry after a failure): the partitions
    // that have not applied it apply that decision.
    finite = (decided->finite & ps::kShareFinite) != 0;
    coef = decided->sum_squares;
  }
  const bool skip = !finite;
  if (skip) {
    counters_.skipped_steps.fetch_add(1);
    spdlog::warn(
        "step {}: the gradient holds NaN or Inf; the step is skipped on every server (non_finite_policy "
        "SKIP_STEP)",
        step);
  }
  std::vector<std::shared_ptr<Part>> parts;
  // Who held the step up here: the member that pushed last to the most
  // partitions (a hiccup on one partition does not outvote the others), by
  // the mean of how long after the push before it its pushes came.
  std::map<uint64_t, std::pair<uint32_t, double>> last;  // member -> partitions, seconds
  for (auto& [id, part] : parts_) {
    MutexLock plock(&part->mu);
    if (part->role == v1::REPLICA_ROLE_PRIMARY && part->agg_epoch == epoch && part->agg_step == step && part->ready &&
        part->state.step + 1 == step) {
      parts.push_back(part);
      counters_.aggregation_seconds.fetch_add(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - part->first_push).count());
      if (part->contributors > 1 && part->last_pusher != 0) {
        auto& [count, seconds] = last[part->last_pusher];
        ++count;
        seconds += std::chrono::duration<double>(part->last_push - part->previous_push).count();
      }
    }
  }
  if (!last.empty() && step_wait_sink_) {
    const auto most = std::max_element(last.begin(), last.end(), [](const auto& a, const auto& b) {
      return a.second.first != b.second.first ? a.second.first < b.second.first : a.second.second < b.second.second;
    });
    v1::StepWait wait;
    wait.set_step(step);
    wait.set_late_member_id(most->first);
    wait.set_late_seconds(most->second.second / most->second.first);
    wait.set_scope("server");
    step_wait_sink_(std::move(wait));
  }
  const double grad_scale = coef / divisor;
  auto apply = [this, parts = std::move(parts), epoch, step, skip, coef, grad_scale]() mutable {
    ApplyDecision(std::move(parts), epoch, step, skip, coef, grad_scale);
  };
  if (StepFitsHereLocked()) {
    actions.push_back(std::move(apply));
  } else {
    actions.push_back([this, apply = std::move(apply)]() mutable { Offload(std::move(apply)); });
  }
}

void ParameterStore::ApplyDecision(std::vector<std::shared_ptr<Part>> parts, uint64_t epoch, uint64_t step, bool skip,
                                   double coef, double grad_scale) {
  const auto crash_primary_of = FailpointNumber("ps.crash_on_decide_primary_of");
  // With crash_on_decide_primary_of, only in epoch 1: the server that
  // takes the partition over must not die of the same failpoint.
  const bool crash_here = !crash_primary_of.has_value() ||
                          (epoch == 1 && std::any_of(parts.begin(), parts.end(), [&](const std::shared_ptr<Part>& p) {
                             MutexLock lock(&p->mu);
                             return p->state.id == *crash_primary_of;
                           }));
  if (!parts.empty() && FailpointNumber("ps.crash_on_decide") == step && crash_here) {
    // The other servers have this server's share, so they decide the step
    // and apply it; this server's partitions are neither applied nor
    // replicated, and their promoted backups are one step behind.
    FailpointCrashSoon(fmt::format("ps.crash_on_decide: step {} is decided; this server dies before applying it to "
                                   "its {} primary partition(s) and replicating them",
                                   step, parts.size()),
                       300);
    return;
  }
  // Partition by partition, in id order (the order of the parameter space,
  // which is the order the workers' next forward reads it): each one's
  // replication and waiting pulls go out as soon as it is applied, while the
  // next one is.
  Actions actions;
  std::vector<uint32_t> completed;
  for (const std::shared_ptr<Part>& part : parts) {
    Run(actions);
    // A step decided in an old epoch replicates in the current one.
    const uint64_t current = this->epoch();
    MutexLock plock(&part->mu);
    if (part->agg_epoch != epoch || part->agg_step != step || !part->ready || part->state.step + 1 != step) continue;
    ps::Frame rep;
    rep.type = ps::FrameType::kReplica;
    rep.partition = part->state.id;
    rep.epoch = current;
    rep.step = step;
    rep.version = part->state.version;
    rep.value = grad_scale;
    ps::SetReplicaLearningRate(rep, part->agg_lr);
    std::shared_ptr<const std::vector<float>> grad;
    if (skip) {
      rep.flags = ps::kFlagSkip;
    } else {
      ApplyLocked(*part, part->acc->data(), grad_scale, part->agg_lr);
      grad = part->acc;
    }
    part->state.step = step;
    part->decided_step = step;
    part->decided_coef = coef;
    part->decided_skip = skip;
    part->ready = false;
    part->agg_epoch = 0;
    // Without a backup this answers the step's waiting pulls.
    ReplicateLocked(*part, rep, grad, actions);
    completed.push_back(part->state.id);
  }
  Run(actions);
  for (uint32_t id : completed) StepCompleted(id, step);
}

void* PushLanding::PayloadBuffer(int peer, const ps::Frame& header) {
  if (peer < 0 || static_cast<size_t>(peer) >= slots_.size()) return nullptr;
  auto& slot = slots_[static_cast<size_t>(peer)];
  slot = store_->PushBuffer(header);
  return slot ? slot->data() : nullptr;
}

std::shared_ptr<std::vector<float>> PushLanding::Take(int peer, const void* payload) {
  if (peer < 0 || static_cast<size_t>(peer) >= slots_.size()) return nullptr;
  std::shared_ptr<std::vector<float>> buffer = std::move(slots_[static_cast<size_t>(peer)]);
  if (buffer && buffer->data() == payload) return buffer;
  return nullptr;
}

}  // namespace tandem::server
