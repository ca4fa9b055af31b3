// Making parameters valid before the model reads them (runtime.h,
// Acquire and Release): the last step's parameters still landing from the
// servers, and the sharded placement's gathers from the node's workers,
// with the next segment's gather prefetched, and the pages handed back.
#include <algorithm>
#include <climits>
#include <cstring>

#include "worker/runtime/buckets.h"
#include "worker/runtime/step.h"
#include "worker/runtime/trace_spans.h"

namespace tandem::worker {

using runtime_internal::Clock;
using runtime_internal::Seconds;

Status Runtime::Acquire(std::pair<size_t, size_t> now, std::pair<size_t, size_t> next) {
  if (now.first >= now.second) return Status::Ok();
  const uint64_t step = in_step_ ? step_ : 0;
  const int64_t trace_start = TraceStart(step);
  const auto start = Clock::now();
  Status status = sharded_ ? AcquireSharded(now, next) : AwaitLanding(now);
  parameter_wait_ += Seconds(Clock::now() - start);
  // Only a real wait is a span (most segments' parameters are there already).
  if (const int64_t end = trace_start != 0 ? trace::Now() : 0; end - trace_start > 2000) {
    trace::Complete("param_wait", "step", trace_start, end, step,
                    {{"begin", static_cast<int64_t>(now.first)}, {"end", static_cast<int64_t>(now.second)}});
  }
  return status;
}

Status Runtime::WaitForParameters() {
  if (params_.empty()) return Status::Ok();
  return AwaitLanding({0, params_.size()});
}

Status Runtime::AwaitLanding(std::pair<size_t, size_t> range) {
  uint64_t ticket = 0;
  for (const auto& b : buckets_) {
    if (b->landed != 0 && b->begin < range.second && b->end > range.first) ticket = std::max(ticket, b->landed);
  }
  if (ticket == 0) return Status::Ok();
  return WaitFor(ticket).WithContext("waiting for the last step's parameters from the servers");
}

Status Runtime::AcquireSharded(std::pair<size_t, size_t> now, std::pair<size_t, size_t> next) {
  uint64_t ticket = 0;
  if (gathers_.prefetch_ticket != 0 && gathers_.prefetched == now) {
    ticket = gathers_.prefetch_ticket;
  } else {
    // A prefetch of something else finishes first: planning may grow the
    // buffers it uses.
    if (gathers_.prefetch_ticket != 0) TANDEM_RETURN_IF_ERROR(WaitFor(gathers_.prefetch_ticket));
    GatherPlan* plan = &PlanGather(now);
    ticket = Enqueue([this, plan] { return Gather(*plan); });
  }
  gathers_.prefetch_ticket = 0;
  gathers_.prefetched = gathers_.prefetched_span = {0, 0};
  Status status = WaitFor(ticket);
  if (!status.ok()) return status;
  if (next.first < next.second) {
    GatherPlan* plan = &PlanGather(next);
    gathers_.prefetched = next;
    gathers_.prefetched_span = plan->span;
    gathers_.prefetch_ticket = Enqueue([this, plan] { return Gather(*plan); });
  }
  return Status::Ok();
}

Runtime::GatherPlan& Runtime::PlanGather(std::pair<size_t, size_t> range) {
  auto& cached = gathers_.plans[range];
  if (cached) return *cached;
  cached = std::make_unique<GatherPlan>();
  GatherPlan& plan = *cached;
  const int local = node_->size();
  std::vector<size_t> fill(static_cast<size_t>(local), 0);
  plan.span = {SIZE_MAX, 0};
  for (const PartitionPlace& place : places_) {
    if (place.bucket == nullptr) continue;
    const auto [from, to] = place.bucket->cuts[place.k];
    if (to <= range.first || from >= range.second) continue;
    const size_t owner = place.bucket->owner[place.k];
    plan.parts.emplace_back(place.bucket, place.k);
    plan.slot.push_back(fill[owner]);
    fill[owner] += place.bucket->ranges[place.k].second - place.bucket->ranges[place.k].first;
    plan.span = {std::min(plan.span.first, from), std::max(plan.span.second, to)};
  }
  plan.block = *std::max_element(fill.begin(), fill.end());
  if (plan.parts.empty()) plan.span = {0, 0};
  gathers_.send.resize(std::max(gathers_.send.size(), plan.block));
  gathers_.staging.resize(std::max(gathers_.staging.size(), plan.block * static_cast<size_t>(local)));
  return plan;
}

Status Runtime::Gather(GatherPlan& plan) {
  const int me = node_->rank();
  for (size_t j = 0; j < plan.parts.size(); ++j) {
    const auto [b, k] = plan.parts[j];
    if (static_cast<int>(b->owner[k]) != me) continue;
    std::memcpy(gathers_.send.data() + plan.slot[j], b->pulled.data() + b->slot[k],
                (b->ranges[k].second - b->ranges[k].first) * sizeof(float));
  }
  const int64_t start = TraceStart(step_);
  Status gathered = node_->AllGather(gathers_.send.data(), gathers_.staging.data(), plan.block, comm::DType::kFloat32);
  TraceCollective("gather", *node_, step_, start, plan.block * static_cast<size_t>(node_->size()) * sizeof(float),
                  gathered.ok());
  TANDEM_RETURN_IF_ERROR(gathered.WithContext("gathering parameters from the node's workers (sharded placement)"));
  for (size_t j = 0; j < plan.parts.size(); ++j) {
    const auto [b, k] = plan.parts[j];
    const size_t owner = b->owner[k];
    const auto [from, to] = b->cuts[k];
    std::memcpy(params_.data() + from, gathers_.staging.data() + owner * plan.block + plan.slot[j] + b->cut_offset[k],
                (to - from) * sizeof(float));
  }
  return Status::Ok();
}

void Runtime::NoteParameterBytes() {
  uint64_t bytes = param_pages_ != nullptr ? param_pages_->ResidentBytes() : params_.size_bytes();
  for (const auto& b : buckets_) bytes += b->share * sizeof(float);
  parameter_bytes_ = std::max(parameter_bytes_, bytes);
}

void Runtime::Release(std::pair<size_t, size_t> now) {
  if (!sharded_) return;
  NoteParameterBytes();  // the segment in use and the one being gathered
  // Everything `now`'s gather wrote (whole partitions, which may reach into
  // the neighbouring segments), but not the elements the prefetch writes.
  size_t from = now.first, to = now.second;
  if (auto it = gathers_.plans.find(now);
      it != gathers_.plans.end() && it->second->span.first < it->second->span.second) {
    from = std::min(from, it->second->span.first);
    to = std::max(to, it->second->span.second);
  }
  const auto [pb, pe] = gathers_.prefetched_span;
  if (pb < pe && pb < to && pe > from) {
    if (pb > from) param_pages_->Release(from, pb);
    if (pe < to) param_pages_->Release(pe, to);
    return;
  }
  param_pages_->Release(from, to);
}

}  // namespace tandem::worker
