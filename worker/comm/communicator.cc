#include "worker/comm/communicator.h"

#include <algorithm>
#include <future>
#include <utility>

#include <fmt/format.h>

namespace tandem::comm {

const char* KindName(Kind kind) {
  switch (kind) {
    case Kind::kAllReduce:
      return "allreduce";
    case Kind::kReduceScatter:
      return "reduce_scatter";
    case Kind::kAllGather:
      return "all_gather";
    case Kind::kBroadcast:
      return "broadcast";
    case Kind::kReduce:
      return "reduce";
    case Kind::kBarrier:
      return "barrier";
    case Kind::kSend:
      return "send";
    case Kind::kRecv:
      return "recv";
  }
  return "collective";
}

std::string DescribeCollective(Kind kind, uint64_t seq, uint64_t count, DType dtype, ReduceOp op, int root) {
  const auto type = collectives::Name(dtype);
  const auto op_name = collectives::Name(op);
  switch (kind) {
    case Kind::kBarrier:
      return fmt::format("barrier seq {}", seq);
    case Kind::kAllGather:
      return fmt::format("all_gather seq {} of {} {} elements", seq, count, type);
    case Kind::kBroadcast:
      return fmt::format("broadcast seq {} of {} {} elements from root {}", seq, count, type, root);
    case Kind::kReduce:
      return fmt::format("reduce seq {} of {} {} elements (op {}) to root {}", seq, count, type, op_name, root);
    default:
      return fmt::format("{} seq {} of {} {} elements (op {})", KindName(kind), seq, count, type, op_name);
  }
}

Communicator::Communicator(CommInfo info) : info_(std::move(info)) {}

Status Communicator::health() const {
  MutexLock lock(&mu_);
  return broken_;
}

void Communicator::Abort(const std::string& reason) {
  {
    MutexLock lock(&mu_);
    if (aborted_.load()) return;
    if (broken_.ok()) {
      broken_ = Aborted("communicator \"{}\" of epoch {} was aborted: {}", info_.name, info_.epoch, reason);
    }
    aborted_.store(true, std::memory_order_release);
  }
  OnAbort();
}

uint64_t Communicator::member_id(int rank) const {
  if (rank < 0 || static_cast<size_t>(rank) >= info_.member_ids.size()) return 0;
  return info_.member_ids[static_cast<size_t>(rank)];
}

Progress Communicator::progress() const {
  Progress p;
  p.communicator = info_.name;
  p.last_entered = entered_.load();
  p.last_completed = completed_.load();
  const auto kind = last_kind_.load();
  if (kind != 0) p.last_kind = KindName(static_cast<Kind>(kind));
  return p;
}

Status Communicator::Begin(Kind kind, uint64_t* seq) {
  {
    MutexLock lock(&mu_);
    if (!broken_.ok()) return broken_;
  }
  last_kind_.store(static_cast<uint8_t>(kind));
  if (seq != nullptr) {
    *seq = entered_.fetch_add(1) + 1;  // point to point is not numbered
    last_wait_ = Wait{};
  }
  return Status::Ok();
}

void Communicator::Observe(Kind kind, uint64_t bytes, std::chrono::steady_clock::time_point started) const {
  if (!observer_) return;
  observer_(kind, bytes, std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
}

Status Communicator::Finish(Status status, bool numbered) {
  if (status.ok()) {
    if (numbered) completed_.fetch_add(1);
    return status;
  }
  MutexLock lock(&mu_);
  // An abort that raced the failure explains it better than the symptom.
  if (!broken_.ok()) return broken_;
  broken_ = status;
  return status;
}

namespace {

Status CheckBuffer(const void* p, size_t count, const char* what) {
  if (count > 0 && p == nullptr) return InvalidArgument("{} is null but count is {}", what, count);
  return Status::Ok();
}

Status CheckRoot(int root, int size, const char* what) {
  if (root < 0 || root >= size) return InvalidArgument("{} {} is not a rank of a group of {}", what, root, size);
  return Status::Ok();
}

Status CheckOp(DType dtype, ReduceOp op) {
  if (static_cast<int>(dtype) > static_cast<int>(DType::kInt64)) {
    return InvalidArgument("unknown dtype {}", static_cast<int>(dtype));
  }
  if (static_cast<int>(op) > static_cast<int>(ReduceOp::kMax)) {
    return InvalidArgument("unknown reduction op {}", static_cast<int>(op));
  }
  return Status::Ok();
}

}  // namespace

#define TANDEM_COMM_RUN(kind, bytes, call)                 \
  do {                                                     \
    uint64_t seq = 0;                                      \
    TANDEM_RETURN_IF_ERROR(Begin(kind, &seq));             \
    const auto started = std::chrono::steady_clock::now(); \
    Status done = Finish(call, true);                      \
    if (done.ok()) Observe(kind, bytes, started);          \
    return done;                                           \
  } while (false)

Status Communicator::AllReduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op) {
  TANDEM_RETURN_IF_ERROR(CheckOp(dtype, op));
  TANDEM_RETURN_IF_ERROR(CheckBuffer(in, count, "allreduce input"));
  TANDEM_RETURN_IF_ERROR(CheckBuffer(out, count, "allreduce output"));
  TANDEM_COMM_RUN(Kind::kAllReduce, count * collectives::SizeOf(dtype), DoAllReduce(seq, in, out, count, dtype, op));
}

Status Communicator::ReduceScatter(const void* in, void* out, size_t count, DType dtype, ReduceOp op) {
  TANDEM_RETURN_IF_ERROR(CheckOp(dtype, op));
  TANDEM_RETURN_IF_ERROR(CheckBuffer(in, count, "reduce_scatter input"));
  TANDEM_RETURN_IF_ERROR(CheckBuffer(out, count, "reduce_scatter output"));
  TANDEM_COMM_RUN(Kind::kReduceScatter, count * static_cast<uint64_t>(size()) * collectives::SizeOf(dtype),
                  DoReduceScatter(seq, in, out, count, dtype, op));
}

Status Communicator::AllGather(const void* in, void* out, size_t count, DType dtype) {
  TANDEM_RETURN_IF_ERROR(CheckOp(dtype, ReduceOp::kSum));
  TANDEM_RETURN_IF_ERROR(CheckBuffer(in, count, "all_gather input"));
  TANDEM_RETURN_IF_ERROR(CheckBuffer(out, count, "all_gather output"));
  TANDEM_COMM_RUN(Kind::kAllGather, count * static_cast<uint64_t>(size()) * collectives::SizeOf(dtype),
                  DoAllGather(seq, in, out, count, dtype));
}

Status Communicator::Broadcast(void* data, size_t count, DType dtype, int root) {
  TANDEM_RETURN_IF_ERROR(CheckOp(dtype, ReduceOp::kSum));
  TANDEM_RETURN_IF_ERROR(CheckRoot(root, size(), "broadcast root"));
  TANDEM_RETURN_IF_ERROR(CheckBuffer(data, count, "broadcast buffer"));
  TANDEM_COMM_RUN(Kind::kBroadcast, count * collectives::SizeOf(dtype), DoBroadcast(seq, data, count, dtype, root));
}

Status Communicator::Reduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op, int root) {
  TANDEM_RETURN_IF_ERROR(CheckOp(dtype, op));
  TANDEM_RETURN_IF_ERROR(CheckRoot(root, size(), "reduce root"));
  TANDEM_RETURN_IF_ERROR(CheckBuffer(in, count, "reduce input"));
  if (rank() == root) TANDEM_RETURN_IF_ERROR(CheckBuffer(out, count, "reduce output"));
  TANDEM_COMM_RUN(Kind::kReduce, count * collectives::SizeOf(dtype), DoReduce(seq, in, out, count, dtype, op, root));
}

Status Communicator::Barrier() {
  TANDEM_COMM_RUN(Kind::kBarrier, 0, DoBarrier(seq));
}

Status Communicator::Send(int peer, const void* data, size_t count, DType dtype) {
  TANDEM_RETURN_IF_ERROR(CheckOp(dtype, ReduceOp::kSum));
  TANDEM_RETURN_IF_ERROR(CheckRoot(peer, size(), "send peer"));
  if (peer == rank()) return InvalidArgument("rank {} cannot send to itself", peer);
  TANDEM_RETURN_IF_ERROR(CheckBuffer(data, count, "send buffer"));
  TANDEM_RETURN_IF_ERROR(Begin(Kind::kSend, nullptr));
  const uint64_t bytes = count * collectives::SizeOf(dtype);
  const auto started = std::chrono::steady_clock::now();
  Status done = Finish(DoSend(peer, data, bytes), false);
  if (done.ok()) Observe(Kind::kSend, bytes, started);
  return done;
}

Status Communicator::Recv(int peer, void* data, size_t count, DType dtype) {
  TANDEM_RETURN_IF_ERROR(CheckOp(dtype, ReduceOp::kSum));
  TANDEM_RETURN_IF_ERROR(CheckRoot(peer, size(), "recv peer"));
  if (peer == rank()) return InvalidArgument("rank {} cannot receive from itself", peer);
  TANDEM_RETURN_IF_ERROR(CheckBuffer(data, count, "recv buffer"));
  TANDEM_RETURN_IF_ERROR(Begin(Kind::kRecv, nullptr));
  const uint64_t bytes = count * collectives::SizeOf(dtype);
  const auto started = std::chrono::steady_clock::now();
  Status done = Finish(DoRecv(peer, data, bytes), false);
  if (done.ok()) Observe(Kind::kRecv, bytes, started);
  return done;
}

Status Communicator::SendRecv(int to, const void* send, int from, void* recv, size_t count, DType dtype) {
  TANDEM_RETURN_IF_ERROR(CheckOp(dtype, ReduceOp::kSum));
  TANDEM_RETURN_IF_ERROR(CheckRoot(to, size(), "sendrecv destination"));
  TANDEM_RETURN_IF_ERROR(CheckRoot(from, size(), "sendrecv source"));
  if (to == rank() || from == rank()) return InvalidArgument("rank {} cannot send to or receive from itself", rank());
  TANDEM_RETURN_IF_ERROR(CheckBuffer(send, count, "sendrecv send buffer"));
  TANDEM_RETURN_IF_ERROR(CheckBuffer(recv, count, "sendrecv receive buffer"));
  TANDEM_RETURN_IF_ERROR(Begin(Kind::kSend, nullptr));
  const uint64_t bytes = count * collectives::SizeOf(dtype);
  const auto started = std::chrono::steady_clock::now();
  Status done = Finish(DoSendRecv(to, send, from, recv, bytes), false);
  if (done.ok()) Observe(Kind::kSend, bytes, started);
  return done;
}

Status Communicator::DoSendRecv(int to, const void* send, int from, void* recv, size_t bytes) {
  auto sent = std::async(std::launch::async, [&] { return DoSend(to, send, bytes); });
  Status received = DoRecv(from, recv, bytes);
  Status s = sent.get();
  return received.ok() ? s : received;
}

#undef TANDEM_COMM_RUN

}  // namespace tandem::comm
