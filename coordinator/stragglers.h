// The coordinator's straggler score: one per worker, over a sliding window of
// steps, built from what the job's members saw of each step
// (v1::StepWait in their heartbeats), with hysteresis before a worker is
// named a straggler and before it is cleared.
//
// Each step is charged to at most one worker, the one that held it up:
// - With parameter servers, a server reports the member whose push of the
//   step came last at one of its partitions and how long after the push
//   before it (the largest over its partitions; the coordinator takes the
//   largest over the servers). In hybrid mode that member stands for its
//   node: the node's workers report which of them entered the node's
//   reduce-scatters last, summed over the step, and the step is charged to
//   that worker, by the smaller of the two delays (the node came late by
//   the server's delay; the worker held its node up by the node's). A node
//   whose workers sent nothing charges the pusher itself (ps mode, one
//   worker per node).
// - Without servers (allreduce mode), the workers report whom their dp
//   group's all-reduces waited for; the step is charged to the worker
//   reported with the largest delay.
// A worker's score is the delay charged to it over the window divided by
// the window's step time (the median of the workers' reported wall times of
// each step): the share of the job's time spent waiting for it. A worker
// 1.5 times slower than the others scores about 1/3 (a third of every step
// is spent waiting for it).
//
// Named when, over a window of at least `min_steps` steps, it was late (the
// step was charged to it by at least `late_fraction` of the step) in at
// least `name_share` of the steps, and in `recent_late` of the newest
// `recent`; cleared when its late steps fall below `clear_share`. The score
// measures how much a straggler costs; naming asks for consistency, which
// noise lacks: on a busy machine a different worker comes last in each
// step, sometimes by a lot (a process descheduled), but the same worker is
// not late by a tenth of the step in 15 of 20 steps unless it is slower. A
// worker 1.5 times slower than the others is late by a third of every step.
//
// The tracker is fed by the core under its lock (Add, Evaluate); it keeps
// no reference to the job. Thread safety: not thread-safe (the core's lock
// guards it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tandem/v1/coordinator.pb.h"

namespace tandem::coordinator {

struct StragglerOptions {
  size_t window = 20;     // steps
  size_t min_steps = 10;  // in the window before anyone is named
  // A late step of a worker: charged to it by at least this share of the step.
  double late_fraction = 0.10;
  // Named when late in at least this share of the window's steps; cleared
  // when late in less than `clear_share`.
  double name_share = 0.75;
  double clear_share = 0.40;
  // And, to be named, late in at least `recent_late` of the window's newest
  // `recent` steps (a burst of noise earlier in the window does not name
  // anyone).
  size_t recent = 8;
  size_t recent_late = 7;
};

// Who a member is in the latest epoch (for charging steps and for names).
struct StragglerIdentity {
  int rank = -1;        // global rank; -1: not a worker of the latest epoch
  std::string node_id;  // its node
  std::string name;     // its member name, if any
};

// A worker named a straggler, or cleared (Evaluate's answer).
struct StragglerChange {
  uint64_t member_id = 0;
  bool named = false;  // false: cleared
  StragglerIdentity who;
  v1::StragglerStatus status;
};

class StragglerTracker {
 public:
  using Resolve = std::function<std::optional<StragglerIdentity>(uint64_t member_id)>;

  explicit StragglerTracker(StragglerOptions options = {}) : options_(options) {}

  // A member's report (from its heartbeat). `reporter_node` is the
  // reporting member's node (a worker's group reports are matched with the
  // server's by node).
  void Add(const std::string& reporter_node, const v1::StepWait& wait);

  // Recomputes every worker's score over the window of the newest steps;
  // returns the workers named or cleared since the last call, in member id
  // order. `job_step` is the job's step (recorded when a worker is named).
  std::vector<StragglerChange> Evaluate(const Resolve& resolve, uint64_t job_step);

  // A worker's status as of the last Evaluate; empty for a member the
  // window never charged (it scores 0: window_steps()).
  std::optional<v1::StragglerStatus> Status(uint64_t member_id) const;
  // Every worker charged in the window (member id -> status), as of the
  // last Evaluate.
  const std::map<uint64_t, v1::StragglerStatus>& statuses() const { return statuses_; }
  // Steps in the window as of the last Evaluate (a worker never charged in
  // it scores 0 over these).
  uint32_t window_steps() const { return window_steps_; }
  // Forgets everything (a job that restarts training from scratch).
  void Clear();

  const StragglerOptions& options() const { return options_; }

 private:
  // What the members said of one step.
  struct Step {
    std::vector<double> step_seconds;  // workers' wall times
    uint64_t server_late = 0;          // the servers' latest pusher (largest delay)
    double server_seconds = 0;
    // Worker groups' reports by scope: the late member, its delay and the
    // reporters' node.
    struct Group {
      uint64_t late = 0;
      double seconds = 0;
      std::string node;
    };
    std::map<std::string, Group> groups;
  };
  // The member a step is charged to, and by how much; member 0: none.
  std::pair<uint64_t, double> Charge(const Step& step, const Resolve& resolve) const;

  StragglerOptions options_;
  std::map<uint64_t, Step> steps_;  // the newest steps reported (a few windows)
  uint64_t server_step_ = 0;        // the newest step with a server's report
  std::map<uint64_t, v1::StragglerStatus> statuses_;
  uint32_t window_steps_ = 0;
};

}  // namespace tandem::coordinator
