// ParameterStore, checkpoints: capturing partitions at a step, and
// replacing them on restore.
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

void ParameterStore::StopCaptures() {
  {
    MutexLock lock(&mu_);
    captures_stopped_ = true;
    for (auto& capture : captures_) capture->failed = Unavailable("the server is shutting down");
    captures_.clear();
  }
  changed_.NotifyAll();
}

Result<Capture> ParameterStore::CaptureAt(uint64_t step, std::chrono::milliseconds timeout) {
  auto request = std::make_shared<CaptureRequest>();
  // The capture on the server's timeline, from the request to the copies of
  // every partition at the step (a checkpoint's part that holds up training).
  struct CaptureSpan {
    const CaptureRequest& request;
    int64_t start = trace::On() ? trace::Now() : 0;
    ~CaptureSpan() {
      if (start == 0) return;
      trace::Complete("capture", "checkpoint", start, trace::Now(), request.step,
                      {{"partitions", static_cast<int64_t>(request.result.partitions.size())},
                       {"expected", static_cast<int64_t>(request.expected.size())}});
    }
  } span{*request};
  std::vector<std::shared_ptr<Part>> parts;
  MutexLock lock(&mu_);
  if (captures_stopped_) return Unavailable("the server is shutting down");
  if (!configured_) return FailedPrecondition("the job has not been initialised on this server");
  for (auto& [id, part] : parts_) {
    MutexLock plock(&part->mu);
    if (part->role == v1::REPLICA_ROLE_PRIMARY) parts.push_back(part);
  }
  if (parts.empty()) return Capture{step, {}};
  uint64_t lo = UINT64_MAX, hi = 0;
  for (auto& part : parts) {
    MutexLock plock(&part->mu);
    if (part->state.version == 0) {
      return FailedPrecondition("partition {} has no state (it was never initialised or was lost)", part->state.id);
    }
    lo = std::min(lo, part->state.step);
    hi = std::max(hi, part->state.step);
  }
  if (step == 0) {
    if (lo != hi) {
      return FailedPrecondition(
          "step: 0 asks for the current step, but this server's partitions are between steps "
          "{} and {}; name a step (or pause training)",
          lo, hi);
    }
    step = lo;
  }
  if (hi > step) {
    return FailedPrecondition("step: this server has already completed step {}, past the requested step {}", hi, step);
  }
  request->step = step;
  request->result.step = step;
  for (auto& part : parts) {
    MutexLock plock(&part->mu);
    request->expected.insert(part->state.id);
    if (part->state.step == step) request->result.partitions.push_back(part->state);
  }
  if (!request->done()) {
    captures_.push_back(request);
    const bool ok = changed_.WaitFor(lock, timeout, [&] { return request->done(); });
    captures_.erase(std::remove(captures_.begin(), captures_.end(), request), captures_.end());
    if (!ok) {
      return DeadlineExceeded("step {} was not reached within {} ms ({} of {} partitions there)", step, timeout.count(),
                              request->result.partitions.size(), request->expected.size());
    }
  }
  if (!request->failed.ok()) return request->failed;
  // The partitions are copied in the order they reach the step, whatever
  // their role when they do.
  std::sort(request->result.partitions.begin(), request->result.partitions.end(),
            [](const PartitionState& a, const PartitionState& b) { return a.id < b.id; });
  return std::move(request->result);
}

size_t ParameterStore::WaitingCaptures() const {
  MutexLock lock(&mu_);
  return captures_.size();
}

void ParameterStore::StepCompleted(uint32_t partition, uint64_t step) {
  // Called without part locks held; copies state for waiting captures.
  std::shared_ptr<Part> part;
  {
    MutexLock lock(&mu_);
    bool wanted = false;
    // A backup given the whole state by transfer can jump past a step.
    for (const auto& c : captures_) {
      wanted = wanted || (c->step <= step && c->expected.count(partition) > 0 && !c->Captured(partition));
    }
    if (wanted) {
      auto it = parts_.find(partition);
      if (it != parts_.end()) part = it->second;
      if (part) {
        MutexLock plock(&part->mu);
        for (auto& c : captures_) {
          if (c->step > step || c->expected.count(partition) == 0 || !c->failed.ok() || c->Captured(partition)) {
            continue;
          }
          if (part->state.step == step) {
            trace::Span copy("capture_copy", "checkpoint", step);
            copy.Add("partition", partition);
            c->result.partitions.push_back(part->state);
          } else {
            c->failed =
                FailedPrecondition("partition {} moved past step {} before it could be captured", partition, step);
          }
        }
      }
    }
  }
  changed_.NotifyAll();
}

Status ParameterStore::Replace(std::vector<PartitionState> states, bool skip_optimizer_state) {
  int buffers = 0;
  {
    MutexLock lock(&mu_);
    if (!configured_) return FailedPrecondition("the job has not been initialised on this server");
    buffers = optimizer_->state_buffers();
  }
  std::vector<std::shared_ptr<Part>> parts;
  for (auto& s : states) {
    auto part = Find(s.id);
    if (!part) return FailedPrecondition("partition {} is not held by this server", s.id);
    MutexLock plock(&part->mu);
    if (part->state.begin != s.begin || part->state.end != s.end || s.weights.size() != s.size()) {
      return InvalidArgument("partition {}: restored range [{}, {}) does not match [{}, {})", s.id, s.begin, s.end,
                             part->state.begin, part->state.end);
    }
    parts.push_back(part);
  }
  Actions actions;
  for (size_t i = 0; i < states.size(); ++i) {
    auto& s = states[i];
    Part& part = *parts[i];
    MutexLock plock(&part.mu);
    if (skip_optimizer_state || s.state0.size() != (buffers >= 1 ? s.size() : 0) ||
        s.state1.size() != (buffers >= 2 ? s.size() : 0)) {
      s.state0.assign(buffers >= 1 ? s.size() : 0, 0.0f);
      s.state1.assign(buffers >= 2 ? s.size() : 0, 0.0f);
    }
    UnlendLocked(part, /*keep_values=*/false);
    part.state.weights = std::move(s.weights);
    part.state.state0 = std::move(s.state0);
    part.state.state1 = std::move(s.state1);
    part.state.version = std::max<uint64_t>(1, s.version);
    part.state.step = s.step;
    part.safe_step = s.step;
    ClearInSyncLocked(part);
    part.agg_epoch = 0;
    part.ready = false;
    SetScanPending(part, false);
    part.early.clear();
    for (auto& pull : part.pulls) {
      std::vector<char> payload;
      ps::Frame reply =
          ErrorReply(pull.header, ps::FrameType::kPullReply,
                     Aborted("partition {} was restored from a checkpoint (step {})", s.id, s.step), &payload);
      actions.push_back(
          [r = std::move(pull.reply), reply, payload = std::move(payload)]() mutable { r(reply, std::move(payload)); });
    }
    part.pulls.clear();
  }
  Run(actions);
  return Status::Ok();
}

}  // namespace tandem::server
