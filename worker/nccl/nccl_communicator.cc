#include "worker/nccl/nccl_communicator.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <thread>
#include <utility>

#include <spdlog/spdlog.h>

#if TANDEM_CUDA_ENABLED
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

namespace tandem::gpu {

using comm::DType;
using comm::Kind;
using comm::ReduceOp;

// NCCL's enum values, spelled out so that the mapping also exists (and is
// tested) without CUDA; checked against nccl.h where it is available.
namespace {

constexpr int kNcclInt32 = 2;
constexpr int kNcclInt64 = 4;
constexpr int kNcclFloat16 = 6;
constexpr int kNcclFloat32 = 7;
constexpr int kNcclBfloat16 = 9;
constexpr int kNcclSum = 0;
constexpr int kNcclMax = 2;
constexpr int kNcclMin = 3;
constexpr int kNcclAvg = 4;

#if TANDEM_CUDA_ENABLED
static_assert(kNcclInt32 == ncclInt32 && kNcclInt64 == ncclInt64 && kNcclFloat16 == ncclFloat16 &&
              kNcclFloat32 == ncclFloat32 && kNcclBfloat16 == ncclBfloat16);
static_assert(kNcclSum == ncclSum && kNcclMax == ncclMax && kNcclMin == ncclMin && kNcclAvg == ncclAvg);
#endif

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

Result<int> ToNcclDataType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return kNcclFloat32;
    case DType::kFloat16:
      return kNcclFloat16;
    case DType::kBFloat16:
      return kNcclBfloat16;
    case DType::kInt32:
      return kNcclInt32;
    case DType::kInt64:
      return kNcclInt64;
  }
  return InvalidArgument("dtype {} has no NCCL equivalent", static_cast<int>(dtype));
}

Result<int> ToNcclRedOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return kNcclSum;
    case ReduceOp::kAvg:
      return kNcclAvg;
    case ReduceOp::kMin:
      return kNcclMin;
    case ReduceOp::kMax:
      return kNcclMax;
  }
  return InvalidArgument("reduction op {} has no NCCL equivalent", static_cast<int>(op));
}

std::string NcclUniqueIdKey(const comm::CommInfo& info) {
  return fmt::format("nccl/{}/{}", info.name, info.epoch);
}

std::string HexEncode(std::string_view bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(bytes.size() * 2);
  for (const char c : bytes) {
    const auto b = static_cast<unsigned char>(c);
    hex += kDigits[b >> 4];
    hex += kDigits[b & 0xf];
  }
  return hex;
}

Result<std::string> HexDecode(std::string_view hex) {
  if (hex.size() % 2 != 0) return InvalidArgument("hex text has an odd length ({})", hex.size());
  std::string bytes;
  bytes.reserve(hex.size() / 2);
  for (size_t i = 0; i < hex.size(); i += 2) {
    const int hi = HexValue(hex[i]);
    const int lo = HexValue(hex[i + 1]);
    if (hi < 0 || lo < 0) return InvalidArgument("hex text has a non-hex character at offset {}", hi < 0 ? i : i + 1);
    bytes += static_cast<char>((hi << 4) | lo);
  }
  return bytes;
}

std::string NcclCommunicator::Where() const {
  return fmt::format("NCCL communicator \"{}\" of epoch {} on rank {} of {}", name(), epoch(), rank(), size());
}

std::string NcclCommunicator::Describe(const OpName* op) const {
  if (op == nullptr) return "initialisation";
  if (op->kind == Kind::kSend) return fmt::format("send to rank {}", op->peer);
  if (op->kind == Kind::kRecv) return fmt::format("recv from rank {}", op->peer);
  return fmt::format("{} seq {}", comm::KindName(op->kind), op->seq);
}

#if TANDEM_CUDA_ENABLED

namespace {

using Clock = std::chrono::steady_clock;

constexpr auto kFirstPause = std::chrono::microseconds(20);
constexpr auto kLongestPause = std::chrono::microseconds(1000);

// CUDA's text for an error, clearing it unless it is sticky.
std::string CudaError(cudaError_t err) {
  cudaGetLastError();
  return fmt::format("{} ({})", cudaGetErrorString(err), cudaGetErrorName(err));
}

// "unhandled system error (...): <NCCL's last error>" for a failed call.
std::string NcclError(ncclResult_t result, ncclComm_t nccl) {
  std::string text = ncclGetErrorString(result);
  const char* last = ncclGetLastError(nccl);
  if (last != nullptr && *last != '\0') text += fmt::format(": {}", last);
  return text;
}

// The status code for a failed NCCL call: a peer or the network is gone
// (UNAVAILABLE), NCCL rejected the arguments (INVALID_ARGUMENT), else
// something is wrong here (INTERNAL).
StatusCode NcclCode(ncclResult_t result) {
  switch (result) {
    case ncclSystemError:
    case ncclRemoteError:
      return StatusCode::kUnavailable;
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return StatusCode::kInvalidArgument;
    default:
      return StatusCode::kInternal;
  }
}

// Makes `device` current on this thread. Never restores the previous device:
// a thread that has not chosen one reports device 0, and making device 0
// current creates a context on it.
Status UseDevice(int device) {
  if (const cudaError_t err = cudaSetDevice(device); err != cudaSuccess) {
    return Unavailable("cannot use CUDA device {}: {}", device, CudaError(err));
  }
  return Status::Ok();
}

}  // namespace

class NcclCommunicator::Enqueue {
 public:
  explicit Enqueue(std::function<ncclResult_t(ncclComm_t, cudaStream_t)> call) : call_(std::move(call)) {}
  ncclResult_t operator()(ncclComm_t nccl, cudaStream_t stream) const { return call_(nccl, stream); }

 private:
  std::function<ncclResult_t(ncclComm_t, cudaStream_t)> call_;
};

NcclCommunicator::NcclCommunicator(comm::CommInfo info, int device) : Communicator(std::move(info)), device_(device) {}

Result<std::unique_ptr<comm::Communicator>> NcclCommunicator::Create(comm::CommInfo info, comm::Rendezvous& rendezvous,
                                                                     const NcclOptions& options) {
  if (info.size < 1 || info.rank < 0 || info.rank >= info.size) {
    return InvalidArgument("NCCL communicator \"{}\": rank {} is not a rank of a group of {}", info.name, info.rank,
                           info.size);
  }
  if (info.timeout.count() <= 0) {
    return InvalidArgument("NCCL communicator \"{}\": the timeout must be positive, not {} ms", info.name,
                           info.timeout.count());
  }
  const std::string where =
      fmt::format("NCCL communicator \"{}\" of epoch {} on rank {} of {}", info.name, info.epoch, info.rank, info.size);
  int devices = 0;
  if (const cudaError_t err = cudaGetDeviceCount(&devices); err != cudaSuccess) {
    return Unavailable("cannot create {}: {}", where, CudaError(err));
  }
  if (devices == 0) return Unavailable("cannot create {}: no CUDA device is visible", where);
  int device = options.device;
  if (device < 0) {
    if (options.local_rank < 0) {
      return InvalidArgument("cannot create {}: local rank {} is negative", where, options.local_rank);
    }
    device = options.local_rank % devices;
  }
  if (device >= devices) {
    return InvalidArgument("cannot create {}: CUDA device {} does not exist ({} visible)", where, device, devices);
  }

  std::unique_ptr<NcclCommunicator> self(new NcclCommunicator(std::move(info), device));
  TANDEM_RETURN_IF_ERROR(self->SetUp());

  const std::string key = NcclUniqueIdKey(self->info());
  std::string unique_id;
  if (self->rank() == 0) {
    ncclUniqueId id;
    if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
      return Status(NcclCode(r), fmt::format("cannot create {}: ncclGetUniqueId: {}", where, NcclError(r, nullptr)));
    }
    unique_id.assign(id.internal, sizeof(id.internal));
    TANDEM_RETURN_IF_ERROR(rendezvous.Put(key, HexEncode(unique_id)).WithContext("cannot create " + where));
  } else {
    auto hex = rendezvous.Get(key, self->timeout());
    if (!hex.ok()) return hex.status().WithContext("cannot create " + where);
    auto bytes = HexDecode(*hex);
    if (!bytes.ok() || bytes->size() != sizeof(ncclUniqueId)) {
      return InvalidArgument("cannot create {}: rendezvous key {} does not hold an NCCL unique id ({} characters)",
                             where, key, hex->size());
    }
    unique_id = std::move(bytes).value();
  }
  TANDEM_RETURN_IF_ERROR(self->InitNccl(unique_id));
  spdlog::debug("{} is ready on CUDA device {}", where, device);
  return std::unique_ptr<comm::Communicator>(std::move(self));
}

Status NcclCommunicator::SetUp() {
  TANDEM_RETURN_IF_ERROR(UseDevice(device_).WithContext("cannot create " + Where()));
  cudaStream_t stream = nullptr;
  // A blocking stream: it waits for what the caller queued on the legacy
  // default stream (cudaMemcpy, cudaMemset, kernels launched without a
  // stream) before a collective starts, and such work queued after waits
  // for the collective, as a call that takes no stream should behave.
  if (const cudaError_t err = cudaStreamCreateWithFlags(&stream, cudaStreamDefault); err != cudaSuccess) {
    return Unavailable("cannot create {}: cudaStreamCreateWithFlags on device {}: {}", Where(), device_,
                       CudaError(err));
  }
  stream_ = stream;
  void* barrier = nullptr;
  if (const cudaError_t err = cudaMalloc(&barrier, sizeof(int32_t)); err != cudaSuccess) {
    return Unavailable("cannot create {}: cudaMalloc on device {}: {}", Where(), device_, CudaError(err));
  }
  barrier_ = static_cast<int32_t*>(barrier);
  if (const cudaError_t err = cudaMemset(barrier_, 0, sizeof(int32_t)); err != cudaSuccess) {
    return Unavailable("cannot create {}: cudaMemset on device {}: {}", Where(), device_, CudaError(err));
  }
  return Status::Ok();
}

Status NcclCommunicator::InitNccl(const std::string& unique_id) {
  TANDEM_RETURN_IF_ERROR(UseDevice(device_).WithContext("cannot create " + Where()));
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t nccl = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&nccl, size(), id, rank(), &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    const std::string error = NcclError(r, nccl);
    if (nccl != nullptr) ncclCommAbort(nccl);
    return Status(NcclCode(r), fmt::format("cannot create {}: ncclCommInitRankConfig: {}", Where(), error));
  }
  Status status = Wait(nullptr, nccl, /*query_stream=*/false);
  MutexLock lock(&nccl_mu_);
  nccl_ = nccl;
  if (!status.ok()) {
    AbortNcclLocked();
    return status.WithContext("cannot create " + Where());
  }
  return Status::Ok();
}

Status NcclCommunicator::Wait(const OpName* op, ncclComm_t nccl, bool query_stream) {
  const auto deadline = Clock::now() + timeout();
  auto pause = std::chrono::duration_cast<std::chrono::microseconds>(kFirstPause);
  while (true) {
    if (aborted()) return health();
    ncclResult_t state = ncclSuccess;
    if (const ncclResult_t r = ncclCommGetAsyncError(nccl, &state); r != ncclSuccess) state = r;
    if (state != ncclSuccess && state != ncclInProgress) {
      return Status(NcclCode(state),
                    fmt::format("{} failed on rank {}: NCCL: {}", Describe(op), rank(), NcclError(state, nccl)));
    }
    if (state == ncclSuccess) {
      if (!query_stream) return Status::Ok();
      const cudaError_t err = cudaStreamQuery(stream_);
      if (err == cudaSuccess) return Status::Ok();
      if (err != cudaErrorNotReady) {
        return Internal("{} failed on rank {}: CUDA error on device {}: {}", Describe(op), rank(), device_,
                        CudaError(err));
      }
    }
    if (Clock::now() >= deadline) {
      if (op == nullptr) {
        return DeadlineExceeded(
            "NCCL initialisation did not complete within {} ms on rank {}: a rank did not join (NCCL cannot say "
            "which); NCCL communicator aborted",
            timeout().count(), rank());
      }
      return DeadlineExceeded(
          "communicator \"{}\" of epoch {}: {} did not complete within {} ms on rank {}; NCCL communicator aborted",
          name(), epoch(), Describe(op), timeout().count(), rank());
    }
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(pause * 2, kLongestPause);
  }
}

Status NcclCommunicator::Run(const OpName& op, const Enqueue& enqueue) {
  ncclComm_t nccl = nullptr;
  {
    MutexLock lock(&nccl_mu_);
    if (aborted()) return health();
    if (nccl_ == nullptr) return FailedPrecondition("{}: the NCCL communicator is gone", Where());
    nccl = nccl_;
    in_flight_ = true;
  }
  Status status = UseDevice(device_);
  if (status.ok()) {
    const ncclResult_t r = enqueue(nccl, stream_);
    if (r == ncclSuccess || r == ncclInProgress) {
      status = Wait(&op, nccl, /*query_stream=*/true);
    } else {
      status =
          Status(NcclCode(r), fmt::format("{} failed on rank {}: NCCL: {}", Describe(&op), rank(), NcclError(r, nccl)));
    }
  }
  MutexLock lock(&nccl_mu_);
  in_flight_ = false;
  // An abort that came in while the operation ran was left to this thread.
  if ((!status.ok() || aborted()) && nccl_ != nullptr) AbortNcclLocked();
  return status;
}

void NcclCommunicator::AbortNcclLocked() {
  if (nccl_ == nullptr) return;
  ncclComm_t nccl = std::exchange(nccl_, nullptr);
  if (Status s = UseDevice(device_); !s.ok()) spdlog::warn("{}: {}", Where(), s.message());
  ncclResult_t r = ncclCommAbort(nccl);
  // ncclCommAbort blocks in the NCCL versions Tandem builds with; older ones
  // may report it in progress, to be polled like any non-blocking call.
  const auto deadline = Clock::now() + timeout();
  while (r == ncclInProgress && Clock::now() < deadline) {
    std::this_thread::sleep_for(kLongestPause);
    if (ncclCommGetAsyncError(nccl, &r) != ncclSuccess) break;
  }
  if (r != ncclSuccess) spdlog::warn("{}: ncclCommAbort: {}", Where(), NcclError(r, nullptr));
}

void NcclCommunicator::OnAbort() {
  MutexLock lock(&nccl_mu_);
  // With an operation in flight its thread sees aborted() and aborts NCCL.
  if (!in_flight_) AbortNcclLocked();
}

NcclCommunicator::~NcclCommunicator() {
  if (stream_ != nullptr) (void)UseDevice(device_);  // SetUp got this far: the device works
  {
    MutexLock lock(&nccl_mu_);
    if (nccl_ != nullptr && health().ok()) {
      // Flush and release gracefully, bounded by the timeout.
      ncclResult_t r = ncclCommFinalize(nccl_);
      const auto deadline = Clock::now() + timeout();
      auto pause = std::chrono::duration_cast<std::chrono::microseconds>(kFirstPause);
      while (r == ncclInProgress && Clock::now() < deadline) {
        std::this_thread::sleep_for(pause);
        pause = std::min<std::chrono::microseconds>(pause * 2, kLongestPause);
        if (ncclCommGetAsyncError(nccl_, &r) != ncclSuccess) r = ncclInternalError;
      }
      if (r == ncclSuccess) {
        r = ncclCommDestroy(std::exchange(nccl_, nullptr));
        if (r != ncclSuccess && r != ncclInProgress) {
          spdlog::warn("{}: ncclCommDestroy: {}", Where(), NcclError(r, nullptr));
        }
      } else {
        spdlog::warn(
            "{}: ncclCommFinalize did not complete ({}); aborting it", Where(),
            r == ncclInProgress ? fmt::format("still running after {} ms", timeout().count()) : NcclError(r, nullptr));
      }
    }
    AbortNcclLocked();  // a no-op once destroyed
  }
  if (barrier_ != nullptr) cudaFree(barrier_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  cudaGetLastError();
}

Status NcclCommunicator::DoAllReduce(uint64_t seq, const void* in, void* out, size_t count, DType dtype, ReduceOp op) {
  if (count == 0) return Status::Ok();
  TANDEM_ASSIGN_OR_RETURN(const int type, ToNcclDataType(dtype));
  TANDEM_ASSIGN_OR_RETURN(const int red, ToNcclRedOp(op));
  return Run({Kind::kAllReduce, seq}, Enqueue([&](ncclComm_t nccl, cudaStream_t stream) {
               return ncclAllReduce(in, out, count, static_cast<ncclDataType_t>(type), static_cast<ncclRedOp_t>(red),
                                    nccl, stream);
             }));
}

Status NcclCommunicator::DoReduceScatter(uint64_t seq, const void* in, void* out, size_t count, DType dtype,
                                         ReduceOp op) {
  if (count == 0) return Status::Ok();
  TANDEM_ASSIGN_OR_RETURN(const int type, ToNcclDataType(dtype));
  TANDEM_ASSIGN_OR_RETURN(const int red, ToNcclRedOp(op));
  return Run({Kind::kReduceScatter, seq}, Enqueue([&](ncclComm_t nccl, cudaStream_t stream) {
               return ncclReduceScatter(in, out, count, static_cast<ncclDataType_t>(type),
                                        static_cast<ncclRedOp_t>(red), nccl, stream);
             }));
}

Status NcclCommunicator::DoAllGather(uint64_t seq, const void* in, void* out, size_t count, DType dtype) {
  if (count == 0) return Status::Ok();
  TANDEM_ASSIGN_OR_RETURN(const int type, ToNcclDataType(dtype));
  return Run({Kind::kAllGather, seq}, Enqueue([&](ncclComm_t nccl, cudaStream_t stream) {
               return ncclAllGather(in, out, count, static_cast<ncclDataType_t>(type), nccl, stream);
             }));
}

Status NcclCommunicator::DoBroadcast(uint64_t seq, void* data, size_t count, DType dtype, int root) {
  if (count == 0) return Status::Ok();
  TANDEM_ASSIGN_OR_RETURN(const int type, ToNcclDataType(dtype));
  return Run({Kind::kBroadcast, seq}, Enqueue([&](ncclComm_t nccl, cudaStream_t stream) {
               return ncclBroadcast(data, data, count, static_cast<ncclDataType_t>(type), root, nccl, stream);
             }));
}

Status NcclCommunicator::DoReduce(uint64_t seq, const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                                  int root) {
  if (count == 0) return Status::Ok();
  TANDEM_ASSIGN_OR_RETURN(const int type, ToNcclDataType(dtype));
  TANDEM_ASSIGN_OR_RETURN(const int red, ToNcclRedOp(op));
  // NCCL ignores the output buffer (which may be null) on ranks other than root.
  return Run({Kind::kReduce, seq}, Enqueue([&](ncclComm_t nccl, cudaStream_t stream) {
               return ncclReduce(in, out, count, static_cast<ncclDataType_t>(type), static_cast<ncclRedOp_t>(red), root,
                                 nccl, stream);
             }));
}

Status NcclCommunicator::DoBarrier(uint64_t seq) {
  return Run({Kind::kBarrier, seq}, Enqueue([&](ncclComm_t nccl, cudaStream_t stream) {
               return ncclAllReduce(barrier_, barrier_, 1, ncclInt32, ncclSum, nccl, stream);
             }));
}

namespace {

// One send or recv in its own group, closing the group whatever happens.
ncclResult_t Grouped(const std::function<ncclResult_t()>& call) {
  const ncclResult_t start = ncclGroupStart();
  if (start != ncclSuccess) return start;
  const ncclResult_t r = call();
  const ncclResult_t end = ncclGroupEnd();
  return r != ncclSuccess ? r : end;
}

}  // namespace

Status NcclCommunicator::DoSend(int peer, const void* data, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  return Run({Kind::kSend, 0, peer}, Enqueue([&](ncclComm_t nccl, cudaStream_t stream) {
               return Grouped([&] { return ncclSend(data, bytes, ncclInt8, peer, nccl, stream); });
             }));
}

Status NcclCommunicator::DoRecv(int peer, void* data, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  return Run({Kind::kRecv, 0, peer}, Enqueue([&](ncclComm_t nccl, cudaStream_t stream) {
               return Grouped([&] { return ncclRecv(data, bytes, ncclInt8, peer, nccl, stream); });
             }));
}

#else  // !TANDEM_CUDA_ENABLED

namespace {

Status NoCuda() {
  return FailedPrecondition("this build of Tandem has no CUDA support (configure with -DTANDEM_WITH_CUDA=ON)");
}

}  // namespace

Result<std::unique_ptr<comm::Communicator>> NcclCommunicator::Create(comm::CommInfo info, comm::Rendezvous&,
                                                                     const NcclOptions&) {
  return NoCuda().WithContext(
      fmt::format("cannot create NCCL communicator \"{}\" of epoch {} on rank {}", info.name, info.epoch, info.rank));
}

NcclCommunicator::NcclCommunicator(comm::CommInfo info, int device) : Communicator(std::move(info)), device_(device) {}
NcclCommunicator::~NcclCommunicator() = default;

Status NcclCommunicator::DoAllReduce(uint64_t, const void*, void*, size_t, DType, ReduceOp) {
  return NoCuda();
}
Status NcclCommunicator::DoReduceScatter(uint64_t, const void*, void*, size_t, DType, ReduceOp) {
  return NoCuda();
}
Status NcclCommunicator::DoAllGather(uint64_t, const void*, void*, size_t, DType) {
  return NoCuda();
}
Status NcclCommunicator::DoBroadcast(uint64_t, void*, size_t, DType, int) {
  return NoCuda();
}
Status NcclCommunicator::DoReduce(uint64_t, const void*, void*, size_t, DType, ReduceOp, int) {
  return NoCuda();
}
Status NcclCommunicator::DoBarrier(uint64_t) {
  return NoCuda();
}
Status NcclCommunicator::DoSend(int, const void*, size_t) {
  return NoCuda();
}
Status NcclCommunicator::DoRecv(int, void*, size_t) {
  return NoCuda();
}
void NcclCommunicator::OnAbort() {}

#endif  // TANDEM_CUDA_ENABLED

}  // namespace tandem::gpu
