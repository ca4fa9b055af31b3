#include "worker/comm/transport_communicator.h"

#include <algorithm>
#include <cstring>
#include <utility>

namespace tandem::comm {
namespace {

using std::chrono::milliseconds;

// Tags of the streams every collective shares (collective `seq` >= 1 uses
// (seq << 8) | phase, so these never collide with one).
constexpr uint64_t kDescriptorTag = 0;
constexpr uint64_t kNoticeTag = 1;
// Send/recv: the top bit, and the message's number between the two ranks.
constexpr uint64_t kPointToPointTag = uint64_t{1} << 63;

}  // namespace

Result<std::unique_ptr<TransportCommunicator>> TransportCommunicator::Create(
    CommInfo info, std::unique_ptr<transport::Transport> transport, TransportCommunicatorOptions options) {
  if (transport == nullptr) return InvalidArgument("communicator \"{}\" needs a transport", info.name);
  if (info.size < 1 || info.rank < 0 || info.rank >= info.size) {
    return InvalidArgument("communicator \"{}\": rank {} is not a rank of a group of {}", info.name, info.rank,
                           info.size);
  }
  if (transport->rank() != info.rank || transport->size() != info.size) {
    return InvalidArgument("communicator \"{}\" is rank {} of {}, but its transport is rank {} of {}", info.name,
                           info.rank, info.size, transport->rank(), transport->size());
  }
  if (options.chunk_bytes == 0) return InvalidArgument("communicator \"{}\": chunk_bytes must be positive", info.name);
  if (options.slice <= milliseconds(0)) {
    return InvalidArgument("communicator \"{}\": the wait slice must be positive, got {} ms", info.name,
                           options.slice.count());
  }
  return std::unique_ptr<TransportCommunicator>(
      new TransportCommunicator(std::move(info), std::move(transport), std::move(options)));
}

TransportCommunicator::TransportCommunicator(CommInfo info, std::unique_ptr<transport::Transport> transport,
                                             TransportCommunicatorOptions options)
    : Communicator(std::move(info)),
      transport_(std::move(transport)),
      options_(std::move(options)),
      sent_(static_cast<size_t>(size()), 0),
      received_(static_cast<size_t>(size()), 0),
      notices_in_(static_cast<size_t>(size())),
      notice_recvs_(static_cast<size_t>(size())) {
  check_.timeout = timeout();
  check_.slice = options_.slice;
  check_.interrupt = [this] { return Interrupted(); };
  collective_ = check_;
  collective_.chunk_bytes = options_.chunk_bytes;
  collective_.small_bytes = options_.small_bytes;
  collective_.check = false;  // CheckPeers does it, with sequence numbers
  collective_.workspace = &workspace_;
  // A rank that never enters is seen by its neighbours in CheckPeers, which
  // waits `timeout`; ranks stalled behind those neighbours wait a little
  // longer, so they report the neighbours' notice naming the absent rank
  // rather than their own stall.
  collective_.grace = 2 * options_.slice;
  for (int q = 0; q < size(); ++q) {
    if (q == rank()) continue;
    const auto uq = static_cast<size_t>(q);
    notice_recvs_[uq] = transport_->Recv(q, kNoticeTag, &notices_in_[uq], sizeof(Notice));
  }
}

TransportCommunicator::~TransportCommunicator() = default;

const char* TransportCommunicator::AllReduceAlgorithmName(size_t count, DType dtype) const {
  return collectives::AlgorithmName(collectives::AllReduceAlgorithm(size(), count, dtype, collective_));
}

std::string TransportCommunicator::Describe(const Descriptor& d) {
  return DescribeCollective(static_cast<Kind>(d.kind), d.seq, d.count, static_cast<DType>(d.dtype),
                            static_cast<ReduceOp>(d.op), d.root);
}

Status TransportCommunicator::CheckPeers(const Descriptor& mine) {
  const int n = size();
  if (n == 1) return Status::Ok();
  const int r = rank();
  const int left = (r + n - 1) % n;
  const int right = (r + 1) % n;
  descriptor_out_ = mine;
  // Both neighbours (one when n == 2): so both sides of a disagreement see it.
  const int peers[2] = {left, right};
  const int count = n == 2 ? 1 : 2;
  std::unique_ptr<transport::Request> recvs[2];
  std::unique_ptr<transport::Request> sends[2];
  for (int i = 0; i < count; ++i) {
    recvs[i] = transport_->Recv(peers[i], kDescriptorTag, &descriptor_in_[i], sizeof(Descriptor));
  }
  for (int i = 0; i < count; ++i) {
    sends[i] = transport_->Send(peers[i], kDescriptorTag, &descriptor_out_, sizeof(Descriptor));
  }
  // Whom this rank waited for (Communicator::last_wait): the neighbour whose
  // descriptor came last, and how long after this rank's entry. A neighbour
  // already there when the other one's came was not waited for.
  const auto entered = std::chrono::steady_clock::now();
  Wait wait;
  for (int i = 0; i < count; ++i) {
    const bool there = i > 0 && recvs[i]->Wait(milliseconds(0)).ok();
    if (!there) {
      TANDEM_RETURN_IF_ERROR(
          collectives::Wait(*recvs[i], r, peers[i], false, check_, "agreement check", -1, "entered this collective"));
      wait = Wait{peers[i], std::chrono::duration<double>(std::chrono::steady_clock::now() - entered).count()};
    }
    const Descriptor& theirs = descriptor_in_[i];
    if (std::memcmp(&theirs, &mine, sizeof(Descriptor)) != 0) {
      return InvalidArgument("rank {} runs {}, but rank {} runs {}", peers[i], Describe(theirs), r, Describe(mine));
    }
  }
  for (int i = 0; i < count; ++i) {
    TANDEM_RETURN_IF_ERROR(collectives::Wait(*sends[i], r, peers[i], true, check_, "agreement check"));
  }
  SetLastWait(wait);
  return Status::Ok();
}

Status TransportCommunicator::Interrupted() {
  if (aborted()) return health();
  for (int q = 0; q < size(); ++q) {
    auto& request = notice_recvs_[static_cast<size_t>(q)];
    if (request == nullptr) continue;
    const Status status = request->Wait(milliseconds(0));
    if (status.code() == StatusCode::kDeadlineExceeded) continue;  // nothing from q
    request.reset();
    failed_by_peer_ = true;
    if (!status.ok()) return status.WithContext(fmt::format("rank {} is unreachable", q));
    const Notice& notice = notices_in_[static_cast<size_t>(q)];
    auto code = static_cast<StatusCode>(notice.code);
    if (notice.code <= 0 || notice.code > static_cast<int>(StatusCode::kUnauthenticated)) code = StatusCode::kUnknown;
    const std::string text(notice.text, std::min<size_t>(notice.length, sizeof(notice.text)));
    return Status(code, fmt::format("rank {} failed: {}", q, text));
  }
  return Status::Ok();
}

Status TransportCommunicator::Fail(Status status) {
  if (failed_by_peer_ || notified_ || size() == 1) return status;
  notified_ = true;
  notice_out_.code = static_cast<int32_t>(status.code());
  const size_t length = std::min(status.message().size(), sizeof(notice_out_.text));
  std::memcpy(notice_out_.text, status.message().data(), length);
  notice_out_.length = static_cast<uint32_t>(length);
  for (int q = 0; q < size(); ++q) {
    if (q != rank()) notice_sends_.push_back(transport_->Send(q, kNoticeTag, &notice_out_, sizeof(Notice)));
  }
  // Best effort and briefly: a peer that is gone fails at once, and the
  // requests (and notice_out_) live as long as the communicator.
  const auto bound = std::min(options_.slice, timeout());
  for (auto& send : notice_sends_) (void)send->Wait(bound);
  return status;
}

template <typename Body>
Status TransportCommunicator::Collective(Kind kind, uint64_t seq, size_t count, DType dtype, ReduceOp op, int root,
                                         Body&& body) {
  Descriptor d;
  d.kind = static_cast<uint8_t>(kind);
  d.dtype = static_cast<uint8_t>(dtype);
  d.op = static_cast<uint8_t>(op);
  d.root = root;
  d.count = count;
  d.seq = seq;
  collective_.tag = seq;
  Status status = CheckPeers(d);
  if (status.ok()) status = body(collective_);
  if (status.ok()) return status;
  return Fail(status.WithContext(fmt::format("{} seq {}", KindName(kind), seq)));
}

Status TransportCommunicator::DoAllReduce(uint64_t seq, const void* in, void* out, size_t count, DType dtype,
                                          ReduceOp op) {
  return Collective(Kind::kAllReduce, seq, count, dtype, op, 0, [&](const collectives::CollectiveOptions& o) {
    return collectives::AllReduce(*transport_, in, out, count, dtype, op, o);
  });
}

Status TransportCommunicator::DoReduceScatter(uint64_t seq, const void* in, void* out, size_t count, DType dtype,
                                              ReduceOp op) {
  return Collective(Kind::kReduceScatter, seq, count, dtype, op, 0, [&](const collectives::CollectiveOptions& o) {
    return collectives::ReduceScatter(*transport_, in, out, count, dtype, op, o);
  });
}

Status TransportCommunicator::DoAllGather(uint64_t seq, const void* in, void* out, size_t count, DType dtype) {
  return Collective(Kind::kAllGather, seq, count, dtype, ReduceOp::kSum, 0,
                    [&](const collectives::CollectiveOptions& o) {
                      return collectives::AllGather(*transport_, in, out, count, dtype, o);
                    });
}

Status TransportCommunicator::DoBroadcast(uint64_t seq, void* data, size_t count, DType dtype, int root) {
  return Collective(Kind::kBroadcast, seq, count, dtype, ReduceOp::kSum, root,
                    [&](const collectives::CollectiveOptions& o) {
                      return collectives::Broadcast(*transport_, data, count, dtype, root, o);
                    });
}

Status TransportCommunicator::DoReduce(uint64_t seq, const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                                       int root) {
  return Collective(Kind::kReduce, seq, count, dtype, op, root, [&](const collectives::CollectiveOptions& o) {
    return collectives::Reduce(*transport_, in, out, count, dtype, op, root, o);
  });
}

Status TransportCommunicator::DoBarrier(uint64_t seq) {
  return Collective(Kind::kBarrier, seq, 0, DType::kFloat32, ReduceOp::kSum, 0,
                    [&](const collectives::CollectiveOptions& o) { return collectives::Barrier(*transport_, o); });
}

Status TransportCommunicator::DoSend(int peer, const void* data, size_t bytes) {
  static const char kNothing = 0;  // transports get a valid pointer even for empty messages
  const uint64_t tag = kPointToPointTag | sent_[static_cast<size_t>(peer)]++;
  auto request = transport_->Send(peer, tag, bytes > 0 ? data : &kNothing, bytes);
  const Status status = collectives::Wait(*request, rank(), peer, true, check_, "send");
  return status.ok() ? status : Fail(status);
}

Status TransportCommunicator::DoRecv(int peer, void* data, size_t bytes) {
  char nothing = 0;
  const uint64_t tag = kPointToPointTag | received_[static_cast<size_t>(peer)]++;
  auto request = transport_->Recv(peer, tag, bytes > 0 ? data : &nothing, bytes);
  const Status status = collectives::Wait(*request, rank(), peer, false, check_, "recv");
  return status.ok() ? status : Fail(status);
}

Status TransportCommunicator::DoSendRecv(int to, const void* send, int from, void* recv, size_t bytes) {
  static const char kNothing = 0;
  char nothing = 0;
  const uint64_t send_tag = kPointToPointTag | sent_[static_cast<size_t>(to)]++;
  const uint64_t recv_tag = kPointToPointTag | received_[static_cast<size_t>(from)]++;
  auto receiving = transport_->Recv(from, recv_tag, bytes > 0 ? recv : &nothing, bytes);
  auto sending = transport_->Send(to, send_tag, bytes > 0 ? send : &kNothing, bytes);
  const Status received = collectives::Wait(*receiving, rank(), from, false, check_, "recv");
  const Status sent = collectives::Wait(*sending, rank(), to, true, check_, "send");
  const Status status = received.ok() ? sent : received;
  return status.ok() ? status : Fail(status);
}

}  // namespace tandem::comm
