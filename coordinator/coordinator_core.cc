#include "coordinator/coordinator_core.h"

#include <algorithm>
#include <cctype>

#include <spdlog/spdlog.h>

#include "common/config.h"
#include "common/grpc_util.h"
#include "coordinator/assignment.h"
#include "coordinator/coordinator_core_util.h"
#include "tandem/config.h"

namespace tandem::coordinator {
namespace {

using core_util::FromMs;
using core_util::HostKey;
using core_util::RoleName;
using core_util::StateName;
using core_util::Timestamp;
using core_util::ToMs;
using std::chrono::milliseconds;

constexpr size_t kMaxJobIdBytes = 128;
constexpr size_t kMaxMemberNameBytes = 128;
constexpr size_t kMaxEndpoints = 16;
constexpr size_t kMaxCollectives = 64;
constexpr size_t kMaxHostnameBytes = 253;
constexpr size_t kMaxValueBytes = 64 * 1024;
constexpr size_t kMaxValues = 1024;
constexpr uint32_t kMaxWorkers = 65536;
// How long, and how many, members that left or died are remembered.
constexpr milliseconds kForgetAfter{600000};
constexpr size_t kMaxRemembered = 1024;

Status ValidateJobId(const std::string& job_id) {
  if (job_id.empty()) return InvalidArgument("job_id: empty; name the job (letters, digits, '.', '_', '-')");
  if (job_id.size() > kMaxJobIdBytes) {
    return InvalidArgument("job_id: {} bytes, at most {} accepted", job_id.size(), kMaxJobIdBytes);
  }
  for (char c : job_id) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) {
      return InvalidArgument("job_id '{}': only letters, digits, '.', '_' and '-' are accepted", job_id);
    }
  }
  return Status::Ok();
}

// RegisterRequest.member_name: empty (no name), or 1 to 128 bytes of [A-Za-z0-9._-].
Status ValidateMemberName(const std::string& name) {
  if (name.size() > kMaxMemberNameBytes) {
    return InvalidArgument("member_name: {} bytes, at most {} accepted", name.size(), kMaxMemberNameBytes);
  }
  for (char c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) {
      return InvalidArgument("member_name '{}': only letters, digits, '.', '_' and '-' are accepted", name);
    }
  }
  return Status::Ok();
}

// RegisterRequest.version: empty (no check), or MAJOR[.MINOR[.PATCH]][-suffix]
// of at most 64 bytes whose major is this coordinator's: members of another
// major version speak another protocol.
Status CheckMemberVersion(const std::string& version) {
  if (version.empty()) return Status::Ok();
  if (version.size() > 64) return InvalidArgument("version: {} bytes, at most 64 accepted", version.size());
  size_t digits = 0;
  while (digits < version.size() && std::isdigit(static_cast<unsigned char>(version[digits]))) ++digits;
  if (digits == 0 || digits > 9 || (digits < version.size() && version[digits] != '.' && version[digits] != '-')) {
    return InvalidArgument("version '{}': expected MAJOR.MINOR.PATCH, for example {}", version, TANDEM_VERSION);
  }
  const int major = std::stoi(version.substr(0, digits));
  if (major != TANDEM_VERSION_MAJOR) {
    return FailedPrecondition(
        "version: the member runs Tandem {}, this coordinator {}; members and coordinator must share the major "
        "version (upgrade them together)",
        version, TANDEM_VERSION);
  }
  return Status::Ok();
}

}  // namespace

v1::JobSpec DefaultJobSpec() {
  v1::JobSpec spec;
  spec.set_min_workers(1);
  spec.set_max_workers(1);
  spec.set_min_servers(0);
  *spec.mutable_last_call_window() = FromMs(milliseconds(500));
  *spec.mutable_join_timeout() = FromMs(milliseconds(600000));
  *spec.mutable_heartbeat_interval() = FromMs(milliseconds(1000));
  *spec.mutable_heartbeat_deadline() = FromMs(milliseconds(3000));
  *spec.mutable_stream_grace() = FromMs(milliseconds(500));
  spec.set_partition_size_bytes(4u << 20);
  return spec;
}

CoordinatorCore::CoordinatorCore(CoreOptions options, Store* store, const Clock* clock)
    : options_(std::move(options)), store_(store), clock_(clock), random_(std::random_device{}()) {}

uint64_t CoordinatorCore::incarnation() const {
  MutexLock lock(&mu_);
  return incarnation_;
}

void CoordinatorCore::SetChangeListener(std::function<void(bool)> listener) {
  listener_ = std::move(listener);
}

void CoordinatorCore::FlushNotify() {
  if (!notify_ || !listener_) return;
  const bool epochs = notify_epochs_;
  notify_ = false;
  notify_epochs_ = false;
  // The caller's MutexLock stays in charge of mu_: it is released only
  // while the listener runs, and held again when this returns.
  mu_.Unlock();
  listener_(epochs);
  mu_.Lock();
}

// --- validation ------------------------------------------------------------------

Status CoordinatorCore::CheckToken(const std::string& token) const {
  if (options_.token.empty()) return Status::Ok();
  if (token.empty()) return Unauthenticated("token: this coordinator requires a join token");
  if (!ConstantTimeEquals(token, options_.token)) return Unauthenticated("token: wrong join token");
  return Status::Ok();
}

Result<CoordinatorCore::Job*> CoordinatorCore::FindJob(const std::string& job_id) {
  TANDEM_RETURN_IF_ERROR(ValidateJobId(job_id));
  auto it = jobs_.find(job_id);
  if (it == jobs_.end() || it->second.spec.job_id().empty()) return NotFound("job_id: unknown job '{}'", job_id);
  return &it->second;
}

Result<CoordinatorCore::Job*> CoordinatorCore::FindAdminJob(const std::string& job_id) {
  if (!job_id.empty()) return FindJob(job_id);
  // With one job, administrators need not name it.
  Job* only = nullptr;
  size_t count = 0;
  for (auto& [id, job] : jobs_) {
    if (job.spec.job_id().empty()) continue;
    only = &job;
    ++count;
  }
  if (count == 1) return only;
  if (count == 0) return NotFound("no job is known to this coordinator");
  return InvalidArgument("job_id: this coordinator has {} jobs; name one", count);
}

Result<CoordinatorCore::Member*> CoordinatorCore::FindMember(Job& job, uint64_t member_id, uint64_t session_id) {
  if (member_id == 0) return InvalidArgument("member_id: missing (0)");
  auto it = job.members.find(member_id);
  if (it == job.members.end()) {
    return NotFound(
        "member_id: member {} is not known in job '{}' (it left or was declared dead long ago); register "
        "again",
        member_id, job.spec.job_id());
  }
  Member& m = it->second;
  if (session_id != m.record.session_id()) {
    return FailedPrecondition("session_id: {} is not member {}'s current session; register again", session_id,
                              member_id);
  }
  if (m.record.state() == v1::MEMBER_STATE_DEAD || m.record.state() == v1::MEMBER_STATE_LEFT) {
    return FailedPrecondition("member {} is {}: {}; register again", member_id, StateName(m.record.state()),
                              m.record.detail());
  }
  return &m;
}

Result<v1::JobSpec> CoordinatorCore::ValidateSpec(const v1::JobSpec& requested) const {
  // Layers: built-in defaults, the coordinator's defaults, the request. A
  // plain MergeFrom would merge a Duration's seconds and nanos separately
  // (1 s merged with 400 ms gives 1.4 s), so durations are replaced whole.
  v1::JobSpec spec = DefaultJobSpec();
  for (const v1::JobSpec* layer : {&options_.job_defaults, &requested}) {
    v1::JobSpec merged = spec;
    merged.MergeFrom(*layer);
    if (layer->has_last_call_window()) *merged.mutable_last_call_window() = layer->last_call_window();
    if (layer->has_join_timeout()) *merged.mutable_join_timeout() = layer->join_timeout();
    if (layer->has_heartbeat_interval()) *merged.mutable_heartbeat_interval() = layer->heartbeat_interval();
    if (layer->has_heartbeat_deadline()) *merged.mutable_heartbeat_deadline() = layer->heartbeat_deadline();
    if (layer->has_stream_grace()) *merged.mutable_stream_grace() = layer->stream_grace();
    spec = std::move(merged);
  }
  TANDEM_RETURN_IF_ERROR(ValidateJobId(spec.job_id()).WithContext("job_spec"));
  if (spec.min_workers() < 1) return InvalidArgument("job_spec.min_workers: must be at least 1");
  if (spec.max_workers() < spec.min_workers()) spec.set_max_workers(spec.min_workers());
  if (spec.max_workers() > kMaxWorkers) {
    return InvalidArgument("job_spec.max_workers: {} is more than {}", spec.max_workers(), kMaxWorkers);
  }
  if (spec.max_workers() + spec.min_servers() > options_.max_members_per_job) {
    return InvalidArgument("job_spec: {} workers and {} servers exceed this coordinator's limit of {} members",
                           spec.max_workers(), spec.min_servers(), options_.max_members_per_job);
  }
  for (const auto* dim : {&spec.mesh()}) {
    if (dim->dp() > kMaxMeshDimension || dim->tp() > kMaxMeshDimension || dim->pp() > kMaxMeshDimension) {
      return InvalidArgument("job_spec.mesh: dimensions above {} are not accepted", kMaxMeshDimension);
    }
  }
  const auto check_duration = [](const google::protobuf::Duration& d, const char* name, milliseconds lo,
                                 milliseconds hi) -> Status {
    const milliseconds v = ToMs(d);
    if (v < lo || v > hi) {
      return InvalidArgument("job_spec.{}: {} is out of range {}..{}", name, FormatDuration(v), FormatDuration(lo),
                             FormatDuration(hi));
    }
    return Status::Ok();
  };
  TANDEM_RETURN_IF_ERROR(
      check_duration(spec.last_call_window(), "last_call_window", milliseconds(0), milliseconds(600000)));
  TANDEM_RETURN_IF_ERROR(
      check_duration(spec.join_timeout(), "join_timeout", milliseconds(100), milliseconds(86400000)));
  TANDEM_RETURN_IF_ERROR(
      check_duration(spec.heartbeat_interval(), "heartbeat_interval", milliseconds(10), milliseconds(60000)));
  TANDEM_RETURN_IF_ERROR(
      check_duration(spec.heartbeat_deadline(), "heartbeat_deadline", milliseconds(20), milliseconds(600000)));
  TANDEM_RETURN_IF_ERROR(check_duration(spec.stream_grace(), "stream_grace", milliseconds(0), milliseconds(600000)));
  if (ToMs(spec.heartbeat_deadline()) <= ToMs(spec.heartbeat_interval())) {
    return InvalidArgument("job_spec.heartbeat_deadline ({}) must be longer than heartbeat_interval ({})",
                           FormatDuration(ToMs(spec.heartbeat_deadline())),
                           FormatDuration(ToMs(spec.heartbeat_interval())));
  }
  if (spec.partition_size_bytes() < 4096 || spec.partition_size_bytes() % 4 != 0) {
    return InvalidArgument("job_spec.partition_size_bytes: {} must be at least 4096 and a multiple of 4",
                           spec.partition_size_bytes());
  }
  uint64_t tensor_elements = 0;
  for (const auto& t : spec.tensors()) {
    uint64_t n = 1;
    for (int64_t d : t.shape()) {
      if (d < 0 || (d > 0 && n > kMaxParameterCount / static_cast<uint64_t>(d))) {
        return InvalidArgument("job_spec.tensors['{}']: shape is negative or too large", t.name());
      }
      n *= static_cast<uint64_t>(d);
    }
    tensor_elements += n;
    if (tensor_elements > kMaxParameterCount) {
      return InvalidArgument("job_spec.tensors: more than {} parameters in all", kMaxParameterCount);
    }
  }
  if (spec.parameter_count() == 0) spec.set_parameter_count(tensor_elements);
  if (spec.parameter_count() > kMaxParameterCount) {
    return InvalidArgument("job_spec.parameter_count: {} is more than {}", spec.parameter_count(), kMaxParameterCount);
  }
  if (tensor_elements != 0 && tensor_elements != spec.parameter_count()) {
    return InvalidArgument("job_spec: parameter_count {} differs from the {} elements of the tensors",
                           spec.parameter_count(), tensor_elements);
  }
  return spec;
}

// --- membership --------------------------------------------------------------------

bool CoordinatorCore::Alive(const Member& m) {
  const auto s = m.record.state();
  return s == v1::MEMBER_STATE_JOINING || s == v1::MEMBER_STATE_ACTIVE || s == v1::MEMBER_STATE_DRAINING;
}

bool CoordinatorCore::InLatest(const Job& job, uint64_t member_id) const {
  return job.latest_index.count(member_id) > 0;
}

void CoordinatorCore::SetMemberState(Member& member, v1::MemberState state, const std::string& detail) {
  internal::Record r;
  *r.mutable_member() = member.record;
  r.mutable_member()->set_state(state);
  r.mutable_member()->set_detail(detail);
  Commit(std::move(r));
}

Status CoordinatorCore::CreateJob(const v1::JobSpec& requested) {
  TANDEM_ASSIGN_OR_RETURN(v1::JobSpec spec, ValidateSpec(requested));
  uint64_t seq = 0;
  {
    MutexLock lock(&mu_);
    if (auto it = jobs_.find(spec.job_id()); it != jobs_.end() && !it->second.spec.job_id().empty()) {
      return AlreadyExists("job '{}' exists", spec.job_id());
    }
    internal::Record r;
    *r.mutable_job() = spec;
    seq = Commit(std::move(r));
  }
  spdlog::info("job '{}': {}..{} workers, at least {} servers, mesh dp={} tp={} pp={}, {} parameters", spec.job_id(),
               spec.min_workers(), spec.max_workers(), spec.min_servers(), spec.mesh().dp(), spec.mesh().tp(),
               spec.mesh().pp(), spec.parameter_count());
  return store_->WaitDurable(seq);
}

Result<CoordinatorCore::Reply<v1::RegisterResponse>> CoordinatorCore::Register(const v1::RegisterRequest& request) {
  TANDEM_RETURN_IF_ERROR(CheckToken(request.token()));
  TANDEM_RETURN_IF_ERROR(ValidateJobId(request.job_id()));
  if (request.role() != v1::ROLE_WORKER && request.role() != v1::ROLE_SERVER) {
    return InvalidArgument("role: must be ROLE_WORKER or ROLE_SERVER");
  }
  if (request.node().hostname().empty()) return InvalidArgument("node.hostname: empty");
  if (request.node().hostname().size() > kMaxHostnameBytes || request.node().node_id().size() > kMaxHostnameBytes) {
    return InvalidArgument("node: hostname and node_id may have at most {} bytes", kMaxHostnameBytes);
  }
  if (static_cast<size_t>(request.endpoints_size()) > kMaxEndpoints) {
    return InvalidArgument("endpoints: {} given, at most {} accepted", request.endpoints_size(), kMaxEndpoints);
  }
  if (!request.control_address().empty()) {
    TANDEM_RETURN_IF_ERROR(ParseHostPort(request.control_address()).status().WithContext("control_address"));
  }
  TANDEM_RETURN_IF_ERROR(ValidateMemberName(request.member_name()));
  TANDEM_RETURN_IF_ERROR(CheckMemberVersion(request.version()));

  MutexLock lock(&mu_);
  auto it = jobs_.find(request.job_id());
  if (it == jobs_.end() || it->second.spec.job_id().empty()) {
    if (!request.has_job_spec()) {
      return NotFound("job_id: unknown job '{}', and the request carries no job_spec to create it", request.job_id());
    }
    if (!options_.allow_job_creation) {
      return PermissionDenied("job_id: unknown job '{}'; this coordinator does not create jobs on registration",
                              request.job_id());
    }
    if (request.job_spec().job_id() != request.job_id()) {
      return InvalidArgument("job_spec.job_id '{}' differs from job_id '{}'", request.job_spec().job_id(),
                             request.job_id());
    }
    TANDEM_ASSIGN_OR_RETURN(v1::JobSpec spec, ValidateSpec(request.job_spec()));
    internal::Record r;
    *r.mutable_job() = spec;
    Commit(std::move(r));
    spdlog::info("job '{}' created: {}..{} workers, {} servers at least, mesh dp={} tp={} pp={}, {} parameters",
                 spec.job_id(), spec.min_workers(), spec.max_workers(), spec.min_servers(), spec.mesh().dp(),
                 spec.mesh().tp(), spec.mesh().pp(), spec.parameter_count());
  }
  Job& job = jobs_[request.job_id()];
  const auto now = clock_->Now();

  // A member coming back (after a coordinator restart or a broken connection) keeps its id and ranks.
  if (request.resume_member_id() != 0) {
    auto m = job.members.find(request.resume_member_id());
    if (m != job.members.end() && Alive(m->second) && m->second.record.session_id() == request.resume_session_id()) {
      m->second.last_heartbeat = now;
      Reply<v1::RegisterResponse> reply;
      auto& r = reply.response;
      r.set_member_id(m->first);
      r.set_session_id(m->second.record.session_id());
      r.set_resumed(true);
      *r.mutable_heartbeat_interval() = job.spec.heartbeat_interval();
      *r.mutable_heartbeat_deadline() = job.spec.heartbeat_deadline();
      *r.mutable_stream_grace() = job.spec.stream_grace();
      *r.mutable_job_spec() = job.spec;
      r.set_coordinator_incarnation(incarnation_);
      if (job.latest.epoch() > 0) *r.mutable_current_epoch() = View(job, m->first, v1::PEER_VIEW_FULL);
      reply.durable_after = job.latest_sequence;
      return reply;
    }
  }

  // A live member of the same name and role is an earlier life of this
  // process's name: a restarted process (a newer incarnation) replaces it at
  // once; an older incarnation is a process that was itself replaced, and is
  // refused.
  const std::string host = HostKey(request.node());
  uint64_t replaced = 0;
  bool same_process = false;
  if (!request.member_name().empty()) {
    for (const auto& [id, m] : job.members) {
      if (!Alive(m) || m.record.role() != request.role() || m.record.member_name() != request.member_name()) continue;
      const uint64_t held = m.record.incarnation();
      const uint64_t incarnation = request.incarnation();
      // The same process registering again (the reply to its earlier
      // registration was lost): same incarnation, same pid, same node.
      same_process = incarnation != 0 && incarnation == held && request.pid() != 0 && request.pid() == m.record.pid() &&
                     HostKey(m.record.node()) == host;
      if (!same_process && incarnation <= held) {
        return AlreadyExists(
            "member_name '{}' is held by {} {} (incarnation {}, pid {} on {}), and this registration's incarnation {} "
            "is not newer: a newer process of this name replaced this one, or two processes were given the same "
            "name",
            request.member_name(), RoleName(m.record.role()), id, held, m.record.pid(), HostKey(m.record.node()),
            incarnation);
      }
      replaced = id;
      break;
    }
  }
  if (auto h = job.hosts.find(host);
      h != job.hosts.end() && h->second.held_out_until_unix_ms() > clock_->UnixMillis()) {
    return FailedPrecondition("host '{}' is held out after {} failures for another {:.1f} s", host,
                              h->second.failures(),
                              (h->second.held_out_until_unix_ms() - clock_->UnixMillis()) / 1000.0);
  }
  size_t alive = 0;
  size_t workers = 0;
  for (const auto& [id, m] : job.members) {
    if (!Alive(m) || id == replaced) continue;
    ++alive;
    if (m.record.role() == v1::ROLE_WORKER) ++workers;
  }
  if (alive >= options_.max_members_per_job) {
    return ResourceExhausted("job '{}' already has {} members, the most this coordinator accepts", job.spec.job_id(),
                             alive);
  }

  internal::Record r;
  auto* m = r.mutable_member();
  m->set_job_id(job.spec.job_id());
  m->set_member_id(next_member_id_);
  uint64_t session = 0;
  while (session == 0) session = random_();
  m->set_session_id(session);
  m->set_role(request.role());
  *m->mutable_node() = request.node();
  *m->mutable_endpoints() = request.endpoints();
  m->set_control_address(request.control_address());
  m->set_capacity_bytes(request.capacity_bytes());
  m->set_state(v1::MEMBER_STATE_JOINING);
  m->set_registered_unix_ms(clock_->UnixMillis());
  m->set_member_name(request.member_name());
  m->set_incarnation(request.member_name().empty() ? 0 : request.incarnation());
  m->set_pid(request.pid());
  const uint64_t member_id = m->member_id();
  uint64_t seq = Commit(std::move(r));
  Member& member = job.members[member_id];
  member.last_heartbeat = now;
  member.joined = now;
  if (!job.rendezvous_started && job.latest.epoch() == 0) job.rendezvous_started = now;
  spdlog::debug("job '{}': {} {} registered from {} ({} workers alive)", job.spec.job_id(), RoleName(request.role()),
                member_id, request.node().hostname(), workers + (request.role() == v1::ROLE_WORKER ? 1 : 0));
  if (replaced != 0) {
    // After the new member is in, so that the epoch without the old one
    // takes the new one in as well (one epoch, not two).
    const uint64_t old_incarnation = job.members.at(replaced).record.incarnation();
    std::string why;
    if (same_process) {
      spdlog::info("job '{}': {} '{}' (incarnation {}) registered again: member {} replaces its earlier member {}",
                   job.spec.job_id(), RoleName(request.role()), request.member_name(), request.incarnation(), member_id,
                   replaced);
      why = fmt::format("registered again as member {} (incarnation {} of '{}')", member_id, request.incarnation(),
                        request.member_name());
    } else {
      spdlog::info("job '{}': {} '{}' restarted: member {} (incarnation {}) replaces member {} (incarnation {})",
                   job.spec.job_id(), RoleName(request.role()), request.member_name(), member_id, request.incarnation(),
                   replaced, old_incarnation);
      why = fmt::format("replaced by incarnation {} of '{}'", request.incarnation(), request.member_name());
    }
    DeclareDead(job, {{replaced, why}}, /*replaced=*/true);
  }

  MaybeCloseRendezvous(job);
  seq = last_sequence_;
  Reply<v1::RegisterResponse> reply;
  auto& resp = reply.response;
  resp.set_member_id(member_id);
  resp.set_session_id(session);
  *resp.mutable_heartbeat_interval() = job.spec.heartbeat_interval();
  *resp.mutable_heartbeat_deadline() = job.spec.heartbeat_deadline();
  *resp.mutable_stream_grace() = job.spec.stream_grace();
  *resp.mutable_job_spec() = job.spec;
  resp.set_coordinator_incarnation(incarnation_);
  if (job.latest.epoch() > 0) *resp.mutable_current_epoch() = View(job, member_id, v1::PEER_VIEW_SELF);
  reply.durable_after = seq;
  FlushNotify();
  return reply;
}

void CoordinatorCore::MaybeCloseRendezvous(Job& job) {
  const auto now = clock_->Now();
  uint32_t joining_workers = 0;
  uint32_t workers = 0;
  uint32_t servers = 0;
  bool joining_servers = false;
  for (const auto& [id, m] : job.members) {
    if (!Alive(m) || m.record.state() == v1::MEMBER_STATE_DRAINING) continue;
    if (m.record.role() == v1::ROLE_WORKER) {
      ++workers;
      if (m.record.state() == v1::MEMBER_STATE_JOINING && !m.record.has_rank()) ++joining_workers;
    } else {
      ++servers;
      if (!InLatest(job, id)) joining_servers = true;
    }
  }
  const bool first = job.latest.epoch() == 0 || job.latest.worker_count() == 0;
  if (first) {
    if (workers < job.spec.min_workers() || servers < job.spec.min_servers()) {
      job.waiting_reason = fmt::format("waiting for members: {} of {} workers and {} of {} servers registered", workers,
                                       job.spec.min_workers(), servers, job.spec.min_servers());
      job.window_closes.reset();
      return;
    }
    if (workers >= job.spec.max_workers() || ToMs(job.spec.last_call_window()).count() == 0) {
      PublishEpoch(job, v1::EPOCH_CAUSE_INITIAL, "rendezvous complete");
      return;
    }
    if (!job.window_closes) {
      job.window_closes = now + ToMs(job.spec.last_call_window());
      job.waiting_reason = fmt::format("last call: {} workers registered; the rendezvous closes within {}", workers,
                                       FormatDuration(ToMs(job.spec.last_call_window())));
    } else if (now >= *job.window_closes) {
      PublishEpoch(job, v1::EPOCH_CAUSE_INITIAL, "rendezvous complete");
    }
    return;
  }
  // A running job admits joiners at the next epoch, batching those that come together.
  uint32_t ranked = 0;
  for (const auto& p : job.latest.peers()) {
    if (p.role() == v1::ROLE_WORKER) ++ranked;
  }
  const bool room = ranked < job.spec.max_workers();
  if ((joining_workers == 0 || !room) && !joining_servers) {
    job.window_closes.reset();
    return;
  }
  if (!job.window_closes) {
    job.window_closes = now + ToMs(job.spec.last_call_window());
  } else if (now >= *job.window_closes) {
    PublishEpoch(job, v1::EPOCH_CAUSE_JOIN, fmt::format("{} worker(s) joined", joining_workers));
  }
}

// The epoch PublishEpoch computed: its message, the placement it came from,
// and the servers in it (by member id).
struct CoordinatorCore::NextEpoch {
  v1::MembershipEpoch epoch;
  MeshPlan plan;
  std::vector<uint64_t> servers;
  bool paused = false;
  // False when the epoch would rank the same members as the latest one (the
  // caller then publishes nothing, so members do not rebuild for nothing).
  bool changed = true;
};

bool CoordinatorCore::PublishEpoch(Job& job, v1::EpochCause cause, const std::string& detail, bool pause) {
  job.window_closes.reset();
  auto next = ComputeEpoch(job, cause, detail, pause);
  if (!next.ok()) {
    job.waiting_reason = "no epoch can form: " + next.status().message();
    spdlog::warn("job '{}': {}", job.spec.job_id(), job.waiting_reason);
    return false;
  }
  if (!next->changed) {
    job.waiting_reason = next->plan.standby.empty() ? "" : "standby: " + next->plan.standby_reason;
    return true;
  }
  RecordEpoch(job, *next);
  AnnounceEpoch(job, *next, detail);
  return true;
}

namespace {

// The shard map of the next epoch: the latest one's partitions reassigned
// over `servers`, or a new map when there is none yet. Left unset when the
// map cannot be built (which is logged).
void AssignShardMap(const v1::JobSpec& spec, const v1::ShardMap& latest, const std::vector<uint64_t>& servers,
                    v1::MembershipEpoch& epoch) {
  if (spec.parameter_count() > 0 && !servers.empty()) {
    const uint64_t version = latest.version() + 1;
    if (latest.partitions_size() > 0) {
      auto change = ReassignShardMap(latest, servers, version);
      if (change.ok()) {
        *epoch.mutable_shard_map() = change->map;
        if (!change->lost.empty()) {
          spdlog::error("job '{}': {} partition(s) lost both their primary and their backup", spec.job_id(),
                        change->lost.size());
        }
      } else {
        spdlog::error("job '{}': shard map: {}", spec.job_id(), change.status().message());
      }
    } else {
      auto map = BuildShardMap(spec.parameter_count(), spec.partition_size_bytes() / 4, servers, version);
      if (map.ok()) {
        *epoch.mutable_shard_map() = *map;
      } else {
        spdlog::error("job '{}': shard map: {}", spec.job_id(), map.status().message());
      }
    }
  } else if (latest.partitions_size() > 0) {
    *epoch.mutable_shard_map() = latest;  // no live server: keep the map until one returns
  }
}

}  // namespace

Result<CoordinatorCore::NextEpoch> CoordinatorCore::ComputeEpoch(const Job& job, v1::EpochCause cause,
                                                                 const std::string& detail, bool pause) const {
  NextEpoch next;
  // Workers: survivors by their previous rank, then joiners in registration order, up to max_workers.
  std::vector<const Member*> candidates;
  for (const auto& [id, m] : job.members) {
    if (!Alive(m) || m.record.state() == v1::MEMBER_STATE_DRAINING) continue;
    if (m.record.role() == v1::ROLE_SERVER) {
      next.servers.push_back(id);
    } else {
      candidates.push_back(&m);
    }
  }
  std::stable_sort(candidates.begin(), candidates.end(), [](const Member* a, const Member* b) {
    if (a->record.has_rank() != b->record.has_rank()) return a->record.has_rank();
    if (a->record.has_rank()) return a->record.rank() < b->record.rank();
    return a->record.member_id() < b->record.member_id();
  });
  if (candidates.size() > job.spec.max_workers()) candidates.resize(job.spec.max_workers());
  std::vector<WorkerSlot> slots;
  for (const Member* m : candidates) {
    WorkerSlot slot;
    slot.member_id = m->record.member_id();
    slot.node_id = HostKey(m->record.node());
    if (m->record.has_rank()) slot.previous_rank = m->record.rank();
    slots.push_back(std::move(slot));
  }
  TANDEM_ASSIGN_OR_RETURN(next.plan, PlanMesh(std::move(slots), job.spec.mesh()));
  const MeshPlan& plan = next.plan;
  const std::vector<uint64_t>& servers = next.servers;
  next.paused = plan.ranked.size() < job.spec.min_workers() && (pause || job.latest.paused());
  // Nothing changed (for example, the only joiners do not fit the mesh and
  // stay on standby): publish nothing.
  const bool rebalance = cause == v1::EPOCH_CAUSE_REBALANCE;
  if (job.latest.epoch() > 0 && cause != v1::EPOCH_CAUSE_FAILURE && next.paused == job.latest.paused()) {
    std::set<std::pair<uint64_t, uint32_t>> before;
    std::set<std::pair<uint64_t, uint32_t>> after;
    for (const auto& p : job.latest.peers()) before.emplace(p.member_id(), p.has_rank() ? p.rank().global_rank() : ~0u);
    for (const auto& [id, rank] : plan.ranked) after.emplace(id, rank.global_rank());
    for (uint64_t id : servers) after.emplace(id, ~0u);
    // A rebalance changes the shard map and nothing else: the workers
    // push a step again after it only if the same workers are in it.
    if ((before == after) != rebalance) {
      next.changed = false;
      return next;
    }
  } else if (rebalance) {
    next.changed = false;
    return next;
  }
  v1::MembershipEpoch& epoch = next.epoch;
  epoch.set_epoch(job.latest.epoch() + 1);
  epoch.set_job_id(job.spec.job_id());
  *epoch.mutable_mesh() = plan.mesh;
  epoch.set_state(v1::EPOCH_STATE_PENDING);
  *epoch.mutable_created_time() = Timestamp(clock_->UnixMillis());
  epoch.set_start_step(job.step);
  epoch.set_cause(cause);
  epoch.set_cause_detail(detail);
  epoch.set_worker_count(static_cast<uint32_t>(plan.ranked.size()));
  epoch.set_server_count(static_cast<uint32_t>(servers.size()));
  epoch.set_paused(next.paused);
  for (const auto& [member_id, rank] : plan.ranked) {
    const Member& m = job.members.at(member_id);
    auto* peer = epoch.add_peers();
    peer->set_member_id(member_id);
    peer->set_role(v1::ROLE_WORKER);
    *peer->mutable_rank() = rank;
    *peer->mutable_node() = m.record.node();
    *peer->mutable_endpoints() = m.record.endpoints();
    peer->set_control_address(m.record.control_address());
  }
  for (uint64_t id : servers) {
    const Member& m = job.members.at(id);
    auto* peer = epoch.add_peers();
    peer->set_member_id(id);
    peer->set_role(v1::ROLE_SERVER);
    *peer->mutable_node() = m.record.node();
    *peer->mutable_endpoints() = m.record.endpoints();
    peer->set_control_address(m.record.control_address());
  }
  if (rebalance) {
    // Backups first (a server holding too little gets some), primaries once
    // every backup holds its state (MaybeRebalance).
    const v1::ShardMap& map = job.latest.shard_map();
    auto backups = RebalanceBackups(map, servers, map.version() + 1);
    if (backups.ok() && !backups->moved.empty()) {
      *epoch.mutable_shard_map() = std::move(backups->map);
      return next;
    }
    auto balanced = RebalancePrimaries(map, map.version() + 1);
    if (!balanced.ok() || balanced->swapped.empty()) {
      next.changed = false;
      return next;
    }
    *epoch.mutable_shard_map() = std::move(balanced->map);
    return next;
  }
  AssignShardMap(job.spec, job.latest.shard_map(), servers, epoch);
  return next;
}

void CoordinatorCore::MaybeRebalance(Job& job) {
  const v1::MembershipEpoch& latest = job.latest;
  if (latest.state() != v1::EPOCH_STATE_ACTIVE || latest.shard_map().partitions_size() == 0 ||
      job.window_closes.has_value()) {
    return;
  }
  // Every member of the epoch is alive and staying, every live server is in
  // it, and each reports its backups in sync in this epoch.
  for (const auto& p : latest.peers()) {
    auto it = job.members.find(p.member_id());
    if (it == job.members.end() || !Alive(it->second) || it->second.record.state() == v1::MEMBER_STATE_DRAINING) {
      return;
    }
    if (p.role() == v1::ROLE_SERVER && it->second.replicated_epoch < latest.epoch()) return;
  }
  for (const auto& [id, m] : job.members) {
    if (m.record.role() == v1::ROLE_SERVER && Alive(m) && !InLatest(job, id)) return;
  }
  // Cheap first: does a server hold 2 partitions more than another (backups
  // move), or is it primary of 2 more (swaps, or exchanges of backups that
  // make a swap possible)?
  std::unordered_map<uint64_t, uint64_t> primaries;
  std::unordered_map<uint64_t, uint64_t> holdings;
  for (const auto& p : latest.peers()) {
    if (p.role() == v1::ROLE_SERVER) primaries[p.member_id()] = holdings[p.member_id()] = 0;
  }
  for (const auto& p : latest.shard_map().partitions()) {
    ++primaries[p.primary_member_id()];
    ++holdings[p.primary_member_id()];
    if (p.backup_member_id() != 0) ++holdings[p.backup_member_id()];
  }
  const auto spread = [](const std::unordered_map<uint64_t, uint64_t>& counts) -> uint64_t {
    if (counts.empty()) return 0;
    const auto [lo, hi] = std::minmax_element(counts.begin(), counts.end(),
                                              [](const auto& a, const auto& b) { return a.second < b.second; });
    return hi->second - lo->second;
  };
  const bool backups_uneven = spread(holdings) >= 2;
  const bool primaries_uneven = spread(primaries) >= 2;
  if (!backups_uneven && !primaries_uneven) return;
  // What ComputeEpoch will do: move backups if any can move, else swap.
  std::vector<uint64_t> servers;
  for (const auto& [id, n] : holdings) servers.push_back(id);
  auto moves = RebalanceBackups(latest.shard_map(), servers, latest.shard_map().version() + 1);
  const bool move_backups = moves.ok() && !moves->moved.empty();
  std::string counts;
  for (const auto& p : latest.peers()) {
    if (p.role() != v1::ROLE_SERVER) continue;
    counts += fmt::format("{}member {}: {}", counts.empty() ? "" : ", ", p.member_id(),
                          move_backups ? holdings[p.member_id()] : primaries[p.member_id()]);
  }
  // A map the rebalance cannot improve publishes nothing: ComputeEpoch
  // finds no change.
  PublishEpoch(
      job, v1::EPOCH_CAUSE_REBALANCE,
      move_backups
          ? fmt::format("backups moved to even out the partitions each server holds (held before: {})", counts)
          : fmt::format("primaries rebalanced now that every backup holds its state (primaries before: {})", counts));
}

void CoordinatorCore::RecordEpoch(Job& job, const NextEpoch& next) {
  const MeshPlan& plan = next.plan;
  // Member records: ranks for the placed, standby for the rest.
  std::set<uint64_t> ranked_ids;
  for (const auto& [member_id, rank] : plan.ranked) {
    ranked_ids.insert(member_id);
    Member& m = job.members[member_id];
    if (m.record.state() == v1::MEMBER_STATE_ACTIVE && m.record.has_rank() && m.record.rank() == rank.global_rank()) {
      continue;
    }
    internal::Record r;
    *r.mutable_member() = m.record;
    r.mutable_member()->set_state(v1::MEMBER_STATE_ACTIVE);
    r.mutable_member()->set_rank(rank.global_rank());
    r.mutable_member()->set_has_rank(true);
    Commit(std::move(r));
  }
  for (uint64_t id : next.servers) {
    Member& m = job.members[id];
    if (m.record.state() != v1::MEMBER_STATE_ACTIVE) SetMemberState(m, v1::MEMBER_STATE_ACTIVE, "");
  }
  for (auto& [id, m] : job.members) {
    if (m.record.role() == v1::ROLE_WORKER && Alive(m) && !ranked_ids.count(id) && m.record.has_rank()) {
      internal::Record r;
      *r.mutable_member() = m.record;
      r.mutable_member()->set_has_rank(false);
      r.mutable_member()->set_state(m.record.state() == v1::MEMBER_STATE_DRAINING ? v1::MEMBER_STATE_DRAINING
                                                                                  : v1::MEMBER_STATE_JOINING);
      r.mutable_member()->set_detail(plan.standby_reason);
      Commit(std::move(r));
    }
  }
  // The epoch itself, last: Apply makes it the job's latest and queues the
  // watchers' wake-up (NotifyLater).
  internal::Record r;
  *r.mutable_epoch() = next.epoch;
  Commit(std::move(r));
  ++stats_.epochs_published;
}

void CoordinatorCore::AnnounceEpoch(Job& job, const NextEpoch& next, const std::string& detail) {
  // Members learn of the epoch through their watch streams: the caller's
  // FlushNotify wakes the watchers, which send the epoch (NextUpdate) once
  // the store is durable up to its record. Status and the log learn here.
  const v1::MembershipEpoch& epoch = next.epoch;
  const MeshPlan& plan = next.plan;
  job.waiting_reason = plan.standby.empty() ? "" : "standby: " + plan.standby_reason;
  if (next.paused) {
    job.waiting_reason = fmt::format(
        "training paused: {} of the {} workers the job needs (min_workers); waiting for "
        "joins",
        epoch.worker_count(), job.spec.min_workers());
  }
  spdlog::info(
      "job '{}': epoch {} published ({}): {} workers (dp={} tp={} pp={}), {} servers{}{}", job.spec.job_id(),
      epoch.epoch(), detail, epoch.worker_count(), epoch.mesh().dp(), epoch.mesh().tp(), epoch.mesh().pp(),
      epoch.server_count(), plan.standby.empty() ? "" : fmt::format(", {} on standby", plan.standby.size()),
      next.paused ? fmt::format("; training paused below the minimum of {} workers", job.spec.min_workers()) : "");
}

void CoordinatorCore::MaybeActivate(Job& job) {
  if (job.latest.state() != v1::EPOCH_STATE_PENDING || job.pending_acks > 0) return;
  v1::MembershipEpoch epoch = job.latest;
  epoch.set_state(v1::EPOCH_STATE_ACTIVE);
  *epoch.mutable_activated_time() = Timestamp(clock_->UnixMillis());
  internal::Record r;
  *r.mutable_epoch() = epoch;
  Commit(std::move(r));
  const auto now = clock_->Now();
  if (job.latest.epoch() == 1 && job.rendezvous_started) {
    stats_.rendezvous_seconds.push_back(std::chrono::duration<double>(now - *job.rendezvous_started).count());
    job.rendezvous_started.reset();
  }
  if (job.failure_detected) {
    stats_.failure_to_epoch_seconds.push_back(std::chrono::duration<double>(now - *job.failure_detected).count());
    job.failure_detected.reset();
  }
  spdlog::info("job '{}': epoch {} active", job.spec.job_id(), epoch.epoch());
}

void CoordinatorCore::DeclareDead(Job& job, const std::vector<std::pair<uint64_t, std::string>>& dead, bool replaced) {
  bool in_epoch = false;
  std::set<std::string> failed_hosts;
  std::string detail;
  for (const auto& [id, why] : dead) {
    auto it = job.members.find(id);
    if (it == job.members.end() || !Alive(it->second)) continue;
    Member& member = it->second;
    // A replaced member's death was logged by Register, as a restart.
    if (!replaced) {
      spdlog::warn("job '{}': {} {} on {} declared dead: {}", job.spec.job_id(), RoleName(member.record.role()), id,
                   HostKey(member.record.node()), why);
    }
    ++stats_.failures_detected;
    ++stats_.failures_by_node[{job.spec.job_id(), RoleName(member.record.role()), HostKey(member.record.node())}];
    in_epoch |= InLatest(job, id);
    // A restart that replaced its old self says nothing against the host:
    // counting it could hold the host out and refuse the very registration
    // that replaced it.
    if (!replaced) failed_hosts.insert(HostKey(member.record.node()));
    SetMemberState(member, v1::MEMBER_STATE_DEAD, why);
    if (detail.empty())
      detail = replaced ? fmt::format("member {} {}", id, why) : fmt::format("member {} failed: {}", id, why);
  }
  if (dead.size() > 1 && !detail.empty()) detail += fmt::format(" (and {} more)", dead.size() - 1);
  // Host failure history: a host that keeps failing is held out, with
  // exponential backoff. One incident counts once, however many members the
  // host had.
  const int64_t now_ms = clock_->UnixMillis();
  for (const std::string& host : failed_hosts) {
    internal::HostRecord h = job.hosts.count(host) ? job.hosts[host] : internal::HostRecord();
    if (h.last_failure_unix_ms() != 0 && now_ms - h.last_failure_unix_ms() > options_.host_failure_reset.count()) {
      h.set_failures(0);
    }
    h.set_job_id(job.spec.job_id());
    h.set_host(host);
    h.set_failures(h.failures() + 1);
    h.set_last_failure_unix_ms(now_ms);
    // host_failures_before_holdout 0: never hold a host out.
    if (options_.host_failures_before_holdout > 0 && h.failures() >= options_.host_failures_before_holdout) {
      const uint32_t exponent = std::min<uint32_t>(h.failures() - options_.host_failures_before_holdout, 20);
      const int64_t backoff =
          std::min<int64_t>(options_.host_backoff_base.count() << exponent, options_.host_backoff_max.count());
      h.set_held_out_until_unix_ms(now_ms + backoff);
      spdlog::warn("job '{}': host '{}' held out for {} after {} failures", job.spec.job_id(), host,
                   FormatDuration(milliseconds(backoff)), h.failures());
    }
    internal::Record r;
    *r.mutable_host() = h;
    Commit(std::move(r));
  }
  if (in_epoch) {
    if (!job.failure_detected) job.failure_detected = clock_->Now();
    // With no worker left the mesh cannot form; the job then waits for joiners
    // (MaybeCloseRendezvous admits them as the next epoch).
    PublishEpoch(job, v1::EPOCH_CAUSE_FAILURE, detail);
  }
}

Result<v1::HeartbeatResponse> CoordinatorCore::Heartbeat(const v1::HeartbeatRequest& request) {
  TANDEM_RETURN_IF_ERROR(CheckToken(request.token()));
  if (static_cast<size_t>(request.collectives_size()) > kMaxCollectives) {
    return InvalidArgument("collectives: {} given, at most {} accepted", request.collectives_size(), kMaxCollectives);
  }
  if (request.step_waits_size() > 64) {
    return InvalidArgument("step_waits: {} given, at most 64 accepted", request.step_waits_size());
  }
  MutexLock lock(&mu_);
  TANDEM_ASSIGN_OR_RETURN(Job * job, FindJob(request.job_id()));
  TANDEM_ASSIGN_OR_RETURN(Member * member, FindMember(*job, request.member_id(), request.session_id()));
  if (request.epoch() > job->latest.epoch()) {
    return InvalidArgument("epoch: {} is newer than the newest epoch {} of job '{}'", request.epoch(),
                           job->latest.epoch(), job->spec.job_id());
  }
  ++stats_.heartbeats;
  const auto now = clock_->Now();
  member->last_heartbeat = now;
  if (request.step() != member->last_step) member->step_changed = now;
  member->last_step = request.step();
  member->epoch_seen = request.epoch();
  member->collectives.assign(request.collectives().begin(), request.collectives().end());
  if (member->record.role() == v1::ROLE_SERVER) member->replicated_epoch = request.replicated_epoch();
  if (request.step() > job->step && now - job->step_recorded >= milliseconds(1000)) {
    internal::Record r;
    r.mutable_step()->set_job_id(job->spec.job_id());
    r.mutable_step()->set_step(request.step());
    Commit(std::move(r));
    job->step_recorded = now;
  } else {
    job->step = std::max(job->step, request.step());
  }
  if (request.step_waits_size() > 0) NoteStepWaits(*job, *member, request.step_waits());
  v1::HeartbeatResponse response;
  const bool durable = store_->durable_sequence() >= job->latest_sequence;
  response.set_latest_epoch(durable ? job->latest.epoch() : member->epoch_seen);
  response.set_active_epoch(job->latest.state() == v1::EPOCH_STATE_ACTIVE ? job->latest.epoch() : 0);
  response.set_command(member->record.state() == v1::MEMBER_STATE_DRAINING ? v1::MEMBER_COMMAND_DRAIN
                                                                           : v1::MEMBER_COMMAND_CONTINUE);
  response.set_coordinator_incarnation(incarnation_);
  return response;
}

Result<CoordinatorCore::Reply<v1::AckEpochResponse>> CoordinatorCore::AckEpoch(const v1::AckEpochRequest& request) {
  TANDEM_RETURN_IF_ERROR(CheckToken(request.token()));
  MutexLock lock(&mu_);
  TANDEM_ASSIGN_OR_RETURN(Job * job, FindJob(request.job_id()));
  TANDEM_ASSIGN_OR_RETURN(Member * member, FindMember(*job, request.member_id(), request.session_id()));
  Reply<v1::AckEpochResponse> reply;
  if (request.epoch() < job->latest.epoch()) {
    return Aborted("epoch {} was superseded by epoch {}; acknowledge that one", request.epoch(), job->latest.epoch());
  }
  if (request.epoch() > job->latest.epoch() || request.epoch() == 0) {
    return InvalidArgument("epoch: {} is not an epoch of job '{}' (newest: {})", request.epoch(), job->spec.job_id(),
                           job->latest.epoch());
  }
  if (!InLatest(*job, member->record.member_id())) {
    return FailedPrecondition("member {} is not part of epoch {} (on standby: {})", member->record.member_id(),
                              request.epoch(), member->record.detail());
  }
  if (!request.error().empty()) {
    DeclareDead(*job, {{member->record.member_id(),
                        "could not join epoch " + std::to_string(request.epoch()) + ": " + request.error()}});
    reply.durable_after = last_sequence_;
    FlushNotify();
    return Aborted("epoch {} abandoned: member {} could not join it", request.epoch(), member->record.member_id());
  }
  member->last_heartbeat = clock_->Now();
  if (job->acked.insert(member->record.member_id()).second) --job->pending_acks;
  MaybeActivate(*job);
  reply.response.set_state(job->latest.state());
  reply.response.set_pending_acks(static_cast<uint32_t>(job->pending_acks));
  reply.durable_after = last_sequence_;
  FlushNotify();
  return reply;
}

Result<CoordinatorCore::Reply<v1::LeaveResponse>> CoordinatorCore::Leave(const v1::LeaveRequest& request) {
  TANDEM_RETURN_IF_ERROR(CheckToken(request.token()));
  MutexLock lock(&mu_);
  TANDEM_ASSIGN_OR_RETURN(Job * job, FindJob(request.job_id()));
  TANDEM_ASSIGN_OR_RETURN(Member * member, FindMember(*job, request.member_id(), request.session_id()));
  const uint64_t id = member->record.member_id();
  const bool in_epoch = InLatest(*job, id);
  spdlog::info("job '{}': {} {} leaves{}{}", job->spec.job_id(), RoleName(member->record.role()), id,
               request.message().empty() ? "" : ": ", request.message());
  SetMemberState(*member, v1::MEMBER_STATE_LEFT, request.message().empty() ? "left" : "left: " + request.message());
  Reply<v1::LeaveResponse> reply;
  if (in_epoch && !PublishEpoch(*job, v1::EPOCH_CAUSE_LEAVE, fmt::format("member {} left", id))) {
    MaybeCloseRendezvous(*job);
  }
  reply.response.set_next_epoch(job->latest.epoch());
  reply.durable_after = last_sequence_;
  FlushNotify();
  return reply;
}

Status CoordinatorCore::PutEpochValue(const v1::PutEpochValueRequest& request) {
  TANDEM_RETURN_IF_ERROR(CheckToken(request.token()));
  if (request.key().empty() || request.key().size() > 256) return InvalidArgument("key: 1..256 bytes");
  if (request.value().size() > kMaxValueBytes) {
    return InvalidArgument("value: {} bytes, at most {} accepted", request.value().size(), kMaxValueBytes);
  }
  MutexLock lock(&mu_);
  TANDEM_ASSIGN_OR_RETURN(Job * job, FindJob(request.job_id()));
  TANDEM_RETURN_IF_ERROR(FindMember(*job, request.member_id(), request.session_id()).status());
  if (request.epoch() != job->latest.epoch()) {
    return Aborted("epoch {} is not the current epoch {}", request.epoch(), job->latest.epoch());
  }
  auto it = job->values.find(request.key());
  if (it != job->values.end()) {
    if (it->second == request.value()) return Status::Ok();
    return AlreadyExists("key '{}' already has a different value in epoch {}", request.key(), request.epoch());
  }
  if (job->values.size() >= kMaxValues)
    return ResourceExhausted("epoch {} already has {} values", request.epoch(), kMaxValues);
  job->values[request.key()] = request.value();
  NotifyLater(false);
  FlushNotify();
  return Status::Ok();
}

Result<v1::GetEpochValuesResponse> CoordinatorCore::GetEpochValues(const v1::GetEpochValuesRequest& request) {
  TANDEM_RETURN_IF_ERROR(CheckToken(request.token()));
  if (static_cast<size_t>(request.keys_size()) > kMaxValues) return InvalidArgument("keys: at most {}", kMaxValues);
  MutexLock lock(&mu_);
  TANDEM_ASSIGN_OR_RETURN(Job * job, FindJob(request.job_id()));
  TANDEM_RETURN_IF_ERROR(FindMember(*job, request.member_id(), request.session_id()).status());
  if (request.epoch() != job->latest.epoch()) {
    return Aborted("epoch {} is not the current epoch {}", request.epoch(), job->latest.epoch());
  }
  v1::GetEpochValuesResponse response;
  for (const auto& key : request.keys()) {
    auto it = job->values.find(key);
    if (it == job->values.end()) {
      response.add_missing_keys(key);
    } else {
      (*response.mutable_values())[key] = it->second;
    }
  }
  return response;
}

// --- watch streams: coordinator_watch.cc ----------------------------------------------------

// --- timers ----------------------------------------------------------------------------------

void CoordinatorCore::Tick() {
  MutexLock lock(&mu_);
  const auto now = clock_->Now();
  // If the coordinator itself stalled (the machine was overloaded, the process
  // was stopped), members could not be heard meanwhile: do not blame them.
  if (last_tick_ && now - *last_tick_ > options_.stall_threshold) {
    const auto stall = now - *last_tick_;
    spdlog::warn("the coordinator did not run its timers for {}; extending every member's deadline by as much",
                 FormatDuration(std::chrono::duration_cast<milliseconds>(stall)));
    for (auto& [id, job] : jobs_) {
      for (auto& [mid, m] : job.members) {
        m.last_heartbeat += stall;
        if (m.stream_broken) m.stream_broken_at += stall;
      }
    }
  }
  last_tick_ = now;
  for (auto& [job_id, job] : jobs_) {
    if (job.spec.job_id().empty()) continue;
    const auto deadline = ToMs(job.spec.heartbeat_deadline());
    const auto grace = ToMs(job.spec.stream_grace());
    const auto join_timeout = ToMs(job.spec.join_timeout());
    std::vector<std::pair<uint64_t, std::string>> dead;
    std::vector<uint64_t> timed_out;
    for (auto& [id, m] : job.members) {
      if (!Alive(m)) continue;
      if (now - m.last_heartbeat > deadline) {
        dead.emplace_back(
            id, fmt::format("no heartbeat for {}",
                            FormatDuration(std::chrono::duration_cast<milliseconds>(now - m.last_heartbeat))));
      } else if (m.stream_broken && now - m.stream_broken_at > grace) {
        dead.emplace_back(
            id, fmt::format("its membership stream broke and did not come back within {}", FormatDuration(grace)));
      } else if (job.latest.epoch() == 0 && m.record.state() == v1::MEMBER_STATE_JOINING &&
                 now - m.joined > join_timeout) {
        timed_out.push_back(id);
      }
    }
    if (!dead.empty()) DeclareDead(job, dead);
    if (!timed_out.empty()) {
      const std::string why =
          fmt::format("rendezvous did not complete within {}: {}", FormatDuration(join_timeout), job.waiting_reason);
      for (uint64_t id : timed_out) {
        auto it = job.members.find(id);
        if (it != job.members.end()) SetMemberState(it->second, v1::MEMBER_STATE_LEFT, why);
      }
      spdlog::warn("job '{}': {} member(s) gave up: {}", job_id, timed_out.size(), why);
    }
    MaybeCloseRendezvous(job);
    MaybeRebalance(job);
    // Members that left or died are remembered for a while (so they learn
    // why, and `tandem status` shows them), then forgotten.
    size_t gone = 0;
    for (const auto& [id, m] : job.members) gone += Alive(m) ? 0 : 1;
    for (auto it = job.members.begin(); it != job.members.end();) {
      const bool old = now - it->second.last_heartbeat > kForgetAfter || gone > kMaxRemembered;
      if (!Alive(it->second) && !InLatest(job, it->first) && old) {
        it = job.members.erase(it);
        --gone;
      } else {
        ++it;
      }
    }
  }
  auto snapshot = PrepareSnapshot();
  FlushNotify();
  if (snapshot) {
    lock.Unlock();
    WriteSnapshot(snapshot->first, std::move(snapshot->second));
  }
}

// --- admin (GetStatus and TakeStats: coordinator_status.cc) ------------------------------------

Result<CoordinatorCore::Reply<v1::DrainResponse>> CoordinatorCore::Drain(const v1::DrainRequest& request) {
  TANDEM_RETURN_IF_ERROR(CheckToken(request.token()));
  MutexLock lock(&mu_);
  TANDEM_ASSIGN_OR_RETURN(Job * job, FindAdminJob(request.job_id()));
  auto it = job->members.find(request.member_id());
  if (it == job->members.end() || !Alive(it->second)) {
    return NotFound("member_id: no live member {} in job '{}'", request.member_id(), job->spec.job_id());
  }
  Reply<v1::DrainResponse> reply;
  if (it->second.record.state() != v1::MEMBER_STATE_DRAINING) {
    const bool in_epoch = InLatest(*job, request.member_id());
    SetMemberState(it->second, v1::MEMBER_STATE_DRAINING,
                   request.reason().empty() ? "drained by an administrator" : "drained: " + request.reason());
    if (in_epoch) PublishEpoch(*job, v1::EPOCH_CAUSE_ADMIN, fmt::format("member {} drained", request.member_id()));
  }
  reply.response.set_state(v1::MEMBER_STATE_DRAINING);
  reply.durable_after = last_sequence_;
  FlushNotify();
  return reply;
}

Result<CoordinatorCore::Reply<v1::ScaleResponse>> CoordinatorCore::Scale(const v1::ScaleRequest& request) {
  TANDEM_RETURN_IF_ERROR(CheckToken(request.token()));
  MutexLock lock(&mu_);
  TANDEM_ASSIGN_OR_RETURN(Job * job, FindAdminJob(request.job_id()));
  v1::JobSpec wanted = job->spec;
  if (request.min_workers() != 0) wanted.set_min_workers(request.min_workers());
  if (request.max_workers() != 0) wanted.set_max_workers(request.max_workers());
  if (wanted.max_workers() < wanted.min_workers()) {
    return InvalidArgument("max_workers ({}) is below min_workers ({})", wanted.max_workers(), wanted.min_workers());
  }
  TANDEM_ASSIGN_OR_RETURN(v1::JobSpec spec, ValidateSpec(wanted));
  internal::Record r;
  *r.mutable_job() = spec;
  Commit(std::move(r));
  Reply<v1::ScaleResponse> reply;
  // Too many workers: drain the highest ranks.
  std::vector<std::pair<uint32_t, uint64_t>> ranked;
  for (const auto& p : job->latest.peers()) {
    if (p.role() == v1::ROLE_WORKER) ranked.emplace_back(p.rank().global_rank(), p.member_id());
  }
  std::sort(ranked.rbegin(), ranked.rend());
  uint32_t workers = static_cast<uint32_t>(ranked.size());
  for (const auto& [rank, id] : ranked) {
    if (workers <= spec.max_workers()) break;
    auto m = job->members.find(id);
    if (m == job->members.end() || !Alive(m->second)) continue;
    SetMemberState(m->second, v1::MEMBER_STATE_DRAINING, "drained to scale down");
    reply.response.add_drained_member_ids(id);
    --workers;
  }
  const bool running = job->latest.epoch() > 0 && job->latest.worker_count() > 0;
  if (reply.response.drained_member_ids_size() > 0) {
    PublishEpoch(*job, v1::EPOCH_CAUSE_ADMIN, fmt::format("scaled to at most {} workers", spec.max_workers()));
  } else if (running && workers < spec.min_workers() && !job->latest.paused()) {
    // Below the new minimum: training pauses until joins bring the count up.
    PublishEpoch(*job, v1::EPOCH_CAUSE_ADMIN,
                 fmt::format("scaled to at least {} workers; {} in the job", spec.min_workers(), workers),
                 /*pause=*/true);
  } else if (running && workers >= spec.min_workers() && job->latest.paused()) {
    PublishEpoch(*job, v1::EPOCH_CAUSE_ADMIN,
                 fmt::format("scaled to at least {} workers: training resumes", spec.min_workers()));
  }
  MaybeCloseRendezvous(*job);
  spdlog::info("job '{}': scaled to {}..{} workers", job->spec.job_id(), spec.min_workers(), spec.max_workers());
  *reply.response.mutable_job_spec() = job->spec;
  reply.response.set_workers(workers);
  reply.durable_after = last_sequence_;
  FlushNotify();
  return reply;
}

uint64_t CoordinatorCore::epoch_sequence() const {
  MutexLock lock(&mu_);
  uint64_t seq = 0;
  for (const auto& [id, job] : jobs_) seq = std::max(seq, job.latest_sequence);
  return seq;
}

}  // namespace tandem::coordinator
