// FrameChannel: request/response messaging over a Transport, for the
// parameter-server data plane (workers push gradients and pull parameters;
// servers share step decisions and replicate updates to their backups).
//
// A message is a frame: a fixed 80-byte header (Frame, common/ps_protocol.h)
// followed, when header.payload_bytes > 0, by one payload message. Because the
// transport needs the receive size up front, the header goes first under one
// tag and the payload second under another; messages of one (sender,
// receiver, tag) are matched in order, and each peer's frames are sent by one
// sender thread, so header i always pairs with payload i.
//
// Threads: for every peer, one receiver thread (posts the header receive,
// then the payload receive into a buffer the handler chooses, then calls the
// handler) and one sender thread. Send posts a frame's two messages to the
// transport from the caller's thread, in call order per peer (a hand-off to
// another thread costs a context switch on a busy core); the sender thread
// waits for their completions, in order, and runs the `done` callbacks.
// Neither thread ever waits on the other side's application, so two
// processes that send to each other at once cannot deadlock whatever the
// transport's protocol (eager or rendezvous). Handlers run on the receiver thread of the frame's
// peer and must not block for long: a reply that has to wait (a pull for a
// step not yet applied) is sent later, from whichever thread completes it.
//
// Failure: when an operation with a peer fails (the transport reports the
// peer dead, or a payload of the wrong size), the channel calls
// on_peer_failed once for that peer, fails that peer's queued sends with the
// same status, and stops its threads. Stop() cancels everything.
//
// Thread safety: Send may be called from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

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

  struct Handler {
    PayloadBuffer payload_buffer;
    OnFrame on_frame;
    OnPeerFailed on_peer_failed;
  };

  // Serves frames from and to `peers` (ranks of `transport`, not its own).
  // `transport` must outlive the channel. `poll` bounds how long a thread
  // waits before it checks for Stop. With `start` false the threads start
  // only at Start(), so that the owner can publish the channel (which its
  // handler uses to reply) before the first frame arrives.
  FrameChannel(Transport* transport, std::vector<int> peers, Handler handler,
               std::chrono::milliseconds poll = std::chrono::milliseconds(50), bool start = true);
  ~FrameChannel();
  FrameChannel(const FrameChannel&) = delete;
  FrameChannel& operator=(const FrameChannel&) = delete;

  // Posts a frame to `peer` on the transport, from the calling thread (also
  // before Start: only the waiting for its completion needs the threads).
  // header.payload_bytes must equal `bytes`. `payload` must stay valid until
  // `done` runs (or `keep` holds it: the channel releases `keep` after the
  // send). A peer that is not served, or
  // failed, or a stopped channel: `done` runs at once with the error.
  void Send(int peer, ps::Frame header, const void* payload, size_t bytes, SendDone done = nullptr,
            std::shared_ptr<const void> keep = nullptr);
  // Sends with a payload the channel owns.
  void Send(int peer, ps::Frame header, std::vector<char> payload, SendDone done = nullptr);

  // Whether `peer` failed (and why).
  Status PeerStatus(int peer) const;

  // Starts the threads (once; a channel built with start true has started).
  void Start();

  // Cancels receives and queued sends (with CANCELLED) and joins the threads.
  // Idempotent; the handler is not called after it returns.
  void Stop();

 private:
  // A frame posted to the transport, until its sends complete. The header
  // is on the heap: the transport reads it until then, and the entry moves.
  struct Outgoing {
    std::unique_ptr<ps::Frame> header;
    std::unique_ptr<Request> head, body;
    SendDone done;
    std::shared_ptr<const void> keep;
  };
  struct Peer {
    int rank = -1;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Outgoing> queue TANDEM_GUARDED_BY(mu);
    Status failed TANDEM_GUARDED_BY(mu);
    std::thread sender;
    std::thread receiver;
  };

  Peer* Find(int peer) const;
  void ReceiveLoop(Peer* peer);
  void SendLoop(Peer* peer);
  // Waits for `request` until it completes, the channel stops, or the peer
  // fails.
  Status WaitFor(Request& request, Peer* peer);
  void Fail(Peer* peer, const Status& status);
  // Waits for (or cancels) its sends, then runs `done` with `status` and
  // releases the payload: never before the transport is done reading it.
  static void Finish(Outgoing& out, const Status& status);

  Transport* const transport_;
  const Handler handler_;
  const std::chrono::milliseconds poll_;
  std::atomic<bool> stopping_{false};
  std::vector<std::unique_ptr<Peer>> peers_;
  std::mutex stop_mu_;
  bool started_ = false;
  bool stopped_ = false;
};

}  // namespace tandem::transport
