// tandem status | drain | scale: the coordinator's admin API from a terminal.
#include <algorithm>

#include <google/protobuf/util/json_util.h>
#include <google/protobuf/util/time_util.h>

#include "cli/commands.h"
#include "common/config.h"
#include "common/grpc_util.h"
#include "tandem/v1/coordinator.grpc.pb.h"

namespace tandem::cli {
namespace {

using google::protobuf::util::TimeUtil;

struct AdminFlags {
  std::string coordinator = "127.0.0.1:7400";
  std::string job_id;
  std::string token_file;
  std::chrono::milliseconds timeout{5000};
  TlsConfig tls;
};

void DeclareAdminFlags(OptionSet& options, AdminFlags* f) {
  options.Address("coordinator", &f->coordinator, "the coordinator's gRPC address");
  options.String("job", &f->job_id, "the job (may be left out when the coordinator has one job)");
  options.String("token_file", &f->token_file, "file holding the join token, if the coordinator requires one");
  options.Duration("timeout", &f->timeout, "how long to wait for the coordinator", std::chrono::milliseconds(1),
                   std::chrono::milliseconds(600000));
  DeclareTlsOptions(options, &f->tls, /*client_only=*/true);
}

Result<std::unique_ptr<v1::CoordinatorAdmin::Stub>> Connect(const AdminFlags& f, std::string* token) {
  if (!f.token_file.empty()) {
    TANDEM_ASSIGN_OR_RETURN(*token, ReadFileContents(f.token_file, "token_file"));
    while (!token->empty() && std::isspace(static_cast<unsigned char>(token->back()))) token->pop_back();
  }
  TANDEM_ASSIGN_OR_RETURN(auto channel, MakeChannel(f.coordinator, f.tls));
  return v1::CoordinatorAdmin::NewStub(channel);
}

std::string StateName(v1::MemberState s) {
  std::string name = v1::MemberState_Name(s);
  name = name.substr(std::string("MEMBER_STATE_").size());
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
  return name;
}

std::string HealthName(v1::MemberHealth h) {
  switch (h) {
    case v1::MEMBER_HEALTH_HEALTHY:
      return "healthy";
    case v1::MEMBER_HEALTH_LATE:
      return "late";
    case v1::MEMBER_HEALTH_STRAGGLER:
      return "straggler";
    default:
      return "-";
  }
}

// Calls one admin RPC with the flags' coordinator, token and timeout. Returns
// -1 on success (the response is filled in), else the exit code after
// printing the error: 2 for a local problem, 1 for the coordinator's answer.
template <typename Request, typename Response>
int Call(const char* command, const AdminFlags& f, Request request, Response* response,
         grpc::Status (v1::CoordinatorAdmin::Stub::*method)(grpc::ClientContext*, const Request&, Response*)) {
  std::string token;
  auto stub = Connect(f, &token);
  if (!stub.ok()) {
    fmt::print(stderr, "tandem {}: {}\n", command, stub.status().message());
    return 2;
  }
  request.set_job_id(f.job_id);
  request.set_token(token);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + f.timeout);
  if (const grpc::Status s = ((**stub).*method)(&ctx, request, response); !s.ok()) {
    fmt::print(stderr, "tandem {}: {}\n", command, Status::FromGrpc(s).ToString());
    return 1;
  }
  return -1;
}

}  // namespace

std::string FormatStatus(const v1::GetStatusResponse& s) {
  std::string out;
  const auto& spec = s.job_spec();
  out += fmt::format("job {}: ", spec.job_id());
  if (s.active_epoch() > 0) {
    out += fmt::format("epoch {} active", s.active_epoch());
  } else if (s.pending_epoch() > 0) {
    out += fmt::format("epoch {} pending (waiting for acknowledgements)", s.pending_epoch());
  } else {
    out += "no epoch yet (rendezvous open)";
  }
  out += fmt::format(", mesh dp={} tp={} pp={}, step {}, {}..{} workers, coordinator incarnation {}\n", s.mesh().dp(),
                     s.mesh().tp(), s.mesh().pp(), s.step(), spec.min_workers(), spec.max_workers(),
                     s.coordinator_incarnation());
  if (s.rendezvous().open()) {
    out += fmt::format("rendezvous: {} worker(s) and {} server(s) waiting\n", s.rendezvous().waiting_workers(),
                       s.rendezvous().waiting_servers());
  }
  if (!s.waiting_reason().empty()) out += s.waiting_reason() + "\n";
  out += fmt::format("\n  {:>6}  {:<20} {:>7}  {:<7} {:<9} {:>5} {:>5} {:>6}  {:<16} {:>4} {:>8} {:>9}  {}\n", "MEMBER",
                     "NAME", "PID", "ROLE", "STATE", "RANK", "NODE", "LOCAL", "NODE ID", "GPUS", "STEP", "HEARTBEAT",
                     "HEALTH");
  auto members = s.members();
  std::sort(members.begin(), members.end(), [](const v1::MemberStatus& a, const v1::MemberStatus& b) {
    if (a.role() != b.role()) return a.role() < b.role();
    if (a.has_rank() != b.has_rank()) return a.has_rank();
    if (a.has_rank()) return a.rank().global_rank() < b.rank().global_rank();
    return a.member_id() < b.member_id();
  });
  for (const auto& m : members) {
    const bool ranked = m.has_rank();
    // Names differ at their end (pod-3, worker-12): a long one keeps its end.
    const std::string& name = m.member_name();
    const std::string shown = name.empty() ? "-" : name.size() <= 20 ? name : "~" + name.substr(name.size() - 19);
    out += fmt::format(
        "  {:>6}  {:<20} {:>7}  {:<7} {:<9} {:>5} {:>5} {:>6}  {:<16} {:>4} {:>8} {:>8.1f}s  {}\n", m.member_id(),
        shown, m.pid() == 0 ? "-" : std::to_string(m.pid()), m.role() == v1::ROLE_SERVER ? "server" : "worker",
        StateName(m.state()), ranked ? std::to_string(m.rank().global_rank()) : "-",
        ranked ? std::to_string(m.rank().node_rank()) : "-", ranked ? std::to_string(m.rank().local_rank()) : "-",
        (m.node().node_id().empty() ? m.node().hostname() : m.node().node_id()).substr(0, 16),
        m.node().local_device_count(), m.last_step(), TimeUtil::DurationToMilliseconds(m.last_heartbeat_age()) / 1000.0,
        HealthName(m.health()));
  }
  if (s.shard_map().partitions_size() > 0) {
    std::map<uint64_t, std::pair<int, int>> load;
    for (const auto& p : s.shard_map().partitions()) {
      ++load[p.primary_member_id()].first;
      if (p.backup_member_id() != 0) ++load[p.backup_member_id()].second;
    }
    out +=
        fmt::format("\nshard map v{}: {} parameters in {} partitions of {} elements\n", s.shard_map().version(),
                    s.shard_map().parameter_count(), s.shard_map().partitions_size(), s.shard_map().partition_size());
    for (const auto& [server, counts] : load) {
      out += fmt::format("  server {}: primary for {}, backup for {}\n", server, counts.first, counts.second);
    }
  }
  // The straggler score: workers the job waited for noticeably, and who is named.
  std::string stragglers;
  uint32_t window = 0;
  for (const auto& m : members) {
    if (!m.has_straggler() || !m.has_rank()) continue;
    const auto& st = m.straggler();
    window = std::max(window, st.window_steps());
    if (st.score() < 0.02 && !st.named()) continue;
    stragglers += fmt::format(
        "  rank {} on node {} (member {}): score {:.2f}, late in {} of {} steps{}{}\n", m.rank().global_rank(),
        m.node().node_id(), m.member_id(), st.score(), st.late_steps(), st.window_steps(),
        st.late_steps() > 0 ? fmt::format(" by {:.1f} ms on average", st.mean_late_seconds() * 1e3) : "",
        st.named() ? fmt::format(": a straggler since step {}", st.named_at_step()) : "");
  }
  if (window > 0) {
    out += fmt::format("\nstragglers (the share of step time the job waited for each worker, last {} steps):{}\n",
                       window, stragglers.empty() ? " none" : "");
    out += stragglers;
  }
  for (const auto& c : s.stalled_collectives()) {
    std::string ranks;
    for (uint32_t r : c.waiting_for_ranks()) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    out += fmt::format("\nstalled: {} #{} waits for rank(s) {} ({:.1f} s)\n", c.communicator(), c.sequence(), ranks,
                       TimeUtil::DurationToMilliseconds(c.stalled_for()) / 1000.0);
  }
  return out;
}

int StatusCommand(int argc, char** argv) {
  AdminFlags f;
  bool json = false;
  OptionSet options("tandem status",
                    "show a job's epoch, members (name, pid, role, rank, node, step, health, straggler score) and "
                    "shard map");
  options.Bool("json", &json, "print the coordinator's answer (tandem.v1.GetStatusResponse) as JSON");
  DeclareAdminFlags(options, &f);
  if (int rc = ParseOrExit(options, argc, argv); rc >= 0) return rc;
  v1::GetStatusResponse response;
  if (int rc = Call("status", f, v1::GetStatusRequest(), &response, &v1::CoordinatorAdmin::Stub::GetStatus); rc >= 0) {
    return rc;
  }
  if (json) {
    std::string text;
    google::protobuf::util::JsonPrintOptions print;
    print.add_whitespace = true;
    print.preserve_proto_field_names = true;
    (void)google::protobuf::util::MessageToJsonString(response, &text, print);
    fmt::print("{}", text);
    return 0;
  }
  fmt::print("{}", FormatStatus(response));
  return 0;
}

int DrainCommand(int argc, char** argv) {
  AdminFlags f;
  std::string member;
  std::string reason;
  OptionSet options("tandem drain", "take a member out of the job at the next epoch (it finishes and leaves)");
  options.Positional("MEMBER", &member, "the member id (see tandem status)", true);
  options.String("reason", &reason, "why, for the logs and tandem status");
  DeclareAdminFlags(options, &f);
  if (int rc = ParseOrExit(options, argc, argv); rc >= 0) return rc;
  uint64_t id = 0;
  try {
    id = std::stoull(member);
  } catch (const std::exception&) {
    fmt::print(stderr, "tandem drain: MEMBER: expected a member id (a number), got '{}'\n", member);
    return 2;
  }
  v1::DrainRequest request;
  request.set_member_id(id);
  request.set_reason(reason);
  v1::DrainResponse response;
  if (int rc = Call("drain", f, request, &response, &v1::CoordinatorAdmin::Stub::Drain); rc >= 0) return rc;
  fmt::print("member {} is draining: the next epoch forms without it\n", id);
  return 0;
}

int ScaleCommand(int argc, char** argv) {
  AdminFlags f;
  int64_t min_workers = 0;
  int64_t max_workers = 0;
  OptionSet options("tandem scale", "change a job's worker range; extra workers drain, waiting ones join");
  options.Int("min", &min_workers, "new minimum number of workers (0: unchanged)", 0, 65536);
  options.Int("max", &max_workers, "new maximum number of workers (0: unchanged)", 0, 65536);
  DeclareAdminFlags(options, &f);
  if (int rc = ParseOrExit(options, argc, argv); rc >= 0) return rc;
  if (min_workers == 0 && max_workers == 0) {
    fmt::print(stderr, "tandem scale: give --min, --max or both\n");
    return 2;
  }
  v1::ScaleRequest request;
  request.set_min_workers(static_cast<uint32_t>(min_workers));
  request.set_max_workers(static_cast<uint32_t>(max_workers));
  v1::ScaleResponse response;
  if (int rc = Call("scale", f, request, &response, &v1::CoordinatorAdmin::Stub::Scale); rc >= 0) return rc;
  fmt::print("job {}: {}..{} workers; {} worker(s) now, {} draining\n", response.job_spec().job_id(),
             response.job_spec().min_workers(), response.job_spec().max_workers(), response.workers(),
             response.drained_member_ids_size());
  return 0;
}

}  // namespace tandem::cli
