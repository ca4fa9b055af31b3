#include "cli/faults.h"

#include <algorithm>
#include <charconv>
#include <random>

#include "common/config.h"

namespace tandem::cli {
namespace {

constexpr FaultKind kKinds[] = {FaultKind::kKill, FaultKind::kStop, FaultKind::kPartition, FaultKind::kSlow};

Result<uint64_t> ParseCount(std::string_view text, std::string_view what) {
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty()) {
    return InvalidArgument("{}: '{}' is not a whole number", what, text);
  }
  return v;
}

bool Has(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

// Whether `target` names node k of `nodes` ("node-K"); sets *node.
bool NodeOf(const std::string& target, int nodes, int* node) {
  if (target.rfind("node-", 0) != 0) return false;
  auto k = ParseCount(std::string_view(target).substr(5), "node");
  if (!k.ok() || *k >= static_cast<uint64_t>(nodes)) return false;
  *node = static_cast<int>(*k);
  return true;
}

}  // namespace

const char* FaultKindName(FaultKind kind) {
  switch (kind) {
    case FaultKind::kKill:
      return "kill";
    case FaultKind::kStop:
      return "stop";
    case FaultKind::kPartition:
      return "partition";
    case FaultKind::kSlow:
      return "slow";
  }
  return "?";
}

std::string FormatFault(const Fault& f) {
  std::string text = fmt::format("{}:{}@{}", FaultKindName(f.kind), f.target, f.step);
  if (f.duration.count() > 0) text += "/" + FormatDuration(f.duration);
  return text;
}

Result<std::vector<Fault>> ParseFaults(std::string_view text) {
  std::vector<Fault> faults;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string_view item = text.substr(start, comma - start);
    start = comma + 1;
    if (item.empty()) continue;
    const std::string where = fmt::format("--inject '{}'", item);
    const size_t colon = item.find(':');
    const size_t at = item.find('@');
    if (colon == std::string_view::npos || at == std::string_view::npos || at < colon) {
      return InvalidArgument(
          "{}: expected KIND:TARGET@STEP[/DURATION], e.g. kill:worker-1@20 or partition:node-1@40/4s", where);
    }
    Fault f;
    const std::string_view kind = item.substr(0, colon);
    const auto known =
        std::find_if(std::begin(kKinds), std::end(kKinds), [kind](FaultKind k) { return kind == FaultKindName(k); });
    if (known == std::end(kKinds)) {
      return InvalidArgument("{}: unknown kind '{}' (kill, stop, partition or slow)", where, kind);
    }
    f.kind = *known;
    f.target = std::string(item.substr(colon + 1, at - colon - 1));
    if (f.target.empty()) return InvalidArgument("{}: no target", where);
    std::string_view rest = item.substr(at + 1);
    const size_t slash = rest.find('/');
    TANDEM_ASSIGN_OR_RETURN(f.step, ParseCount(rest.substr(0, slash), where + ": the step"));
    if (f.step == 0) return InvalidArgument("{}: the step must be at least 1", where);
    const bool timed = f.kind == FaultKind::kPartition || f.kind == FaultKind::kSlow;
    if (slash != std::string_view::npos) {
      if (!timed) return InvalidArgument("{}: a {} has no duration", where, kind);
      TANDEM_ASSIGN_OR_RETURN(f.duration, ParseDuration(rest.substr(slash + 1)));
      if (f.duration.count() <= 0 || f.duration > std::chrono::minutes(10)) {
        return InvalidArgument("{}: the duration must be above 0 and at most 10m", where);
      }
    } else if (timed) {
      return InvalidArgument("{}: a {} needs a duration (/4s)", where, kind);
    }
    faults.push_back(std::move(f));
  }
  if (faults.empty()) return InvalidArgument("--inject: no fault given");
  return faults;
}

Status CheckFaults(const std::vector<Fault>& faults, const FaultSpace& space) {
  for (const Fault& f : faults) {
    const std::string where = "--inject " + FormatFault(f);
    if (f.step >= space.steps) {
      return InvalidArgument("{}: the step must be below --steps ({}): the fault comes once that step is done", where,
                             space.steps);
    }
    int node = 0;
    if (f.kind == FaultKind::kPartition) {
      if (!space.namespaces) {
        return InvalidArgument("{}: a partition needs simulated nodes in network namespaces (--network netns, as root)",
                               where);
      }
      if (!NodeOf(f.target, space.nodes, &node)) {
        return InvalidArgument("{}: a partition's target is a node, node-0 .. node-{}", where, space.nodes - 1);
      }
      if (space.nodes < 2 || !space.partition_loss) {
        return InvalidArgument(
            "{}: losing a whole node would leave no whole job (it needs another node with workers, and at most one "
            "server per node, each partition backed up on another)",
            where);
      }
      if (f.duration > kShortPartition && !space.rollback &&
          std::find(space.server_nodes.begin(), space.server_nodes.end(), node) != space.server_nodes.end()) {
        return InvalidArgument(
            "{}: node-{} holds a server; cut off for longer than {} ms it loses a server and workers together, and a "
            "step that server decided but did not replicate loses the gradients of the workers that died with it, "
            "which only a rollback to a checkpoint restores (docs/failures.md): give the run checkpoints "
            "(--train-checkpoint-every and --train-checkpoint-dir, a synchronous server mode), cut it off for at "
            "most {} ms, or cut off a node without a server",
            where, node, kShortPartition.count(), kShortPartition.count());
      }
      continue;
    }
    if (f.target == "servers") {
      if (f.kind != FaultKind::kKill) return InvalidArgument("{}: all servers at once can only be killed", where);
      if (!space.rollback) {
        return InvalidArgument(
            "{}: killing every server loses both copies of every partition, which only a synchronous server mode "
            "that writes checkpoints survives (--train-checkpoint-every and --train-checkpoint-dir)",
            where);
      }
      continue;
    }
    const bool worker = Has(space.workers, f.target);
    const bool server = Has(space.servers, f.target);
    const bool coordinator = f.target == "coordinator";
    if (!worker && !server && !coordinator) {
      return InvalidArgument("{}: no process '{}' (workers worker-0 .., servers server-0 .., coordinator)", where,
                             f.target);
    }
    if (coordinator && f.kind != FaultKind::kKill) {
      return InvalidArgument("{}: the coordinator can only be killed (the supervisor restarts it)", where);
    }
    if (worker && f.kind != FaultKind::kSlow && !space.worker_loss) {
      return InvalidArgument(
          "{}: the job does not survive losing a worker (a single data-parallel replica in allreduce mode, or the "
          "mesh needs every worker)",
          where);
    }
    if (server && f.kind != FaultKind::kSlow && !space.server_loss) {
      return InvalidArgument(
          "{}: the job does not survive losing a server (it needs at least two, so that every partition has a "
          "backup)",
          where);
    }
  }
  return Status::Ok();
}

Result<ChaosSpec> ParseChaos(std::string_view text) {
  ChaosSpec spec;
  const size_t colon = text.find(':');
  TANDEM_ASSIGN_OR_RETURN(spec.seed, ParseCount(text.substr(0, colon), "--chaos: the seed"));
  if (colon != std::string_view::npos) {
    TANDEM_ASSIGN_OR_RETURN(const uint64_t n, ParseCount(text.substr(colon + 1), "--chaos: the count"));
    if (n < 1 || n > 64) return InvalidArgument("--chaos: the count must be 1 to 64, not {}", n);
    spec.count = static_cast<int>(n);
  }
  return spec;
}

std::vector<Fault> DrawChaos(const ChaosSpec& spec, const FaultSpace& space) {
  // mt19937_64's output is fixed by the standard; the draws below use only
  // it (no distribution, whose algorithm differs between libraries).
  std::mt19937_64 rng(spec.seed);
  const auto below = [&rng](uint64_t n) { return n == 0 ? 0 : rng() % n; };
  // What may be drawn: (kind, target list), each equally likely.
  struct Choice {
    FaultKind kind;
    std::vector<std::string> targets;
  };
  std::vector<Choice> choices;
  if (space.worker_loss && !space.workers.empty()) {
    choices.push_back({FaultKind::kKill, space.workers});
    choices.push_back({FaultKind::kStop, space.workers});
  }
  if (space.server_loss && !space.servers.empty()) {
    choices.push_back({FaultKind::kKill, space.servers});
    choices.push_back({FaultKind::kStop, space.servers});
  }
  choices.push_back({FaultKind::kKill, {"coordinator"}});
  if (space.rollback) choices.push_back({FaultKind::kKill, {"servers"}});
  if (space.namespaces && space.nodes >= 2 && space.partition_loss) {
    std::vector<std::string> nodes;
    for (int k = 0; k < space.nodes; ++k) nodes.push_back(fmt::format("node-{}", k));
    choices.push_back({FaultKind::kPartition, nodes});
  }
  if (!space.workers.empty()) choices.push_back({FaultKind::kSlow, space.workers});

  // Steps spread over [10%, 80%] of the run, one slot per fault.
  const uint64_t first = std::max<uint64_t>(1, space.steps / 10);
  const uint64_t last = std::max<uint64_t>(first, space.steps * 8 / 10);
  const uint64_t slot = std::max<uint64_t>(1, (last - first + 1) / static_cast<uint64_t>(spec.count));
  std::vector<Fault> faults;
  for (int i = 0; i < spec.count; ++i) {
    const Choice& c = choices[below(choices.size())];
    Fault f;
    f.kind = c.kind;
    f.target = c.targets[below(c.targets.size())];
    f.step = std::min(last, first + static_cast<uint64_t>(i) * slot + below(slot));
    if (f.kind == FaultKind::kPartition) {
      const int node = std::stoi(f.target.substr(5));
      const bool server =
          std::find(space.server_nodes.begin(), space.server_nodes.end(), node) != space.server_nodes.end();
      // A node with a server, where the job could not roll back: ridden out
      // (0.5-1.5 s); otherwise 2-6 s, evicted.
      f.duration = server && !space.rollback ? std::chrono::milliseconds(500 + 250 * below(5))
                                             : std::chrono::milliseconds(2000 + 500 * below(9));
    }
    if (f.kind == FaultKind::kSlow) f.duration = std::chrono::milliseconds(3000 + 500 * below(5));  // 3-5 s
    faults.push_back(std::move(f));
  }
  return faults;
}

}  // namespace tandem::cli
