// The fixture of the coordinator core's tests (coordinator_core_test.cc and
// the files beside it): a core on a fake clock and an in-memory store, and
// members that join, heartbeat and acknowledge epochs.
#pragma once

#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include <google/protobuf/util/time_util.h>
#include <gtest/gtest.h>

#include "common/member_session.h"
#include "coordinator/coordinator_core.h"
#include "test_util.h"

namespace tandem::coordinator::core_test {

using google::protobuf::util::TimeUtil;
using std::chrono::milliseconds;

// A member as the tests hold it.
struct M {
  uint64_t id = 0;
  uint64_t session = 0;
};

class CoreTest : public ::testing::Test {
 protected:
  void Open(CoreOptions options = {}) {
    // The fake clock jumps seconds between ticks on purpose: not a stall.
    options.stall_threshold = std::chrono::hours(24);
    core_.reset();
    store_ = std::make_unique<MemoryStore>(backing_);
    core_ = std::make_unique<CoordinatorCore>(options, store_.get(), &clock_);
    ASSERT_TRUE(core_->Recover().ok());
  }

  static v1::JobSpec Spec(uint32_t min_workers, uint32_t max_workers, uint32_t min_servers = 0) {
    v1::JobSpec spec;
    spec.set_job_id("j");
    spec.set_min_workers(min_workers);
    spec.set_max_workers(max_workers);
    spec.set_min_servers(min_servers);
    *spec.mutable_last_call_window() = TimeUtil::MillisecondsToDuration(500);
    *spec.mutable_join_timeout() = TimeUtil::MillisecondsToDuration(10000);
    return spec;
  }

  Result<M> TryJoin(const std::string& node, v1::Role role = v1::ROLE_WORKER, const std::string& token = "") {
    v1::RegisterRequest r;
    r.set_job_id("j");
    r.set_role(role);
    r.mutable_node()->set_hostname(node);
    r.mutable_node()->set_node_id(node);
    r.set_token(token);
    auto reply = core_->Register(r);
    if (!reply.ok()) return reply.status();
    return M{reply->response.member_id(), reply->response.session_id()};
  }

  // A registration under a member name (RegisterRequest.member_name) with its incarnation and pid.
  Result<M> TryJoinAs(const std::string& node, const std::string& name, uint64_t incarnation, uint32_t pid,
                      v1::Role role = v1::ROLE_WORKER) {
    v1::RegisterRequest r;
    r.set_job_id("j");
    r.set_role(role);
    r.mutable_node()->set_hostname(node);
    r.mutable_node()->set_node_id(node);
    r.set_member_name(name);
    r.set_incarnation(incarnation);
    r.set_pid(pid);
    auto reply = core_->Register(r);
    if (!reply.ok()) return reply.status();
    const M m{reply->response.member_id(), reply->response.session_id()};
    members_.push_back(m);
    return m;
  }

  const v1::MemberStatus* FindStatus(const v1::GetStatusResponse& s, uint64_t id) {
    for (const auto& m : s.members()) {
      if (m.member_id() == id) return &m;
    }
    return nullptr;
  }

  M Join(const std::string& node, v1::Role role = v1::ROLE_WORKER) {
    auto m = TryJoin(node, role);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    if (m.ok()) members_.push_back(*m);
    return m.ok() ? *m : M{};
  }

  void Tick(milliseconds d) {
    clock_.Advance(d);
    for (const M& m : members_) (void)Beat(m);
    core_->Tick();
  }

  // Moves time without heartbeats from `silent` members.
  void TickWithout(milliseconds d, const std::vector<uint64_t>& silent) {
    clock_.Advance(d);
    for (const M& m : members_) {
      if (std::find(silent.begin(), silent.end(), m.id) == silent.end()) (void)Beat(m);
    }
    core_->Tick();
  }

  // Server `server` (named `name`) misses its heartbeat deadline, the epoch
  // without it is acknowledged, and it registers again; returns it once the
  // join window closed (the join epoch published, not acknowledged).
  M RestartServer(const M& server, const std::string& name, const M& worker) {
    TickWithout(milliseconds(3100), {server.id});
    AckAll(Latest(worker));
    const M back = Join(name, v1::ROLE_SERVER);
    Tick(milliseconds(600));
    return back;
  }

  Status Beat(const M& m, uint64_t step = 0) {
    v1::HeartbeatRequest r;
    r.set_job_id("j");
    r.set_member_id(m.id);
    r.set_session_id(m.session);
    r.set_step(step);
    if (auto it = replicated_.find(m.id); it != replicated_.end()) r.set_replicated_epoch(it->second);
    return core_->Heartbeat(r).status();
  }

  v1::GetStatusResponse Status_() {
    v1::GetStatusRequest r;
    r.set_job_id("j");
    auto s = core_->GetStatus(r);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? *s : v1::GetStatusResponse();
  }

  // The newest epoch as member `m` would receive it.
  v1::MembershipEpoch Latest(const M& m) {
    v1::WatchMembershipRequest r;
    r.set_job_id("j");
    r.set_member_id(m.id);
    r.set_session_id(m.session);
    WatchPosition pos;
    auto u = core_->NextUpdate(r, pos);
    if (!u.ok() || !u->has_value()) return v1::MembershipEpoch();
    return (*u)->epoch();
  }

  Status Ack(const M& m, uint64_t epoch) {
    v1::AckEpochRequest r;
    r.set_job_id("j");
    r.set_member_id(m.id);
    r.set_session_id(m.session);
    r.set_epoch(epoch);
    return core_->AckEpoch(r).status();
  }

  void AckAll(const v1::MembershipEpoch& epoch) {
    for (const auto& p : epoch.peers()) {
      for (const M& m : members_) {
        if (m.id == p.member_id()) {
          EXPECT_TRUE(Ack(m, epoch.epoch()).ok());
        }
      }
    }
  }

  std::map<uint64_t, uint32_t> Ranks(const v1::MembershipEpoch& e) {
    std::map<uint64_t, uint32_t> out;
    for (const auto& p : e.peers()) {
      if (p.has_rank()) out[p.member_id()] = p.rank().global_rank();
    }
    return out;
  }

  FakeClock clock_;
  std::shared_ptr<MemoryStoreBacking> backing_ = std::make_shared<MemoryStoreBacking>();
  std::unique_ptr<MemoryStore> store_;
  std::unique_ptr<CoordinatorCore> core_;
  std::vector<M> members_;
  // HeartbeatRequest.replicated_epoch each member reports (absent: 0).
  std::map<uint64_t, uint64_t> replicated_;
};

}  // namespace tandem::coordinator::core_test
