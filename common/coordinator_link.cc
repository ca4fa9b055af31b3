#include "common/coordinator_link.h"

#include <unistd.h>

#include <cctype>
#include <chrono>
#include <limits>
#include <map>
#include <thread>

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <spdlog/spdlog.h>

#include "common/grpc_util.h"

namespace tandem {

void DeclareCoordinatorLinkOptions(OptionSet& options, CoordinatorLinkConfig* config) {
  options.Address("coordinator.address", &config->address, "the coordinator's gRPC address");
  options.String("coordinator.token_file", &config->token_file,
                 "file holding the job's join token (if the coordinator requires one)");
  options.String("job.id", &config->job_id, "the job to join");
  options.String("node.id", &config->node_id,
                 "this node's identity: members with the same id share a node (default: the hostname)");
  options.Int("incarnation", &config->incarnation,
              "which life of its --name this process is: a higher incarnation replaces a live member of the same "
              "name at once (a restart); a process whose name a higher one took over exits with status 1. 0: this "
              "process's start time in microseconds since the Unix epoch, so restarts increase with no "
              "configuration",
              0, std::numeric_limits<int64_t>::max());
}

Result<std::unique_ptr<CoordinatorLink>> CoordinatorLink::Start(const CoordinatorLinkConfig& config, Daemon& daemon,
                                                                v1::Role role, const v1::NodeIdentity& node,
                                                                MemberHooks hooks) {
  std::unique_ptr<CoordinatorLink> link(new CoordinatorLink());
  TANDEM_ASSIGN_OR_RETURN(auto channel,
                          MakeChannel(config.address, daemon.config().tls, daemon.config().max_message_bytes));
  MemberSessionOptions options;
  options.job_id = config.job_id;
  if (daemon.name_given()) {
    const std::string& name = daemon.config().name;
    bool valid = name.size() <= 128;
    for (char c : name) {
      valid = valid && (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-');
    }
    if (!valid) {
      return InvalidArgument(
          "name '{}': a member registers under its name, which may hold only letters, digits, '.', '_' and '-' (at "
          "most 128 bytes)",
          name);
    }
    options.member_name = name;
    options.incarnation = config.incarnation != 0
                              ? static_cast<uint64_t>(config.incarnation)
                              : static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                                          std::chrono::system_clock::now().time_since_epoch())
                                                          .count());
  }
  if (!config.token_file.empty()) {
    TANDEM_ASSIGN_OR_RETURN(options.token, ReadFileContents(config.token_file, "coordinator.token_file"));
    while (!options.token.empty() && std::isspace(static_cast<unsigned char>(options.token.back()))) {
      options.token.pop_back();
    }
  }
  options.role = role;
  options.node = node;
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  options.node.set_hostname(host);
  options.node.set_node_id(config.node_id.empty() ? host : config.node_id);
  options.node.set_cpu_cores(std::thread::hardware_concurrency());
  options.node.set_memory_bytes(static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) *
                                static_cast<uint64_t>(sysconf(_SC_PAGESIZE)));
  options.control_address = daemon.grpc_address();
  options.endpoints = hooks.endpoints;
  options.peer_view = hooks.peer_view;
  options.collective_progress = hooks.collective_progress;
  options.replicated_epoch = hooks.replicated_epoch;

  auto& up = prometheus::BuildGauge()
                 .Name("tandem_coordinator_reachable")
                 .Help("1 while this process is registered with its coordinator and its membership stream is up.")
                 .Register(daemon.registry())
                 .Add({});
  auto& changes = prometheus::BuildCounter()
                      .Name("tandem_coordinator_reachability_changes_total")
                      .Help("Times the coordinator went from reachable to unreachable or back.")
                      .Register(daemon.registry())
                      .Add({});
  auto& epoch_gauge = prometheus::BuildGauge()
                          .Name("tandem_member_epoch")
                          .Help("The newest membership epoch this member has joined.")
                          .Register(daemon.registry())
                          .Add({});
  // Which job, node and rank this member is: an unranked series until it
  // joins an epoch, then one series with its rank (a new rank replaces it).
  // A server's rank is its rank among the epoch's servers (ServerRank).
  auto& info_family = prometheus::BuildGauge()
                          .Name("tandem_member_info")
                          .Help(
                              "Always 1; the labels say which job and node this member is in and its rank (workers: "
                              "global rank; servers: rank among the servers) in its newest epoch.")
                          .Register(daemon.registry());
  const std::map<std::string, std::string> identity = {{"job_id", options.job_id}, {"node_id", options.node.node_id()}};
  info_family.Add(identity).Set(1);
  const std::string address = config.address;
  Daemon* d = &daemon;  // outlives the link (see Start's contract)
  options.on_connection = [address, d, &up, &changes, first = true](bool connected, const std::string& detail) mutable {
    if (connected) {
      spdlog::info("coordinator at {} is serving", address);
    } else {
      spdlog::warn("coordinator at {} is not reachable ({}); waiting for it", address, detail);
    }
    if (!first) changes.Increment();
    first = false;
    up.Set(connected ? 1 : 0);
    d->SetReady(connected);
  };
  CoordinatorLink* self = link.get();  // owns the session, so outlives its callbacks
  options.on_epoch = [&epoch_gauge, &info_family, identity, info = &info_family.Add(identity), self,
                      on_epoch = hooks.on_epoch](const v1::MembershipEpoch& epoch) mutable {
    epoch_gauge.Set(static_cast<double>(epoch.epoch()));
    // The session's thread may get an epoch before the constructor below has
    // returned and the session is published.
    MemberSession* session = nullptr;
    while ((session = self->published_.load(std::memory_order_acquire)) == nullptr) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    auto labels = identity;
    int64_t rank_now = -1;
    if (const auto rank = session->rank()) {
      labels["rank"] = std::to_string(rank->global_rank());
      rank_now = rank->global_rank();
    } else if (const auto server = ServerRank(epoch, session->member_id())) {
      labels["rank"] = std::to_string(*server);
      rank_now = *server;
    }
    if (trace::On()) {  // a membership event on this member's timeline
      trace::SetProcessInfo("member_id", static_cast<int64_t>(session->member_id()));
      trace::SetProcessInfo("rank", rank_now);
      trace::Instant("epoch", "membership", trace::Now(), 0,
                     {{"epoch", static_cast<int64_t>(epoch.epoch())},
                      {"rank", rank_now},
                      {"workers", static_cast<int64_t>(epoch.worker_count())},
                      {"servers", static_cast<int64_t>(epoch.server_count())}});
    }
    if (auto* now = &info_family.Add(labels); now != info) {
      info_family.Remove(info);
      info = now;
      info->Set(1);
    }
    if (!on_epoch) return Status::Ok();
    return on_epoch(epoch, *session);
  };
  options.on_newer_epoch = hooks.on_newer_epoch;
  options.on_drain = [] { spdlog::warn("the coordinator drains this member"); };
  options.on_fenced = [d, &up, name = options.member_name, job = options.job_id](const std::string&) {
    up.Set(0);
    d->SetReady(false);
    d->RequestShutdown(FailedPrecondition(
        "a newer incarnation of '{}' replaced this process, which cannot rejoin job '{}' (see above)", name, job));
  };
  // Not reachable until the first registration succeeds.
  options.on_connection(false, "not registered yet");
  if (trace::On()) {
    trace::SetProcessInfo("node", options.node.node_id());
    link->clock_ = std::make_unique<trace::ClockSampler>(channel);
  }
  link->session_ = std::make_unique<MemberSession>(std::move(channel), std::move(options));
  link->published_.store(link->session_.get(), std::memory_order_release);
  return link;
}

CoordinatorLink::~CoordinatorLink() = default;

void CoordinatorLink::Leave(std::chrono::milliseconds timeout) {
  if (session_ == nullptr || session_->member_id() == 0) return;
  if (Status s = session_->Leave("shutting down", timeout); !s.ok()) {
    spdlog::warn("could not leave the job cleanly: {}", s.ToString());
  } else {
    spdlog::info("left the job");
  }
}

}  // namespace tandem
