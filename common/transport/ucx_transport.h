// UcxTransport: the Transport of transport.h over UCX's tag-matching API (ucp),
// for ranks on one host (shared memory) and on different hosts (TCP, verbs).
// Built against UCX 1.13 (Debian 12, pkg-config `ucx`).
//
// Bootstrap is two-phase: Create() opens UCX and returns a transport whose
// address() the member publishes through the coordinator (an Endpoint with
// transport "ucx"); once every rank's address is known, Connect() creates the
// endpoints and runs a handshake with every peer. When Connect returns OK on
// all ranks, every pair can exchange messages.
//
// The implementation is under common/transport/ucx/ (core.h says which file
// holds which part: set-up, connection, requests, progress, liveness).
//
// Design
// - Two UCX contexts, one worker each: a shared-memory worker (posix, sysv,
//   and cma when prefer_copy_shm is off) for peers on this host, and a network
//   worker (every other transport UCX finds: tcp, verbs) for peers on other
//   hosts. A peer is reached through exactly one of them. One worker for both
//   does not work in UCX 1.13: endpoints that handle peer failure
//   (UCP_ERR_HANDLING_MODE_PEER) refuse posix/sysv ("no peer failure
//   handler"), and an endpoint without failure handling that UCX gives a
//   network lane (tcp is picked as the rendezvous lane between processes on
//   one host when cma is excluded) aborts the process when that peer dies.
// - address() is a small Tandem envelope around both packed worker
//   addresses: host name, boot id, PID and network namespaces, pid and
//   process start time, so that Connect can tell same-host peers apart before
//   it creates any endpoint. Peers on this host and in this PID namespace and
//   network namespace use the shared-memory worker; all others the network
//   worker. The network namespace matters because UCX's shared-memory
//   transports (posix, sysv) wake a sleeping receiver by a datagram to an
//   abstract Unix socket, and abstract sockets belong to a network namespace:
//   across namespaces (the simulated nodes of `tandem run`, containers) the
//   sender's sendto fails with ECONNREFUSED, which UCX ignores, so every
//   message waited for the receiver's next timed wake-up (liveness_interval:
//   a round trip took 45-50 ms instead of 0.1 ms, and 1 s with a 1 s
//   interval). Such peers go over the network (TCP over the namespaces' veth
//   links), which wakes its receiver through the socket itself; only when
//   the two have no common network transport do they fall back to shared
//   memory, with a warning.
// - One progress thread owns both workers and makes the UCX calls after
//   Create. Send, Recv and the Request destructor hand operations to it
//   through a mutex-protected queue. A thread that waits for an operation of
//   up to 1 MiB (Request::Wait, or a caller of Progress() such as
//   PsOp::Wait) first runs rounds of the same loop itself, on its own
//   thread, whenever the progress thread is not in one, and while they find
//   work (transport::DriveWhileWaiting); then it blocks on a condition
//   variable. The workers are UCS_THREAD_MODE_SERIALIZED; a mutex (the
//   role) says which thread makes UCX calls and runs completions, so
//   completions never run concurrently.
//   On a host where the waiter and the progress thread share a core, this
//   saves the two context switches and wake-ups of each hand-off, which cost
//   more than a small message itself (docs/benchmarks.md, "Waiters drive the
//   transport"). The thread
//   polls while there is traffic (yielding the CPU between polls that found
//   nothing, so that threads sharing its core, such as the one consuming
//   what it receives, are not starved), then (UcxProgressMode::kAdaptive) sleeps
//   in epoll on the workers' event descriptors (UCP_FEATURE_WAKEUP) and an
//   eventfd for new work, waking at least every liveness_interval. That
//   timed wake-up is for the liveness check, never for delivery: a message
//   that only arrives with it is a lost wake-up (see network namespaces
//   above), and shows as communication times in multiples of the interval.
// - Tags: the 64-bit UCX tag is [63: user tag bit 63][62: internal]
//   [61..40: sender rank][39..0: user tag bits 39..0], matched with a full
//   mask, so messages of one (sender, receiver, tag) match in order and a
//   receive never matches another sender's message. A user tag may use bit 63
//   and bits 0..39 (TagFits: (tag & ~kTagHighBit) <= kMaxUserTag), which
//   covers the collectives' (seq << 8) | phase for seq < 2^32 and the
//   communicator's top-bit send/recv counters below 2^40; any other tag gives
//   INVALID_ARGUMENT. Groups are limited to kMaxRanks (2^22).
// - Receives are posted with UCP_OP_ATTR_FLAG_NO_IMM_CMPL so that UCX always
//   reports the sender's length: a receive whose size differs from the
//   message fails with INVALID_ARGUMENT naming both sizes, whether UCX saw a
//   truncation (smaller buffer) or a short message (larger buffer).
//
// Protocols and memory
// - prefer_copy_shm (default true): on this machine (2-core VM) copying
//   through posix/sysv segments beats UCX's single-copy cma rendezvous for
//   large messages. ucx_perftest tag_bw between two processes, median of 5
//   interleaved runs: 16 MiB 15.2 GB/s copying (posix,sysv, all eager) vs
//   9.0 GB/s with cma (1.69x); 64 MiB 12.6 vs 7.6 GB/s (1.65x). Through this
//   transport (UcxBench.CopyVersusCma, ping-pong between two ranks of one
//   process): 16 MiB 15.6-15.9 vs 6.7-8.3 GB/s, 64 MiB 12.8-13.2 vs
//   7.6-8.2 GB/s (another run: 31 vs 9 and 21 vs 8 GB/s; figures on this
//   shared machine vary with its load, the ratio stays above 1.6).
//   With prefer_copy_shm the shared-memory worker also sends every message
//   eagerly (UCX_RNDV_THRESH=inf): a send completes once its data is in the
//   receiver's shared-memory FIFO, so it never waits for the receiving
//   application, and a message that arrives before its receive is posted is
//   buffered by the receiving worker (memory grows with such messages). A
//   send in flight waits for room in the FIFO, which raises no event, so the
//   progress thread polls while it has one. Without prefer_copy_shm, large
//   messages use cma rendezvous (the receiver reads the sender's buffer).
// - Registration: UCX's own registration cache (UCX_RCACHE_ENABLE=try, set
//   explicitly so an environment setting cannot turn it off) and memory-type
//   cache (UCX_MEMTYPE_CACHE, UCX's default) handle memory registration for
//   tag sends on verbs; posix/sysv/tcp copy and need none. Tandem keeps no
//   cache of its own.
//
// Peer death (every pending and later operation with a dead peer fails with
// UNAVAILABLE naming it)
// - Same host, same PID namespace (shared-memory worker): UCX 1.13 cannot
//   detect a dead posix/sysv peer, so the progress thread reads
//   /proc/<pid>/stat of each such peer every liveness_interval (50 ms): a
//   missing process, a zombie (killed, not yet reaped) or a different start
//   time (pid reused) marks the peer dead, so a SIGKILLed peer fails pending
//   operations within one liveness_interval (2-20 ms measured). Before
//   failing operations the workers are drained, so data the peer wrote before
//   it died is still delivered.
// - Other peers (network worker): endpoints use UCP_ERR_HANDLING_MODE_PEER
//   with an error callback. A killed process on a reachable host resets its
//   TCP connections at once (0-2 ms measured); a dead host or a cut link is
//   found by UCX's
//   keepalive (keepalive_interval, UCX_KEEPALIVE_INTERVAL) and TCP
//   keepalive. The pid check above also runs for network peers on this host.
// - A peer whose transport is destroyed says so ("bye") before it closes, so
//   its peers fail their operations with it at once, not at a timeout.
// - Receives from a dead peer still complete with data that arrived before it
//   died; everything else fails.
//
// Dropped requests: destroying a Request that is still in flight cancels it
// (ucp_request_cancel for receives) and waits until UCX no longer uses its
// buffer. Sends cannot be cancelled in UCX; a dropped shared-memory send
// completes on its own (eager), and a dropped network send that the peer has
// not taken within abandon_timeout makes Tandem declare that peer failed and
// force-close its endpoint, which releases the send. With prefer_copy_shm
// off, a dropped rendezvous send to a live same-host peer waits until the
// peer receives it or dies (a warning is logged every abandon_timeout).
//
// Start-up self-check: after the handshake Connect logs (spdlog info) one line
// per peer naming the UCX transports and devices its endpoint uses for eager
// messages and rendezvous and how the peer's death is detected, and warns
// when a peer on this host is reached over the network although shared
// memory was expected, or when a peer on another host is reached over TCP
// although both hosts have verbs devices. PathSummary() returns these lines.
//
// UCX's own log messages go through spdlog ("ucx: ...", UCX errors as
// warnings since Tandem reports failures to its callers), never straight to
// stderr; UCX's warning about unused UCX_* environment variables is off.
//
// Thread safety: thread-safe; one Request from one thread at a time. Connect
// and the destructor must not run concurrently with other calls.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/transport/transport.h"

namespace tandem::transport {

namespace ucx {
class Core;  // the implementation (common/transport/ucx/core.h)
}  // namespace ucx

enum class UcxProgressMode {
  kAdaptive,  // poll while there is traffic, then sleep on the workers' events (default)
  kBusyPoll,  // never sleep (only yield to other runnable threads): lowest latency, one busy core per transport
};

struct UcxOptions {
  // UCX transports, comma-separated (UCX_TLS syntax, "^a,b" to exclude);
  // empty: every transport UCX finds, minus cma when prefer_copy_shm. Each
  // name goes to the worker it belongs to (posix, sysv, mm, cma, knem, xpmem,
  // sm, shm: shared memory; self is ignored; the rest: network). Unknown
  // names give INVALID_ARGUMENT.
  std::string tls;
  // Network devices (UCX_NET_DEVICES), comma-separated: "lo", "eth0",
  // "mlx5_0:1"; empty or "all": all. A device this host lacks gives
  // INVALID_ARGUMENT. The daemons' default, "auto" (the interface that carries
  // the listen address), is resolved before it gets here
  // (common/transport/ucx/net_device.h).
  std::string net_devices;
  // Copy through posix/sysv shared memory rather than single-copy cma (see
  // the figures above).
  bool prefer_copy_shm = true;
  // This host's name as the coordinator knows it; empty: gethostname().
  // Used, with the boot id, to tell peers on this host.
  std::string hostname;
  UcxProgressMode progress = UcxProgressMode::kAdaptive;
  // kAdaptive: how long the progress thread keeps polling after the last
  // event before it sleeps (0 to 10 ms).
  std::chrono::microseconds spin{50};
  // How often peers on this host are checked for being alive (1 ms to 10 s).
  std::chrono::milliseconds liveness_interval{50};
  // UCX keepalive on network endpoints (UCX_KEEPALIVE_INTERVAL, 10 ms to 1 h).
  std::chrono::milliseconds keepalive_interval{1000};
  // How long the destructor waits for goodbyes and endpoint closes (0 to 1 min).
  std::chrono::milliseconds close_timeout{2000};
  // How long a dropped network send may wait for its peer (1 ms to 1 h).
  std::chrono::milliseconds abandon_timeout{10000};
};

// Checks options without opening UCX: the ranges, the transport names, and
// that the named network devices exist on this host. Daemons call it at
// start-up, so that a typo stops them there and not at their first epoch.
Status CheckUcxOptions(const UcxOptions& options);

class UcxTransport final : public Transport {
 public:
  // User tags: bit 63 plus bits 0..39.
  static constexpr int kUserTagBits = 40;
  static constexpr uint64_t kTagHighBit = uint64_t{1} << 63;
  static constexpr uint64_t kMaxUserTag = (uint64_t{1} << kUserTagBits) - 1;
  static constexpr bool TagFits(uint64_t tag) { return (tag & ~kTagHighBit) <= kMaxUserTag; }
  static constexpr int kMaxRanks = 1 << 22;

  // Opens the UCX contexts and workers and starts the progress thread.
  // INVALID_ARGUMENT names a bad option; UNAVAILABLE if UCX cannot start.
  static Result<std::unique_ptr<UcxTransport>> Create(const UcxOptions& options);
  // Says goodbye to the peers, closes the endpoints (bounded by
  // close_timeout), destroys the workers and contexts and joins the progress
  // thread. Operations still in flight fail with CANCELLED.
  ~UcxTransport() override;
  UcxTransport(const UcxTransport&) = delete;
  UcxTransport& operator=(const UcxTransport&) = delete;

  // This rank's address, to publish through the coordinator (at most a few
  // hundred bytes without verbs devices; binary).
  std::string address() const;

  // Connects to every peer: peer_addresses[r] is rank r's address() (the
  // entry for `rank` itself is ignored). Creates the endpoints, exchanges a
  // handshake with every peer within `timeout`, then logs the self-check.
  // Errors name the peer rank. Call once; after an error the transport
  // cannot be used and should be destroyed. `cancelled`, when set, is asked
  // while the handshake waits: once it says true, Connect fails with
  // CANCELLED (the process is stopping).
  Status Connect(int rank, int size, const std::vector<std::string>& peer_addresses, std::chrono::milliseconds timeout,
                 std::function<bool()> cancelled = {});

  // One line per peer, in rank order (self excluded), after Connect: which
  // UCX transports and devices carry eager messages and rendezvous to that
  // peer, and how its death is detected.
  std::vector<std::string> PathSummary() const;

  // -1 and 0 before Connect.
  int rank() const override;
  int size() const override;
  // Before Connect: FAILED_PRECONDITION. A tag that does not fit (TagFits)
  // or a bad peer: INVALID_ARGUMENT.
  std::unique_ptr<Request> Send(int peer, uint64_t tag, const void* data, size_t bytes) override;
  std::unique_ptr<Request> Recv(int peer, uint64_t tag, void* data, size_t bytes) override;
  // Completions run on the progress thread.
  std::unique_ptr<Request> SendAsync(int peer, uint64_t tag, const void* data, size_t bytes, Completion done) override;
  std::unique_ptr<Request> RecvAsync(int peer, uint64_t tag, void* data, size_t bytes, Completion done) override;
  // Operations are started by the progress thread: waits (up to a second)
  // until it has started those posted before the call. Inside a completion
  // (the thread holds the progress role) it starts them itself, in order;
  // what ends at once completes at the start of the next round.
  void WaitPosted() override;
  // One round of the progress thread's loop on the calling thread, when the
  // progress thread is not in one (it yields meanwhile). Wait does this
  // before it blocks.
  Progressed Progress() override;

 private:
  explicit UcxTransport(std::shared_ptr<ucx::Core> core) : core_(std::move(core)) {}
  std::shared_ptr<ucx::Core> core_;
};

}  // namespace tandem::transport
