#include "common/member_session.h"

#include <unistd.h>

#include <google/protobuf/util/time_util.h>
#include <spdlog/spdlog.h>

#include "tandem/config.h"

namespace tandem {
namespace {

using google::protobuf::util::TimeUtil;

// The coordinator no longer knows this member (or buried it): register anew.
bool Forgotten(const grpc::Status& s) {
  return s.error_code() == grpc::StatusCode::NOT_FOUND || s.error_code() == grpc::StatusCode::FAILED_PRECONDITION;
}

}  // namespace

MemberSession::MemberSession(std::shared_ptr<grpc::Channel> channel, MemberSessionOptions options)
    : channel_(std::move(channel)), stub_(v1::Coordinator::NewStub(channel_)), options_(std::move(options)) {
  session_thread_ = std::thread([this] { Run(); });
  heartbeat_thread_ = std::thread([this] { HeartbeatLoop(); });
}

MemberSession::~MemberSession() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
    if (watch_context_ != nullptr) watch_context_->TryCancel();
  }
  cv_.NotifyAll();
  session_thread_.join();
  heartbeat_thread_.join();
}

uint64_t MemberSession::member_id() const {
  MutexLock lock(&mu_);
  return member_id_;
}

uint64_t MemberSession::session_id() const {
  MutexLock lock(&mu_);
  return session_id_;
}

uint64_t MemberSession::epoch() const {
  MutexLock lock(&mu_);
  return epoch_.epoch();
}

std::optional<v1::RankAssignment> MemberSession::rank() const {
  MutexLock lock(&mu_);
  return rank_;
}

bool MemberSession::WaitActive(std::chrono::milliseconds timeout) {
  MutexLock lock(&mu_);
  return cv_.WaitFor(lock, timeout, [this]() TANDEM_REQUIRES(mu_) { return active_ || stop_; }) && active_;
}

bool MemberSession::Sleep(std::chrono::milliseconds d) {
  MutexLock lock(&mu_);
  return !cv_.WaitFor(lock, d, [this]() TANDEM_REQUIRES(mu_) { return stop_; });
}

void MemberSession::SetConnected(bool connected, const std::string& detail) {
  if (connected_.exchange(connected) == connected) return;
  if (options_.on_connection) options_.on_connection(connected, detail);
}

bool MemberSession::RegisterOnce(std::string* error, bool* fenced) {
  v1::RegisterRequest request;
  request.set_job_id(options_.job_id);
  request.set_token(options_.token);
  request.set_role(options_.role);
  *request.mutable_node() = options_.node;
  for (const auto& e : options_.endpoints) *request.add_endpoints() = e;
  request.set_control_address(options_.control_address);
  request.set_capacity_bytes(options_.capacity_bytes);
  request.set_version(TANDEM_VERSION);
  request.set_pid(static_cast<uint32_t>(getpid()));
  request.set_member_name(options_.member_name);
  request.set_incarnation(options_.incarnation);
  {
    MutexLock lock(&mu_);
    if (!reregister_) {
      request.set_resume_member_id(member_id_);
      request.set_resume_session_id(session_id_);
    }
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::RegisterResponse response;
  const grpc::Status s = stub_->Register(&ctx, request, &response);
  if (!s.ok()) {
    *error = Status::FromGrpc(s).ToString();
    // ALREADY_EXISTS: a live member of a newer incarnation holds this name.
    *fenced = s.error_code() == grpc::StatusCode::ALREADY_EXISTS && !options_.member_name.empty();
    return false;
  }
  MutexLock lock(&mu_);
  const bool resumed = response.resumed();
  if (!resumed) {
    epoch_.Clear();
    rank_.reset();
    in_epoch_ = false;
    active_ = false;
  }
  if (incarnation_ != 0 && response.coordinator_incarnation() != incarnation_ && resumed) ++reattachments_;
  member_id_ = response.member_id();
  session_id_ = response.session_id();
  incarnation_ = response.coordinator_incarnation();
  heartbeat_interval_ = std::chrono::milliseconds(TimeUtil::DurationToMilliseconds(response.heartbeat_interval()));
  reregister_ = false;
  spdlog::info("{} coordinator as member {} of job '{}'{}", resumed ? "re-attached to the" : "registered with the",
               member_id_, options_.job_id,
               options_.member_name.empty()
                   ? ""
                   : fmt::format(" ('{}', incarnation {})", options_.member_name, options_.incarnation));
  return true;
}

void MemberSession::Run() {
  auto backoff = options_.retry_min;
  bool registered = false;
  while (true) {
    {
      MutexLock lock(&mu_);
      if (stop_) return;
      if (reregister_) registered = false;
    }
    if (!registered) {
      std::string error;
      bool fenced = false;
      if (!RegisterOnce(&error, &fenced)) {
        if (fenced) {
          // Replaced by a newer process of the same name: retrying cannot
          // succeed, and the coordinator has buried this member already.
          spdlog::error("a newer incarnation of '{}' replaced this process; it stops taking part in job '{}': {}",
                        options_.member_name, options_.job_id, error);
          {
            MutexLock lock(&mu_);
            stop_ = true;
            left_ = true;
            member_id_ = 0;
            session_id_ = 0;
          }
          cv_.NotifyAll();
          fenced_ = true;
          // Not "unreachable, waiting for it" (on_connection): on_fenced says what happened.
          connected_ = false;
          if (options_.on_fenced) options_.on_fenced(error);
          return;
        }
        SetConnected(false, error);
        if (!Sleep(backoff)) return;
        backoff = std::min(backoff * 2, options_.retry_max);
        continue;
      }
      registered = true;
    }
    backoff = options_.retry_min;
    WatchOnce();  // returns when the stream ends
    {
      MutexLock lock(&mu_);
      if (stop_) return;
    }
    if (!Sleep(options_.retry_min)) return;
    // The stream broke: re-attach (Register with resume keeps id and ranks).
    registered = false;
  }
}

void MemberSession::WatchOnce() {
  grpc::ClientContext ctx;
  v1::WatchMembershipRequest request;
  {
    MutexLock lock(&mu_);
    if (stop_) return;
    request.set_job_id(options_.job_id);
    request.set_member_id(member_id_);
    request.set_session_id(session_id_);
    request.set_token(options_.token);
    request.set_last_epoch_seen(epoch_.epoch());
    // The peers on this member's node and the servers: what a member needs
    // today, and O(node) per member instead of O(job) for large jobs.
    request.set_peer_view(options_.peer_view);
    watch_context_ = &ctx;
  }
  auto reader = stub_->WatchMembership(&ctx, request);
  SetConnected(true, "");
  v1::WatchMembershipResponse update;
  while (reader->Read(&update)) {
    if (update.has_epoch()) {
      HandleEpoch(update.epoch());
    } else if (update.has_state_change()) {
      const auto& change = update.state_change();
      bool ack_again = false;
      {
        MutexLock lock(&mu_);
        if (change.epoch() == epoch_.epoch()) {
          epoch_.set_state(change.state());
          if (change.state() == v1::EPOCH_STATE_ACTIVE && in_epoch_) {
            active_ = true;
            cv_.NotifyAll();
          }
          // A coordinator that restarted while the epoch was pending lost the
          // acknowledgements: acknowledge again.
          ack_again = change.state() == v1::EPOCH_STATE_PENDING;
        }
      }
      if (change.state() == v1::EPOCH_STATE_ACTIVE) spdlog::info("epoch {} is active", change.epoch());
      if (ack_again) Ack(change.epoch(), "");
    }
  }
  const grpc::Status s = reader->Finish();
  {
    MutexLock lock(&mu_);
    watch_context_ = nullptr;
    if (stop_ || left_) return;  // leaving: the refusals that follow are expected
    if (Forgotten(s)) reregister_ = true;
  }
  if (Forgotten(s)) {
    spdlog::warn("the coordinator ended this member: {}; registering again", s.error_message());
  } else {
    SetConnected(false, Status::FromGrpc(s).ToString());
    spdlog::warn("membership stream ended ({}); re-attaching", Status::FromGrpc(s).ToString());
  }
}

void MemberSession::HandleEpoch(const v1::MembershipEpoch& epoch) {
  uint64_t my_id = 0;
  {
    MutexLock lock(&mu_);
    my_id = member_id_;
  }
  const v1::Peer* me = nullptr;
  for (const auto& p : epoch.peers()) {
    if (p.member_id() == my_id) me = &p;
  }
  {
    MutexLock lock(&mu_);
    epoch_ = epoch;
    in_epoch_ = me != nullptr;
    rank_.reset();
    if (me != nullptr && me->has_rank()) rank_ = me->rank();
    active_ = me != nullptr && epoch.state() == v1::EPOCH_STATE_ACTIVE;
    if (active_) cv_.NotifyAll();
  }
  if (me == nullptr) {
    spdlog::info("epoch {}: this member is on standby", epoch.epoch());
    return;
  }
  if (me->has_rank()) {
    spdlog::info("epoch {}: rank {} of {} (node {}, local rank {}), mesh dp={} tp={} pp={}", epoch.epoch(),
                 me->rank().global_rank(), me->rank().world_size(), me->rank().node_rank(), me->rank().local_rank(),
                 epoch.mesh().dp(), epoch.mesh().tp(), epoch.mesh().pp());
  } else {
    spdlog::info("epoch {}: {} workers, {} servers", epoch.epoch(), epoch.worker_count(), epoch.server_count());
  }
  Status joined = options_.on_epoch ? options_.on_epoch(epoch) : Status::Ok();
  Ack(epoch.epoch(), joined.ok() ? "" : joined.message());
}

void MemberSession::Ack(uint64_t epoch, const std::string& error) {
  v1::AckEpochRequest request;
  {
    MutexLock lock(&mu_);
    if (left_) return;  // out of the job: nothing to acknowledge
    request.set_job_id(options_.job_id);
    request.set_member_id(member_id_);
    request.set_session_id(session_id_);
  }
  request.set_token(options_.token);
  request.set_epoch(epoch);
  request.set_error(error);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::AckEpochResponse response;
  const grpc::Status s = stub_->AckEpoch(&ctx, request, &response);
  if (!s.ok() && s.error_code() != grpc::StatusCode::ABORTED) {
    spdlog::warn("acknowledging epoch {} failed: {}", epoch, Status::FromGrpc(s).ToString());
  }
}

void MemberSession::HeartbeatLoop() {
  while (true) {
    std::chrono::milliseconds interval{1000};
    v1::HeartbeatRequest request;
    {
      MutexLock lock(&mu_);
      if (stop_) return;
      interval = heartbeat_interval_;
      request.set_job_id(options_.job_id);
      request.set_member_id(member_id_);
      request.set_session_id(session_id_);
      request.set_epoch(epoch_.epoch());
    }
    if (request.member_id() != 0) {
      request.set_token(options_.token);
      request.set_step(step_);
      if (options_.replicated_epoch) request.set_replicated_epoch(options_.replicated_epoch());
      for (auto& w : step_waits_.Take()) *request.add_step_waits() = std::move(w);
      if (options_.collective_progress) {
        constexpr size_t kMaxCollectives = 64;  // HeartbeatRequest.collectives
        for (auto& c : options_.collective_progress()) {
          if (static_cast<size_t>(request.collectives_size()) == kMaxCollectives) break;
          *request.add_collectives() = std::move(c);
        }
      }
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + interval);
      v1::HeartbeatResponse response;
      const grpc::Status s = stub_->Heartbeat(&ctx, request, &response);
      if (s.ok()) {
        if (response.latest_epoch() > request.epoch() && request.epoch() != 0 && options_.on_newer_epoch) {
          options_.on_newer_epoch(response.latest_epoch());
        }
        if (response.command() == v1::MEMBER_COMMAND_DRAIN) {
          // Drained by an administrator: it is already out of the epochs; leave the job and stop.
          drained_ = true;
          if (options_.on_drain) options_.on_drain();
          const Status left = Leave("drained", std::chrono::milliseconds(5000));
          spdlog::warn("drained: left the job ({}); this process stays up but takes no part until restarted",
                       left.ok() ? "OK" : left.ToString());
          SetConnected(false, "drained");
          return;
        }
      } else if (Forgotten(s)) {
        MutexLock lock(&mu_);
        // Only if the refusal is about the current session: a heartbeat sent
        // just before a fresh registration must not undo it.
        if (!reregister_ && !left_ && session_id_ == request.session_id()) {
          spdlog::warn("heartbeat refused: {}; registering again", s.error_message());
          reregister_ = true;
          if (watch_context_ != nullptr) watch_context_->TryCancel();
        }
      }
    }
    if (!Sleep(interval)) return;
  }
}

Status MemberSession::Leave(const std::string& message, std::chrono::milliseconds timeout) {
  v1::LeaveRequest request;
  {
    MutexLock lock(&mu_);
    if (left_) return Status::Ok();
    if (member_id_ == 0) return FailedPrecondition("not registered");
    left_ = true;
    request.set_job_id(options_.job_id);
    request.set_member_id(member_id_);
    request.set_session_id(session_id_);
  }
  request.set_token(options_.token);
  request.set_reason(v1::LEAVE_REASON_SHUTDOWN);
  request.set_message(message);
  request.set_step(step_);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  v1::LeaveResponse response;
  const grpc::Status s = stub_->Leave(&ctx, request, &response);
  {
    MutexLock lock(&mu_);
    stop_ = true;
    if (watch_context_ != nullptr) watch_context_->TryCancel();
  }
  cv_.NotifyAll();
  return Status::FromGrpc(s);
}

std::optional<uint32_t> ServerRank(const v1::MembershipEpoch& epoch, uint64_t member_id) {
  bool found = false;
  uint32_t below = 0;
  for (const auto& p : epoch.peers()) {
    if (p.role() != v1::ROLE_SERVER) continue;
    if (p.member_id() == member_id) found = true;
    if (p.member_id() < member_id) ++below;
  }
  if (!found) return std::nullopt;
  return below;
}

}  // namespace tandem
