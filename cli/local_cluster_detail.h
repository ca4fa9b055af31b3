// The innards of one `tandem run` (cli/local_cluster.h): the LocalCluster
// that starts, follows and sums up a run, shared by cli/local_cluster.cc
// (start, follow, sum up) and cli/local_cluster_faults.cc (supervision and
// the faults it injects). Not an interface: nothing else includes it.
#pragma once

#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "cli/faults.h"
#include "cli/local_cluster.h"
#include "cli/node_network.h"
#include "cli/supervisor.h"
#include "tandem/v1/coordinator.grpc.pb.h"

namespace tandem::cli::local_cluster_detail {

using Clock = std::chrono::steady_clock;

inline double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// One step as global rank 0 reported it.
struct Record {
  uint64_t step = 0;
  uint64_t epoch = 0;
  double loss = 0;
  uint64_t tokens = 0;
  double step_seconds = 0;
  double compute_seconds = 0;
  double comm_seconds = 0;
  double exposed_seconds = 0;
  uint32_t world_size = 0;
  double time = 0;
  std::vector<double> pipeline_idle;  // by stage
  uint64_t parameter_bytes = 0;
};

// Reads the lines appended to a progress file since the last call: one per
// step, and the last one once training is finished.
class ProgressReader {
 public:
  explicit ProgressReader(std::string path) : path_(std::move(path)) {}
  // Whether the finished line was read, the steps it says were completed
  // (in the asynchronous modes rank 0 may skip lines of steps that others
  // completed) and the final checkpoint it names.
  bool finished() const { return finished_; }
  // Rollbacks to a checkpoint rank 0 reported: (from, to) steps, and the checkpoint.
  struct RolledBack {
    uint64_t from = 0;
    uint64_t to = 0;
    std::string checkpoint;
  };
  const std::vector<RolledBack>& rollbacks() const { return rollbacks_; }
  uint64_t finished_steps() const { return finished_steps_; }
  const std::string& checkpoint() const { return checkpoint_; }
  void Poll(std::map<uint64_t, Record>* records) {
    std::ifstream in(path_, std::ios::binary);
    if (!in) return;
    in.seekg(static_cast<std::streamoff>(offset_));
    std::string chunk((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    size_t start = 0;
    while (true) {
      const size_t nl = chunk.find('\n', start);
      if (nl == std::string::npos) break;  // a partial line waits for the next poll
      Parse(std::string_view(chunk).substr(start, nl - start), records);
      start = nl + 1;
    }
    offset_ += start;
  }

 private:
  void Parse(std::string_view line, std::map<uint64_t, Record>* records) {
    try {
      const YAML::Node n = YAML::Load(std::string(line));
      if (n["rollback"]) {
        rollbacks_.push_back({n["from"].as<uint64_t>(), n["to"].as<uint64_t>(), n["checkpoint"].as<std::string>()});
        return;
      }
      if (n["finished"]) {
        finished_ = n["finished"].as<bool>();
        if (n["steps"]) finished_steps_ = n["steps"].as<uint64_t>();
        if (n["checkpoint"] && !n["checkpoint"].IsNull()) checkpoint_ = n["checkpoint"].as<std::string>();
        return;
      }
      Record r;
      r.step = n["step"].as<uint64_t>();
      r.epoch = n["epoch"].as<uint64_t>();
      r.loss = n["loss"].IsNull() ? std::nan("") : n["loss"].as<double>();
      r.tokens = n["tokens"].as<uint64_t>();
      r.step_seconds = n["step_seconds"].as<double>();
      r.compute_seconds = n["compute_seconds"].as<double>();
      r.comm_seconds = n["comm_seconds"].as<double>();
      r.exposed_seconds = n["exposed_seconds"].as<double>();
      r.world_size = n["world_size"].as<uint32_t>();
      r.time = n["time"].as<double>();
      if (n["pipeline_idle"]) r.pipeline_idle = n["pipeline_idle"].as<std::vector<double>>();
      if (n["parameter_bytes"]) r.parameter_bytes = n["parameter_bytes"].as<uint64_t>();
      (*records)[r.step] = r;
    } catch (const std::exception&) {
      // Not a step line (a torn write is impossible: lines are flushed whole).
    }
  }

  std::string path_;
  std::vector<RolledBack> rollbacks_;
  size_t offset_ = 0;
  bool finished_ = false;
  uint64_t finished_steps_ = 0;
  std::string checkpoint_;
};

// The model the job trains: its size for the coordinator's shard map, and a
// few words for the first line.
struct JobModel {
  uint64_t parameters = 0;         // the model's
  uint64_t server_parameters = 0;  // what the servers hold (the job's parameter count)
  std::string description;
};

// The reference model, after checking that its split over tp x pp fits the workers.
// One local training run: LocalCluster::Start brings the cluster up,
// Follow watches the training (and injects the faults asked for) until it
// ends, Summarise asks the servers, stops everything and sums up.
// RunLocalTraining (below) runs the three steps.
class LocalCluster {
 public:
  LocalCluster(const ClusterOptions& o, ShutdownSignal& shutdown);
  LocalCluster(const LocalCluster&) = delete;
  LocalCluster& operator=(const LocalCluster&) = delete;

  // Checks the options, learns the model, creates the simulated nodes and
  // starts the coordinator, the servers and the workers. False when Ctrl-C
  // came while a script described its model (summary() says interrupted);
  // an error when the run could not start (whatever started is stopped).
  Result<bool> Start();
  // Follows the training until the last step is done, a process fails, the
  // time runs out or Ctrl-C; then holds the cluster up if asked (--hold).
  // REQUIRES: Start() returned true.
  void Follow();
  // Asks the servers for their updates and the workers for their peak
  // memory, stops every process and returns the summary.
  RunSummary Summarise();

  const RunSummary& summary() const { return summary_; }

 private:
  // Start's steps.
  Status CheckOptions();
  Status PrepareWorkDir();
  Status StartProcesses();
  Status Launch(const std::string& binary, const std::string& name, int node, ProcessRole role,
                std::vector<std::string> args, decltype(LaunchSpec::command) command = nullptr);
  Status LaunchWorker(int node);
  // The CPUs worker `index` is bound to ("" when unbound).
  std::string CpusOf(int index) const;
  // Stops workers and servers at once, the coordinator last; what did not
  // stop cleanly ("" if all did).
  std::string StopAll();

  // Follow's steps; each returns false when the run must end (the failure
  // is in summary_ and was shown).
  uint64_t LastStep() const;
  void ShowProgress(uint64_t last);
  void Supervise();
  void MaybeKillWorker(uint64_t last);
  bool MaybeAddWorker(uint64_t last);
  bool WaitForTheEnd(uint64_t last);
  void HoldIfAsked();

  // Supervision and faults (below Summarise's steps).
  Status PlanFaults();
  FaultSpace SpaceOfFaults() const;
  // The coordinator's view of the job (status_), asked at most every 250 ms;
  // whether it was asked now and answered.
  bool PollCoordinator();
  // Kills the processes the coordinator declared dead (the supervisor
  // restarts them); after each new status.
  void FenceTheDead();
  // Every process up and in the active epoch, every partition backed up.
  bool Whole() const;
  void MaybeInject(uint64_t last);
  void Inject(const Fault& fault, uint64_t last);
  // Ends a timed fault when its time is up, and notes when the fault was
  // detected and when the cluster was whole again.
  void FollowFault();

  // Summarise's steps.
  void AskServers();
  void ReadPeakMemory();
  void Stop();
  void SumUpSteps();

  void Print(const std::string& text) const;
  // A line of its own, after the live progress line if that is open.
  void Event(const std::string& text);

  const ClusterOptions& o_;
  ShutdownSignal& shutdown_;
  RunSummary summary_;
  const int64_t workers_;  // at start
  const bool script_;
  int64_t servers_ = 0;
  JobModel model_;
  std::string work_dir_;
  worker::TrainConfig train_;  // o_.train with this run's files
  // With o_.bind, worker i runs on its share of the CPUs (an added worker
  // shares those of worker i modulo the starting count).
  std::vector<int> cpus_;
  std::unique_ptr<NodeNetwork> network_;  // outlives supervisor_ (declared before)
  Clock::time_point t_start_{};
  std::unique_ptr<Supervisor> supervisor_;  // the processes, the coordinator first
  std::string coordinator_;                 // its gRPC address
  int next_worker_ = 0;
  // The first process that ended with a failure while the cluster stopped
  // (a script that raised as the others finished: it may still have been
  // exiting when the run ended), named as a run failure is.
  std::string ended_badly_;

  // Following the training.
  std::optional<ProgressReader> reader_;
  std::map<uint64_t, Record> records_;
  uint64_t shown_ = 0;
  bool killed_ = false;
  uint64_t killed_at_ = 0;
  bool added_ = false;
  bool tty_ = false;
  std::string line_open_;                        // the live line is on screen (tty)
  std::optional<Clock::time_point> done_since_;  // when the last step was reported
  bool said_waiting_ = false;

  // Supervision and faults.
  std::unique_ptr<v1::CoordinatorAdmin::Stub> admin_;
  std::optional<v1::GetStatusResponse> status_;  // unset while the coordinator does not answer
  Clock::time_point status_at_{};                // asked last
  Clock::time_point status_fresh_{};             // answered last
  std::vector<Fault> plan_;                      // --inject, then --chaos
  size_t next_fault_ = 0;
  // The fault injected last, until the cluster is whole again.
  struct ActiveFault {
    size_t index = 0;  // in summary_.injected
    Clock::time_point t0{};
    std::set<int> pids;            // the processes it hit
    std::vector<Supervised*> hit;  // the processes it hit (kill, stop, slow)
    int node = -1;                 // partition
    Clock::time_point ends{};      // partition, slow
    bool over = false;             // kill, stop: at once; partition, slow: at `ends`
    // When the fault's effect was over: the process it hit is up again
    // (a new incarnation), the link is up, the process runs at full speed.
    std::optional<Clock::time_point> settled;
    Clock::time_point next_toggle{};  // slow: when to stop or continue it next
    // The one process a kill, stop or slow of one process hit (else null).
    Supervised* process() const { return hit.size() == 1 ? hit.front() : nullptr; }
  };
  std::optional<ActiveFault> active_;
  size_t rollbacks_seen_ = 0;
};

}  // namespace tandem::cli::local_cluster_detail
