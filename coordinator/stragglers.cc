#include "coordinator/stragglers.h"

#include <algorithm>
#include <utility>

namespace tandem::coordinator {

void StragglerTracker::Add(const std::string& reporter_node, const v1::StepWait& wait) {
  const uint64_t step = wait.step();
  if (step == 0) return;
  const bool server = wait.scope() == "server";
  // A worker reporting a step well below the newest ones: the job rolled
  // back to a checkpoint, and the steps from this one on are trained again.
  if (!server && !steps_.empty() && steps_.rbegin()->first > step + 2 * options_.window) {
    steps_.erase(steps_.lower_bound(step), steps_.end());
    server_step_ = std::min(server_step_, step);
  }
  Step& s = steps_[step];
  if (server) {
    if (wait.late_member_id() != 0 && (s.server_late == 0 || wait.late_seconds() > s.server_seconds)) {
      s.server_late = wait.late_member_id();
      s.server_seconds = std::max(0.0, wait.late_seconds());
    }
    server_step_ = std::max(server_step_, step);
  } else {
    constexpr size_t kMaxReports = 65536;  // workers reporting one step
    if (wait.step_seconds() > 0 && s.step_seconds.size() < kMaxReports) s.step_seconds.push_back(wait.step_seconds());
    if (wait.late_member_id() != 0) {
      Step::Group& g = s.groups[wait.scope()];
      if (g.late == 0 || wait.late_seconds() > g.seconds) {
        g.late = wait.late_member_id();
        g.seconds = std::max(0.0, wait.late_seconds());
        g.node = reporter_node;
      }
    }
  }
  while (steps_.size() > 4 * options_.window) steps_.erase(steps_.begin());
}

std::pair<uint64_t, double> StragglerTracker::Charge(const Step& step, const Resolve& resolve) const {
  std::pair<uint64_t, double> best{0, 0.0};
  if (step.server_late != 0) {
    best = {step.server_late, step.server_seconds};
    // The late pusher stands for its node: the node's own group says which
    // of its workers held it up (and by how much it held the node up).
    const auto pusher = resolve(step.server_late);
    if (!pusher) return best;
    const Step::Group* inside = nullptr;
    for (const auto& [scope, g] : step.groups) {
      if (g.node == pusher->node_id && scope.starts_with("node") && (inside == nullptr || g.seconds > inside->seconds))
        inside = &g;
    }
    if (inside != nullptr) best = {inside->late, std::min(step.server_seconds, inside->seconds)};
    return best;
  }
  for (const auto& [scope, g] : step.groups) {
    if (best.first == 0 || g.seconds > best.second) best = {g.late, g.seconds};
  }
  return best;
}

std::vector<StragglerChange> StragglerTracker::Evaluate(const Resolve& resolve, uint64_t job_step) {
  struct Sum {
    double charged = 0;  // seconds charged over the window
    double late = 0;     // over its late steps
    uint32_t late_steps = 0;
    uint32_t recent_late = 0;  // of the window's newest options_.recent steps
  };
  std::map<uint64_t, Sum> sums;
  double window_seconds = 0;
  uint32_t window_steps = 0;
  for (auto it = steps_.rbegin(); it != steps_.rend() && window_steps < options_.window; ++it) {
    const Step& s = it->second;
    if (s.step_seconds.empty()) continue;  // no worker's wall time (yet)
    // With servers, a step counts once their report is in (until then it
    // would be charged from the workers' groups alone).
    if (server_step_ > 0 ? s.server_late == 0 : s.groups.empty()) continue;
    std::vector<double> times = s.step_seconds;
    auto mid = times.begin() + static_cast<std::ptrdiff_t>(times.size() / 2);
    std::nth_element(times.begin(), mid, times.end());
    const double step_seconds = *mid;
    ++window_steps;
    window_seconds += step_seconds;
    const auto [member, seconds] = Charge(s, resolve);
    if (member == 0) continue;
    Sum& sum = sums[member];
    sum.charged += seconds;
    if (seconds >= options_.late_fraction * step_seconds) {
      ++sum.late_steps;
      sum.late += seconds;
      if (window_steps <= options_.recent) ++sum.recent_late;
    }
  }
  std::map<uint64_t, v1::StragglerStatus> next;
  std::vector<StragglerChange> changes;
  for (const auto& [member, sum] : sums) {
    const auto who = resolve(member);
    if (!who || who->rank < 0) continue;  // no longer a worker of the job
    v1::StragglerStatus st;
    st.set_score(window_seconds > 0 ? std::min(1.0, sum.charged / window_seconds) : 0.0);
    st.set_late_steps(sum.late_steps);
    st.set_window_steps(window_steps);
    st.set_mean_late_seconds(sum.late_steps > 0 ? sum.late / sum.late_steps : 0.0);
    bool named = false;
    if (auto before = statuses_.find(member); before != statuses_.end() && before->second.named()) {
      named = true;
      st.set_named_at_step(before->second.named_at_step());
    }
    const double late_share = window_steps > 0 ? static_cast<double>(sum.late_steps) / window_steps : 0.0;
    if (!named && window_steps >= options_.min_steps && late_share >= options_.name_share &&
        sum.recent_late >= options_.recent_late) {
      named = true;
      st.set_named_at_step(job_step);
      st.set_named(true);
      changes.push_back({member, true, *who, st});
    } else if (named && late_share < options_.clear_share) {
      named = false;
      changes.push_back({member, false, *who, st});
    }
    st.set_named(named);
    next[member] = st;
  }
  // Named workers the window no longer charges at all are cleared too.
  for (const auto& [member, st] : statuses_) {
    if (!st.named() || next.contains(member)) continue;
    if (const auto who = resolve(member); who && who->rank >= 0) {
      v1::StragglerStatus cleared;
      cleared.set_window_steps(window_steps);
      cleared.set_named_at_step(st.named_at_step());
      next[member] = cleared;
      changes.push_back({member, false, *who, cleared});
    }
  }
  statuses_ = std::move(next);
  window_steps_ = window_steps;
  return changes;
}

std::optional<v1::StragglerStatus> StragglerTracker::Status(uint64_t member_id) const {
  auto it = statuses_.find(member_id);
  if (it == statuses_.end()) return std::nullopt;
  return it->second;
}

void StragglerTracker::Clear() {
  steps_.clear();
  server_step_ = 0;
  statuses_.clear();
  window_steps_ = 0;
}

}  // namespace tandem::coordinator
