// Who held up each training step, as a member saw it (v1::StepWait), kept
// until the next heartbeat carries it to the coordinator, whose straggler
// score is built from these reports (coordinator/stragglers.h).
//
// Workers add one per completed step (worker/runtime), servers one per
// decided step (server/ps_aggregation.cc); the member session takes them
// for each heartbeat (MemberSessionOptions::step_waits). At most kMax are
// kept: when heartbeats stop (the coordinator is unreachable) the oldest go.
// A heartbeat that fails loses the reports it carried; the score is built
// from a window of steps and does not need every one.
//
// Thread safety: thread-safe.
#pragma once

#include <cstddef>
#include <deque>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "common/thread_annotations.h"
#include "tandem/v1/types.pb.h"

namespace tandem {

class StepWaitLog {
 public:
  static constexpr size_t kMax = 64;  // HeartbeatRequest.step_waits

  void Add(v1::StepWait wait) {
    MutexLock lock(&mu_);
    if (waits_.size() == kMax) waits_.pop_front();
    waits_.push_back(std::move(wait));
  }

  // Everything added since the last call, oldest first.
  std::vector<v1::StepWait> Take() {
    MutexLock lock(&mu_);
    std::vector<v1::StepWait> out(std::make_move_iterator(waits_.begin()), std::make_move_iterator(waits_.end()));
    waits_.clear();
    return out;
  }

 private:
  Mutex mu_;
  std::deque<v1::StepWait> waits_ TANDEM_GUARDED_BY(mu_);
};

}  // namespace tandem
