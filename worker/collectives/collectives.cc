#include "worker/collectives/collectives.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

namespace tandem::collectives {

using transport::Request;
using transport::Transport;

char* Workspace::Buffer(int slot, size_t bytes) {
  Slot& s = slots_[static_cast<size_t>(slot)];
  if (!s.data || s.size < bytes) {
    // Grow geometrically, so a slowly growing size does not reallocate every call.
    const size_t size = std::max<size_t>({bytes, s.size + s.size / 2, 64});
    s.data.reset(new char[size]);
    s.size = size;
  }
  return s.data.get();
}

const char* AlgorithmName(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::kRing:
      return "ring";
    case Algorithm::kRecursiveDoubling:
      return "recursive doubling";
    case Algorithm::kBruck:
      return "bruck";
    case Algorithm::kChain:
      return "chain";
    case Algorithm::kBinomialTree:
      return "binomial tree";
    case Algorithm::kDissemination:
      return "dissemination";
    case Algorithm::kTrivial:
      return "trivial";
  }
  return "unknown";
}

Algorithm AllReduceAlgorithm(int size, size_t count, DType dtype, const CollectiveOptions& options) {
  if (size <= 1 || count == 0) return Algorithm::kTrivial;
  if (count * SizeOf(dtype) <= options.small_bytes || count < static_cast<size_t>(size)) {
    return Algorithm::kRecursiveDoubling;
  }
  return Algorithm::kRing;
}

Algorithm ReduceScatterAlgorithm(int size, size_t count, DType dtype, const CollectiveOptions& options) {
  if (size <= 1 || count == 0) return Algorithm::kTrivial;
  if (count * static_cast<size_t>(size) * SizeOf(dtype) <= options.small_bytes) return Algorithm::kRecursiveDoubling;
  return Algorithm::kRing;
}

Algorithm AllGatherAlgorithm(int size, size_t count, DType dtype, const CollectiveOptions& options) {
  if (size <= 1 || count == 0) return Algorithm::kTrivial;
  if (count * static_cast<size_t>(size) * SizeOf(dtype) <= options.small_bytes) return Algorithm::kBruck;
  return Algorithm::kRing;
}

Algorithm BroadcastAlgorithm(int size, size_t count, DType dtype, const CollectiveOptions& options) {
  if (size <= 1 || count == 0) return Algorithm::kTrivial;
  if (count * SizeOf(dtype) <= options.small_bytes) return Algorithm::kBinomialTree;
  return Algorithm::kChain;
}

Algorithm ReduceAlgorithm(int size, size_t count, DType dtype, const CollectiveOptions& options) {
  if (size <= 1 || count == 0) return Algorithm::kTrivial;
  if (count * SizeOf(dtype) <= options.small_bytes || count < static_cast<size_t>(size)) {
    return Algorithm::kBinomialTree;
  }
  return Algorithm::kRing;
}

namespace {

std::string Where(const char* where, int step) {
  return step >= 0 ? fmt::format("{} {}", where, step) : std::string(where);
}

}  // namespace

Status Wait(Request& request, int self, int peer, bool sending, const CollectiveOptions& options, const char* where,
            int step, const char* never) {
  using Clock = std::chrono::steady_clock;
  using std::chrono::milliseconds;
  Status status;
  const milliseconds limit = options.timeout + std::max(options.grace, milliseconds(0));
  if (!options.interrupt) {
    status = request.Wait(limit);
  } else {
    const milliseconds slice = std::max(options.slice, milliseconds(1));
    const auto deadline = Clock::now() + limit;
    for (;;) {
      const auto left = std::chrono::ceil<milliseconds>(deadline - Clock::now());
      status = request.Wait(std::clamp(left, milliseconds(0), slice));
      if (status.code() != StatusCode::kDeadlineExceeded) break;
      TANDEM_RETURN_IF_ERROR(options.interrupt());
      if (Clock::now() >= deadline) break;
    }
  }
  if (status.ok()) return status;
  if (status.code() == StatusCode::kDeadlineExceeded) {
    if (never == nullptr) never = sending ? "took the data sent to it" : "sent its data";
    return DeadlineExceeded("rank {} never {} within {} ms (waiting on rank {} from rank {}, {})", peer, never,
                            options.timeout.count(), peer, self, Where(where, step));
  }
  return status.WithContext(fmt::format("{} on rank {}", Where(where, step), self));
}

namespace {

enum class Kind : uint32_t { kAllReduce = 1, kReduceScatter, kAllGather, kBroadcast, kBarrier, kReduce };

const char* KindName(Kind k) {
  switch (k) {
    case Kind::kAllReduce:
      return "all-reduce";
    case Kind::kReduceScatter:
      return "reduce-scatter";
    case Kind::kAllGather:
      return "all-gather";
    case Kind::kBroadcast:
      return "broadcast";
    case Kind::kBarrier:
      return "barrier";
    case Kind::kReduce:
      return "reduce";
  }
  return "collective";
}

// The message streams of one collective: tag (options.tag << 8) | phase.
enum Phase : uint64_t {
  kPhaseCheck = 1,
  kPhaseRingReduceScatter,
  kPhaseRingAllGather,
  kPhaseFoldIn,
  kPhaseFoldOut,
  kPhaseGather,
  kPhaseChain,
  kPhaseTree,
  kPhaseRounds = 16,  // + round, for the log-step algorithms (at most 64 rounds)
};

struct Descriptor {
  uint32_t kind;
  uint8_t dtype;
  uint8_t op;
  uint16_t root;
  uint64_t count;
};
static_assert(sizeof(Descriptor) == 16);

Descriptor Describe(Kind kind, size_t count, DType dtype, ReduceOp op, int root) {
  Descriptor d{};
  d.kind = static_cast<uint32_t>(kind);
  d.dtype = static_cast<uint8_t>(dtype);
  d.op = static_cast<uint8_t>(op);
  d.root = static_cast<uint16_t>(root);
  d.count = count;
  return d;
}

int Mod(int a, int n) {
  return ((a % n) + n) % n;
}

// What one call works with: the transport, the options, scratch, and the
// element size. Sizes passed to Send/Recv are in elements.
struct Ctx {
  Transport& t;
  const CollectiveOptions& o;
  Workspace& ws;
  DType dtype;
  size_t element;
  int n;
  int r;

  Ctx(Transport& transport, const CollectiveOptions& options, Workspace& workspace, DType type)
      : t(transport),
        o(options),
        ws(workspace),
        dtype(type),
        element(SizeOf(type)),
        n(transport.size()),
        r(transport.rank()) {}

  uint64_t Tag(uint64_t phase) const { return (o.tag << 8) | phase; }
  std::unique_ptr<Request> Send(int peer, uint64_t phase, const void* data, size_t elements) const {
    return t.Send(peer, Tag(phase), data, elements * element);
  }
  std::unique_ptr<Request> Recv(int peer, uint64_t phase, void* data, size_t elements) const {
    return t.Recv(peer, Tag(phase), data, elements * element);
  }
  Status Wait(Request& request, int peer, bool sending, const char* where, int step = -1) const {
    return collectives::Wait(request, r, peer, sending, o, where, step);
  }
  size_t Bytes(size_t elements) const { return elements * element; }
};

// Checks that the left neighbour runs the same collective with the same
// shape, and tells the right neighbour what this rank runs.
Status CheckNeighbours(Ctx& c, const Descriptor& mine) {
  if (!c.o.check) return Status::Ok();
  const int right = Mod(c.r + 1, c.n);
  const int left = Mod(c.r - 1, c.n);
  Descriptor theirs{};
  auto recv = c.t.Recv(left, c.Tag(kPhaseCheck), &theirs, sizeof(theirs));
  auto send = c.t.Send(right, c.Tag(kPhaseCheck), &mine, sizeof(mine));
  TANDEM_RETURN_IF_ERROR(c.Wait(*recv, left, false, "descriptor check"));
  TANDEM_RETURN_IF_ERROR(c.Wait(*send, right, true, "descriptor check"));
  if (std::memcmp(&theirs, &mine, sizeof(mine)) != 0) {
    return InvalidArgument(
        "rank {} runs {} of {} {} elements (op {}, root {}), but rank {} runs {} of {} {} elements (op {}, root {})",
        left, KindName(static_cast<Kind>(theirs.kind)), theirs.count, Name(static_cast<DType>(theirs.dtype)),
        Name(static_cast<ReduceOp>(theirs.op)), theirs.root, c.r, KindName(static_cast<Kind>(mine.kind)), mine.count,
        Name(static_cast<DType>(mine.dtype)), Name(static_cast<ReduceOp>(mine.op)), mine.root);
  }
  return Status::Ok();
}

// One ring step: sends send[0..send_count) to the right and receives
// recv_count elements from the left into recv, both cut into chunks of
// chunk_bytes and posted at once. When `mine` is set, each received chunk is
// reduced as soon as it arrives: recv[i] = op(recv[i], mine[i]).
Status RingStep(Ctx& c, const char* send, size_t send_count, char* recv, size_t recv_count, const char* mine,
                ReduceOp op, uint64_t phase, const char* where, int step) {
  const int right = Mod(c.r + 1, c.n);
  const int left = Mod(c.r - 1, c.n);
  const size_t per = std::max<size_t>(1, c.o.chunk_bytes / c.element);
  auto& recvs = c.ws.Requests(0);
  auto& sends = c.ws.Requests(1);
  recvs.clear();
  sends.clear();
  for (size_t off = 0; off < recv_count; off += per) {
    recvs.push_back(c.Recv(left, phase, recv + c.Bytes(off), std::min(per, recv_count - off)));
  }
  for (size_t off = 0; off < send_count; off += per) {
    sends.push_back(c.Send(right, phase, send + c.Bytes(off), std::min(per, send_count - off)));
  }
  Status status;
  size_t i = 0;
  for (size_t off = 0; off < recv_count && status.ok(); off += per, ++i) {
    status = c.Wait(*recvs[i], left, false, where, step);
    if (status.ok() && mine != nullptr) {
      Reduce(recv + c.Bytes(off), mine + c.Bytes(off), std::min(per, recv_count - off), c.dtype, op);
    }
  }
  // After a failure the remaining requests are dropped (the transport
  // cancels them) rather than waited on for another timeout.
  for (size_t j = 0; j < sends.size() && status.ok(); ++j) status = c.Wait(*sends[j], right, true, where, step);
  recvs.clear();
  sends.clear();
  return status;
}

// The reduce-scatter half of the ring over in[0..count) cut into n blocks.
// `in` is only read; partial sums live in two block-sized workspace buffers
// used in turn. On return *result points at the one holding the full
// reduction of block (r + shift) mod n.
Status RingReduceScatter(Ctx& c, const char* in, size_t count, ReduceOp op, int shift, const char** result) {
  const int n = c.n;
  const size_t max_block = BlockCount(count, n, 0);
  char* buffers[2] = {c.ws.Buffer(0, c.Bytes(max_block)), c.ws.Buffer(1, c.Bytes(max_block))};
  for (int s = 0; s < n - 1; ++s) {
    // At step s rank r sends the block it finished reducing at step s-1 (at
    // step 0, its own input) and receives the left neighbour's partial sum
    // of the next one.
    const int send_block = Mod(c.r - s + shift - 1, n);
    const int recv_block = Mod(c.r - s + shift - 2, n);
    const char* send = s == 0 ? in + c.Bytes(BlockOffset(count, n, send_block)) : buffers[(s - 1) % 2];
    TANDEM_RETURN_IF_ERROR(RingStep(c, send, BlockCount(count, n, send_block), buffers[s % 2],
                                    BlockCount(count, n, recv_block), in + c.Bytes(BlockOffset(count, n, recv_block)),
                                    op, kPhaseRingReduceScatter, "ring reduce-scatter step", s));
  }
  *result = buffers[(n - 2) % 2];
  return Status::Ok();
}

// The all-gather half: rank r starts holding block (r + shift) mod n of
// data[0..count) and ends holding all of them.
Status RingAllGather(Ctx& c, char* data, size_t count, int shift) {
  const int n = c.n;
  for (int s = 0; s < n - 1; ++s) {
    const int send_block = Mod(c.r - s + shift, n);
    const int recv_block = Mod(c.r - s + shift - 1, n);
    TANDEM_RETURN_IF_ERROR(RingStep(c, data + c.Bytes(BlockOffset(count, n, send_block)),
                                    BlockCount(count, n, send_block), data + c.Bytes(BlockOffset(count, n, recv_block)),
                                    BlockCount(count, n, recv_block), nullptr, ReduceOp::kSum, kPhaseRingAllGather,
                                    "ring all-gather step", s));
  }
  return Status::Ok();
}

// Reduces a (lower rank's operand) and b (higher rank's) into whichever of
// the two `*mine` is; swaps the pointers when the result lands in `other`.
void ReduceOrdered(Ctx& c, char** mine, char** other, size_t count, ReduceOp op, bool other_is_lower) {
  if (other_is_lower) {
    Reduce(*other, *mine, count, c.dtype, op);
    std::swap(*mine, *other);
  } else {
    Reduce(*mine, *other, count, c.dtype, op);
  }
}

// Recursive doubling over buf[0..count) (this rank's contribution in, the
// reduction over all ranks out), with the fold-in for sizes that are not a
// power of two (see the header).
Status RecursiveDoubling(Ctx& c, char* buf, size_t count, ReduceOp op) {
  const int n = c.n;
  const int r = c.r;
  char* cur = buf;
  char* other = c.ws.Buffer(2, c.Bytes(count));
  int p = 1;
  while (p * 2 <= n) p *= 2;
  const int rem = n - p;
  int core = r - rem;  // rank within the power-of-two core; -1 for a rank folded out
  if (r < 2 * rem) {
    if (r % 2 == 0) {
      auto send = c.Send(r + 1, kPhaseFoldIn, cur, count);
      TANDEM_RETURN_IF_ERROR(c.Wait(*send, r + 1, true, "recursive doubling fold-in"));
      core = -1;
    } else {
      auto recv = c.Recv(r - 1, kPhaseFoldIn, other, count);
      TANDEM_RETURN_IF_ERROR(c.Wait(*recv, r - 1, false, "recursive doubling fold-in"));
      ReduceOrdered(c, &cur, &other, count, op, /*other_is_lower=*/true);
      core = r / 2;
    }
  }
  if (core >= 0) {
    for (int mask = 1, round = 0; mask < p; mask <<= 1, ++round) {
      const int core_peer = core ^ mask;
      const int peer = core_peer < rem ? core_peer * 2 + 1 : core_peer + rem;
      auto recv = c.Recv(peer, kPhaseRounds + static_cast<uint64_t>(round), other, count);
      auto send = c.Send(peer, kPhaseRounds + static_cast<uint64_t>(round), cur, count);
      TANDEM_RETURN_IF_ERROR(c.Wait(*recv, peer, false, "recursive doubling round", round));
      TANDEM_RETURN_IF_ERROR(c.Wait(*send, peer, true, "recursive doubling round", round));
      ReduceOrdered(c, &cur, &other, count, op, peer < r);
    }
  }
  if (r < 2 * rem) {
    if (r % 2 == 0) {
      auto recv = c.Recv(r + 1, kPhaseFoldOut, cur, count);
      TANDEM_RETURN_IF_ERROR(c.Wait(*recv, r + 1, false, "recursive doubling fold-out"));
    } else {
      auto send = c.Send(r - 1, kPhaseFoldOut, cur, count);
      TANDEM_RETURN_IF_ERROR(c.Wait(*send, r - 1, true, "recursive doubling fold-out"));
    }
  }
  if (cur != buf) std::memcpy(buf, cur, c.Bytes(count));
  return Status::Ok();
}

// Bruck's all-gather: position j of a staging buffer holds block (r + j) mod
// n; at step k a rank sends its first min(2^k, n - 2^k) blocks to rank
// r - 2^k and appends those of rank r + 2^k. The blocks are then rotated
// into place.
Status Bruck(Ctx& c, const char* in, char* out, size_t count) {
  const int n = c.n;
  const size_t block = c.Bytes(count);
  char* staging = c.ws.Buffer(3, block * static_cast<size_t>(n));
  std::memcpy(staging, in, block);
  int have = 1;
  for (int round = 0; have < n; ++round) {
    const int distance = have;
    const int blocks = std::min(distance, n - have);
    const int to = Mod(c.r - distance, n);
    const int from = Mod(c.r + distance, n);
    const auto phase = kPhaseRounds + static_cast<uint64_t>(round);
    auto recv = c.Recv(from, phase, staging + block * static_cast<size_t>(have), count * static_cast<size_t>(blocks));
    auto send = c.Send(to, phase, staging, count * static_cast<size_t>(blocks));
    TANDEM_RETURN_IF_ERROR(c.Wait(*recv, from, false, "bruck all-gather round", round));
    TANDEM_RETURN_IF_ERROR(c.Wait(*send, to, true, "bruck all-gather round", round));
    have += blocks;
  }
  for (int j = 0; j < n; ++j) {
    std::memcpy(out + block * static_cast<size_t>(Mod(c.r + j, n)), staging + block * static_cast<size_t>(j), block);
  }
  return Status::Ok();
}

}  // namespace

Status AllReduce(Transport& t, const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                 const CollectiveOptions& options) {
  Workspace local;
  Ctx c(t, options, options.workspace != nullptr ? *options.workspace : local, dtype);
  auto* bytes = static_cast<char*>(out);
  const auto* input = static_cast<const char*>(in);
  if (c.n == 1) {
    if (in != out && count > 0) std::memmove(out, in, c.Bytes(count));
    return Status::Ok();  // avg over one rank is the identity
  }
  TANDEM_RETURN_IF_ERROR(CheckNeighbours(c, Describe(Kind::kAllReduce, count, dtype, op, 0)));
  switch (AllReduceAlgorithm(c.n, count, dtype, options)) {
    case Algorithm::kRecursiveDoubling:
      if (in != out) std::memcpy(bytes, input, c.Bytes(count));
      TANDEM_RETURN_IF_ERROR(RecursiveDoubling(c, bytes, count, op));
      if (op == ReduceOp::kAvg) Divide(bytes, count, dtype, c.n);
      return Status::Ok();
    case Algorithm::kRing: {
      // After the reduce-scatter rank r owns block (r + 1) mod n, which the
      // all-gather then starts from. in == out is fine: the reduce-scatter
      // only reads `in`, and out is written after it.
      const char* reduced = nullptr;
      TANDEM_RETURN_IF_ERROR(RingReduceScatter(c, input, count, op, /*shift=*/1, &reduced));
      const int owned = Mod(c.r + 1, c.n);
      char* block = bytes + c.Bytes(BlockOffset(count, c.n, owned));
      std::memcpy(block, reduced, c.Bytes(BlockCount(count, c.n, owned)));
      if (op == ReduceOp::kAvg) Divide(block, BlockCount(count, c.n, owned), dtype, c.n);
      return RingAllGather(c, bytes, count, /*shift=*/1);
    }
    default:
      return Status::Ok();  // nothing to move
  }
}

Status AllReduce(Transport& t, void* data, size_t count, DType dtype, ReduceOp op, const CollectiveOptions& options) {
  return AllReduce(t, data, data, count, dtype, op, options);
}

Status ReduceScatter(Transport& t, const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                     const CollectiveOptions& options) {
  Workspace local;
  Ctx c(t, options, options.workspace != nullptr ? *options.workspace : local, dtype);
  if (c.n == 1) {
    if (in != out && count > 0) std::memmove(out, in, c.Bytes(count));
    return Status::Ok();
  }
  TANDEM_RETURN_IF_ERROR(CheckNeighbours(c, Describe(Kind::kReduceScatter, count, dtype, op, 0)));
  const size_t total = count * static_cast<size_t>(c.n);
  const char* reduced = nullptr;  // this rank's block, reduced
  switch (ReduceScatterAlgorithm(c.n, count, dtype, options)) {
    case Algorithm::kRecursiveDoubling: {
      char* work = c.ws.Buffer(3, c.Bytes(total));
      std::memcpy(work, in, c.Bytes(total));
      TANDEM_RETURN_IF_ERROR(RecursiveDoubling(c, work, total, op));
      reduced = work + c.Bytes(count * static_cast<size_t>(c.r));
      break;
    }
    case Algorithm::kRing:
      // Blocks of exactly `count`: shift 0 leaves rank r owning block r.
      TANDEM_RETURN_IF_ERROR(RingReduceScatter(c, static_cast<const char*>(in), total, op, /*shift=*/0, &reduced));
      break;
    default:
      return Status::Ok();
  }
  std::memcpy(out, reduced, c.Bytes(count));
  if (op == ReduceOp::kAvg) Divide(out, count, dtype, c.n);
  return Status::Ok();
}

Status AllGather(Transport& t, const void* in, void* out, size_t count, DType dtype, const CollectiveOptions& options) {
  Workspace local;
  Ctx c(t, options, options.workspace != nullptr ? *options.workspace : local, dtype);
  auto* bytes = static_cast<char*>(out);
  char* mine = bytes + c.Bytes(count * static_cast<size_t>(c.r));
  if (c.n == 1) {
    if (in != mine && count > 0) std::memmove(mine, in, c.Bytes(count));
    return Status::Ok();
  }
  TANDEM_RETURN_IF_ERROR(CheckNeighbours(c, Describe(Kind::kAllGather, count, dtype, ReduceOp::kSum, 0)));
  switch (AllGatherAlgorithm(c.n, count, dtype, options)) {
    case Algorithm::kBruck:
      return Bruck(c, static_cast<const char*>(in), bytes, count);
    case Algorithm::kRing:
      if (in != mine) std::memmove(mine, in, c.Bytes(count));
      // Rank r starts with block r: shift 0.
      return RingAllGather(c, bytes, count * static_cast<size_t>(c.n), /*shift=*/0);
    default:
      return Status::Ok();
  }
}

Status Broadcast(Transport& t, void* data, size_t count, DType dtype, int root, const CollectiveOptions& options) {
  Workspace local;
  Ctx c(t, options, options.workspace != nullptr ? *options.workspace : local, dtype);
  const int n = c.n;
  if (root < 0 || root >= n) return InvalidArgument("broadcast root {} is not a rank of a group of {}", root, n);
  if (n == 1) return Status::Ok();
  TANDEM_RETURN_IF_ERROR(CheckNeighbours(c, Describe(Kind::kBroadcast, count, dtype, ReduceOp::kSum, root)));
  auto* bytes = static_cast<char*>(data);
  const int position = Mod(c.r - root, n);
  auto& sends = c.ws.Requests(1);
  sends.clear();
  Status status;
  switch (BroadcastAlgorithm(n, count, dtype, options)) {
    case Algorithm::kBinomialTree: {
      // Position v receives from v - lowbit(v), then sends to v + 2^k for
      // every 2^k below lowbit(v).
      int mask = 1;
      for (; mask < n; mask <<= 1) {
        if ((position & mask) != 0) {
          const int parent = Mod(c.r - mask, n);
          auto recv = c.Recv(parent, kPhaseTree, bytes, count);
          TANDEM_RETURN_IF_ERROR(c.Wait(*recv, parent, false, "binomial tree broadcast"));
          break;
        }
      }
      std::array<int, 64> children{};
      for (mask >>= 1; mask > 0; mask >>= 1) {
        if (position + mask < n) {
          const int child = Mod(c.r + mask, n);
          children[sends.size()] = child;
          sends.push_back(c.Send(child, kPhaseTree, bytes, count));
        }
      }
      for (size_t j = 0; j < sends.size() && status.ok(); ++j) {
        status = c.Wait(*sends[j], children[j], true, "binomial tree broadcast");
      }
      sends.clear();
      return status;
    }
    case Algorithm::kChain: {
      // A chain root -> root+1 -> ... -> root-1, pipelined by chunks: each
      // rank forwards a chunk as soon as it has it.
      const int left = Mod(c.r - 1, n);
      const int right = Mod(c.r + 1, n);
      const size_t per = std::max<size_t>(1, options.chunk_bytes / c.element);
      auto& recvs = c.ws.Requests(0);
      recvs.clear();
      if (position != 0) {
        for (size_t off = 0; off < count; off += per) {
          recvs.push_back(c.Recv(left, kPhaseChain, bytes + c.Bytes(off), std::min(per, count - off)));
        }
      }
      size_t i = 0;
      for (size_t off = 0; off < count && status.ok(); off += per, ++i) {
        if (position != 0) status = c.Wait(*recvs[i], left, false, "chain broadcast chunk", static_cast<int>(i));
        if (status.ok() && position != n - 1) {
          sends.push_back(c.Send(right, kPhaseChain, bytes + c.Bytes(off), std::min(per, count - off)));
        }
      }
      for (size_t j = 0; j < sends.size() && status.ok(); ++j) {
        status = c.Wait(*sends[j], right, true, "chain broadcast chunk", static_cast<int>(j));
      }
      recvs.clear();
      sends.clear();
      return status;
    }
    default:
      return Status::Ok();
  }
}

Status Reduce(Transport& t, const void* in, void* out, size_t count, DType dtype, ReduceOp op, int root,
              const CollectiveOptions& options) {
  Workspace local;
  Ctx c(t, options, options.workspace != nullptr ? *options.workspace : local, dtype);
  const int n = c.n;
  if (root < 0 || root >= n) return InvalidArgument("reduce root {} is not a rank of a group of {}", root, n);
  if (n == 1) {
    if (in != out && count > 0) std::memmove(out, in, c.Bytes(count));
    return Status::Ok();
  }
  TANDEM_RETURN_IF_ERROR(CheckNeighbours(c, Describe(Kind::kReduce, count, dtype, op, root)));
  const auto* input = static_cast<const char*>(in);
  auto* result = static_cast<char*>(out);
  switch (ReduceAlgorithm(n, count, dtype, options)) {
    case Algorithm::kBinomialTree: {
      // Position v receives the partial results of v + 1, v + 2, v + 4, ...
      // (below its lowest set bit), then sends its own to v - lowbit(v).
      char* acc = c.r == root ? result : c.ws.Buffer(3, c.Bytes(count));
      if (acc != input) std::memcpy(acc, input, c.Bytes(count));
      char* other = c.ws.Buffer(2, c.Bytes(count));
      const int position = Mod(c.r - root, n);
      for (int mask = 1, round = 0; mask < n; mask <<= 1, ++round) {
        if ((position & mask) != 0) {
          const int parent = Mod(c.r - mask, n);
          auto send = c.Send(parent, kPhaseTree, acc, count);
          TANDEM_RETURN_IF_ERROR(c.Wait(*send, parent, true, "binomial tree reduce round", round));
          break;
        }
        if (position + mask < n) {
          const int child = Mod(c.r + mask, n);
          auto recv = c.Recv(child, kPhaseTree, other, count);
          TANDEM_RETURN_IF_ERROR(c.Wait(*recv, child, false, "binomial tree reduce round", round));
          Reduce(acc, other, count, dtype, op);  // this rank's position is the lower
        }
      }
      break;
    }
    case Algorithm::kRing: {
      // The ring reduce-scatter leaves rank r with block r reduced; the
      // blocks are then gathered straight into the root's output.
      const char* reduced = nullptr;
      TANDEM_RETURN_IF_ERROR(RingReduceScatter(c, input, count, op, /*shift=*/0, &reduced));
      const size_t mine = BlockCount(count, n, c.r);
      if (c.r != root) {
        if (mine == 0) return Status::Ok();
        auto send = c.Send(root, kPhaseGather, reduced, mine);
        return c.Wait(*send, root, true, "gather to the root");
      }
      std::memcpy(result + c.Bytes(BlockOffset(count, n, c.r)), reduced, c.Bytes(mine));
      auto& recvs = c.ws.Requests(0);
      recvs.clear();
      for (int q = 0; q < n; ++q) {
        if (q == c.r || BlockCount(count, n, q) == 0) continue;
        recvs.push_back(c.Recv(q, kPhaseGather, result + c.Bytes(BlockOffset(count, n, q)), BlockCount(count, n, q)));
      }
      size_t i = 0;
      Status status;
      for (int q = 0; q < n && status.ok(); ++q) {
        if (q == c.r || BlockCount(count, n, q) == 0) continue;
        status = c.Wait(*recvs[i++], q, false, "gather to the root");
      }
      recvs.clear();
      TANDEM_RETURN_IF_ERROR(status);
      break;
    }
    default:
      return Status::Ok();
  }
  if (c.r == root && op == ReduceOp::kAvg) Divide(result, count, dtype, n);
  return Status::Ok();
}

Status Barrier(Transport& t, const CollectiveOptions& options) {
  Workspace local;
  Ctx c(t, options, options.workspace != nullptr ? *options.workspace : local, DType::kInt32);
  if (c.n == 1) return Status::Ok();
  TANDEM_RETURN_IF_ERROR(CheckNeighbours(c, Describe(Kind::kBarrier, 0, DType::kInt32, ReduceOp::kSum, 0)));
  // Dissemination: at step k every rank signals rank r + 2^k and waits for
  // rank r - 2^k; after ceil(log2 n) steps each has heard, directly or not,
  // from every rank.
  const uint8_t token = 1;
  uint8_t received = 0;
  for (int distance = 1, round = 0; distance < c.n; distance <<= 1, ++round) {
    const int to = Mod(c.r + distance, c.n);
    const int from = Mod(c.r - distance, c.n);
    const auto tag = c.Tag(kPhaseRounds + static_cast<uint64_t>(round));
    auto recv = t.Recv(from, tag, &received, 1);
    auto send = t.Send(to, tag, &token, 1);
    TANDEM_RETURN_IF_ERROR(c.Wait(*recv, from, false, "dissemination barrier round", round));
    TANDEM_RETURN_IF_ERROR(c.Wait(*send, to, true, "dissemination barrier round", round));
  }
  return Status::Ok();
}

}  // namespace tandem::collectives
