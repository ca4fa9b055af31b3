// The worker runtime's trace spans of collectives (common/trace.h): the
// operation, its group and the bytes. Internal header: not installed.
#pragma once

#include <cstdint>

#include "common/trace.h"
#include "worker/comm/communicator.h"

namespace tandem::worker {

// Records a collective of `group` that began at `start` (trace::Now()), for
// `step`, once it returned.
inline void TraceCollective(const char* name, const comm::Communicator& group, uint64_t step, int64_t start,
                            uint64_t bytes, bool succeeded) {
  if (!trace::StepOn(step)) return;
  trace::Complete(name, "comm", start, trace::Now(), step,
                  {{"bytes", static_cast<int64_t>(bytes)},
                   {"group_rank", group.rank()},
                   {"ok", succeeded}},
                  "group", group.name());
}

inline int64_t TraceStart(uint64_t step) {
  return trace::StepOn(step) ? trace::Now() : 0;
}

}  // namespace tandem::worker
