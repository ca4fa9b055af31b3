// The parameter-server data plane's wire protocol: the frames workers and
// servers exchange over the transport (common/transport/frame_channel.h).
// Control (initialise, statistics, checkpoints) goes over gRPC
// (proto/tandem/v1/server.proto); this is the hot path only.
//
// Every frame is a 80-byte header, followed by a payload of payload_bytes
// when that is not 0. Fields are in host byte order; Tandem runs only on
// little-endian machines (checked at compile time), so that is little-endian.
//
// Requests and their replies (request_id pairs them; a reply echoes the
// request's partition, epoch and step):
//
//   kPush        worker -> primary. Gradient of `partition` for `step`,
//                computed in `epoch`, as payload_bytes of `dtype` (one
//                element per partition element). `contributor` of
//                `contributors` (pushes a step needs). `value` is the step's
//                learning rate: 0 means the configured schedule's (the
//                optimizer's LrSchedule at the partition's update count);
//                > 0 (finite) is the job-wide rule's learning rate for this
//                step, replacing the scheduled one (a group's lr_scale still
//                multiplies it). Negative, NaN or Inf is refused with
//                INVALID_ARGUMENT. In sync mode every push of a step (every
//                contributor, a retry in a later epoch too) must carry the
//                same value, else it is refused with INVALID_ARGUMENT and
//                changes nothing; in the asynchronous modes each push is
//                applied with its own. Reply: kPushReply, status OK; `flags`
//                kFlagDuplicate when the push was already counted or the
//                step already applied (the push is ignored).
//   kPull        worker -> primary. Parameters of `partition` once its step is
//                >= `step` (0: now), as `dtype` (FP32 or BF16). In the
//                asynchronous modes, with `contributors` set, `contributor`
//                is the puller, which computes `step` next: its clock moves
//                up to step - 1 (bounded staleness: the pull waits until
//                every contributor is within the bound of it). Reply:
//                kPullReply with the values; `step` and `version` say where
//                the partition is.
//   kShare       server -> server (sync mode). This server's part of the
//                decision for `step` in `epoch`: payload is `contributors`
//                entries of ShareEntry, one per partition it is primary for.
//                No reply.
//   kReplica     primary -> backup. One update of `partition`: the reduced
//                gradient (fp32, payload) and the grad scale (`value`) the
//                primary applied, with flags kFlagSkip when the step was
//                skipped (no payload). `step` is the step, `version` the
//                version before the update. The learning rate the primary
//                applied (its pushes' `value`: 0 for the schedule's) is in
//                the 64 bits of `contributor` (low half) and `contributors`
//                (high half), which a kReplica frame has no other use for:
//                SetReplicaLearningRate, ReplicaLearningRate. (A primary
//                that leaves them 0 means the schedule's.) Reply:
//                kReplicaReply.
//   kTransfer    primary -> new backup. The whole state of `partition`:
//                payload is weights, then state0, then state1 (fp32 each, as
//                many buffers as the optimizer keeps, `contributors` says
//                how many); `step` the step and `version` the version. With
//                flags kFlagDecided, `value` is the clipping coefficient the
//                step was decided with (and kFlagSkip: it was skipped), for
//                a retry of that step after the backup becomes primary.
//                Reply: kTransferReply.
//   kJob         primary -> new backup, before kTransfer. The job's
//                configuration: a serialized InitializeParametersRequest
//                with tensors, optimizer and consistency (no values), for a
//                server that joined after the job was initialised. No reply.
//
// Errors: a reply whose `status` is not 0 carries a StatusCode and, as its
// payload, the message (UTF-8, at most 4 KiB).
//
// Tracing: `trace_hi` and `trace_lo` (the bytes that were reserved, so the
// layout is unchanged and a peer that ignores them is unaffected) carry a
// 48-bit correlation id, 0 when the sender does not trace the request's step.
// A traced worker sets it on its pushes and pulls; the server records it with
// its spans and echoes it in the reply, so a trace links a push to the
// server's update and a pull to its answer (common/trace.h).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/status.h"

namespace tandem::ps {

static_assert(std::endian::native == std::endian::little, "the parameter-server protocol assumes little-endian hosts");

inline constexpr uint32_t kMagic = 0x31535054;  // "TPS1"
// Transport tags of headers and payloads.
inline constexpr uint64_t kHeaderTag = 0x5053000001;
inline constexpr uint64_t kPayloadTag = 0x5053000002;
inline constexpr size_t kMaxErrorBytes = 4096;

enum class FrameType : uint16_t {
  kPush = 1,
  kPushReply = 2,
  kPull = 3,
  kPullReply = 4,
  kShare = 5,
  kReplica = 6,
  kReplicaReply = 7,
  kTransfer = 8,
  kTransferReply = 9,
  kJob = 10,
};

inline constexpr uint16_t kFlagDuplicate = 1;
inline constexpr uint16_t kFlagSkip = 2;
inline constexpr uint16_t kFlagDecided = 4;

struct Frame {
  uint32_t magic = kMagic;
  FrameType type = FrameType::kPush;
  uint16_t dtype = 0;  // v1::WireDType
  uint32_t partition = 0;
  int32_t status = 0;  // StatusCode of a reply
  uint64_t epoch = 0;
  uint64_t step = 0;
  uint64_t request_id = 0;
  uint64_t payload_bytes = 0;
  uint32_t contributor = 0;
  uint32_t contributors = 0;
  double value = 0;
  uint64_t version = 0;
  uint16_t flags = 0;
  uint16_t trace_hi = 0;  // the correlation id's high 16 bits (Correlation)
  uint32_t trace_lo = 0;  // and its low 32
};
static_assert(sizeof(Frame) == 80, "Frame is 80 bytes on the wire");
static_assert(offsetof(Frame, contributor) == 48 && offsetof(Frame, contributors) == 52 && offsetof(Frame, value) == 56,
              "the wire layout of Frame");
static_assert(offsetof(Frame, flags) == 72 && offsetof(Frame, trace_hi) == 74 && offsetof(Frame, trace_lo) == 76,
              "the wire layout of Frame's tail");

// The frame's trace correlation id (48 bits; 0: none).
inline uint64_t Correlation(const Frame& frame) {
  return static_cast<uint64_t>(frame.trace_hi) << 32 | frame.trace_lo;
}
inline void SetCorrelation(Frame& frame, uint64_t id) {
  frame.trace_hi = static_cast<uint16_t>(id >> 32);
  frame.trace_lo = static_cast<uint32_t>(id);
}

// A kReplica frame's learning rate (see kReplica above): the double's bits,
// low half in `contributor`, high half in `contributors`.
inline void SetReplicaLearningRate(Frame& frame, double lr) {
  const auto bits = std::bit_cast<uint64_t>(lr);
  frame.contributor = static_cast<uint32_t>(bits);
  frame.contributors = static_cast<uint32_t>(bits >> 32);
}
inline double ReplicaLearningRate(const Frame& frame) {
  return std::bit_cast<double>(static_cast<uint64_t>(frame.contributors) << 32 | frame.contributor);
}

// One partition's part of a sync step decision (kShare payload).
struct ShareEntry {
  uint32_t partition = 0;
  // Bit 0 (kShareFinite): the partition's reduced gradient holds no NaN or
  // Inf. Bit 1 (kShareDecided): the partition applied the step before (a
  // retry in a later epoch): `sum_squares` is then the clipping
  // coefficient the step was decided with, and bit 0 clear means skipped.
  uint32_t finite = 1;
  double sum_squares = 0;
};
inline constexpr uint32_t kShareFinite = 1;
inline constexpr uint32_t kShareDecided = 2;
static_assert(sizeof(ShareEntry) == 16);

const char* FrameTypeName(FrameType type);

// The reply to `request` with `type`: partition, epoch, step and request id
// copied, no payload.
inline Frame ReplyTo(const Frame& request, FrameType type) {
  Frame reply;
  reply.type = type;
  reply.partition = request.partition;
  reply.epoch = request.epoch;
  reply.step = request.step;
  reply.request_id = request.request_id;
  reply.contributor = request.contributor;
  reply.trace_hi = request.trace_hi;
  reply.trace_lo = request.trace_lo;
  return reply;
}

// The error payload of a reply carrying `status` (truncated to
// kMaxErrorBytes); sets reply.status and payload_bytes.
inline std::vector<char> ErrorPayload(Frame& reply, const Status& status) {
  std::string message = status.message().substr(0, kMaxErrorBytes);
  reply.status = static_cast<int32_t>(status.code());
  reply.payload_bytes = message.size();
  return {message.begin(), message.end()};
}

// The Status a reply carries (OK when status is 0).
inline Status ReplyStatus(const Frame& reply, const void* payload) {
  if (reply.status == 0) return Status::Ok();
  const size_t n = payload != nullptr ? static_cast<size_t>(reply.payload_bytes) : 0;
  const int code = reply.status;
  return Status(code > 0 && code <= 16 ? static_cast<StatusCode>(code) : StatusCode::kUnknown,
                std::string(static_cast<const char*>(payload), n));
}

}  // namespace tandem::ps
