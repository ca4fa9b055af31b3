// Connect: the peers' addresses decide how each is reached, then the
// endpoints, the handshake with every peer and the start-up self-check.
#include <algorithm>
#include <future>

#include "common/logging.h"
#include "common/transport/ucx/core.h"
#include "common/transport/ucx/endpoint_info.h"

namespace tandem::transport::ucx {
namespace {

using std::chrono::milliseconds;

void OnEpError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* a = static_cast<Peer::ErrorArg*>(arg);
  a->core->AssertRoleHeld();
  a->core->OnEndpointError(a->rank, status);
}

}  // namespace

template <typename F>
auto Core::OnProgressThread(F&& fn) -> decltype(fn()) {
  using R = decltype(fn());
  auto task = std::make_shared<std::packaged_task<R()>>(std::forward<F>(fn));
  auto result = task->get_future();
  {
    MutexLock lock(&mu_);
    tasks_.push_back([task] { (*task)(); });
    WakeLocked();
  }
  return result.get();
}

Status Core::Connect(int rank, int size, const std::vector<std::string>& addresses, milliseconds timeout,
                     const std::function<bool()>& cancelled) {
  if (connect_called_.exchange(true)) return FailedPrecondition("ucx: Connect was already called");
  if (size < 1 || size > UcxTransport::kMaxRanks) {
    return InvalidArgument("ucx: group size {} is out of range (1 to {})", size, UcxTransport::kMaxRanks);
  }
  if (rank < 0 || rank >= size) return InvalidArgument("ucx: rank {} is out of range for a group of {}", rank, size);
  if (addresses.size() != static_cast<size_t>(size)) {
    return InvalidArgument("ucx: {} peer addresses for a group of {}", addresses.size(), size);
  }
  const auto deadline = Clock::now() + std::min(timeout, kMaxWait);

  std::vector<std::unique_ptr<Peer>> peers(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    TANDEM_ASSIGN_OR_RETURN(peers[static_cast<size_t>(r)], PlanPeer(r, addresses[static_cast<size_t>(r)]));
  }

  TANDEM_RETURN_IF_ERROR(
      OnProgressThread([&]() TANDEM_REQUIRES(role_mu_) { return CreateEndpoints(std::move(peers)); }));
  {
    MutexLock lock(&mu_);
    rank_.store(rank);
    size_.store(size);
    connected_ = true;
  }
  // Goodbye receives: a peer that closes its transport says so.
  OnProgressThread([&]() TANDEM_REQUIRES(role_mu_) {
    for (auto& p : peers_) {
      if (!p) continue;
      p->bye_recv = std::make_shared<Op>(Op::Kind::kRecv, p->rank, kByeTag, true, &p->bye_buffer, sizeof(uint64_t));
      Start(p->bye_recv);
    }
  });

  TANDEM_RETURN_IF_ERROR(Handshake(rank, size, deadline, timeout, cancelled));
  OnProgressThread([&]() TANDEM_REQUIRES(role_mu_) { SelfCheck(); });
  return Status::Ok();
}

Result<std::unique_ptr<Peer>> Core::PlanPeer(int r, const std::string& address) const {
  auto p = std::make_unique<Peer>();
  p->rank = r;
  if (const std::string error = DecodeIdentity(address, &p->id); !error.empty()) {
    return InvalidArgument("ucx: the address of rank {} is not a Tandem UCX address: {}", r, error);
  }
  p->same_host = p->id.hostname == self_.hostname && p->id.boot_id == self_.boot_id;
  p->pid_check =
      p->same_host && self_.pid_namespace != 0 && p->id.pid_namespace == self_.pid_namespace && p->id.pid != 0;
  // UCX's shared-memory transports wake a sleeping receiver through an
  // abstract Unix socket, and those exist per network namespace: across
  // namespaces every wake-up is lost (sendto fails with ECONNREFUSED, which
  // UCX ignores), so the receiver would only see its data when the progress
  // thread next woke on its own. Such a peer is another (simulated) node.
  const bool same_net_namespace =
      self_.net_namespace == 0 || p->id.net_namespace == 0 || p->id.net_namespace == self_.net_namespace;
  const bool shm_possible = p->same_host && !self_.shm_address.empty() && !p->id.shm_address.empty();
  const bool net_possible = !self_.net_address.empty() && !p->id.net_address.empty();
  p->shm_expected = shm_possible && same_net_namespace;
  if (shm_possible && p->pid_check && (same_net_namespace || !net_possible)) {
    p->shm = true;
    p->shm_without_wakeups = !same_net_namespace;  // no other way: works, slowly
                                                   // (warned in SelfCheck)
  } else if (p->same_host) {
    if (self_.shm_address.empty()) {
      p->network_reason = "this rank has no shared-memory transport";
    } else if (p->id.shm_address.empty()) {
      p->network_reason = fmt::format("rank {} has no shared-memory transport", r);
    } else if (!same_net_namespace) {
      p->network_reason =
          "it runs in another network namespace (UCX's "
          "shared-memory wake-ups do not cross it)";
    } else {
      p->network_reason =
          "it runs in another PID namespace, where its death "
          "could not be detected";
    }
  }
  if (!p->shm && !net_possible) {
    return Unavailable("ucx: cannot reach rank {} on host {}: {}", r, p->id.hostname,
                       p->same_host                ? p->network_reason + ", and there is no common network transport"
                       : self_.net_address.empty() ? fmt::format("it is on another host and this rank has no network "
                                                                 "transport (tls '{}')",
                                                                 options_.tls)
                                                   : std::string("it is on another host and has no network transport"));
  }
  return p;
}

Status Core::Handshake(int rank, int size, Clock::time_point deadline, milliseconds timeout,
                       const std::function<bool()>& cancelled) {
  struct Hello {
    uint32_t magic, rank, size, pid;
  };
  const Hello mine{kHelloMagic, static_cast<uint32_t>(rank), static_cast<uint32_t>(size), self_.pid};
  std::vector<Hello> theirs(static_cast<size_t>(size));
  std::vector<std::unique_ptr<Request>> recvs(static_cast<size_t>(size));
  std::vector<std::unique_ptr<Request>> sends(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    recvs[static_cast<size_t>(r)] =
        Submit(Op::Kind::kRecv, r, kHelloTag, true, &theirs[static_cast<size_t>(r)], sizeof(Hello));
    sends[static_cast<size_t>(r)] =
        Submit(Op::Kind::kSend, r, kHelloTag, true, const_cast<Hello*>(&mine), sizeof(Hello));
  }
  auto remaining = [&] {
    return std::max(milliseconds(0), std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
  };
  // On failure the transport is unusable: fail every peer, so that the
  // handshake requests still in flight are released at once.
  auto abandon = [&](Status error) {
    OnProgressThread([&]() TANDEM_REQUIRES(role_mu_) {
      for (auto& p : peers_) {
        if (p) FailPeer(p->rank, fmt::format("the handshake of rank {} failed", rank));
      }
    });
    return error;
  };
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    const auto i = static_cast<size_t>(r);
    for (auto* req : {&recvs[i], &sends[i]}) {
      Status s;
      if (cancelled) {
        // In slices, so that a stopping process does not wait out the timeout.
        while (true) {
          s = (*req)->Wait(std::min(remaining(), milliseconds(50)));
          if (s.code() != StatusCode::kDeadlineExceeded || remaining() <= milliseconds(0)) break;
          if (cancelled()) {
            return abandon(Cancelled("ucx: the handshake of rank {} with rank {} was cancelled", rank, r));
          }
        }
      } else {
        s = (*req)->Wait(remaining());
      }
      if (s.code() == StatusCode::kDeadlineExceeded) {
        return abandon(
            DeadlineExceeded("ucx: rank {} did not complete the handshake with "
                             "rank {} within {} ms (is rank {} running and "
                             "connecting to the same group?)",
                             rank, r, timeout.count(), r));
      }
      if (!s.ok()) {
        return abandon(
            Status(s.code(), fmt::format("ucx: handshake of rank {} with rank {}: {}", rank, r, s.message())));
      }
    }
    const Hello& h = theirs[i];
    if (h.magic != kHelloMagic || h.rank != static_cast<uint32_t>(r) || h.size != static_cast<uint32_t>(size)) {
      return abandon(
          InvalidArgument("ucx: rank {} answered the handshake as rank {} of a "
                          "group of {}; rank {} expected rank {} of {} (do all "
                          "ranks use the same address list?)",
                          r, h.rank, h.size, rank, r, size));
    }
  }

  return Status::Ok();
}

Status Core::CreateEndpoints(std::vector<std::unique_ptr<Peer>> peers) {
  for (auto& p : peers) {
    if (!p) continue;
    p->error_arg = {this, p->rank};
    auto create = [&](bool shm) -> ucs_status_t {
      ucp_ep_params_t params{};
      params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
      const std::string& address = shm ? p->id.shm_address : p->id.net_address;
      params.address = reinterpret_cast<const ucp_address_t*>(address.data());
      if (shm) {
        // posix/sysv have no peer-failure handling in UCX 1.13; the pid check
        // covers these peers.
        params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
      } else {
        params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
        params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
        params.err_handler.cb = &OnEpError;
        params.err_handler.arg = &p->error_arg;
      }
      p->worker = shm ? shm_.worker : net_.worker;
      return ucp_ep_create(p->worker, &params, &p->ep);
    };
    ucs_status_t st = create(p->shm);
    if (st != UCS_OK && p->shm && !self_.net_address.empty() && !p->id.net_address.empty()) {
      p->shm = false;
      p->network_reason = fmt::format("shared memory is unreachable (UCX: {})", ucs_status_string(st));
      st = create(false);
    }
    if (st != UCS_OK) {
      p->ep = nullptr;
      Status error = Unavailable("ucx: cannot create an endpoint to rank {} on host {}: {}", p->rank, p->id.hostname,
                                 ucs_status_string(st));
      for (auto& q : peers) {
        if (q && q->ep != nullptr) CloseEndpoint(*q, /*force=*/!q->shm);
      }
      MutexLock lock(&mu_);
      peers_ = std::move(peers);  // kept: UCX may still call back with their error arguments
      return error;
    }
  }
  MutexLock lock(&mu_);
  peers_ = std::move(peers);
  return Status::Ok();
}

void Core::SelfCheck() {
  std::vector<std::string> lines;
  const int self = rank_.load();
  for (auto& p : peers_) {
    if (!p || p->ep == nullptr) continue;
    const EndpointPaths paths = ParseEndpointInfo(EndpointInfoText(p->ep));
    const std::string where = p->shm         ? "same host, shared memory"
                              : p->same_host ? "same host, network: " + p->network_reason
                                             : "host " + p->id.hostname;
    const std::string death =
        p->shm ? fmt::format("pid check every {} ms", options_.liveness_interval.count())
               : fmt::format("UCX error handling, keepalive every {} ms{}", options_.keepalive_interval.count(),
                             p->pid_check ? ", and pid check" : "");
    lines.push_back(
        fmt::format("rank {} -> rank {} ({}): {}; peer death: {}", self, p->rank, where, paths.Describe(), death));
    spdlog::info("ucx: {}", lines.back());
    if (p->same_host && !p->shm && p->shm_expected) {
      spdlog::warn(
          "ucx: rank {} -> rank {} is on this host but uses {} "
          "instead of shared memory: {}",
          self, p->rank, paths.Lanes("am", "am_bw"), p->network_reason);
    }
    if (p->shm_without_wakeups) {
      spdlog::warn(
          "ucx: rank {} -> rank {} runs in another network namespace "
          "and the two have no common network transport: "
          "shared memory, whose wake-ups do not cross network "
          "namespaces, so a message may wait up to {} ms",
          self, p->rank, options_.liveness_interval.count());
    }
    if (p->shm && paths.HasNetworkLane()) {
      spdlog::warn(
          "ucx: rank {} -> rank {} is on this host but UCX gave its "
          "endpoint a network lane ({})",
          self, p->rank, paths.Describe());
    }
    if (!p->same_host && paths.OnlyTcp() && self_.has_verbs && p->id.has_verbs) {
      spdlog::warn(
          "ucx: rank {} -> rank {} (host {}) uses TCP although both "
          "hosts have verbs devices (check tls "
          "and net_devices)",
          self, p->rank, p->id.hostname);
    }
  }
  MutexLock lock(&mu_);
  summaries_ = std::move(lines);
}

std::vector<std::string> Core::PathSummary() const {
  MutexLock lock(&mu_);
  return summaries_;
}

}  // namespace tandem::transport::ucx
