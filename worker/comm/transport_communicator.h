// A communicator over any Transport (common/transport/): the in-process
// LocalFabric in tests ("local"), and the network transports between nodes
// ("ucx", "tcp"). The algorithms are the CPU collectives of
// worker/collectives/collectives.h; this class adds what a communicator
// promises (communicator.h): agreement checks with sequence numbers, bounded
// waits that Abort() interrupts, and failures that reach every rank quickly.
//
// Algorithm selection (see collectives.h for the algorithms), with B the
// bytes of one rank's buffer and n the group size:
// - allreduce: recursive doubling (with the fold-in for n not a power of
//   two) when B <= small_bytes or count < n; otherwise the pipelined
//   chunked ring (reduce-scatter then all-gather).
// - reduce_scatter: recursive doubling of the whole input when n*count
//   elements fit in small_bytes; otherwise the ring reduce-scatter.
// - all_gather: Bruck's algorithm when the n*count gathered elements fit in
//   small_bytes; otherwise the ring all-gather.
// - broadcast: a binomial tree when B <= small_bytes; otherwise a chain
//   pipelined by chunks.
// - reduce: a binomial tree when B <= small_bytes or count < n; otherwise
//   the ring reduce-scatter followed by a gather of the blocks to the root
//   (every rank sends and receives about B, against log2(n) * B into the
//   root for a tree).
// - barrier: the dissemination barrier (after the agreement check).
// The 64 KiB default comes from measurements over the in-process transport
// (float32 sum, 2 to 8 ranks): recursive doubling is faster than the ring up
// to 64 KiB at every group size and about even near 256 KiB; for reduce,
// the ring reduce-scatter plus gather is faster than the tree from 256 KiB.
// - send/recv: one message over the transport; a receive whose size differs
//   from the message fails with INVALID_ARGUMENT naming both sizes.
//
// Agreement: every collective starts with a descriptor exchange with both
// ring neighbours (kind, count, dtype, op, root, sequence number), on a tag
// of its own that all collectives share in order, so a rank that skipped or
// reordered a collective is caught too. A mismatch gives INVALID_ARGUMENT
// naming both ranks and both descriptors. Neighbour checks cover the ring
// transitively: some rank sees every disagreement, and its failure notice
// (below) fails the others. A rank whose part ended before it could hear of
// the failure (the root of a broadcast) returns OK with correct data and
// fails at its next call.
//
// Tags: collective number `seq` uses tags (seq << 8) | phase, so a late
// message of collective N never matches collective N+1; send/recv use tags
// with the top bit set and a counter per peer and direction; the
// descriptors and failure notices use tags 0 and 1.
//
// Failures: waits run in slices of `slice` up to the CommInfo timeout.
// Between slices a rank checks whether it was aborted (ABORTED with the
// reason) and whether a peer reported a failure or died. The first rank to
// fail for a reason of its own (a timeout, a dead peer, a disagreement, an
// abort) sends a short notice to every peer, which then fails with the same
// code and a message naming the rank and its error, instead of waiting out
// its own timeout. A peer that never enters gives its neighbours
// DEADLINE_EXCEEDED naming it after `timeout` ("allreduce seq 7: rank 2 never
// entered this collective within 30000 ms (waiting on rank 2 from rank 1,
// agreement check)"); the waits of the algorithms proper last two slices
// longer, so the ranks stalled behind those neighbours report the notice
// naming the absent rank rather than their own stall. A peer that stops
// sending mid-collective gives "rank 2 never sent its data within ..."; a
// dead peer gives UNAVAILABLE naming it.
//
// Memory: scratch buffers are allocated on first use, grown as needed and
// reused; steady-state calls allocate only the transport's request objects.
//
// Thread safety: as Communicator (one call at a time; Abort() and
// progress() from any thread).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/transport/transport.h"
#include "worker/collectives/collectives.h"
#include "worker/comm/communicator.h"

namespace tandem::comm {

struct TransportCommunicatorOptions {
  std::string backend = "local";  // what backend() reports: "local", "ucx", "tcp"
  // At or below this many bytes (see the selection rule above) the
  // latency-optimal algorithms run.
  size_t small_bytes = 64 << 10;
  // Pipelining granularity of the ring and chain algorithms.
  size_t chunk_bytes = 1 << 20;
  // How often a wait checks for Abort() and for peers' failures.
  std::chrono::milliseconds slice{50};
};

class TransportCommunicator final : public Communicator {
 public:
  // INVALID_ARGUMENT when the transport's rank or size differ from info's,
  // or an option is out of range. Posts one receive per peer for failure
  // notices.
  static Result<std::unique_ptr<TransportCommunicator>> Create(CommInfo info,
                                                               std::unique_ptr<transport::Transport> transport,
                                                               TransportCommunicatorOptions options = {});
  ~TransportCommunicator() override;

  std::string backend() const override { return options_.backend; }
  const TransportCommunicatorOptions& options() const { return options_; }
  // The algorithm an allreduce of `count` elements of `dtype` runs
  // ("recursive doubling", "ring", ...), for logs and tests.
  const char* AllReduceAlgorithmName(size_t count, DType dtype) const;

 protected:
  Status DoAllReduce(uint64_t seq, const void* in, void* out, size_t count, DType dtype, ReduceOp op) override;
  Status DoReduceScatter(uint64_t seq, const void* in, void* out, size_t count, DType dtype, ReduceOp op) override;
  Status DoAllGather(uint64_t seq, const void* in, void* out, size_t count, DType dtype) override;
  Status DoBroadcast(uint64_t seq, void* data, size_t count, DType dtype, int root) override;
  Status DoReduce(uint64_t seq, const void* in, void* out, size_t count, DType dtype, ReduceOp op, int root) override;
  Status DoBarrier(uint64_t seq) override;
  Status DoSend(int peer, const void* data, size_t bytes) override;
  Status DoRecv(int peer, void* data, size_t bytes) override;
  // Both messages posted at once, then waited for (no helper thread).
  Status DoSendRecv(int to, const void* send, int from, void* recv, size_t bytes) override;

 private:
  // What every rank of a collective must agree on (24 bytes on the wire).
  struct Descriptor {
    uint8_t kind = 0;
    uint8_t dtype = 0;
    uint8_t op = 0;
    uint8_t reserved = 0;
    int32_t root = 0;
    uint64_t count = 0;
    uint64_t seq = 0;
  };
  // A failure report (fixed size, so receives always match).
  struct Notice {
    int32_t code = 0;
    uint32_t length = 0;
    char text[1016] = {};
  };

  TransportCommunicator(CommInfo info, std::unique_ptr<transport::Transport> transport,
                        TransportCommunicatorOptions options);

  // Checks agreement, runs `body` with the options for collective `seq`, and
  // on failure adds "<kind> seq <seq>" as context and notifies the peers.
  template <typename Body>
  Status Collective(Kind kind, uint64_t seq, size_t count, DType dtype, ReduceOp op, int root, Body&& body);
  Status CheckPeers(const Descriptor& mine);
  static std::string Describe(const Descriptor& d);
  // The interrupt hook of every wait: ABORTED once aborted, or a peer's
  // reported failure or death.
  Status Interrupted();
  // Records `status` as this rank's failure and, unless it came from a
  // peer, tells every peer (once per communicator).
  Status Fail(Status status);

  // Declared first so that it is destroyed last, after every request.
  std::unique_ptr<transport::Transport> transport_;
  const TransportCommunicatorOptions options_;
  collectives::Workspace workspace_;
  // Reused by every call (only the tag changes): for the agreement check and
  // send/recv, and for the algorithms, which wait `grace` longer (see Fail).
  collectives::CollectiveOptions check_;
  collectives::CollectiveOptions collective_;
  Descriptor descriptor_out_;
  Descriptor descriptor_in_[2];
  std::vector<uint64_t> sent_;      // send/recv messages sent to each peer
  std::vector<uint64_t> received_;  // and received from each
  std::vector<Notice> notices_in_;  // one per peer
  std::vector<std::unique_ptr<transport::Request>> notice_recvs_;
  Notice notice_out_;
  std::vector<std::unique_ptr<transport::Request>> notice_sends_;
  bool failed_by_peer_ = false;
  bool notified_ = false;
};

}  // namespace tandem::comm
