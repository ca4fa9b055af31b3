// NcclCommunicator: the Communicator backend for GPU (device) buffers, built
// on NCCL. One object is one NCCL communicator of one membership epoch on one
// CUDA device.
//
// What runs where:
// - Create() picks the device (NcclOptions::device, or local_rank modulo the
//   visible devices), makes it current, creates a dedicated CUDA stream
//   (blocking: ordered with the caller's work on the legacy default stream,
//   such as cudaMemcpy and cudaMemset into the buffers) and a small device buffer for Barrier(), then exchanges the
//   NCCL unique id through the Rendezvous: rank 0 calls ncclGetUniqueId and Puts it, hex-encoded, under
//   "nccl/<name>/<epoch>"; the others Get it (waiting up to CommInfo::timeout). It then calls ncclCommInitRankConfig
//   with config.blocking = 0 and polls ncclCommGetAsyncError until NCCL reports success or an error, or
//   CommInfo::timeout passes (then the half-built NCCL communicator is aborted and Create returns DEADLINE_EXCEEDED).
//   The key is written once: one Create per (name, epoch); after a failure, build the next epoch.
// - Every operation enqueues its NCCL call on the communicator's stream and
//   then waits on the calling thread with a bounded poll loop:
//   ncclCommGetAsyncError (the enqueue itself may still be in progress in
//   non-blocking mode) and then cudaStreamQuery, sleeping 20 us at first and
//   backing off to 1 ms. When CommInfo::timeout passes first the operation
//   returns DEADLINE_EXCEEDED ("allreduce seq N did not complete within T ms
//   on rank R; NCCL communicator aborted") and the NCCL communicator is
//   aborted (ncclCommAbort), so the kernels waiting on the missing peers exit.
//   Send and Recv are issued inside ncclGroupStart/ncclGroupEnd.
// - count == 0 returns OK at once without entering NCCL (every rank does the
//   same: the count is part of the SPMD contract).
// - Abort(reason) (from any thread): when no operation is in flight it calls
//   ncclCommAbort at once; when one is, the waiting thread sees the abort
//   within a millisecond, calls ncclCommAbort itself and returns ABORTED with
//   the reason. ncclCommAbort is only ever called by one thread while no other
//   thread uses the NCCL communicator.
// - The destructor finalizes a healthy NCCL communicator (ncclCommFinalize,
//   polled up to CommInfo::timeout, then ncclCommDestroy) and aborts a broken,
//   aborted or slow one; then it frees the stream and the barrier buffer.
//
// What NCCL cannot tell: when a collective stalls NCCL only knows that it has
// not completed; it cannot name the ranks that never entered it, nor check
// that ranks agree on the kind, count, dtype, op or root of a collective
// (disagreeing ranks hang until the timeout instead of getting
// INVALID_ARGUMENT). The collective sequence numbers (progress()) travel in
// heartbeats, so the coordinator names the ranks that are behind: `tandem
// status` shows the stalled collectives. A peer process that dies surfaces as
// NCCL's remote error (UNAVAILABLE) or as the timeout.
//
// CUDA: Create and every operation make the communicator's device current on
// the calling thread (cudaSetDevice), as NCCL requires, and leave it current.
// Buffers must be device memory of that device (or memory NCCL can address).
// Work the caller enqueues on stream() is ordered with the collectives, and
// counts against their timeout.
//
// Without CUDA (TANDEM_CUDA_ENABLED is 0) this header compiles all the same
// and Create returns FAILED_PRECONDITION; without a usable device Create
// returns UNAVAILABLE with CUDA's explanation, never a crash.
//
// Thread safety: as Communicator says: one operation at a time; Abort(),
// health() and progress() from any thread at any time. Create is thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "common/mutex.h"
#include "common/rendezvous.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "tandem/config.h"
#include "worker/comm/communicator.h"

#if TANDEM_CUDA_ENABLED
#include <cuda_runtime_api.h>
#endif

// NCCL's and CUDA's opaque handle types (ncclComm_t is ncclComm*, cudaStream_t
// is CUstream_st*), declared here so that this header needs neither nccl.h nor,
// without CUDA, the CUDA headers.
struct ncclComm;
struct CUstream_st;

namespace tandem::gpu {

struct NcclOptions {
  // The CUDA device to use; -1 picks local_rank modulo the visible devices.
  int device = -1;
  // This process's rank among the processes of its node (for the default
  // device).
  int local_rank = 0;
};

// NCCL's numbers for Tandem's element types (ncclDataType_t) and reductions
// (ncclRedOp_t: kAvg is ncclAvg). INVALID_ARGUMENT for a value outside the
// enums. Returned as int so that callers need not include nccl.h.
Result<int> ToNcclDataType(comm::DType dtype);
Result<int> ToNcclRedOp(comm::ReduceOp op);

// The rendezvous key of a communicator's NCCL unique id: "nccl/<name>/<epoch>".
std::string NcclUniqueIdKey(const comm::CommInfo& info);

// Lower-case hex of arbitrary bytes, and back (INVALID_ARGUMENT on an odd
// length or a character that is not a hex digit).
std::string HexEncode(std::string_view bytes);
Result<std::string> HexDecode(std::string_view hex);

class NcclCommunicator final : public comm::Communicator {
 public:
  // Builds the communicator of `info` (see the file comment); every rank of
  // the group calls it with the same name, epoch and size. Errors name the
  // communicator, the rank and, from NCCL, ncclGetErrorString and
  // ncclGetLastError. FAILED_PRECONDITION when built without CUDA; UNAVAILABLE
  // when no device is usable; DEADLINE_EXCEEDED when a peer does not join in
  // time. Returns a comm::Communicator; dynamic_cast to NcclCommunicator for
  // device() and stream().
  static Result<std::unique_ptr<comm::Communicator>> Create(comm::CommInfo info, comm::Rendezvous& rendezvous,
                                                            const NcclOptions& options);

  ~NcclCommunicator() override;

  std::string backend() const override { return "nccl"; }
  bool device_buffers() const override { return true; }
  // The CUDA device the buffers live on.
  int device() const { return device_; }
#if TANDEM_CUDA_ENABLED
  // The stream every operation runs on: enqueue kernels here to order them
  // with the collectives without synchronising the device.
  cudaStream_t stream() const {
    return stream_;
  }
#endif

 protected:
  Status DoAllReduce(uint64_t seq, const void* in, void* out, size_t count, comm::DType dtype,
                     comm::ReduceOp op) override;
  Status DoReduceScatter(uint64_t seq, const void* in, void* out, size_t count, comm::DType dtype,
                         comm::ReduceOp op) override;
  Status DoAllGather(uint64_t seq, const void* in, void* out, size_t count, comm::DType dtype) override;
  Status DoBroadcast(uint64_t seq, void* data, size_t count, comm::DType dtype, int root) override;
  Status DoReduce(uint64_t seq, const void* in, void* out, size_t count, comm::DType dtype, comm::ReduceOp op,
                  int root) override;
  Status DoBarrier(uint64_t seq) override;
  Status DoSend(int peer, const void* data, size_t bytes) override;
  Status DoRecv(int peer, void* data, size_t bytes) override;
  void OnAbort() override;

 private:
  // What an operation is, for messages: "allreduce seq 3", "send to rank 2".
  struct OpName {
    comm::Kind kind;
    uint64_t seq = 0;  // 0 for send and recv
    int peer = -1;     // send and recv only
  };
  class Enqueue;  // the NCCL call of one operation (defined in the .cc)

  NcclCommunicator(comm::CommInfo info, int device);
  Status SetUp();
  Status InitNccl(const std::string& unique_id);
  Status Run(const OpName& op, const Enqueue& enqueue) TANDEM_EXCLUDES(nccl_mu_);
  Status Wait(const OpName* op, ncclComm* nccl, bool query_stream);
  void AbortNcclLocked() TANDEM_REQUIRES(nccl_mu_);
  std::string Where() const;
  std::string Describe(const OpName* op) const;

  const int device_;
  CUstream_st* stream_ = nullptr;
  int32_t* barrier_ = nullptr;  // one int32 of device memory for Barrier()
  Mutex nccl_mu_;
  ncclComm* nccl_ TANDEM_GUARDED_BY(nccl_mu_) = nullptr;  // null before init and once aborted
  bool in_flight_ TANDEM_GUARDED_BY(nccl_mu_) = false;    // an operation is using nccl_ outside the lock
};

}  // namespace tandem::gpu
