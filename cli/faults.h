// Failures `tandem run` injects on purpose, to show that training survives
// them: named ones (--inject) and a seeded random drill (--chaos SEED[:N]).
//
// Kinds: kill (SIGKILL; the supervisor restarts the process), stop (SIGSTOP:
// a hung process, found by the coordinator's heartbeat deadline and then
// killed and restarted by the supervisor), partition (a simulated node's
// link taken down for a while, network namespaces only) and slow (a process
// stopped and continued in turn for a while, so it runs at a fraction of its
// speed: detected and named, not acted upon).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace tandem::cli {

enum class FaultKind { kKill, kStop, kPartition, kSlow };

// "kill", "stop", "partition", "slow".
const char* FaultKindName(FaultKind kind);

struct Fault {
  FaultKind kind = FaultKind::kKill;
  // A process ("worker-1", "server-0", "coordinator"), "servers" (kill
  // only: every server at once, so partitions lose both copies), or for a
  // partition a node ("node-1").
  std::string target;
  // Injected once this step is done and the cluster is whole again after
  // the fault before (every process up and in the job, replication whole).
  uint64_t step = 0;
  // partition and slow: how long they last (kill and stop: 0).
  std::chrono::milliseconds duration{0};
};

// "KIND:TARGET@STEP[/DURATION]" ("partition:node-1@40/4s"; durations as
// the flags take them: 500ms, 4s, 1m).
std::string FormatFault(const Fault& fault);

// A comma-separated list of FormatFault's form, checked for form only
// (CheckFaults checks the targets against a cluster).
Result<std::vector<Fault>> ParseFaults(std::string_view text);

// The processes and nodes a cluster has, what a fault may aim at.
struct FaultSpace {
  std::vector<std::string> workers;  // process names
  std::vector<std::string> servers;
  int nodes = 1;
  bool namespaces = false;  // partitions need them
  uint64_t steps = 0;       // the run's steps: a fault comes at one below
  // Whether the job survives losing one worker (a data-parallel replica is
  // left, or the servers hold the parameters) and one server (each
  // partition has a backup).
  bool worker_loss = true;
  bool server_loss = true;
  // Whether a partition of any one node leaves a whole job behind (at most
  // one server per node and workers on another node).
  bool partition_loss = true;
  // The nodes that hold a server. Cut off for longer than the heartbeat
  // deadline, such a node loses a server and workers in the same
  // membership change: a step the server had decided but not replicated
  // has lost the gradients of the workers that died with it, which nothing
  // but a rollback to a checkpoint restores. Without `rollback` these
  // nodes are only cut off for less than kShortPartition, which the job
  // rides out in the same epoch.
  std::vector<int> server_nodes;
  // Whether the job survives losing every server at once (both copies of
  // every partition): a synchronous server mode that writes checkpoints,
  // rolled back to the latest one.
  bool rollback = false;
};

// Checks each fault against the cluster: its target exists, its step is
// below the run's steps, and the job is promised to survive it (the error
// says why not).
Status CheckFaults(const std::vector<Fault>& faults, const FaultSpace& space);

// The longest partition of a node holding a server that a job without
// checkpoints is promised to ride out: well under the heartbeat deadline of
// `tandem run` (3 s).
inline constexpr std::chrono::milliseconds kShortPartition{1500};

// --chaos SEED[:N]: N (default 3) faults, 1 to 64.
struct ChaosSpec {
  uint64_t seed = 0;
  int count = 3;
};
Result<ChaosSpec> ParseChaos(std::string_view text);

// The drill: `spec.count` faults of kinds and targets the job is promised
// to survive, at increasing steps spread over the middle of the run, drawn
// from the seed alone (the same seed and cluster give the same drill on
// any machine).
std::vector<Fault> DrawChaos(const ChaosSpec& spec, const FaultSpace& space);

}  // namespace tandem::cli
