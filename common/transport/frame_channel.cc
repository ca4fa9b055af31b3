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

FrameChannel::FrameChannel(Transport* transport, std::vector<int> peers, Handler handler,
                           std::chrono::milliseconds poll, bool start)
    : transport_(transport), handler_(std::move(handler)), poll_(poll) {
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
  std::lock_guard stop_lock(stop_mu_);
  if (started_ || stopped_) return;
  started_ = true;
  for (auto& peer : peers_) {
    Peer* p = peer.get();
    p->receiver = std::thread([this, p] { ReceiveLoop(p); });
    p->sender = std::thread([this, p] { SendLoop(p); });
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
  std::lock_guard lock(peer->mu);
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
    {
      std::lock_guard lock(peer->mu);
      if (stopping_.load()) {
        refused = Cancelled("the channel is stopping");
      } else if (!peer->failed.ok()) {
        refused = peer->failed;
      } else {
        // Posted under the peer's lock: header i and payload i go out in the
        // order of the Send calls, whichever threads make them.
        Outgoing out{std::make_unique<ps::Frame>(header), nullptr, nullptr, std::move(done), std::move(keep)};
        out.head = transport_->Send(peer->rank, ps::kHeaderTag, out.header.get(), sizeof(ps::Frame));
        if (bytes > 0) out.body = transport_->Send(peer->rank, ps::kPayloadTag, payload, bytes);
        peer->queue.push_back(std::move(out));
      }
    }
    if (refused.ok()) {
      // Outside the lock, so the sender does not wake only to wait for it.
      // The peer lives as long as the channel.
      peer->cv.notify_one();
      return;
    }
  }
  if (done) done(refused);
}

void FrameChannel::Finish(Outgoing& out, const Status& status) {
  out.head.reset();
  out.body.reset();
  if (out.done) out.done(status);
  out.done = nullptr;
  out.keep.reset();
}

Status FrameChannel::WaitFor(Request& request, Peer* peer) {
  for (;;) {
    Status status = request.Wait(poll_);
    if (status.code() != StatusCode::kDeadlineExceeded) return status;
    if (stopping_.load()) return Cancelled("the channel is stopping");
    std::lock_guard lock(peer->mu);
    if (!peer->failed.ok()) return peer->failed;
  }
}

void FrameChannel::Fail(Peer* peer, const Status& status) {
  std::deque<Outgoing> dropped;
  {
    std::lock_guard lock(peer->mu);
    if (!peer->failed.ok()) return;
    peer->failed = status;
    dropped.swap(peer->queue);
  }
  peer->cv.notify_all();
  for (auto& out : dropped) Finish(out, status);
  if (!stopping_.load() && handler_.on_peer_failed) handler_.on_peer_failed(peer->rank, status);
}

void FrameChannel::ReceiveLoop(Peer* peer) {
  std::vector<char> owned;
  while (!stopping_.load()) {
    ps::Frame header;
    auto request = transport_->Recv(peer->rank, ps::kHeaderTag, &header, sizeof(header));
    Status status = WaitFor(*request, peer);
    request.reset();
    if (!status.ok()) {
      if (status.code() != StatusCode::kCancelled) Fail(peer, status);
      return;
    }
    if (header.magic != ps::kMagic) {
      Fail(peer, InvalidArgument("rank {} sent a frame with magic {:#x}, expected {:#x}", peer->rank, header.magic,
                                 ps::kMagic));
      return;
    }
    void* payload = nullptr;
    if (header.payload_bytes > 0) {
      if (handler_.payload_buffer) payload = handler_.payload_buffer(peer->rank, header);
      if (payload == nullptr) {
        // Reused while the sizes repeat (no zero-filling per frame).
        if (owned.size() != header.payload_bytes) owned.resize(header.payload_bytes);
        payload = owned.data();
      }
      auto data = transport_->Recv(peer->rank, ps::kPayloadTag, payload, header.payload_bytes);
      status = WaitFor(*data, peer);
      data.reset();
      if (!status.ok()) {
        if (status.code() != StatusCode::kCancelled) Fail(peer, status);
        return;
      }
    }
    handler_.on_frame(peer->rank, header, payload, owned);
  }
}

void FrameChannel::SendLoop(Peer* peer) {
  // Takes everything posted (up to kBatch frames) at once and waits for the
  // sends in order: a burst of replies (the pulls a step's update answers)
  // costs one wake-up of this thread, not one per frame.
  constexpr size_t kBatch = 32;
  std::vector<Outgoing> batch;
  batch.reserve(kBatch);
  for (;;) {
    {
      std::unique_lock lock(peer->mu);
      peer->cv.wait(lock, [&] { return stopping_.load() || !peer->failed.ok() || !peer->queue.empty(); });
      if (stopping_.load() || !peer->failed.ok()) return;
      while (!peer->queue.empty() && batch.size() < kBatch) {
        batch.push_back(std::move(peer->queue.front()));
        peer->queue.pop_front();
      }
    }
    Status status;
    for (Outgoing& out : batch) {
      // After a failure the rest are not waited for: Fail stops the peer.
      if (status.ok()) status = WaitFor(*out.head, peer);
      if (status.ok() && out.body) status = WaitFor(*out.body, peer);
      Finish(out, status);
    }
    batch.clear();
    if (!status.ok()) {
      if (status.code() != StatusCode::kCancelled) Fail(peer, status);
      return;
    }
  }
}

void FrameChannel::Stop() {
  std::lock_guard stop_lock(stop_mu_);
  if (stopped_) return;
  stopped_ = true;
  stopping_.store(true);
  for (auto& peer : peers_) {
    std::lock_guard lock(peer->mu);
    peer->cv.notify_all();
  }
  for (auto& peer : peers_) {
    if (peer->receiver.joinable()) peer->receiver.join();
    if (peer->sender.joinable()) peer->sender.join();
    std::deque<Outgoing> dropped;
    {
      std::lock_guard lock(peer->mu);
      dropped.swap(peer->queue);
    }
    for (auto& out : dropped) Finish(out, Cancelled("the channel stopped"));
  }
}

}  // namespace tandem::transport
