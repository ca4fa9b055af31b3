// Operations: posting (Submit, WaitPosted), waiting and dropping (Wait,
// Drop), and on the progress thread starting them in UCX and completing them
// (Start, Cancel, OnUcxDone, Complete, Finish).
#include <algorithm>

#include "common/logging.h"
#include "common/transport/ucx/core.h"

namespace tandem::transport::ucx {
namespace {

using std::chrono::milliseconds;

class UcxRequest final : public Request {
 public:
  UcxRequest(std::shared_ptr<Core> core, std::shared_ptr<Op> op) : core_(std::move(core)), op_(std::move(op)) {}
  ~UcxRequest() override { core_->Drop(op_); }
  Status Wait(std::chrono::milliseconds timeout) override { return core_->Wait(*op_, timeout); }

 private:
  std::shared_ptr<Core> core_;
  std::shared_ptr<Op> op_;
};

void OnSendDone(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<Op*>(user_data);
  op->core->AssertRoleHeld();
  op->core->OnUcxDone(op, request, status, 0);
}

void OnRecvDone(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user_data) {
  auto* op = static_cast<Op*>(user_data);
  op->core->AssertRoleHeld();
  op->core->OnUcxDone(op, request, status, info != nullptr ? info->length : 0);
}

}  // namespace

std::string Describe(const Op& op) {
  const char* what = op.kind == Op::Kind::kSend ? "send" : "receive";
  if (op.internal) return fmt::format("{} {}", op.tag == kHelloTag ? "handshake" : "goodbye", what);
  return fmt::format("{} of {} bytes with tag {}", what, op.bytes, op.tag);
}

// ---------------------------------------------------------------------------
// Caller side.

void Core::WaitPosted() {
  if (t_progress_core == this) {
    // A completion (this thread holds the role): start what was posted now,
    // rather than when the completion returns, so that a reply does not
    // wait for the work its sender goes on with.
    role_mu_.AssertHeld();
    StartPosted(/*defer=*/true);
    return;
  }
  MutexLock lock(&mu_);
  // What is queued goes with the next batch; a batch taken but not started
  // yet may hold this thread's operations too.
  const uint64_t target = batches_taken_ + (posted_.empty() ? 0 : 1);
  if (batches_started_ >= target || stopping_.load()) return;
  ++posted_waiters_;
  started_cv_.WaitFor(lock, std::chrono::seconds(1),
                      [&]() TANDEM_REQUIRES(mu_) { return batches_started_ >= target || stopping_.load(); });
  --posted_waiters_;
}

std::unique_ptr<Request> Core::Submit(Op::Kind kind, int peer, uint64_t tag, bool internal, void* data, size_t bytes,
                                      Transport::Completion done) {
  const char* what = kind == Op::Kind::kSend ? "send" : "receive";
  const int self = rank_.load();
  const int n = size_.load();
  auto op = std::make_shared<Op>(kind, peer, tag, internal, data, bytes);
  op->callback = std::move(done);
  Status refused;
  {
    MutexLock lock(&mu_);
    if (!connected_) {
      refused = FailedPrecondition("ucx: {} before Connect", what);
    } else if (peer < 0 || peer >= n || peer == self) {
      refused = InvalidArgument("ucx: rank {} cannot {} rank {} (the group has ranks 0 to {})", self,
                                kind == Op::Kind::kSend ? "send to" : "receive from", peer, n - 1);
    } else if (!internal && !UcxTransport::TagFits(tag)) {
      refused = InvalidArgument(
          "ucx: tag {:#x} does not fit: a UCX tag may use bit 63 and bits 0 to "
          "{} (at most {:#x} without bit 63)",
          tag, UcxTransport::kUserTagBits - 1, UcxTransport::kMaxUserTag);
    } else if (bytes > 0 && data == nullptr) {
      refused = InvalidArgument("ucx: {} of {} bytes with a null buffer", what, bytes);
    } else if (stopping_.load()) {
      refused = Cancelled("ucx: the transport of rank {} is closing", self);
    } else if (const Peer& p = *peers_[static_cast<size_t>(peer)]; p.dead && kind == Op::Kind::kSend) {
      refused = GoneStatus(*op, p.reason);
    }
    if (refused.ok() || (op->callback && !stopping_.load())) {
      // A refused operation with a completion is finished by the progress
      // thread, so the completion never runs inside this call.
      op->refused = refused;
      posted_.push_back(op);
      WakeLocked();
      return std::make_unique<UcxRequest>(shared_from_this(), std::move(op));
    }
  }
  if (!op->callback) return Completed(std::move(refused));
  op->refused = refused;  // a Drop before it finishes must not look at its peer
  // A closing transport (its destructor runs: nothing should post now) may
  // have no progress thread left to run the completion on. It runs on a
  // thread of its own, never inside this call (the caller may hold locks the
  // completion takes); dropping the request waits for it, as ever.
  std::thread([core = shared_from_this(), op, refused] { core->Finish(*op, refused); }).detach();
  return std::make_unique<UcxRequest>(shared_from_this(), std::move(op));
}

Status Core::Wait(Op& op, milliseconds timeout) {
  timeout = std::clamp(timeout, milliseconds(0), kMaxWait);
  const auto deadline = Clock::now() + timeout;
  DriveWhileWaiting(
      op.bytes, [this] { return Progress(); },
      [&] {
        MutexLock lock(&mu_);
        return op.done;
      },
      deadline);
  MutexLock lock(&mu_);
  if (!op.cv.WaitUntil(lock, deadline, [&]() TANDEM_REQUIRES(mu_) { return op.done; })) {
    return DeadlineExceeded("rank {} waited {} ms for rank {} ({}); the request is still pending", rank_.load(),
                            timeout.count(), op.peer, Describe(op));
  }
  return op.status;
}

void Core::Drop(const std::shared_ptr<Op>& op) {
  MutexLock lock(&mu_);
  // On the progress thread nothing is waited for: the completion that runs
  // there (perhaps the caller itself) runs later or is running now.
  if (op->done) {
    if (t_progress_core != this) op->cv.Wait(lock, [&]() TANDEM_REQUIRES(mu_) { return !op->in_callback; });
    return;
  }
  op->dropped = true;
  cancels_.push_back(op);
  WakeLocked();
  if (t_progress_core == this) return;
  const bool network_send =
      op->kind == Op::Kind::kSend && op->refused.ok() && !peers_[static_cast<size_t>(op->peer)]->shm;
  while (!op->cv.WaitFor(lock, options_.abandon_timeout,
                         [&]() TANDEM_REQUIRES(mu_) { return op->done && !op->in_callback; })) {
    if (op->done) {
      spdlog::warn(
          "ucx: rank {} is still waiting for the completion of a "
          "dropped {} with rank {} to return",
          rank_.load(), Describe(*op), op->peer);
    } else if (network_send) {
      const std::string reason = fmt::format(
          "it did not take a dropped {} within {} ms, so rank {} closed the "
          "connection",
          Describe(*op), options_.abandon_timeout.count(), rank_.load());
      tasks_.push_back([this, peer = op->peer, reason]() TANDEM_REQUIRES(role_mu_) { FailPeer(peer, reason); });
      WakeLocked();
    } else {
      spdlog::warn(
          "ucx: rank {} is still waiting for rank {} to take a "
          "dropped {} (UCX holds its buffer)",
          rank_.load(), op->peer, Describe(*op));
    }
  }
}

// Progress thread.

void Core::Start(const std::shared_ptr<Op>& op) {
  if (!op->refused.ok()) {  // its peer may not exist
    Finish(*op, op->refused);
    return;
  }
  Peer& p = *peers_[static_cast<size_t>(op->peer)];
  bool dead = false;
  bool dropped = false;
  std::string reason;
  {
    MutexLock lock(&mu_);
    dead = p.dead;
    reason = p.reason;
    dropped = op->dropped && !op->done;  // dropped before it was posted
  }
  if (dropped) {
    Finish(*op, Cancelled("ucx: the {} with rank {} was dropped before it started", Describe(*op), op->peer));
    return;
  }
  if (op->kind == Op::Kind::kSend && (dead || p.ep == nullptr)) {
    Finish(*op, GoneStatus(*op, reason.empty() ? "its endpoint is closed" : reason));
    return;
  }
  op->core = this;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.user_data = op.get();
  void* request = nullptr;
  if (op->kind == Op::Kind::kSend) {
    param.cb.send = &OnSendDone;
    request = ucp_tag_send_nbx(p.ep, op->data, op->bytes, UcxTag(rank_.load(), op->tag, op->internal), &param);
    if (request == nullptr) {  // done at once (eager, data copied out)
      Finish(*op, Status::Ok());
      return;
    }
  } else {
    // Never complete at once: only the callback reports the sender's length.
    param.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    param.cb.recv = &OnRecvDone;
    request =
        ucp_tag_recv_nbx(p.worker, op->data, op->bytes, UcxTag(op->peer, op->tag, op->internal), kFullMask, &param);
  }
  if (IsUcsError(request)) {
    Finish(*op, ErrorStatus(*op, UcsStatusOf(request)));
    return;
  }
  if (op->ucx_done) {  // the callback ran inside the call
    ucp_request_free(request);
    Complete(*op);
    return;
  }
  op->request = request;
  inflight_.emplace(op.get(), op);
  if (op->kind == Op::Kind::kSend && p.shm && plan_.shm_eager_only && !dead) {
    op->polled = true;
    ++polled_sends_;
  }
  if (dead && op->kind == Op::Kind::kRecv) {
    // The peer is gone: only data it sent before dying (already delivered) can
    // match.
    ucp_request_cancel(p.worker, request);
    Finish(*op, GoneStatus(*op, reason));
  }
}

void Core::Cancel(const std::shared_ptr<Op>& op) {
  if (op->kind == Op::Kind::kRecv && op->request != nullptr) {
    ucp_request_cancel(peers_[static_cast<size_t>(op->peer)]->worker, op->request);
  }
  // Sends cannot be cancelled in UCX: they complete, or fail with their peer.
}

void Core::OnUcxDone(Op* op, void* request, ucs_status_t status, size_t length) {
  if (op->polled) {
    op->polled = false;
    --polled_sends_;
  }
  op->ucx_done = true;
  op->ucx_status = status;
  op->length = length;
  if (op->request == nullptr) return;  // completed inside the posting call: Start() frees the request
  op->request = nullptr;
  ucp_request_free(request);
  Complete(*op);
  inflight_.erase(op);  // may destroy *op
}

void Core::Complete(Op& op) {
  Status status;
  if (op.kind == Op::Kind::kRecv && (op.ucx_status == UCS_OK || op.ucx_status == UCS_ERR_MESSAGE_TRUNCATED)) {
    if (op.ucx_status == UCS_ERR_MESSAGE_TRUNCATED || op.length != op.bytes) {
      status = InvalidArgument(
          "rank {} sent {} bytes with tag {}, rank {} expected "
          "{} (do the ranks agree on count "
          "and dtype?)",
          op.peer, op.length, op.tag, rank_.load(), op.bytes);
    }
  } else if (op.ucx_status != UCS_OK) {
    status = ErrorStatus(op, op.ucx_status);
  }
  if (op.internal && op.tag == kByeTag && op.kind == Op::Kind::kRecv && status.ok()) {
    failures_.emplace_back(op.peer, kClosedReason);
  }
  Finish(op, std::move(status));
}

void Core::Finish(Op& op, Status status) {
  // The waiter is woken after the lock is released: woken under it, it would
  // run only to block on mu_ and be woken a second time (two context
  // switches more per operation, on every hand-off of the data path). The
  // reference keeps the op, and so its cv, alive until the notification,
  // even if the waiter returns and drops its request at once.
  // A completion runs after the op is done (so Wait returns) but before a
  // thread dropping its Request returns (in_callback).
  const std::shared_ptr<Op> keep = op.shared_from_this();
  if (t_deferring_core == this) {
    // Started inside a completion (by the role's holder): its own completion
    // runs after that one returns, at the start of the next round.
    role_mu_.AssertHeld();
    deferred_.emplace_back(keep, std::move(status));
    return;
  }
  Transport::Completion callback;
  {
    MutexLock lock(&mu_);
    if (op.done) return;
    op.done = true;
    op.status = status;
    callback = std::move(op.callback);
    op.in_callback = static_cast<bool>(callback);
  }
  if (callback) {
    callback(status);
    MutexLock lock(&mu_);
    op.in_callback = false;
  }
  op.cv.NotifyAll();
  // `callback` (and what it holds) is released here, after the op is
  // complete: what it releases may drop Requests, which then return at once.
}

Status Core::GoneStatus(const Op& op, const std::string& reason) const {
  return Unavailable("rank {} is gone ({} by rank {}): {}", op.peer, Describe(op), rank_.load(), reason);
}

Status Core::ErrorStatus(const Op& op, ucs_status_t status) {
  {
    MutexLock lock(&mu_);
    const Peer& p = *peers_[static_cast<size_t>(op.peer)];
    if (p.dead) return GoneStatus(op, p.reason);
  }
  if (status == UCS_ERR_CANCELED) {
    if (stopping_.load()) {
      return Cancelled("ucx: rank {} closed its transport with a {} with rank {} in flight", rank_.load(), Describe(op),
                       op.peer);
    }
    return Cancelled("ucx: the {} with rank {} was cancelled (its request was dropped)", Describe(op), op.peer);
  }
  return Unavailable("rank {} is unreachable ({} by rank {}): UCX reported '{}'", op.peer, Describe(op), rank_.load(),
                     ucs_status_string(status));
}

}  // namespace tandem::transport::ucx
