#include "cli/local_cluster.h"

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <set>
#include <thread>

#include <yaml-cpp/yaml.h>

#include "cli/commands.h"
#include "cli/launcher.h"
#include "cli/local_cluster_detail.h"
#include "cli/node_network.h"
#include "cli/script_workers.h"
#include "common/cpus.h"
#include "common/grpc_util.h"
#include "common/logging.h"
#include "common/proc_stat.h"
#include "tandem/v1/coordinator.grpc.pb.h"
#include "tandem/v1/server.grpc.pb.h"
#include "worker/model/model.h"
#include "worker/runtime/pipeline.h"

namespace tandem::cli {
namespace {

using local_cluster_detail::Clock;
using local_cluster_detail::JobModel;
using local_cluster_detail::Record;
using local_cluster_detail::Seconds;

// On loopback every simulated node is on 127.0.0.1, so members reach each
// other over `lo` only. Left to itself UCX opens TCP lanes over every
// interface of the host, including bridges and veth pairs that other jobs or
// containers create and delete; a lane over an interface that goes away
// breaks the connection and the peer is taken for dead.
constexpr char kLoopbackDevice[] = "lo";

// Sets the job's minimum number of workers through the coordinator's admin
// API (the launcher's coordinator has no TLS and no admin token).
Status ScaleJob(const std::string& coordinator, uint32_t min_workers) {
  TANDEM_ASSIGN_OR_RETURN(auto channel, MakeChannel(coordinator, TlsConfig{}));
  auto stub = v1::CoordinatorAdmin::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::ScaleRequest request;
  request.set_job_id("default");
  request.set_min_workers(min_workers);
  v1::ScaleResponse response;
  return Status::FromGrpc(stub->Scale(&ctx, request, &response))
      .WithContext(fmt::format("raising the job's minimum to {} workers", min_workers));
}

std::string Human(double v) {
  if (v >= 1e6) return fmt::format("{:.2f}M", v / 1e6);
  if (v >= 1e3) return fmt::format("{:.1f}k", v / 1e3);
  return fmt::format("{:.0f}", v);
}

Result<JobModel> ReferenceModel(const ClusterOptions& o, int64_t workers) {
  auto model_config = worker::ModelConfigOf(o.train);
  if (!model_config.ok()) return model_config.status();
  if (o.tp > 1) {
    // A tensor-parallel group lies inside one node.
    if (o.workers_per_node % o.tp != 0) {
      return InvalidArgument(
          "--tp {}: a tensor-parallel group lies inside one node, but --workers-per-node {} does not split into "
          "groups of {}",
          o.tp, o.workers_per_node, o.tp);
    }
    if (o.add_worker_at > 0) {
      return InvalidArgument(
          "--add-worker-at with --tp {}: one more worker does not fit the mesh (it grows by whole tensor-parallel "
          "groups)",
          o.tp);
    }
    model::ModelConfig split = *model_config;
    split.tensor_parallel = static_cast<int>(o.tp);
    TANDEM_RETURN_IF_ERROR(split.Validate().WithContext(fmt::format("--tp {}", o.tp)));
  }
  if (o.pp > 1) {
    // The mesh must fit before anything starts.
    if (workers % (o.pp * o.tp) != 0) {
      return InvalidArgument(
          "--pp {}: the {} workers ({} node(s) x {}) do not split into {} pipeline stages of equal size{}", o.pp,
          workers, o.nodes, o.workers_per_node, o.pp,
          o.tp > 1 ? fmt::format(" made of whole tensor-parallel groups of {}", o.tp) : "");
    }
    if (o.add_worker_at > 0) {
      return InvalidArgument(
          "--add-worker-at with --pp {}: one more worker does not fit the mesh (it grows by {} workers)", o.pp, o.pp);
    }
    model::ModelConfig staged = *model_config;
    staged.pipeline_stages = static_cast<int>(o.pp);
    TANDEM_RETURN_IF_ERROR(staged.Validate().WithContext(fmt::format("--pp {}", o.pp)));
  }
  JobModel model;
  for (const auto& t : model::TensorLayout(*model_config)) model.parameters += t.size;
  // The servers hold every part of the split: with tensor parallelism each
  // rank's copy of the replicated tensors too.
  model::ModelConfig split = *model_config;
  split.pipeline_stages = static_cast<int>(o.pp);
  split.tensor_parallel = static_cast<int>(o.tp);
  model.server_parameters = model::PartBounds(split).back();
  model.description = fmt::format("a {:.2f}M-parameter model ({})", model.parameters / 1e6,
                                  o.train.data.empty() ? "built-in corpus" : o.train.data);
  return model;
}

// The flags `tandem run` gives a worker besides the launcher's own (--name,
// the addresses, --ready-file, --log-level): a tandem-worker's command line,
// a script's TANDEM_WORKER_FLAGS. No --coordinator-address when empty.
std::vector<std::string> WorkerArgs(const ClusterOptions& o, const std::string& coordinator, int node, bool loopback,
                                    const std::string& cpus, const worker::TrainConfig& train) {
  std::vector<std::string> args;
  if (!coordinator.empty()) args.insert(args.end(), {"--coordinator-address", coordinator});
  args.insert(args.end(), {"--node-id", fmt::format("node-{}", node), "--data-plane-backend", o.backend});
  if (loopback) args.insert(args.end(), {"--data-plane-ucx-net-devices", kLoopbackDevice});
  if (!cpus.empty()) args.insert(args.end(), {"--cpus", cpus});
  for (auto& f : worker::TrainFlags(train)) args.push_back(f);
  return args;
}

// Only the script knows its model: it says in describe mode, run with the
// flags of worker 0 on loopback (no cluster is up yet). CANCELLED on Ctrl-C.
Result<JobModel> ScriptModelOf(const ClusterOptions& o, const worker::TrainConfig& train, const std::string& cpus,
                               const std::string& work_dir, ShutdownSignal& shutdown) {
  std::vector<std::string> flags = {"--name",      "describe",          "--listen-address",
                                    "127.0.0.1:0", "--metrics-address", "127.0.0.1:0"};
  for (auto& f : WorkerArgs(o, "", 0, /*loopback=*/true, cpus, train)) flags.push_back(f);
  flags.insert(flags.end(), {"--log-level", o.log_level});
  TANDEM_ASSIGN_OR_RETURN(const ScriptModel described, DescribeScript(o.script, o.bin_dir, flags, work_dir, shutdown));
  JobModel model;
  model.parameters = model.server_parameters = described.parameters;
  model.description = fmt::format("{} ({:.2f}M parameters in {} tensors{})", o.script.file, described.parameters / 1e6,
                                  described.tensors, o.train.data.empty() ? "" : ", data " + o.train.data);
  return model;
}

// The rank a worker's log last reported ("epoch 3: rank 1 of 4 (node 0, ...").
std::optional<uint32_t> LastRankInLog(const std::string& path) {
  static const std::regex kRank(R"(epoch \d+: rank (\d+) of \d+)");
  std::ifstream in(path);
  std::optional<uint32_t> rank;
  std::smatch m;
  for (std::string line; std::getline(in, line);) {
    if (std::regex_search(line, m, kRank)) rank = static_cast<uint32_t>(std::stoul(m[1].str()));
  }
  return rank;
}

// Why the run fails when a process ended on its own: "worker-1 (rank 1)
// exited with status 1: ValueError: ...; the end of LOG:" and the end of its
// log (a script's traceback).
std::string EndedMessage(const Supervised& m, const std::string& how) {
  std::string who = m.daemon.name;
  if (m.role == ProcessRole::kWorker) {
    if (auto rank = LastRankInLog(m.daemon.log_file)) who += fmt::format(" (rank {})", *rank);
  }
  const LogTail tail = TailOfLog(m.daemon.log_file, 15);
  return fmt::format("{} {}{}; the end of {}:\n{}", who, how, tail.exception.empty() ? "" : ": " + tail.exception,
                     m.daemon.log_file, tail.text);
}

}  // namespace

namespace local_cluster_detail {

LocalCluster::LocalCluster(const ClusterOptions& o, ShutdownSignal& shutdown)
    : o_(o),
      shutdown_(shutdown),
      workers_(o.nodes * o.workers_per_node),
      script_(!o.script.file.empty()),
      supervisor_(std::make_unique<Supervisor>(o.restart, [this](const std::string& text) { Event(text); })) {
  summary_.mode = o.train.mode;
  summary_.placement = o.train.placement;
  summary_.tensor_parallel = static_cast<uint32_t>(o.tp);
}

void LocalCluster::Print(const std::string& text) const {
  if (o_.progress) {
    fmt::print("{}", text);
    std::fflush(stdout);
  }
}

void LocalCluster::Event(const std::string& text) {
  if (!line_open_.empty()) Print("\n");
  line_open_.clear();
  Print(text + "\n");
}

std::string LocalCluster::CpusOf(int index) const {
  return cpus_.empty() ? std::string() : FormatCpuList(ShareOfCpus(cpus_, index, static_cast<int>(workers_)));
}

// --- start -------------------------------------------------------------------

Result<bool> LocalCluster::Start() {
  TANDEM_RETURN_IF_ERROR(CheckOptions());
  TANDEM_RETURN_IF_ERROR(PrepareWorkDir());
  if (script_) {
    Print(fmt::format("Running {} once to learn its model's size (describe mode) ...\n", o_.script.file));
    auto described = ScriptModelOf(o_, train_, CpusOf(0), work_dir_, shutdown_);
    if (described.status().code() == StatusCode::kCancelled) {
      summary_.interrupted = true;
      summary_.failure = "interrupted";
      return false;
    }
    TANDEM_ASSIGN_OR_RETURN(model_, std::move(described));
  }
  std::remove(train_.progress_file.c_str());
  std::remove(train_.params_out.c_str());
  TANDEM_ASSIGN_OR_RETURN(network_, NodeNetwork::Create(static_cast<int>(o_.nodes), o_.network));
  summary_.network = network_->namespaces() ? "netns" : "loopback";

  t_start_ = Clock::now();
  Print(fmt::format(
      "Tandem: {} mode, {} node(s) x {} worker(s), {} server(s), {} steps of {}\n  network: {}\n  logs: {}\n",
      o_.train.mode, o_.nodes, o_.workers_per_node, servers_, o_.train.steps, model_.description, network_->Describe(),
      work_dir_));
  TANDEM_RETURN_IF_ERROR(StartProcesses());
  if (Status planned = PlanFaults(); !planned.ok()) {
    StopAll();
    return planned;
  }
  Print(fmt::format(
      "Started {} processes in {:.1f} s{}; training ...\n", supervisor_->processes().size(),
      Seconds(Clock::now() - t_start_),
      cpus_.empty() ? std::string() : fmt::format(" (workers bound to their share of CPUs {})", FormatCpuList(cpus_))));
  return true;
}

Status LocalCluster::CheckOptions() {
  const ClusterOptions& o = o_;
  const int64_t workers = workers_;
  if (workers < 1) return InvalidArgument("--nodes and --workers-per-node must give at least one worker");
  if (o.kill_worker_at > 0 && workers + (o.add_worker_at > 0 ? 1 : 0) < 2) {
    return InvalidArgument("--kill-worker-at needs at least two workers, so that one survives");
  }
  if (o.kill_worker_at > 0 && workers / std::max<int64_t>(1, o.tp * o.pp) < 2) {
    return InvalidArgument(
        "--kill-worker-at with --tp {} --pp {}: the {} workers form one tp x pp slice, so the survivors could not "
        "form the mesh; give at least {} workers",
        o.tp, o.pp, workers, 2 * o.tp * o.pp);
  }
  const bool servers_needed = o.train.mode != "allreduce";
  if (servers_needed && o.servers < 1) {
    return InvalidArgument("--mode {} needs parameter servers (--servers >= 1); --mode allreduce runs without",
                           o.train.mode);
  }
  servers_ = servers_needed ? o.servers : 0;
  if (script_) {
    TANDEM_RETURN_IF_ERROR(CheckScriptFiles(o.script));
  } else {
    TANDEM_ASSIGN_OR_RETURN(model_, ReferenceModel(o, workers));
  }
  TANDEM_RETURN_IF_ERROR(worker::RuntimeOptionsOf(o.train).status());
  if (!o.train.data.empty() && access(o.train.data.c_str(), R_OK) != 0) {
    return InvalidArgument("--data: cannot read '{}': {}", o.train.data, std::strerror(errno));
  }
  return Status::Ok();
}

Status LocalCluster::PrepareWorkDir() {
  work_dir_ = o_.work_dir;
  if (work_dir_.empty()) {
    std::string tmpl = "/tmp/tandem-run-XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) {
      return Unavailable("cannot create a work directory under /tmp: {}", std::strerror(errno));
    }
    work_dir_ = tmpl;
  } else {
    std::error_code ec;
    std::filesystem::create_directories(work_dir_, ec);
    if (ec) return InvalidArgument("work_dir: cannot create '{}': {}", work_dir_, ec.message());
  }
  summary_.work_dir = work_dir_;
  train_ = o_.train;
  train_.progress_file = work_dir_ + "/progress.jsonl";
  train_.params_out = work_dir_ + "/params.bin";
  if (!o_.train.data.empty()) train_.data = std::filesystem::absolute(o_.train.data).string();
  cpus_ = o_.bind ? AllowedCpus() : std::vector<int>{};
  return Status::Ok();
}

Status LocalCluster::Launch(const std::string& binary, const std::string& name, int node, ProcessRole role,
                            std::vector<std::string> args, decltype(LaunchSpec::command) command) {
  LaunchSpec spec;
  spec.binary = o_.bin_dir + "/" + binary;
  spec.command = std::move(command);
  spec.name = name;
  spec.args = std::move(args);
  spec.args.insert(spec.args.end(), {"--log-level", o_.log_level});
  if (!o_.trace.dir.empty()) {  // --trace: every process writes its timeline there
    spec.args.insert(spec.args.end(), {"--trace-dir", o_.trace.dir, "--trace-steps", o_.trace.steps});
  }
  spec.work_dir = work_dir_;
  spec.startup_timeout = o_.startup_timeout;
  if (node >= 0) {
    spec.listen_host = network_->node_address(node);
    spec.exec_prefix = network_->exec_prefix(node);
  } else {
    spec.listen_host = network_->host_address();
  }
  return supervisor_->Launch(std::move(spec), role, node);
}

Status LocalCluster::LaunchWorker(int node) {
  std::vector<std::string> args =
      WorkerArgs(o_, coordinator_, node, !network_->namespaces(), CpusOf(next_worker_), train_);
  const std::string name = fmt::format("worker-{}", next_worker_++);
  if (!script_) return Launch("tandem-worker", name, node, ProcessRole::kWorker, std::move(args));
  // The script takes the flags in its environment.
  const ClusterOptions& o = o_;
  return Launch("", name, node, ProcessRole::kWorker, std::move(args),
                [&o](const std::vector<std::string>& flags) { return ScriptCommand(o.script, o.bin_dir, flags); });
}

Status LocalCluster::StartProcesses() {
  // The coordinator: the whole job in its flags.
  const int64_t max_workers = workers_ + (o_.add_worker_at > 0 ? 1 : 0);
  Status status =
      Launch("tandem-coordinator", "coordinator", -1, ProcessRole::kCoordinator,
             {"--data-dir", work_dir_ + "/coordinator-data", "--job-min-workers", std::to_string(workers_),
              "--job-max-workers", std::to_string(max_workers), "--job-min-servers", std::to_string(servers_),
              "--job-last-call-window", "0s", "--job-parameter-count",
              std::to_string(servers_ > 0 ? model_.server_parameters : 0), "--job-partition-size",
              std::to_string(o_.partition_bytes), "--job-heartbeat-interval", "500ms", "--job-heartbeat-deadline", "3s",
              "--job-mesh-pp", std::to_string(o_.pp), "--job-mesh-tp", std::to_string(o_.tp),
              // The supervisor's restart back-off stands for
              // the coordinator's holding out of a failing host:
              // a simulated node whose processes were killed on
              // purpose is not a bad host.
              "--host-failures-before-holdout", "0"});
  coordinator_ = status.ok() ? supervisor_->processes()[0]->daemon.ready.grpc_address : "";
  for (int64_t i = 0; status.ok() && i < servers_ && !shutdown_.requested(); ++i) {
    const int node = static_cast<int>(i % o_.nodes);
    std::vector<std::string> args = {"--coordinator-address", coordinator_, "--node-id", fmt::format("node-{}", node)};
    if (!network_->namespaces()) args.insert(args.end(), {"--server-ucx-net-devices", kLoopbackDevice});
    status = Launch("tandem-server", fmt::format("server-{}", i), node, ProcessRole::kServer, std::move(args));
  }
  for (int64_t i = 0; status.ok() && i < workers_ && !shutdown_.requested(); ++i) {
    status = LaunchWorker(static_cast<int>(i / o_.workers_per_node));
  }
  if (!status.ok()) {
    const std::string unclean = StopAll();
    return status.WithContext(unclean.empty() ? "starting the cluster" : "starting the cluster" + unclean);
  }
  return Status::Ok();
}

std::string LocalCluster::StopAll() {
  return supervisor_->StopAll([this](const Supervised& p, const Result<ExitInfo>& exit) {
    const std::string ended = EndedMessage(p, exit.ok() ? DescribeExit(*exit) : "ended");
    if (ended_badly_.empty()) ended_badly_ = ended;
    return ended;
  });
}

// --- follow ------------------------------------------------------------------

void LocalCluster::Follow() {
  reader_.emplace(train_.progress_file);
  tty_ = isatty(STDOUT_FILENO) != 0;
  while (true) {
    if (shutdown_.requested()) {
      summary_.interrupted = true;
      summary_.failure = "interrupted";
      Event("Interrupted: stopping the cluster ...");
      break;
    }
    if (o_.timeout.count() > 0 && Clock::now() - t_start_ > o_.timeout) {
      summary_.failure = fmt::format("the run did not finish within {:.0f} s", Seconds(o_.timeout));
      Event(summary_.failure);
      break;
    }
    reader_->Poll(&records_);
    while (rollbacks_seen_ < reader_->rollbacks().size()) {
      const auto& r = reader_->rollbacks()[rollbacks_seen_++];
      ++summary_.rollbacks;
      summary_.steps_redone += r.from - r.to;
      Event(
          fmt::format("rolled the job back from step {} to checkpoint step {} ({}): partitions had lost both "
                      "copies; {} steps are trained again",
                      r.from, r.to, r.checkpoint, r.from - r.to));
    }
    const uint64_t last = LastStep();
    ShowProgress(last);
    Supervise();
    if (!summary_.failure.empty()) {
      Event("Failed: " + summary_.failure);
      break;
    }
    if (reader_->finished()) {
      // Rank 0 wrote the final parameters and the last checkpoint: nothing
      // is left that stopping the cluster would cut short (a process ending
      // now changes no result).
      const auto steps = static_cast<uint64_t>(o_.train.steps);
      summary_.completed = last >= steps;
      if (!summary_.completed) summary_.failure = fmt::format("training finished after {} of {} steps", last, steps);
      summary_.checkpoint = reader_->checkpoint();
      break;
    }
    MaybeKillWorker(last);
    FollowFault();
    MaybeInject(last);
    if (!MaybeAddWorker(last) || !WaitForTheEnd(last)) break;
    // While a kill or an added worker is due, look often: small models
    // train a step in a few milliseconds, and the event should come at the
    // step asked for, not several steps later.
    const bool event_due = (o_.kill_worker_at > 0 && !killed_) || (o_.add_worker_at > 0 && !added_) ||
                           next_fault_ < plan_.size() || active_.has_value();
    std::this_thread::sleep_for(std::chrono::milliseconds(event_due ? 2 : 50));
  }
  if (!line_open_.empty()) Print("\n");
  HoldIfAsked();
}

uint64_t LocalCluster::LastStep() const {
  return std::max(records_.empty() ? 0 : records_.rbegin()->first, reader_->finished_steps());
}

void LocalCluster::ShowProgress(uint64_t last) {
  if (last <= shown_ || records_.empty()) return;
  shown_ = last;
  const auto steps = static_cast<uint64_t>(o_.train.steps);
  const Record& r = records_.rbegin()->second;
  const std::string text = fmt::format(
      "step {:>{}}/{}  loss {:.4f}  tokens/s {:>6}  step {:6.1f} ms  comm {:6.1f} ms (exposed {:5.1f} ms)  "
      "epoch {}  workers {}",
      r.step, std::to_string(steps).size(), steps, r.loss,
      Human(r.step_seconds > 0 ? static_cast<double>(r.tokens) / r.step_seconds : 0), r.step_seconds * 1e3,
      r.comm_seconds * 1e3, r.exposed_seconds * 1e3, r.epoch, r.world_size);
  if (tty_) {
    Print("\r" + text + "\033[K");
    line_open_ = text;
  } else if (r.step == 1 || r.step == steps || r.step % std::max<uint64_t>(1, steps / 20) == 0 ||
             (records_.size() >= 2 && std::prev(records_.end(), 2)->second.epoch != r.epoch)) {
    Print(text + "\n");
  }
}

void LocalCluster::Supervise() {
  // A process that ended on its own is restarted (cli/supervisor.h), unless
  // training is over: a script worker that returns after the last step has
  // only finished its script (rank 0 recorded the step before any worker
  // could leave the final barrier); one that returns before is restarted
  // like any other.
  const auto steps = static_cast<uint64_t>(o_.train.steps);
  supervisor_->Poll([this, steps](const Supervised& p, const Result<ExitInfo>& exit) {
    reader_->Poll(&records_);
    if (reader_->finished()) return false;
    return !(script_ && p.role == ProcessRole::kWorker && exit.ok() && exit->success() && LastStep() >= steps);
  });
  if (PollCoordinator()) FenceTheDead();
  // A process with no restarts left leaves the job below its minimum (the
  // coordinator's, or both copies of partitions lost): training cannot go
  // on. The first one found is named: the others may have ended because of it.
  for (auto& p : supervisor_->processes()) {
    if (p->state != Supervised::State::kDown || !summary_.failure.empty()) continue;
    summary_.failure = p->final ? EndedMessage(*p, p->last_end + " (the job cannot go on)")
                                : EndedMessage(*p, fmt::format("{} and has no restarts left ({} used, --restarts {})",
                                                               p->last_end, p->restarts, o_.restart.restarts));
  }
}

void LocalCluster::MaybeKillWorker(uint64_t last) {
  if (o_.kill_worker_at <= 0 || killed_ || last < static_cast<uint64_t>(o_.kill_worker_at)) return;
  killed_ = true;
  killed_at_ = last;
  auto& processes = supervisor_->processes();
  for (size_t i = processes.size(); i-- > 0;) {
    Supervised& p = *processes[i];
    if (p.role != ProcessRole::kWorker || !p.up()) continue;
    const int pid = p.pid();
    supervisor_->Retire(p);
    ++summary_.faults;
    Event(fmt::format("step {}: killed {} (pid {}) with SIGKILL for good; the survivors go on in a new epoch", last,
                      p.name(), pid));
    break;
  }
}

bool LocalCluster::MaybeAddWorker(uint64_t last) {
  // A worker is added only once the survivors of a kill have trained a
  // step, so the two membership changes stay apart.
  if (o_.add_worker_at <= 0 || added_ || last < static_cast<uint64_t>(o_.add_worker_at) ||
      !(o_.kill_worker_at == 0 || (killed_ && last > killed_at_))) {
    return true;
  }
  added_ = true;
  const int node = static_cast<int>(o_.nodes - 1);
  // The job's minimum goes up by one first: training pauses at the next
  // step boundary until the new worker is in, so that it joins at this
  // step however long it takes to start.
  const uint32_t wanted = records_.rbegin()->second.world_size + 1;
  Status s = ScaleJob(coordinator_, wanted);
  if (s.ok()) {
    Event(fmt::format("step {}: raised the job's minimum to {} workers: training pauses until the new worker joins",
                      last, wanted));
    s = LaunchWorker(node);
  }
  if (!s.ok()) {
    summary_.failure = "starting the added worker: " + s.message();
    Event("Failed: " + summary_.failure);
    return false;
  }
  ++summary_.workers_added;
  Event(fmt::format("step {}: started {} on node-{}; it joins at the next epoch", last,
                    supervisor_->processes().back()->name(), node));
  return true;
}

bool LocalCluster::WaitForTheEnd(uint64_t last) {
  // After the last step rank 0 writes the final parameters and waits for
  // its last checkpoint (at most max(step_timeout, 10 min)), maybe after a
  // membership change (epoch_wait).
  const Clock::duration finish_wait = std::max<Clock::duration>(o_.train.step_timeout, std::chrono::minutes(10)) +
                                      o_.train.epoch_wait + std::chrono::minutes(1);
  if (last >= static_cast<uint64_t>(o_.train.steps) && !done_since_) {
    done_since_ = Clock::now();
  } else if (done_since_ && Clock::now() - *done_since_ > std::chrono::seconds(30) && !said_waiting_) {
    said_waiting_ = true;
    Event("All steps are done; waiting for rank 0 to write the final parameters and the last checkpoint ...");
  }
  if (done_since_ && Clock::now() - *done_since_ > finish_wait) {
    // Longer than rank 0 waits for its last checkpoint and a new epoch.
    summary_.failure =
        fmt::format("every step was reported, but rank 0 did not say training finished within {:.0f} s (see its log)",
                    Seconds(finish_wait));
    Event("Failed: " + summary_.failure);
    return false;
  }
  return true;
}

void LocalCluster::HoldIfAsked() {
  if (!o_.hold || !summary_.completed) return;
  Print(fmt::format("Training done; holding the cluster up (--hold): coordinator at {}. Press Ctrl-C to stop it.\n",
                    coordinator_));
  shutdown_.Wait();
}

// --- summarise ---------------------------------------------------------------

RunSummary LocalCluster::Summarise() {
  if (servers_ > 0) AskServers();
  ReadPeakMemory();
  Stop();
  SumUpSteps();
  return std::move(summary_);
}

void LocalCluster::AskServers() {
  // The servers' own count of updates, before they stop.
  std::set<uint64_t> applied;
  std::string detail;
  for (const auto& process : supervisor_->processes()) {
    const Supervised& m = *process;
    if (m.role != ProcessRole::kServer || !m.up()) continue;
    auto channel = MakeChannel(m.daemon.ready.grpc_address, TlsConfig{});
    if (!channel.ok()) continue;
    auto stub = v1::ParameterServer::NewStub(*channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::GetStatsRequest request;
    request.set_job_id("default");
    v1::GetStatsResponse response;
    const grpc::Status s = stub->GetStats(&ctx, request, &response);
    if (!s.ok()) {
      detail += fmt::format("{}: {}; ", m.daemon.name, s.error_message());
      continue;
    }
    for (const auto& p : response.partitions()) {
      if (p.role() != v1::REPLICA_ROLE_PRIMARY || p.version() == 0) continue;
      applied.insert(p.version() - 1);
      detail += fmt::format("{} partition {}: {} updates; ", m.daemon.name, p.partition_id(), p.version() - 1);
    }
  }
  if (applied.size() == 1) {
    summary_.server_steps_applied = *applied.begin();
  } else {
    summary_.server_steps_detail = detail.empty() ? "no server answered" : detail;
  }
}

void LocalCluster::ReadPeakMemory() {
  for (const auto& p : supervisor_->processes()) {
    const Supervised& m = *p;
    if (m.role != ProcessRole::kWorker || !m.up()) continue;
    if (auto peak = ReadPeakResidentBytes(m.daemon.process->pid())) {
      summary_.worker_peak_rss_bytes[m.daemon.name] = *peak;
      summary_.peak_rss_bytes = std::max(summary_.peak_rss_bytes, *peak);
    }
  }
}

void LocalCluster::Stop() {
  if (active_ && active_->node >= 0 && !active_->over) (void)network_->SetNodeLink(active_->node, true);
  Print(fmt::format("Stopping {} processes ...\n", supervisor_->processes().size()));
  const std::string unclean = StopAll();
  if (!unclean.empty()) {
    if (summary_.failure.empty()) {
      summary_.failure = ended_badly_.empty() ? "a process did not stop cleanly" : ended_badly_;
    }
    summary_.completed = false;
    Print("Some processes did not stop cleanly:" + unclean + "\n");
  }
  summary_.restarts = supervisor_->restarts();
  supervisor_.reset();  // before the network it ran in
  network_.reset();
}

void LocalCluster::SumUpSteps() {
  RunSummary& summary = summary_;
  const auto& records = records_;
  const auto steps = static_cast<uint64_t>(o_.train.steps);
  summary.elapsed_seconds = Seconds(Clock::now() - t_start_);

  summary.steps = LastStep();
  std::set<uint64_t> epochs;
  std::vector<double> step_s, compute_s;
  double tokens = 0, span_steps = 0, exposed = 0;
  std::vector<double> idle_sum;  // by pipeline stage
  double idle_steps = 0;
  const Record* previous = nullptr;
  for (const auto& [step, r] : records) {
    summary.losses.push_back(r.loss);
    epochs.insert(r.epoch);
    summary.peak_parameter_bytes = std::max(summary.peak_parameter_bytes, r.parameter_bytes);
    if (step >= 2) {
      if (!r.pipeline_idle.empty()) {
        idle_sum.resize(r.pipeline_idle.size(), 0.0);
        for (size_t i = 0; i < r.pipeline_idle.size() && i < idle_sum.size(); ++i) idle_sum[i] += r.pipeline_idle[i];
        ++idle_steps;
      }
      step_s.push_back(r.step_seconds);
      compute_s.push_back(r.compute_seconds);
      exposed += r.exposed_seconds;
      span_steps += r.step_seconds;
      tokens += static_cast<double>(r.tokens);
    }
    previous = &r;
  }
  for (const auto& [step, r] : records) {
    if (std::isfinite(r.loss)) {
      summary.first_loss = r.loss;
      break;
    }
  }
  for (auto it = records.rbegin(); it != records.rend(); ++it) {
    if (std::isfinite(it->second.loss)) {
      summary.last_loss = it->second.loss;
      break;
    }
  }
  if (!records.empty()) {
    summary.world_size = records.rbegin()->second.world_size;
    // Throughput over wall time between the end of step 1 and the last step:
    // retries and resynchronisations count against it.
    const auto first = records.find(1);
    const double wall = first != records.end() ? previous->time - first->second.time : 0;
    if (wall > 0) summary.tokens_per_second = tokens / wall;
  }
  summary.epochs = epochs.size();
  summary.step_seconds_median = Median(step_s);
  summary.compute_seconds_median = Median(compute_s);
  summary.exposed_fraction = span_steps > 0 ? exposed / span_steps : 0;
  if (o_.pp > 1) {
    summary.pipeline_stages = static_cast<uint32_t>(o_.pp);
    summary.pipeline_schedule = o_.train.pipeline_schedule;
    for (double v : idle_sum) summary.pipeline_idle.push_back(idle_steps > 0 ? v / idle_steps : 0);
    // Micro-batches per pipeline: the accumulation, or fewer when a shard is smaller.
    const int64_t dp = workers_ / (o_.pp * o_.tp);
    const int64_t shard = std::max<int64_t>(1, o_.train.global_batch / dp);
    summary.analytic_bubble =
        worker::AnalyticBubble(static_cast<int>(o_.pp), static_cast<int>(std::min(o_.train.accumulation, shard)));
  }
  if (summary.completed && summary.steps < steps) {
    summary.completed = false;
    summary.failure = fmt::format("only {} of {} steps were reported", summary.steps, steps);
  }
}

}  // namespace local_cluster_detail

using local_cluster_detail::LocalCluster;

Result<RunSummary> RunLocalTraining(const ClusterOptions& o, ShutdownSignal& shutdown) {
  LocalCluster cluster(o, shutdown);
  TANDEM_ASSIGN_OR_RETURN(const bool started, cluster.Start());
  if (!started) return cluster.summary();  // Ctrl-C before anything started
  cluster.Follow();
  return cluster.Summarise();
}

std::string SummaryJson(const RunSummary& s) {
  std::string peaks;
  for (const auto& [name, bytes] : s.worker_peak_rss_bytes) {
    peaks += fmt::format("{}{}: {}", peaks.empty() ? "" : ", ", JsonQuote(name), bytes);
  }
  std::string idle;
  for (size_t i = 0; i < s.pipeline_idle.size(); ++i) idle += (i ? "," : "") + JsonNumber(s.pipeline_idle[i], 4);
  std::string restarts;
  for (const auto& [role, n] : s.restarts)
    restarts += fmt::format("{}{}: {}", restarts.empty() ? "" : ", ", JsonQuote(role), n);
  std::string injected;
  for (const InjectedFault& f : s.injected) {
    injected += fmt::format(
        "{}\n    {{\"kind\": {}, \"process\": {}, \"step\": {}, \"planned_step\": {}, \"duration_seconds\": {}, "
        "\"at_seconds\": {}, \"detected_seconds\": {}, \"recovered_seconds\": {}, \"detection\": {}}}",
        injected.empty() ? "" : ",", JsonQuote(FaultKindName(f.fault.kind)), JsonQuote(f.fault.target), f.step,
        f.fault.step, JsonNumber(std::chrono::duration<double>(f.fault.duration).count(), 3),
        JsonNumber(f.at_seconds, 3), f.detected_seconds < 0 ? "null" : JsonNumber(f.detected_seconds, 3),
        f.recovered_seconds < 0 ? "null" : JsonNumber(f.recovered_seconds, 3), JsonQuote(f.detection));
  }
  if (!injected.empty()) injected += "\n  ";
  std::string losses;
  for (size_t i = 0; i < s.losses.size(); ++i) {
    losses += (i ? "," : "") + (std::isfinite(s.losses[i]) ? fmt::format("{:.6f}", s.losses[i]) : std::string("null"));
  }
  return fmt::format(
      "{{\n  \"completed\": {},\n  \"steps\": {},\n  \"first_loss\": {},\n  \"last_loss\": {},\n"
      "  \"tokens_per_second\": {},\n  \"mode\": {},\n  \"world_size\": {},\n  \"epochs\": {},\n  \"faults\": {},\n"
      "  \"workers_added\": {},\n  \"server_steps_applied\": {},\n  \"step_seconds_median\": {},\n"
      "  \"compute_seconds_median\": {},\n  \"exposed_comm_fraction\": {},\n  \"network\": {},\n"
      "  \"elapsed_seconds\": {},\n  \"failure\": {},\n  \"work_dir\": {},\n  \"checkpoint\": {},\n"
      "  \"pipeline_stages\": {},\n"
      "  \"pipeline_schedule\": {},\n  \"pipeline_idle\": [{}],\n  \"analytic_bubble\": {},\n  \"peak_rss_bytes\": "
      "{},\n"
      "  \"worker_peak_rss_bytes\": {{{}}},\n  \"peak_parameter_bytes\": {},\n  \"placement\": {},\n"
      "  \"tensor_parallel\": {},\n  \"restarts\": {{{}}},\n  \"rollbacks\": {},\n  \"steps_redone\": {},\n"
      "  \"chaos_seed\": {},\n  \"injected\": [{}],\n"
      "  \"losses\": [{}]\n}}\n",
      s.completed ? "true" : "false", s.steps, JsonNumber(s.first_loss, 7), JsonNumber(s.last_loss, 7),
      JsonNumber(s.tokens_per_second, 6), JsonQuote(s.mode), s.world_size, s.epochs, s.faults, s.workers_added,
      s.server_steps_applied ? std::to_string(*s.server_steps_applied) : "null", JsonNumber(s.step_seconds_median, 6),
      JsonNumber(s.compute_seconds_median, 6), JsonNumber(s.exposed_fraction, 4), JsonQuote(s.network),
      JsonNumber(s.elapsed_seconds, 4), s.failure.empty() ? "null" : JsonQuote(s.failure), JsonQuote(s.work_dir),
      s.checkpoint.empty() ? "null" : JsonQuote(s.checkpoint), s.pipeline_stages,
      s.pipeline_schedule.empty() ? "null" : JsonQuote(s.pipeline_schedule), idle, JsonNumber(s.analytic_bubble, 4),
      s.peak_rss_bytes, peaks, s.peak_parameter_bytes, JsonQuote(s.placement), s.tensor_parallel, restarts, s.rollbacks,
      s.steps_redone, s.chaos ? std::to_string(s.chaos_seed) : "null", injected, losses);
}

}  // namespace tandem::cli
