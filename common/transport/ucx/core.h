// The inside of UcxTransport (ucx_transport.h, which describes the design):
// the Core that owns the UCX contexts, workers and progress thread, the
// operations it carries (Op) and the peers it reaches (Peer). Its methods
// are spread by lifecycle:
//   context.cc   set-up and shutdown: the contexts and workers, the progress
//                thread's start, Teardown
//   connect.cc   Connect: the peers' addresses, endpoints, handshake and the
//                start-up self-check
//   request.cc   operations: posting (Submit, WaitPosted), waiting and
//                dropping (Wait, Drop), starting in UCX and completing
//   progress.cc  the progress thread's loop and a waiter's rounds (Progress)
//   liveness.cc  peer death: UCX endpoint errors, the pid check, FailPeer
//
// Thread safety: mu_ guards the fields marked TANDEM_GUARDED_BY(mu_) and the
// Op and Peer fields documented as guarded by Core::mu_. role_mu_ (the
// progress role) is held by the one thread that makes UCX calls and runs
// completions: it guards the Core's fields marked TANDEM_GUARDED_BY(role_mu_),
// and the Op and Peer fields marked "progress thread only" belong to its
// holder too (clang cannot check those: they live outside the Core). UCX's
// callbacks run inside the holder's UCX calls (AssertRoleHeld). A completion
// normally runs on the holder; one refused while the transport closes runs
// on a thread of its own (Submit).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ucp/api/ucp.h>

#include "common/mutex.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "common/transport/transport.h"
#include "common/transport/ucx/address.h"
#include "common/transport/ucx/options.h"
#include "common/transport/ucx_transport.h"

namespace tandem::transport::ucx {

using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------
// Tags: [63: user tag bit 63][62: internal][61..40: sender rank][39..0: user
// tag bits 39..0].

inline constexpr uint64_t kInternalBit = uint64_t{1} << 62;
inline constexpr int kRankShift = UcxTransport::kUserTagBits;
static_assert(UcxTransport::kMaxRanks <= (1 << (62 - kRankShift)));
inline constexpr uint64_t kFullMask = ~uint64_t{0};
// Internal messages (the user-tag field of an internal tag).
inline constexpr uint64_t kHelloTag = 1;
inline constexpr uint64_t kByeTag = 2;
inline constexpr uint32_t kHelloMagic = 0x54554358;  // "TUCX"
inline constexpr char kClosedReason[] = "it closed its transport";

inline uint64_t UcxTag(int sender, uint64_t tag, bool internal) {
  return (tag & UcxTransport::kTagHighBit) | (internal ? kInternalBit : 0) |
         (static_cast<uint64_t>(sender) << kRankShift) | (tag & UcxTransport::kMaxUserTag);
}

// UCS_PTR_IS_ERR and UCS_PTR_STATUS without their C casts.
inline bool IsUcsError(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) >= static_cast<uintptr_t>(UCS_ERR_LAST);
}
inline ucs_status_t UcsStatusOf(const void* ptr) {
  return static_cast<ucs_status_t>(reinterpret_cast<intptr_t>(ptr));
}

// Longest wait a condition variable is given (larger ones overflow the clock).
inline constexpr std::chrono::milliseconds kMaxWait = std::chrono::hours(24 * 365);

// The transport whose progress role this thread holds (its progress thread,
// or a caller inside Progress()): completions run there, and a Request of
// that transport dropped there must not wait for them.
extern thread_local constinit const void* t_progress_core;
// The transport that is starting operations inside a completion
// (Core::WaitPosted there): what ends at once is finished later, not inside
// the completion that posted it.
extern thread_local constinit const void* t_deferring_core;

class Core;

// ---------------------------------------------------------------------------
// Operations.

struct Op : std::enable_shared_from_this<Op> {
  enum class Kind { kSend, kRecv };
  Op(Kind k, int p, uint64_t t, bool in, void* d, size_t b)
      : kind(k), peer(p), tag(t), internal(in), data(d), bytes(b) {}

  const Kind kind;
  const int peer;
  const uint64_t tag;   // the user tag (or kHelloTag/kByeTag when internal)
  const bool internal;  // handshake and goodbye messages
  void* const data;
  const size_t bytes;
  CondVar cv;                      // with Core::mu_
  Transport::Completion callback;  // moved out by Finish, which runs it
  Status refused;                  // set at Submit: Start finishes the op with it

  // Guarded by Core::mu_.
  bool done = false;
  bool in_callback = false;  // done, and its callback is running
  Status status;
  bool dropped = false;  // its Request was destroyed while in flight

  // Progress thread only.
  Core* core = nullptr;
  void* request = nullptr;  // the UCX request, while UCX holds it
  bool ucx_done = false;    // UCX's callback ran
  bool polled = false;      // counted in Core::polled_sends_
  ucs_status_t ucx_status = UCS_OK;
  size_t length = 0;  // the sender's length, for receives
};

// "send of 8 bytes with tag 3", "handshake receive".
std::string Describe(const Op& op);

struct Peer {
  int rank = 0;
  Identity id;
  bool same_host = false;            // same host name and boot id
  bool pid_check = false;            // same host and PID namespace: liveness through /proc
  bool shm = false;                  // reached through the shared-memory worker
  bool shm_expected = false;         // both ranks have shared-memory workers and share
                                     // the host and network namespace
  bool shm_without_wakeups = false;  // shared memory across network namespaces: nothing else reaches it
  std::string network_reason;        // why a peer on this host is not reached through
                                     // shared memory

  // Progress thread only (set before the peer is published).
  ucp_worker_h worker = nullptr;
  ucp_ep_h ep = nullptr;
  struct ErrorArg {
    Core* core;
    int rank;
  } error_arg{nullptr, 0};
  uint64_t bye_buffer = 0;
  std::shared_ptr<Op> bye_recv;

  // Guarded by Core::mu_.
  bool dead = false;
  std::string reason;  // why it is gone
};

// ---------------------------------------------------------------------------

class Core : public std::enable_shared_from_this<Core> {
 public:
  explicit Core(UcxOptions options) : options_(std::move(options)) {}
  ~Core();
  Core(const Core&) = delete;
  Core& operator=(const Core&) = delete;

  // context.cc
  Status Init();
  void Start();
  void Shutdown() TANDEM_EXCLUDES(mu_);

  // connect.cc
  const std::string& Address() const { return address_; }
  Status Connect(int rank, int size, const std::vector<std::string>& addresses, std::chrono::milliseconds timeout,
                 const std::function<bool()>& cancelled) TANDEM_EXCLUDES(mu_);
  std::vector<std::string> PathSummary() const TANDEM_EXCLUDES(mu_);
  int Rank() const { return rank_.load(); }
  int Size() const { return size_.load(); }

  // request.cc
  // `done`, when set, is called on the progress thread when the operation
  // ends (transport.h); an operation refused at once is refused there too.
  std::unique_ptr<Request> Submit(Op::Kind kind, int peer, uint64_t tag, bool internal, void* data, size_t bytes,
                                  Transport::Completion done = nullptr) TANDEM_EXCLUDES(mu_);
  Status Wait(Op& op, std::chrono::milliseconds timeout) TANDEM_EXCLUDES(mu_);
  void WaitPosted() TANDEM_EXCLUDES(mu_);
  void Drop(const std::shared_ptr<Op>& op) TANDEM_EXCLUDES(mu_);
  // UCX's completion callback (progress thread).
  void OnUcxDone(Op* op, void* request, ucs_status_t status, size_t length) TANDEM_EXCLUDES(mu_)
      TANDEM_REQUIRES(role_mu_);

  // UCX runs its callbacks inside the calls of the role's holder.
  void AssertRoleHeld() const TANDEM_ASSERT_CAPABILITY(role_mu_) {}

  // progress.cc
  Transport::Progressed Progress() TANDEM_EXCLUDES(mu_, role_mu_);

  // liveness.cc
  // UCX's endpoint error callback (progress thread).
  void OnEndpointError(int rank, ucs_status_t status) TANDEM_REQUIRES(role_mu_);

 private:
  struct Context {
    const char* name = "";  // "shared-memory", "network"
    ucp_context_h context = nullptr;
    ucp_worker_h worker = nullptr;
    std::string address;
    int efd = -1;
  };

  // context.cc
  Status OpenContext(Context& ctx, const char* name, const std::string& tls, bool network, bool eager_only);
  void DestroyUcx();
  void Teardown() TANDEM_EXCLUDES(mu_, role_mu_);

  // connect.cc
  // Runs `fn` on the progress thread and returns its result.
  template <typename F>
  auto OnProgressThread(F&& fn) -> decltype(fn());
  // Rank r of a group joined as `rank`, from its published address.
  Result<std::unique_ptr<Peer>> PlanPeer(int r, const std::string& address) const;
  Status CreateEndpoints(std::vector<std::unique_ptr<Peer>> peers) TANDEM_EXCLUDES(mu_) TANDEM_REQUIRES(role_mu_);
  // Every rank sends (magic, rank, size, pid) to every peer and waits for
  // theirs.
  Status Handshake(int rank, int size, Clock::time_point deadline, std::chrono::milliseconds timeout,
                   const std::function<bool()>& cancelled) TANDEM_EXCLUDES(mu_);
  void SelfCheck() TANDEM_EXCLUDES(mu_) TANDEM_REQUIRES(role_mu_);

  // request.cc (progress thread)
  void Start(const std::shared_ptr<Op>& op) TANDEM_EXCLUDES(mu_) TANDEM_REQUIRES(role_mu_);
  void Cancel(const std::shared_ptr<Op>& op) TANDEM_REQUIRES(role_mu_);
  void Complete(Op& op) TANDEM_EXCLUDES(mu_) TANDEM_REQUIRES(role_mu_);
  void Finish(Op& op, Status status) TANDEM_EXCLUDES(mu_);
  Status ErrorStatus(const Op& op, ucs_status_t status) TANDEM_EXCLUDES(mu_);
  Status GoneStatus(const Op& op, const std::string& reason) const;

  // progress.cc (progress thread)
  void WakeLocked() TANDEM_REQUIRES(mu_);
  void Run() TANDEM_EXCLUDES(mu_, role_mu_);
  bool RunQueued() TANDEM_EXCLUDES(mu_) TANDEM_REQUIRES(role_mu_);
  // Takes what was posted into starting_ and starts it in order; with
  // `defer`, operations that end at once are finished later (deferred_).
  // Returns whether it took anything.
  bool StartPosted(bool defer) TANDEM_EXCLUDES(mu_) TANDEM_REQUIRES(role_mu_);
  // Finishes the operations deferred_ holds.
  bool RunDeferred() TANDEM_EXCLUDES(mu_) TANDEM_REQUIRES(role_mu_);
  bool ProgressAll() TANDEM_REQUIRES(role_mu_);
  void Drain() TANDEM_REQUIRES(role_mu_);
  // Arms the workers' wake-ups. False when the thread should not sleep
  // (events or work pending, or no wake-up support, after a short nap);
  // true when it may: sleeping_ is then set.
  bool PrepareSleep() TANDEM_EXCLUDES(mu_) TANDEM_REQUIRES(role_mu_);
  // Sleeps in epoll (the caller has released the role) at most `max`.
  void Sleep(Clock::duration max) TANDEM_EXCLUDES(mu_, role_mu_);

  // liveness.cc (progress thread)
  void FailPeer(int rank, const std::string& reason) TANDEM_EXCLUDES(mu_) TANDEM_REQUIRES(role_mu_);
  void HandleFailures() TANDEM_EXCLUDES(mu_) TANDEM_REQUIRES(role_mu_);
  void CheckPeers() TANDEM_EXCLUDES(mu_) TANDEM_REQUIRES(role_mu_);
  void CloseEndpoint(Peer& peer, bool force) TANDEM_REQUIRES(role_mu_);

  const UcxOptions options_;
  TlsPlan plan_;
  Identity self_;
  std::string address_;
  Context shm_;
  Context net_;
  std::vector<ucp_worker_h> workers_;  // the open ones
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  std::thread thread_;
  // Held by the thread that makes UCX calls and runs completions: the
  // progress thread for each round of its loop, or a caller in Progress().
  // What is marked "progress thread only" belongs to the holder.
  Mutex role_mu_;
  std::atomic<int> rank_{-1};
  std::atomic<int> size_{0};
  std::atomic<bool> connect_called_{false};
  std::atomic<bool> work_{false};
  std::atomic<bool> stopping_{false};

  mutable Mutex mu_;
  bool sleeping_ TANDEM_GUARDED_BY(mu_) = false;
  bool connected_ TANDEM_GUARDED_BY(mu_) = false;
  std::vector<std::shared_ptr<Op>> posted_ TANDEM_GUARDED_BY(mu_);
  // Batches of posted_ the progress thread took, and started (WaitPosted).
  uint64_t batches_taken_ TANDEM_GUARDED_BY(mu_) = 0;
  uint64_t batches_started_ TANDEM_GUARDED_BY(mu_) = 0;
  int posted_waiters_ TANDEM_GUARDED_BY(mu_) = 0;
  CondVar started_cv_;
  std::vector<std::shared_ptr<Op>> cancels_ TANDEM_GUARDED_BY(mu_);
  std::vector<std::function<void()>> tasks_ TANDEM_GUARDED_BY(mu_);
  std::vector<std::string> summaries_ TANDEM_GUARDED_BY(mu_);
  // Written once by the progress thread (under mu_) in CreateEndpoints; the
  // Peer objects' own fields say who guards them.
  std::vector<std::unique_ptr<Peer>> peers_;

  // The progress role's (progress thread only).
  // Ops whose UCX request is alive.
  std::unordered_map<Op*, std::shared_ptr<Op>> inflight_ TANDEM_GUARDED_BY(role_mu_);
  // From UCX callbacks, handled after progress.
  std::deque<std::pair<int, std::string>> failures_ TANDEM_GUARDED_BY(role_mu_);
  // Endpoint close requests.
  std::vector<void*> closing_ TANDEM_GUARDED_BY(role_mu_);
  // Taken from posted_ and not yet started, in posting order: a completion
  // that starts operations itself (WaitPosted) starts these first.
  std::deque<std::shared_ptr<Op>> starting_ TANDEM_GUARDED_BY(role_mu_);
  // Operations that ended while they were started inside a completion.
  std::vector<std::pair<std::shared_ptr<Op>, Status>> deferred_ TANDEM_GUARDED_BY(role_mu_);
  // Eager shared-memory sends in flight to live peers. Such a send waits for
  // room in the peer's FIFO, which raises no event: the thread polls while
  // there are any.
  int polled_sends_ TANDEM_GUARDED_BY(role_mu_) = 0;
};

}  // namespace tandem::transport::ucx
