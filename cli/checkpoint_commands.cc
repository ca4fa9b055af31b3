// tandem checkpoint save | restore | verify and tandem ps stats: the parameter
// servers' checkpoints and statistics from a terminal.
//
// The cluster commands ask the coordinator (CoordinatorAdmin.GetStatus) for
// the job's active epoch and its servers (their control addresses), then call
// tandem.v1.ParameterServer on every server of the epoch at once, with the
// job's join token. `checkpoint verify` reads a checkpoint directory offline
// with the reader a restore uses (server/checkpoint/checkpoint.h).
//
// Exit status: 0 on success, 1 when the cluster (or the checkpoint) says no
// (the message names the server or the file), 2 for bad flags or local files.
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <google/protobuf/util/time_util.h>

#include "cli/commands.h"
#include "common/config.h"
#include "common/grpc_util.h"
#include "server/checkpoint/checkpoint.h"
#include "tandem/v1/coordinator.grpc.pb.h"
#include "tandem/v1/server.grpc.pb.h"

namespace tandem::cli {
namespace {

using google::protobuf::util::TimeUtil;
using std::chrono::milliseconds;

// ---- output helpers -------------------------------------------------------------------------------

// A JSON object written field by field, in order.
class JsonObject {
 public:
  JsonObject& Str(std::string_view key, std::string_view value) { return Raw(key, JsonQuote(value)); }
  JsonObject& Num(std::string_view key, uint64_t value) { return Raw(key, std::to_string(value)); }
  JsonObject& Real(std::string_view key, double value) {
    return Raw(key, std::isfinite(value) ? fmt::format("{:.6g}", value) : "null");
  }
  JsonObject& Flag(std::string_view key, bool value) { return Raw(key, value ? "true" : "false"); }
  JsonObject& Raw(std::string_view key, std::string_view json) {
    if (!body_.empty()) body_ += ", ";
    body_ += JsonQuote(key) + ": " + std::string(json);
    return *this;
  }
  std::string str() const { return "{" + body_ + "}"; }

 private:
  std::string body_;
};

std::string JsonArray(const std::vector<std::string>& items) {
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + items[i];
  return out + "]";
}

std::string HumanBytes(uint64_t bytes) {
  if (bytes < 1024) return fmt::format("{} B", bytes);
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  size_t unit = 0;
  for (v /= 1024; v >= 1024 && unit + 1 < std::size(kUnits); v /= 1024) ++unit;
  return fmt::format("{:.1f} {}", v, kUnits[unit]);
}

double Seconds(const google::protobuf::Duration& d) {
  return static_cast<double>(TimeUtil::DurationToMilliseconds(d)) / 1000.0;
}

std::string CheckpointStateName(v1::CheckpointState s) {
  switch (s) {
    case v1::CHECKPOINT_STATE_IN_PROGRESS:
      return "in_progress";
    case v1::CHECKPOINT_STATE_COMPLETE:
      return "complete";
    case v1::CHECKPOINT_STATE_FAILED:
      return "failed";
    default:
      return "-";
  }
}

std::string MemberStateName(v1::MemberState s) {
  std::string name = v1::MemberState_Name(s);
  if (name.rfind("MEMBER_STATE_", 0) == 0) name = name.substr(std::string("MEMBER_STATE_").size());
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
  return name;
}

std::string ConsistencyName(const v1::ConsistencyConfig& c) {
  switch (c.mode()) {
    case v1::CONSISTENCY_MODE_ASYNC:
      return "async";
    case v1::CONSISTENCY_MODE_BOUNDED_STALENESS:
      return fmt::format("bounded({})", c.staleness_bound());
    default:
      return "sync";
  }
}

std::string CheckpointInfoJson(const v1::CheckpointInfo& info) {
  return JsonObject()
      .Str("checkpoint_id", info.checkpoint_id())
      .Str("state", CheckpointStateName(info.state()))
      .Num("step", info.step())
      .Num("bytes", info.bytes())
      .Real("duration_s", Seconds(info.duration()))
      .Str("path", info.path())
      .Str("error", info.error())
      .str();
}

// ---- the cluster: the coordinator's view of the job's servers ----------------------------------------

struct ClusterFlags {
  std::string coordinator = "127.0.0.1:7400";
  std::string job_id;
  std::string token_file;
  milliseconds timeout{10000};
  TlsConfig tls;
  bool json = false;
};

void DeclareClusterFlags(OptionSet& options, ClusterFlags* f, const std::string& timeout_help) {
  options.Address("coordinator", &f->coordinator, "the coordinator's gRPC address");
  options.String("job", &f->job_id, "the job (may be left out when the coordinator has one job)");
  options.String("token_file", &f->token_file,
                 "file holding the job's join token, if it requires one (sent to the coordinator and to every server)");
  options.Duration("timeout", &f->timeout, timeout_help, milliseconds(1), milliseconds(24 * 3600 * 1000));
  DeclareTlsOptions(options, &f->tls, /*client_only=*/true);
  options.Bool("json", &f->json, "print one JSON object instead of the table");
}

struct Server {
  uint64_t member_id = 0;
  std::string address;
  uint32_t primaries = 0;  // partitions it holds in the epoch's shard map
  uint32_t backups = 0;
  std::unique_ptr<v1::ParameterServer::Stub> stub;
};

struct Cluster {
  std::string job_id;
  uint64_t epoch = 0;
  std::string token;
  v1::ShardMap shard_map;
  std::vector<Server> servers;  // sorted by member id
  std::vector<std::string> notes;
};

bool Live(v1::MemberState s) {
  return s == v1::MEMBER_STATE_ACTIVE || s == v1::MEMBER_STATE_DRAINING;
}

// Which servers of the shard map must be live for a command: a save needs
// every primary (the others write nothing), a restore every replica.
enum class Need { kNothing, kPrimaries, kAll };

// Finds the job's active epoch and its live servers. A server the shard map
// names that is not live fails the command when `need` says so, and is noted
// otherwise. Returns -1 when the cluster is filled in, else the exit code
// after printing the error.
int Resolve(const std::string& program, const ClusterFlags& f, Need need, Cluster* cluster) {
  if (!f.token_file.empty()) {
    auto token = ReadFileContents(f.token_file, "token_file");
    if (!token.ok()) {
      fmt::print(stderr, "{}: {}\n", program, token.status().message());
      return 2;
    }
    cluster->token = *token;
    while (!cluster->token.empty() && std::isspace(static_cast<unsigned char>(cluster->token.back()))) {
      cluster->token.pop_back();
    }
  }
  auto channel = MakeChannel(f.coordinator, f.tls);
  if (!channel.ok()) {
    fmt::print(stderr, "{}: {}\n", program, channel.status().message());
    return 2;
  }
  auto coordinator = v1::CoordinatorAdmin::NewStub(*channel);
  v1::GetStatusRequest request;
  request.set_job_id(f.job_id);
  request.set_token(cluster->token);
  v1::GetStatusResponse status;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::min(f.timeout, milliseconds(30000)));
  if (const grpc::Status s = coordinator->GetStatus(&ctx, request, &status); !s.ok()) {
    fmt::print(stderr, "{}: coordinator {}: {}\n", program, f.coordinator, Status::FromGrpc(s).ToString());
    return 1;
  }
  cluster->job_id = status.job_spec().job_id();
  if (status.active_epoch() == 0) {
    if (status.pending_epoch() > 0) {
      fmt::print(stderr,
                 "{}: job '{}' has no active epoch: epoch {} is pending (its members are acknowledging it); retry "
                 "in a moment\n",
                 program, cluster->job_id, status.pending_epoch());
    } else {
      fmt::print(stderr, "{}: job '{}' has no epoch yet (the rendezvous is waiting for members); retry once it has\n",
                 program, cluster->job_id);
    }
    return 1;
  }
  cluster->epoch = status.active_epoch();
  cluster->shard_map = status.shard_map();
  if (cluster->shard_map.partitions_size() == 0) {
    fmt::print(stderr, "{}: job '{}' keeps no state on parameter servers in epoch {} (its shard map is empty)\n",
               program, cluster->job_id, cluster->epoch);
    return 1;
  }
  std::map<uint64_t, const v1::MemberStatus*> members;
  for (const auto& m : status.members()) members.emplace(m.member_id(), &m);
  std::map<uint64_t, std::pair<uint32_t, uint32_t>> held;  // member -> primaries, backups
  for (const auto& p : cluster->shard_map.partitions()) {
    if (p.primary_member_id() != 0) ++held[p.primary_member_id()].first;
    if (p.backup_member_id() != 0) ++held[p.backup_member_id()].second;
  }
  // Servers the shard map names that are no longer live (dead, left): the
  // coordinator's next epoch moves their partitions.
  for (const auto& [id, counts] : held) {
    auto it = members.find(id);
    if (it != members.end() && Live(it->second->state())) continue;
    const std::string what =
        fmt::format("server {}, which holds {} primary and {} backup partition(s) in epoch {}'s shard map, is {}", id,
                    counts.first, counts.second, cluster->epoch,
                    it == members.end() ? "unknown to the coordinator" : MemberStateName(it->second->state()));
    if (need == Need::kAll || (need == Need::kPrimaries && counts.first > 0)) {
      fmt::print(stderr, "{}: job '{}': {}; wait for the coordinator's next epoch (it moves them) and retry\n", program,
                 cluster->job_id, what);
      return 1;
    }
    cluster->notes.push_back(what);
  }
  for (const auto& m : status.members()) {
    if (m.role() != v1::ROLE_SERVER || !Live(m.state())) continue;
    Server server;
    server.member_id = m.member_id();
    server.address = m.control_address();
    if (server.address.empty()) {
      fmt::print(stderr, "{}: job '{}': server {} registered no control address, so it cannot be reached\n", program,
                 cluster->job_id, m.member_id());
      return 1;
    }
    auto server_channel = MakeChannel(server.address, f.tls);
    if (!server_channel.ok()) {
      fmt::print(stderr, "{}: server {}: {}\n", program, m.member_id(), server_channel.status().message());
      return 2;
    }
    server.stub = v1::ParameterServer::NewStub(*server_channel);
    if (auto it = held.find(m.member_id()); it != held.end()) {
      server.primaries = it->second.first;
      server.backups = it->second.second;
    }
    cluster->servers.push_back(std::move(server));
  }
  std::sort(cluster->servers.begin(), cluster->servers.end(),
            [](const Server& a, const Server& b) { return a.member_id < b.member_id; });
  if (cluster->servers.empty()) {
    fmt::print(stderr, "{}: job '{}' has no live parameter server in epoch {}\n", program, cluster->job_id,
               cluster->epoch);
    return 1;
  }
  return -1;
}

// Runs fn(i) for every server at once and waits for all.
template <typename Fn>
void ForEachServer(const Cluster& cluster, Fn fn) {
  std::vector<std::thread> threads;
  threads.reserve(cluster.servers.size());
  for (size_t i = 0; i < cluster.servers.size(); ++i) threads.emplace_back([&fn, i] { fn(i); });
  for (auto& t : threads) t.join();
}

std::unique_ptr<grpc::ClientContext> Deadline(milliseconds timeout) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + timeout);
  return ctx;
}

std::string ServerName(const Server& s) {
  return fmt::format("server {} ({})", s.member_id, s.address);
}

// ---- tandem checkpoint save -----------------------------------------------------------------------

struct SaveOutcome {
  std::string error;  // empty: the server's last answer was not a failure
  v1::CheckpointInfo info;
  bool ok() const { return error.empty(); }
};

// Follows asynchronous writes with GetStats until every server reports
// COMPLETE or FAILED, or `timeout` passes; progress goes to stderr.
void FollowWrites(const Cluster& cluster, const ClusterFlags& f, milliseconds poll, milliseconds timeout,
                  std::vector<SaveOutcome>& out) {
  const auto started = std::chrono::steady_clock::now();
  const auto deadline = started + timeout;
  std::vector<Status> unreachable(out.size());
  std::string last_line;
  for (;;) {
    ForEachServer(cluster, [&](size_t i) {
      if (!out[i].ok() || out[i].info.state() != v1::CHECKPOINT_STATE_IN_PROGRESS) return;
      const Server& server = cluster.servers[i];
      v1::GetStatsRequest request;
      request.set_job_id(cluster.job_id);
      request.set_token(cluster.token);
      v1::GetStatsResponse stats;
      auto ctx = Deadline(std::min(f.timeout, milliseconds(10000)));
      if (const grpc::Status s = server.stub->GetStats(ctx.get(), request, &stats); !s.ok()) {
        unreachable[i] = Status::FromGrpc(s);  // perhaps passing: asked again at the next poll
        return;
      }
      unreachable[i] = Status::Ok();
      const v1::CheckpointInfo& last = stats.last_checkpoint();
      if (last.checkpoint_id() != out[i].info.checkpoint_id() || last.path() != out[i].info.path()) {
        out[i].error = fmt::format(
            "its last checkpoint is now '{}' at {}, not '{}': another save started before this one was confirmed",
            last.checkpoint_id(), last.path(), out[i].info.checkpoint_id());
        return;
      }
      out[i].info = last;
      if (last.state() == v1::CHECKPOINT_STATE_FAILED) out[i].error = "the write failed: " + last.error();
    });
    size_t done = 0, complete = 0;
    uint64_t bytes = 0;
    for (const auto& o : out) {
      bytes += o.info.bytes();
      if (!o.ok() || o.info.state() != v1::CHECKPOINT_STATE_IN_PROGRESS) ++done;
      if (o.ok() && o.info.state() == v1::CHECKPOINT_STATE_COMPLETE) ++complete;
    }
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    std::string line = fmt::format("checkpoint '{}': {}/{} servers complete, {} written", out[0].info.checkpoint_id(),
                                   complete, out.size(), HumanBytes(bytes));
    if (line != last_line || done == out.size()) fmt::print(stderr, "{} ({:.1f} s)\n", line, elapsed);
    last_line = line;
    if (done == out.size()) return;
    if (std::chrono::steady_clock::now() + poll > deadline) {
      for (size_t i = 0; i < out.size(); ++i) {
        if (!out[i].ok() || out[i].info.state() != v1::CHECKPOINT_STATE_IN_PROGRESS) continue;
        out[i].error =
            unreachable[i].ok()
                ? fmt::format("still writing after {:.1f} s; follow it with tandem ps stats", elapsed)
                : fmt::format("unreachable while writing, for {:.1f} s: {}", elapsed, unreachable[i].ToString());
      }
      return;
    }
    std::this_thread::sleep_for(poll);
  }
}

}  // namespace

int CheckpointSaveCommand(int argc, char** argv) {
  ClusterFlags f;
  f.timeout = milliseconds(600000);
  std::string dir;
  std::string id;
  int64_t step = 0;
  bool async = false;
  bool no_wait = false;
  milliseconds poll{500};
  OptionSet options("tandem checkpoint save",
                    "save a checkpoint of a job's parameter servers: every server of the active epoch writes the "
                    "partitions it holds as primary, at the same step, into DIR/ID");
  options.String("dir", &dir,
                 "directory to write into (required): absolute, on the servers' filesystem; the checkpoint is DIR/ID");
  options.Int("step", &step,
              "the step boundary to save (the state after exactly this many updates); servers that have not reached "
              "it wait for it, a server already past it refuses. 0: the step each server is at now, a consistent cut "
              "only when training is paused",
              0, INT64_MAX);
  options.String("id", &id,
                 "the checkpoint's id, 1 to 128 bytes of [A-Za-z0-9._-] (default: step-<step>, zero-padded to 10 "
                 "digits)");
  options.Bool("async", &async,
               "each server answers once its state is captured and writes in the background without stalling "
               "training; the command then follows the writes (progress on stderr) until every server is done");
  options.Bool("no_wait", &no_wait, "with --async: print the servers' first answers (in_progress) and exit");
  options.Duration("poll_interval", &poll, "with --async: how often to ask the servers for progress", milliseconds(10),
                   milliseconds(60000));
  DeclareClusterFlags(options, &f,
                      "longest wait for each server (a save waits for its step and, without --async, for its files) "
                      "and, with --async, for the writes to finish");
  options.SetEpilog(
      "A consistent cut of the whole job needs the same step on every server: give --step (training goes on;\n"
      "each server captures its partitions as they complete that step). --step 0 saves the step each server is\n"
      "at when the request arrives, which is the same step everywhere only while training is paused; the\n"
      "command fails if the servers saved different steps. Each server prints one line; the exit status is 0\n"
      "when every server's files are in place, 1 when any server failed (named; do not restore from that\n"
      "checkpoint), 2 for bad flags.\n");
  if (int rc = ParseOrExit(options, argc, argv); rc >= 0) return rc;
  const std::string program = options.program();
  if (dir.empty()) {
    fmt::print(stderr, "{}: --dir: required: the directory to write into, on the servers' filesystem\n", program);
    return 2;
  }
  if (!std::filesystem::path(dir).is_absolute()) {
    fmt::print(stderr, "{}: --dir: must be an absolute path (the servers open it on their filesystem), got '{}'\n",
               program, dir);
    return 2;
  }
  if (!id.empty()) {
    if (Status s = server::ValidateCheckpointId(id); !s.ok()) {
      fmt::print(stderr, "{}: --id: {}\n", program, s.message());
      return 2;
    }
  }
  if (no_wait && !async) {
    fmt::print(stderr, "{}: --no-wait: only with --async (a synchronous save returns when the files are in place)\n",
               program);
    return 2;
  }
  Cluster cluster;
  if (int rc = Resolve(program, f, Need::kPrimaries, &cluster); rc >= 0) return rc;

  const auto started = std::chrono::steady_clock::now();
  std::vector<SaveOutcome> out(cluster.servers.size());
  ForEachServer(cluster, [&](size_t i) {
    const Server& server = cluster.servers[i];
    v1::SaveCheckpointRequest request;
    request.set_job_id(cluster.job_id);
    request.set_token(cluster.token);
    request.set_step(static_cast<uint64_t>(step));
    request.set_directory(dir);
    request.set_async(async);
    request.set_checkpoint_id(id);
    request.set_epoch(cluster.epoch);
    v1::SaveCheckpointResponse response;
    auto ctx = Deadline(f.timeout);
    if (const grpc::Status s = server.stub->SaveCheckpoint(ctx.get(), request, &response); !s.ok()) {
      out[i].error = Status::FromGrpc(s).ToString();
      if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
        out[i].error += fmt::format(" (no answer within --timeout {}: {})", FormatDuration(f.timeout),
                                    step > 0 ? fmt::format("has training reached step {}?", step)
                                             : std::string("is the server overloaded or its disk slow?"));
      }
      return;
    }
    out[i].info = response.checkpoint();
    if (out[i].info.state() == v1::CHECKPOINT_STATE_FAILED) out[i].error = "the write failed: " + out[i].info.error();
  });
  const bool all_ok = std::all_of(out.begin(), out.end(), [](const SaveOutcome& o) { return o.ok(); });
  if (async && !no_wait && all_ok) {
    const milliseconds left =
        f.timeout - std::chrono::duration_cast<milliseconds>(std::chrono::steady_clock::now() - started);
    FollowWrites(cluster, f, poll, std::max(left, milliseconds(1)), out);
  }

  // What was saved: the servers holding primaries decide (the others write nothing).
  std::set<uint64_t> steps;
  v1::CheckpointInfo summary;
  uint64_t bytes = 0;
  double seconds = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!out[i].ok()) continue;
    bytes += out[i].info.bytes();
    seconds = std::max(seconds, Seconds(out[i].info.duration()));
    if (cluster.servers[i].primaries == 0) continue;
    steps.insert(out[i].info.step());
    if (summary.checkpoint_id().empty()) summary = out[i].info;
  }
  if (summary.checkpoint_id().empty()) {
    for (const auto& o : out) {
      if (o.ok()) summary = o.info;
    }
  }
  std::string cut_error;
  if (steps.size() > 1) {
    std::string which;
    for (size_t i = 0; i < out.size(); ++i) {
      if (!out[i].ok() || cluster.servers[i].primaries == 0) continue;
      which += fmt::format("{}server {} at step {}", which.empty() ? "" : ", ", cluster.servers[i].member_id,
                           out[i].info.step());
    }
    cut_error = fmt::format(
        "the servers saved different steps ({}): not a consistent cut (--step 0 while training runs?); save again "
        "with --step",
        which);
  }
  size_t failed = 0, in_progress = 0;
  for (const auto& o : out) {
    if (!o.ok()) ++failed;
    if (o.ok() && o.info.state() == v1::CHECKPOINT_STATE_IN_PROGRESS) ++in_progress;
  }
  const bool ok = failed == 0 && cut_error.empty();

  if (f.json) {
    std::vector<std::string> rows;
    for (size_t i = 0; i < out.size(); ++i) {
      const Server& server = cluster.servers[i];
      JsonObject row;
      row.Num("member", server.member_id).Str("address", server.address).Num("primary_partitions", server.primaries);
      if (out[i].ok()) {
        row.Str("state", CheckpointStateName(out[i].info.state())).Raw("checkpoint", CheckpointInfoJson(out[i].info));
      } else {
        row.Str("state", "failed").Str("error", out[i].error);
      }
      rows.push_back(row.str());
    }
    JsonObject o;
    o.Str("job", cluster.job_id)
        .Num("epoch", cluster.epoch)
        .Str("checkpoint_id", summary.checkpoint_id())
        .Num("step", summary.step())
        .Str("path", summary.path())
        .Num("bytes", bytes)
        .Flag("ok", ok)
        .Flag("complete", ok && in_progress == 0);
    if (!cut_error.empty()) o.Str("error", cut_error);
    o.Raw("servers", JsonArray(rows));
    fmt::print("{}\n", o.str());
  } else {
    fmt::print("checkpoint of job '{}', epoch {}: {} server(s)\n", cluster.job_id, cluster.epoch, out.size());
    fmt::print("  {:>6}  {:<21} {:<11} {:>8} {:>11} {:>9}  {}\n", "MEMBER", "ADDRESS", "STATE", "STEP", "BYTES",
               "DURATION", "PATH");
    for (size_t i = 0; i < out.size(); ++i) {
      const Server& server = cluster.servers[i];
      const auto& info = out[i].info;
      if (out[i].ok()) {
        fmt::print("  {:>6}  {:<21} {:<11} {:>8} {:>11} {:>8.3f}s  {}\n", server.member_id, server.address,
                   CheckpointStateName(info.state()), info.step(), HumanBytes(info.bytes()), Seconds(info.duration()),
                   info.path());
      } else {
        fmt::print("  {:>6}  {:<21} {:<11} {:>8} {:>11} {:>9}  {}\n", server.member_id, server.address, "failed", "-",
                   "-", "-", out[i].error);
      }
    }
    if (ok && in_progress == 0) {
      fmt::print("saved checkpoint '{}' at step {} on {} server(s): {} in {:.3f} s, in {}\n", summary.checkpoint_id(),
                 summary.step(), out.size(), HumanBytes(bytes), seconds, summary.path());
    } else if (ok) {
      fmt::print(
          "checkpoint '{}' at step {} is being written by {} server(s) in {}; it is complete once tandem ps stats "
          "shows it complete on every server\n",
          summary.checkpoint_id(), summary.step(), in_progress, summary.path());
    }
  }
  if (ok) return 0;
  const std::string program_prefix = program + ": ";
  for (size_t i = 0; i < out.size(); ++i) {
    if (!out[i].ok()) {
      fmt::print(stderr, "{}{} failed: {}\n", program_prefix, ServerName(cluster.servers[i]), out[i].error);
    }
  }
  if (!cut_error.empty()) fmt::print(stderr, "{}{}\n", program_prefix, cut_error);
  fmt::print(stderr, "{}checkpoint '{}' is incomplete{}: do not restore from it\n", program_prefix,
             summary.checkpoint_id().empty() ? id : summary.checkpoint_id(),
             failed > 0 ? fmt::format(" ({} of {} server(s) failed)", failed, out.size()) : "");
  return 1;
}

// ---- tandem checkpoint restore --------------------------------------------------------------------

int CheckpointRestoreCommand(int argc, char** argv) {
  ClusterFlags f;
  f.timeout = milliseconds(600000);
  std::string path;
  bool skip_optimizer_state = false;
  OptionSet options("tandem checkpoint restore",
                    "restore a job's parameter servers from a checkpoint: every server of the active epoch replaces "
                    "the partitions it holds (primary and backup) with the checkpoint's state");
  options.String("path", &path,
                 "the checkpoint directory (DIR/ID of the save, required): absolute, on the servers' filesystem");
  options.Bool("skip_optimizer_state", &skip_optimizer_state,
               "restore the weights only and reset the optimizer state (moments, momentum) to zero; needed when the "
               "job's optimizer differs from the checkpoint's");
  DeclareClusterFlags(options, &f, "longest wait for each server's restore");
  options.SetEpilog(
      "The checkpoint may come from any number of servers and any partition size: each server assembles its\n"
      "partitions from the files that cover them. Pause training first: workers then pull the restored\n"
      "parameters. A server that fails (corrupt or missing files: DATA_LOSS, FAILED_PRECONDITION) restores\n"
      "nothing, but the others have restored: fix the cause and restore again. Exit status: 0 when every\n"
      "server restored, 1 when any failed (named), 2 for bad flags.\n");
  if (int rc = ParseOrExit(options, argc, argv); rc >= 0) return rc;
  const std::string program = options.program();
  if (path.empty()) {
    fmt::print(stderr, "{}: --path: required: the checkpoint directory (DIR/ID of the save)\n", program);
    return 2;
  }
  if (!std::filesystem::path(path).is_absolute()) {
    fmt::print(stderr, "{}: --path: must be an absolute path (the servers open it on their filesystem), got '{}'\n",
               program, path);
    return 2;
  }
  Cluster cluster;
  if (int rc = Resolve(program, f, Need::kAll, &cluster); rc >= 0) return rc;
  struct Outcome {
    Status status;
    v1::RestoreCheckpointResponse response;
  };
  std::vector<Outcome> out(cluster.servers.size());
  ForEachServer(cluster, [&](size_t i) {
    v1::RestoreCheckpointRequest request;
    request.set_job_id(cluster.job_id);
    request.set_token(cluster.token);
    request.set_epoch(cluster.epoch);
    request.set_path(path);
    request.set_skip_optimizer_state(skip_optimizer_state);
    auto ctx = Deadline(f.timeout);
    out[i].status = Status::FromGrpc(cluster.servers[i].stub->RestoreCheckpoint(ctx.get(), request, &out[i].response));
  });
  size_t failed = 0, partitions = 0;
  uint64_t bytes = 0;
  const v1::RestoreCheckpointResponse* first = nullptr;
  for (const auto& o : out) {
    if (!o.status.ok()) {
      ++failed;
      continue;
    }
    partitions += static_cast<size_t>(o.response.partition_ids_size());
    bytes += o.response.bytes();
    if (first == nullptr) first = &o.response;
  }
  if (f.json) {
    std::vector<std::string> rows;
    for (size_t i = 0; i < out.size(); ++i) {
      JsonObject row;
      row.Num("member", cluster.servers[i].member_id).Str("address", cluster.servers[i].address);
      if (out[i].status.ok()) {
        const auto& r = out[i].response;
        std::vector<std::string> ids;
        for (uint32_t p : r.partition_ids()) ids.push_back(std::to_string(p));
        row.Flag("ok", true)
            .Str("checkpoint_id", r.checkpoint_id())
            .Num("step", r.step())
            .Raw("partitions", JsonArray(ids))
            .Num("bytes", r.bytes())
            .Real("duration_s", Seconds(r.duration()));
      } else {
        row.Flag("ok", false).Str("error", out[i].status.ToString());
      }
      rows.push_back(row.str());
    }
    JsonObject o;
    o.Str("job", cluster.job_id).Num("epoch", cluster.epoch).Str("path", path);
    if (first != nullptr) o.Str("checkpoint_id", first->checkpoint_id()).Num("step", first->step());
    o.Num("bytes", bytes).Flag("ok", failed == 0).Raw("servers", JsonArray(rows));
    fmt::print("{}\n", o.str());
  } else {
    fmt::print("restore of job '{}', epoch {}, from {}: {} server(s)\n", cluster.job_id, cluster.epoch, path,
               out.size());
    fmt::print("  {:>6}  {:<21} {:<8} {:>10} {:>8} {:>11} {:>9}\n", "MEMBER", "ADDRESS", "RESULT", "PARTITIONS", "STEP",
               "READ", "DURATION");
    for (size_t i = 0; i < out.size(); ++i) {
      const Server& server = cluster.servers[i];
      const auto& r = out[i].response;
      if (out[i].status.ok()) {
        fmt::print("  {:>6}  {:<21} {:<8} {:>10} {:>8} {:>11} {:>8.3f}s\n", server.member_id, server.address,
                   "restored", r.partition_ids_size(), r.step(), HumanBytes(r.bytes()), Seconds(r.duration()));
      } else {
        fmt::print("  {:>6}  {:<21} {:<8} {}\n", server.member_id, server.address, "failed", out[i].status.ToString());
      }
    }
    if (failed == 0 && first != nullptr) {
      fmt::print("restored checkpoint '{}' (step {}) on {} server(s): {} partition replica(s), {} read\n",
                 first->checkpoint_id(), first->step(), out.size(), partitions, HumanBytes(bytes));
    }
  }
  if (failed == 0) return 0;
  std::string restored;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i].status.ok()) {
      restored += fmt::format("{}{}", restored.empty() ? "" : ", ", cluster.servers[i].member_id);
    } else {
      fmt::print(stderr, "{}: {} failed: {}\n", program, ServerName(cluster.servers[i]), out[i].status.ToString());
    }
  }
  if (!restored.empty()) {
    fmt::print(stderr,
               "{}: {} of {} server(s) failed while server(s) {} restored: the job's state is mixed; fix the cause "
               "and restore again\n",
               program, failed, out.size(), restored);
  }
  return 1;
}

// ---- tandem checkpoint verify ---------------------------------------------------------------------

int CheckpointVerifyCommand(int argc, char** argv) {
  std::string path;
  bool json = false;
  OptionSet options("tandem checkpoint verify",
                    "check a checkpoint directory offline: every file's header and checksums, and that the files "
                    "cover the whole parameter space");
  options.Positional("PATH", &path, "the checkpoint directory (DIR/ID of the save), on this machine", true);
  options.Bool("json", &json, "print one JSON object instead of the report");
  options.SetEpilog(
      "Reads every byte, as a restore would. Exit status: 0 when the checkpoint is complete and every checksum\n"
      "matches, 1 when it is incomplete (missing element ranges: a server did not finish its save) or corrupt\n"
      "(the file is named), 2 for bad flags.\n");
  if (int rc = ParseOrExit(options, argc, argv); rc >= 0) return rc;
  const std::string program = options.program();
  auto reader = server::CheckpointReader::Open(path);
  if (!reader.ok()) {
    if (json) {
      fmt::print("{}\n",
                 JsonObject().Str("path", path).Flag("ok", false).Str("error", reader.status().ToString()).str());
    }
    fmt::print(stderr, "{}: {}\n", program, reader.status().ToString());
    return 1;
  }
  const auto& meta = reader->meta();
  uint64_t bytes = 0;
  for (const auto& file : reader->files()) bytes += file.file_bytes;
  const auto missing = reader->Missing();
  const Status verified = reader->Verify();
  const bool ok = missing.empty() && verified.ok();
  if (json) {
    std::vector<std::string> files, gaps;
    for (const auto& file : reader->files()) {
      files.push_back(JsonObject()
                          .Str("name", file.name)
                          .Num("partition_id", file.partition_id)
                          .Num("begin", file.begin)
                          .Num("end", file.end)
                          .Num("version", file.version)
                          .Num("step", file.step)
                          .Num("bytes", file.file_bytes)
                          .str());
    }
    for (const auto& [begin, end] : missing) gaps.push_back(fmt::format("[{}, {}]", begin, end));
    JsonObject o;
    o.Str("path", path)
        .Str("job", meta.job_id)
        .Str("checkpoint_id", meta.checkpoint_id)
        .Num("step", meta.step)
        .Num("parameter_count", meta.parameter_count)
        .Str("optimizer", meta.optimizer)
        .Num("state_buffers", meta.state_buffers)
        .Num("bytes", bytes)
        .Raw("files", JsonArray(files))
        .Raw("missing", JsonArray(gaps))
        .Str("checksums", verified.ok() ? "ok" : verified.ToString())
        .Flag("complete", missing.empty())
        .Flag("ok", ok);
    fmt::print("{}\n", o.str());
  } else {
    fmt::print("checkpoint {}\n", path);
    fmt::print("  job         {}\n", meta.job_id);
    fmt::print("  id          {}\n", meta.checkpoint_id);
    fmt::print("  step        {}\n", meta.step);
    fmt::print("  parameters  {}\n", meta.parameter_count);
    fmt::print("  optimizer   {} ({} state buffer(s) per element)\n", meta.optimizer, meta.state_buffers);
    fmt::print("  files       {} ({})\n", reader->files().size(), HumanBytes(bytes));
    if (missing.empty()) {
      fmt::print("  coverage    complete\n");
    } else {
      uint64_t count = 0;
      std::string ranges;
      for (const auto& [begin, end] : missing) {
        count += end - begin;
        ranges += fmt::format("{}[{}, {})", ranges.empty() ? "" : ", ", begin, end);
      }
      fmt::print("  coverage    INCOMPLETE: {} element(s) in no file: {}\n", count, ranges);
    }
    fmt::print("  checksums   {}\n", verified.ok() ? fmt::format("ok ({} read)", HumanBytes(reader->bytes_read()))
                                                   : "FAILED: " + verified.ToString());
  }
  if (ok) return 0;
  if (!missing.empty()) {
    fmt::print(stderr,
               "{}: {}: incomplete: {} range(s) of elements are in no partition file (a server did not "
               "finish its save?)\n",
               program, path, missing.size());
  }
  if (!verified.ok()) fmt::print(stderr, "{}: corrupt: {}\n", program, verified.ToString());
  return 1;
}

// ---- tandem ps stats ------------------------------------------------------------------------------

namespace {

// One server's answer to GetStats.
struct StatsOutcome {
  Status status;
  v1::GetStatsResponse stats;
};

// --verify-replicas: each partition's copies compared. Copies at different
// versions are an update on its way to the backup (or a backup still being
// built), not a fault; at the same version they must agree.
struct ReplicaCheck {
  std::vector<uint32_t> differ, behind, single, uninitialized;
  size_t agree = 0;
};

ReplicaCheck CompareReplicas(const std::vector<StatsOutcome>& out) {
  ReplicaCheck r;
  struct Copy {
    uint64_t version;
    uint32_t crc;
  };
  std::map<uint32_t, std::vector<Copy>> copies;
  for (const auto& o : out) {
    if (!o.status.ok()) continue;
    for (const auto& p : o.stats.partitions()) copies[p.partition_id()].push_back({p.version(), p.state_crc32c()});
  }
  for (const auto& entry : copies) {
    const auto& id = entry.first;
    const auto& c = entry.second;  // not a structured binding: clang 14 cannot capture one in a lambda
    if (c.size() < 2) {
      r.single.push_back(id);
      continue;
    }
    const bool same_version = std::all_of(c.begin(), c.end(), [&](const Copy& x) { return x.version == c[0].version; });
    const bool some_empty = std::any_of(c.begin(), c.end(), [](const Copy& x) { return x.version == 0; });
    if (!same_version && some_empty) {
      r.uninitialized.push_back(id);
      continue;
    }
    const bool same_crc = std::all_of(c.begin(), c.end(), [&](const Copy& x) { return x.crc == c[0].crc; });
    if (!same_version) {
      r.behind.push_back(id);
    } else if (!same_crc) {
      r.differ.push_back(id);
    } else {
      ++r.agree;
    }
  }
  return r;
}

std::vector<std::string> IdList(const std::vector<uint32_t>& ids) {
  std::vector<std::string> s;
  for (uint32_t id : ids) s.push_back(std::to_string(id));
  return s;
}

uint64_t LagOf(const v1::GetStatsResponse& s) {
  uint64_t lag = 0;
  for (const auto& p : s.partitions()) lag = std::max(lag, p.replication_lag());
  return lag;
}

std::pair<uint32_t, uint32_t> RolesOf(const v1::GetStatsResponse& s) {
  std::pair<uint32_t, uint32_t> n{0, 0};
  for (const auto& p : s.partitions()) ++(p.role() == v1::REPLICA_ROLE_PRIMARY ? n.first : n.second);
  return n;
}

// `tandem ps stats --json`.
void PrintPsStatsJson(const Cluster& cluster, const std::vector<StatsOutcome>& out, bool partitions, bool verify,
                      const ReplicaCheck& check, size_t failed) {
  const auto& [differ, behind, single, uninitialized, agree] = check;
  std::vector<std::string> rows;
  for (size_t i = 0; i < out.size(); ++i) {
    JsonObject row;
    row.Num("member", cluster.servers[i].member_id).Str("address", cluster.servers[i].address);
    if (!out[i].status.ok()) {
      rows.push_back(row.Flag("ok", false).Str("error", out[i].status.ToString()).str());
      continue;
    }
    const auto& s = out[i].stats;
    const auto [primary, backup] = RolesOf(s);
    row.Flag("ok", true)
        .Num("member_id", s.member_id())
        .Num("epoch", s.epoch())
        .Str("optimizer", s.optimizer())
        .Str("consistency", ConsistencyName(s.consistency()))
        .Num("step", s.step())
        .Num("primary_partitions", primary)
        .Num("backup_partitions", backup)
        .Num("state_bytes", s.state_bytes())
        .Num("skipped_steps", s.skipped_steps())
        .Num("replication_lag", LagOf(s))
        .Raw("last_checkpoint", s.has_last_checkpoint() ? CheckpointInfoJson(s.last_checkpoint()) : "null");
    if (partitions) {
      std::vector<std::string> parts;
      for (const auto& p : s.partitions()) {
        parts.push_back(JsonObject()
                            .Num("partition_id", p.partition_id())
                            .Num("begin", p.range().begin())
                            .Num("end", p.range().end())
                            .Str("role", p.role() == v1::REPLICA_ROLE_PRIMARY ? "primary" : "backup")
                            .Num("version", p.version())
                            .Num("step", p.step())
                            .Num("pushes", p.pushes())
                            .Num("pulls", p.pulls())
                            .Num("bytes_pushed", p.bytes_pushed())
                            .Num("bytes_pulled", p.bytes_pulled())
                            .Num("replication_lag", p.replication_lag())
                            .Raw("state_crc32c", p.has_state_crc32c() ? std::to_string(p.state_crc32c()) : "null")
                            .str());
      }
      row.Raw("partitions", JsonArray(parts));
    }
    rows.push_back(row.str());
  }
  std::vector<std::string> notes;
  for (const auto& n : cluster.notes) notes.push_back(JsonQuote(n));
  JsonObject top;
  top.Str("job", cluster.job_id)
      .Num("epoch", cluster.epoch)
      .Num("shard_map_version", cluster.shard_map.version())
      .Num("partitions", static_cast<uint64_t>(cluster.shard_map.partitions_size()))
      .Flag("ok", failed == 0 && differ.empty())
      .Raw("notes", JsonArray(notes))
      .Raw("servers", JsonArray(rows));
  if (verify) {
    top.Raw("replicas", JsonObject()
                            .Num("agree", static_cast<uint64_t>(agree))
                            .Raw("differ", JsonArray(IdList(differ)))
                            .Raw("behind", JsonArray(IdList(behind)))
                            .Raw("without_backup", JsonArray(IdList(single)))
                            .Raw("uninitialized", JsonArray(IdList(uninitialized)))
                            .str());
  }
  fmt::print("{}\n", top.str());
}

// `tandem ps stats` as a table.
void PrintPsStatsTable(const Cluster& cluster, const std::vector<StatsOutcome>& out, bool partitions) {
  fmt::print("job '{}', epoch {}: {} server(s); shard map v{}: {} partitions of {} elements\n", cluster.job_id,
             cluster.epoch, out.size(), cluster.shard_map.version(), cluster.shard_map.partitions_size(),
             cluster.shard_map.partition_size());
  fmt::print("  {:>6}  {:<21} {:>5}  {:<9} {:>8} {:>7} {:>11} {:>7} {:>5}  {}\n", "MEMBER", "ADDRESS", "EPOCH",
             "OPTIMIZER", "STEP", "PRI/BAK", "STATE BYTES", "SKIPPED", "LAG", "LAST CHECKPOINT");
  for (size_t i = 0; i < out.size(); ++i) {
    const Server& server = cluster.servers[i];
    if (!out[i].status.ok()) {
      fmt::print("  {:>6}  {:<21} unreachable: {}\n", server.member_id, server.address, out[i].status.ToString());
      continue;
    }
    const auto& s = out[i].stats;
    const auto [primary, backup] = RolesOf(s);
    std::string last = "-";
    if (s.has_last_checkpoint()) {
      const auto& c = s.last_checkpoint();
      last = fmt::format("{} {} (step {}, {}, {:.3f} s)", c.checkpoint_id(), CheckpointStateName(c.state()), c.step(),
                         HumanBytes(c.bytes()), Seconds(c.duration()));
      if (c.state() == v1::CHECKPOINT_STATE_FAILED) last += ": " + c.error();
    }
    fmt::print("  {:>6}  {:<21} {:>5}  {:<9} {:>8} {:>7} {:>11} {:>7} {:>5}  {}\n", server.member_id, server.address,
               s.epoch(), s.optimizer().empty() ? "-" : s.optimizer(), s.step(), fmt::format("{}/{}", primary, backup),
               HumanBytes(s.state_bytes()), s.skipped_steps(), LagOf(s), last);
  }
  for (const auto& n : cluster.notes) fmt::print("note: {}\n", n);
  if (partitions) {
    struct Row {
      uint64_t member;
      const v1::PartitionStats* p;
    };
    std::vector<Row> rows;
    for (size_t i = 0; i < out.size(); ++i) {
      if (!out[i].status.ok()) continue;
      for (const auto& p : out[i].stats.partitions()) rows.push_back({cluster.servers[i].member_id, &p});
    }
    std::sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) {
      if (a.p->partition_id() != b.p->partition_id()) return a.p->partition_id() < b.p->partition_id();
      if (a.p->role() != b.p->role()) return a.p->role() < b.p->role();
      return a.member < b.member;
    });
    fmt::print("\n  {:>9}  {:<23} {:>6}  {:<7} {:>8} {:>8} {:>8} {:>8} {:>11} {:>11} {:>5}\n", "PARTITION", "RANGE",
               "MEMBER", "ROLE", "VERSION", "STEP", "PUSHES", "PULLS", "PUSHED", "PULLED", "LAG");
    for (const auto& [member, p] : rows) {
      fmt::print("  {:>9}  {:<23} {:>6}  {:<7} {:>8} {:>8} {:>8} {:>8} {:>11} {:>11} {:>5}\n", p->partition_id(),
                 fmt::format("[{}, {})", p->range().begin(), p->range().end()), member,
                 p->role() == v1::REPLICA_ROLE_PRIMARY ? "primary" : "backup", p->version(), p->step(), p->pushes(),
                 p->pulls(), HumanBytes(p->bytes_pushed()), HumanBytes(p->bytes_pulled()), p->replication_lag());
    }
  }
}

}  // namespace

int PsStatsCommand(int argc, char** argv) {
  ClusterFlags f;
  bool partitions = false;
  OptionSet options("tandem ps stats",
                    "show every parameter server of a job's active epoch: partitions, steps, state, skipped steps, "
                    "replication lag, last checkpoint");
  options.Bool("partitions", &partitions,
               "also list every partition replica: range, role, version, step, traffic, replication lag");
  bool verify = false;
  options.Bool("verify_replicas", &verify,
               "checksum every partition's state on its primary and its backup and compare them (reads all the "
               "state, under each partition's lock); exit status 1 if two copies at the same version differ");
  DeclareClusterFlags(options, &f, "longest wait for each server's answer");
  if (int rc = ParseOrExit(options, argc, argv); rc >= 0) return rc;
  const std::string program = options.program();
  Cluster cluster;
  if (int rc = Resolve(program, f, Need::kNothing, &cluster); rc >= 0) return rc;
  std::vector<StatsOutcome> out(cluster.servers.size());
  ForEachServer(cluster, [&](size_t i) {
    v1::GetStatsRequest request;
    request.set_job_id(cluster.job_id);
    request.set_token(cluster.token);
    request.set_checksums(verify);
    auto ctx = Deadline(f.timeout);
    out[i].status = Status::FromGrpc(cluster.servers[i].stub->GetStats(ctx.get(), request, &out[i].stats));
  });
  const ReplicaCheck check = verify ? CompareReplicas(out) : ReplicaCheck{};
  const auto& [differ, behind, single, uninitialized, agree] = check;
  size_t failed = 0;
  for (const auto& o : out) failed += o.status.ok() ? 0 : 1;
  if (f.json) {
    PrintPsStatsJson(cluster, out, partitions, verify, check, failed);
  } else {
    PrintPsStatsTable(cluster, out, partitions);
  }
  if (verify && !f.json) {
    fmt::print(
        "\nreplicas: {} partition(s) with both copies alike, {} differ, {} with the backup behind, {} without a "
        "backup\n",
        agree, differ.size(), behind.size(), single.size());
    if (!behind.empty()) {
      fmt::print("  behind (an update or a transfer on its way; run again to see it settle): {}\n",
                 fmt::join(IdList(behind), ", "));
    }
    if (!uninitialized.empty()) {
      fmt::print("  a copy not initialised yet (the backup gets the primary's whole state with the next update): {}\n",
                 fmt::join(IdList(uninitialized), ", "));
    }
    if (failed > 0) {
      fmt::print(
          "  {} server(s) did not answer: the copies they hold are not compared (their partitions count as "
          "without a backup)\n",
          failed);
    }
  }
  if (!differ.empty()) {
    fmt::print(stderr, "{}: partition(s) {}: the primary and the backup hold different state at the same version\n",
               program, fmt::join(IdList(differ), ", "));
  }
  for (size_t i = 0; i < out.size(); ++i) {
    if (!out[i].status.ok()) {
      fmt::print(stderr, "{}: {}: {}\n", program, ServerName(cluster.servers[i]), out[i].status.ToString());
    }
  }
  return failed == 0 && differ.empty() ? 0 : 1;
}

}  // namespace tandem::cli
