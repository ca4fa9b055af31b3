#include "common/transport/frame_channel.h"

#include <algorithm>

#include <spdlog/spdlog.h>

namespace tandem::ps {

const char* FrameTypeName(FrameType type) {
  switch (type) {
    case FrameType::kPush:
      return "push";
    case FrameType::kPushReply:
      return "push reply";
    case FrameType::kPull:
      return "pull";
    case FrameType::kPullReply:
      return "pull reply";
    case FrameType::kShare:
      return "share";
    case FrameType::kReplica:
      return "replica";
    case FrameType::kReplicaReply:
      return "replica reply";
    case FrameType::kTransfer:
      return "transfer";
    case FrameType::kTransferReply:
      return "transfer reply";
    case FrameType::kJob:
      return "job";
  }
  return "unknown";
}

}  // namespace tandem::ps

namespace tandem::transport {

FrameChannel::FrameChannel(Transport* transport, std::vector<int> peers, Handler handler, bool start)
    : transport_(transport), handler_(std::move(handler)) {
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  for (int rank : peers) {
    auto peer = std::make_unique<Peer>();
    peer->rank = rank;
    peers_.push_back(std::move(peer));
  }
  if (start) Start();
}

void FrameChannel::Start() {
  MutexLock stop_lock(&stop_mu_);
  if (started_ || stopped_) return;
  started_ = true;
  for (auto& peer : peers_) {
    Peer* p = peer.get();
    p->receiver = std::thread([this, p] { ReceiveLoop(p); });
    std::unique_ptr<Request> old;
    {
      MutexLock lock(&p->mu);
      old = PostHeaderLocked(p);
    }
  }
}

FrameChannel::~FrameChannel() {
  Stop();
}

FrameChannel::Peer* FrameChannel::Find(int rank) const {
  auto it = std::lower_bound(peers_.begin(), peers_.end(), rank,
                             [](const std::unique_ptr<Peer>& p, int r) { return p->rank < r; });
  return it != peers_.end() && (*it)->rank == rank ? it->get() : nullptr;
}

Status FrameChannel::PeerStatus(int rank) const {
  Peer* peer = Find(rank);
  if (peer == nullptr) return InvalidArgument("rank {} is not a peer of this channel", rank);
  MutexLock lock(&peer->mu);
  return peer->failed;
}

void FrameChannel::Send(int rank, ps::Frame header, std::vector<char> payload, SendDone done) {
  auto owned = std::make_shared<std::vector<char>>(std::move(payload));
  const void* data = owned->data();
  const size_t bytes = owned->size();
  Send(rank, header, data, bytes, std::move(done), std::move(owned));
}

void FrameChannel::Send(int rank, ps::Frame header, const void* payload, size_t bytes, SendDone done,
                        std::shared_ptr<const void> keep) {
  header.magic = ps::kMagic;
  header.payload_bytes = bytes;
  Peer* peer = Find(rank);
  Status refused;
  if (peer == nullptr) {
    refused = InvalidArgument("rank {} is not a peer of this channel", rank);
  } else {
    MutexLock lock(&peer->mu);
    if (stopping_.load()) {
      refused = Cancelled("the channel is stopping");
    } else if (!peer->failed.ok()) {
      refused = peer->failed;
    } else {
      // Posted under the peer's lock: header i and payload i go out in the
      // order of the Send calls, whichever threads make them. The
      // completions run on the transport's thread, never inside these calls.
      auto out = std::make_shared<Outgoing>();
      out->header = header;
      out->done = std::move(done);
      out->keep = std::move(keep);
      out->left.store(bytes > 0 ? 2 : 1);
      const uint64_t id = peer->next_send++;
      peer->sending.emplace(id, out);
      Outgoing* raw = out.get();
      auto sent = [this, peer, id, out](const Status& status) { OnSent(peer, id, *out, status); };
      raw->head = transport_->SendAsync(peer->rank, ps::kHeaderTag, &raw->header, sizeof(ps::Frame), sent);
      if (bytes > 0) raw->body = transport_->SendAsync(peer->rank, ps::kPayloadTag, payload, bytes, sent);
      return;
    }
  }
  if (done) done(refused);
}

void FrameChannel::OnSent(Peer* peer, uint64_t id, Outgoing& out, const Status& status) {
  Status result;
  {
    MutexLock lock(&out.mu);
    if (!status.ok() && out.status.ok()) out.status = status;
    if (out.left.fetch_sub(1) != 1) return;
    result = out.status;
  }
  // Both messages are sent (or failed): the payload is no longer read.
  if (out.done) out.done(result);
  out.done = nullptr;
  out.keep.reset();
  if (!result.ok() && result.code() != StatusCode::kCancelled) Fail(peer, result);
  // Only now: Stop waits for the frames it finds here, and so for this
  // completion, `done` included.
  MutexLock lock(&peer->mu);
  peer->sending.erase(id);
}

std::unique_ptr<Request> FrameChannel::PostHeaderLocked(Peer* peer) {
  if (stopping_.load() || !peer->failed.ok()) return nullptr;
  std::unique_ptr<Request> old = std::move(peer->recv);
  peer->recv = transport_->RecvAsync(peer->rank, ps::kHeaderTag, &peer->header, sizeof(ps::Frame),
                                     [this, peer](const Status& status) { OnHeader(peer, status); });
  return old;
}

void FrameChannel::Received(Peer* peer, const Status& status) {
  // A receive cancelled by Stop (or by the transport closing) ends the chain quietly.
  if (status.code() == StatusCode::kCancelled) return;
  Fail(peer, status);
}

void FrameChannel::OnHeader(Peer* peer, const Status& status) {
  if (!status.ok()) return Received(peer, status);
  const ps::Frame& header = peer->header;
  if (header.magic != ps::kMagic) {
    return Fail(peer, InvalidArgument("rank {} sent a frame with magic {:#x}, expected {:#x}", peer->rank, header.magic,
                                      ps::kMagic));
  }
  if (header.payload_bytes == 0) {
    peer->payload = nullptr;
    return Deliver(peer);
  }
  void* payload = handler_.payload_buffer ? handler_.payload_buffer(peer->rank, header) : nullptr;
  if (payload == nullptr) {
    // Reused while the sizes repeat (no zero-filling per frame).
    if (peer->owned.size() != header.payload_bytes) peer->owned.resize(header.payload_bytes);
    payload = peer->owned.data();
  }
  peer->payload = payload;
  std::unique_ptr<Request> old;  // this header's receive: it does not wait for its own completion
  MutexLock lock(&peer->mu);
  if (stopping_.load() || !peer->failed.ok()) return;
  old = std::move(peer->recv);
  peer->recv = transport_->RecvAsync(peer->rank, ps::kPayloadTag, payload, header.payload_bytes,
                                     [this, peer](const Status& s) { OnPayload(peer, s); });
}

void FrameChannel::OnPayload(Peer* peer, const Status& status) {
  if (!status.ok()) return Received(peer, status);
  Deliver(peer);
}

void FrameChannel::Deliver(Peer* peer) {
  const bool handled = handler_.try_inline && handler_.try_inline(peer->rank, peer->header, peer->payload, peer->owned);
  if (handled) {
    std::unique_ptr<Request> old;
    MutexLock lock(&peer->mu);
    old = PostHeaderLocked(peer);
    return;
  }
  {
    MutexLock lock(&peer->mu);
    peer->frame_ready = true;
  }
  // The last thing this completion does: the receiver thread may replace
  // (and so drop) its request at once.
  peer->cv.NotifyOne();
}

void FrameChannel::Fail(Peer* peer, const Status& status) {
  {
    MutexLock lock(&peer->mu);
    if (!peer->failed.ok()) return;
    peer->failed = status;
    peer->failure_pending = true;
  }
  peer->cv.NotifyOne();
}

void FrameChannel::ReceiveLoop(Peer* peer) {
  MutexLock lock(&peer->mu);
  bool failed = false;  // on_peer_failed was called
  for (;;) {
    peer->cv.Wait(lock, [&]() TANDEM_REQUIRES(peer->mu) {
      return stopping_.load() || peer->frame_ready || peer->failure_pending;
    });
    if (stopping_.load()) return;
    if (peer->frame_ready) {
      peer->frame_ready = false;
      if (failed) continue;  // nothing more is handled from a failed peer
      lock.Unlock();
      handler_.on_frame(peer->rank, peer->header, peer->payload, peer->owned);
      lock.Lock();
      std::unique_ptr<Request> old = PostHeaderLocked(peer);  // none once stopping
      lock.Unlock();
      old.reset();  // the payload's receive: waits (briefly) for its completion to return
      lock.Lock();
      continue;
    }
    // failure_pending: nothing more is received from this peer. The thread
    // stays until Stop.
    peer->failure_pending = false;
    failed = true;
    const Status status = peer->failed;
    lock.Unlock();
    if (handler_.on_peer_failed) handler_.on_peer_failed(peer->rank, status);
    lock.Lock();
  }
}

void FrameChannel::Stop() {
  MutexLock stop_lock(&stop_mu_);
  if (stopped_) return;
  stopped_ = true;
  for (auto& peer : peers_) {
    MutexLock lock(&peer->mu);
    stopping_.store(true);  // under each peer's lock: nothing is posted to it after this
    peer->cv.NotifyAll();
  }
  stopping_.store(true);
  for (auto& peer : peers_) {
    std::unique_ptr<Request> recv;
    std::vector<std::shared_ptr<Outgoing>> sending;
    {
      MutexLock lock(&peer->mu);
      recv = std::move(peer->recv);
      for (auto& [id, out] : peer->sending) sending.push_back(out);
    }
    recv.reset();  // cancels it; returns once its completion has run
    for (auto& out : sending) {
      // Sends cannot be cancelled: each returns once sent (or failed) and its done ran.
      out->head.reset();
      out->body.reset();
    }
  }
  for (auto& peer : peers_) {
    if (peer->receiver.joinable()) peer->receiver.join();
  }
}

}  // namespace tandem::transport
