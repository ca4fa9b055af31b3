// The worker runtime's trace spans of collectives (common/trace.h): the
// operation, its group, the bytes, and whom it waited for
// (Communicator::last_wait). Internal header: not installed.
#pragma once

#include <cstdint>

#include "common/trace.h"
#include "worker/comm/communicator.h"

namespace tandem::worker {

// Records a collective of `group` that began at `start` (trace::Now()), for
// `step`, once it returned; whom it waited for (Communicator::last_wait:
// the group rank and member that entered last, and by how much) when it
// succeeded, -1 when the backend names no one.
inline void TraceCollective(const char* name, const comm::Communicator& group, uint64_t step, int64_t start,
                            uint64_t bytes, bool succeeded) {
  if (!trace::StepOn(step)) return;
  const comm::Wait wait = succeeded ? group.last_wait() : comm::Wait{};
  trace::Complete(name, "comm", start, trace::Now(), step,
                  {{"bytes", static_cast<int64_t>(bytes)},
                   {"group_rank", group.rank()},
                   {"waited_for", wait.rank},
                   {"waited_for_member", wait.rank >= 0 ? static_cast<int64_t>(group.member_id(wait.rank)) : 0},
                   {"waited_ns", static_cast<int64_t>(wait.seconds * 1e9)}},
                  "group", group.name());
}

inline int64_t TraceStart(uint64_t step) {
  return trace::StepOn(step) ? trace::Now() : 0;
}

}  // namespace tandem::worker
