// Peer death: UCX's endpoint errors and goodbyes (handled after each round
// of progress), the pid check of peers on this host every liveness_interval,
// and FailPeer, which fails every operation with a dead peer.
#include <sys/types.h>

#include "common/logging.h"
#include "common/proc_stat.h"
#include "common/transport/ucx/core.h"

namespace tandem::transport::ucx {
namespace {

// Why process `pid` (started at `start_ticks`) is no longer the peer, or empty
// while it is alive.
std::string ProcessGone(uint32_t pid, uint64_t start_ticks, const std::string& host) {
  const std::string why = tandem::ProcessGone(static_cast<pid_t>(pid), start_ticks);
  return why.empty() ? "" : fmt::format("its process {} on {} {}", pid, host, why);
}

}  // namespace

void Core::OnEndpointError(int rank, ucs_status_t status) {
  failures_.emplace_back(rank, fmt::format("UCX reported '{}' on its endpoint", ucs_status_string(status)));
}

void Core::HandleFailures() {
  while (!failures_.empty()) {
    auto [rank, reason] = std::move(failures_.front());
    failures_.pop_front();
    const Peer& p = *peers_[static_cast<size_t>(rank)];
    if (reason != kClosedReason && p.pid_check && p.id.pid != self_.pid) {
      // A connection that broke on this host: say why if the process is gone.
      if (const std::string why = ProcessGone(p.id.pid, p.id.start_ticks, p.id.hostname); !why.empty()) {
        reason = fmt::format("{} ({})", why, reason);
      }
    }
    FailPeer(rank, reason);
  }
}

void Core::FailPeer(int rank, const std::string& reason) {
  Peer& p = *peers_[static_cast<size_t>(rank)];
  {
    MutexLock lock(&mu_);
    if (p.dead) return;
    p.dead = true;
    p.reason = reason;
  }
  if (stopping_.load()) {
  } else if (reason == kClosedReason) {
    spdlog::info("ucx: rank {} -> rank {}: {}", rank_.load(), rank, reason);
  } else {
    spdlog::warn("ucx: rank {} lost rank {}: {}", rank_.load(), rank, reason);
  }
  // Deliver what the peer sent before it went away; after this nothing more can
  // arrive from it.
  Drain();
  std::vector<std::shared_ptr<Op>> ops;
  for (const auto& [raw, op] : inflight_) {
    if (op->peer == rank) ops.push_back(op);
  }
  for (const auto& op : ops) {
    if (op->kind == Op::Kind::kRecv && op->request != nullptr) ucp_request_cancel(p.worker, op->request);
  }
  if (!p.shm && p.ep != nullptr) CloseEndpoint(p, /*force=*/true);  // releases its sends
  for (const auto& op : ops) {
    if (op->polled) {
      op->polled = false;
      --polled_sends_;
    }
    Finish(*op, GoneStatus(*op, reason));
  }
}

void Core::CloseEndpoint(Peer& p, bool force) {
  ucp_request_param_t param{};
  if (force) {
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  }
  void* request = ucp_ep_close_nbx(p.ep, &param);
  p.ep = nullptr;
  if (request != nullptr && !IsUcsError(request)) closing_.push_back(request);
}

void Core::CheckPeers() {
  for (auto& p : peers_) {
    if (!p || !p->pid_check || p->id.pid == self_.pid) continue;  // ranks in this process live as long as it does
    {
      MutexLock lock(&mu_);
      if (p->dead) continue;
    }
    const std::string why = ProcessGone(p->id.pid, p->id.start_ticks, p->id.hostname);
    if (!why.empty()) FailPeer(p->rank, why);
  }
}

}  // namespace tandem::transport::ucx
