// FrameChannel: request/response messaging over a Transport, for the
// parameter-server data plane (workers push gradients and pull parameters;
// servers share step decisions and replicate updates to their backups).
//
// A message is a frame: a fixed 80-byte header (Frame, common/ps_protocol.h)
// followed, when header.payload_bytes > 0, by one payload message. Because the
// transport needs the receive size up front, the header goes first under one
// tag and the payload second under another; messages of one (sender,
// receiver, tag) are matched in order, and each peer's two messages are
// posted together under that peer's lock, so header i always pairs with
// payload i.
//
// Threads: the channel runs on the transport's completions (transport.h:
// SendAsync/RecvAsync), so a frame costs no hand-off between threads of its
// own. For every peer one receive is posted at a time: the header, then, on
// its completion, the payload into a buffer the handler chooses; on the
// payload's completion the frame goes to the handler, and only once the
// handler has returned is the next header received (frames of one peer are
// handled one at a time, in order). The handler's try_inline may take a
// frame right there on the transport's completion thread, when it can
// without blocking (a server hands it to its shard's loop; a worker
// completes the request waiting for it); every other frame goes to the
// peer's receiver thread, so a slow handler holds up only its own peer's
// frames. Send
// posts a frame's two messages from the caller's thread, in call order per
// peer, and `done` runs on the completion thread once both are sent. Nothing
// waits on the other side's application, so two processes that send to
// each other at once cannot deadlock whatever the transport's protocol (eager
// or rendezvous). A reply that has to wait (a pull for a step not yet
// applied) is sent later, from whichever thread completes it.
//
// Failure: when an operation with a peer fails (the transport reports the
// peer dead, or a payload of the wrong size), the channel stops receiving
// from it, refuses later sends to it with that status, and calls
// on_peer_failed once, on the peer's receiver thread. Sends already posted
// end as the transport ends them (failed with a dead peer). Stop() cancels
// the receives and waits for the sends.
//
// Thread safety: Send may be called from any thread, also from handlers and
// `done` callbacks.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/mutex.h"
#include "common/ps_protocol.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "common/transport/transport.h"

namespace tandem::transport {

class FrameChannel {
 public:
  // Called with a frame's header; returns where its payload goes (at least
  // header.payload_bytes bytes that stay valid until on_frame returns), or
  // nullptr to have the channel allocate it. Not called for frames without a
  // payload.
  using PayloadBuffer = std::function<void*(int peer, const ps::Frame& header)>;
  // Called with every frame received. `payload` is null when payload_bytes
  // is 0; `owned` holds the payload when the channel allocated it (the
  // handler may move it out to keep the bytes).
  using OnFrame = std::function<void(int peer, const ps::Frame& header, void* payload, std::vector<char>& owned)>;
  using OnPeerFailed = std::function<void(int peer, const Status& status)>;
  // Called when a send completed or failed (after its payload is no longer
  // read).
  using SendDone = std::function<void(const Status&)>;
  // Called first with every frame received, on the transport's completion
  // thread: handles it there (or hands it on, taking the payload out of
  // `owned` if it keeps it) and returns true, or returns false without
  // having done anything, and the frame goes to on_frame on the peer's
  // receiver thread. It must not block: the completion thread carries every
  // peer's messages.
  using TryInline = std::function<bool(int peer, const ps::Frame& header, void* payload, std::vector<char>& owned)>;

  struct Handler {
    PayloadBuffer payload_buffer;
    OnFrame on_frame;
    OnPeerFailed on_peer_failed;
    TryInline try_inline;  // empty: every frame on the receiver thread
  };

  // Serves frames from and to `peers` (ranks of `transport`, not its own).
  // `transport` must outlive the channel. With `start` false frames are
  // received only from Start(), so that the owner can publish the channel
  // (which its handler uses to reply) before the first frame arrives.
  FrameChannel(Transport* transport, std::vector<int> peers, Handler handler, bool start = true);
  ~FrameChannel();
  FrameChannel(const FrameChannel&) = delete;
  FrameChannel& operator=(const FrameChannel&) = delete;

  // Posts a frame to `peer` on the transport, from the calling thread (also
  // before Start).
  // header.payload_bytes must equal `bytes`. `payload` must stay valid until
  // `done` runs (or `keep` holds it: the channel releases `keep` after the
  // send). A peer that is not served, or
  // failed, or a stopped channel: `done` runs at once with the error.
  void Send(int peer, ps::Frame header, const void* payload, size_t bytes, SendDone done = nullptr,
            std::shared_ptr<const void> keep = nullptr);
  // Sends with a payload the channel owns.
  void Send(int peer, ps::Frame header, std::vector<char> payload, SendDone done = nullptr);
  // Returns once the frames this thread sent are handed to the network
  // (Transport::WaitPosted): for a thread with long work to do next, whose
  // replies should not wait for it.
  void WaitPosted() { transport_->WaitPosted(); }
  // One round of the transport's progress on this thread, for a thread about
  // to wait for a reply (Transport::Progress): the frames' completions, and
  // so on_frame, may run here.
  Transport::Progressed Progress() { return transport_->Progress(); }

  // Whether `peer` failed (and why).
  Status PeerStatus(int peer) const;

  // Starts receiving (once; a channel built with start true has started).
  void Start();

  // Cancels the receives, waits for the sends posted and their `done`
  // callbacks, and joins the threads. Idempotent; the handler is not called after it
  // returns. Not from a handler or a `done` callback.
  void Stop();

 private:
  // A frame posted to the transport, until both its messages are sent.
  struct Outgoing {
    ps::Frame header;  // read by the transport until then
    std::unique_ptr<Request> head, body;
    SendDone done;
    std::shared_ptr<const void> keep;
    std::atomic<int> left{0};  // messages not yet complete
    Mutex mu;
    Status status TANDEM_GUARDED_BY(mu);  // the first failure
  };
  struct Peer {
    int rank = -1;
    Mutex mu;
    CondVar cv;
    Status failed TANDEM_GUARDED_BY(mu);
    bool failure_pending TANDEM_GUARDED_BY(mu) = false;   // on_peer_failed is still to be called
    bool frame_ready TANDEM_GUARDED_BY(mu) = false;       // a frame waits for the receiver thread
    std::unique_ptr<Request> recv TANDEM_GUARDED_BY(mu);  // the header or payload receive in flight
    std::map<uint64_t, std::shared_ptr<Outgoing>> sending TANDEM_GUARDED_BY(mu);
    uint64_t next_send TANDEM_GUARDED_BY(mu) = 0;
    // The frame being received: used by one step of the chain at a time
    // (header completion, payload completion, handler), each starting only
    // after the one before it ended.
    ps::Frame header;
    void* payload = nullptr;
    std::vector<char> owned;
    std::thread receiver;
  };

  Peer* Find(int peer) const;
  // Posts the receive of the peer's next header unless the channel stops or
  // the peer failed; returns the request it replaces, to be destroyed
  // outside the lock.
  std::unique_ptr<Request> PostHeaderLocked(Peer* peer) TANDEM_REQUIRES(peer->mu);
  void OnHeader(Peer* peer, const Status& status);
  void OnPayload(Peer* peer, const Status& status);
  // The frame is complete: handle it here or on the receiver thread.
  void Deliver(Peer* peer);
  void Received(Peer* peer, const Status& status);  // a receive that failed
  void OnSent(Peer* peer, uint64_t id, Outgoing& out, const Status& status);
  void ReceiveLoop(Peer* peer);
  void Fail(Peer* peer, const Status& status);

  Transport* const transport_;
  const Handler handler_;
  std::atomic<bool> stopping_{false};
  std::vector<std::unique_ptr<Peer>> peers_;
  Mutex stop_mu_;
  bool started_ TANDEM_GUARDED_BY(stop_mu_) = false;
  bool stopped_ TANDEM_GUARDED_BY(stop_mu_) = false;
};

}  // namespace tandem::transport
