#include "worker/collectives/collectives.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

namespace tandem::collectives {
namespace {

using transport::Request;
using transport::Transport;

enum class Kind : uint32_t { kAllReduce = 1, kReduceScatter, kAllGather, kBroadcast, kBarrier };

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
  }
  return "collective";
}

struct Descriptor {
  uint32_t kind;
  uint8_t dtype;
  uint8_t op;
  uint16_t root;
  uint64_t count;
};
static_assert(sizeof(Descriptor) == 16);

int Mod(int a, int n) {
  return ((a % n) + n) % n;
}

// Block b of `count` elements split over `n` blocks: [offset, offset + size).
size_t BlockOffset(size_t count, int n, int b) {
  const size_t base = count / static_cast<size_t>(n);
  const size_t extra = count % static_cast<size_t>(n);
  const auto ub = static_cast<size_t>(b);
  return ub * base + std::min(ub, extra);
}
size_t BlockSize(size_t count, int n, int b) {
  return BlockOffset(count, n, b + 1) - BlockOffset(count, n, b);
}

// Checks that the left neighbour runs the same collective with the same
// shape, and tells the right neighbour what this rank runs.
Status CheckNeighbours(Transport& t, const Descriptor& mine, const CollectiveOptions& options) {
  const int right = Mod(t.rank() + 1, t.size());
  const int left = Mod(t.rank() - 1, t.size());
  Descriptor theirs{};
  auto recv = t.Recv(left, options.tag, &theirs, sizeof(theirs));
  auto send = t.Send(right, options.tag, &mine, sizeof(mine));
  TANDEM_RETURN_IF_ERROR(recv->Wait(options.timeout));
  TANDEM_RETURN_IF_ERROR(send->Wait(options.timeout));
  if (std::memcmp(&theirs, &mine, sizeof(mine)) != 0) {
    return InvalidArgument(
        "rank {} runs {} of {} {} elements (op {}, root {}), but rank {} runs {} of {} {} elements (op {}, root {})",
        left, KindName(static_cast<Kind>(theirs.kind)), theirs.count, Name(static_cast<DType>(theirs.dtype)),
        Name(static_cast<ReduceOp>(theirs.op)), theirs.root, t.rank(), KindName(static_cast<Kind>(mine.kind)),
        mine.count, Name(static_cast<DType>(mine.dtype)), Name(static_cast<ReduceOp>(mine.op)), mine.root);
  }
  return Status::Ok();
}

struct Chunk {
  size_t offset;  // in elements, within the block
  size_t count;
};

std::vector<Chunk> Chunks(size_t count, size_t element, size_t chunk_bytes) {
  std::vector<Chunk> out;
  const size_t per = std::max<size_t>(1, chunk_bytes / element);
  for (size_t off = 0; off < count; off += per) out.push_back({off, std::min(per, count - off)});
  return out;
}

// One ring step: send [send_off, +send_count) to the right; receive
// [recv_off, +recv_count) from the left, either into `data` (copy) or into
// `scratch` and reduced into `data` (reduce).
Status RingStep(Transport& t, char* data, size_t send_off, size_t send_count, size_t recv_off, size_t recv_count,
                size_t element, char* scratch, bool reduce, DType dtype, ReduceOp op, const CollectiveOptions& options,
                const char* what, int step) {
  const int right = Mod(t.rank() + 1, t.size());
  const int left = Mod(t.rank() - 1, t.size());
  const auto recv_chunks = Chunks(recv_count, element, options.chunk_bytes);
  const auto send_chunks = Chunks(send_count, element, options.chunk_bytes);
  std::vector<std::unique_ptr<Request>> recvs;
  std::vector<std::unique_ptr<Request>> sends;
  for (const auto& c : recv_chunks) {
    char* dst = reduce ? scratch + c.offset * element : data + (recv_off + c.offset) * element;
    recvs.push_back(t.Recv(left, options.tag, dst, c.count * element));
  }
  for (const auto& c : send_chunks) {
    sends.push_back(t.Send(right, options.tag, data + (send_off + c.offset) * element, c.count * element));
  }
  Status status;
  for (size_t i = 0; i < recv_chunks.size() && status.ok(); ++i) {
    status = recvs[i]->Wait(options.timeout);
    if (status.ok() && reduce) {
      const auto& c = recv_chunks[i];
      Reduce(data + (recv_off + c.offset) * element, scratch + c.offset * element, c.count, dtype, op);
    }
  }
  for (auto& s : sends) {
    const Status sent = s->Wait(options.timeout);
    if (status.ok()) status = sent;
  }
  return status.WithContext(fmt::format("{} step {} on rank {}", what, step, t.rank()));
}

// The reduce-scatter half of the ring over `data` cut into size blocks; on
// return, rank r holds the full reduction of block (r + shift) mod size.
Status RingReduceScatter(Transport& t, char* data, size_t count, DType dtype, ReduceOp op, int shift,
                         const CollectiveOptions& options) {
  const int n = t.size();
  const int r = t.rank();
  const size_t element = SizeOf(dtype);
  std::vector<char> scratch((count / static_cast<size_t>(n) + 1) * element);
  for (int s = 0; s < n - 1; ++s) {
    const int send_block = Mod(r - s + shift - 1, n);
    const int recv_block = Mod(r - s + shift - 2, n);
    TANDEM_RETURN_IF_ERROR(RingStep(t, data, BlockOffset(count, n, send_block), BlockSize(count, n, send_block),
                                    BlockOffset(count, n, recv_block), BlockSize(count, n, recv_block), element,
                                    scratch.data(), true, dtype, op, options, "reduce-scatter", s));
  }
  return Status::Ok();
}

// The all-gather half: rank r starts holding block (r + shift) mod size.
Status RingAllGather(Transport& t, char* data, size_t count, DType dtype, int shift, const CollectiveOptions& options) {
  const int n = t.size();
  const int r = t.rank();
  const size_t element = SizeOf(dtype);
  for (int s = 0; s < n - 1; ++s) {
    const int send_block = Mod(r - s + shift, n);
    const int recv_block = Mod(r - s + shift - 1, n);
    TANDEM_RETURN_IF_ERROR(RingStep(t, data, BlockOffset(count, n, send_block), BlockSize(count, n, send_block),
                                    BlockOffset(count, n, recv_block), BlockSize(count, n, recv_block), element,
                                    nullptr, false, dtype, ReduceOp::kSum, options, "all-gather", s));
  }
  return Status::Ok();
}

Descriptor Describe(Kind kind, size_t count, DType dtype, ReduceOp op, int root) {
  Descriptor d{};
  d.kind = static_cast<uint32_t>(kind);
  d.dtype = static_cast<uint8_t>(dtype);
  d.op = static_cast<uint8_t>(op);
  d.root = static_cast<uint16_t>(root);
  d.count = count;
  return d;
}

}  // namespace

Status AllReduce(Transport& t, void* data, size_t count, DType dtype, ReduceOp op, const CollectiveOptions& options) {
  const int n = t.size();
  if (n == 1) {
    return Status::Ok();  // avg over one rank is the identity
  }
  TANDEM_RETURN_IF_ERROR(CheckNeighbours(t, Describe(Kind::kAllReduce, count, dtype, op, 0), options));
  auto* bytes = static_cast<char*>(data);
  // After the reduce-scatter rank r owns block (r + 1) mod n.
  TANDEM_RETURN_IF_ERROR(RingReduceScatter(t, bytes, count, dtype, op, /*shift=*/1, options));
  if (op == ReduceOp::kAvg) {
    const int owned = Mod(t.rank() + 1, n);
    Divide(bytes + BlockOffset(count, n, owned) * SizeOf(dtype), BlockSize(count, n, owned), dtype, n);
  }
  return RingAllGather(t, bytes, count, dtype, /*shift=*/1, options);
}

Status ReduceScatter(Transport& t, const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                     const CollectiveOptions& options) {
  const int n = t.size();
  const size_t element = SizeOf(dtype);
  if (n == 1) {
    if (count > 0) std::memcpy(out, in, count * element);
    return Status::Ok();
  }
  TANDEM_RETURN_IF_ERROR(CheckNeighbours(t, Describe(Kind::kReduceScatter, count, dtype, op, 0), options));
  const size_t total = count * static_cast<size_t>(n);
  std::vector<char> work(static_cast<const char*>(in), static_cast<const char*>(in) + total * element);
  // Blocks of exactly `count`: block b is rank b's; shift 0 leaves rank r owning block r.
  TANDEM_RETURN_IF_ERROR(RingReduceScatter(t, work.data(), total, dtype, op, /*shift=*/0, options));
  const size_t offset = BlockOffset(total, n, t.rank());
  if (op == ReduceOp::kAvg) Divide(work.data() + offset * element, count, dtype, n);
  if (count > 0) std::memcpy(out, work.data() + offset * element, count * element);
  return Status::Ok();
}

Status AllGather(Transport& t, const void* in, void* out, size_t count, DType dtype, const CollectiveOptions& options) {
  const int n = t.size();
  const size_t element = SizeOf(dtype);
  auto* bytes = static_cast<char*>(out);
  if (count > 0) std::memcpy(bytes + static_cast<size_t>(t.rank()) * count * element, in, count * element);
  if (n == 1) return Status::Ok();
  TANDEM_RETURN_IF_ERROR(CheckNeighbours(t, Describe(Kind::kAllGather, count, dtype, ReduceOp::kSum, 0), options));
  // Rank r starts with block r: shift 0.
  return RingAllGather(t, bytes, count * static_cast<size_t>(n), dtype, /*shift=*/0, options);
}

Status Broadcast(Transport& t, void* data, size_t count, DType dtype, int root, const CollectiveOptions& options) {
  const int n = t.size();
  if (root < 0 || root >= n) return InvalidArgument("broadcast root {} is not a rank of a group of {}", root, n);
  if (n == 1) return Status::Ok();
  TANDEM_RETURN_IF_ERROR(CheckNeighbours(t, Describe(Kind::kBroadcast, count, dtype, ReduceOp::kSum, root), options));
  // A chain root -> root+1 -> ... -> root-1, pipelined by chunks: each rank
  // forwards a chunk as soon as it has it.
  const size_t element = SizeOf(dtype);
  auto* bytes = static_cast<char*>(data);
  const int position = Mod(t.rank() - root, n);
  const int left = Mod(t.rank() - 1, n);
  const int right = Mod(t.rank() + 1, n);
  const auto chunks = Chunks(count, element, options.chunk_bytes);
  std::vector<std::unique_ptr<Request>> recvs;
  std::vector<std::unique_ptr<Request>> sends;
  if (position != 0) {
    for (const auto& c : chunks)
      recvs.push_back(t.Recv(left, options.tag, bytes + c.offset * element, c.count * element));
  }
  Status status;
  for (size_t i = 0; i < chunks.size() && status.ok(); ++i) {
    if (position != 0) status = recvs[i]->Wait(options.timeout);
    if (status.ok() && position != n - 1) {
      sends.push_back(t.Send(right, options.tag, bytes + chunks[i].offset * element, chunks[i].count * element));
    }
  }
  for (auto& s : sends) {
    const Status sent = s->Wait(options.timeout);
    if (status.ok()) status = sent;
  }
  return status.WithContext(fmt::format("broadcast from rank {} on rank {}", root, t.rank()));
}

Status Barrier(Transport& t, const CollectiveOptions& options) {
  int32_t token = 1;
  return AllReduce(t, &token, 1, DType::kInt32, ReduceOp::kSum, options).WithContext("barrier");
}

}  // namespace tandem::collectives
